#!/usr/bin/env bash
# The GPU check of issue 34 in one bounded call, on a machine with an NVIDIA GPU, a CUDA PyTorch,
# pytest, numpy and safetensors, and no Rust toolchain: everything compiled comes from the bundle
# `scripts/gpu-bundle.sh` built (`make gpu-bundle`). Steps, each under its own time limit and
# all within GPU_CHECK_SECONDS (default 480):
#
#   1. the machine: GPU, driver, torch, CPUs
#   2. the Rust GPU tests (staged uploads, device loads, NCCL at world 1; they print `skipped:`
#      where they cannot run)
#   3. the package's CUDA tests (python/tests -k cuda) with the bundle's wheel and CLI
#   4. benches/gpu.rs: H2D through tessera's pinned staging vs one plain pinned copy, and an
#      end-to-end load into device memory
#   5. benches/gpu_check.py: CUDA DTensors over 4 gloo ranks vs dcp.load (bytes equal, a flipped
#      byte caught), torch's own H2D rates, one-process loads vs dcp.load / safetensors, the
#      async_save stall vs dcp.async_save, NCCL at world 1
#
# Writes OUT/gpu-check.log, OUT/steps.json (each step's exit status and seconds) and
# OUT/gpu_check.json. Exits 0 when every step passed, 1 otherwise.
#
# With the device tool (from the repository root here):
#   make gpu-bundle
#   run(command="scripts/gpu-check.sh", carry=["target/gpu-bundle"], timeout_s=560)
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-target/gpu-bundle}
OUT=${OUT:-target/gpu-check-out}
BUDGET=${GPU_CHECK_SECONDS:-480}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/tessera-gpu-check.XXXXXX)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
started=$(date +%s)
failed=0
steps=()

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND under min(LIMIT, what is left of the budget).
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET - ($(date +%s) - started)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name: not run (the ${BUDGET} s budget is spent)"
    steps+=("{\"step\": \"$name\", \"status\": \"not run: budget spent\"}")
    failed=1
    return
  fi
  echo "== $name (at most ${limit} s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  [ $rc -ne 0 ] && failed=1
  echo "== $name: exit $rc after $(($(date +%s) - t0)) s"
  steps+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $(($(date +%s) - t0))}")
}

step machine 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uname -r; nproc; free -g | head -2; $PYTHON -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())'"

step unpack 60 bash -c "tar -C '$WORK' -xJf '$BUNDLE/bin.tar.xz' && $PYTHON -m pip install -q --no-index --no-deps --no-compile --target '$WORK/site' '$BUNDLE'/tessera-*.whl && ls -la '$WORK/bin'"
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
# The CLI for the Python tests and for the Rust tests that run it (their build tree is not here).
export TESSERA_BIN="$WORK/bin/tessera" TESSERA_TEST_BIN="$WORK/bin/tessera"
export TESSERA_DCP_FIXTURES="$PWD/$BUNDLE/fixtures/dcp"

for test in "$WORK"/bin/test-*; do
  [ -e "$test" ] || continue
  step "rust $(basename "$test")" 120 "$test" --test-threads=1 --nocapture
done

step "python cuda tests" 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
  python/tests/test_torch.py python/tests/test_async_save.py python/tests/test_errors.py -k "cuda or CUDA"

for bench in "$WORK"/bin/bench-*; do
  [ -e "$bench" ] || continue
  step "rust $(basename "$bench")" 120 env TESSERA_BENCH_H2D_MB=${TESSERA_BENCH_H2D_MB:-2048} "$bench" --bench
done

# GPU_CHECK_ARGS: other sizes (a CPU dry run here: "--gb 0.25 --save-gb 0.1 --reps 1").
# shellcheck disable=SC2086
step "gpu_check.py" 300 "$PYTHON" benches/gpu_check.py --out "$OUT" --work "$WORK/gpu-check" \
  ${GPU_CHECK_ARGS:---gb 4 --save-gb 1 --reps 3}

rm -rf "$WORK"
{
  echo "{\"budget_seconds\": $BUDGET, \"seconds\": $(($(date +%s) - started)), \"failed\": $failed, \"steps\": ["
  (IFS=,; echo "${steps[*]}")
  echo "]}"
} > "$OUT/steps.json"
echo "== done after $(($(date +%s) - started)) s; failed: $failed"
sleep 1  # the log's tee writes its last lines before the call collects OUT
exit $failed

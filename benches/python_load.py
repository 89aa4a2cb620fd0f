"""Python-side overhead of `tessera.load`: the same checkpoint and layout loaded by the Rust CLI
(`tessera load`) and by `tessera.load` into NumPy arrays, in one run, on one machine.

The checkpoint is synthetic gpt-small with optimizer states (about 2.3 GB) saved FSDP over 4 ranks;
the target is the whole model on one rank (every tensor whole), so both read every byte once and
neither exchanges. Each repetition runs each side in a fresh process (the CLI allocates its own
buffers, Python `numpy.empty` arrays: both pay for first-touch page faults alike; a long-lived
Python process reusing freed heap memory would not, and would look faster than it is).

Three times per side: the whole process (start, imports, open, plan, load), the load itself
(Python: the `tessera.load` call, array allocation excluded; CLI: its report's total), and the
loader's own total as reported by each. Python-side overhead = Python call / CLI load.

Run with `make python-bench` (release builds of the CLI and the module). Prints a table for
BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
CLI = Path(os.environ.get("TESSERA_BIN", TARGET / "release" / "tessera"))
REPEATS = int(os.environ.get("REPEATS", "5"))
MODEL = os.environ.get("MODEL", "gpt-small")

# One repetition of the Python side, in a fresh interpreter.
PY_RUN = r"""
import json, sys, time
t0 = time.perf_counter()
import ml_dtypes, numpy as np, tessera
NUMPY = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64,
         "i64": np.int64, "i32": np.int32, "u8": np.uint8, "bool": np.bool_}
ckpt, verify = sys.argv[1], sys.argv[2] == "1"
tensors = tessera.inspect(ckpt)["tensors"]
state = {t["fqn"]: np.empty(t["shape"], NUMPY[t["dtype"]]) for t in tensors}
t1 = time.perf_counter()
report = tessera.load(ckpt, state, verify=verify, progress=False)
t2 = time.perf_counter()
print(json.dumps({"call": t2 - t1, "setup": t1 - t0, "loader": report["total_seconds"]}))
"""


def cli(*args: str) -> str:
    return subprocess.run([str(CLI), *args], check=True, capture_output=True, text=True).stdout


def run_cli(ckpt: Path, layout: Path, verify: bool) -> dict:
    args = ["load", str(ckpt), "--layout", str(layout)] + ([] if verify else ["--no-verify"])
    t0 = time.perf_counter()
    out = cli(*args)
    wall = time.perf_counter() - t0
    total = re.search(r"total ([0-9.]+) s", out)
    if total is None:
        raise SystemExit(f"no total in the CLI's report:\n{out}")
    return {"wall": wall, "load": float(total.group(1))}


def run_python(ckpt: Path, verify: bool) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PY_RUN, str(ckpt), "1" if verify else "0"],
        check=True, capture_output=True, text=True,
    ).stdout
    wall = time.perf_counter() - t0
    doc = json.loads(out)
    return {"wall": wall, "load": doc["call"], "loader": doc["loader"]}


def main() -> None:
    import tessera  # noqa: F401  (fail early when the module is not built)

    with tempfile.TemporaryDirectory(prefix="tessera-pybench-") as tmp:
        tmp = Path(tmp)
        (tmp / "saved.json").write_text(cli("layout", "fsdp", "--dp", "4"))
        whole = tmp / "whole.json"
        whole.write_text(cli("layout", "fsdp", "--dp", "1"))
        ckpt = tmp / "ckpt"
        started = time.perf_counter()
        cli("synth", "--model", MODEL, "--layout", str(tmp / "saved.json"), "--out", str(ckpt))
        print(f"synth {MODEL} with optimizer states: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        total = sum(f.stat().st_size for f in (ckpt / "data").iterdir())
        run_cli(ckpt, whole, True)  # warm the page cache: both sides then read from memory
        runs: dict = {k: [] for k in ("cli", "py", "cli_nv", "py_nv")}
        for _ in range(REPEATS):
            runs["cli"].append(run_cli(ckpt, whole, True))
            runs["py"].append(run_python(ckpt, True))
            runs["cli_nv"].append(run_cli(ckpt, whole, False))
            runs["py_nv"].append(run_python(ckpt, False))

    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    print(f"{MODEL}, {total / 1e9:.2f} GB of data files, {REPEATS} repetitions each, medians:")
    print("| run | process wall | load | load GB/s | loader's own total | load vs CLI |")
    print("|---|---|---|---|---|---|")
    for name, key, base in [
        ("CLI `tessera load` (verify)", "cli", "cli"),
        ("Python `tessera.load` (verify)", "py", "cli"),
        ("CLI `tessera load --no-verify`", "cli_nv", "cli_nv"),
        ("Python `tessera.load(verify=False)`", "py_nv", "cli_nv"),
    ]:
        rs = runs[key]
        loader = med(rs, "loader") if "loader" in rs[0] else med(rs, "load")
        print(
            f"| {name} | {med(rs, 'wall'):.3f} s | {med(rs, 'load'):.3f} s | "
            f"{total / med(rs, 'load') / 1e9:.2f} | {loader:.3f} s | "
            f"{med(rs, 'load') / med(runs[base], 'load'):.2f}x |"
        )
    print(json.dumps(runs))


if __name__ == "__main__":
    main()

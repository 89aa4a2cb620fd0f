#!/usr/bin/env python3
"""PyTorch's DCP load against `tessera load --device cuda` of the same checkpoint (issue 6).

Needs a CUDA GPU, torch (with CUDA) and a tessera binary built with `--features cuda`. In one run:

1. `tessera synth` writes the checkpoint benches/gpu.rs loads: gpt-small with optimizer states
   (about 2.3 GB), saved as FSDP over 4 ranks, native format.
2. `tessera convert --format safetensors` exports it as whole tensors; torch reads those and
   `dcp.save`s them: the same tensors (names, shapes, dtypes, bytes) in PyTorch DCP format.
3. Every file of both checkpoints is read once (page cache warm), then each load runs --runs
   times (best and median reported):
   - torch: `dcp.load` into a state dict of empty CUDA tensors of the same shapes and dtypes on
     cuda:0 (whole tensors), then `torch.cuda.synchronize()`;
   - tessera: `tessera load <checkpoint> --layout <whole tensors> --device cuda:0` as one rank
     (`--rank 0 --world 1`), of the DCP checkpoint (read in place, no checksums there) and of the
     native one (verified reads); seconds from its report (`--report-json`: total load time, after
     planning and process start) and the command's wall time.
4. Prints a table: GB/s of tensor bytes per second for each, and tessera / torch as a ratio.

Usage:
    cargo build --release --features cuda
    python3 benches/torch_dcp_load.py [--tessera target/release/tessera] [--model gpt-small]
        [--work DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_safetensors(path: Path, torch):
    """The tensors of one safetensors file (whole file read; parsed by hand, so the script needs
    only torch)."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
        start, end = entry["data_offsets"]
        raw = bytearray(data[base + start : base + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(entry["shape"]).clone()
    return out


def warm(paths: list[Path]) -> int:
    total = 0
    for root in paths:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    while chunk := f.read(64 << 20):
                        total += len(chunk)
    return total


def dcp_call(fn, *args, **kwargs):
    """dcp.save / dcp.load without a process group (`no_dist` where this torch has it)."""
    import inspect

    if "no_dist" in inspect.signature(fn).parameters:
        kwargs["no_dist"] = True
    return fn(*args, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tessera", default="target/release/tessera")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--work", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--device",
        default="cuda:0",
        help="cuda:N (the benchmark), or cpu: the same comparison into host memory (a dry run "
        "of this script on a machine without a GPU)",
    )
    args = parser.parse_args()
    on_gpu = args.device != "cpu"

    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError as e:
        print(f"skipped: torch is not installed ({e})")
        return 0
    if on_gpu and not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return 0

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    tessera = str(Path(args.tessera).resolve())
    if not Path(tessera).exists():
        print(f"error: no tessera binary at {tessera}; cargo build --release --features cuda", file=sys.stderr)
        return 1

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tessera-dcp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        native = work / "native" / "run" / "step-000001"
        st = work / "safetensors"
        dcp_dir = work / "dcp" / "run" / "step-000001"
        saved = work / "fsdp4.json"
        whole = work / "whole.json"
        saved.write_text(run([tessera, "layout", "fsdp", "--dp", "4"], capture_output=True, text=True).stdout)
        whole.write_text(run([tessera, "layout", "fsdp", "--dp", "1"], capture_output=True, text=True).stdout)
        if not (native / "manifest.json").exists():
            run([tessera, "synth", "--model", args.model, "--layout", str(saved), "--out", str(native)])
        if not (dcp_dir / ".metadata").exists():
            if not (st / "model.safetensors.index.json").exists():
                run([tessera, "convert", str(native), "--format", "safetensors", "--out", str(st)])
            index = json.loads((st / "model.safetensors.index.json").read_text())
            state = {}
            for shard in sorted(set(index["weight_map"].values())):
                state.update(read_safetensors(st / shard, torch))
            print(f"dcp.save of {len(state)} tensors to {dcp_dir}", flush=True)
            dcp_call(dcp.save, state, checkpoint_id=str(dcp_dir))
            del state

        # The destination layout: whole tensors on cuda:0, shapes and dtypes from the export.
        index = json.loads((st / "model.safetensors.index.json").read_text())
        shapes = {}
        for shard in sorted(set(index["weight_map"].values())):
            with open(st / shard, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = (entry["shape"], getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]]))
        nbytes = sum(
            torch.empty(0, dtype=dtype).element_size() * _numel(shape)
            for shape, dtype in shapes.values()
        )
        warmed = warm([native, dcp_dir])
        print(f"page cache warmed: {warmed / 1e9:.2f} GB read; {nbytes / 1e9:.2f} GB of tensors to load", flush=True)

        def torch_load() -> float:
            state = {
                name: torch.empty(shape, dtype=dtype, device=args.device)
                for name, (shape, dtype) in shapes.items()
            }
            sync()
            started = time.perf_counter()
            dcp_call(dcp.load, state, checkpoint_id=str(dcp_dir))
            sync()
            seconds = time.perf_counter() - started
            del state
            if on_gpu:
                torch.cuda.empty_cache()
            return seconds

        def tessera_load(checkpoint: Path, verify: bool) -> tuple[float, float]:
            report = work / "report.json"
            cmd = [
                tessera, "load", str(checkpoint), "--layout", str(whole), "--device", args.device,
                "--rank", "0", "--world", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "--quiet", "--report-json", str(report),
            ]
            if not verify:
                cmd.append("--no-verify")
            started = time.perf_counter()
            subprocess.run(cmd, check=True)
            wall = time.perf_counter() - started
            return json.loads(report.read_text())["total_seconds"], wall

        # One untimed round of each (CUDA context, allocator, page cache).
        torch_load()
        tessera_load(dcp_dir, False)
        tessera_load(native, True)
        rows = {"torch dcp.load (DCP)": [], "tessera load (same DCP, in place)": [], "tessera load (native, verified)": []}
        walls = {k: [] for k in rows}
        for _ in range(args.runs):
            rows["torch dcp.load (DCP)"].append(torch_load())
            walls["torch dcp.load (DCP)"].append(rows["torch dcp.load (DCP)"][-1])
            for key, ckpt, verify in [
                ("tessera load (same DCP, in place)", dcp_dir, False),
                ("tessera load (native, verified)", native, True),
            ]:
                seconds, wall = tessera_load(ckpt, verify)
                rows[key].append(seconds)
                walls[key].append(wall)

        torch_best = min(rows["torch dcp.load (DCP)"])
        print()
        where = f"{args.device} ({torch.cuda.get_device_name(args.device)})" if on_gpu else "host memory"
        print(
            f"{args.model} with optimizer states, {nbytes / 1e9:.2f} GB of tensors into {where}, "
            f"torch {torch.__version__}, best of {args.runs}"
        )
        print("| load | best s | median s | GB/s (best) | vs torch dcp.load | command wall s (best) |")
        print("|---|---|---|---|---|---|")
        for key, times in rows.items():
            best = min(times)
            print(
                f"| {key} | {best:.3f} | {statistics.median(times):.3f} | {nbytes / best / 1e9:.2f} "
                f"| {torch_best / best:.2f}x | {min(walls[key]):.3f} |"
            )
        return 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())

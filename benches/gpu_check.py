#!/usr/bin/env python3
"""The GPU check of issue 34, the Python half: tessera's CUDA paths against torch's on the same
card, in one bounded run. `scripts/gpu-check.sh` runs it on a lent GPU machine (after the Rust
GPU tests and the package's CUDA tests); by hand:

    python benches/gpu_check.py --out /tmp/gpu-check              # on a machine with a GPU
    python benches/gpu_check.py --out /tmp/gpu-check --device cpu # a dry run of the same steps

Parts (``--parts``, default all; each is timed, and a part that fails is recorded with its
error and the others still run):

* ``correctness``: a 4-process gloo job whose ranks share the one GPU saves two Llama-3-8B
  layers at a quarter of the width (bf16 parameters, fp32 moments, GQA shapes) as FSDP Shard(0)
  DTensors with ``dcp.save`` and with ``tessera.save``, then loads both into CUDA DTensors laid
  out Shard(1) and TP2 x DP2: ``dcp.load`` of the DCP checkpoint, ``tessera.load`` of each. Every
  rank's bytes must equal the values saved and ``dcp.load``'s. Then one byte of the DCP
  checkpoint's largest data file is flipped: ``tessera.load`` must fail on every rank, naming
  that file somewhere.
* ``h2d``: torch's own host-to-device ``copy_`` from pinned and from pageable memory (the
  baselines for tessera's staging, whose own rate ``benches/gpu.rs`` measures).
* ``load``: one process, Llama-3-8B layers (bf16 parameters, fp32 moments) saved by ``dcp.save``,
  page cache warm, loaded into the same CUDA tensors by ``tessera.load`` and ``dcp.load``,
  interleaved, medians; the two results compared.
* ``hf``: one process, a whole HF-style bf16 model (safetensors shards and an index), page cache
  warm, into existing CUDA tensors: ``tessera.load`` against ``safe_open`` + ``copy_`` and
  against ``safetensors.torch.load_file(device="cuda")``; GB/s (issue 34's goal: >= 25 GB/s).
* ``save``: the training thread's stall of ``tessera.async_save`` (eager and lazy) from CUDA
  tensors against ``dcp.async_save`` (its default stager; pinned staging where this torch has
  it), interleaved, medians; every checkpoint is loaded back and compared.
* ``nccl``: a world-1 NCCL group (one GPU is all there is): ``tessera.load`` over it into CUDA
  DTensors, compared with ``dcp.load``. The NCCL ring across GPUs stays untested.

Writes ``OUT/gpu_check.json`` (every number, the card, versions, each part's status) and prints
a summary table last. Exits 1 when any correctness check failed, 0 otherwise (a part skipped
for want of a GPU is not a failure, and says so).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

from bench_util import free_port, tensor_specs, warm

WORLD = 4
# The correctness job's layers: Llama-3-8B widths divided by 4 (hidden 1024).
SCALE = 4


def llama_specs(layers: int, scale: int, moments: bool) -> List[tuple]:
    """(name, shape, torch dtype name) of `layers` Llama-3-8B layers (GQA, SwiGLU; widths divided
    by `scale`): bf16 parameters, then with `moments` their fp32 Adam moments (the benchmarks'
    realistic shapes, `bench_util.tensor_specs`)."""
    names = {"bf16": "bfloat16", "fp32": "float32"}
    return [(n, s, names[d]) for n, s, d in tensor_specs("llama8b", layers, scale, moments)]


def layers_for(gb: float, moments: bool) -> int:
    """How many full-width layers make about `gb` GB (at least one)."""
    per_layer = sum(
        (2 if dtype == "bfloat16" else 4) * math.prod(shape) for _, shape, dtype in llama_specs(1, 1, moments)
    )
    return max(1, round(gb * 1e9 / per_layer))


def full_value(name: str, shape: tuple, dtype: str) -> Any:
    """The saved value of a tensor: random (never zeros), seeded by its name."""
    import torch

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(getattr(torch, dtype))


def digest(t: Any) -> str:
    """sha256 of a tensor's bytes (copied to the host)."""
    import torch

    host = t.detach().contiguous().cpu()
    return hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# correctness: a 4-rank gloo job sharing the GPU


def _placements(layout: str, shape: tuple) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    if len(shape) == 1:
        return (Replicate(),) if layout == "shard1" else (Replicate(), Replicate())
    return (Shard(1),) if layout == "shard1" else (Replicate(), Shard(1))


def data_byte(data: bytes) -> int:
    """An offset inside tensor bytes of a `.distcp` file: the middle of the longest stretch
    between zip signatures ("PK" + 01 02, 03 04, 05 06, 06 06, 06 07, 07 08), which in a file of
    `torch.save` blobs is the longest storage record. (A flip in a zip header would test the
    blob index, not the data's checksums.)"""
    marks = [0]
    at = data.find(b"PK")
    while at >= 0:
        if data[at + 2:at + 4] in (b"\x01\x02", b"\x03\x04", b"\x05\x06", b"\x06\x06", b"\x06\x07", b"\x07\x08"):
            marks.append(at)
        at = data.find(b"PK", at + 2)
    marks.append(len(data))
    start, end = max(zip(marks, marks[1:]), key=lambda pair: pair[1] - pair[0])
    return (start + end) // 2


def _correctness_rank(rank: int, port: int, work: str, device: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import tessera

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(2)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result: Dict[str, Any] = {"rank": rank, "checks": [], "errors": []}
    try:
        work_dir = Path(work)
        specs = llama_specs(2, SCALE, True)
        cpu_mesh = init_device_mesh("cpu", (WORLD,))
        saved = {
            name: distribute_tensor(full_value(name, shape, dtype), cpu_mesh, [Shard(0)], src_data_rank=None)
            for name, shape, dtype in specs
        }
        dcp.save(saved, checkpoint_id=str(work_dir / "dcp"))
        tessera.save(saved, str(work_dir / "native"))
        dist.barrier()
        meshes = {
            "shard1": (init_device_mesh(device, (WORLD,)), init_device_mesh("cpu", (WORLD,))),
            "tp2dp2": (
                init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp")),
                init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            ),
        }

        def targets(layout: str) -> Dict[str, Any]:
            mesh = meshes[layout][0]
            state = {}
            for name, shape, dtype in specs:
                placements = _placements(layout, shape)
                like = distribute_tensor(
                    torch.empty(shape, dtype=getattr(torch, dtype)), meshes[layout][1], placements, src_data_rank=None
                )
                local = torch.full(like.to_local().shape, 7, dtype=getattr(torch, dtype), device=device)
                state[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                                 stride=like.stride())
            return state

        for layout in ("shard1", "tp2dp2"):
            expected = {
                name: digest(distribute_tensor(full_value(name, shape, dtype), meshes[layout][1],
                                               _placements(layout, shape), src_data_rank=None).to_local())
                for name, shape, dtype in specs
            }
            for method in ("dcp.load DCP", "tessera DCP", "tessera native"):
                state = targets(layout)
                dist.barrier()
                started = time.perf_counter()
                if method == "dcp.load DCP":
                    dcp.load(state, checkpoint_id=str(work_dir / "dcp"))
                else:
                    source = work_dir / ("dcp" if method.endswith("DCP") else "native")
                    tessera.load(state, str(source), progress=False, timeout=120)
                sync(device)
                seconds = time.perf_counter() - started
                wrong = [name for name, value in state.items() if digest(value.to_local()) != expected[name]]
                devices = sorted({str(v.to_local().device) for v in state.values()})
                result["checks"].append({
                    "layout": layout, "method": method, "seconds": seconds, "wrong": wrong, "devices": devices,
                    "bytes": sum(nbytes(v.to_local()) for v in state.values()),
                })
        # One flipped byte of tensor data in the largest data file: every rank must fail.
        flipped = work_dir / "dcp-flipped"
        if rank == 0:
            shutil.copytree(work_dir / "dcp", flipped)
            largest = max(flipped.glob("*.distcp"), key=lambda p: p.stat().st_size)
            data = bytearray(largest.read_bytes())
            at = data_byte(data)
            data[at] ^= 0x10
            largest.write_bytes(bytes(data))
            result["flipped_file"] = largest.name
            result["flipped_at"] = at
        dist.barrier()
        try:
            tessera.load(targets("shard1"), str(flipped), progress=False, timeout=60)
            result["corruption"] = {"raised": False}
        except tessera.TesseraError as e:
            result["corruption"] = {"raised": True, "message": str(e)[:2000]}
    except Exception:  # recorded, so the parent can report every rank's failure
        result["errors"].append(traceback.format_exc()[-4000:])
    finally:
        out[rank] = result
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def part_correctness(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    work.mkdir(parents=True, exist_ok=True)
    out = mp.Manager().dict()
    mp.spawn(_correctness_rank, args=(free_port(), str(work), args.device, out), nprocs=WORLD, join=True)
    ranks = [out[r] for r in range(WORLD)]
    failures = []
    for r in ranks:
        failures += [f"rank {r['rank']}: {e}" for e in r["errors"]]
        for check in r["checks"]:
            if check["wrong"]:
                failures.append(f"rank {r['rank']} {check['layout']} {check['method']}: wrong bytes in {check['wrong']}")
            want = "cuda:0" if args.device == "cuda" else "cpu"
            if check["devices"] != [want]:
                failures.append(f"rank {r['rank']} {check['layout']} {check['method']}: tensors on {check['devices']}")
    corruption = [r.get("corruption", {}) for r in ranks]
    flipped_file = ranks[0].get("flipped_file", "?")
    if not all(c.get("raised") for c in corruption):
        failures.append(f"the flipped byte in {flipped_file} did not fail every rank: {corruption}")
    elif not any(flipped_file in c.get("message", "") for c in corruption):
        failures.append(f"no rank's error named {flipped_file}: {[c.get('message') for c in corruption]}")
    seconds: Dict[str, List[float]] = {}
    for r in ranks:
        for check in r["checks"]:
            key = f"{check['layout']} {check['method']}"
            seconds[key] = seconds.get(key, []) + [check["seconds"]]
    return {
        "ok": not failures,
        "failures": failures,
        "slowest_rank_seconds": {k: max(v) for k, v in seconds.items()},
        "bytes_per_rank": {f"{c['layout']}": c["bytes"] for c in ranks[0]["checks"]} if ranks[0]["checks"] else {},
        "corruption_messages": [c.get("message", "") for c in corruption],
        "flipped_file": flipped_file,
    }


# --------------------------------------------------------------------------------------------
# one-process speed parts


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def part_h2d(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch

    if args.device != "cuda":
        return {"skipped": "no CUDA device"}
    n = int(args.h2d_gb * 1e9) // 4 * 4
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.random_(0, 255)
    pageable = pinned.clone()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates: Dict[str, List[float]] = {"torch pinned copy_": [], "torch pageable copy_": []}
    for _ in range(args.reps + 1):
        for name, src in (("torch pinned copy_", pinned), ("torch pageable copy_", pageable)):
            s = timed(lambda: dst.copy_(src, non_blocking=True), "cuda")
            rates[name].append(n / s / 1e9)
    ok = torch.equal(dst[:1 << 20].cpu(), pageable[:1 << 20])
    return {"bytes": n, "gb_per_s": {k: statistics.median(v[1:]) for k, v in rates.items()}, "runs": rates, "ok": ok}


def _save_llama(directory: Path, gb: float, moments: bool) -> List[tuple]:
    """A Llama-3-8B state of about `gb` GB, saved by dcp.save from one process."""
    import torch.distributed.checkpoint as dcp

    specs = llama_specs(layers_for(gb, moments), 1, moments)
    if not (directory / ".metadata").exists():
        state = {name: full_value(name, shape, dtype) for name, shape, dtype in specs}
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return specs


def part_load(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import tessera

    directory = work / "llama-dcp"
    specs = _save_llama(directory, args.gb, True)
    warm(str(directory))
    device = "cuda:0" if args.device == "cuda" else "cpu"

    def fresh() -> Dict[str, Any]:
        return {n: torch.full(s, 3, dtype=getattr(torch, d), device=device) for n, s, d in specs}

    a, b = fresh(), fresh()
    total = sum(nbytes(t) for t in a.values())
    runs: Dict[str, List[float]] = {"tessera.load": [], "dcp.load": []}
    reports: List[Any] = []
    for _ in range(args.reps):
        runs["tessera.load"].append(
            timed(lambda: reports.append(tessera.load(a, str(directory), progress=False)), device)
        )
        runs["dcp.load"].append(timed(lambda: dcp.load(b, checkpoint_id=str(directory), no_dist=True), device))
    wrong = [n for n in a if not torch.equal(a[n], b[n])]
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "ok": not wrong, "wrong": wrong[:10], "bytes": total, "tensors": len(specs), "runs": runs, "seconds": med,
        "gb_per_s": {k: total / v / 1e9 for k, v in med.items()},
        "tessera_vs_dcp": med["dcp.load"] / med["tessera.load"],
        "tessera_report": {k: reports[-1][k] for k in ("read_seconds", "h2d_bytes", "h2d_seconds", "total_seconds")},
    }


def part_hf(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import tessera

    directory = work / "hf-model"
    specs = llama_specs(layers_for(args.gb, False), 1, False)
    if not (directory / "model.safetensors.index.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        shards: List[Dict[str, Any]] = [{}]
        size = 0
        for name, shape, dtype in specs:
            value = full_value(name, shape, dtype)
            if size + nbytes(value) > 2e9 and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][name] = value
            size += nbytes(value)
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file))
            weight_map.update({name: file for name in shard})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    warm(str(directory))
    device = "cuda:0" if args.device == "cuda" else "cpu"
    files = sorted(directory.glob("*.safetensors"))
    state = {n: torch.full(s, 3, dtype=getattr(torch, d), device=device) for n, s, d in specs}
    other = {n: torch.full(s, 5, dtype=getattr(torch, d), device=device) for n, s, d in specs}
    total = sum(nbytes(t) for t in state.values())

    def safe_open_copy() -> None:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    other[name].copy_(f.get_tensor(name), non_blocking=True)

    def load_file_device() -> None:
        loaded = {}
        for file in files:
            loaded.update(load_file(str(file), device=device))
        for name, value in loaded.items():
            other[name].copy_(value)

    reports: List[Any] = []
    methods = {
        "tessera.load": lambda: reports.append(tessera.load(state, str(directory), progress=False)),
        "safe_open + copy_": safe_open_copy,
        "safetensors load_file(device)": load_file_device,
    }
    runs: Dict[str, List[float]] = {k: [] for k in methods}
    for _ in range(args.reps):
        for name, fn in methods.items():
            runs[name].append(timed(fn, device))
    wrong = [n for n in state if not torch.equal(state[n], other[n])]
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "ok": not wrong, "wrong": wrong[:10], "bytes": total, "files": len(files), "runs": runs, "seconds": med,
        "gb_per_s": {k: total / v / 1e9 for k, v in med.items()},
        "goal_25_gb_per_s": total / med["tessera.load"] / 1e9 >= 25.0,
        "tessera_report": {k: reports[-1][k] for k in ("read_seconds", "h2d_bytes", "h2d_seconds", "total_seconds")},
    }


def part_save(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import tessera

    device = "cuda:0" if args.device == "cuda" else "cpu"
    specs = llama_specs(layers_for(args.save_gb, False), 1, False)
    state = {n: full_value(n, s, d).to(device) for n, s, d in specs}
    total = sum(nbytes(t) for t in state.values())
    stagers: Dict[str, Any] = {"dcp.async_save": {}}
    try:  # pinned staging, where this torch has the stager API
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stagers["dcp.async_save pinned stager"] = {
            "async_stager": DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                         use_async_staging=False, use_non_blocking_copy=True)),
        }
    except Exception as e:  # older torch: only the default
        stagers_note = f"no DefaultStager/StagingOptions: {e}"
    else:
        stagers_note = ""
    stall: Dict[str, List[float]] = {"tessera.async_save eager": [], "tessera.async_save lazy": []}
    stall.update({k: [] for k in stagers})
    wrong: List[str] = []
    calls: Dict[str, List[float]] = {}
    k = 0
    for _ in range(args.reps):
        for mode in ("eager", "lazy"):
            target = work / f"tessera-{k}"
            k += 1
            started = time.perf_counter()
            handle = tessera.async_save(state, str(target), snapshot=mode)
            calls.setdefault(f"tessera.async_save {mode}", []).append(time.perf_counter() - started)
            # Lazy: the copies run while a job would compute forward and backward; the stall
            # counted here (call + wait for the copies) is the most a job could wait.
            handle.wait_snapshot()
            stall[f"tessera.async_save {mode}"].append(time.perf_counter() - started)
            handle.result()
            back = {n: torch.empty_like(v) for n, v in state.items()}
            tessera.load(back, str(target), progress=False)
            wrong += [f"{mode} {n}" for n in state if not torch.equal(back[n], state[n])]
            shutil.rmtree(target)
        for name, kwargs in list(stagers.items()):
            target = work / f"dcp-{k}"
            k += 1
            started = time.perf_counter()
            try:
                future = dcp.async_save(state, checkpoint_id=str(target), no_dist=True, **kwargs)
                stall[name].append(time.perf_counter() - started)
                (future.upload_completion.result() if hasattr(future, "upload_completion") else future.result())
            except Exception as e:
                if not kwargs:
                    raise  # torch's default async save is the baseline: its failure fails the part
                # A stager this torch does not support: the baseline is the default one.
                stagers_note += f"{name} failed: {type(e).__name__}: {e}; "
                del stagers[name]
                shutil.rmtree(target, ignore_errors=True)
                continue
            back = {n: torch.empty_like(v) for n, v in state.items()}
            dcp.load(back, checkpoint_id=str(target), no_dist=True)
            wrong += [f"{name} {n}" for n in state if not torch.equal(back[n], state[n])]
            shutil.rmtree(target)
    med = {k: statistics.median(v) for k, v in stall.items() if v}
    return {"ok": not wrong, "wrong": wrong[:10], "bytes": total, "stall_runs": stall, "stall_seconds": med,
            "call_seconds": {k: statistics.median(v) for k, v in calls.items()}, "note": stagers_note}


def _nccl_rank(rank: int, port: int, work: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import tessera

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    result: Dict[str, Any] = {}
    try:
        dist.init_process_group("nccl", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        specs = llama_specs(1, SCALE, False)
        saved = {n: full_value(n, s, d) for n, s, d in specs}
        directory = Path(work) / "nccl-dcp"
        dcp.save(saved, checkpoint_id=str(directory), no_dist=True)
        state = {n: distribute_tensor(torch.zeros(s, dtype=getattr(torch, d), device="cuda"), mesh, [Replicate()])
                 for n, s, d in specs}
        report = tessera.load(state, str(directory), progress=False, timeout=60)
        wrong = [n for n in state if digest(state[n].to_local()) != digest(saved[n])]
        result = {"ok": not wrong, "wrong": wrong, "exchange": report.exchange,
                  "backend": str(dist.get_backend())}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()[-3000:]}
    finally:
        out[0] = result
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def part_nccl(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    if args.device != "cuda":
        return {"skipped": "no CUDA device"}
    work.mkdir(parents=True, exist_ok=True)
    out = mp.Manager().dict()
    mp.spawn(_nccl_rank, args=(free_port(), str(work), out), nprocs=1, join=True)
    result = dict(out[0])
    result["note"] = "a world of 1 (one GPU): the NCCL ring between GPUs is untested"
    return result


PARTS = {
    "correctness": part_correctness,
    "h2d": part_h2d,
    "load": part_load,
    "hf": part_hf,
    "save": part_save,
    "nccl": part_nccl,
}


def machine(device: str) -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    try:
        import tessera

        info["tessera"] = str(Path(tessera.__file__).parent)
    except Exception as e:
        info["tessera"] = f"import failed: {e}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--work", default=None, help="scratch folder (default OUT/../gpu-check-work)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cuda (default where torch sees a GPU) or cpu (a dry run)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--gb", type=float, default=4.0, help="size of the load and hf checkpoints")
    parser.add_argument("--save-gb", type=float, default=2.0)
    parser.add_argument("--h2d-gb", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out.parent / "gpu-check-work"
    results: Dict[str, Any] = {"machine": machine(args.device), "device": args.device, "args": vars(args), "parts": {}}
    for name in [p for p in args.parts.split(",") if p]:
        started = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result = PARTS[name](args, work / name)
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
        result["part_seconds"] = round(time.perf_counter() - started, 2)
        results["parts"][name] = result
        print(json.dumps(result, default=str)[:3000], flush=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nGPU check on {results['machine'].get('gpu', args.device)} (torch {results['machine']['torch']})")
    print("| part | status | numbers |")
    print("|---|---|---|")
    failed = False
    for name, r in results["parts"].items():
        status = "skipped: " + r["skipped"] if "skipped" in r else ("ok" if r.get("ok", True) else "FAILED")
        failed |= status == "FAILED"
        numbers = {k: r[k] for k in ("gb_per_s", "stall_seconds", "slowest_rank_seconds", "tessera_vs_dcp") if k in r}
        print(f"| {name} | {status} | {json.dumps(numbers, default=lambda x: round(x, 3))[:400]} |")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

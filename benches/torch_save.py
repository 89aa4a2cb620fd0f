#!/usr/bin/env python3
"""Checkpoint save from a training job: tessera.async_save, tessera.save, dcp.save and
dcp.async_save of the same state dict, with the disk's raw write speed measured in the same run
(issue 15).

`--world` gloo processes on 127.0.0.1 (CPU tensors); each rank holds its shard of `--gb` GB of
float32 tensors as DTensors sharded over the ranks (so both tessera and DCP write every byte
once, each rank its own). For every method, `--runs` times (median reported):

* **stall**: seconds the training thread is blocked: the call, plus for ``tessera.async_save``
  ``wait_snapshot()`` (after which the job may change its tensors; for ``dcp.async_save`` the
  call returns once its staging copy is done, so the call is the stall);
* **persist**: from the call until the checkpoint is committed (``result()`` on every rank),
  the slowest rank's;
* **GB/s**: state bytes / persist.

Baselines measured in the same processes, on the same bytes:

* **memcpy**: one ``copy_`` of the rank's state into a preallocated host buffer (warm): the
  smallest possible snapshot;
* **raw write**: every rank writes its shard's bytes to its own file with ``tofile`` at once;
  once without and once with ``fsync`` (DCP fsyncs its files by default, tessera's local store
  does not).

Usage (release build of the module first):
    cd python && maturin develop --release && cd ..
    python benches/torch_save.py --world 2 --gb 1.5 --runs 3 --dir /work/main/target/bench-save
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time


def _sync_max(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import tessera

    world = args.world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    per_rank = int(args.gb * 1e9) // world
    n_tensors = args.tensors
    rows = per_rank // n_tensors // 4 // 1024
    local = [torch.full((rows, 1024), float(rank * 100 + i)) for i in range(n_tensors)]
    state = {f"layers.{i}.weight": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)}
    nbytes = sum(t.numel() * t.element_size() for t in local)
    total_bytes = int(_sync_max(nbytes)) * world

    # memcpy baseline (warm: the destination is touched once first).
    flat = torch.empty(nbytes // 4)
    for _ in range(2):
        t0 = time.perf_counter()
        offset = 0
        for t in local:
            flat[offset : offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
        memcpy = time.perf_counter() - t0
    del flat
    memcpy = _sync_max(memcpy)

    def raw(fsync: bool) -> float:
        path = os.path.join(args.dir, f"raw-{rank}.bin")
        dist.barrier()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for t in local:
                t.numpy().tofile(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        seconds = _sync_max(time.perf_counter() - t0)
        os.remove(path)
        return seconds

    raw_nosync = [raw(False) for _ in range(args.runs)]
    raw_fsync = [raw(True) for _ in range(args.runs)]

    results = {}

    def run(name: str, save) -> None:
        stalls, persists = [], []
        for i in range(args.runs):
            path = os.path.join(args.dir, name, f"step-{i + 1}")
            dist.barrier()
            t0 = time.perf_counter()
            wait = save(path)
            stall = time.perf_counter() - t0
            wait()
            persist = time.perf_counter() - t0
            stalls.append(_sync_max(stall))
            persists.append(_sync_max(persist))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
        results[name] = (stalls, persists)

    def tessera_async(path):
        handle = tessera.async_save(state, path, process_group=dist.group.WORLD)
        handle.wait_snapshot()
        return handle.result

    def tessera_sync(path):
        tessera.save(state, path, process_group=dist.group.WORLD)
        return lambda: None

    def dcp_sync(path):
        dcp.save(state, checkpoint_id=path)
        return lambda: None

    def dcp_async(path):
        future = dcp.async_save(state, checkpoint_id=path)
        return future.result

    for name, save in [("tessera.async_save", tessera_async), ("tessera.save", tessera_sync),
                       ("dcp.async_save", dcp_async), ("dcp.save", dcp_sync)]:
        run(name, save)
    if rank == 0:
        out.update(
            results=results, memcpy=memcpy, raw_nosync=raw_nosync, raw_fsync=raw_fsync,
            total_bytes=total_bytes, rank_bytes=nbytes,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--gb", type=float, default=1.5, help="state size of the whole job, GB")
    parser.add_argument("--tensors", type=int, default=24, help="tensors per rank")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="target/bench-save")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(args, port, out), nprocs=args.world, join=True)
    gb = out["total_bytes"] / 1e9
    med = statistics.median
    print(f"state: {gb:.2f} GB over {args.world} gloo ranks ({out['rank_bytes'] / 1e9:.2f} GB per rank), "
          f"{args.runs} runs, medians; dir {args.dir}")
    print(f"memcpy of one rank's state: {out['memcpy']:.3f} s")
    for label, key in [("raw write (tofile, no fsync)", "raw_nosync"), ("raw write + fsync", "raw_fsync")]:
        s = med(out[key])
        print(f"{label}: {s:.3f} s = {gb / s:.2f} GB/s")
    raw_fsync = med(out["raw_fsync"])
    raw_nosync = med(out["raw_nosync"])
    print(f"{'method':<20} {'stall s':>9} {'persist s':>10} {'GB/s':>7} {'vs raw':>7} {'vs raw+fsync':>13}  runs (stall/persist)")
    for name, (stalls, persists) in out["results"].items():
        p = med(persists)
        runs = ", ".join(f"{a:.3f}/{b:.2f}" for a, b in zip(stalls, persists))
        print(f"{name:<20} {med(stalls):>9.3f} {p:>10.2f} {gb / p:>7.2f} {raw_nosync / p:>7.0%} {raw_fsync / p:>13.0%}  {runs}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

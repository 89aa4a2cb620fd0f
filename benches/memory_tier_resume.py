"""Resume from memory, resharded (issue 33; BENCHMARKS.md "Resume from a node's memory tier"):
a job of 4 ranks on two "nodes" saves a Llama-like state (bf16 layers with GQA and SwiGLU, fp32
Adam moments) as FSDP Shard(0) DTensors with ``tessera.save(..., memory_tier=...)``; a job of 3
ranks (another world size: FSDP 4 -> 3) then resumes it from an S3 store throttled to a stated
bandwidth, three ways, interleaved, medians:

- ``tessera.load(..., memory_tier=<its node's tier>)``: the pieces the nodes hold are read from
  their memory (``/dev/shm``), storage only for the rest (nothing, with the full tier);
- ``tessera.load`` from the store, no tier;
- ``dcp.load`` with torch's fsspec reader (s3fs) from the same store (the same state saved by
  ``dcp.save``);

and, as the bound, each rank copying its share of the unique bytes in memory (``copy_``) at
once. The S3 test server counts the bytes it served per load, so "from storage" is what went
over the wire.

    cargo build --release --locked -p tessera-storage --features testing --example s3_test_server
    (cd python && maturin build --release -o /tmp/wheel) && unzip it into DIR
    pip install --target S3FS s3fs
    PYTHONPATH=DIR:S3FS python benches/memory_tier_resume.py [--layers 4] [--mb-per-s 400]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench_util import REPO, S3TestServer, free_port
BUCKET = "ckpts"

# Llama-like, scaled in depth to this machine: hidden 2048, 16 heads of 128, 4 KV heads (GQA),
# SwiGLU 5632.
HIDDEN, KV, FFN = 2048, 512, 5632


def _shapes(layers: int) -> dict:
    shapes = {}
    for i in range(layers):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.attn.q.weight": (HIDDEN, HIDDEN), f"{p}.attn.k.weight": (KV, HIDDEN),
            f"{p}.attn.v.weight": (KV, HIDDEN), f"{p}.attn.o.weight": (HIDDEN, HIDDEN),
            f"{p}.mlp.gate.weight": (FFN, HIDDEN), f"{p}.mlp.up.weight": (FFN, HIDDEN),
            f"{p}.mlp.down.weight": (HIDDEN, FFN), f"{p}.norm.weight": (HIDDEN,),
        })
    return shapes


def _full_state(layers: int) -> dict:
    """Parameters in bf16, Adam's two moments in fp32, deterministic."""
    import torch

    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in _shapes(layers).items():
        state[f"model.{name}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
        state[f"optim.{name}.exp_avg"] = torch.randn(shape, generator=g)
        state[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, generator=g)
    return state


def _save_rank(rank: int, world: int, port: int, layers: int, root: str, tiers: list) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tessera

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TESSERA_PORT=str(port + 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full_state(layers).items()}
    tessera.save(state, str(Path(root) / BUCKET / "native"), process_group=dist.group.WORLD,
                 memory_tier=tiers[rank // 2], timeout=600)
    dcp.save(state, checkpoint_id=str(Path(root) / BUCKET / "dcp"))
    dist.destroy_process_group()


def _dest(mesh, layers: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, shape in _shapes(layers).items():
        for key, dtype in ((f"model.{name}", torch.bfloat16), (f"optim.{name}.exp_avg", torch.float32),
                           (f"optim.{name}.exp_avg_sq", torch.float32)):
            full = torch.Size(shape)
            rows = [len(r) for r in torch.arange(shape[0]).chunk(mesh.size())]
            local = torch.zeros((rows[mesh.get_local_rank()], *shape[1:]), dtype=dtype)
            out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full,
                                          stride=torch.empty(full, device="meta").stride())
    return out


def _load_rank(rank: int, world: int, port: int, layers: int, root: str, tiers: list, rate: int,
               reps: int, out: str, skip_dcp: bool = False) -> None:
    import hashlib

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FsspecReader
    from torch.distributed.device_mesh import init_device_mesh

    import tessera

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TESSERA_PORT=str(port + 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    server = S3TestServer(Path(root), BUCKET, rate) if rank == 0 else None
    box = [server.env if server else None]
    dist.broadcast_object_list(box, src=0)
    env = box[0]
    tier = tiers[0] if rank < 2 else tiers[1]
    dest = _dest(mesh, layers)
    mine = sum(t.to_local().nbytes for t in dest.values())
    src, dst = torch.empty(mine, dtype=torch.uint8).fill_(1), torch.empty(mine, dtype=torch.uint8).fill_(2)

    def run(how: str) -> dict:
        if server:
            server.ask("reset")
        dist.barrier()
        started = time.monotonic()
        report = None
        if how == "tessera, memory tier":
            report = tessera.load(dest, f"s3://{BUCKET}/native", storage_options=env, memory_tier=tier,
                                  progress=False, timeout=600)
        elif how == "tessera, store":
            report = tessera.load(dest, f"s3://{BUCKET}/native", storage_options=env, progress=False, timeout=600)
        elif how == "dcp.load (fsspec)":
            reader = FsspecReader(
                f"s3://{BUCKET}/dcp", key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": env["AWS_REGION"]},
            )
            dcp.load(dest, storage_reader=reader)
        else:
            dst.copy_(src)
        seconds = torch.tensor([time.monotonic() - started], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.barrier()
        served = server.ask("served ") if server else None
        tier_bytes = torch.tensor([report.bytes_from_memory_tier if report else 0], dtype=torch.int64)
        dist.all_reduce(tier_bytes)
        digest = hashlib.sha256()
        if how != "memcpy":
            for k in sorted(dest):
                digest.update(dest[k].to_local().contiguous().view(torch.uint8).numpy().tobytes())
                dest[k].to_local().zero_()
        phases = (f"read {report.read_seconds:.2f} s, exchange {report.exchange_seconds:.2f} s, "
                  f"total {report.total_seconds:.2f} s") if report else ""
        return {"seconds": float(seconds), "served": served, "tier_bytes": int(tier_bytes),
                "sha": digest.hexdigest(), "phases": phases}

    order = ["tessera, memory tier", "tessera, store", "dcp.load (fsspec)", "memcpy"]
    if skip_dcp:
        order.remove("dcp.load (fsspec)")
    results: dict = {how: [] for how in order}
    for rep in range(reps):
        for how in order[rep % len(order):] + order[: rep % len(order)]:
            results[how].append(run(how))
            if rank == 0:
                r = results[how][-1]
                served = r["served"]["get_body_bytes"] if r["served"] else 0
                print(f"  rep {rep}: {how}: {r['seconds']:.2f} s, served {served:,} B, tier {r['tier_bytes']:,} B "
                      f"{r['phases']}", flush=True)
    if server:
        server.close()
    shas = {how: [r["sha"] for r in rs] for how, rs in results.items() if how != "memcpy"}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"results": results, "shas": shas, "mine": mine}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mb-per-s", type=int, default=400, help="the store's bandwidth (MB/s, one link)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--root", default=str(REPO / "target" / "bench-tier"))
    p.add_argument("--tiers", default="/dev/shm/tessera-bench", help="the two nodes' tiers go under it")
    p.add_argument("--skip-dcp", action="store_true", help="tessera and memcpy only (a quick look)")
    args = p.parse_args()
    import torch.multiprocessing as mp

    root, tiers_root = Path(args.root), Path(args.tiers)
    for d in (root, tiers_root):
        shutil.rmtree(d, ignore_errors=True)
    (root / BUCKET).mkdir(parents=True)
    tiers = [str(tiers_root / "node0"), str(tiers_root / "node1")]
    try:
        started = time.monotonic()
        mp.spawn(_save_rank, args=(4, free_port(), args.layers, str(root), tiers), nprocs=4, join=True)
        print(f"saved 4 ranks (native + memory tier, and dcp.save) in {time.monotonic() - started:.1f} s", flush=True)
        out = root / "out"
        out.mkdir()
        rate = args.mb_per_s * 1_000_000
        mp.spawn(_load_rank, args=(3, free_port(), args.layers, str(root), tiers, rate, args.reps, str(out), args.skip_dcp),
                 nprocs=3, join=True)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    finally:
        shutil.rmtree(tiers_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    unique = sum(r["mine"] for r in ranks)
    for r in ranks:
        first = next(iter(r["shas"].values()))[0]
        assert all(s == first for shas in r["shas"].values() for s in shas), "a load's bytes differ from dcp.load's"
    results = ranks[0]["results"]
    memcpy = statistics.median(x["seconds"] for x in results["memcpy"])
    print(f"\nstate {unique / 1e9:.2f} GB ({args.layers} Llama-like layers, bf16 + fp32 Adam moments), "
          f"FSDP 4 -> 3 ranks, store at {args.mb_per_s} MB/s, medians of {args.reps}\n")
    print("| resume | seconds | GB/s of the state | bytes from storage (server) | bytes from the tier | vs memcpy |")
    print("|---|---|---|---|---|---|")
    for how, rs in results.items():
        seconds = statistics.median(x["seconds"] for x in rs)
        served = rs[-1]["served"]["get_body_bytes"] if rs[-1]["served"] else 0
        print(f"| {how} | {seconds:.2f} | {unique / seconds / 1e9:.2f} | {served:,} | {rs[-1]['tier_bytes']:,} | "
              f"{memcpy / seconds:.2f}x |")
    tier = statistics.median(x["seconds"] for x in results["tessera, memory tier"])
    for how in [h for h in ("tessera, store", "dcp.load (fsspec)") if h in results]:
        other = statistics.median(x["seconds"] for x in results[how])
        print(f"memory tier vs {how}: {other / tier:.1f}x faster")


if __name__ == "__main__":
    sys.exit(main())

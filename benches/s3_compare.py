"""Object-store loads side by side (BENCHMARKS.md "S3: tessera vs dcp.load vs Run:ai"): tessera,
torch's `dcp.load` with its fsspec reader (s3fs), and the Run:ai Model Streamer for safetensors, on
the same files behind the loopback S3 test server. The server counts what it sent (body bytes and
GET requests), so every row says what went over the wire, not what the client thinks it read.

    cargo build --release --locked -p tessera-storage --features testing --example s3_test_server
    (cd python && maturin develop --release)        # into a venv with torch==2.15.0
    pip install s3fs runai-model-streamer runai-model-streamer-s3 safetensors
    python benches/s3_compare.py [--mib 512] [--world 4] [--reps 3]

Checkpoint: two float32 [rows, 8192] tensors written by torch's `dcp.save` at world `--world`
(Shard(0), as FSDP saves), and the same tensors as one safetensors file. Loads: every rank of a
`--world`-process gloo job fills DTensors (Shard(0): the saved layout; Shard(1): columns, cutting
across the stored row order) through `tessera.load` (one job over the process group) and through
`dcp.load(storage_reader=FsspecReader("s3://..."))`; a single process loads the whole safetensors
file through `tessera.load` and through Run:ai's `SafetensorsStreamer`. Every tessera result is
checked byte for byte against torch's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench_util import REPO, S3TestServer, free_port
COLS = 8192
BUCKET = "ckpts"


def _tensors(rows: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(2)}


def _mesh_state(rank: int, world: int, rows: int, dim: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for i in range(2):
        full_shape = torch.Size([rows, COLS])
        local = [rows // world, COLS] if dim == 0 else [rows, COLS // world]
        state[f"layer{i}.weight"] = DTensor.from_local(
            torch.empty(local), mesh, [Shard(dim)], run_check=False, shape=full_shape,
            stride=torch.empty(full_shape, device="meta").stride(),
        )
    return state


def _save_rank(rank: int, world: int, port: int, rows: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor, Shard
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _tensors(rows).items()}
    dcp.save(state, checkpoint_id=out)
    dist.destroy_process_group()


def _load_rank(rank, world, port, rows, dim, how, env, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = _mesh_state(rank, world, rows, dim)
    dist.barrier()
    started = time.monotonic()
    if how == "tessera":
        import tessera

        report = tessera.load(state, f"s3://{BUCKET}/dcp", storage_options=env, progress=False).to_dict()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FsspecReader

        reader = FsspecReader(
            f"s3://{BUCKET}/dcp", key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": env["AWS_REGION"]},
        )
        dcp.load(state, storage_reader=reader)
        report = {}
    dist.barrier()
    seconds = time.monotonic() - started
    digest = hashlib.sha256()
    for k in sorted(state):
        digest.update(state[k].to_local().contiguous().view(torch.uint8).numpy().tobytes())
    results[rank] = {"seconds": seconds, "sha": digest.hexdigest(), "report": report}
    dist.destroy_process_group()


def _spawn(fn, world, *args):
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def _served(server: S3TestServer, prefix: str, run) -> tuple:
    server.ask("reset")
    out = run()
    served = server.ask(f"served {prefix}")
    return out, served["get_body_bytes"], served["get_requests"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB (two tensors)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--root", default=str(REPO / "target" / "bench-s3"))
    p.add_argument(
        "--st-mib", type=int, default=None,
        help="size of the safetensors file (default --mib); Run:ai's S3 client gives up on this loopback "
        "server above ~128 MiB (aws-c-http throughput minimum)",
    )
    p.add_argument("--only", choices=["dcp", "safetensors"], default=None, help="run one half")
    args = p.parse_args()
    import torch
    import torch.multiprocessing as mp

    rows = args.mib * 2**20 // (2 * COLS * 4) // args.world * args.world
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    (root / BUCKET).mkdir(parents=True)
    st_rows = (args.st_mib or args.mib) * 2**20 // (2 * COLS * 4)
    if args.only != "safetensors":
        _spawn(_save_rank, args.world, rows, str(root / BUCKET / "dcp"))
    from safetensors.torch import save_file

    (root / BUCKET / "st").mkdir()
    save_file(_tensors(st_rows), str(root / BUCKET / "st" / "model.safetensors"))
    unique = 2 * rows * COLS * 4
    server = S3TestServer(root, BUCKET)
    env = server.env
    rows_out = []
    try:
        for dim, target in [] if args.only == "safetensors" else [(0, "Shard(0) (saved layout)"), (1, "Shard(1) (columns)")]:
            shas = {}
            for how in ["tessera", "dcp.load (fsspec)"]:
                times, served, requests = [], 0, 0
                for _ in range(args.reps):
                    results = mp.Manager().dict()
                    key = "tessera" if how == "tessera" else "dcp"
                    _, served, requests = _served(
                        server, f"/{BUCKET}/dcp/",
                        lambda: _spawn(_load_rank, args.world, rows, dim, key, env, results),
                    )
                    times.append(max(r["seconds"] for r in results.values()))
                    shas[how] = [results[r]["sha"] for r in range(args.world)]
                rows_out.append((target, how, statistics.median(times), served, requests))
                print(f"{target} {how}: {statistics.median(times):.2f} s, {served:,} bytes, {requests} GETs", flush=True)
            assert shas["tessera"] == shas["dcp.load (fsspec)"], f"{target}: tessera's bytes differ from torch's"
        # safetensors, whole file, one process.
        st_url = f"s3://{BUCKET}/st/model.safetensors"

        def tessera_st():
            import tessera

            state = {k: torch.empty(st_rows, COLS) for k in ["layer0.weight", "layer1.weight"]}
            tessera.load(state, st_url, storage_options=env, progress=False)
            return state

        def runai_st():
            from runai_model_streamer import SafetensorsStreamer

            os.environ.update(
                AWS_ACCESS_KEY_ID=env["AWS_ACCESS_KEY_ID"], AWS_SECRET_ACCESS_KEY=env["AWS_SECRET_ACCESS_KEY"],
                AWS_ENDPOINT_URL=env["AWS_ENDPOINT_URL"], AWS_DEFAULT_REGION=env["AWS_REGION"],
                RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0", AWS_EC2_METADATA_DISABLED="true",
                # Its default 16 parallel ranged GETs fail against the loopback server on 2 cores
                # ("File access error"); 4 keep it working.
                RUNAI_STREAMER_CONCURRENCY=os.environ.get("RUNAI_STREAMER_CONCURRENCY", "4"),
            )
            out = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(st_url)
                for name, tensor in streamer.get_tensors():
                    out[name] = tensor.clone()
            return out

        st = {}
        for how, run in [] if args.only == "dcp" else [("tessera", tessera_st), ("Run:ai Model Streamer", runai_st)]:
            times = []
            try:
                for _ in range(args.reps):
                    started = time.monotonic()
                    state, served, requests = _served(server, f"/{BUCKET}/st/", run)
                    times.append(time.monotonic() - started)
            except Exception as e:  # a competitor's failure is a result too, not the end of the run
                print(f"{how} failed: {type(e).__name__}: {e}", flush=True)
                rows_out.append(("safetensors, whole file, 1 process", f"{how} (failed: {e})", float("nan"), 0, 0))
                continue
            st[how] = state
            rows_out.append(("safetensors, whole file, 1 process", how, statistics.median(times), served, requests))
        if len(st) == 2:
            for k in st["tessera"]:
                assert torch.equal(st["tessera"][k], st["Run:ai Model Streamer"][k]), k
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)

    st_unique = 2 * st_rows * COLS * 4
    print(
        f"S3 test server on 127.0.0.1; DCP {unique / 2**20:.0f} MiB, safetensors {st_unique / 2**20:.0f} MiB; "
        f"world {args.world}; median of {args.reps}"
    )
    print("| target | loader | seconds | bytes served | × unique | GET requests | vs tessera |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for target, how, seconds, served, requests in rows_out:
        if how == "tessera":
            base[target] = seconds
        ratio = seconds / base[target]
        size = st_unique if target.startswith("safetensors") else unique
        print(
            f"| {target} | {how} | {seconds:.2f} | {served / 2**20:,.0f} MiB | {served / size:.2f} | "
            f"{requests:,} | {ratio:.2f}× |"
        )


if __name__ == "__main__":
    sys.exit(main())

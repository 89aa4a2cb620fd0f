"""`tessera.load` inside a torch job (exchange over the job's gloo group) against torch's own
`dcp.load` (FileSystemReader), into the same DTensor state dicts, in one 4-process gloo job on
127.0.0.1 (issue 14).

Checkpoint: TENSORS float32 2-D tensors of ROWS x COLS (default 8 x 4096 x 16384 = 2 GiB), saved by
torch's `dcp.save` at world 4 as FSDP-style Shard(0) DTensors, and the same state saved by
`tessera.save` as tessera's native checkpoint (the native conversion). Target layouts:

* ``shard0``: Shard(0) on 4 ranks (the saved layout);
* ``shard1``: Shard(1) on 4 ranks (every rank needs a column stripe of every saved row chunk);
* ``tp2dp2``: a 2-D (dp 2, tp 2) mesh, Replicate on dp and Shard(1) on tp.

Per layout and repetition, in this order: tessera.load from the DCP checkpoint, dcp.load from it,
tessera.load from the native checkpoint; after the torch job, the CLI (`tessera load --transport
tcp`, 4 rank processes: the command's wall time, process start and planning included) from each. Destinations are allocated and written once before the
timed call (both sides load into touched memory, so page faults are nobody's cost). Seconds: the
slowest rank's call (every rank starts after a barrier). Bytes read from storage:

* tessera: its reports' ``bytes_read`` and ``bytes_fetched`` (pieces + checksum-block extension)
  summed over ranks;
* dcp.load: what FileSystemReader reads, computed from the checkpoint's metadata (the whole
  ``torch.save`` blob of every chunk a rank's shard overlaps, once per rank and chunk);
* both: the ``rchar`` growth of ``/proc/self/io`` over the call, summed over ranks (bytes the
  process got from read syscalls, page cache hits included; mmap'd reads would not show).

The first repetition's local shards are hashed and compared across the three loads: a benchmark
of wrong bytes would be worthless.

Usage: python benches/torch_load.py [--data DIR] [--repeats 3] [--keep]
Environment: TENSORS, ROWS, COLS to change the checkpoint's size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench_util import dcp_blob_bytes, free_port, minor_faults, rchar, rss_gib, warm

WORLD = 4
TENSORS = int(os.environ.get("TENSORS", "8"))
ROWS = int(os.environ.get("ROWS", "4096"))
COLS = int(os.environ.get("COLS", "16384"))
LAYOUTS = os.environ.get("LAYOUTS", "shard0,shard1,tp2dp2").split(",")
# "tessera DCP exchange=False" (opt-in): every rank reads all it needs itself, no exchange;
# "tessera DCP read_order=auto" (or native, or storage/request): another read order than the default;
# "tessera native verify=False": without verification.
METHODS = os.environ.get("METHODS", "tessera DCP,dcp.load DCP,tessera native").split(",")
# The CLI (`tessera load --transport tcp`: 4 rank processes, its own rendezvous), run after the
# torch job on the same files; CLI="" leaves it out. TESSERA_BIN picks the binary.
CLI_METHODS = [m for m in os.environ.get("CLI", "tessera CLI DCP,tessera CLI native").split(",") if m]
TESSERA_BIN = os.environ.get("TESSERA_BIN", "target/release/tessera")

LAYOUT_JSON = {
    "shard0": {"mesh": [{"name": "dp", "size": 4}], "rules": [{"match": "*", "placements": ["shard(0)"]}]},
    "shard1": {"mesh": [{"name": "dp", "size": 4}], "rules": [{"match": "*", "placements": ["shard(1)"]}]},
    # (dp, tp) row-major, as torch's init_device_mesh numbers the ranks.
    "tp2dp2": {
        "mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}],
        "rules": [{"match": "*", "placements": ["replicate", "shard(1)"]}],
    },
}


def names():
    return [f"layer{i}.weight" for i in range(TENSORS)]


def target_state(layout: str, meshes: dict):
    """This rank's DTensor state dict for `layout`, destinations written (0xA5 bytes) so that
    the timed load pays no first-touch page faults."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, placements = {
        "shard0": (meshes["1d"], [Shard(0)]),
        "shard1": (meshes["1d"], [Shard(1)]),
        "tp2dp2": (meshes["2d"], [Replicate(), Shard(1)]),
    }[layout]
    shape = torch.Size([ROWS, COLS])
    stride = (COLS, 1)
    state = {}
    for name in names():
        # The local shape of `placements` (even splits here: ROWS, COLS divide by 4).
        local = [ROWS, COLS]
        for dim_size, p in zip(mesh.shape, placements):
            if isinstance(p, Shard):
                local[p.dim] //= dim_size
        t = torch.empty(local, dtype=torch.float32)
        t.view(torch.uint8).fill_(0xA5)
        state[name] = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
    return state


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in names():
        h.update(state[name].to_local().numpy().tobytes())
    return h.hexdigest()


def make_checkpoints(dcp_dir: str, native_dir: str, meshes: dict) -> None:
    """FSDP-style Shard(0) DTensors written by torch's dcp.save, and the same by tessera.save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    rows = ROWS // WORLD
    state = {}
    for i, name in enumerate(names()):
        # Distinct values per tensor, row and column (cheap to make: 2 GiB of randn would take
        # longer than the benchmark).
        local = torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS)
        local.mul_(1.0 / (i + 1)).add_(rank * rows * COLS + i)
        state[name] = DTensor.from_local(
            local, meshes["1d"], [Shard(0)], run_check=False, shape=torch.Size([ROWS, COLS]), stride=(COLS, 1)
        )
    started = time.monotonic()
    dcp.save(state, checkpoint_id=dcp_dir)
    dist.barrier()
    if rank == 0:
        print(f"dcp.save: {time.monotonic() - started:.1f} s", flush=True)
    import tessera

    started = time.monotonic()
    tessera.save(state, native_dir)
    dist.barrier()
    if rank == 0:
        print(f"tessera.save: {time.monotonic() - started:.1f} s", flush=True)


def run_one(method: str, layout: str, meshes: dict, paths: dict, hash_it: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tessera

    state = target_state(layout, meshes)
    dist.barrier()
    before = rchar()
    faults_before = minor_faults()
    started = time.perf_counter()
    if method == "dcp.load DCP":
        dcp.load(state, checkpoint_id=paths["dcp"])
        report = {}
    else:
        path = paths["native"] if method.startswith("tessera native") else paths["dcp"]
        exchange = False if method.endswith("exchange=False") else None
        # "... read_order=auto" (or storage/request) overrides the default read order.
        read_order = method.split("read_order=")[1].split()[0] if "read_order=" in method else None
        # "... verify=False": no checksums at all (the cost of verification, side by side).
        verify = "verify=False" not in method
        report = tessera.load(
            state, path, progress=False, timeout=600, exchange=exchange, read_order=read_order, verify=verify
        ).to_dict()
    seconds = time.perf_counter() - started
    faults = minor_faults() - faults_before
    read_syscalls = rchar() - before
    result = {
        "seconds": seconds,
        "rchar": read_syscalls,
        "faults": faults,
        "faults": faults,
        "bytes_needed": sum(v.to_local().numel() * 4 for v in state.values()),
        "bytes_read": report.get("bytes_read"),
        "bytes_fetched": report.get("bytes_fetched"),
        "bytes_received": report.get("bytes_received"),
        "read_seconds": report.get("read_seconds"),
        "exchange_seconds": report.get("exchange_seconds"),
    }
    if method == "dcp.load DCP":
        result["blob_bytes"] = dcp_blob_bytes(paths["dcp"], state)
    if hash_it:
        result["sha"] = digest(state)
    del state
    return result


def worker(rank: int, port: int, data: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # 4 processes on 2 cores: no thread oversubscription
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        meshes = {
            "1d": init_device_mesh("cpu", (WORLD,)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        }
        paths = {"dcp": os.path.join(data, "dcp"), "native": os.path.join(data, "native")}
        if not os.path.exists(os.path.join(paths["native"], "manifest.json")):
            make_checkpoints(paths["dcp"], paths["native"], meshes)
        for layout in LAYOUTS:
            for rep in range(repeats):
                for method in METHODS:
                    result = run_one(method, layout, meshes, paths, hash_it=rep == 0)
                    out[(layout, method, rep, rank)] = result
                    if rank == 0:
                        print(
                            f"{layout} rep {rep} {method}: {result['seconds']:.2f} s"
                            + (
                                f" (rank 0: read {result['read_seconds']:.2f} s, exchange {result['exchange_seconds']:.2f} s)"
                                if result.get("read_seconds") is not None
                                else ""
                            )
                            + f" (rank 0: {result['faults']} page faults, RSS {rss_gib():.2f} GiB)",
                            flush=True,
                        )
    finally:
        dist.destroy_process_group()


def safetensors_digest(path: str) -> str:
    """sha256 of a `--dump` file's tensors in `names()` order (what `digest` hashes in the job)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        h = hashlib.sha256()
        for name in names():
            start, end = header[name]["data_offsets"]
            f.seek(base + start)
            h.update(f.read(end - start))
    return h.hexdigest()


def run_cli(method: str, layout: str, data: str, hash_it: bool) -> list:
    """One `tessera load --transport tcp` of the 4 ranks; per rank: seconds (the command's wall
    time, process start and planning included, the same for every rank), its report, and (first
    repetition) the digest of what it loaded, from `--dump`."""
    import subprocess

    path = os.path.join(data, "native" if method.endswith("native") else "dcp")
    layout_path = os.path.join(data, f"{layout}.json")
    with open(layout_path, "w") as f:
        json.dump(LAYOUT_JSON[layout], f)
    report_path = os.path.join(data, "cli-report.json")
    dump = os.path.join(data, "cli-dump")
    cmd = [TESSERA_BIN, "load", path, "--layout", layout_path, "--transport", "tcp", "--quiet",
           "--report-json", report_path]
    if hash_it:
        cmd += ["--dump", dump]
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - started
    with open(report_path) as f:
        ranks = json.load(f)["ranks"]
    results = []
    for r in ranks:
        result = {
            "seconds": seconds,
            "rchar": None,  # other processes: not measured
            "bytes_needed": r["bytes_needed"],
            "bytes_read": r["bytes_read"],
            "bytes_fetched": r["bytes_fetched"],
            "bytes_received": r["bytes_received"],
            "read_seconds": r["read_seconds"],
            "exchange_seconds": r["exchange_seconds"],
        }
        if hash_it:
            result["sha"] = safetensors_digest(os.path.join(dump, f"rank-{r['rank']}.safetensors"))
        results.append(result)
    if hash_it:
        shutil.rmtree(dump)
    return results


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("BENCH_DATA", "target/bench-data/torch_load"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = parser.parse_args()
    os.makedirs(args.data, exist_ok=True)
    total = TENSORS * ROWS * COLS * 4
    print(f"checkpoint: {TENSORS} x [{ROWS}, {COLS}] float32 = {total:,} bytes; world {WORLD}", flush=True)

    out = mp.Manager().dict()
    # The checkpoints are written by a first job, then the page cache is warmed, then the loads
    # run in a second job (same code; it finds the checkpoints and skips writing).
    if not os.path.exists(os.path.join(args.data, "native", "manifest.json")):
        mp.spawn(worker, args=(free_port(), args.data, 0, out), nprocs=WORLD, join=True)
    warm(args.data)
    mp.spawn(worker, args=(free_port(), args.data, args.repeats, out), nprocs=WORLD, join=True)
    results = dict(out)
    for layout in LAYOUTS:
        for rep in range(args.repeats):
            for method in CLI_METHODS:
                for r, result in enumerate(run_cli(method, layout, args.data, hash_it=rep == 0)):
                    results[(layout, method, rep, r)] = result
                print(f"{layout} rep {rep} {method}: {result['seconds']:.2f} s", flush=True)

    rows = []
    for layout in LAYOUTS:
        shas = {}
        for method in METHODS + CLI_METHODS:
            per_rep = [[results[(layout, method, rep, r)] for r in range(WORLD)] for rep in range(args.repeats)]
            shas[method] = [per_rep[0][r]["sha"] for r in range(WORLD)]
            seconds = [max(x["seconds"] for x in ranks) for ranks in per_rep]
            first = per_rep[0]
            row = {
                "layout": layout,
                "method": method,
                "seconds": seconds,
                "median": statistics.median(seconds),
                "needed": sum(x["bytes_needed"] for x in first),
                "rchar": None if first[0]["rchar"] is None else sum(x["rchar"] for x in first),
            }
            if method == "dcp.load DCP":
                row["storage"] = sum(x["blob_bytes"] for x in first)
            else:
                row["storage"] = sum(x["bytes_read"] for x in first)
                row["fetched"] = sum(x["bytes_fetched"] for x in first)
                row["received"] = sum(x["bytes_received"] for x in first)
                # Where tessera's time went, median over repetitions of the slowest rank's.
                row["read_s"] = statistics.median(max(x["read_seconds"] for x in ranks) for ranks in per_rep)
                row["exchange_s"] = statistics.median(max(x["exchange_seconds"] for x in ranks) for ranks in per_rep)
            rows.append(row)
        if len({tuple(v) for v in shas.values()}) != 1:
            sys.exit(f"{layout}: the loads disagree on the bytes: {shas}")
    with open(os.path.join(args.data, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)

    print(
        "\n| layout | load | seconds (median of %d) | runs | read s / exchange s | bytes from storage "
        "| rchar (read syscalls) | exchanged | vs dcp.load |" % args.repeats
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        base = next(r for r in rows if r["layout"] == layout and r["method"] == "dcp.load DCP")
        for r in (x for x in rows if x["layout"] == layout):
            storage = f"{r['storage']:,}"
            if "fetched" in r:
                storage += f" (fetched {r['fetched']:,})"
            runs = ", ".join(f"{s:.2f}" for s in r["seconds"])
            split = f"{r['read_s']:.2f} / {r['exchange_s']:.2f}" if "read_s" in r else ""
            exchanged = f"{r['received']:,}" if "received" in r else ""
            print(
                f"| {layout} | {r['method']} | {r['median']:.2f} | {runs} | {split} | {storage} | {'' if r['rchar'] is None else format(r['rchar'], ',')} | "
                f"{exchanged} | {base['median'] / r['median']:.2f}x |"
            )
        print(f"| {layout} | (bytes needed by the ranks) | | | | {base['needed']:,} | | | |")
    if not args.keep:
        shutil.rmtree(args.data)


if __name__ == "__main__":
    main()

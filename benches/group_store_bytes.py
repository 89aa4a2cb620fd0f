"""What a process-group load costs the job's c10d store, per rank, as the world grows.

A real gloo job of W ranks (W = 4, 8, 16 by default: ``--worlds``) saves 200 float32 DTensors
[64, 256] Shard(0) with ``dcp.save`` and loads them back as Shard(1) with ``tessera.load`` over
the job's own group (the issue's reshard). Each rank wraps the store tessera's agreement uses
and counts the calls it makes and the bytes it reads and writes (gloo's own rendezvous is not
counted). Printed per W: mean and max bytes read and written per rank (rank 0, the coordinator,
apart), store calls per rank, and whether every rank's values equal what was saved.

    target/pyenv/bin/python benches/group_store_bytes.py --worlds 4,8,16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

# The rank's work is the test's (python/tests/conftest.py reshard_rank), with more tensors and a
# longer group timeout for 16 ranks on a small machine.
TENSORS = 200


def run(world: int) -> dict:
    from conftest import reshard_rank, run_job

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        return run_job(reshard_rank, world, (world, str(Path(tmp) / "ckpt"), TENSORS, 300.0), out, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="4,8,16")
    args = parser.parse_args()
    print("| ranks | read per rank (mean / max, rank 0 apart) | written per rank | store calls per rank | rank 0 read / written | values right |")
    print("|---|---|---|---|---|---|")
    for world in map(int, args.worlds.split(",")):
        results = run(world)
        others = [results[r] for r in range(1, world)]
        mean = lambda k: sum(o[k] for o in others) / len(others)  # noqa: E731
        print(
            f"| {world} | {mean('read') / 1024:.1f} / {max(o['read'] for o in others) / 1024:.1f} KiB "
            f"| {mean('written') / 1024:.1f} KiB | {mean('calls'):.0f} "
            f"| {results[0]['read'] / 1024:.1f} / {results[0]['written'] / 1024:.1f} KiB "
            f"| {all(r['right'] for r in results.values())} |",
            flush=True,
        )
        print(f"  rank 1 read by key: {results[1]['by_kind']}", flush=True)
        print(f"  rank 1 written by key: {results[1]['written_by_kind']}", flush=True)
        print(f"  rank 0 read by key: {results[0]['by_kind']}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TESSERA_LIVENESS_S", "30")
    main()

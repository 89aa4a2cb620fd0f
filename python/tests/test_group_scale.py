"""What a load over a torch process group costs the job's c10d store per rank does not grow with
the world where each rank's own share does not: a real gloo job of 2 and then 4 ranks loads
every float32 tensor of a DCP checkpoint whole on every rank (an eval job's load: each saved
chunk read once and passed on), counting what tessera's rounds read from and write to the store
on each rank. Rank 0 (the job's coordinator) reads every rank's hello; every other rank reads
its own answer (its rank plan) and two short words, whatever the world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import expected_tensors, fixture, join_job, reshard_rank, run_job

torch = pytest.importorskip("torch", reason="torch is not installed")

import tessera  # noqa: E402

C = "c_w4_dp2_tp2"


def _rank(rank: int, port: int, world: int, out: str) -> None:
    from conftest import counting_agreements, empty, sha256

    join_job(rank, world, port)
    counters = counting_agreements()
    tensors = {f: t for f, t in expected_tensors(C).items() if t["dtype"] == "float32"}
    state = {f: empty("float32", t["shape"]) for f, t in tensors.items()}
    tessera.load(state, str(fixture(C)), progress=False, timeout=120)
    right = all(sha256(state[f]) == t["sha256"] for f, t in tensors.items())
    store = counters[0]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"read": store.read, "by_kind": store.by_kind, "right": right}))


def test_a_rank_reads_no_more_of_the_store_at_four_ranks_than_at_two(tmp_path):
    reads = {}
    for world in (2, 4):
        out = tmp_path / f"w{world}"
        out.mkdir()
        results = run_job(_rank, world, (world,), out)
        for rank, result in results.items():
            assert result["right"], f"world {world} rank {rank}: wrong values"
        reads[world] = results
        for rank in range(1, world):
            kinds = results[rank]["by_kind"]
            # Its own answer and two words: nothing of any other rank's.
            assert set(kinds) == {"job/answer", "job/verdict", "job/joint"}, kinds
    two = max(reads[2][r]["read"] for r in range(1, 2))
    four = max(reads[4][r]["read"] for r in range(1, 4))
    assert four <= 1.5 * two, f"a rank read {four} bytes of the store at world 4 and {two} at world 2"
    # The coordinator reads every rank's hello: its share grows with the world.
    assert reads[4][0]["by_kind"]["job/hello"] > reads[2][0]["by_kind"]["job/hello"]


TENSORS = 100


def test_in_an_all_to_all_reshard_a_ranks_reads_grow_far_less_than_its_plan(tmp_path):
    """Saved Shard(0), loaded Shard(1): every rank needs a part of every saved shard, so its
    plan holds one piece per rank for every tensor and doubles from 2 ranks to 4. What it reads
    of the store (its answer, packed as columns of differences, and two words) must not."""
    reads = {}
    for world in (2, 4):
        out = tmp_path / f"w{world}"
        out.mkdir()
        results = run_job(reshard_rank, world, (world, str(tmp_path / f"ckpt{world}"), TENSORS, 60.0), out)
        for rank, result in results.items():
            assert result["right"], f"world {world} rank {rank}: wrong values"
            if rank:
                assert set(result["by_kind"]) == {"job/answer", "job/verdict", "job/joint"}, result["by_kind"]
        reads[world] = max(results[r]["read"] for r in range(1, world))
    assert reads[4] <= 1.5 * reads[2], f"a rank read {reads[4]} bytes of the store at world 4 and {reads[2]} at world 2"

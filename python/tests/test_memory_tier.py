"""Resume from memory, resharded (issue 33): real torch, gloo, processes standing in for nodes by
their memory-tier directories.

A 4-rank job on two "nodes" (ranks 0-1: tier A, ranks 2-3: tier B) saves steps 1-3 as FSDP
Shard(0) DTensors with ``memory_tier=``; the job ends. A 3-rank job with another layout
(Shard(1)) then loads step 3 with ``memory_tier=`` (its ranks 0-1 on node A, rank 2 on node B)
while the tiers are changed between loads: every load's bytes equal the durable checkpoint's,
every byte is read once, and the bytes read from storage are exactly what no surviving tier
holds intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import free_port, join_job, run_job

import torch  # noqa: E402  (make python-test installs it)

import tessera  # noqa: E402

SHAPES = {"w1": ((64, 48), torch.float32), "w2": ((32, 48), torch.bfloat16), "emb": ((40, 24), torch.float32)}
TOTAL = sum(torch.empty(s, dtype=d).nbytes for s, d in SHAPES.values())


def _full(name: str, step: int) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = shape[0] * shape[1]
    index = list(SHAPES).index(name)
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * (step + 1) + index).to(dtype)


def _save_rank(rank: int, port: int, rendezvous_port: int, root: str, tiers: list, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    join_job(rank, 4, port)
    os.environ.update(MASTER_ADDR="127.0.0.1", TESSERA_PORT=str(rendezvous_port))
    mesh = init_device_mesh("cpu", (4,))
    tier = tiers[rank // 2]
    result: dict = {}
    try:
        for step in (1, 2, 3):
            state = {k: distribute_tensor(_full(k, step), mesh, [Shard(0)]) for k in SHAPES}
            state["step"] = step
            path = str(Path(root) / f"step-{step}")
            if step == 2:
                report = tessera.async_save(
                    state, path, process_group=dist.group.WORLD, step=step, memory_tier=tier, timeout=60
                ).result(timeout=120)
            else:
                report = tessera.save(state, path, process_group=dist.group.WORLD, step=step, memory_tier=tier, timeout=60)
            result[step] = report.memory_tier
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _copies(tier: Path, step: int) -> list:
    """The data files of step ``step``'s copy in ``tier``."""
    return sorted(str(p) for p in tier.glob(f"step-{step}-*/data/*.bin"))


def _load_rank(rank: int, port: int, rendezvous_port: int, root: str, tiers: list, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    join_job(rank, 3, port)
    os.environ.update(MASTER_ADDR="127.0.0.1", TESSERA_PORT=str(rendezvous_port))
    mesh = init_device_mesh("cpu", (3,))
    tier = Path(tiers[0] if rank < 2 else tiers[1])
    tier_a, tier_b = Path(tiers[0]), Path(tiers[1])
    results: dict = {}

    def load(name: str) -> None:
        dest = {k: distribute_tensor(torch.zeros(s, dtype=d), mesh, [Shard(1)]) for k, (s, d) in SHAPES.items()}
        dest["step"] = 0
        report = tessera.load(
            dest, str(Path(root) / "step-3"), process_group=dist.group.WORLD, memory_tier=tier,
            progress=False, timeout=60,
        )
        wrong = [k for k in SHAPES if not torch.equal(dest[k].full_tensor(), _full(k, 3))]
        results[name] = {
            "wrong": wrong, "step": dest["step"], "read": report.bytes_read,
            "tier": report.bytes_from_memory_tier, "storage": report.bytes_from_storage,
            "ignored": report.memory_tier_ignored,
        }

    def between(change) -> None:
        dist.barrier()
        if rank == 0:
            change()
        dist.barrier()

    try:
        load("all tiers")
        # One flipped byte in node A's copy of old rank 0's file (its first box's bytes).
        first = _copies(tier_a, 3)[0]
        original = Path(first).read_bytes()
        flipped = bytearray(original)
        flipped[5] ^= 0x10
        between(lambda: Path(first).write_bytes(bytes(flipped)))
        load("flipped byte")
        # Node B lost step 3's copies (it still holds step 2's): mended A, step 3 of B from storage.
        def lose_b() -> None:
            Path(first).write_bytes(original)
            for d in tier_b.glob("step-3-*"):
                shutil.rmtree(d)

        between(lose_b)
        load("node B lost")
    except Exception as e:  # noqa: BLE001 - reported to the test
        results["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _sum(got: dict, scenario: str, field: str) -> int:
    return sum(got[r][scenario][field] for r in got)


def test_a_resharded_resume_reads_what_survives_in_memory_and_storage_only_for_the_rest(tmp_path):
    root, tier_a, tier_b = tmp_path / "ckpt", tmp_path / "node-a", tmp_path / "node-b"
    tiers = [str(tier_a), str(tier_b)]
    (tmp_path / "save").mkdir()
    saved = run_job(_save_rank, 4, (free_port(), str(root), tiers), tmp_path / "save")
    for rank in range(4):
        assert "error" not in saved[rank], saved[rank]
        assert saved[rank]["3"]["path"] and not saved[rank]["3"]["skipped"], saved[rank]
    # Each node holds its two ranks' files of the newest two steps (the default budget).
    for tier, ranks in ((tier_a, (0, 1)), (tier_b, (2, 3))):
        assert sorted(p.name[:6] for p in tier.iterdir()) == ["step-2", "step-3"]
        assert [Path(p).name for p in _copies(tier, 3)] == [f"rank-{r}.bin" for r in ranks]

    (tmp_path / "load").mkdir()
    got = run_job(_load_rank, 3, (free_port(), str(root), tiers), tmp_path / "load")
    for rank in range(3):
        assert "error" not in got[rank], got[rank]
        for scenario, result in got[rank].items():
            assert result["wrong"] == [] and result["step"] == 3, (rank, scenario, result)
            assert result["tier"] + result["storage"] == result["read"], (rank, scenario, result)
    quarter = TOTAL // 4  # each old rank saved a quarter of every tensor's rows
    for scenario, from_storage in (("all tiers", 0), ("flipped byte", quarter), ("node B lost", 2 * quarter)):
        # Every byte read once, by some rank of the new job.
        assert _sum(got, scenario, "read") == TOTAL, scenario
        assert _sum(got, scenario, "storage") == from_storage, (scenario, got)
        assert _sum(got, scenario, "tier") == TOTAL - from_storage, scenario
    # The damaged copy is named by the ranks of the node that holds it, and only there.
    for rank in (0, 1):
        (why,) = got[rank]["flipped byte"]["ignored"]
        assert "rank-0.bin" in why and "does not match the checkpoint's checksum" in why, why
    assert got[2]["flipped byte"]["ignored"] == []
    assert all(got[r]["all tiers"]["ignored"] == [] and got[r]["node B lost"]["ignored"] == [] for r in got)


def test_a_single_process_load_reads_its_tier_and_a_server_cannot_plan_with_it(tmp_path):
    import numpy as np

    root, tier = tmp_path / "ckpt", tmp_path / "tier"
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    report = tessera.save({"w": w, "n": 7}, str(root / "step-1"), step=1, memory_tier=tier)
    assert report.memory_tier["bytes"] == w.nbytes and report.memory_tier["pruned"]["removed"] == []
    out = {"w": np.zeros_like(w), "n": 0}
    loaded = tessera.load(out, str(root / "step-1"), memory_tier=tier, progress=False)
    assert np.array_equal(out["w"], w) and out["n"] == 7
    assert (loaded.bytes_from_memory_tier, loaded.bytes_from_storage) == (w.nbytes, 0)
    # The durable file's tensors are not read: a load of them from the tier works without it
    # (non-tensor values are read from storage).
    os.remove(root / "step-1" / "data" / "rank-0.bin")
    only = {"w": np.zeros_like(w)}
    tessera.load(only, str(root / "step-1"), memory_tier=tier, progress=False)
    assert np.array_equal(only["w"], w)
    # Without the tier the missing file is an error naming it.
    with pytest.raises(tessera.TesseraError, match="rank-0.bin"):
        tessera.load(only, str(root / "step-1"), progress=False)
    # Budget: keep=1 drops step 1's copy when step 2 is saved.
    report = tessera.save({"w": w * 2, "n": 8}, str(root / "step-2"), step=2, memory_tier=tier, memory_tier_keep=1)
    assert [Path(p).name[:6] for p in report.memory_tier["pruned"]["removed"]] == ["step-1"]
    with pytest.raises(ValueError, match="memory_tier_keep=0"):
        tessera.save({"w": w}, str(root / "step-3"), memory_tier=tier, memory_tier_keep=0)
    with pytest.raises(tessera.TesseraError, match="cannot be used with server=http://127.0.0.1:9: load without a server"):
        tessera.load(out, str(root / "step-2"), memory_tier=tier, server="http://127.0.0.1:9", progress=False)


def _killed_rank(rank: int, port: int, rendezvous_port: int, root: str, tier: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tessera import _async_save

    join_job(rank, 2, port)
    os.environ.update(MASTER_ADDR="127.0.0.1", TESSERA_PORT=str(rendezvous_port))
    mesh = init_device_mesh("cpu", (2,))
    result: dict = {}
    state = {k: distribute_tensor(_full(k, 1), mesh, [Shard(0)]) for k in SHAPES}
    tessera.save(state, str(Path(root) / "step-1"), process_group=dist.group.WORLD, step=1, memory_tier=tier, timeout=30)
    if rank == 1:
        # This rank dies in the middle of step 2's snapshot: nothing of step 2 is committed.
        def die(*_args):
            os._exit(9)

        _async_save._copy_entry = die
    state = {k: distribute_tensor(_full(k, 2), mesh, [Shard(0)]) for k in SHAPES}
    try:
        tessera.save(state, str(Path(root) / "step-2"), process_group=dist.group.WORLD, step=2, memory_tier=tier, timeout=10)
        result = {"saved": True}
    except tessera.TesseraError as e:
        result = {"failed": str(e)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_save_killed_before_its_commit_leaves_no_copy_that_counts(tmp_path):
    import multiprocessing as mp

    from conftest import job_store

    root, tier = tmp_path / "ckpt", tmp_path / "tier"
    store = job_store(2)
    ctx = mp.get_context("spawn")
    port = free_port()  # tessera's save rendezvous, one for both ranks
    procs = [
        ctx.Process(target=_killed_rank, args=(r, store.port, port, str(root), str(tier), str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[1].exitcode == 9 and procs[0].exitcode == 0, [p.exitcode for p in procs]
    assert "failed" in json.loads((tmp_path / "rank0.json").read_text())
    # Step 1's copies are the only ones that count; nothing of step 2 is presented.
    assert [p.name[:6] for p in tier.iterdir()] == ["step-1"]
    assert not list(tier.glob("**/*.tier.json.partial"))
    out = {k: torch.zeros(s, dtype=d) for k, (s, d) in SHAPES.items()}
    report = tessera.load(out, str(root / "step-1"), memory_tier=tier, progress=False)
    assert all(torch.equal(out[k], _full(k, 1)) for k in SHAPES)
    assert (report.bytes_from_memory_tier, report.bytes_from_storage) == (TOTAL, 0)
    with pytest.raises(tessera.TesseraError):
        tessera.load(out, str(root / "step-2"), memory_tier=tier, progress=False)


def _own_rendezvous_rank(rank: int, port: int, root: str, tier: str, out: str) -> None:
    import numpy as np

    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    part = {"w": np.zeros((64, 32), np.float32)}
    try:
        report = tessera.load(
            part, root, rank=rank, world_size=2, exchange=True, master_addr="127.0.0.1", master_port=port,
            memory_tier=tier if rank == 0 else None, progress=False, timeout=60,
        )
        result = {"right": bool(np.array_equal(part["w"], w)),
                  "tier": report.bytes_from_memory_tier, "storage": report.bytes_from_storage}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": str(e)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def test_an_own_rendezvous_job_reads_the_copies_of_the_node_that_holds_them(tmp_path):
    # Without torch.distributed (exchange=True): rank 0's node holds the whole checkpoint, rank 1
    # has no tier; both want all of it: rank 0 reads it once from its tier and passes it on.
    import multiprocessing as mp

    import numpy as np

    root, tier = tmp_path / "ckpt", tmp_path / "tier"
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    tessera.save({"w": w}, str(root), memory_tier=tier)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_own_rendezvous_rank, args=(r, port, str(root), str(tier), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    assert got[0] == {"right": True, "tier": w.nbytes, "storage": 0}, got
    assert got[1] == {"right": True, "tier": 0, "storage": 0}, got


def test_a_partial_read_next_to_a_plain_value_verifies_against_the_copy(tmp_path):
    # The last rows of `w` share a checksum block with the plain value stored after it: a read
    # of those rows is verified by the whole block, so the copy must hold the value's bytes too.
    import numpy as np

    root, tier = tmp_path / "ckpt", tmp_path / "tier"
    w = np.arange(100 * 1000, dtype=np.float32).reshape(100, 1000)
    tessera.save({"w": w, "n": {"step": 7, "note": "x" * 100}}, str(root), memory_tier=tier)
    tail = (np.zeros((2, 1000), np.float32), [98, 0])
    report = tessera.load({"w": tail}, str(root), memory_tier=tier, progress=False)
    assert np.array_equal(tail[0], w[98:])
    assert (report.bytes_from_memory_tier, report.bytes_from_storage) == (tail[0].nbytes, 0)
    assert report.memory_tier_ignored == []


def test_memory_tier_arguments_that_cannot_be_are_value_errors_naming_them(tmp_path, monkeypatch):
    # Issue 41 item 14: memory_tier="" wrote into the current directory; counts past 2**64 - 1
    # raised a bare OverflowError; steps=10**6 was taken (1.3 GiB of bookkeeping).
    import numpy as np

    monkeypatch.chdir(tmp_path)
    w = np.ones(64, np.float32)
    with pytest.raises(ValueError, match=r"memory_tier='': an empty path would be the current directory"):
        tessera.save({"w": w}, str(tmp_path / "a"), memory_tier="")
    with pytest.raises(ValueError, match=r"memory_tier='': an empty path"):
        tessera.load({"w": w}, str(tmp_path / "a"), memory_tier="", progress=False)
    assert list(tmp_path.iterdir()) == [], "nothing is written anywhere"
    for name in ("memory_tier_keep", "memory_tier_max_bytes"):
        with pytest.raises(ValueError, match=rf"{name}=18446744073709551616: more than the largest value"):
            tessera.save({"w": w}, str(tmp_path / "a"), memory_tier=tmp_path / "tier", **{name: 2**64})
    with pytest.raises(ValueError, match=r"memory_tier_keep=1.5: not an integer"):
        tessera.save({"w": w}, str(tmp_path / "a"), memory_tier=tmp_path / "tier", memory_tier_keep=1.5)
    assert list(tmp_path.iterdir()) == []
    # The largest budget there is, is one.
    report = tessera.save({"w": w}, str(tmp_path / "a"), memory_tier=tmp_path / "tier", memory_tier_max_bytes=2**64 - 1)
    assert report.memory_tier["bytes"] == w.nbytes

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"steps=1000000: a multi-step snapshot spreads its copy over at most 1024"):
        tessera.async_save(
            {"model": model}, str(tmp_path / "b"), snapshot="multi_step", steps=10**6, optimizer=optimizer
        )
    assert not (tmp_path / "b").exists()


def test_a_relative_memory_tier_saves_and_loads_like_an_absolute_one(tmp_path, monkeypatch):
    # Issue 41 item 13: a relative tier failed every load ("Unable to convert path ... to URL").
    import numpy as np

    monkeypatch.chdir(tmp_path)
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    report = tessera.save({"w": w}, "ckpt/step-1", step=1, memory_tier="tier")
    assert Path(report.memory_tier["path"]).is_relative_to(tmp_path / "tier")
    out = {"w": np.zeros_like(w)}
    loaded = tessera.load(out, "ckpt/step-1", memory_tier="tier", progress=False)
    assert np.array_equal(out["w"], w)
    assert (loaded.bytes_from_memory_tier, loaded.bytes_from_storage) == (w.nbytes, 0)
    assert loaded.memory_tier_ignored == []


def test_a_tier_that_holds_checkpoints_is_refused_before_the_save_writes(tmp_path):
    # Issue 41 item 6: memory_tier= set to the checkpoints' root had the third save's prune delete
    # the committed steps 1 and 2 (every folder without a tier record looked like a dead save's).
    import numpy as np

    root = tmp_path / "run"
    w = np.ones(1024, np.float32)
    for step in (1, 2):
        tessera.save({"w": w * step}, str(root / f"step-{step}"), step=step)
    with pytest.raises(tessera.TesseraError, match=rf"memory tier {re.escape(str(root))}: the checkpoint being saved"):
        tessera.save({"w": w * 3}, str(root / "step-3"), step=3, memory_tier=root)
    assert not (root / "step-3" / "manifest.json").exists()
    for step in (1, 2):
        out = {"w": np.zeros_like(w)}
        tessera.load(out, str(root / f"step-{step}"), progress=False)
        assert np.array_equal(out["w"], w * step)
    # A tier shared with another program: its folder outlives every save's prune.
    tier = tmp_path / "shm"
    foreign = tier / "other-program"
    foreign.mkdir(parents=True)
    (foreign / "state").write_bytes(b"theirs")
    for step in (1, 2, 3):
        tessera.save({"w": w * step}, str(tmp_path / "ok" / f"step-{step}"), step=step, memory_tier=tier, memory_tier_keep=1)
    assert (foreign / "state").read_bytes() == b"theirs"
    assert sorted(p.name[:7] for p in tier.iterdir() if p != foreign) == ["step-3-"]


def test_a_fifo_in_place_of_a_copy_is_read_from_storage_instead_of_waited_on(tmp_path):
    # Issue 41 item 7: a FIFO where a copy was hung every load in open(2), past every timeout. The
    # load runs in a child process, bounded, so that a hang fails the test instead of stalling it.
    import subprocess
    import sys
    import textwrap

    import numpy as np

    root, tier = tmp_path / "ckpt", tmp_path / "tier"
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    tessera.save({"w": w}, str(root), memory_tier=tier)
    [copy] = list(tier.glob("*/data/*.bin"))
    copy.unlink()
    os.mkfifo(copy)
    script = textwrap.dedent(
        f"""
        import json, warnings
        import numpy as np
        import tessera
        out = {{"w": np.zeros((64, 64), np.float32)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = tessera.load(out, {str(root)!r}, memory_tier={str(tier)!r}, progress=False, timeout=30)
        print(json.dumps({{"sum": float(out["w"].sum()), "tier": report.bytes_from_memory_tier,
                           "storage": report.bytes_from_storage, "ignored": report.memory_tier_ignored}}))
        """
    )
    try:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("tessera.load(memory_tier=) with a FIFO in place of a copy did not end within 120 s")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["sum"] == float(w.sum())
    assert (got["tier"], got["storage"]) == (0, w.nbytes)
    assert len(got["ignored"]) == 1 and str(copy) in got["ignored"][0] and "a FIFO" in got["ignored"][0], got

"""tessera.async_save with real torch on CPU: a training loop over a gloo group that checkpoints
every step while it trains, the snapshot/mutation boundary, balanced writes, and faults (a rank
killed mid-persist, storage that refuses writes, the whole job killed with SIGKILL, then gc)."""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import TESSERA_BIN, free_port

import torch  # noqa: E402  (make python-test installs it)

import tessera  # noqa: E402

WORLD = 3
STEPS = 4
SHARD_ROWS = 8  # rows of the sharded tensor per rank


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same replicated parameters on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def _train_rank(rank: int, world: int, port: int, root: str, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    # Each rank also owns rows of a sharded tensor (a ZeRO-like shard), updated every step.
    shard = torch.full((SHARD_ROWS, 16), float(rank))
    shape = [SHARD_ROWS * world, 16]
    expected = {}
    handles = []
    torch.manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        state = {
            "model": model.state_dict(),
            "shard": (shard, [rank * SHARD_ROWS, 0], shape),
            "step": step,
        }
        expected[step] = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "shard": shard.clone(),
        }
        handle = tessera.async_save(state, f"{root}/step-{step}", process_group=dist.group.WORLD, step=step, timeout=60)
        # Forward/backward while the snapshot copies run: they only read the parameters.
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        handle.wait_snapshot(timeout=60)
        # The snapshot is taken: the parameters and the shard change now, in place.
        optim.step()
        shard.add_(1000.0)
        handles.append(handle)
    reports = [h.result(timeout=120) for h in handles]
    out[rank] = {
        "expected": {s: {"model": {k: v.numpy() for k, v in e["model"].items()}, "shard": e["shard"].numpy()}
                     for s, e in expected.items()},
        "manifests": [r.manifest for r in reports],
        "steps": [r["step"] for r in reports],
        "staged": [r.staged_bytes for r in reports],
        "allocations": tessera._async_save.default_pool().allocations,
    }
    dist.destroy_process_group()


def test_training_loop_saves_every_step_and_each_checkpoint_loads_back(tmp_path):
    import torch.multiprocessing as mp

    root = tmp_path / "run"
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_train_rank, args=(WORLD, free_port(), str(root), out), nprocs=WORLD, join=True)
    assert sorted(out.keys()) == list(range(WORLD))
    for rank in range(WORLD):
        assert out[rank]["steps"] == list(range(1, STEPS + 1))
        # The pool was allocated once and reused by every later save.
        assert out[rank]["allocations"] == 1
    assert (root / "latest").read_text().strip() == f"step-{STEPS}"
    names = [k for k in out[0]["expected"][1]["model"]]
    for step in range(1, STEPS + 1):
        manifests = [out[r]["manifests"][step - 1] for r in range(WORLD)]
        assert all(m == manifests[0] for m in manifests)
        # Replicated parameters written once each, plus one box per rank of the shard.
        assert manifests[0]["chunks"] == len(names) + WORLD
        assert manifests[0]["step"] == step
        loaded = {"model": {k: torch.empty_like(torch.from_numpy(out[0]["expected"][step]["model"][k])) for k in names},
                  "shard": torch.empty(SHARD_ROWS * WORLD, 16), "step": -1}
        tessera.load(loaded, str(root / f"step-{step}"), progress=False)
        for k in names:
            # Every rank trained to the same values; the checkpoint holds them as they were
            # before that step's optimizer step (the mutation after wait_snapshot is not in it).
            want = out[0]["expected"][step]["model"][k]
            assert np.array_equal(loaded["model"][k].numpy(), want), (step, k)
        for rank in range(WORLD):
            rows = loaded["shard"][rank * SHARD_ROWS : (rank + 1) * SHARD_ROWS].numpy()
            assert np.array_equal(rows, out[rank]["expected"][step]["shard"]), (step, rank)
            assert float(rows[0, 0]) == rank + 1000.0 * (step - 1)
        assert loaded["step"] == step


def _balanced_rank(args):
    rank, world, port, path = args
    # Twelve replicated tensors of unequal sizes held by every rank: each is written once, and
    # worst-fit spreads them so that no rank writes much more than the mean.
    state = {f"layer{i}.w": np.full((64 * (1 + i % 4), 256), i, dtype=np.float32) for i in range(12)}
    report = tessera.save(state, path, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, timeout=60)
    return report.manifest


def test_replicated_boxes_are_written_once_and_balanced(tmp_path):
    path = str(tmp_path / "run" / "step-1")
    world, port = 3, free_port()
    with multiprocessing.get_context("spawn").Pool(world) as pool:
        manifests = pool.map(_balanced_rank, [(r, world, port, path) for r in range(world)])
    manifest = manifests[0]
    assert manifest["chunks"] == 12  # once each, not once per rank
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    assert sorted(sizes) == [f"data/rank-{r}.bin" for r in range(world)]
    for name, size in sizes.items():
        assert os.path.getsize(os.path.join(path, name)) == size
    total = sum(sizes.values())
    replicated_bytes = sum(64 * (1 + i % 4) * 256 * 4 for i in range(12))
    assert total >= replicated_bytes and total < 2 * replicated_bytes
    ratio = max(sizes.values()) / (total / world)
    print(f"write bytes per rank: {sorted(sizes.values())}, max/mean {ratio:.3f}")
    assert ratio <= 1.2, sizes


def test_snapshot_holds_values_from_before_mutation_and_pool_bound(tmp_path, monkeypatch):
    w = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    b = torch.ones(3, dtype=torch.bfloat16)
    v = np.arange(10, dtype=np.int64)
    handle = tessera.async_save({"w": w, "b": b, "v": v, "nc": w.t()}, str(tmp_path / "step-1"))
    handle.wait_snapshot(timeout=30)
    w.mul_(-1)
    b.zero_()
    v[:] = 0
    report = handle.result(timeout=60)
    assert handle.done() and handle.wait(0)
    assert report.staged_bytes == 4096 * 4 * 2 + 3 * 2 + 10 * 8
    got = {"w": torch.empty(64, 64), "b": torch.empty(3, dtype=torch.bfloat16), "v": np.empty(10, np.int64),
           "nc": torch.empty(64, 64)}
    tessera.load(got, str(tmp_path / "step-1"), progress=False)
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64))
    assert torch.equal(got["nc"], got["w"].t())  # a non-contiguous tensor, copied through the pool
    assert torch.equal(got["b"], torch.ones(3, dtype=torch.bfloat16))
    assert np.array_equal(got["v"], np.arange(10))

    with pytest.raises(tessera.TesseraError) as bound:
        tessera.async_save({"w": w}, str(tmp_path / "step-2"), pool_bytes=1000)
    assert "rank 0: the state to save at" in str(bound.value)
    assert "needs 16,384 bytes of staging memory but the save pool is bounded to 1,000 bytes" in str(bound.value)
    assert not (tmp_path / "step-2").exists()
    pool = tessera.StagingPool(max_bytes=100)
    with pytest.raises(tessera.TesseraError, match="bounded to 100 bytes"):
        tessera.async_save({"w": w}, str(tmp_path / "step-3"), pool=pool)


def test_second_save_waits_for_the_first_persist(tmp_path):
    big = torch.ones(4 * 2**20)  # 16 MiB
    first = tessera.async_save({"x": big}, str(tmp_path / "step-1"))
    second = tessera.async_save({"x": big}, str(tmp_path / "step-2"))
    # The call returned only after the first persist ended: one save in flight per process.
    assert first.done()
    assert second.result(timeout=60).waited_seconds >= 0.0
    assert first.result().manifest["step"] == 1 and second.result().manifest["step"] == 2
    assert (tmp_path / "latest").read_text() == "step-2"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the pinned-pool D2H snapshot is untested here")
def test_cuda_tensors_snapshot_through_the_pinned_pool(tmp_path):
    w = torch.arange(2**20, dtype=torch.float32, device="cuda")
    handle = tessera.async_save({"w": w}, str(tmp_path / "step-1"))
    handle.wait_snapshot(timeout=60)
    w.zero_()
    handle.result(timeout=60)
    assert tessera._async_save.default_pool().pinned
    got = torch.empty(2**20)
    tessera.load({"w": got}, str(tmp_path / "step-1"), progress=False)
    assert torch.equal(got, torch.arange(2**20, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------


BIG_ROWS = 64 * 2**20 // 32  # 64 MiB of float32 rows of 8


def _faulty_rank(rank, world, port, root, die_rank, out):
    state = {"w": (np.full((4, 8), rank, np.float32), [4 * rank, 0], [4 * world, 8])}
    kw = dict(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, timeout=20)
    tessera.save(state, f"{root}/step-1", **kw)
    if rank == die_rank:
        # Large enough that its data file is still being written (object_store's staging file
        # `rank-<r>.bin#<n>` exists) when this rank dies: it never reports to rank 0.
        state["big"] = np.ones((BIG_ROWS, 8), np.float32)

    def die_mid_write():
        pattern = f"{root}/step-2/data/rank-{rank}.bin#*"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if glob.glob(pattern):
                os._exit(9)
            time.sleep(0.0005)

    if rank == die_rank:
        threading.Thread(target=die_mid_write, daemon=True).start()
    started = time.monotonic()
    handle = tessera.async_save(state, f"{root}/step-2", **kw)
    try:
        handle.result(timeout=90)
        out[rank] = ("committed", time.monotonic() - started)
    except tessera.TesseraError as e:
        out[rank] = (str(e), time.monotonic() - started)


def test_a_rank_killed_during_persist_commits_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Manager().dict()
    root = str(tmp_path / "run")
    port = free_port()
    procs = [ctx.Process(target=_faulty_rank, args=(r, WORLD, port, root, 2, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0, 9]
    assert sorted(out.keys()) == [0, 1]
    for rank in (0, 1):
        message, seconds = out[rank]
        assert message.startswith(f"rank {rank} saving {root}/step-2: "), message
        assert "rank 2" in message, message
        assert seconds < 60, (rank, seconds)  # failed well within the handle's timeout
    assert not os.path.exists(f"{root}/step-2/manifest.json")
    assert open(f"{root}/latest").read() == "step-1"
    # The claim was released with the failure; what is left is data without a manifest: gc's.
    assert not os.path.exists(f"{root}/step-2/.tessera-claim.json")
    w = np.empty((4 * WORLD, 8), np.float32)
    tessera.load({"w": w}, f"{root}/step-1", progress=False)
    assert np.array_equal(w[:, 0], np.repeat(np.arange(WORLD, dtype=np.float32), 4))


def _unwritable_rank(args):
    rank, world, port, root = args
    state = {"w": (np.full((4, 8), rank, np.float32), [4 * rank, 0], [4 * world, 8]), "b": np.ones(3)}
    kw = dict(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, timeout=30)
    tessera.save(state, f"{root}/step-1", **kw)
    # step-2/data is a file: the claim can be taken, but no data file can be created under it.
    if rank == 0:
        os.makedirs(f"{root}/step-2")
        open(f"{root}/step-2/data", "w").close()
    time.sleep(0.5)
    try:
        tessera.async_save(state, f"{root}/step-2", **kw).result(timeout=60)
        return "committed"
    except tessera.TesseraError as e:
        return str(e)


def test_storage_that_refuses_writes_commits_nothing(tmp_path):
    root = str(tmp_path / "run")
    port = free_port()
    with multiprocessing.get_context("spawn").Pool(WORLD) as pool:
        messages = pool.map(_unwritable_rank, [(r, WORLD, port, root) for r in range(WORLD)])
    for rank, message in enumerate(messages):
        assert message != "committed"
        assert message.startswith(f"rank {rank} saving {root}/step-2: "), message
        # Every rank failed writing its own data file, and its error names it and the cause.
        assert f"writing step-2/data/rank-{rank}.bin" in message, message
        assert "Not a directory" in message, message
    assert not os.path.exists(f"{root}/step-2/manifest.json")
    assert not os.path.exists(f"{root}/step-2/.tessera-claim.json")
    assert open(f"{root}/latest").read() == "step-1"


KILLED_JOB = r"""
import sys, numpy as np, tessera
root = sys.argv[1]
tessera.save({"w": np.zeros(16, np.float32)}, f"{root}/step-1")
state = {"w": np.ones(256 * 2**20 // 4, np.float32)}   # 256 MiB: the write takes a while
handle = tessera.async_save(state, f"{root}/step-2")
handle.wait_snapshot()
print("snapshot", flush=True)
handle.result()
print("committed", flush=True)
"""


def test_a_job_killed_mid_persist_leaves_nothing_visible_and_gc_removes_it(tmp_path, plan_server):
    catalog, url = plan_server
    root = catalog / "job"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_JOB, str(root)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "snapshot"
    deadline = time.monotonic() + 60
    while not glob.glob(f"{root}/step-2/data/rank-0.bin#*"):
        assert time.monotonic() < deadline, "the data file's upload never started"
        assert proc.poll() is None, "the job ended before it could be killed"
        time.sleep(0.0005)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert (root / "step-2" / ".tessera-claim.json").exists()
    assert not (root / "step-2" / "manifest.json").exists()
    assert (root / "latest").read_text() == "step-1"

    # The server's catalog shows it as incomplete, never committed; the latest stays step-1.
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/checkpoints", timeout=10) as answer:
        rows = {c["id"]: c for c in json.loads(answer.read())["checkpoints"]}
    assert rows["job/step-2"]["status"] == "incomplete" and rows["job/step-2"]["committed"] is False
    assert rows["job/step-1"]["committed"] is True and rows["job/step-1"]["latest"] is True
    inspect = subprocess.run([str(TESSERA_BIN), "inspect", str(root / "step-2")], capture_output=True, text=True)
    assert inspect.returncode != 0 and "manifest" in inspect.stderr, inspect.stderr

    gc = subprocess.run([str(TESSERA_BIN), "gc", str(catalog), "--json"], capture_output=True, text=True)
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert [r["path"] for r in report["removed"]] == ["job/step-2"]
    assert f"pid {proc.pid} is not running on this host" in report["removed"][0]["reason"]
    assert report["kept"] == []
    assert not (root / "step-2").exists()
    w = np.empty(16, np.float32)
    tessera.load({"w": w}, str(root / "step-1"), progress=False)
    assert np.array_equal(w, np.zeros(16, np.float32))


# Storage faults injected into the store the save writes through (TESSERA_TEST_FAULTS; the module
# is built with the `fault-injection` feature by `make python-test`, and a build without it
# refuses to save while the variable is set, so these tests cannot pass without faults).

FAULTS_ENV = "TESSERA_TEST_FAULTS"


@pytest.mark.parametrize(
    "spec, rows",
    [
        # One-request files (data, metadata, checksums, manifest, latest): each failed put is
        # retried by the store.
        ("write_every_nth:3", 64),
        # A 12 MiB data file goes up in parts (start, two parts, completion); a failed part makes
        # the rank write the whole file again from its snapshot.
        ("write_every_nth:5", 12 * 2**20 // (4 * 64)),
    ],
    ids=["one_request_files", "multipart_file"],
)
def test_transient_write_faults_are_retried_and_the_save_commits(tmp_path, monkeypatch, spec, rows):
    monkeypatch.setenv(FAULTS_ENV, spec)
    w = torch.arange(rows * 64, dtype=torch.float32).reshape(rows, 64)
    v = np.arange(1000, dtype=np.int64)
    report = tessera.async_save({"w": w, "v": v, "step": 7}, str(tmp_path / "run" / "step-7")).result(timeout=120)
    # Faults really were injected, and each cost one retry (of a request or of the whole file).
    assert report.injected_write_faults is not None and report.injected_write_faults >= 1, report
    assert report.write_retries == report.injected_write_faults, report
    monkeypatch.delenv(FAULTS_ENV)
    assert (tmp_path / "run" / "latest").read_text() == "step-7"
    got = {"w": torch.empty(rows, 64), "v": np.empty(1000, np.int64), "step": -1}
    tessera.load(got, str(tmp_path / "run" / "step-7"), progress=False)
    assert torch.equal(got["w"], w) and np.array_equal(got["v"], v) and got["step"] == 7
    verify = subprocess.run([str(TESSERA_BIN), "verify", str(tmp_path / "run" / "step-7")], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stderr


def test_a_write_outage_commits_nothing_names_the_file_and_keeps_latest(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    root = tmp_path / "run"
    clean = tessera.save({"w": np.zeros(16, np.float32)}, str(root / "step-1"))
    assert clean.injected_write_faults is None and clean.write_retries == 0
    # The claim (the first write) lands; every write after it fails, past every retry.
    monkeypatch.setenv(FAULTS_ENV, "write_outage_after:1")
    with pytest.raises(tessera.TesseraError) as failed:
        tessera.async_save({"w": np.ones(16, np.float32)}, str(root / "step-2")).result(timeout=60)
    message = str(failed.value)
    assert message.startswith(f"rank 0 saving {root}/step-2: "), message
    assert "step-2/data/rank-0.bin" in message and "gave up after 5 attempts" in message, message
    assert "injected transient fault" in message, message
    assert not (root / "step-2" / "manifest.json").exists()
    assert not (root / "step-2" / ".tessera-claim.json").exists()
    assert (root / "latest").read_text() == "step-1"
    monkeypatch.delenv(FAULTS_ENV)
    w = np.empty(16, np.float32)
    tessera.load({"w": w}, str(root / "step-1"), progress=False)
    assert np.array_equal(w, np.zeros(16, np.float32))


def test_an_unknown_fault_spec_is_refused_naming_the_accepted_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "every_nth:3")
    with pytest.raises(tessera.TesseraError, match="use write_every_nth:N, write_outage or write_outage_after:N"):
        tessera.save({"w": np.zeros(4, np.float32)}, str(tmp_path / "step-1"))
    assert not (tmp_path / "step-1" / "manifest.json").exists()

"""Live publications between separate processes: `tessera.publish` in a publishing process (or
gloo job), `tessera.load(..., "live://NAME", registry=...)` in another, in another layout.

Every test runs the publisher in its own spawned process(es) that serve the published bytes
until told to stop; the consumer is another process (this one, or a spawned gloo job), and the
loaded bytes are compared with what the publisher held."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import tessera  # noqa: E402
from tessera import TesseraError  # noqa: E402

from conftest import free_ports, join_job, job_store  # noqa: E402

ROWS, COLS = 8, 6


def full_state(step: int) -> dict:
    """The whole state a publisher job holds at ``step``: every element differs, and changes
    with the step."""
    base = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return {
        "w": (base * 0.5 + step).to(torch.bfloat16),
        "m.exp_avg": base * -0.25 + 1000 * step,
        "b": torch.arange(ROWS, dtype=torch.float32) + 0.125 * step,
    }


def row_shard(step: int, rank: int, world: int) -> dict:
    """Rank ``rank``'s FSDP-like row shard of :func:`full_state` as (array, offsets, shape)."""
    rows = ROWS // world
    lo, hi = rank * rows, (rank + 1) * rows
    state = {}
    for fqn, t in full_state(step).items():
        offsets = [lo] + [0] * (t.dim() - 1)
        state[fqn] = (t[lo:hi].clone(), offsets, list(t.shape))
    state["step"] = step
    return state


def replay_full(step: int, head_cols: int = 4) -> dict:
    """The state of the replay tests' publisher at ``step`` (a layout no other test publishes):
    every element differs and changes with the step; ``head`` has ``head_cols`` columns."""
    emb = torch.arange(ROWS * 5, dtype=torch.float32).reshape(ROWS, 5) * 0.25 + step
    head = torch.arange(ROWS * head_cols, dtype=torch.float32).reshape(ROWS, head_cols) * 2.0 - 7 * step
    return {"emb": emb.to(torch.bfloat16), "head": head}


def shard(step: int, rank: int, world: int, extra: dict) -> dict:
    """What publisher rank ``rank`` publishes at ``step``: its row shard of :func:`full_state`,
    or with ``extra["layout"] == "replay"`` of :func:`replay_full` (``extra["head_cols"]``: the
    head's columns by step, default 4)."""
    if extra.get("layout") != "replay":
        state = row_shard(step, rank, world)
        for fqn in extra.get("frozen", []):
            # A tensor training does not change: every step publishes its first values.
            state[fqn] = row_shard(1, rank, world)[fqn]
        return state
    rows = ROWS // world
    lo = rank * rows
    full = replay_full(step, extra.get("head_cols", {}).get(step, 4))
    return {fqn: (t[lo:lo + rows].clone(), [lo, 0], list(t.shape)) for fqn, t in full.items()}


def _wait_for(path: Path, proc, timeout: float = 120.0) -> None:
    """Waits until ``path`` exists (written by the process ``proc``), failing if it exits."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and not proc.is_alive():
            raise AssertionError(f"publisher exited with {proc.exitcode} before writing {path.name}")
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


def publisher(rank, port, world, registry, name, steps, control, extra) -> None:
    """A publishing process: publishes ``steps`` of its row shard, writes ``ready-rank<r>.json``
    with its reports, then serves until ``stop`` appears in ``control``."""
    if world > 1:
        join_job(rank, world, port)
    control = Path(control)
    reports = []
    published = []
    try:
        for step in steps:
            ranks = {} if world > 1 else {"rank": 0, "world_size": 1}
            durable = {}
            if extra.get("durable"):
                # A durable checkpoint of the same step, saved ("save") or only named.
                path = control.parent / f"durable-{name}" / f"step-{step}"
                if extra["durable"] == "save":
                    tessera.save(shard(step, rank, world, extra), str(path), step=step, **ranks)
                durable = {"durable": str(path)}
            pub = tessera.publish(
                shard(step, rank, world, extra), name, step=step, registry=registry, keep=extra.get("keep", 3),
                share_memory=extra.get("share_memory", True), **ranks, **durable,
            )
            reports.append(pub.result(60).to_dict())
            published.append(pub)
        if extra.get("incomplete_step") is not None:
            # Rank 0 of a 2-rank publication whose rank 1 never publishes: never committed.
            pub = tessera.publish(
                row_shard(extra["incomplete_step"], 0, 2), name, step=extra["incomplete_step"], registry=registry,
                rank=0, world_size=2, timeout=0.5,
            )
            try:
                pub.result(60)
                reports.append({"incomplete": "committed?!"})
            except TesseraError as e:
                reports.append({"incomplete": str(e)})
        if extra.get("damage"):
            from tessera import _tessera

            # The first box's first byte of this rank's served file (boxes start at offset 0).
            _tessera.damage_publication(reports[-1]["path"], 0)
        if extra.get("hold"):
            from tessera import _tessera

            # Requests for this rank's file are held unanswered: a consumer is mid-read.
            _tessera.hold_publication(reports[-1]["path"], True)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        (control / f"ready-rank{rank}.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    (control / f"ready-rank{rank}.json").write_text(json.dumps({"reports": reports, "pid": os.getpid()}))
    if extra.get("later"):
        # Steps published once the test says so (after it took a lease, say).
        _wait_for(control / "go", None)
        if extra.get("retire_before_later"):
            # pub.retire() does not wait for leases; a leased step's memory must not be reused.
            for done in published:
                done.retire()
        later = []
        for step in extra["later"]:
            pub = tessera.publish(row_shard(step, rank, world), name, step=step, registry=registry, keep=extra["keep"])
            later.append(pub.result(60).to_dict())
        (control / f"later-rank{rank}.json").write_text(json.dumps(later))
    deadline = time.monotonic() + 300
    while not (control / "stop").exists() and time.monotonic() < deadline:
        if extra.get("hold") and not (control / "holding").exists():
            from tessera import _tessera

            if _tessera.hold_publication(reports[-1]["path"], True) > 0:
                (control / "holding").write_text("")
        time.sleep(0.05)


class Publisher:
    """A publishing job of ``world`` spawned processes (a gloo job when ``world > 1``)."""

    def __init__(self, tmp: Path, name: str, steps, world: int = 1, extra=None) -> None:
        self.registry = tmp / "registry"
        self.control = tmp / f"control-{name}"
        self.control.mkdir(parents=True)
        ctx = mp.get_context("spawn")
        # Held for the job's life: the ranks meet through it (torchrun's agent hosts it so).
        self.store = job_store(world) if world > 1 else None
        port = self.store.port if self.store is not None else 0
        self.procs = [
            ctx.Process(
                target=publisher,
                args=(r, port, world, str(self.registry), name, list(steps), str(self.control), extra or {}),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.ready = {}
        for r, p in enumerate(self.procs):
            path = self.control / f"ready-rank{r}.json"
            _wait_for(path, p)
            self.ready[r] = json.loads(path.read_text())
            assert "error" not in self.ready[r], self.ready[r]["error"]

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(30)

    def stop(self) -> None:
        (self.control / "stop").write_text("")
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


@pytest.fixture
def publishers(tmp_path):
    started = []

    def start(*args, **kwargs) -> Publisher:
        pub = Publisher(tmp_path, *args, **kwargs)
        started.append(pub)
        return pub

    yield start
    for pub in started:
        pub.stop()


def test_one_publisher_one_consumer_loads_row_slices_of_the_newest_step_and_a_named_one(publishers):
    pub = publishers("policy", steps=[1, 2])
    reports = pub.ready[0]["reports"]
    assert [r["step"] for r in reports] == [1, 2]
    assert reports[1]["manifest"]["step"] == 2
    registry = str(pub.registry)

    # Another layout: rows 2..6 of each matrix, the second half of the vector.
    state = {
        "w": (torch.zeros(4, COLS, dtype=torch.bfloat16), [2, 0]),
        "m": {"exp_avg": (torch.zeros(4, COLS), [2, 0])},
        "b": (torch.zeros(4), [4]),
        "step": -1,
    }
    report = tessera.load(state, "live://policy", registry=registry, progress=False)
    assert report.step == 2
    want = full_state(2)
    assert torch.equal(state["w"][0], want["w"][2:6])
    assert state["w"][0].view(torch.int16).tolist() == want["w"][2:6].view(torch.int16).tolist()
    assert torch.equal(state["m"]["exp_avg"][0], want["m.exp_avg"][2:6])
    assert torch.equal(state["b"][0], want["b"][4:])
    assert state["step"] == 2
    assert report.boxes_verified >= 3

    whole = {"w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "b": torch.zeros(ROWS)}
    report = tessera.load(whole, "live://policy@1", registry=registry, progress=False, strict=False)
    assert report.step == 1
    assert torch.equal(whole["w"], full_state(1)["w"])
    assert torch.equal(whole["b"], full_state(1)["b"])


def test_a_step_missing_a_rank_is_never_loaded_and_the_error_names_the_missing_rank(publishers):
    pub = publishers("partial", steps=[1], extra={"incomplete_step": 5})
    incomplete = pub.ready[0]["reports"][-1]["incomplete"]
    assert "publisher ranks [1] of 2" in incomplete, incomplete
    registry = str(pub.registry)
    state = {"b": torch.zeros(ROWS)}
    with pytest.raises(TesseraError) as err:
        tessera.load(state, "live://partial@5", registry=registry, progress=False, strict=False)
    text = str(err.value)
    assert "step 5 of live publication partial is not complete" in text, text
    assert "publisher ranks [1] of 2" in text, text
    # The newest *complete* step is step 1.
    report = tessera.load(state, "live://partial", registry=registry, progress=False, strict=False)
    assert report.step == 1
    assert torch.equal(state["b"], full_state(1)["b"])
    with pytest.raises(TesseraError, match="step 9 of live publication partial was never published"):
        tessera.load(state, "live://partial@9", registry=registry, progress=False, strict=False)


def test_damaged_served_bytes_fail_naming_the_publisher_rank_and_tensor(publishers):
    pub = publishers("damaged", steps=[3], extra={"damage": True})
    state = {"b": torch.zeros(ROWS), "m.exp_avg": torch.zeros(ROWS, COLS), "w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16)}
    with pytest.raises(TesseraError) as err:
        tessera.load(state, "live://damaged", registry=str(pub.registry), progress=False)
    text = str(err.value)
    assert "publisher-rank-0" in text, text
    # Boxes lie in the state dict's order: the damaged byte is the first of w's box.
    assert "tensor w box [0..8, 0..6]" in text, text
    assert "checksum mismatch" in text, text


def test_a_dead_publisher_fails_the_load_naming_its_rank(publishers):
    pub = publishers("dead", steps=[1])
    pub.kill(0)
    state = {"b": torch.zeros(ROWS)}
    with pytest.raises(TesseraError) as err:
        tessera.load(state, "live://dead", registry=str(pub.registry), progress=False, strict=False)
    assert "publisher rank 0" in str(err.value), str(err.value)


def test_older_steps_are_retired_past_keep_unless_a_consumer_leases_them(publishers):
    from tessera import _live

    pub = publishers("kept", steps=[1, 2, 3], extra={"keep": 2, "later": [4]})
    reports = pub.ready[0]["reports"]
    assert reports[2]["retired"] == [1]
    registry = str(pub.registry)
    state = {"b": torch.zeros(ROWS)}
    with pytest.raises(TesseraError, match="step 1 of live publication kept was committed and then retired"):
        tessera.load(state, "live://kept@1", registry=registry, progress=False, strict=False)

    # A consumer's lease on step 2 keeps it served past keep=2 when step 4 comes.
    _step, location = _live.resolve("live://kept@2", registry)
    with _live.Lease(location, 60):
        (pub.control / "go").write_text("")
        _wait_for(pub.control / "later-rank0.json", pub.procs[0])
        later = json.loads((pub.control / "later-rank0.json").read_text())
        assert later[0]["step"] == 4
        assert later[0]["leased"] == [2] and later[0]["retired"] == []
        report = tessera.load(state, "live://kept@2", registry=registry, progress=False, strict=False)
        assert report.step == 2
        assert torch.equal(state["b"], full_state(2)["b"])
    report = tessera.load(state, "live://kept", registry=registry, progress=False, strict=False)
    assert report.step == 4
    assert torch.equal(state["b"], full_state(4)["b"])


def test_a_lease_is_a_file_while_held_and_a_registry_that_cannot_hold_one_is_said(tmp_path):
    from tessera import _live

    step = tmp_path / "step-000007"
    step.mkdir()
    with _live.Lease(f"live+file://{step}", 30) as lease:
        held = Path(lease.path)
        assert held.parent == step / "leases" and held.is_file()
        written = json.loads(held.read_text())
        assert written["pid"] == os.getpid() and abs(written["until"] - written["taken"] - 30) < 1e-6
        assert tessera._tessera.step_leased(str(step))
    assert not held.exists() and not tessera._tessera.step_leased(str(step))
    assert lease.path is None

    (step / "leases").rmdir()
    (step / "leases").write_text("not a folder")
    with pytest.warns(UserWarning, match=f"no lease on {step}.*the publisher may retire the step"):
        lease = _live.Lease(f"live+file://{step}", 30)
    assert lease.path is None


def column_half(rank: int) -> dict:
    """What rank ``rank`` of a 2-rank TP-like consumer loads: its column half of every matrix
    (and the whole vector, and the step value), zeroed."""
    cols = COLS // 2
    return {
        "w": (torch.zeros(ROWS, cols, dtype=torch.bfloat16), [0, rank * cols]),
        "m.exp_avg": (torch.zeros(ROWS, cols), [0, rank * cols]),
        "b": torch.zeros(ROWS),
        "step": -1,
    }


def consumer(rank, port, registry, url, out) -> None:
    """A rank of the 2-rank consuming gloo job: loads its TP-like column half of every matrix
    (and the whole vector) and writes what it got."""
    join_job(rank, 2, port)
    state = column_half(rank)
    result = {}
    try:
        report = tessera.load(state, url, registry=registry, progress=False, timeout=60)
        result = {
            "step": report.step,
            "exchange": report.exchange,
            "w": state["w"][0].view(torch.int16).tolist(),
            "m": state["m.exp_avg"][0].tolist(),
            "b": state["b"].tolist(),
            "value": state["step"],
        }
    except TesseraError as e:
        result = {"error": str(e)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def delta_consumer(rank, port, registry, out) -> None:
    """A rank of a 2-rank consuming gloo job loading steps 1 and 2 of ``delta`` with
    ``delta=True`` in TP-like column halves, then step 2 again after rank 1 wrote its "w" in
    place; writes each load's delta fields and whether its values were right."""
    join_job(rank, 2, port)
    state = column_half(rank)
    loads = []
    try:
        for step, touch in ((1, False), (2, False), (2, rank == 1)):
            if touch:
                state["w"][0].add_(1)
            report = tessera.load(state, f"live://delta@{step}", registry=registry, delta=True, progress=False, timeout=60)
            want = full_state(step)
            half = slice(rank * COLS // 2, (rank + 1) * COLS // 2)
            right = (
                state["w"][0].view(torch.int16).tolist() == full_state(1)["w"][:, half].view(torch.int16).tolist()
                and torch.equal(state["m.exp_avg"][0], want["m.exp_avg"][:, half])
                and torch.equal(state["b"], want["b"])
                and state["step"] == step
            )
            loads.append({"step": report.step, "delta_from": report.delta_from, "unchanged": report.unchanged_keys, "right": right})
        result = {"loads": loads}
    except TesseraError as e:
        result = {"error": str(e), "loads": loads}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_consuming_group_loads_deltas_each_rank_by_what_it_holds(publishers, tmp_path):
    pub = publishers("delta", steps=[1, 2], world=2, extra={"keep": 3, "frozen": ["w"]})
    out = tmp_path / "delta-consumer"
    out.mkdir()
    store = job_store(2)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=delta_consumer, args=(r, store.port, str(pub.registry), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"consumer rank exited with {p.exitcode}"
    got = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}
    for r in range(2):
        assert "error" not in got[r], got[r]
        loads = got[r]["loads"]
        assert all(load["right"] for load in loads), loads
        assert [(load["step"], load["delta_from"]) for load in loads] == [(1, None), (2, 1), (2, 2)], loads
        assert loads[0]["unchanged"] == [] and loads[1]["unchanged"] == ["w"], loads
    # The third load: rank 0 holds everything (only the non-tensor "step" is read), rank 1
    # reloads the "w" it wrote; the job's plan is one for both.
    assert got[0]["loads"][2]["unchanged"] == ["w", "m.exp_avg", "b"], got[0]
    assert got[1]["loads"][2]["unchanged"] == ["m.exp_avg", "b"], got[1]


def run_consumer(tmp: Path, registry: Path, url: str) -> dict:
    out = tmp / "consumer"
    out.mkdir(exist_ok=True)
    store = job_store(2)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=consumer, args=(r, store.port, str(registry), url, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"consumer rank exited with {p.exitcode}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


def test_a_two_rank_row_sharded_publisher_job_feeds_a_two_rank_column_sharded_consumer_job(publishers, tmp_path):
    pub = publishers("job", steps=[4], world=2)
    assert pub.ready[0]["reports"][0]["manifest"]["files"][1]["path"] == "data/publisher-rank-1.bin"
    got = run_consumer(tmp_path, pub.registry, "live://job")
    want = full_state(4)
    cols = COLS // 2
    for rank in range(2):
        r = got[rank]
        assert "error" not in r, r["error"]
        assert r["step"] == 4 and r["value"] == 4
        assert r["exchange"] == "process_group"
        part = slice(rank * cols, (rank + 1) * cols)
        assert r["w"] == want["w"][:, part].contiguous().view(torch.int16).tolist()
        assert r["m"] == want["m.exp_avg"][:, part].tolist()
        assert r["b"] == want["b"].tolist()


def test_a_publisher_rank_that_died_fails_every_consumer_rank_naming_it(publishers, tmp_path):
    pub = publishers("gone", steps=[1], world=2)
    pub.kill(1)
    got = run_consumer(tmp_path, pub.registry, "live://gone")
    for rank in range(2):
        assert "error" in got[rank], got[rank]
        assert "publisher rank 1" in got[rank]["error"], got[rank]["error"]


def test_retire_stops_serving_a_step_and_no_load_picks_it(tmp_path):
    # Publisher and consumer in one process here: what is tested is the publisher's retire.
    registry = tmp_path / "registry"
    pub = tessera.publish(row_shard(1, 0, 1), "solo", step=1, registry=registry, rank=0, world_size=1)
    served = pub.result(60)
    state = {"b": torch.zeros(ROWS)}
    assert tessera.load(state, "live://solo", registry=registry, progress=False, strict=False).step == 1
    pub.retire()
    from tessera import _tessera

    assert not _tessera.unpublish(served.path), "the step's bytes are still served"
    with pytest.raises(TesseraError, match="live publication solo in .* has no complete step"):
        tessera.load(state, "live://solo", registry=registry, progress=False, strict=False)


def test_a_publisher_killed_while_a_consumer_reads_fails_the_load_naming_it(publishers):
    import threading

    # Over HTTP (a consumer on this host would read the shared memory it opened, unaffected).
    pub = publishers("killed", steps=[1], extra={"hold": True, "share_memory": False})
    state = {"b": torch.zeros(ROWS), "w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16)}
    result = {}

    def consume() -> None:
        try:
            tessera.load(state, "live://killed", registry=str(pub.registry), progress=False, strict=False)
            result["loaded"] = True
        except TesseraError as e:
            result["error"] = str(e)

    consumer_thread = threading.Thread(target=consume, daemon=True)
    consumer_thread.start()
    # The consumer opened the step and its read is in the publisher's hands: kill it now.
    _wait_for(pub.control / "holding", pub.procs[0])
    pub.kill(0)
    consumer_thread.join(180)
    assert not consumer_thread.is_alive(), "the load hung after its publisher died"
    assert "error" in result, result
    assert "publisher rank 0" in result["error"], result["error"]


def test_a_stopped_publisher_fails_the_load_within_the_retry_bound_naming_it(publishers):
    # A publisher that stops answering (SIGSTOP: its socket still accepts, nothing replies) is
    # what a wedged or swapping training process looks like; the load fails on the storage
    # timeouts and retry bound, naming the publisher, instead of hanging. Over HTTP: on this host
    # the shared memory is read whatever the publisher does (next test).
    pub = publishers("stopped", steps=[1], extra={"share_memory": False})
    os.kill(pub.procs[0].pid, signal.SIGSTOP)
    try:
        state = {"b": torch.zeros(ROWS)}
        with pytest.raises(TesseraError) as err:
            tessera.load(state, "live://stopped", registry=str(pub.registry), progress=False, strict=False)
        assert "publisher rank 0" in str(err.value), str(err.value)
    finally:
        os.kill(pub.procs[0].pid, signal.SIGCONT)


def test_a_consumer_on_the_publishers_host_reads_its_shared_memory_not_http(publishers):
    shared = publishers("shared", steps=[4])
    http = publishers("http", steps=[4], extra={"share_memory": False})
    want = full_state(4)
    reports = {}
    for name, pub in (("shared", shared), ("http", http)):
        state = {"w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "m.exp_avg": torch.zeros(ROWS, COLS)}
        reports[name] = tessera.load(state, f"live://{name}", registry=str(pub.registry), progress=False, strict=False)
        assert state["w"].view(torch.int16).tolist() == want["w"].view(torch.int16).tolist()
        assert torch.equal(state["m.exp_avg"], want["m.exp_avg"])
    assert shared.ready[0]["reports"][-1]["shared"] is True
    assert http.ready[0]["reports"][-1]["shared"] is False
    mem, net = reports["shared"], reports["http"]
    assert mem.bytes_read == net.bytes_read > 0
    assert mem.bytes_from_publisher_memory == mem.bytes_read, mem
    assert mem.bytes_from_storage == 0, mem
    assert mem.boxes_verified > 0, mem
    assert net.bytes_from_publisher_memory == 0, net
    assert net.bytes_from_storage == net.bytes_read, net


def test_later_steps_are_laid_out_in_the_shared_memory_of_retired_ones(publishers):
    # keep=1: each publish retires the step before it once committed, and its memory waits for the
    # next step, which is written into those pages (already faulted in) instead of fresh ones.
    pub = publishers("reuse", steps=[1, 2, 3, 4], world=2, extra={"keep": 1})
    for rank in (0, 1):
        reports = pub.ready[rank]["reports"]
        assert [r["reused_memory"] for r in reports] == [False, False, True, True], reports
        assert all(r["shared"] for r in reports)
        assert [r["retired"] for r in reports] == [[], [1], [2], [3]], reports
    state = {"w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "m.exp_avg": torch.zeros(ROWS, COLS)}
    report = tessera.load(state, "live://reuse", registry=str(pub.registry), progress=False, strict=False)
    assert report.step == 4
    want = full_state(4)
    assert state["w"].view(torch.int16).tolist() == want["w"].view(torch.int16).tolist()
    assert torch.equal(state["m.exp_avg"], want["m.exp_avg"])
    assert report.bytes_from_publisher_memory == report.bytes_read > 0, report
    # The retired steps stay retired: never their memory's new bytes under their name.
    with pytest.raises(TesseraError, match="step 3 of live publication reuse was committed and then retired"):
        tessera.load(state, "live://reuse@3", registry=str(pub.registry), progress=False, strict=False)


def test_a_registry_keeps_the_newest_retired_steps_and_removes_older_ones(publishers):
    # keep=1 over 12 steps: step 12 served, 11 retired steps of which the newest 8 (4-11) keep
    # their directories; 1-3 are removed by rank 0's retires.
    pub = publishers("bounded", steps=list(range(1, 13)), extra={"keep": 1})
    folder = pub.registry / "bounded"
    left = sorted(int(p.name.split("-")[1]) for p in folder.iterdir() if p.name.startswith("step-"))
    assert left == list(range(4, 13)), left
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".removing")]
    registry = str(pub.registry)
    state = {"b": torch.zeros(ROWS)}
    with pytest.raises(TesseraError, match="step 4 of live publication bounded was committed and then retired"):
        tessera.load(state, "live://bounded@4", registry=registry, progress=False, strict=False)
    with pytest.raises(TesseraError, match="step 3 of live publication bounded was never published"):
        tessera.load(state, "live://bounded@3", registry=registry, progress=False, strict=False)
    report = tessera.load(state, "live://bounded", registry=registry, progress=False, strict=False)
    assert report.step == 12 and torch.equal(state["b"], full_state(12)["b"])


def test_a_leased_step_retired_by_hand_keeps_its_memory_from_later_steps(publishers):
    from tessera import _live

    pub = publishers("handretire", steps=[1, 2], extra={"keep": 5, "later": [3, 4], "retire_before_later": True})
    _step, location = _live.resolve("live://handretire@1", str(pub.registry))
    with _live.Lease(location, 60):
        (pub.control / "go").write_text("")
        _wait_for(pub.control / "later-rank0.json", pub.procs[0])
    later = json.loads((pub.control / "later-rank0.json").read_text())
    # Step 2 (no lease) left its memory for step 3; step 1 (leased while retired) did not, so
    # step 4 had none to reuse.
    assert [r["reused_memory"] for r in later] == [True, False], later
    state = {"w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "m.exp_avg": torch.zeros(ROWS, COLS)}
    report = tessera.load(state, "live://handretire@4", registry=str(pub.registry), progress=False, strict=False)
    assert torch.equal(state["m.exp_avg"], full_state(4)["m.exp_avg"]), report


def test_a_delta_load_reads_only_the_tensors_whose_saved_boxes_changed(publishers):
    # "w" is frozen (every step publishes its step-1 values); the moments and "b" change.
    pub = publishers("delta", steps=[1, 2], world=2, extra={"keep": 3, "frozen": ["w"]})
    registry = str(pub.registry)
    state = {"w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "m.exp_avg": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS)}

    def load(step):
        return tessera.load(state, f"live://delta@{step}", registry=registry, delta=True, progress=False, strict=False)

    def assert_values(step):
        want = full_state(step)
        assert state["w"].view(torch.int16).tolist() == full_state(1)["w"].view(torch.int16).tolist()
        assert torch.equal(state["m.exp_avg"], want["m.exp_avg"]) and torch.equal(state["b"], want["b"])

    first = load(1)
    assert (first.step, first.delta_from, first.unchanged_keys, first.bytes_unchanged) == (1, None, [], 0)
    assert_values(1)
    second = load(2)
    w_bytes = ROWS * COLS * 2
    assert (second.step, second.delta_from, second.unchanged_keys, second.bytes_unchanged) == (2, 1, ["w"], w_bytes)
    assert second.bytes_needed == first.bytes_needed - w_bytes, (first, second)
    assert second.bytes_read < first.bytes_read, (first, second)
    assert_values(2)

    # Written in place through torch (its version counter moves): loaded again, the others kept.
    state["w"].add_(1)
    third = load(2)
    assert (third.delta_from, third.unchanged_keys) == (2, ["m.exp_avg", "b"]), third
    assert_values(2)
    # Another tensor object under a key: loaded; and delta=True is for live:// only.
    state["b"] = torch.zeros(ROWS)
    fourth = load(2)
    assert fourth.unchanged_keys == ["w", "m.exp_avg"], fourth
    assert_values(2)
    # A load without delta writes the tensors behind torch's back: the next delta load reads
    # them all again rather than trust what it recorded.
    plain = tessera.load(state, "live://delta@1", registry=registry, progress=False, strict=False)
    assert plain.unchanged_keys == [] and plain.delta_from is None
    fifth = load(2)
    assert (fifth.delta_from, fifth.unchanged_keys) == (2, []), fifth
    assert_values(2)
    with pytest.raises(ValueError, match="delta=True is for live:// publications"):
        tessera.load(state, str(pub.registry), delta=True)


def test_a_stopped_publisher_on_this_host_is_read_from_its_shared_memory(publishers):
    # SIGSTOPped, it answers no HTTP request; its shared memory is the committed step's bytes,
    # which the consumer opens and verifies without it.
    pub = publishers("paused", steps=[6])
    os.kill(pub.procs[0].pid, signal.SIGSTOP)
    try:
        state = {"b": torch.zeros(ROWS), "w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16)}
        report = tessera.load(state, "live://paused", registry=str(pub.registry), progress=False, strict=False)
        assert report.step == 6
        assert torch.equal(state["b"], full_state(6)["b"])
        assert state["w"].view(torch.int16).tolist() == full_state(6)["w"].view(torch.int16).tolist()
        assert report.bytes_from_publisher_memory == report.bytes_read > 0, report
    finally:
        os.kill(pub.procs[0].pid, signal.SIGCONT)


def test_the_readme_example_runs_as_written_across_two_processes(tmp_path, monkeypatch):
    import re
    import runpy
    import subprocess
    import sys

    from conftest import REPO

    text = (REPO / "README.md").read_text()
    section = text.split("### Online resharding (live://)", 1)[1].split("\n### ", 1)[0]
    publisher_py, consumer_py = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:2]
    (tmp_path / "publisher.py").write_text(publisher_py)
    (tmp_path / "consumer.py").write_text(consumer_py)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "publisher.py"], cwd=tmp_path, env=env)
    try:
        manifest = tmp_path / "registry" / "policy" / "step-000003" / "manifest.json"
        deadline = time.monotonic() + 120
        while not manifest.exists():
            assert proc.poll() is None, f"publisher.py exited with {proc.returncode}"
            assert time.monotonic() < deadline, "publisher.py committed no step 3 within 120 s"
            time.sleep(0.05)
        monkeypatch.chdir(tmp_path)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(var, raising=False)
        got = runpy.run_path(str(tmp_path / "consumer.py"), run_name="__main__")
    finally:
        proc.kill()
        proc.wait(30)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for _ in range(3):
            model.weight.add_(0.01)
    assert got["report"].step == 3
    assert torch.equal(got["w"], model.weight[:, 32:])
    assert torch.equal(got["state"]["bias"], model.bias)


def test_dcp_load_through_the_storage_reader_takes_live_urls(publishers):
    import torch.distributed.checkpoint as dcp

    import tessera.torch

    pub = publishers("viadcp", steps=[1, 2])
    state = {"w": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "b": torch.zeros(ROWS)}
    reader = tessera.torch.StorageReader("live://viadcp", registry=str(pub.registry))
    dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert reader.step == 2
    assert torch.equal(state["w"], full_state(2)["w"])
    assert torch.equal(state["b"], full_state(2)["b"])
    reader = tessera.torch.StorageReader("live://viadcp@1", registry=str(pub.registry))
    dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert reader.step == 1
    assert torch.equal(state["w"], full_state(1)["w"])


# ---- plan once, replay ----------------------------------------------------------------------


def test_successive_steps_replay_the_plan_and_read_each_steps_own_bytes(publishers):
    pub = publishers("replayed", steps=[1, 2], extra={"layout": "replay"})
    registry = str(pub.registry)
    state = {
        "emb": (torch.zeros(4, 5, dtype=torch.bfloat16), [2, 0]),
        "head": (torch.zeros(ROWS, 2), [0, 2]),
    }
    first = tessera.load(state, "live://replayed@1", registry=registry, progress=False)
    assert first.step == 1 and not first.plan_reused
    assert torch.equal(state["emb"][0], replay_full(1)["emb"][2:6])

    second = tessera.load(state, "live://replayed@2", registry=registry, progress=False)
    assert second.step == 2
    assert second.plan_reused, second
    want = replay_full(2)
    assert state["emb"][0].view(torch.int16).tolist() == want["emb"][2:6].view(torch.int16).tolist()
    assert torch.equal(state["head"][0], want["head"][:, 2:])
    assert not torch.equal(want["head"][:, 2:], replay_full(1)["head"][:, 2:])
    assert second.boxes_verified >= 2

    # Other requests are another plan.
    whole = {"emb": torch.zeros(ROWS, 5, dtype=torch.bfloat16)}
    report = tessera.load(whole, "live://replayed@2", registry=registry, progress=False, strict=False)
    assert not report.plan_reused
    assert torch.equal(whole["emb"], want["emb"])


def test_a_publisher_that_changes_a_shape_between_steps_is_planned_anew(publishers):
    # Step 2's head has 3 columns instead of 4; the consumer asks for emb only, with the same
    # requests both times: only the layout differs.
    pub = publishers("reshaped", steps=[1, 2], extra={"layout": "replay", "head_cols": {2: 3}})
    registry = str(pub.registry)
    state = {"emb": (torch.zeros(ROWS, 3, dtype=torch.bfloat16), [0, 1])}
    first = tessera.load(state, "live://reshaped@1", registry=registry, progress=False)
    assert torch.equal(state["emb"][0], replay_full(1)["emb"][:, 1:4])
    second = tessera.load(state, "live://reshaped@2", registry=registry, progress=False)
    assert not second.plan_reused, second
    assert torch.equal(state["emb"][0], replay_full(2, 3)["emb"][:, 1:4])
    # Its own plan is replayed once made.
    again = tessera.load(state, "live://reshaped@2", registry=registry, progress=False)
    assert again.plan_reused
    assert torch.equal(state["emb"][0], replay_full(2, 3)["emb"][:, 1:4])
    assert first.step == 1 and second.step == 2


def test_damaged_bytes_of_a_replayed_step_fail_naming_the_publisher_rank_and_tensor(publishers):
    # The last step's served bytes are damaged (emb's box, the first in the file).
    pub = publishers("damagedlater", steps=[1, 2], extra={"layout": "replay", "damage": True})
    registry = str(pub.registry)
    state = {"emb": torch.zeros(ROWS, 5, dtype=torch.bfloat16), "head": torch.zeros(ROWS, 4)}
    assert not tessera.load(state, "live://damagedlater@1", registry=registry, progress=False).plan_reused
    assert torch.equal(state["emb"], replay_full(1)["emb"])
    with pytest.raises(TesseraError) as err:
        tessera.load(state, "live://damagedlater@2", registry=registry, progress=False)
    text = str(err.value)
    assert "publisher-rank-0" in text, text
    assert "tensor emb box [0..8, 0..5]" in text, text
    assert "checksum mismatch" in text, text
    # Step 1's bytes are intact and still load on the plan kept for this layout.
    report = tessera.load(state, "live://damagedlater@1", registry=registry, progress=False)
    assert report.plan_reused
    assert torch.equal(state["head"], replay_full(1)["head"])


def steps_consumer(rank, port, registry, urls, out) -> None:
    """A rank of a 2-rank consuming gloo job loading ``urls`` one after the other: the head's
    column half (rank 0 the left, rank 1 the right) and the whole emb; writes each report."""
    join_job(rank, 2, port)
    state = {
        "emb": torch.zeros(ROWS, 5, dtype=torch.bfloat16),
        "head": (torch.zeros(ROWS, 2), [0, 2 * rank]),
    }
    results = []
    for url in urls:
        try:
            report = tessera.load(state, url, registry=registry, progress=False, timeout=60)
            results.append({
                "step": report.step, "exchange": report.exchange, "reused": report.plan_reused,
                "fallback": report.fallback, "durable": report.durable_checkpoint,
                "emb": state["emb"].view(torch.int16).tolist(), "head": state["head"][0].tolist(),
            })
        except TesseraError as e:
            results.append({"error": str(e)})
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run_steps_consumer(tmp: Path, registry: Path, urls) -> dict:
    out = tmp / "steps-consumer"
    out.mkdir(exist_ok=True)
    store = job_store(2)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=steps_consumer, args=(r, store.port, str(registry), list(urls), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0, f"consumer rank exited with {p.exitcode}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


def test_a_two_rank_consumer_job_replays_the_plan_on_every_rank(publishers, tmp_path):
    pub = publishers("jobsteps", steps=[1, 2], world=2, extra={"layout": "replay"})
    got = run_steps_consumer(tmp_path, pub.registry, ["live://jobsteps@1", "live://jobsteps@2"])
    for rank in range(2):
        loads = got[rank]
        for step, r in zip((1, 2), loads):
            assert "error" not in r, r["error"]
            want = replay_full(step)
            assert r["step"] == step and r["exchange"] == "process_group"
            assert r["emb"] == want["emb"].view(torch.int16).tolist()
            assert r["head"] == want["head"][:, 2 * rank:2 * rank + 2].tolist()
        # The coordinator made the plan once; both ranks loaded step 2 on its replay.
        assert [r["reused"] for r in loads] == [False, True], loads


# ---- durable fallback -----------------------------------------------------------------------


def test_a_dead_publisher_falls_back_to_the_durable_checkpoint_of_the_same_step(publishers, tmp_path):
    pub = publishers("durable", steps=[1, 2], extra={"durable": "save"})
    registry = pub.registry
    assert json.loads((registry / "durable" / "step-000002" / "durable.json").read_text())["step"] == 2
    pub.kill(0)
    state = {"w": (torch.zeros(4, COLS, dtype=torch.bfloat16), [2, 0]), "b": torch.zeros(ROWS), "step": -1}
    report = tessera.load(state, "live://durable", registry=str(registry), progress=False, strict=False)
    assert report.step == 2
    durable = str(tmp_path / "durable-durable" / "step-2")
    assert report.durable_checkpoint == durable
    assert "publisher rank 0 at http://" in report.fallback, report.fallback
    assert durable in report.fallback, report.fallback
    want = full_state(2)
    assert state["w"][0].view(torch.int16).tolist() == want["w"][2:6].view(torch.int16).tolist()
    assert torch.equal(state["b"], want["b"])
    assert state["step"] == 2


def test_a_dead_publisher_whose_durable_checkpoint_is_not_committed_fails_naming_both(publishers, tmp_path):
    pub = publishers("undurable", steps=[1], extra={"durable": "name-only"})
    pub.kill(0)
    state = {"b": torch.zeros(ROWS)}
    with pytest.raises(TesseraError) as err:
        tessera.load(state, "live://undurable", registry=str(pub.registry), progress=False, strict=False)
    text = str(err.value)
    assert "publisher rank 0 at http://" in text, text
    assert f"durable checkpoint {tmp_path / 'durable-undurable' / 'step-1'} is not committed" in text, text


def test_every_rank_of_a_consumer_job_falls_back_to_the_durable_checkpoint_together(publishers, tmp_path):
    pub = publishers("durablejob", steps=[1], extra={"durable": "save", "layout": "replay"})
    pub.kill(0)
    got = run_steps_consumer(tmp_path, pub.registry, ["live://durablejob"])
    want = replay_full(1)
    for rank in range(2):
        r = got[rank][0]
        assert "error" not in r, r["error"]
        assert r["step"] == 1 and r["exchange"] == "process_group"
        assert r["durable"] == str(tmp_path / "durable-durablejob" / "step-1")
        assert "publisher rank 0 at http://" in r["fallback"], r["fallback"]
        assert r["emb"] == want["emb"].view(torch.int16).tolist()
        assert r["head"] == want["head"][:, 2 * rank:2 * rank + 2].tolist()

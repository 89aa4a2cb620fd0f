"""A rank of a torch gloo job that fails, stops (SIGSTOP) or dies (SIGKILL) while tessera.load
plans, reads or exchanges: every other rank fails within seconds, naming it, whatever the
group's own timeout (30 minutes by default; 600 s here). Each case runs a real 3-rank job.

The seconds from the fault to each survivor's error are printed (``-s`` shows them; BENCHMARKS.md
"Failure bounds" has the table)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import expected_tensors, fixture, job_store, join_job

import torch  # noqa: F401,E402  (make python-test installs it)

import tessera  # noqa: E402

C = "c_w4_dp2_tp2"
WORLD = 3
VICTIM = 1
# Rank 0 coordinates the load's rounds (plans for every rank): its stop is watched like any other.
COORDINATOR = 0
# Short here so the suite stays quick; `TESSERA_LIVENESS_S=10` measures the default.
LIVENESS_S = float(os.environ.get("TESSERA_LIVENESS_S", "3"))


class _Faulty:
    """A GroupLoad whose ``phase`` method first does ``fault`` to this process (records when)."""

    def __init__(self, inner, phase: str, fault: str, mark: Path) -> None:
        self._inner, self._phase, self._fault, self._mark = inner, phase, fault, mark

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name != self._phase:
            return attr

        def faulty(*args, **kwargs):
            self._mark.write_text(str(time.time()))
            if self._fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif self._fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                raise RuntimeError(f"injected failure in {self._phase}")
            return attr(*args, **kwargs)

        return faulty


def _rank(rank: int, port: int, phase: str, fault: str, victim: int, out: str) -> None:
    import numpy as np
    import torch.distributed as dist

    from tessera import _tessera

    os.environ["TESSERA_LIVENESS_S"] = str(LIVENESS_S)
    # The group's own timeout far above every bound measured here.
    join_job(rank, WORLD, port, group_timeout=600)
    if rank == victim:
        real = _tessera.group_load
        mark = Path(out) / "fault"
        _tessera.group_load = lambda *a, **k: _Faulty(real(*a, **k), phase, fault, mark)
    tensors = expected_tensors(C)
    # Every rank wants every tensor whole: pieces are read once and exchanged.
    state = {f: np.empty(t["shape"], np.float32) for f, t in tensors.items() if t["dtype"] == "float32"}
    result = {"rank": rank}
    try:
        tessera.load(state, str(fixture(C)), process_group=dist.group.WORLD, progress=False, timeout=120)
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
    result["at"] = time.time()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no teardown of a group whose peer is stopped or dead


@pytest.mark.parametrize(
    "phase,fault,victim",
    [
        # job_step: the rounds' local work (taking the plan, its digests, the joint checks).
        ("job_step", "fail", VICTIM),
        ("read", "fail", VICTIM),
        ("job_step", "stop", VICTIM),
        ("read", "stop", VICTIM),
        ("read", "kill", VICTIM),
        ("exchange", "kill", VICTIM),
        ("exchange", "stop", VICTIM),
        ("job_step", "stop", COORDINATOR),
        ("read", "kill", COORDINATOR),
    ],
)
def test_every_rank_fails_within_seconds_naming_the_rank(tmp_path, phase, fault, victim):
    ctx = mp.get_context("spawn")
    store = job_store(WORLD)
    port = store.port
    procs = [ctx.Process(target=_rank, args=(r, port, phase, fault, victim, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    survivors = [r for r in range(WORLD) if r != victim]
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all((tmp_path / f"rank{r}.json").exists() for r in survivors):
            time.sleep(0.1)
        results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in survivors}
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    fault_at = float((tmp_path / "fault").read_text())
    # Failing outright is seen within a poll; a silent rank (stopped, or killed: its beat stops)
    # within the liveness bound. A kill mid-exchange is usually seen at once (the connection
    # drops), but only the liveness bound is promised (a pair gloo has not connected yet).
    bound = 5.0 if fault == "fail" else LIVENESS_S + 6.0
    for r, result in results.items():
        assert "error" in result, f"rank {r} reported success: {result}"
        seconds = result["at"] - fault_at
        print(f"{phase}/{fault}: rank {r} failed {seconds:.2f} s after rank {victim}'s fault: {result['error']}")
        assert f"rank {victim}" in result["error"], result["error"]
        assert "gloo" not in result["error"].lower(), result["error"]
        assert seconds < bound, f"rank {r} took {seconds:.1f} s: {result['error']}"


def _own_rendezvous_rank(rank: int, port: int, read_order: str, out: str) -> None:
    import numpy as np

    t = expected_tensors(C)["model.final_ln.weight"]
    started = time.time()
    try:
        tessera.load(
            {"model.final_ln.weight": np.empty(t["shape"], np.float32)}, str(fixture(C)), rank=rank,
            world_size=2, exchange=True, master_addr="127.0.0.1", master_port=port, read_order=read_order,
            progress=False, timeout=60,
        )
        result = {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": str(e)}
    result["seconds"] = time.time() - started
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def test_ranks_of_an_own_rendezvous_load_with_other_read_orders_fail_at_once_naming_it(tmp_path):
    # tessera.load without torch.distributed (exchange=True): the ranks compare their plan
    # options at the rendezvous, as the CLI's ranks do, instead of failing late in the exchange.
    from conftest import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    orders = {0: "request", 1: "storage"}
    procs = [ctx.Process(target=_own_rendezvous_rank, args=(r, port, orders[r], str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    for r, result in results.items():
        assert "--read-order" in result.get("error", ""), (r, result)
        assert "storage" in result["error"] and "request" in result["error"], (r, result)
        assert result["seconds"] < 30, (r, result)

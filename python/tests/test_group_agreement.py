"""The ranks of a torch gloo job agree on what they load before any byte moves between them.
Each case runs a real 2-rank job over the default group (every rank wants every tensor, so
pieces are read once and exchanged):

- ranks naming different checkpoints (rank 0 step-1, rank 1 step-2) fail on every rank, naming
  the ranks and both checkpoints (they used to succeed with some tensors of the other step);
- a plan server that answers rank 1 from another plan of the same requests (rank 0's two boxes
  listed the other way round: piece id 0 names other rows on each rank) is refused on both
  ranks, and one that answers rank 0 with its requests in another order is refused naming the
  destination (both used to succeed with rows swapped); over the process group and over
  tessera's own rendezvous (``exchange=True`` without torch.distributed) alike;
- a rank whose load fails before the group step (a missing key) still takes part in that load:
  the other rank fails at once naming it, and the fallback loads of both ranks then meet (it
  used to be one load behind: its fallback joined the other rank's first load, mixing steps,
  and the next load waited out ``timeout=``).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from conftest import TESSERA_BIN, free_port, join_job, run_job

import torch  # noqa: F401,E402  (make python-test installs it)

import tessera  # noqa: E402

ROWS, COLS = 128, 64


def _values(step: int) -> dict:
    w = (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 100000.0 * step)
    b = np.arange(COLS, dtype=np.float32) - 7.0 * step
    return {"w": w, "b": b}


def _save_steps(root: Path) -> Path:
    for step in (1, 2):
        tessera.save(_values(step), root / "run" / f"step-{step}", step=step)
    return root / "run"


def _whole() -> dict:
    return {"w": np.empty((ROWS, COLS), np.float32), "b": np.empty(COLS, np.float32)}


def _result(rank: int, out: str, **fields) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, **fields}))


def _load(state: dict, path: str, **kw) -> dict:
    import torch.distributed as dist

    started = time.monotonic()
    try:
        tessera.load(state, path, process_group=dist.group.WORLD, progress=False, timeout=20, **kw)
        return {"ok": True, "seconds": time.monotonic() - started}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}


def _same(state: dict, step: int) -> bool:
    want = _values(step)
    return all(np.array_equal(state[k], want[k]) for k in want)


# -- ranks naming different checkpoints ---------------------------------------------------------


def _other_step_rank(rank: int, port: int, root: str, out: str) -> None:
    join_job(rank, 2, port)
    state = _whole()
    outcome = _load(state, f"{root}/step-{rank + 1}")
    _result(rank, out, **outcome)


def test_ranks_naming_different_checkpoints_fail_naming_both(tmp_path):
    root = _save_steps(tmp_path)
    results = run_job(_other_step_rank, 2, (str(root),), tmp_path)
    for rank, result in results.items():
        assert "error" in result, f"rank {rank} loaded: {result}"
        error = result["error"]
        for needle in (
            f"rank {rank}: the ranks of this job load different checkpoints",
            f"rank 1 loads {root}/step-2 (native:",
            f"but rank 0 loads {root}/step-1 (native:",
        ):
            assert needle in error, f"rank {rank}: {needle!r} not in {error}"
        assert result["seconds"] < 15, result


# -- a lying plan server --------------------------------------------------------------------------


def _requests(rank0_reversed: bool) -> dict:
    half = lambda top: {"fqn": "w", "offsets": [0 if top else ROWS // 2, 0], "lengths": [ROWS // 2, COLS]}  # noqa: E731
    rank0 = [half(True), half(False)]
    if rank0_reversed:
        rank0.reverse()
    return {"ranks": [rank0, [half(True), half(False)]]}


def _rank_plan_arrow(ckpt: Path, requests: dict, rank: int, tmp: Path) -> bytes:
    path = tmp / f"requests-{rank}-{id(requests)}.json"
    path.write_text(json.dumps(requests))
    run = subprocess.run(
        [str(TESSERA_BIN), "plan", str(ckpt), "--requests", str(path), "--rank", str(rank), "--format", "arrow"],
        capture_output=True, check=True,
    )
    return run.stdout


def _identity(ckpt: Path, requests: dict) -> tuple:
    doc = tessera.plan(str(ckpt), requests=requests, rank=0)
    return doc["summary"], doc["rank_plan"]["checkpoint_identity"]


def _serve(created: dict, ranks: list) -> ThreadingHTTPServer:
    body = json.dumps(created).encode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, kind: str, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer("application/json", body)

        def do_GET(self) -> None:  # noqa: N802
            self._answer("application/vnd.apache.arrow.stream", ranks[int(self.path.rsplit("/", 1)[1])])

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _lying_server_rank(rank: int, port: int, ckpt: str, url: str, own_port: int, out: str) -> None:
    top, bottom = np.empty((ROWS // 2, COLS), np.float32), np.empty((ROWS // 2, COLS), np.float32)
    # Both ranks want w's two halves by rows, top first: the requests of plan A.
    state = {"top": (top, [0, 0]), "bottom": (bottom, [ROWS // 2, 0])}
    kw = dict(rename={"top": "w", "bottom": "w"}, server=url, server_id="run/step-1")
    if own_port:
        # No torch.distributed: tessera's own rendezvous and TCP exchange.
        started = time.monotonic()
        try:
            tessera.load(state, ckpt, rank=rank, world_size=2, exchange=True, master_addr="127.0.0.1",
                         master_port=own_port, progress=False, timeout=20, **kw)
            outcome = {"ok": True}
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcome = {"error": f"{type(e).__name__}: {e}"}
        outcome["seconds"] = time.monotonic() - started
    else:
        join_job(rank, 2, port)
        outcome = _load(state, ckpt, **kw)
    if "ok" in outcome:
        want = _values(1)["w"]
        outcome["right_rows"] = bool(np.array_equal(top, want[: ROWS // 2]) and np.array_equal(bottom, want[ROWS // 2:]))
    _result(rank, out, **outcome)


@pytest.mark.parametrize("path", ["process group", "own rendezvous"])
@pytest.mark.parametrize("lie", ["rank 1 from another plan", "rank 0's boxes swapped"])
def test_a_plan_server_that_lies_across_ranks_is_refused(tmp_path, lie, path):
    if not TESSERA_BIN.exists():
        pytest.fail(f"{TESSERA_BIN} is missing: build it with `cargo build --bin tessera`")
    ckpt = _save_steps(tmp_path) / "step-1"
    a, b = _requests(False), _requests(True)
    summary, identity = _identity(ckpt, a)
    created = {"plan": "lying", "checkpoint": "run/step-1", "world": 2, "summary": summary,
               "checkpoint_identity": identity}
    # The honest server first: every rank from plan A, the right rows on both.
    plans = {"honest": [a, a], "rank 1 from another plan": [a, b], "rank 0's boxes swapped": [b, b]}
    for case in ("honest", lie):
        ranks = [_rank_plan_arrow(ckpt, plans[case][r], r, tmp_path) for r in range(2)]
        server = _serve(created, ranks)
        out = tmp_path / case.replace(" ", "_").replace("'", "")
        out.mkdir()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            own_port = free_port() if path == "own rendezvous" else 0
            results = run_job(_lying_server_rank, 2, (str(ckpt), url, own_port), out)
        finally:
            server.shutdown()
        if case == "honest":
            assert all(r.get("right_rows") for r in results.values()), results
            continue
        for rank, result in results.items():
            assert "error" in result, f"{lie}: rank {rank} loaded ({result})"
            error = result["error"]
            if lie == "rank 1 from another plan":
                needle = f"rank {rank}: this rank's plan and the plan of rank {1 - rank} disagree on what they pass each other"
            elif rank == 0:
                needle = "rank 0: the plan's destinations are not this rank's requests: destination 0 is box at [64, 0]"
            elif path == "process group":
                needle = "rank 0 failed planning its pieces"
            else:
                needle = "rank 0"  # its connection ends, or the agreement waits for it in vain
            assert needle in error, f"{lie}: rank {rank}: {needle!r} not in {error}"


# -- a rank whose load fails before the group step ------------------------------------------------


def _resume_rank(rank: int, port: int, root: str, out: str) -> None:
    join_job(rank, 2, port)
    state = _whole()
    if rank == 1:
        # A key the checkpoint lacks: this rank's load raises before it reaches the group.
        state["extra.weight"] = np.empty(3, np.float32)
    first = _load(state, f"{root}/step-2")
    state.pop("extra.weight", None)
    # The resume script falls back to the older checkpoint after any error.
    fallback = _load(state, f"{root}/step-1")
    _result(rank, out, first=first, fallback=fallback, fallback_right=_same(state, 1) if "ok" in fallback else None)


def test_a_rank_failing_before_the_group_step_takes_part_and_the_fallback_loads_meet(tmp_path):
    root = _save_steps(tmp_path)
    results = run_job(_resume_rank, 2, (str(root),), tmp_path)
    first0, first1 = results[0]["first"], results[1]["first"]
    assert "error" in first1 and "extra.weight" in first1["error"], first1
    assert "error" in first0, f"rank 0's first load succeeded: {first0}"
    assert "rank 0: rank 1 failed preparing its requests" in first0["error"], first0
    assert "extra.weight" in first0["error"], first0
    assert first0["seconds"] < 10, first0
    for rank, result in results.items():
        assert result["fallback"].get("ok"), f"rank {rank}: {result['fallback']}"
        assert result["fallback_right"], f"rank {rank}: the fallback loaded other bytes than step-1's"
        assert result["fallback"]["seconds"] < 10, result

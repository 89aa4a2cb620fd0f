"""tessera.load with plans from a real `tessera serve` on a loopback port."""

from __future__ import annotations

import multiprocessing
import shutil

import pytest

import tessera
from conftest import empty, fixture, free_port, rank_state, reference, sha256

C = "c_w4_dp2_tp2"


def plan_computations(url: str) -> int:
    import re
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(re.search(r"^tessera_plan_computations_total (\d+)$", text, re.M).group(1))


def test_independent_ranks_plan_on_the_server(plan_server):
    root, url = plan_server
    shutil.copytree(fixture(C), root / "fixtures" / "c")
    ref = reference(C, "w2_shard1")
    for rank in range(2):
        state = rank_state(ref, rank)
        tessera.load(state, str(root / "fixtures" / "c"), rank=rank, world_size=2, server=url, progress=False)
        for fqn, t in ref["tensors"].items():
            assert sha256(state[fqn][0]) == t["ranks"][rank]["sha256"], (fqn, rank)
    # Independent ranks each ask for their own one-rank plan.
    assert plan_computations(url) == 2


def _exchange_rank(args):
    path, url, rank, world, port = args
    ref = reference(C, "w3_shard0")
    state = rank_state(ref, rank)
    report = tessera.load(
        state, path, rank=rank, world_size=world, exchange=True, master_addr="127.0.0.1",
        master_port=port, server=url, server_id="fixtures/c", progress=False, timeout=60,
    )
    return report, {fqn: sha256(a) for fqn, (a, _) in state.items()}


def test_exchange_with_one_plan_from_the_server(plan_server):
    root, url = plan_server
    path = root / "fixtures" / "c"
    shutil.copytree(fixture(C), path)
    ref = reference(C, "w3_shard0")
    port = free_port()
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_exchange_rank, [(str(path), url, r, 3, port) for r in range(3)])
    for rank, (report, shas) in enumerate(results):
        for fqn, t in ref["tensors"].items():
            assert shas[fqn] == t["ranks"][rank]["sha256"], (fqn, rank)
    assert sum(r["bytes_received"] for r, _ in results) > 0
    # The three ranks gathered the same requests: the server planned the job once.
    assert plan_computations(url) == 1


def test_unknown_checkpoint_on_the_server(plan_server):
    root, url = plan_server
    shutil.copytree(fixture(C), root / "fixtures" / "c")
    with pytest.raises(tessera.TesseraError, match=r"fixtures/nope"):
        tessera.load(
            {"model.final_ln.weight": empty("float32", [64])}, str(fixture(C)),
            server=url, server_id="fixtures/nope", progress=False,
        )


def test_a_server_without_an_id_for_the_checkpoint_says_to_give_server_id(plan_server, monkeypatch):
    root, url = plan_server
    shutil.copytree(fixture(C), root / "c")
    # "c" alone: no <run>/<step> for the server's id of it.
    monkeypatch.chdir(root)
    with pytest.raises(tessera.TesseraError, match=r'checkpoint "c" .*give server_id="<run>/<step>"'):
        tessera.load(
            {"model.final_ln.weight": empty("float32", [64])}, "c", server=url, progress=False,
        )

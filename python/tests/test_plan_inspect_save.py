"""tessera.plan, tessera.inspect and tessera.save (one rank and several)."""

from __future__ import annotations

import json
import multiprocessing

import numpy as np
import pytest

import tessera
from conftest import expected_tensors, fixture, free_port, sha256

C = "c_w4_dp2_tp2"


def test_inspect_returns_plain_data():
    info = tessera.inspect(str(fixture(C)))
    assert info["format"] == "dcp"
    tensors = {t["fqn"]: t for t in info["tensors"]}
    expected = expected_tensors(C)
    assert set(tensors) == set(expected)
    assert tensors["model.tok_emb.weight"]["shape"] == [96, 64]
    assert all(b["file"].endswith(".distcp") for b in tensors["model.tok_emb.weight"]["boxes"])


def test_plan_from_layout_file_and_dict():
    layout_path = fixture(C) / "layout_w3_shard0.json"
    from_file = tessera.plan(str(fixture(C)), layout=str(layout_path), rank=2)
    from_dict = tessera.plan(str(fixture(C)), layout=json.loads(layout_path.read_text()))
    assert from_file["world"] == 3 and from_dict["summary"] == from_file["summary"]
    summary = from_file["summary"]
    assert summary["bytes_read"] <= summary["bytes_needed"]
    assert from_file["rank_plan"]["rank"] == 2 and from_file["rank_plan"]["destinations"]
    with pytest.raises(tessera.TesseraError, match=r"rank 3 is outside the plan's 3 ranks"):
        tessera.plan(str(fixture(C)), layout=str(layout_path), rank=3)


def test_plan_from_requests():
    requests = {"ranks": [[{"fqn": "model.tok_emb.weight", "flat": [0, 100]}], []]}
    doc = tessera.plan(str(fixture(C)), requests=requests, rank=0)
    assert doc["world"] == 2
    assert doc["rank_plan"]["destinations"][0]["bytes"] == 400


def test_plan_errors():
    with pytest.raises(ValueError, match=r"exactly one of layout= or requests="):
        tessera.plan(str(fixture(C)))
    with pytest.raises(tessera.TesseraError, match=r"model\.missing"):
        tessera.plan(str(fixture(C)), requests={"ranks": [[{"fqn": "model.missing", "flat": [0, 1]}]]})


def test_save_refuses_committed_checkpoint_and_conflicts(tmp_path):
    out = tmp_path / "ckpt"
    tessera.save({"w": np.zeros(4, np.float32)}, str(out))
    with pytest.raises(tessera.TesseraError, match=r"manifest"):
        tessera.save({"w": np.zeros(4, np.float32)}, str(out))
    with pytest.raises(TypeError, match=r"w: save needs the global shape"):
        tessera.save({"w": (np.zeros(4, np.float32), [0])}, str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"needs a rendezvous"):
        tessera.save({"w": np.zeros(4, np.float32)}, str(tmp_path / "x"), rank=0, world_size=2)


def test_save_refuses_a_claimed_directory_until_break_claim(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    claim = out / ".tessera-claim.json"
    claim.write_text(
        '{"pid": 4242, "host": "trainer-7", "created": "2026-01-02T03:04:05Z", "command": "tessera.save"}'
    )
    with pytest.raises(tessera.TesseraError) as refused:
        tessera.save({"w": np.arange(4, dtype=np.float32)}, str(out))
    message = str(refused.value)
    assert "is held by tessera.save pid 4242 on host trainer-7 since 2026-01-02T03:04:05Z" in message
    assert "rerun the save with break_claim=True" in message
    assert not (out / "data").exists() and not (out / "manifest.json").exists()
    manifest = tessera.save({"w": np.arange(4, dtype=np.float32)}, str(out), break_claim=True)
    assert manifest["tensors"] == 1
    assert not claim.exists()  # released after the commit
    w = np.empty(4, np.float32)
    tessera.load({"w": w}, str(out), progress=False)
    assert np.array_equal(w, np.arange(4, dtype=np.float32))


def test_save_with_a_hole_commits_nothing(tmp_path):
    out = tmp_path / "holey"
    with pytest.raises(tessera.TesseraError, match=r"w"):
        tessera.save({"w": (np.zeros(4, np.float32), [0], [8])}, str(out))
    assert not (out / "manifest.json").exists()


def _save_rank(args):
    rank, world, port, path = args
    full = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    rows = [(0, 4), (4, 8), (8, 10)][rank]
    state = {
        # Sharded by rows, uneven.
        "layer.weight": (np.ascontiguousarray(full[rows[0] : rows[1]]), [rows[0], 0], [10, 6]),
        # Replicated on every rank: written once.
        "layer.bias": np.full(6, 7, dtype=np.int64),
    }
    return tessera.save(
        state, path, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, timeout=60
    )


def test_save_from_three_ranks_then_load(tmp_path):
    path = str(tmp_path / "run" / "step-3")
    world, port = 3, free_port()
    with multiprocessing.get_context("spawn").Pool(world) as pool:
        manifests = pool.map(_save_rank, [(r, world, port, path) for r in range(world)])
    assert all(m.manifest == manifests[0].manifest for m in manifests)
    assert [m.rank for m in manifests] == [0, 1, 2]
    assert manifests[0]["tensors"] == 2 and manifests[0]["chunks"] == 4  # bias written once
    weight, bias = np.empty((10, 6), np.float32), np.empty(6, np.int64)
    tessera.load({"layer.weight": weight, "layer.bias": bias}, path, progress=False)
    assert np.array_equal(weight, np.arange(60, dtype=np.float32).reshape(10, 6))
    assert np.array_equal(bias, np.full(6, 7))
    assert sha256(weight) == sha256(np.arange(60, dtype=np.float32).reshape(10, 6))

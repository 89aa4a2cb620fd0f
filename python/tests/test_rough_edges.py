"""Rough edges a transformers eval/SFT job hit (issue 44 items 5 and 6): `tessera.inspect` lists
a native checkpoint's plain values with their values, as it lists a DCP checkpoint's, in the same
shape; and `tessera.load` loads into tensors and DTensors built on the meta device as `dcp.load`
does (a real tensor takes each one's place in the state dict), checked against `dcp.load` in a
real 2-rank gloo job with a tensor-parallel model built on meta (PyTorch's
test_tp_checkpoint_load_on_meta_device)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from conftest import join_job, run_job

torch = pytest.importorskip("torch", reason="torch is not installed")

import torch.distributed.checkpoint as dcp  # noqa: E402

import tessera  # noqa: E402

TRAIN_STATE = {"step": 5, "lr": 0.1, "name": "run1", "milestones": [100, 200], "done": False, "note": None}


def _state() -> dict:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)},
        "train_state": dict(TRAIN_STATE),
        "blob": b"\x00\x01raw",
    }


def _objects(doc: dict) -> dict:
    entries = doc["objects"]
    for entry in entries:
        assert {"key", "file", "byte_offset", "byte_length"} <= set(entry), entry
        assert entry["byte_length"] > 0, entry
    return {entry["key"]: entry for entry in entries}


def test_inspect_lists_a_native_checkpoints_plain_values_as_dcps(tmp_path):
    native, dcp_dir = str(tmp_path / "native"), str(tmp_path / "dcp")
    tessera.save(_state(), native, step=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dcp.save alone warns it has no group
        dcp.save(_state(), checkpoint_id=dcp_dir)

    ours = _objects(tessera.inspect(native))
    expected = {f"train_state.{k}": v for k, v in TRAIN_STATE.items()}
    expected["blob"] = {"__bytes__": b"\x00\x01raw".hex()}
    assert {k: e["value"] for k, e in ours.items()} == expected
    assert all(e["file"] == "data/rank-0.bin" for e in ours.values()), ours
    # The same values, keys and document shape as a DCP checkpoint of the same state.
    theirs = _objects(tessera.inspect(dcp_dir))
    assert {k: e["value"] for k, e in theirs.items()} == expected
    assert {frozenset(e) for e in ours.values()} == {frozenset(e) for e in theirs.values()}
    # The manifest's count agrees with the list.
    assert tessera.inspect(native)["manifest"]["objects"] == len(expected)


def test_meta_tensors_in_a_nested_state_dict_are_replaced_in_place(tmp_path):
    saved = {"model": {"w": torch.randn(4, 6), "b": torch.randn(6).to(torch.bfloat16)}, "step": 3}
    tessera.save(saved, str(tmp_path / "c"))
    inner = {"w": torch.empty(4, 6, device="meta"), "b": torch.empty(6, dtype=torch.bfloat16, device="meta")}
    state = {"model": inner, "step": 0}
    report = tessera.load(state, str(tmp_path / "c"), progress=False)
    # The caller's inner dict holds real tensors with the saved bytes (dcp.load assigns into it).
    assert state["model"] is inner and state["step"] == 3
    for name in ("w", "b"):
        got = inner[name]
        assert got.device.type == "cpu" and got.dtype == saved["model"][name].dtype, name
        assert torch.equal(got, saved["model"][name]), name
    assert report.tensors_loaded == 2


class _UnevenModel(torch.nn.Module):
    """PyTorch's UnevenShardedModel (test_tp_checkpoint.py): net3 has one output row, so its
    Colwise shard is empty on rank 1."""

    def __init__(self, device):
        super().__init__()
        torch.manual_seed(5)
        self.net1 = torch.nn.Linear(5, 10, device=device)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 15, device=device)
        self.net3 = torch.nn.Linear(15, 1, device=device)


def _tp_model(device, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel(), "net3": ColwiseParallel()}
    return parallelize_module(_UnevenModel(device), mesh, parallelize_plan=plan)


def _local_hex(t) -> str:
    return t.to_local().contiguous().view(torch.uint8).numpy().tobytes().hex()


def _meta_tp_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    join_job(rank, 2, port)
    result: dict = {}
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = _tp_model("cpu", mesh)
        saved = {"model": model.state_dict()}
        dcp.save(saved, checkpoint_id=path)
        result["saved"] = {k: _local_hex(v) for k, v in saved["model"].items()}
        for how in ("tessera", "dcp"):
            model2 = _tp_model("meta", mesh)
            before = model2.state_dict()
            was_meta = all(v.is_meta for v in before.values())
            state = {"model": before}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                if how == "tessera":
                    tessera.load(state, path, progress=False, timeout=60)
                else:
                    dcp.load(state, checkpoint_id=path)
            in_place = state["model"] is before
            model2.load_state_dict(state["model"], assign=True)
            after = model2.state_dict()
            result[how] = {
                "was_meta": was_meta,
                "in_place": in_place,
                "meta_after": [k for k, v in {**state["model"], **after}.items() if v.is_meta],
                "devices": sorted({str(v.to_local().device) for v in after.values()}),
                "placements": {k: repr(tuple(v.placements)) for k, v in after.items()},
                "shapes": {k: list(v.to_local().shape) for k, v in after.items()},
                "loaded": {k: _local_hex(v) for k, v in state["model"].items()},
                "after": {k: _local_hex(v) for k, v in after.items()},
            }
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_tp_model_built_on_meta_loads_like_dcp_load(tmp_path):
    """It failed "model.net1.weight: tensor is on meta"; now every DTensor's local shard is
    allocated as dcp.load allocates it and loaded: bytes equal to dcp.load's and to what was
    saved, on every rank (rank 1's shard of net3 is empty)."""
    got = run_job(_meta_tp_rank, 2, (str(tmp_path / "ckpt"),), tmp_path)
    for rank in range(2):
        assert "error" not in got[rank], got[rank]
        ours, theirs, saved = got[rank]["tessera"], got[rank]["dcp"], got[rank]["saved"]
        assert ours["was_meta"] and ours["in_place"], (rank, ours)
        assert ours["meta_after"] == [] and ours["devices"] == ["cpu"], (rank, ours)
        for key in ("placements", "shapes", "loaded", "after"):
            assert ours[key] == theirs[key], (rank, key)
        assert ours["loaded"] == ours["after"] == saved, rank
    assert got[1]["tessera"]["shapes"]["net3.weight"] == [0, 15]
    assert got[0]["tessera"]["shapes"]["net3.weight"] == [1, 15]

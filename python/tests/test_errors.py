"""Bad requests and unreachable services: clear errors that name the tensor, nothing silent."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from conftest import empty, expected_tensors, fixture

C = "c_w4_dp2_tp2"


def test_unknown_fqn_is_named_with_near_matches():
    with pytest.raises(tessera.TesseraError) as e:
        tessera.load({"model.final_ln.wieght": np.empty(3, np.float32)}, str(fixture(C)), progress=False)
    assert str(e.value).startswith(
        f"Missing key in checkpoint state_dict: model.final_ln.wieght. "
        f"1 key(s) of the state dict are not in checkpoint {fixture(C)}: model.final_ln.wieght: "
        "did you mean model.final_ln.weight"
    )
    assert "strict=False loads the rest" in str(e.value)


def test_wrong_shape_names_tensor_and_both_shapes():
    t = expected_tensors(C)["model.tok_emb.weight"]
    assert t["shape"] == [96, 64]
    with pytest.raises(
        tessera.TesseraError,
        match=r"tensor model\.tok_emb\.weight: the checkpoint's shape is \[96, 64\] but the array's is \[96, 63\]",
    ):
        tessera.load({"model.tok_emb.weight": np.empty((96, 63), np.float32)}, str(fixture(C)), progress=False)


def test_wrong_dtype_is_not_cast_unless_asked():
    with pytest.raises(
        tessera.TesseraError,
        match=r"tensor model\.tok_emb\.weight: the checkpoint stores model\.tok_emb\.weight as f32 but the array is float64; pass cast=True to convert on load",
    ):
        tessera.load({"model.tok_emb.weight": np.empty((96, 64), np.float64)}, str(fixture(C)), progress=False)


def test_box_past_the_end():
    with pytest.raises(tessera.TesseraError, match=r"box at offsets \[90, 0\] of shape \[8, 64\] reaches past"):
        tessera.load(
            {"model.tok_emb.weight": (np.empty((8, 64), np.float32), [90, 0])},
            str(fixture(C)),
            progress=False,
        )


def test_flat_range_past_the_end():
    with pytest.raises(tessera.TesseraError, match=r"flat range \[6000, 6200\) reaches past the checkpoint's 6144 elements"):
        tessera.load(
            {"model.tok_emb.weight": tessera.Flat(np.empty(200, np.float32), 6000)},
            str(fixture(C)),
            progress=False,
        )


def test_non_contiguous_and_read_only_arrays_are_refused():
    a = np.empty((64, 96), np.float32).T
    with pytest.raises(ValueError, match=r"model\.tok_emb\.weight: array is not C-contiguous"):
        tessera.load({"model.tok_emb.weight": a}, str(fixture(C)), progress=False)
    b = np.empty((96, 64), np.float32)
    b.setflags(write=False)
    with pytest.raises(ValueError, match=r"model\.tok_emb\.weight: array is read-only"):
        tessera.load({"model.tok_emb.weight": b}, str(fixture(C)), progress=False)


def test_values_that_are_not_arrays_are_non_tensor_keys():
    # A non-tensor value is looked up among the checkpoint's objects; this one has none of that name.
    with pytest.raises(tessera.TesseraError, match=r"not in checkpoint .*: train_step"):
        tessera.load({"train_step": 3}, str(fixture(C)), progress=False)


def test_shared_memory_between_entries_is_refused():
    a = empty("float32", [64])
    with pytest.raises(tessera.TesseraError, match=r"share memory"):
        tessera.load(
            {"model.final_ln.weight": a, "model.final_ln.bias": a},
            str(fixture(C)),
            progress=False,
        )


def test_missing_checkpoint(tmp_path):
    with pytest.raises(tessera.TesseraError, match=str(tmp_path / "nothing")):
        tessera.load({}, str(tmp_path / "nothing"), progress=False)


def test_unreachable_server():
    t = expected_tensors(C)["model.final_ln.weight"]
    with pytest.raises(tessera.TesseraError, match=r"http://127\.0\.0\.1:9/"):
        tessera.load(
            {"model.final_ln.weight": empty(t["dtype"], t["shape"])},
            str(fixture(C)),
            server="http://127.0.0.1:9/",
            server_id="fixtures/c",
            progress=False,
        )


def test_exchange_needs_a_rendezvous(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "TESSERA_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"exchange=True needs a rendezvous"):
        tessera.load({}, str(fixture(C)), rank=0, world_size=2, exchange=True, progress=False)


def test_rank_outside_world():
    with pytest.raises(ValueError, match=r"rank 2 is outside a world of 2 ranks"):
        tessera.load({}, str(fixture(C)), rank=2, world_size=2, progress=False)


def test_torchrun_environment_is_the_default(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    t = expected_tensors(C)["model.final_ln.weight"]
    report = tessera.load(
        {"model.final_ln.weight": empty(t["dtype"], t["shape"])}, str(fixture(C)), progress=False
    )
    assert report["rank"] == 1


def _target(fqn, array, device):
    from tessera import _tessera

    return _tessera.LoadTarget(
        fqn=fqn, dtype=str(array.dtype), shape=list(array.shape), address=array.ctypes.data, nbytes=array.nbytes,
        cuda_device=device,
    )


def test_cuda_destinations_need_the_cuda_build_or_a_driver():
    from tessera import _tessera

    a = np.empty(64, np.float32)
    # The native module's own check (torch, which makes CUDA tensors, is not needed to reach it).
    with pytest.raises(tessera.TesseraError, match=r"no CUDA support|CUDA driver"):
        _tessera.load_into(
            _tessera.open_checkpoint(str(fixture(C)), []), [_target("model.final_ln.weight", a, 0)],
            tessera._typed(_tessera.LoadRequest, timeout_s=10.0),
        )


def test_host_and_cuda_destinations_in_one_call_are_refused():
    from tessera import _tessera

    a, b = np.empty(64, np.float32), np.empty(64, np.float32)
    with pytest.raises(
        tessera.TesseraError,
        match=r"model\.final_ln\.weight is in host memory but model\.final_ln\.bias in cuda:1",
    ):
        _tessera.load_into(
            _tessera.open_checkpoint(str(fixture(C)), []),
            [_target("model.final_ln.weight", a, None), _target("model.final_ln.bias", b, 1)],
            tessera._typed(_tessera.LoadRequest, timeout_s=10.0),
        )


def test_a_load_request_refuses_a_field_it_does_not_have():
    from tessera import _tessera

    request = tessera._typed(_tessera.LoadRequest, rank=1, world=2, read_order="storage")
    assert (request.rank, request.world, request.read_order, request.verify) == (1, 2, "storage", True)
    with pytest.raises(AttributeError, match="raed_order"):
        tessera._typed(_tessera.LoadRequest, raed_order="storage")
    with pytest.raises(AttributeError, match="brake_claim"):
        tessera._typed(_tessera.SaveRequest, brake_claim=True)

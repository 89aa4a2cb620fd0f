"""The DCP-aligned API: argument order, non-tensor values, strict, cast, rename, allow_pickle,
typed reports, Partial DTensors, Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import tessera
from conftest import REPO, empty, expected_tensors, fixture, free_port, sha256

C = "c_w4_dp2_tp2"
E = "e_w2_fsdp2_adamw"


def test_dcp_argument_order_and_the_old_order_warns():
    t = expected_tensors(C)["model.final_ln.weight"]
    new = empty(t["dtype"], t["shape"])
    report = tessera.load({"model.final_ln.weight": new}, fixture(C), progress=False)  # a PathLike
    assert isinstance(report, tessera.LoadReport) and report.tensors_loaded == 1
    assert report["bytes_needed"] == report.bytes_needed == new.nbytes
    old = empty(t["dtype"], t["shape"])
    with pytest.warns(DeprecationWarning, match=r"call tessera\.load\(state_dict, checkpoint_id\)"):
        tessera.load(str(fixture(C)), {"model.final_ln.weight": old}, progress=False)
    assert sha256(new) == sha256(old) == t["sha256"]
    with pytest.raises(TypeError, match=r"needs checkpoint_id"):
        tessera.load({"x": new})


def test_plain_values_round_trip_through_a_native_checkpoint(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    saved = {
        "model": {"w": w},
        "step": 5,
        "train": {"lr": 0.1, "betas": (0.9, 0.95), "name": "run-1", "flags": {"ema": True, "skip": None}},
        "history": [1, 2.5, "three"],
        "blob": b"\x00raw\xff",
    }
    report = tessera.save(saved, tmp_path / "ckpt", step=5)
    assert isinstance(report, tessera.SaveReport)
    assert report["step"] == 5 and report.objects == 8  # step, lr, betas, name, ema, skip, history, blob
    keys = set(json.loads(tessera._tessera.open_checkpoint(str(tmp_path / "ckpt"), []).entries())["objects"])
    assert {"step", "train.lr", "train.betas", "train.flags.ema", "history", "blob"} <= keys

    state = {
        "model": {"w": np.zeros((3, 4), np.float32)},
        "step": 0,
        "train": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "flags": {"ema": False, "skip": 1}},
        "history": [],
        "blob": b"",
    }
    loaded = tessera.load(state, tmp_path / "ckpt", progress=False)
    assert np.array_equal(state["model"]["w"], w)
    assert state["step"] == 5 and state["history"] == [1, 2.5, "three"] and state["blob"] == b"\x00raw\xff"
    assert state["train"] == {"lr": 0.1, "betas": (0.9, 0.95), "name": "run-1", "flags": {"ema": True, "skip": None}}
    assert loaded.objects_loaded == 8 and loaded.tensors_loaded == 1


def test_dcp_objects_decode_to_plain_values():
    # Fixture e holds AdamW's param_groups (flattened by DCP) and a train_state, as torch.save blobs.
    state = {"optim": {"param_groups": [{"lr": None, "betas": None, "params": None}]}, "train_state": {"step": None}}
    tessera.load(state, fixture(E), progress=False)
    group = state["optim"]["param_groups"][0]
    assert group["lr"] == 0.003 and group["betas"] == (0.9, 0.95) and group["params"][0] == "tok_emb.weight"
    assert state["train_state"]["step"] == 2


def test_saving_a_value_that_is_not_plain_is_refused_naming_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"extra\.third: tessera saves tensors and plain values .* a Fraction is not one"):
        tessera.save({"w": np.zeros(2, np.float32), "extra": {"third": Fraction(1, 3)}}, tmp_path / "x")
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_a_pickle_that_is_not_plain_needs_allow_pickle(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # dcp.save without a process group warns that it saves alone
        dcp.save({"w": torch.arange(4.0), "third": Fraction(1, 3)}, checkpoint_id=str(tmp_path / "d"))
    state = {"w": torch.zeros(4), "third": None}
    with pytest.raises(ValueError) as refused:
        tessera.load(state, tmp_path / "d", progress=False)
    assert str(refused.value).startswith(
        "object third: tessera loads non-tensor values that decode to plain Python values, and it pickles fractions.Fraction"
    )
    assert "pass allow_pickle=True" in str(refused.value)
    assert state["third"] is None and torch.equal(state["w"], torch.zeros(4))  # nothing half-loaded
    tessera.load(state, tmp_path / "d", allow_pickle=True, progress=False)
    assert state["third"] == Fraction(1, 3) and torch.equal(state["w"], torch.arange(4.0))


def test_strict_false_reports_missing_keys_and_leaves_them():
    t = expected_tensors(C)["model.final_ln.weight"]
    a = empty(t["dtype"], t["shape"])
    kept = np.full(3, 7, np.float32)
    state = {"model.final_ln.weight": a, "model.final_ln.wieght": kept, "epoch": 9}
    report = tessera.load(state, fixture(C), strict=False, progress=False)
    assert report.missing_keys == ["model.final_ln.wieght", "epoch"]
    assert sha256(a) == t["sha256"] and np.array_equal(kept, np.full(3, 7, np.float32)) and state["epoch"] == 9


def test_rename_by_dict_and_by_callable():
    t = expected_tensors(C)["model.final_ln.weight"]
    a, b = empty(t["dtype"], t["shape"]), empty(t["dtype"], t["shape"])
    tessera.load({"module.model.final_ln.weight": a}, fixture(C), rename=lambda k: k.removeprefix("module."), progress=False)
    tessera.load({"ln.w": b}, fixture(C), rename={"ln.w": "model.final_ln.weight"}, progress=False)
    assert sha256(a) == sha256(b) == t["sha256"]
    with pytest.raises(tessera.TesseraError, match=r"ln\.x \(renamed to model\.final_ln\.weight2\): did you mean model\.final_ln\.weight"):
        tessera.load({"ln.x": b}, fixture(C), rename={"ln.x": "model.final_ln.weight2"}, progress=False)


def test_cast_converts_floats_and_refuses_across_kinds():
    tensors = expected_tensors(C)
    bf16 = next(f for f, t in tensors.items() if t["dtype"] == "bfloat16")
    t = tensors[bf16]
    exact = empty("bfloat16", t["shape"])
    tessera.load({bf16: exact}, fixture(C), progress=False)
    as_f32 = np.zeros(t["shape"], np.float32)
    with pytest.raises(tessera.TesseraError, match=rf"tensor {bf16}: the checkpoint stores {bf16} as bf16 but the array is float32; pass cast=True"):
        tessera.load({bf16: as_f32}, fixture(C), progress=False)
    report = tessera.load({bf16: as_f32}, fixture(C), cast=True, progress=False)
    assert report.cast == {bf16: "bf16->f32"}
    assert np.array_equal(as_f32, exact.astype(np.float32))
    with pytest.raises(tessera.TesseraError, match=rf"tensor {bf16}: cannot cast the checkpoint's bf16 to int32"):
        tessera.load({bf16: np.zeros(t["shape"], np.int32)}, fixture(C), cast=True, progress=False)


def test_cast_of_torch_tensors_and_dtensor_shards():
    import torch

    tensors = expected_tensors(C)
    f32 = next(f for f, t in tensors.items() if t["dtype"] == "float32" and len(t["shape"]) == 2)
    t = tensors[f32]
    exact = torch.empty(t["shape"], dtype=torch.float32)
    tessera.load({f32: exact}, fixture(C), progress=False)
    half = torch.zeros(t["shape"], dtype=torch.float16)
    tessera.load({f32: half}, fixture(C), cast=True, progress=False)
    assert torch.equal(half, exact.to(torch.float16))


def _partial_rank(rank, world, port, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        partial = DTensor.from_local(torch.zeros(64), mesh, [Partial()], run_check=False)
        for call in (lambda: tessera.load({"model.final_ln.weight": partial}, fixture(C), progress=False),
                     lambda: tessera.save({"w": partial}, "/nonexistent/never-written")):
            try:
                call()
                out[rank] = "no error"
            except ValueError as e:
                out[rank] = str(e)
                if "redistribute it to Replicate() or Shard() first" not in str(e):
                    break
    finally:
        dist.destroy_process_group()


def test_partial_dtensors_are_refused_clearly():
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_partial_rank, args=(2, free_port(), out), nprocs=2, join=True)
    for rank in range(2):
        assert out[rank].startswith("w: the DTensor is Partial(sum) on mesh dim 0"), out[rank]
        assert out[rank].endswith("redistribute it to Replicate() or Shard() first")


def test_ctrl_c_interrupts_a_load_waiting_for_its_peers(tmp_path):
    # Rank 0 of 2 waits at tessera's rendezvous for a rank 1 that never comes (timeout 120 s);
    # SIGINT must end it within seconds with KeyboardInterrupt, not at the timeout.
    t = expected_tensors(C)["model.final_ln.weight"]
    script = textwrap.dedent(
        f"""
        import numpy as np, sys, tessera
        print("ready", flush=True)
        try:
            tessera.load({{"model.final_ln.weight": np.empty({t["shape"]}, np.float32)}}, {str(fixture(C))!r},
                         rank=0, world_size=2, exchange=True, master_addr="127.0.0.1",
                         master_port={free_port()}, timeout=120, progress=False)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        assert proc.poll() is None, proc.stderr.read()
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert out.strip() == "interrupted"
        assert time.monotonic() - sent < 30
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_compressed_object_member_is_refused_without_inflating_it():
    # A torch.save-shaped archive whose data.pkl is deflated: 64 MiB of pickle in ~64 KiB.
    import tracemalloc
    import zipfile

    from tessera import _objects

    payload = pickle.dumps("x" * (64 << 20), protocol=4)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", payload)
    data = buffer.getvalue()
    del payload
    assert len(data) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            _objects.decode("extra_state", data, None, allow_pickle=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert message.startswith("object extra_state: the stored bytes do not decode"), message
    assert "archive/data.pkl is compressed" in message and "does not inflate" in message, message
    assert peak < 8 << 20, f"{peak} bytes allocated: the member was inflated"

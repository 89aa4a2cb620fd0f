"""`tessera.torch.StorageReader`: `dcp.load(state, storage_reader=...)` with real torch on CPU,
multi-process gloo on 127.0.0.1, against the torch-written fixtures and their torch-made
references."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import warnings

import pytest

from conftest import DCP_FIXTURES, LAYOUTS, expected_tensors, fixture, free_port, reference

import torch  # noqa: E402  (make python-test installs it: these tests run everywhere)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem  # noqa: E402

import tessera  # noqa: E402
import tessera.torch  # noqa: E402

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
HF = "f_hf_w1_full"
NOTE = b"dcp-fixture\x00\xff\x01"  # fixture c's `extra.note`, saved into the native checkpoint too


def sha(t) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def patterned(shape, dtype):
    # 0xA5 everywhere, not zeros: a byte the reader failed to write cannot pass by luck.
    t = torch.empty(shape, dtype=dtype)
    t.reshape(-1).view(torch.uint8).fill_(0xA5)
    return t


def quiet_load(state, reader):
    # dcp.load without a process group warns that it loads in one process: that is the intent.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader)


def full_state(name: str) -> dict:
    """Whole tensors of a fixture, per its expected.json."""
    return {f: patterned(t["shape"], TORCH_DTYPES[t["dtype"]]) for f, t in expected_tensors(name).items()}


@pytest.fixture(scope="module")
def native_c(tmp_path_factory):
    """Fixture c (DCP, 4 ranks) saved again by `tessera.save` as a native checkpoint, with its
    `extra.note` bytes: same values, so c's references hold for it."""
    state = full_state("c_w4_dp2_tp2")
    tessera.load(state, str(fixture("c_w4_dp2_tp2")), progress=False)
    path = tmp_path_factory.mktemp("native") / "c"
    tessera.save({**state, "extra.note": NOTE}, str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Every fixture into every reference layout, on a gloo mesh
# ---------------------------------------------------------------------------------------------


def _placement(text: str):
    from torch.distributed.tensor import Replicate, Shard

    if text.startswith("Shard("):
        return Shard(int(text.split("=")[1].rstrip(")")))
    if text == "Replicate()":
        return Replicate()
    raise ValueError(f"reference placement {text!r} is not one this test builds")


def _reader_rank(rank, world, port, layout, checkpoints, out, how="dcp"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name, path, ref_name, object_keys in checkpoints:
            ref = reference(ref_name, layout)
            state = {}
            local_bytes = 0
            for fqn, t in ref["tensors"].items():
                mine = t["ranks"][rank]
                local = patterned(mine["local_shape"], TORCH_DTYPES[t["dtype"]])
                local_bytes += local.numel() * local.element_size()
                shape = torch.Size(t["global_shape"])
                stride = torch.empty(shape, device="meta").stride()
                state[fqn] = DTensor.from_local(
                    local, mesh, [_placement(p) for p in t["placements"]],
                    run_check=False, shape=shape, stride=stride,
                )
            for key in object_keys:
                state[key] = None  # DCP replaces a non-tensor entry by the loaded value
            if how == "dcp":
                reader = tessera.torch.StorageReader(path)
                dcp.load(state, storage_reader=reader)
                report = reader.report
            else:
                # tessera.load inside the job: one load over the job's own gloo group
                # (`tessera:<order>` forces the planner's read order).
                order = how.split(":")[1] if ":" in how else None
                report = tessera.load(state, path, progress=False, timeout=60, read_order=order).to_dict()
            out[(name, rank)] = {
                "sha": {fqn: sha(state[fqn].to_local()) for fqn in ref["tensors"]},
                "objects": {key: repr(state[key]) for key in object_keys},
                "local_bytes": local_bytes,
                "report": report,
            }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["dcp", "tessera"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_fixture_into_the_reference_layout(layout, how, native_c):
    """DCP fixtures a, b, c, e in place, the HF safetensors fixture, and a native conversion of c,
    each loaded by `dcp.load` with the StorageReader into the layout torch's own `dcp.load` made
    the reference with (one spawn per layout): every rank's bytes equal torch's, non-tensor
    values equal torch's, and every rank reads exactly the bytes of its shards."""
    import torch.multiprocessing as mp

    checkpoints = [
        (name, str(fixture(name)), name, sorted(reference(name, layout)["non_tensors"]))
        for name in DCP_FIXTURES
    ]
    checkpoints.append((HF, str(fixture(HF)), HF, []))
    checkpoints.append(("native_c", str(native_c), "c_w4_dp2_tp2", ["extra.note"]))
    world = reference(DCP_FIXTURES[0], layout)["world_size"]
    for name, _, ref_name, _ in checkpoints:
        assert reference(ref_name, layout)["world_size"] == world, name
    out = mp.Manager().dict()
    mp.spawn(_reader_rank, args=(world, free_port(), layout, checkpoints, out, how), nprocs=world, join=True)

    for name, _, ref_name, object_keys in checkpoints:
        ref = reference(ref_name, layout)
        for rank in range(world):
            got = out[(name, rank)]
            for fqn, t in ref["tensors"].items():
                assert got["sha"][fqn] == t["ranks"][rank]["sha256"], (name, fqn, rank)
            for key in object_keys:
                assert got["objects"][key] == ref["non_tensors"][key]["repr"], (name, key, rank)
            assert got["report"]["bytes_needed"] == got["local_bytes"], (name, rank)
            if how == "dcp":
                # Partial reads: what tessera read is what the rank's shards hold, no more (a DCP
                # chunk's sub-box is read as byte runs, not as the whole torch.save blob).
                assert got["report"]["bytes_read"] == got["local_bytes"], (name, rank)
            else:
                assert got["report"]["exchange"] == "process_group", (name, rank)
                assert got["report"]["read_amplification"] == 1.0, (name, rank)
                assert got["report"]["bytes_received"] <= got["local_bytes"], (name, rank)
        if how == "tessera":
            # Read once as a job: the ranks together read each byte of the targets at most once.
            read = sum(out[(name, r)]["report"]["bytes_read"] for r in range(world))
            needed = sum(out[(name, r)]["local_bytes"] for r in range(world))
            assert read <= needed, (name, read, needed)
    assert ("native_c", 0) in out and len(out) == len(checkpoints) * world


# ---------------------------------------------------------------------------------------------
# One process: safetensors, native, object store, non-tensors, destinations that need a copy
# ---------------------------------------------------------------------------------------------


def test_safetensors_fixture_in_one_process():
    tensors = expected_tensors(HF)
    state = full_state(HF)
    reader = tessera.torch.StorageReader(fixture(HF))
    quiet_load(state, reader)
    for fqn, t in tensors.items():
        assert sha(state[fqn]) == t["sha256"], fqn
    assert reader.report["bytes_read"] == sum(v.numel() * v.element_size() for v in state.values())


def test_native_checkpoint_in_one_process(native_c):
    tensors = expected_tensors("c_w4_dp2_tp2")
    state = {**full_state("c_w4_dp2_tp2"), "extra.note": None}
    quiet_load(state, tessera.torch.StorageReader(str(native_c)))
    for fqn, t in tensors.items():
        assert sha(state[fqn]) == t["sha256"], fqn
    assert state["extra.note"] == NOTE


def test_dcp_fixture_through_s3(s3_server):
    root, env = s3_server
    shutil.copytree(fixture("c_w4_dp2_tp2"), root / "ckpts" / "reader_c")
    tensors = expected_tensors("c_w4_dp2_tp2")
    objects = sorted(reference("c_w4_dp2_tp2", LAYOUTS[0])["non_tensors"])
    state = {**full_state("c_w4_dp2_tp2"), **{k: None for k in objects}}
    reader = tessera.torch.StorageReader("s3://ckpts/reader_c", storage_options=env)
    quiet_load(state, reader)
    for fqn, t in tensors.items():
        assert sha(state[fqn]) == t["sha256"], fqn
    plain = {k: None for k in objects}
    quiet_load(plain, dcp.FileSystemReader(str(fixture("c_w4_dp2_tp2"))))
    for key in objects:
        assert state[key] == plain[key], key
    assert reader.report["requests"] > 0


def test_optimizer_and_train_state_equal_plain_dcp_load():
    """Fixture e (FSDP2 + AdamW, really trained): param_groups entries, `train_state.step` and
    `.last_loss`, and every tensor equal what `dcp.load` with FileSystemReader gives."""
    name = "e_w2_fsdp2_adamw"
    objects = sorted(reference(name, LAYOUTS[0])["non_tensors"])
    assert "train_state.step" in objects and "optim.param_groups.0.lr" in objects
    ours = {**full_state(name), **{k: None for k in objects}}
    theirs = {**full_state(name), **{k: None for k in objects}}
    quiet_load(ours, tessera.torch.StorageReader(fixture(name)))
    quiet_load(theirs, dcp.FileSystemReader(str(fixture(name))))
    for key in objects:
        assert ours[key] == theirs[key] and type(ours[key]) is type(theirs[key]), key
    assert ours["train_state.step"] == 2
    for fqn, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert sha(ours[fqn]) == sha(value), fqn


def test_destinations_that_need_a_copy_are_cast_and_strided_like_dcp():
    """A float64 destination for a float32 tensor (DCP casts on copy) and a transposed,
    non-contiguous destination go through a staging tensor; the values equal FileSystemReader's."""
    name = "c_w4_dp2_tp2"
    path = fixture(name)

    def state():
        return {
            "model.final_ln.bias": torch.zeros(64, dtype=torch.float64),
            "model.tok_emb.weight": torch.zeros(64, 96).t(),  # [96, 64], strides (1, 96)
        }

    ours, theirs = state(), state()
    quiet_load(ours, tessera.torch.StorageReader(path))
    quiet_load(theirs, dcp.FileSystemReader(str(path)))
    assert not ours["model.tok_emb.weight"].is_contiguous()
    for fqn in ours:
        assert ours[fqn].dtype == theirs[fqn].dtype and torch.equal(ours[fqn], theirs[fqn]), fqn
    expected = expected_tensors(name)
    assert sha(ours["model.tok_emb.weight"]) == expected["model.tok_emb.weight"]["sha256"]


class _ViewsPlanner:
    """The part of a LoadPlanner `read_data` uses, resolving items to given views."""

    def __init__(self, views):
        self.views = views
        self.committed = []

    def resolve_tensor(self, item):
        return self.views[item.dest_offsets[0]]

    def commit_tensor(self, item, tensor):
        self.committed.append(tensor)


def test_destinations_sharing_memory_are_loaded_in_order_not_refused():
    """Two read items whose destinations overlap (a custom planner may do that) cannot both be
    loaded straight into place in one call: the later one is staged and copied after, so the
    result is what item-by-item reading (FileSystemReader's) gives."""
    name = "c_w4_dp2_tp2"
    full = full_state(name)["model.tok_emb.weight"]  # [96, 64] float32, saved as rows 0..48, 48..96
    tessera.load({"model.tok_emb.weight": full}, str(fixture(name)), progress=False)
    buf = patterned([48, 64], torch.float32)

    def item(chunk_row, dest_row, rows):
        return ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("model.tok_emb.weight", [dest_row, 0]),
            dest_offsets=torch.Size([dest_row, 0]),
            storage_index=MetadataIndex("model.tok_emb.weight", [chunk_row, 0]),
            storage_offsets=torch.Size([0, 0]),
            lengths=torch.Size([rows, 64]),
        )

    planner = _ViewsPlanner({0: buf[0:48], 24: buf[24:48]})
    reader = tessera.torch.StorageReader(fixture(name))
    reader.read_data(LoadPlan([item(0, 0, 48), item(48, 24, 24)]), planner).wait()
    assert torch.equal(buf[0:24], full[0:24])
    assert torch.equal(buf[24:48], full[48:72])
    assert [t.data_ptr() for t in planner.committed] == [buf.data_ptr(), buf[24].data_ptr()]
    assert reader.report["bytes_read"] == (48 + 24) * 64 * 4


def test_missing_checkpoint_names_it(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    reader = tessera.torch.StorageReader(missing)
    # The whole path, as the CLI says it (one open for every loading front end).
    message = re.escape(f"opening checkpoint {missing}: {missing}: does not exist")
    with pytest.raises(tessera.TesseraError, match=message):
        reader.read_metadata()
    # Through dcp.load, which wraps a rank's failure in a CheckpointException quoting it.
    with pytest.raises(dcp.CheckpointException, match="global metadata read failed: " + message):
        quiet_load({"x": torch.empty(1)}, tessera.torch.StorageReader(missing))


def test_a_tensor_the_checkpoint_lacks_names_it_and_the_checkpoint():
    """A read item for a tensor tessera cannot give (a custom planner's plan, not DCP's default
    one, which refuses missing keys itself) is an error naming the tensor and the path."""
    path = str(fixture("c_w4_dp2_tp2"))
    reader = tessera.torch.StorageReader(path)
    reader.read_metadata()
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("model.nope", [0]),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("model.nope", [0]),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([4]),
    )
    with pytest.raises(tessera.TesseraError, match=re.escape(f"tensor 'model.nope' is not in checkpoint {path}")):
        reader.read_data(LoadPlan([item]), planner=None)


def test_corrupted_native_data_file_fails_verification(tmp_path):
    state = full_state("c_w4_dp2_tp2")
    tessera.load(state, str(fixture("c_w4_dp2_tp2")), progress=False)
    path = tmp_path / "native"
    manifest = tessera.save(state, str(path))
    data_file = manifest["files"][0]["path"]
    with open(path / data_file, "r+b") as f:
        f.seek(100)  # inside the first box (boxes start at 4 KiB-aligned offsets, the first at 0)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = full_state("c_w4_dp2_tp2")
    with pytest.raises(dcp.CheckpointException, match=r"checksum mismatch in \S*" + re.escape(data_file)):
        quiet_load(target, tessera.torch.StorageReader(str(path)))
    # verify=False reads the flipped byte without complaint: the check above is verification's.
    unverified = full_state("c_w4_dp2_tp2")
    quiet_load(unverified, tessera.torch.StorageReader(str(path), verify=False))
    differing = [f for f in state if not torch.equal(unverified[f], state[f])]
    assert len(differing) == 1, differing


def test_checkpoint_ids_it_accepts():
    reader = tessera.torch.StorageReader
    assert reader.validate_checkpoint_id("/ckpts/run1/step-10")
    assert reader.validate_checkpoint_id("s3://ckpts/run1/step-10")
    assert reader.validate_checkpoint_id("file:///ckpts/x")
    assert not reader.validate_checkpoint_id("ftp://host/x")
    assert not reader.validate_checkpoint_id("")
    r = reader("/a")
    r.reset("/b")
    assert r.checkpoint_id == "/b"


def _order_rank(rank, world, port, name, layout, how, out):
    _reader_rank(rank, world, port, layout, [(name, str(fixture(name)), name, [])], out, how)


def _torch_job_reports(name, layout, how):
    import torch.multiprocessing as mp

    world = reference(name, layout)["world_size"]
    out = mp.Manager().dict()
    mp.spawn(_order_rank, args=(world, free_port(), name, layout, how, out), nprocs=world, join=True)
    return [out[(name, rank)] for rank in range(world)]


def test_read_order_reaches_the_process_group_plan():
    """Forced storage order relays row chunks' columns between the ranks; request order lets
    each rank read its own columns; the default is the planner's cost model (`auto`), as in
    every front end: all land torch's bytes."""
    name, layout = "b_w4_fsdp_shard0", "w2_shard1"
    ref = reference(name, layout)
    sent = {}
    for how in ["tessera:storage", "tessera:request", "tessera:auto", "tessera"]:
        ranks = _torch_job_reports(name, layout, how)
        for rank, got in enumerate(ranks):
            for fqn, t in ref["tensors"].items():
                assert got["sha"][fqn] == t["ranks"][rank]["sha256"], (how, fqn, rank)
        sent[how] = sum(got["report"]["bytes_sent"] for got in ranks)
    assert sent["tessera:storage"] > sent["tessera:request"], sent
    assert sent["tessera"] == sent["tessera:auto"], sent


def test_an_unknown_read_order_is_refused():
    with pytest.raises(ValueError, match=r'read_order must be "auto", "request" or "storage", not "sideways"'):
        tessera.load({}, str(fixture("c_w4_dp2_tp2")), read_order="sideways", progress=False)

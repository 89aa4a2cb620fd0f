"""`tessera.save` from a 3-process torch job (DTensor Shard(0) params, a non-tensor `step`, a
nested dict of plain values), then loaded in a 2-process job on another mesh (Shard(1)): torch's
own `dcp.load` with its FileSystemReader cannot read the native format (expected), while
`tessera.load` over the job's group and `dcp.load` through `tessera.torch.StorageReader` give the
saved bytes and the saved non-tensor values.

Real torch, CPU, gloo on 127.0.0.1."""

from __future__ import annotations

import os

import pytest

from conftest import free_ports

torch = pytest.importorskip("torch", reason="torch is not installed")

import torch.distributed.checkpoint as dcp  # noqa: E402

import tessera  # noqa: E402
import tessera.torch  # noqa: E402

# name -> (global shape, dtype, placement dim on the 2-rank load mesh). Row counts 7 and 5 do
# not divide by 3, so the saving ranks hold uneven shards (3, 3, 1 and 2, 2, 1 rows).
TENSORS = {
    "model.w": ([7, 10], torch.float32, 1),
    "model.v": ([5, 4], torch.float32, 1),
    "model.e": ([3, 5, 4], torch.bfloat16, 1),  # 5 columns on 2 ranks: 3 and 2
    "model.i": ([9], torch.int64, 0),  # 1-D: Shard(0) on the load mesh too
}
STEP = 7
META = {
    "lr": 3e-4,
    "name": "run-α",
    "flags": {"resumed": True, "note": None},
    "milestones": [100, 200, 300],
    "blob": b"\x00\xffbytes",
}


def _full(name: str):
    """The saved value of tensor `name`, the same in every process (seeded per name)."""
    shape, dtype, _ = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _init(rank, world, ports):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # torch's store and tessera's rendezvous (the save's commit) each on a port chosen free.
    torch_port, tessera_port = ports
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(torch_port), TESSERA_PORT=str(tessera_port), RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _save_rank(rank, port, path, out):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _init(rank, 3, port)
    try:
        state = {
            "model": {name: distribute_tensor(_full(name), mesh, [Shard(0)]) for name in TENSORS},
            "step": STEP,
            "meta": META,
        }
        report = tessera.save(state, path)
        out[rank] = {
            "world_size": report.world_size,
            "objects": report.objects,
            "local_rows": {n: int(state["model"][n].to_local().shape[0]) for n in TENSORS},
        }
    finally:
        dist.destroy_process_group()


def _placeholders(mesh):
    """A 2-rank state dict on the load mesh: Shard(1) DTensors (Shard(0) for the 1-D one) filled
    with 0xA5 bytes, and placeholders of the non-tensor values that the load must replace."""
    from torch.distributed.tensor import DTensor, Shard

    model = {}
    for name, (shape, dtype, dim) in TENSORS.items():
        # torch.chunk's split is DTensor's Shard split (ceil-sized pieces, the last one smaller).
        piece = torch.empty(shape, device="meta").chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
        local = torch.empty(piece.shape, dtype=dtype)
        _bytes(local).fill_(0xA5)
        model[name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    meta = {"lr": 0.0, "name": "", "flags": {"resumed": False, "note": "x"}, "milestones": [], "blob": b""}
    return {"model": model, "step": 0, "meta": meta}


def _check(state, mesh) -> dict:
    """What this rank got: per tensor, whether its local shard's bytes equal the saved tensor's
    slice there; the non-tensor values as loaded."""
    from torch.distributed.tensor import Shard

    equal = {}
    for name, (_shape, _dtype, dim) in TENSORS.items():
        expected = _full(name).chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
        got = state["model"][name]
        assert tuple(got.placements) == (Shard(dim),)
        equal[name] = bool(torch.equal(_bytes(got.to_local()), _bytes(expected)))
    return {"equal": equal, "step": state["step"], "meta": state["meta"]}


def _load_rank(rank, port, path, out):
    import torch.distributed as dist

    mesh = _init(rank, 2, port)
    try:
        # torch's own reader: the native format has no DCP `.metadata`.
        try:
            dcp.load(_placeholders(mesh), checkpoint_id=path)
        except dcp.CheckpointException as e:  # a BaseException, not an Exception, in torch
            out[("dcp", rank)] = (type(e).__name__, str(e))
        else:
            out[("dcp", rank)] = None

        state = _placeholders(mesh)
        report = tessera.load(state, path, progress=False, timeout=60)
        out[("tessera", rank)] = {**_check(state, mesh), "report": report.to_dict()}

        state = _placeholders(mesh)
        reader = tessera.torch.StorageReader(path)
        dcp.load(state, storage_reader=reader)
        out[("reader", rank)] = {**_check(state, mesh), "report": dict(reader.report)}
    finally:
        dist.destroy_process_group()


def test_tessera_save_from_3_ranks_loads_into_2_ranks_shard1(tmp_path):
    import torch.multiprocessing as mp

    path = str(tmp_path / "native")
    out = mp.Manager().dict()
    mp.spawn(_save_rank, args=(free_ports(2), path, out), nprocs=3, join=True)
    assert [out[r]["world_size"] for r in range(3)] == [3, 3, 3]
    assert out[0]["local_rows"] == {"model.w": 3, "model.v": 2, "model.e": 1, "model.i": 3}
    assert out[2]["local_rows"] == {"model.w": 1, "model.v": 1, "model.e": 1, "model.i": 3}
    # The checkpoint is tessera's native format: a manifest, no DCP metadata.
    assert os.path.exists(os.path.join(path, "manifest.json"))
    assert not os.path.exists(os.path.join(path, ".metadata"))

    mp.spawn(_load_rank, args=(free_ports(2), path, out), nprocs=2, join=True)
    for rank in range(2):
        failure = out[("dcp", rank)]
        assert failure is not None, "dcp.load with FileSystemReader read a native checkpoint"
        kind, message = failure
        assert kind == "CheckpointException", failure
        assert "No such file or directory" in message and ".metadata" in message, failure
        for how in ("tessera", "reader"):
            got = out[(how, rank)]
            assert got["equal"] == {name: True for name in TENSORS}, (how, rank, got["equal"])
            assert got["step"] == STEP and type(got["step"]) is int, (how, rank, got["step"])
            assert got["meta"] == META, (how, rank, got["meta"])
            assert type(got["meta"]["blob"]) is bytes, (how, rank)
        assert out[("tessera", rank)]["report"]["exchange"] == "process_group"
        assert out[("tessera", rank)]["report"]["objects_loaded"] == 1 + 6  # step + 6 meta leaves

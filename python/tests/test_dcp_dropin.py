"""Code written for `dcp.load`/`dcp.save` runs unchanged with tessera: Stateful values (a module,
an optimizer), meta-device destinations, DTensors on a mesh that leaves the calling rank out, and
DCP's CheckpointException for what DCP would refuse. Real torch, gloo for the multi-rank case."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from conftest import join_job, run_job

import torch  # noqa: E402  (make python-test installs it)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import tessera  # noqa: E402
import tessera.torch  # noqa: E402


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        optim.step()
    return model, optim


def _same(model_a, optim_a, model_b, optim_b) -> None:
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name
    sa, sb = optim_a.state_dict(), optim_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][key][name], sb["state"][key][name]), (key, name)


@pytest.mark.parametrize("writer", ["tessera", "dcp"])
def test_a_module_and_an_optimizer_load_as_stateful_values(tmp_path, writer):
    model, optim = _trained(1)
    path = str(tmp_path / "ckpt")
    if writer == "tessera":
        tessera.save({"model": model, "optim": optim, "step": 2}, path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # dcp.save alone warns it has no group
            dcp.save({"model": model, "optim": optim, "step": 2}, checkpoint_id=path)
    other_model, other_optim = _trained(2)
    state = {"model": other_model, "optim": other_optim, "step": 0}
    tessera.load(state, path, progress=False)
    # The caller's objects were loaded through their own load_state_dict; plain values replaced.
    assert state["model"] is other_model and state["optim"] is other_optim and state["step"] == 2
    _same(model, optim, other_model, other_optim)


def test_meta_tensors_are_materialized_in_host_memory(tmp_path):
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tessera.save({"w": w}, str(tmp_path / "c"))
    state = {"w": torch.empty(4, 6, device="meta")}
    tessera.load(state, str(tmp_path / "c"), progress=False)
    assert state["w"].device.type == "cpu" and torch.equal(state["w"], w)


def test_dcp_shaped_failures_are_checkpoint_exceptions_and_tessera_errors(tmp_path):
    tessera.save({"w": torch.zeros(4)}, str(tmp_path / "c"))
    with pytest.raises(CheckpointException) as refused:
        tessera.load({"w": torch.zeros(4), "v": torch.zeros(2)}, str(tmp_path / "c"), progress=False)
    assert isinstance(refused.value, tessera.TesseraError) and isinstance(refused.value, Exception)
    # DCP's words first (code written for dcp.load matches on them), then tessera's details.
    assert str(refused.value).startswith(
        "Missing key in checkpoint state_dict: v. 1 key(s) of the state dict are not in checkpoint "
    ), str(refused.value)
    with pytest.raises(CheckpointException, match=r"^Size mismatch between saved \[4\] and current: \[5\] for w: "):
        tessera.load({"w": torch.zeros(5)}, str(tmp_path / "c"), progress=False)


def _sub_mesh_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    join_job(rank, 2, port)
    # "w" lives on rank 0 alone; "v" is sharded over both ranks.
    solo = DeviceMesh("cpu", [0])
    both = DeviceMesh("cpu", [0, 1])
    state = {
        "w": distribute_tensor(torch.zeros(4, 6), solo, [Replicate()]),
        "v": distribute_tensor(torch.zeros(8), both, [Shard(0)]),
    }
    result = {}
    try:
        tessera.load(state, path, process_group=dist.group.WORLD, progress=False, timeout=60)
        result = {"w": state["w"].to_local().tolist(), "v": state["v"].to_local().tolist()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_dtensor_on_a_mesh_without_this_rank_loads_nothing_here(tmp_path):
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    v = torch.arange(8, dtype=torch.float32) + 100
    tessera.save({"w": w, "v": v}, str(tmp_path / "c"))
    got = run_job(_sub_mesh_rank, 2, (str(tmp_path / "c"),), tmp_path)
    assert got[0] == {"w": w.tolist(), "v": v[:4].tolist()}, got
    assert got[1] == {"w": [], "v": v[4:].tolist()}, got


def _assert_same_tree(ours, theirs, path="") -> None:
    assert type(ours) is type(theirs) or (torch.is_tensor(ours) and torch.is_tensor(theirs)), path
    if isinstance(theirs, dict):
        assert sorted(ours) == sorted(theirs), path
        for key in theirs:
            _assert_same_tree(ours[key], theirs[key], f"{path}.{key}")
    elif torch.is_tensor(theirs):
        assert torch.equal(ours, theirs), path
    else:
        assert ours == theirs, path


def test_the_storage_readers_metadata_unflattens_like_torchs():
    # DCP's own helpers unflatten with the metadata's planner_data: the nested state dict comes
    # back as torch's reader gives it (not flat keys), and the version is DCP's.
    from conftest import fixture
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = str(fixture("c_w4_dp2_tp2"))
    ours_reader = tessera.torch.StorageReader(path)
    assert ours_reader.read_metadata().version == FileSystemReader(path).read_metadata().version == "1.0.0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ours = _load_state_dict_from_keys(storage_reader=tessera.torch.StorageReader(path))
        theirs = _load_state_dict_from_keys(storage_reader=FileSystemReader(path))
    assert "model" in theirs and isinstance(theirs["model"], dict)
    _assert_same_tree(ours, theirs)


def _sharded_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    join_job(rank, 2, port)
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor is deprecated
        state = {"w": sharded_tensor.zeros(spec, 6, 4)}
    result = {}
    try:
        tessera.load(state, path, process_group=dist.group.WORLD, progress=False, timeout=60)
        shard = state["w"].local_shards()[0]
        result = {"offsets": list(shard.metadata.shard_offsets), "values": shard.tensor.tolist()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_sharded_tensors_load_their_local_shards_in_place(tmp_path):
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    tessera.save({"w": w}, str(tmp_path / "c"))
    got = run_job(_sharded_rank, 2, (str(tmp_path / "c"),), tmp_path)
    assert got[0] == {"offsets": [0, 0], "values": w[:3].tolist()}, got
    assert got[1] == {"offsets": [3, 0], "values": w[3:].tolist()}, got


def test_uneven_local_shards_of_a_chunk_protocol_tensor_load_in_place(tmp_path):
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    tessera.save({"w": w}, str(tmp_path / "c"))
    # Rows 0-1 and row 4 held here, as torchrec's sharded embeddings hold uneven shards.
    top, row = torch.zeros(2, 4), torch.zeros(1, 4)
    state = {"w": LocalShardsWrapper([top, row], [(0, 0), (4, 0)])}
    tessera.load(state, str(tmp_path / "c"), progress=False)
    assert torch.equal(top, w[:2]) and torch.equal(row, w[4:5])


def _hf_save_rank(rank: int, port: int, world: int, path: str, value: float, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    join_job(rank, world, port)
    mesh = DeviceMesh("cpu", list(range(world)))
    full = torch.arange(48, dtype=torch.float32).reshape(12, 4) + value
    state = {"w": distribute_tensor(full, mesh, [Shard(0)])}
    writer = dcp.HuggingFaceStorageWriter(path, save_distributed=True)
    dcp.save(state, storage_writer=writer, process_group=dist.group.WORLD)
    Path(out, f"rank{rank}.json").write_text("{}")
    dist.destroy_process_group()


def test_a_reused_hf_directory_loads_the_newest_save_and_names_the_strays(tmp_path):
    pytest.importorskip("safetensors", reason="DCP's HF writer needs the safetensors module (make python-env installs it)")
    path = tmp_path / "hf"
    # torch's HF writer, distributed: a save by 3 ranks, then one by 2 into the same directory.
    run_job(_hf_save_rank, 3, (3, str(path), 1000.0), tmp_path)
    run_job(_hf_save_rank, 2, (2, str(path), 0.0), tmp_path)
    assert sorted(p.name for p in path.glob("*.safetensors")) == [
        f"shard-0000{s}-model-00001-of-00001.safetensors" for s in (1, 2, 3)
    ]
    newest = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    for load in ("tessera", "reader"):
        state = {"w": torch.zeros(12, 4)}
        with pytest.warns(UserWarning, match=r"ignored 1 file\(s\) of an earlier DCP save into the same directory: "
                          r"shard-00003-model-00001-of-00001\.safetensors"):
            if load == "tessera":
                tessera.load(state, str(path), progress=False)
            else:
                dcp.load(state, storage_reader=tessera.torch.StorageReader(str(path)), no_dist=True)
        assert torch.equal(state["w"], newest), load

"""A real FSDP2 + TP model, trained one AdamW step on a 2×2 (dp, tp) gloo mesh and saved with
`dcp.save`, loaded by `tessera.load` (exchange over the job's gloo group) into other meshes
(dp 4 with `fully_shard` only, tp 4 with `parallelize_module` only), next to the same load by
`dcp.load` with torch's FileSystemReader: parameters and optimizer state equal, and training
resumes identically (the next step's loss and parameters equal).

Real torch, CPU, 4 processes on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os

import pytest

from conftest import free_port

torch = pytest.importorskip("torch", reason="torch is not installed")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

import tessera  # noqa: E402

WORLD = 4
VOCAB, DIM, HIDDEN, SEQ, BATCH = 64, 32, 64, 8, 2
SEED = 1234


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _tp_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        # Vocab-sharded embedding (Shard(0) of the weight); its partial output is all-reduced.
        "emb": RowwiseParallel(input_layouts=Replicate()),
        # Logits replicated so that every rank computes the same loss.
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


def _build(kind: str, mesh):
    """A model with the same initial weights on every rank (fixed seed), parallelized as `kind`:
    "dp2tp2" (TP on mesh["tp"], then FSDP2 on mesh["dp"]), "dp4" (FSDP2 only), "tp4" (TP only)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(SEED)
    model = Model()
    if kind == "dp2tp2":
        parallelize_module(model, mesh["tp"], _tp_plan())
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif kind == "dp4":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp4":
        parallelize_module(model, mesh, _tp_plan())
    else:
        raise ValueError(kind)
    # foreach=False: the per-tensor path, the same on every layout (TP-only keeps LayerNorm
    # parameters as plain tensors next to DTensors, which one foreach group would mix).
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, optim


def _batch(dp_rank: int):
    # A fixed batch per data-parallel rank (the same on the tp ranks of one dp rank).
    g = torch.Generator().manual_seed(SEED + 1 + dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train_step(model, optim, dp_rank: int) -> float:
    inputs, labels = _batch(dp_rank)
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _leaves(tree, prefix=""):
    """(fqn, value) of a nested state dict, dicts and lists entered."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _sha(t) -> str:
    t = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _full_shas(state) -> dict:
    """fqn -> sha256 of every tensor's full value (a collective: every rank, same order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for fqn, value in _leaves(state):
        if isinstance(value, DTensor):
            out[fqn] = _sha(value.full_tensor())
        elif isinstance(value, torch.Tensor):
            out[fqn] = _sha(value)
    return out


def _plain(state) -> dict:
    """fqn -> value of every non-tensor leaf (param_groups entries)."""
    return {fqn: v for fqn, v in _leaves(state) if not isinstance(v, torch.Tensor)}


def _state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _scribble(state) -> None:
    """Overwrites every tensor of a state dict with 0xA5 bytes and bumps the learning rate, so that
    a byte or value the load failed to write cannot pass as the checkpoint's by luck."""
    from torch.distributed.tensor import DTensor

    for _fqn, value in _leaves(state):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            local.detach().reshape(-1).view(torch.uint8).fill_(0xA5)
    for group in state["optim"]["param_groups"]:
        group["lr"] = 0.5


def _rank(rank, port, path, out):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # --- 1. Train one step on the 2×2 mesh and save with dcp.save ------------------------
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, optim = _build("dp2tp2", mesh)
        _train_step(model, optim, mesh["dp"].get_local_rank())
        saved = _state(model, optim)
        msd = saved["model"]
        placements = {fqn: tuple(v.placements) for fqn, v in msd.items()}
        dcp.save(saved, checkpoint_id=path)
        source = _full_shas(saved)
        source_plain = _plain(saved)
        if rank == 0:
            out["placements"] = placements
            out["source"] = source
            out["source_plain"] = source_plain
        del model, optim, saved, msd

        # --- 2. Load into other meshes: tessera.load and dcp.load, side by side --------------
        for kind, shape in (("dp4", (4,)), ("tp4", (4,))):
            target_mesh = init_device_mesh("cpu", shape, mesh_dim_names=(kind[:2],))
            dp_rank = rank if kind == "dp4" else 0
            runs = {}
            for how in ("tessera", "dcp"):
                model, optim = _build(kind, target_mesh)
                state = _state(model, optim)  # get_state_dict makes the AdamW state (lr 0 step)
                _scribble(state)
                if how == "tessera":
                    report = tessera.load(state, path, progress=False, timeout=60)
                    out[(kind, "report", rank)] = report.to_dict()
                else:
                    dcp.load(state, checkpoint_id=path)
                set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
                # What the model and optimizer now hold, read back through get_state_dict.
                loaded = _state(model, optim)
                local = {
                    fqn: _sha(v.to_local() if isinstance(v, DTensor) else v)
                    for fqn, v in _leaves(loaded)
                    if isinstance(v, torch.Tensor)
                }
                full = _full_shas(loaded)
                plain = _plain(loaded)
                loss = _train_step(model, optim, dp_rank)
                after = _full_shas(_state(model, optim))
                runs[how] = {"local": local, "full": full, "plain": plain, "loss": loss, "after": after}
                if kind == "tp4":
                    # TP only: params are Shard(0)/Shard(1)/Replicate DTensors on a 1-D mesh.
                    assert isinstance(model.blocks[0].up.weight, DTensor)
                    assert tuple(model.blocks[0].up.weight.placements) == (Shard(0),)
                    assert tuple(model.blocks[0].down.weight.placements) == (Shard(1),)
                else:
                    assert tuple(model.blocks[0].up.weight.placements) == (Shard(0),)
                del model, optim, state, loaded
            out[(kind, rank)] = runs
    finally:
        dist.destroy_process_group()


def test_fsdp2_tp_checkpoint_loads_into_dp4_and_tp4_like_dcp(tmp_path):
    import torch.multiprocessing as mp
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    path = str(tmp_path / "fsdp_tp")
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), path, out), nprocs=WORLD, join=True)

    # The checkpoint is a real FSDP2 + TP one: TP's Shard(0) sharded again by FSDP on dp is
    # _StridedShard(0) on dp; TP's Shard(1) and Replicate get FSDP's Shard(0) on dp.
    placements = out["placements"]
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    for i in range(2):
        assert placements[f"blocks.{i}.up.weight"] == strided, placements
        assert placements[f"blocks.{i}.up.bias"] == strided, placements
        assert placements[f"blocks.{i}.down.weight"] == (Shard(0), Shard(1)), placements
        assert placements[f"blocks.{i}.down.bias"] == (Shard(0), Replicate()), placements
    assert placements["emb.weight"] == strided, placements
    assert placements["head.weight"] == strided, placements
    assert placements["norm.weight"][0] == Shard(0), placements

    source = out["source"]
    params = [k[len("model."):] for k in source if k.startswith("model.")]
    assert len(params) == 16, params
    for suffix in ("exp_avg", "exp_avg_sq", "step"):
        assert {f"optim.state.{p}.{suffix}" for p in params} <= set(source), suffix
    for kind in ("dp4", "tp4"):
        for rank in range(WORLD):
            runs = out[(kind, rank)]
            ours, theirs = runs["tessera"], runs["dcp"]
            where = (kind, rank)
            # Every parameter and optimizer state tensor: this rank's shard, and the whole tensor,
            # byte-equal between the tessera-loaded and dcp.load-loaded run, and equal to what
            # was saved.
            assert set(ours["local"]) == set(source), where
            for fqn in source:
                assert ours["local"][fqn] == theirs["local"][fqn], (where, fqn)
                assert ours["full"][fqn] == theirs["full"][fqn] == source[fqn], (where, fqn)
            assert ours["plain"] == theirs["plain"] == out["source_plain"], where
            assert ours["plain"]["optim.param_groups.0.lr"] == 1e-2, where
            # Training resumes identically: same loss, same parameters and state afterwards.
            assert ours["loss"] == theirs["loss"], where
            assert ours["after"] == theirs["after"], where
            assert ours["after"] != ours["full"], where  # the step did change the parameters
            report = out[(kind, "report", rank)]
            assert report["exchange"] == "process_group", where
            assert report["tensors_loaded"] == len(source), where

"""torch tensors and DTensors with real torch (CPU; CUDA tests skip without a device)."""

from __future__ import annotations

import os

import pytest

from conftest import expected_tensors, fixture, free_port, reference

import torch  # noqa: E402  (make python-test installs it: these tests run everywhere)

import tessera  # noqa: E402

C = "c_w4_dp2_tp2"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}


def sha(t) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_cpu_tensors_with_bf16():
    tensors = expected_tensors(C)
    state = {f: torch.empty(t["shape"], dtype=TORCH_DTYPES[t["dtype"]]) for f, t in tensors.items()}
    tessera.load(state, str(fixture(C)), progress=False)
    for f, t in tensors.items():
        assert sha(state[f].reshape(-1)) == t["sha256"], f


def test_a_loaded_state_dict_is_freed_as_soon_as_the_caller_drops_it():
    """tessera keeps no reference to the caller's tensors after `load` returns, not even in a
    reference cycle that only the garbage collector would break (a recursive closure used to
    hold every tensor of the state dict until the next collection: a job loading twice held
    both copies)."""
    import gc
    import weakref

    tensors = expected_tensors(C)
    state = {f: torch.empty(t["shape"], dtype=TORCH_DTYPES[t["dtype"]]) for f, t in tensors.items()}
    refs = [weakref.ref(v) for v in state.values()]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        report = tessera.load(state, str(fixture(C)), progress=False)
        assert report.bytes_read > 0
        del state
        alive = sum(r() is not None for r in refs)
    finally:
        if was_enabled:
            gc.enable()
    assert alive == 0, f"{alive} of {len(refs)} tensors outlive the state dict"


def _dtensor_rank(rank, world, port, layout, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, Replicate, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    ref = reference(C, layout)
    state = {}
    for fqn, t in ref["tensors"].items():
        full = torch.zeros(t["global_shape"], dtype=TORCH_DTYPES[t["dtype"]])
        placement = t["placements"][0]
        if placement.startswith("Shard"):
            dim = int(placement.split("=")[1].rstrip(")"))
            state[fqn] = distribute_tensor(full, mesh, [Shard(dim)])
        else:
            state[fqn] = distribute_tensor(full, mesh, [Replicate()])
    tessera.load(state, str(fixture(C)), exchange=True, progress=False, timeout=60)
    shas = {f: sha(v.to_local().reshape(-1)) for f, v in state.items()}
    dist.destroy_process_group()
    out[rank] = shas


def test_dtensors_on_a_gloo_group():
    import torch.multiprocessing as mp

    layout = "w3_shard0"
    ref = reference(C, layout)
    world = ref["world_size"]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_dtensor_rank, args=(world, free_port(), layout, out), nprocs=world, join=True)
    for rank in range(world):
        for f, t in ref["tensors"].items():
            assert out[rank][f] == t["ranks"][rank]["sha256"], (f, rank)


def test_cuda_tensors_byte_for_byte():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tensors = expected_tensors(C)
    state = {f: torch.empty(t["shape"], dtype=TORCH_DTYPES[t["dtype"]], device="cuda") for f, t in tensors.items()}
    try:
        report = tessera.load(state, str(fixture(C)), progress=False)
    except tessera.TesseraError as e:
        if "no CUDA support" in str(e):
            pytest.skip("this build of the package has no `cuda` feature (maturin develop --features cuda)")
        raise
    assert report["h2d_bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    for f, t in tensors.items():
        assert sha(state[f].cpu().reshape(-1)) == t["sha256"], f


def test_cuda_and_host_tensors_in_one_call_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    state = {
        "model.final_ln.weight": torch.empty(64, device="cuda"),
        "model.final_ln.bias": torch.empty(64),
    }
    with pytest.raises(tessera.TesseraError, match=r"model\.final_ln\.weight is in cuda:0 but model\.final_ln\.bias in host memory"):
        tessera.load(state, str(fixture(C)), progress=False)


def _replicated_rank(rank, world, port, declining, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if rank in declining:
        os.environ["TESSERA_CROSS_MEMORY"] = "0"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    tensors = expected_tensors(C)
    state = {
        f: distribute_tensor(torch.zeros(t["shape"], dtype=TORCH_DTYPES[t["dtype"]]), mesh, [Replicate()])
        for f, t in tensors.items()
    }
    report = tessera.load(state, str(fixture(C)), progress=False, timeout=60)
    shas = {f: sha(v.to_local().reshape(-1)) for f, v in state.items()}
    dist.destroy_process_group()
    out[rank] = (
        shas, report.bytes_received, report.bytes_received_direct, report.exchange,
        (report.exchange_wait_seconds, report.exchange_seconds),
    )


@pytest.mark.parametrize("declining", [(), (1,)], ids=["all_offer", "rank1_declines"])
def test_replicas_over_a_gloo_group_are_copied_out_of_each_others_memory(declining):
    """Every rank needs every tensor: each piece is read once and the others copy it straight
    out of its reader's arrays (process_vm_readv) instead of receiving it over gloo. A rank with
    TESSERA_CROSS_MEMORY=0 exchanges bytes over gloo with everyone; all load the same bytes."""
    import torch.multiprocessing as mp

    world = 3
    out = mp.Manager().dict()
    mp.spawn(_replicated_rank, args=(world, free_port(), declining, out), nprocs=world, join=True)
    tensors = expected_tensors(C)
    for rank in range(world):
        shas, received, direct, exchange, (waited, exchanging) = out[rank]
        assert exchange == "process_group"
        # The time waiting on peers is part of the exchange's time, and some of it was waited.
        assert 0 < waited <= exchanging, (rank, waited, exchanging)
        for f, t in tensors.items():
            assert shas[f] == t["sha256"], (f, rank)
        assert received > 0, rank
        if rank in declining:
            assert direct == 0, rank
        elif declining:
            assert 0 < direct < received, (rank, direct, received)
        else:
            assert direct == received, (rank, direct, received)

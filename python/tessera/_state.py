"""State dicts as tessera sees them: DCP's flattening (the same FQNs ``dcp.save`` writes), the
memory of arrays, tensors and DTensors, and writing loaded values back into nested containers."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _tessera


@dataclass(frozen=True)
class Box:
    """A box of a tensor: ``array`` holds the elements at ``offsets`` (its shape is the box's)."""

    array: Any
    offsets: Sequence[int]


@dataclass(frozen=True)
class Flat:
    """Elements ``[start, start + array.size)`` of a tensor's row-major flattening."""

    array: Any
    start: int


Path = Tuple[Union[str, int], ...]


def is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_dtensor(value: Any) -> bool:
    # A DTensor exists only once its module was imported: looking there costs nothing, where
    # importing it would cost a plain-tensor load 0.8 s of imports (torch.distributed.tensor).
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def is_sharded_tensor(value: Any) -> bool:
    """A ``ShardedTensor`` (deprecated, still in DCP and in older FSDP state dicts): its local
    shards are boxes of the global tensor, each loaded in place. Looked up among the imported
    modules only, as ``is_dtensor``."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    sharded = getattr(module, "ShardedTensor", None)
    return sharded is not None and isinstance(value, sharded)


def sharded_boxes(value: Any) -> List[Tuple[Any, List[int]]]:
    """``(local tensor, global offsets)`` of each of this rank's shards of a ``ShardedTensor``."""
    return [
        (shard.tensor, [int(o) for o in shard.metadata.shard_offsets]) for shard in value.local_shards()
    ]


def plans_by_chunks(value: Any) -> bool:
    """A tensor subclass that plans through DCP's chunk protocol (``__create_chunk_list__`` and
    ``__get_tensor_shard__``), such as ``LocalShardsWrapper`` (uneven local shards), or a DTensor
    whose local tensor is one (DTensor's own methods hand the protocol to it, as DCP plans it);
    other DTensors have their own path (``dtensor_box``)."""

    def speaks(t: Any) -> bool:
        return callable(getattr(t, "__create_chunk_list__", None)) and callable(getattr(t, "__get_tensor_shard__", None))

    if is_dtensor(value):
        return speaks(value.to_local())
    return is_torch_tensor(value) and speaks(value)


def chunk_boxes(fqn: str, value: Any) -> List[Tuple[Any, List[int]]]:
    """``(local tensor, global offsets)`` of each chunk a chunk-protocol tensor holds here, asked
    of the tensor as DCP asks it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    out = []
    for i, chunk in enumerate(value.__create_chunk_list__()):
        local = value.__get_tensor_shard__(MetadataIndex(fqn, chunk.offsets, i))
        out.append((local, [int(o) for o in chunk.offsets]))
    return out


def is_array(value: Any) -> bool:
    """A NumPy array or a torch tensor (DTensors included)."""
    return is_torch_tensor(value) or hasattr(value, "__array_interface__")


def is_tensor_entry(value: Any) -> bool:
    """What tessera loads as a tensor: arrays, tensors, DTensors, Box, Flat, (array, offsets)."""
    if isinstance(value, (Box, Flat)) or is_array(value):
        return True
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and is_array(value[0])
        and isinstance(value[1], (list, tuple))
        and all(isinstance(o, int) for o in value[1])
    )


def flatten(state_dict: Mapping[str, Any]) -> List[Tuple[str, Path, Any]]:
    """``(fqn, path, value)`` of every leaf, flattened exactly as DCP does
    (``torch.distributed.checkpoint._traverse.traverse_state_dict``): mappings are always entered;
    a list is entered only when it holds a tensor or a container that does; everything else (a
    tuple, a list of plain values, a scalar) is one leaf. The FQN joins the path with ``.``."""
    # Module-level helpers, not nested closures: a recursive closure refers to itself through its
    # cell, a cycle that would keep `out` (and with it every tensor of the state dict) alive until
    # the garbage collector runs, long after the caller let go of the state dict.
    out: List[Tuple[str, Path, Any]] = []
    for key, value in state_dict.items():
        _visit((str(key),), value, out)
    return out


def _terminal(value: Any) -> bool:
    """Whether DCP's traversal stops at ``value`` (a leaf) rather than entering it."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _terminal(entry):
            return False
        if is_tensor_entry(entry):
            return False
    return True


def _visit(path: Path, value: Any, out: List[Tuple[str, Path, Any]]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _visit(path + (str(key),), item, out)
    elif _terminal(value):
        out.append((".".join(str(p) for p in path), path, value))
    else:
        for i, item in enumerate(value):
            _visit(path + (i,), item, out)


def set_element(root: Any, path: Path, value: Any) -> None:
    """Puts ``value`` at ``path`` in nested dicts and lists (keys as the state dict has them)."""
    container = root
    for part in path[:-1]:
        container = _child(container, part)
    last = path[-1]
    if isinstance(container, list):
        container[int(last)] = value
    else:
        container[_key(container, last)] = value


def _child(container: Any, part: Union[str, int]) -> Any:
    if isinstance(container, list):
        return container[int(part)]
    return container[_key(container, part)]


def _key(container: Any, part: Union[str, int]) -> Any:
    # flatten() made every mapping key a string; find the key the mapping really uses.
    if part in container:
        return part
    for key in container:
        if str(key) == part:
            return key
    raise KeyError(part)


def dtype_name(array: Any) -> str:
    if is_torch_tensor(array):
        return str(array.dtype).replace("torch.", "")
    return str(getattr(array, "dtype", type(array).__name__))


def itemsize(array: Any) -> int:
    if is_torch_tensor(array):
        return int(array.element_size())
    return int(array.itemsize)


def memory(key: str, array: Any, *, writable: bool) -> Tuple[str, list, int, int, Optional[int]]:
    """(dtype name, shape, data address, byte length, CUDA device or None) of a C-contiguous array
    or tensor in host memory or (torch) on a CUDA device."""
    if is_torch_tensor(array):
        device: Optional[int] = None
        if array.device.type == "cuda":
            device = array.device.index if array.device.index is not None else array.get_device()
        elif array.device.type != "cpu":
            raise ValueError(f"{key}: tensor is on {array.device}; tessera loads into host or CUDA memory")
        if not array.is_contiguous():
            raise ValueError(f"{key}: tensor is not contiguous; pass a contiguous tensor")
        return (
            dtype_name(array),
            [int(d) for d in array.shape],
            int(array.data_ptr()),
            int(array.numel() * array.element_size()),
            device,
        )
    interface = getattr(array, "__array_interface__", None)
    if interface is None:
        raise TypeError(
            f"{key}: expected a NumPy array, a torch tensor, a DTensor, (array, offsets), "
            f"tessera.Box or tessera.Flat; got {type(array).__name__}"
        )
    flags = getattr(array, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise ValueError(f"{key}: array is not C-contiguous; pass numpy.ascontiguousarray(...)")
    address, read_only = interface["data"]
    if writable and read_only:
        raise ValueError(f"{key}: array is read-only")
    return (dtype_name(array), [int(d) for d in array.shape], int(address), int(array.nbytes), None)


def is_stateful(value: Any) -> bool:
    """Whether DCP treats ``value`` as ``Stateful`` (a module, an optimizer, anything with
    ``state_dict()`` and ``load_state_dict()``): it loads into ``value.state_dict()`` and hands
    the result to ``value.load_state_dict`` afterwards."""
    if isinstance(value, Mapping) or is_tensor_entry(value):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def outside_mesh(value: Any) -> bool:
    """Whether ``value`` is a DTensor whose mesh does not include this rank: it holds no shard
    here (torch's chunk list gives it an empty one without offsets), so there is nothing to load."""
    return is_dtensor(value) and value.device_mesh.get_coordinate() is None


def is_meta(value: Any) -> bool:
    """Whether ``value`` is a torch tensor or a DTensor on the meta device (no storage): DCP loads
    a new tensor of its shape and dtype in its place (``materialize``), and so does tessera."""
    return is_torch_tensor(value) and value.device.type == "meta"


def _materialize_device() -> Any:
    """Where ``dcp.load`` allocates a meta tensor's replacement
    (``planner_helpers._init_state_dict``): the current device of the default process group's
    device type (the host for gloo, the current GPU for NCCL); the host without a process group."""
    import warnings

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    with warnings.catch_warnings():
        # It warns when a group has several backends (a device mesh registers gloo for CPU
        # next to the default), then answers the host as dcp.load's call does.
        warnings.simplefilter("ignore", UserWarning)
        kind = dist.distributed_c10d._get_pg_default_device().type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def materialize(value: Any) -> Any:
    """A tensor with storage in place of meta tensor ``value``, as ``dcp.load`` makes it: for a
    DTensor a new one on the same mesh and placements whose local shard is allocated (global shape
    and stride given, as a shard may be uneven); for a plain tensor one of its shape and dtype.
    Its bytes are whatever the allocator left: the load fills them. Allocated contiguous
    (``torch.empty``, where DCP's ``empty_like`` would copy a meta view's strides): tessera loads
    into contiguous memory."""
    import torch

    device = _materialize_device()
    if is_dtensor(value):
        from torch.distributed.tensor import DTensor

        local = value.to_local()
        return DTensor.from_local(
            torch.empty(local.shape, dtype=local.dtype, device=device),
            device_mesh=value.device_mesh,
            placements=value.placements,
            run_check=False,
            shape=value.size(),
            stride=value.stride(),
        )
    return torch.empty(value.shape, dtype=value.dtype, device=device)


def dtensor_box(key: str, dtensor: Any) -> Tuple[Any, List[int], List[int]]:
    """(local tensor, global offsets, global shape) of a DTensor's shard on this rank, from
    torch's own chunk list (``DTensor.__create_chunk_list__``, the protocol ``dcp.save`` and
    ``dcp.load`` plan with), so every placement torch makes (``Shard``, ``Replicate``,
    ``_StridedShard`` of FSDP2 + TP, uneven and empty shards) lands where torch puts it."""
    for placement in dtensor.placements:
        if placement.is_partial():
            raise ValueError(
                f"{key}: the DTensor is {placement!r} on mesh dim {dtensor.placements.index(placement)}: "
                "a partial (pending-reduction) value has no bytes of its own in a checkpoint; "
                "redistribute it to Replicate() or Shard() first"
            )
    local = dtensor.to_local()
    chunks = dtensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"{key}: the DTensor's local shard is {len(chunks)} boxes; tessera loads one box per entry")
    offsets = [int(o) for o in chunks[0].offsets]
    sizes = [int(s) for s in chunks[0].sizes]
    if [int(d) for d in local.shape] != sizes:
        raise ValueError(
            f"{key}: the DTensor's local shard has shape {tuple(local.shape)} but its placements give {tuple(sizes)}"
        )
    return local, offsets, [int(d) for d in dtensor.shape]


def entry_array(fqn: str, value: Any) -> Tuple[Any, Optional[List[int]], Optional[int]]:
    """(array to fill, box offsets or None, flat start or None) of a tensor entry."""
    if isinstance(value, Flat):
        return value.array, None, int(value.start)
    if isinstance(value, Box):
        return value.array, [int(o) for o in value.offsets], None
    if isinstance(value, tuple):
        return value[0], [int(o) for o in value[1]], None
    if is_dtensor(value):
        local, offsets, _shape = dtensor_box(fqn, value)
        return local, offsets, None
    return value, None, None


def load_target(fqn: str, array: Any, offsets: Optional[List[int]], flat_start: Optional[int]) -> Any:
    """The native module's typed record (``LoadTarget``) of the entry ``fqn`` loaded into ``array``."""
    dtype, shape, address, nbytes, device = memory(fqn, array, writable=True)
    if flat_start is not None:
        shape = [int(nbytes // max(1, itemsize(array)))]
    return _tessera.LoadTarget(
        fqn=fqn, dtype=dtype, shape=shape, offsets=offsets, flat_start=flat_start, address=address,
        nbytes=nbytes, cuda_device=device,
    )


Rename = Union[None, Mapping[str, str], Callable[[str], str]]


def renamer(rename: Rename) -> Callable[[str], str]:
    if rename is None:
        return lambda fqn: fqn
    if callable(rename):
        return rename
    if isinstance(rename, Mapping):
        mapping = dict(rename)
        return lambda fqn: mapping.get(fqn, fqn)
    raise TypeError(f"rename must be a dict or a callable; got {type(rename).__name__}")

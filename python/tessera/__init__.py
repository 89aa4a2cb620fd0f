"""tessera: load distributed checkpoints into a running job's tensors, in any layout.

One call fills a rank's state dict in place from a checkpoint saved with another parallel layout
(PyTorch DCP, safetensors, or tessera's native format; local paths or object-store URLs)::

    import tessera
    state = model.state_dict()              # plain tensors, DTensors, NumPy arrays
    tessera.load("s3://ckpts/run1/step-1000", state)

Each value of the state dict says what this rank needs:

* an array or tensor: the whole tensor of that name;
* a ``torch.distributed.tensor.DTensor``: its local shard (from its placements and device mesh);
* ``(array, offsets)`` or :class:`Box`: the box of that shape starting at ``offsets``;
* :class:`Flat`: elements ``[start, start + array.size)`` of the tensor's row-major flattening
  (ZeRO / FSDP1 flat parameter buffers).

Nothing is cast or reshaped: a dtype or shape that does not match the checkpoint is an error
naming the tensor. Ranks load independently by default; pass ``exchange=True`` (with torchrun's
environment, or ``master_addr``/``master_port``) to have the job read every shared byte once and
pass it on between ranks.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping, Optional, Sequence, Tuple, Union

from . import _tessera
from ._tessera import TesseraError

__all__ = [
    "Box",
    "Flat",
    "TesseraError",
    "inspect",
    "load",
    "plan",
    "save",
    "__version__",
]

__version__: str = _tessera.version()

# Port offset of tessera's rendezvous from torchrun's MASTER_PORT, whose TCPStore already listens
# there: tessera's rank 0 listens on MASTER_PORT + 1 unless TESSERA_PORT says otherwise.
_PORT_OFFSET = 1


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


Progress = Callable[[int, int], None]
Target = Union[Any, Box, Flat, Tuple[Any, Sequence[int]]]


# ---------------------------------------------------------------------------------------------
# Memory of arrays and tensors
# ---------------------------------------------------------------------------------------------


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_dtensor(value: Any) -> bool:
    if "torch" not in sys.modules:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(value, DTensor)


def _dtype_name(array: Any) -> str:
    if _is_torch_tensor(array):
        return str(array.dtype).replace("torch.", "")
    return str(getattr(array, "dtype", type(array).__name__))


def _memory(key: str, array: Any, *, writable: bool) -> Tuple[str, list, int, int, Optional[int]]:
    """(dtype name, shape, data address, byte length, CUDA device or None) of a C-contiguous array
    or tensor in host memory or (torch) on a CUDA device."""
    if _is_torch_tensor(array):
        device: Optional[int] = None
        if array.device.type == "cuda":
            device = array.device.index if array.device.index is not None else array.get_device()
        elif array.device.type != "cpu":
            raise ValueError(f"{key}: tensor is on {array.device}; tessera loads into host or CUDA memory")
        if not array.is_contiguous():
            raise ValueError(f"{key}: tensor is not contiguous; pass a contiguous tensor")
        return (
            _dtype_name(array),
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
    return (_dtype_name(array), [int(d) for d in array.shape], int(address), int(array.nbytes), None)


def _dtensor_box(key: str, dtensor: Any) -> Tuple[Any, list, list]:
    """(local tensor, global offsets, global shape) of a DTensor's shard on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = dtensor.to_local()
    shape, offsets = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    if tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"{key}: the DTensor's local shard has shape {tuple(local.shape)} but its placements "
            f"give {tuple(shape)}"
        )
    return local, [int(o) for o in offsets], [int(d) for d in dtensor.shape]


def _flatten(state_dict: Mapping[str, Any], prefix: str = "") -> list:
    """(fqn, value) pairs with nested dicts flattened the way DCP does (``a.b.c``)."""
    out = []
    for key, value in state_dict.items():
        fqn = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(_flatten(value, fqn + "."))
        else:
            out.append((fqn, value))
    return out


def _load_target(fqn: str, value: Any) -> Tuple[tuple, Any]:
    """The native module's target tuple for one state-dict entry, and the object to keep alive."""
    offsets: Optional[list] = None
    flat_start: Optional[int] = None
    array = value
    if isinstance(value, Flat):
        array, flat_start = value.array, int(value.start)
    elif isinstance(value, Box):
        array, offsets = value.array, [int(o) for o in value.offsets]
    elif isinstance(value, tuple) and len(value) == 2:
        array, offsets = value[0], [int(o) for o in value[1]]
    elif _is_dtensor(value):
        array, offsets, _shape = _dtensor_box(fqn, value)
    dtype, shape, address, nbytes, device = _memory(fqn, array, writable=True)
    if flat_start is not None:
        shape = [int(nbytes // max(1, _itemsize(array)))]
    return (fqn, dtype, shape, offsets, flat_start, address, nbytes, device), array


def _itemsize(array: Any) -> int:
    if _is_torch_tensor(array):
        return int(array.element_size())
    return int(array.itemsize)


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _ranks(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    rank = rank if rank is not None else _env_int("RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    return rank, world_size


def _rendezvous(
    master_addr: Optional[str], master_port: Optional[int]
) -> Optional[Tuple[str, int]]:
    addr = master_addr or os.environ.get("MASTER_ADDR")
    if master_port is None:
        master_port = _env_int("TESSERA_PORT")
    if master_port is None:
        torch_port = _env_int("MASTER_PORT")
        master_port = None if torch_port is None else torch_port + _PORT_OFFSET
    if not addr or master_port is None:
        return None
    return addr, int(master_port)


def _storage_env(storage_options: Optional[Mapping[str, str]]) -> list:
    return [(str(k), str(v)) for k, v in (storage_options or {}).items()]


def _progress_printer() -> Optional[Progress]:
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\rtessera: loaded {done / 2**20:,.1f} of {total / 2**20:,.1f} MiB{end}")
        sys.stderr.flush()

    return show


# ---------------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------------


def load(
    checkpoint: str,
    state_dict: MutableMapping[str, Any],
    *,
    server: Optional[str] = None,
    checkpoint_id: Optional[str] = None,
    token: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    exchange: bool = False,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    storage_options: Optional[Mapping[str, str]] = None,
    verify: bool = True,
    progress: Union[bool, Progress] = True,
    timeout: float = 300.0,
) -> dict:
    """Fills the arrays and tensors of ``state_dict`` in place from ``checkpoint``.

    Args:
        checkpoint: a local path or ``file://``, ``s3://``, ``gs://``, ``az://``, ``http(s)://``
            URL of a native, PyTorch DCP or safetensors checkpoint.
        state_dict: FQN -> what this rank needs (see the module docs); nested dicts are
            flattened with ``.`` like DCP does. Every array must be C-contiguous, writable and in
            host memory (or, with the package's ``cuda`` build, CUDA tensors of one device), with
            the checkpoint's dtype and the box's shape.
        server: URL of a ``tessera serve`` that plans instead of this process.
        checkpoint_id: the checkpoint's id on the server (default: the last two path components).
        token: the server's bearer token (default: ``TESSERA_TOKEN``).
        rank, world_size: this rank and the job's size (default: torchrun's ``RANK`` and
            ``WORLD_SIZE``, else 0 and 1).
        exchange: load as one job: every rank calls ``load`` at the same time, the ranks gather
            each other's requests, each shared byte is read once and passed on (needs a
            rendezvous: ``master_addr``/``master_port``, default ``MASTER_ADDR`` and
            ``TESSERA_PORT`` or ``MASTER_PORT + 1``). Without it every rank reads what it needs.
        storage_options: credentials and endpoints (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT``, ...)
            on top of the environment.
        verify: check block checksums of what is read (native checkpoints).
        progress: print progress on a terminal (True), nothing (False), or call
            ``progress(bytes_done, bytes_total)``.
        timeout: seconds to wait for a peer or the rendezvous.

    Returns:
        The rank's report: bytes needed, read and fetched, requests, retries, bytes exchanged,
        seconds per phase, and two figures by name: ``read_amplification`` (data fetched /
        bytes read for the rank's pieces; 1.0 when nothing else is read) and
        ``io_amplification`` (``bytes_fetched`` / ``bytes_read``: total I/O, verification
        included, since checksum blocks around small tensors can exceed the data), with
        ``verify_extra_bytes`` and ``boxes_verified`` (boxes checked by their own crc32c), and
        ``bytes_transferred``: what the store returned for the rank's ``requests``
        (``bytes_fetched`` plus the gaps that one request spanned between small ranges; object
        stores span gaps up to 64 KiB, local files none).

    Raises:
        TesseraError: unknown tensor, dtype or shape mismatch, unreadable checkpoint, storage,
            server or peer failure. The arrays' contents are then unspecified.
        TypeError, ValueError: a state-dict value tessera cannot write into.
    """
    rank, world_size = _ranks(rank, world_size)
    keep_alive = []
    targets = []
    for fqn, value in _flatten(state_dict):
        target, array = _load_target(fqn, value)
        targets.append(target)
        keep_alive.append(array)
    rendezvous = _rendezvous(master_addr, master_port) if exchange else None
    if exchange and world_size > 1 and rendezvous is None:
        raise ValueError(
            "exchange=True needs a rendezvous: pass master_addr and master_port, or run under "
            "torchrun (MASTER_ADDR, MASTER_PORT)"
        )
    callback: Optional[Progress]
    if progress is True:
        callback = _progress_printer()
    elif progress is False or progress is None:
        callback = None
    else:
        callback = progress
    opened = _tessera.open_checkpoint(str(checkpoint), _storage_env(storage_options))
    report = _tessera.load_into(
        opened,
        targets,
        rank,
        world_size,
        rendezvous,
        server,
        checkpoint_id,
        token if token is not None else os.environ.get("TESSERA_TOKEN"),
        bool(verify),
        True,
        float(timeout),
        callback,
    )
    del keep_alive
    return json.loads(report)


def plan(
    checkpoint: str,
    *,
    layout: Union[None, str, Mapping[str, Any]] = None,
    requests: Union[None, str, Mapping[str, Any]] = None,
    rank: Optional[int] = None,
    dedup: bool = True,
    storage_options: Optional[Mapping[str, str]] = None,
) -> dict:
    """Plans loading ``checkpoint`` into a layout or explicit requests.

    ``layout`` and ``requests`` are the JSON documents of ``tessera plan`` (a dict, JSON text, or
    a path to a ``.json`` file). Returns ``{"world", "summary", "rank_plan"?}``: the whole job's
    totals (bytes needed, read, exchanged; read amplification) and, given ``rank``, that rank's
    plan (destinations, pieces with their file byte ranges, exchange rounds).
    """
    if (layout is None) == (requests is None):
        raise ValueError("give exactly one of layout= or requests=")
    doc = _json_text("layout" if layout is not None else "requests", layout or requests)
    text = _tessera.plan(
        str(checkpoint),
        doc if layout is not None else None,
        doc if requests is not None else None,
        rank,
        bool(dedup),
        _storage_env(storage_options),
    )
    return json.loads(text)


def _json_text(what: str, value: Any) -> str:
    if isinstance(value, Mapping):
        return json.dumps(value)
    text = str(value)
    if text.lstrip().startswith("{"):
        return text
    try:
        with open(text, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: {text!r} is neither JSON nor a readable file: {e}") from None


def inspect(checkpoint: str, *, storage_options: Optional[Mapping[str, str]] = None) -> dict:
    """What a checkpoint holds, as plain Python data (``tessera inspect --json``): format, step,
    and every tensor with its dtype, shape and saved boxes (file, byte range)."""
    return json.loads(_tessera.inspect(str(checkpoint), _storage_env(storage_options)))


def save(
    state_dict: Mapping[str, Any],
    path: str,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    step: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    storage_options: Optional[Mapping[str, str]] = None,
    break_claim: bool = False,
    timeout: float = 300.0,
) -> dict:
    """Saves ``state_dict`` as a tessera native checkpoint at ``path``, from every rank.

    Every rank of the job calls ``save`` with what it holds. Values: a whole array or tensor; a
    ``(array, offsets, global_shape)`` triple or a DTensor for a shard; ``bytes`` (saved as an
    object). A box held by several ranks (data-parallel replicas) is written once. Each rank
    writes its own data file; rank 0 commits (metadata, checksums, manifest last) once every rank
    has written, and on any failure nothing is committed. With several ranks a rendezvous is
    needed (``master_addr``/``master_port``, default ``MASTER_ADDR`` and ``TESSERA_PORT`` or
    ``MASTER_PORT + 1``).

    Rank 0 takes an exclusive write claim on ``path`` (``.tessera-claim.json``) before any rank
    writes and removes it after the commit or a failure: a second job saving into the same
    ``path`` fails at once on every rank, naming the holder (pid, host, since when). A job killed
    while saving leaves its claim; once that job is surely gone, ``break_claim=True`` (on every
    rank; rank 0's counts) removes it and saves anyway. Never while the other job may still run.

    Returns:
        The manifest (dict).
    """
    rank, world_size = _ranks(rank, world_size)
    boxes = []
    objects = []
    keep_alive = []
    for fqn, value in _flatten(state_dict):
        if isinstance(value, (bytes, bytearray)):
            objects.append((fqn, bytes(value)))
            continue
        if _is_dtensor(value):
            array, offsets, shape = _dtensor_box(fqn, value)
        elif isinstance(value, tuple) and len(value) == 3:
            array, offsets, shape = value[0], [int(o) for o in value[1]], [int(d) for d in value[2]]
        elif isinstance(value, (Box, Flat)) or (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(
                f"{fqn}: save needs the global shape of a partial tensor: pass "
                "(array, offsets, global_shape) or a DTensor"
            )
        else:
            array, offsets, shape = value, None, None
        if _is_torch_tensor(array) and array.device.type != "cpu":
            array = array.detach().cpu()  # saving reads host memory: one copy per device tensor
        dtype, lengths, address, nbytes, _device = _memory(fqn, array, writable=False)
        if offsets is None:
            offsets, shape = [0] * len(lengths), list(lengths)
        boxes.append((fqn, dtype, shape, offsets, lengths, address, nbytes))
        keep_alive.append(array)
    rendezvous = _rendezvous(master_addr, master_port)
    if world_size > 1 and rendezvous is None:
        raise ValueError(
            f"saving from {world_size} ranks needs a rendezvous so that rank 0 can commit what "
            "every rank wrote: pass master_addr and master_port, or run under torchrun"
        )
    manifest = _tessera.save(
        str(path),
        boxes,
        objects,
        rank,
        world_size,
        rendezvous,
        step,
        _storage_env(storage_options),
        bool(break_claim),
        float(timeout),
    )
    del keep_alive
    return json.loads(manifest)

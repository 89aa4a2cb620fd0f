"""tessera: load distributed checkpoints into a running job's tensors, in any layout.

One call fills a rank's state dict in place from a checkpoint saved with another parallel layout
(PyTorch DCP, Megatron-Core, DeepSpeed, ByteCheckpoint, safetensors, or tessera's native format;
local paths or object-store URLs), the way ``torch.distributed.checkpoint.load`` does::

    import tessera
    state = {"model": model.state_dict(), "optim": optim_state, "step": 0}
    report = tessera.load(state, "s3://ckpts/run1/step-1000")

Each value of the state dict says what this rank needs:

* an array or tensor: the whole tensor of that name;
* a ``torch.distributed.tensor.DTensor``: its local shard (every placement torch makes);
* ``(array, offsets)`` or :class:`Box`: the box of that shape starting at ``offsets``;
* :class:`Flat`: elements ``[start, start + array.size)`` of the tensor's row-major flattening
  (ZeRO / FSDP1 flat parameter buffers);
* anything else (ints, floats, strings, lists, dicts, bytes): a non-tensor value, replaced by the
  checkpoint's.

Nested dicts and lists are flattened into FQNs exactly as DCP does (``optim.state.w.exp_avg``).
Inside a job where ``torch.distributed`` is initialized the ranks load together over the job's own
process group: every shared byte is read once from storage and passed on with torch's
point-to-point ops. Elsewhere each rank reads what it needs.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple, Union

from . import _group, _objects, _state
from . import _tessera
from ._state import Box, Flat, Rename
from ._tessera import TesseraError

__all__ = [
    "Box",
    "Flat",
    "LoadReport",
    "SaveHandle",
    "SaveReport",
    "StagingPool",
    "TesseraError",
    "async_save",
    "inspect",
    "load",
    "plan",
    "publish",
    "save",
    "__version__",
]

__version__: str = _tessera.version()

Progress = Callable[[int, int], None]
Target = Union[Any, Box, Flat, Tuple[Any, Sequence[int]]]


def _open(checkpoint: str, storage_options: Optional[Mapping[str, str]]) -> Any:
    """Opens a checkpoint for a front end, raising what the open found worth saying (files of an
    earlier save in the directory, ignored) as warnings."""
    opened = _tessera.open_checkpoint(checkpoint, _storage_env(storage_options))
    for warning in opened.warnings:
        warnings.warn(warning, stacklevel=4)
    return opened


def _warn_unverified(checkpoint: str, verify: bool, unverified: int) -> None:
    """Warns when a load asked to verify read bytes that no checksum covered."""
    if verify and unverified > 0:
        warnings.warn(
            f"{unverified} bytes of {checkpoint} were read without a checksum to check them against "
            "(parts of saved boxes that no joint check covers, or a format that records none)",
            stacklevel=3,
        )


class _Report:
    """Dict-style access too (``report["bytes_read"]``), as the reports were dicts before."""

    def __getitem__(self, name: str) -> Any:
        if name not in {f.name for f in fields(self)}:  # type: ignore[arg-type]
            raise KeyError(name)
        return getattr(self, name)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass
class LoadReport(_Report):
    """What one rank's :func:`load` did."""

    rank: int = 0
    #: Bytes of this rank's tensor destinations.
    bytes_needed: int = 0
    #: Bytes of the pieces this rank read from storage.
    bytes_read: int = 0
    #: Bytes requested from storage (the pieces plus checksum-block extension).
    #: Of ``bytes_read``, the bytes read from this node's memory tier (``memory_tier=``) and
    #: from the checkpoint's storage; their sum is ``bytes_read``.
    bytes_from_memory_tier: int = 0
    #: Of ``bytes_read``, the bytes of a ``live://`` load read from its publishers' shared memory
    #: on this host (``publish(share_memory=True)``) instead of over HTTP; ``bytes_from_storage``
    #: is then what came over HTTP.
    bytes_from_publisher_memory: int = 0
    bytes_from_storage: int = 0
    #: Memory-tier copies of this checkpoint seen and not used, each with why (damaged, another
    #: file size); their bytes came from storage.
    memory_tier_ignored: List[str] = field(default_factory=list)
    bytes_fetched: int = 0
    #: Of ``bytes_fetched``, what only verification needed.
    verify_extra_bytes: int = 0
    #: Data fetched / bytes read (1.0: nothing outside the pieces was read).
    read_amplification: float = 1.0
    #: ``bytes_fetched`` / ``bytes_read``, verification included.
    io_amplification: float = 1.0
    #: Saved boxes verified by their own checksum (crc32c, or a DCP blob's zip CRC-32).
    boxes_verified: int = 0
    #: Bytes read with ``verify=True`` that no checksum covered (parts of DCP blobs that no
    #: joint check partitions, formats that record none); a warning says so when not 0.
    bytes_unverified: int = 0
    #: Bytes the store returned (what the wire carried).
    bytes_transferred: int = 0
    #: Storage requests and retried ones.
    requests: int = 0
    retries: int = 0
    #: Bytes passed to and received from other ranks.
    bytes_sent: int = 0
    bytes_received: int = 0
    #: Of ``bytes_received``, bytes copied straight out of a peer process's memory on this host
    #: (no socket; ``TESSERA_CROSS_MEMORY=0`` turns it off).
    bytes_received_direct: int = 0
    read_seconds: float = 0.0
    exchange_seconds: float = 0.0
    #: Of ``exchange_seconds``, the time this rank waited on its peers (their shares, their
    #: joint-check folds) rather than moving bytes itself: what varies with the peers' reads.
    exchange_wait_seconds: float = 0.0
    #: Bytes and seconds of host-to-device copies (CUDA destinations).
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    total_seconds: float = 0.0
    #: How the ranks shared bytes: ``"process_group"`` (the job's torch group), ``"tcp"``
    #: (tessera's own rendezvous) or ``"none"`` (each rank read what it needs).
    exchange: str = "none"
    #: State-dict keys loaded: tensors and non-tensor values.
    tensors_loaded: int = 0
    objects_loaded: int = 0
    #: State-dict keys the checkpoint does not have (``strict=False``; left untouched).
    missing_keys: List[str] = field(default_factory=list)
    #: Tensors converted from the checkpoint's dtype (``cast=True``): key -> "bf16->float32".
    cast: Dict[str, str] = field(default_factory=dict)
    #: The step a ``live://`` load read (None for checkpoints).
    step: Optional[int] = None
    #: The plan was replayed: made for an earlier step of the same live publication with the
    #: same layout and requests (this process's, or over a process group the coordinator's),
    #: checked against this step and read against this step's checksums; planning skipped.
    plan_reused: bool = False
    #: Seconds from this rank's requests to its plan (planning, or replaying, and the rounds
    #: that hand it out over a process group).
    plan_seconds: float = 0.0
    #: A ``live://`` load whose publisher rank died or stopped, read from the durable
    #: checkpoint of the same step the publication names (``publish(durable=)``): why (naming
    #: the publisher rank) and which checkpoint; None when it read the publishers.
    fallback: Optional[str] = None
    durable_checkpoint: Optional[str] = None
    #: A ``live://`` load with ``delta=True``: the step this rank's tensors held before (None: no
    #: earlier load of this publication into them, so everything was loaded), the state-dict
    #: keys left as they were because none of their saved boxes changed, and their bytes.
    delta_from: Optional[int] = None
    unchanged_keys: List[str] = field(default_factory=list)
    bytes_unchanged: int = 0


@dataclass
class SaveReport(_Report):
    """What :func:`save` committed: the checkpoint's manifest and this rank's part."""

    checkpoint_id: str = ""
    rank: int = 0
    world_size: int = 1
    #: The committed manifest (format, step, tensors, boxes, files, ...).
    manifest: Dict[str, Any] = field(default_factory=dict)
    #: Non-tensor values this rank saved.
    objects: int = 0
    total_seconds: float = 0.0
    #: Seconds the call waited for the previous save's persist (one save in flight per process).
    waited_seconds: float = 0.0
    #: Seconds the snapshot copies took, and the persist (write + commit) after them.
    snapshot_seconds: float = 0.0
    persist_seconds: float = 0.0
    #: Bytes of this rank's tensors copied into the staging pool.
    staged_bytes: int = 0
    #: How the snapshot was taken (``async_save``'s ``snapshot=``; ``save`` copies nothing).
    snapshot: str = ""
    #: Seconds the ``async_save`` call blocked the caller, and seconds optimizer steps waited
    #: for the snapshot (lazy, multi-step).
    blocked_seconds: float = 0.0
    step_wait_seconds: float = 0.0
    #: Optimizer steps between the ``async_save`` call and the state saved (multi-step: k - 1).
    steps_after_call: int = 0
    #: This rank's writes retried after a transient storage failure (requests tried again, plus
    #: multipart data files written again from the start).
    write_retries: int = 0
    #: Write faults injected into this rank's store by ``TESSERA_TEST_FAULTS`` (test builds with
    #: the ``fault-injection`` feature); ``None`` when no faults were asked for.
    injected_write_faults: Optional[int] = None
    #: Set when this rank found the checkpoint committed by looking at it itself, because rank 0
    #: did not answer within the save's timeout: committed, but rank 0 (or the way to it) was slow.
    warning: Optional[str] = None
    #: What this rank left in its node's memory tier (``memory_tier=``): ``{"path", "bytes",
    #: "skipped", "pruned"}``, or ``{"error"}`` when leaving the copy failed (the checkpoint is
    #: committed either way); ``None`` without a tier.
    memory_tier: Optional[Dict[str, Any]] = None

    def __getitem__(self, name: str) -> Any:
        # Manifest fields by name (``report["step"]``), as save returned the manifest before.
        if name in self.manifest:
            return self.manifest[name]
        return super().__getitem__(name)


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


def _typed(kind: Any, **fields: Any) -> Any:
    """A typed request of the Rust module (``LoadRequest``, ``SaveRequest``) with ``fields`` set
    by name: a misspelt field raises instead of shifting a positional list."""
    request = kind()
    for name, value in fields.items():
        setattr(request, name, value)
    return request


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
    """Rank 0's address and port for tessera's own rendezvous, by the rule every front end keeps
    (the arguments, else ``MASTER_ADDR`` and ``TESSERA_PORT`` or ``MASTER_PORT + 1``: torch's
    store listens on ``MASTER_PORT``); None unless both are known."""
    return _tessera.rendezvous_endpoint(master_addr, None if master_port is None else int(master_port))


def _memory_tier_dir(memory_tier: Union[str, "os.PathLike[str]", None]) -> Optional[str]:
    """``memory_tier=`` as the front ends hand it on: an absolute path (a relative one is taken
    from the current directory now, as the caller means it), None for no tier. An empty path
    would be the current directory, which the prune and the copies would share with whatever
    else is there: refused."""
    if memory_tier is None:
        return None
    path = os.fspath(memory_tier)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if not path.strip():
        raise ValueError(
            f"memory_tier={memory_tier!r}: an empty path would be the current directory; name a directory "
            "of its own (e.g. /dev/shm/tessera/<run>), or pass memory_tier=None for no tier"
        )
    return os.path.abspath(path)


#: What a count or byte budget of the memory tier may be: Rust's u64 (the tier's sizes).
_MAX_U64 = 2**64 - 1


def _memory_tier_int(value: Any, name: str, minimum: int, why: str) -> int:
    """``value`` of argument ``name`` as an int in [minimum, 2**64 - 1], else a ValueError naming
    the argument (``why`` says what the minimum means)."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r}: not an integer") from None
        if number != value:
            raise ValueError(f"{name}={value!r}: not an integer")
        value = number
    if value < minimum:
        raise ValueError(f"{name}={value}: {why}")
    if value > _MAX_U64:
        raise ValueError(f"{name}={value}: more than the largest value tessera takes (2**64 - 1)")
    return int(value)


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
# Loading
# ---------------------------------------------------------------------------------------------

_FLOATS = {"f16", "bf16", "f32", "f64"}
_INTS = {"i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"}
_NUMPY_NAMES = {
    "f16": "float16", "f32": "float32", "f64": "float64", "bf16": "bfloat16", "bool": "bool",
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
}


def _dcp_order(state_dict: Any, checkpoint_id: Any, call: str) -> Tuple[Any, Any]:
    """``(state_dict, checkpoint_id)``, accepting the pre-0.2 order ``(checkpoint, state_dict)``
    with a DeprecationWarning."""
    if isinstance(state_dict, (str, os.PathLike)) and isinstance(checkpoint_id, Mapping):
        warnings.warn(
            f"tessera.{call}(checkpoint, state_dict) is deprecated: call tessera.{call}(state_dict, "
            "checkpoint_id) as torch.distributed.checkpoint does",
            DeprecationWarning,
            stacklevel=3,
        )
        return checkpoint_id, state_dict
    if checkpoint_id is None:
        raise TypeError(f"tessera.{call}() needs checkpoint_id: the checkpoint's path or URL")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
    return state_dict, os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id


def _host_like(array: Any, tessera_dtype: str) -> Any:
    """A fresh contiguous host array of ``array``'s shape in the checkpoint's dtype."""
    name = _NUMPY_NAMES.get(tessera_dtype)
    if name is None:
        raise TesseraError(f"tessera cannot stage a {tessera_dtype} tensor for a cast or a device copy")
    if _state.is_torch_tensor(array):
        import torch

        pin = array.device.type == "cuda"
        return torch.empty(tuple(array.shape), dtype=getattr(torch, name), pin_memory=pin)
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.empty(array.shape, dtype=ml_dtypes.bfloat16)
    return np.empty(array.shape, dtype=np.dtype(name))


def _copy_into(dst: Any, src: Any) -> None:
    if _state.is_torch_tensor(dst):
        dst.copy_(src)
    else:
        import numpy as np

        np.copyto(dst, src.astype(dst.dtype, copy=False), casting="unsafe")


def _destination(
    key: str, fqn: str, array: Any, stored: str, cast: bool, stage_device: bool, report: "LoadReport"
) -> Tuple[Any, Optional[Tuple[Any, Any]]]:
    """The array tessera fills for one tensor entry, and ``(user array, staged array)`` to copy
    back afterwards when it is not the user's own (a cast, or device memory staged on the host)."""
    given = _tessera.canonical_dtype(_state.dtype_name(array))
    mismatch = given != stored
    if mismatch:
        if not cast:
            raise TesseraError(
                f"tensor {key}: the checkpoint stores {fqn} as {stored} but the array is "
                f"{_state.dtype_name(array)}; pass cast=True to convert on load"
            )
        if not ((given in _FLOATS and stored in _FLOATS) or (given in _INTS and stored in _INTS)):
            raise TesseraError(
                f"tensor {key}: cannot cast the checkpoint's {stored} to {_state.dtype_name(array)} "
                "(cast=True converts between floating types and between integer types)"
            )
        report.cast[key] = f"{stored}->{given}"
    on_device = _state.is_torch_tensor(array) and array.device.type == "cuda"
    if mismatch or (stage_device and on_device):
        staged = _host_like(array, stored)
        return staged, (array, staged)
    return array, None


def _missing_message(checkpoint_id: str, missing: List[Tuple[str, str]], names: List[str]) -> str:
    parts = []
    for key, fqn in missing[:5]:
        text = key if key == fqn else f"{key} (renamed to {fqn})"
        close = difflib.get_close_matches(fqn, names, n=3, cutoff=0.6)
        if close:
            text += f": did you mean {', '.join(close)}?"
        parts.append(text)
    more = f"; and {len(missing) - 5} more" if len(missing) > 5 else ""
    # DCP's own words first (it stops at the first missing key), which code written for
    # dcp.load matches on; then every key with its near matches.
    return (
        f"Missing key in checkpoint state_dict: {missing[0][1]}. "
        f"{len(missing)} key(s) of the state dict are not in checkpoint {checkpoint_id}: "
        + "; ".join(parts)
        + more
        + " (strict=False loads the rest and reports these in missing_keys; rename= maps keys to the checkpoint's names)"
    )


def _progress_callback(progress: Union[bool, Progress, None]) -> Optional[Progress]:
    if progress is True:
        return _progress_printer()
    if progress is False or progress is None:
        return None
    return progress


def _checkpoint_error(error: BaseException) -> BaseException:
    """``error`` as an error that is a :class:`TesseraError` and, where torch is imported, also
    DCP's ``CheckpointException``, so code written for ``dcp.load`` that catches the latter
    keeps working (``except Exception`` still catches it too)."""
    cls = _checkpoint_error_class()
    if cls is None or isinstance(error, cls):
        return error
    return cls(str(error))


_CHECKPOINT_ERROR: Any = None


def _checkpoint_error_class() -> Any:
    global _CHECKPOINT_ERROR
    if _CHECKPOINT_ERROR is None:
        if "torch" not in sys.modules:
            return None
        try:
            from torch.distributed.checkpoint.api import CheckpointException
        except ImportError:
            return None

        class CheckpointError(TesseraError, CheckpointException):  # type: ignore[misc, valid-type]
            """A tessera load error that is also DCP's ``CheckpointException``."""

            def __init__(self, message: str) -> None:
                TesseraError.__init__(self, message)
                self._failures: Dict[int, Any] = {}

            def __str__(self) -> str:
                return str(self.args[0]) if self.args else ""

        CheckpointError.__module__ = "tessera"
        _CHECKPOINT_ERROR = CheckpointError
    return _CHECKPOINT_ERROR


def _dcp_errors(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, raising its ``TesseraError``s as :func:`_checkpoint_error` makes them."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except TesseraError as e:
            raise _checkpoint_error(e) from None

    return wrapper


@_dcp_errors
@_group.joins_on_failure
def load(
    state_dict: MutableMapping[str, Any],
    checkpoint_id: Union[str, "os.PathLike[str]", None] = None,
    *,
    process_group: Any = None,
    strict: bool = True,
    cast: bool = False,
    rename: Rename = None,
    allow_pickle: bool = False,
    verify: bool = True,
    exchange: Optional[bool] = None,
    read_order: Optional[str] = None,
    storage_options: Optional[Mapping[str, str]] = None,
    server: Optional[str] = None,
    server_id: Optional[str] = None,
    token: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    progress: Union[bool, Progress] = True,
    timeout: float = 300.0,
    memory_tier: Union[str, "os.PathLike[str]", None] = None,
    registry: Union[str, "os.PathLike[str]", None] = None,
    delta: bool = False,
) -> LoadReport:
    """Fills ``state_dict`` in place from checkpoint ``checkpoint_id``, like ``dcp.load``.

    Args:
        state_dict: what this rank needs (see the module docs). Tensor entries are filled in
            place (C-contiguous, writable, host memory or CUDA tensors); non-tensor values are
            replaced by the checkpoint's. Nested dicts and lists are flattened as DCP does.
        checkpoint_id: a local path or ``file://``, ``s3://``, ``gs://``, ``az://``,
            ``http(s)://`` URL of a native, DCP (Megatron-Core, ByteCheckpoint), DeepSpeed or
            safetensors checkpoint; or ``live://NAME`` (the newest complete step of a live
            publication, see :func:`publish`) or ``live://NAME@STEP``, with ``registry=``.
        process_group: the torch process group to load over (default: the default group when
            ``torch.distributed`` is initialized with several ranks). Its ranks read each shared
            byte once and pass it on with torch's point-to-point ops (gloo for CPU, NCCL for
            device memory); every rank of the group must call ``load``.
        strict: a state-dict key the checkpoint lacks is an error naming it and near matches;
            with ``strict=False`` it is left as it is and listed in ``missing_keys``.
        cast: convert dtypes on the way (between float types, between integer types) where the
            array's dtype differs from the checkpoint's; without it a mismatch is an error.
        rename: maps state-dict keys (flattened FQNs) to the checkpoint's FQNs: a dict, or a
            callable such as ``lambda k: k.removeprefix("module.")``.
        allow_pickle: non-tensor values that are not plain values (ints, floats, strings,
            lists, dicts, tuples, sets, bytes) are unpickled only with ``allow_pickle=True``,
            which runs code from the checkpoint: for trusted checkpoints only.
        verify: check block checksums and saved boxes' crc32c of what is read.
        exchange: ``False`` makes every rank read what it needs on its own even inside a
            process group; ``True`` without torch.distributed uses tessera's own TCP rendezvous
            (``master_addr``/``master_port``, default ``MASTER_ADDR`` and ``TESSERA_PORT`` or
            ``MASTER_PORT + 1``) for jobs that have no process group.
        read_order: how saved chunks are read when ranks load together: ``"request"`` (each
            rank reads its pieces where the target cuts them), ``"storage"`` (a chunk cut across
            its rows is read in slabs and the parts others need are passed on), or ``"auto"``
            (the planner's cost model per chunk). Default: the cost model's choice, as in the CLI
            (``tessera load --read-order auto``): one rule for every front end.
        storage_options: credentials and endpoints (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT``, ...)
            on top of the environment.
        server, server_id, token: a ``tessera serve`` that plans instead of the ranks, the
            checkpoint's id there (default: the last two path components) and its bearer token
            (default ``TESSERA_TOKEN``).
        rank, world_size: without a process group, this rank and the job's size (default
            torchrun's ``RANK``/``WORLD_SIZE``, else 0 and 1).
        progress: print progress on a terminal (True), nothing (False), or call
            ``progress(bytes_done, bytes_total)``.
        timeout: seconds to wait for a peer, a rendezvous or the exchange.
        memory_tier: this node's memory tier (the directory ``save``/``async_save`` was given
            as ``memory_tier=``). Each rank offers the copies of this checkpoint it finds there,
            each verified box by box against the checkpoint's checksums; the job plans together
            and every piece a node holds is read from that node's memory, once, and passed on to
            the ranks that need it; storage serves only what no node holds. A copy of another
            checkpoint (another step, another run, an uncommitted save) is never used, and a
            damaged one is read from storage instead (``report.memory_tier_ignored`` and a
            warning say which and why), as is one that is not a regular file (a FIFO is never
            waited on) or that changes after it was verified and fails a read (the pieces not
            yet read of it). A relative path is taken from the current directory at the call.
            Any layout and world size. Not with ``server=``.
        registry: the registry directory of ``live://`` publications (the publishing job's
            ``publish(..., registry=)``). ``report.step`` says which step was loaded; the step
            stays served while this load reads it (a lease in the registry).
        delta: for ``live://``: load only the tensors of which some saved box changed (its
            crc32c differs) since the step this process last loaded from the publication into
            these same tensors; the others keep their bytes (``report.unchanged_keys``). A
            tensor counts as the same only while its storage, shape, strides and torch's
            version counter are unchanged since then, so one written in place by torch, or by
            another ``load``, is loaded again; by passing ``delta=True`` the caller vouches that
            nothing else (raw pointers, numpy views) wrote it. Nested and Stateful values are
            always loaded.

    Returns:
        :class:`LoadReport` of this rank (also readable as ``report["bytes_read"]``).

    Raises:
        TesseraError: a key missing (strict), a dtype or shape mismatch, an unreadable or corrupt
            checkpoint, a storage, server or peer failure. The arrays' contents are then
            unspecified; non-tensor values are only replaced after every tensor loaded.
        TypeError, ValueError: a state-dict value tessera cannot write into, or a non-tensor
            value that needs ``allow_pickle=True``.
        KeyboardInterrupt: Ctrl-C, seen while reading and while waiting for peers.
    """
    state_dict, checkpoint_id = _dcp_order(state_dict, checkpoint_id, "load")
    live = sys.modules.get(f"{__name__}._live")
    if live is not None and live._HELD and not delta:
        # This load writes these tensors without moving torch's version counter: what a
        # delta load recorded of them no longer says what they hold (a delta load compares
        # first, and records anew after its own load).
        live.forget(state_dict)
    if isinstance(checkpoint_id, str) and checkpoint_id.startswith("live://"):
        options = dict(
            process_group=process_group, strict=strict, cast=cast, rename=rename, allow_pickle=allow_pickle,
            verify=verify, exchange=exchange, read_order=read_order, storage_options=storage_options,
            server=server, server_id=server_id, token=token, rank=rank, world_size=world_size,
            master_addr=master_addr, master_port=master_port, progress=progress, timeout=timeout,
            memory_tier=memory_tier,
        )
        if delta:
            return _live_delta(state_dict, checkpoint_id, registry, options)
        return _load_live(state_dict, checkpoint_id, registry, options)
    if registry is not None:
        raise ValueError(f"registry= is for live:// publications, not {checkpoint_id}")
    if delta:
        raise ValueError(f"delta=True is for live:// publications, not {checkpoint_id}")
    tier_dir = _memory_tier_dir(memory_tier)
    started = time.monotonic()
    outer = state_dict
    state_dict, stateful = _stateful_states(outer)
    group = _load_group(process_group, exchange, rank, world_size, timeout)
    opened = _open(str(checkpoint_id), storage_options)
    report = LoadReport()
    found = _find_targets(opened, str(checkpoint_id), state_dict, report, (rename, cast, strict, group is not None))

    # Non-tensor values are read and decoded before any tensor is touched (a value that does not
    # decode fails the load early) and set only after every tensor loaded.
    decoded = _read_objects(opened, found.wanted_objects, allow_pickle)

    raw, report.exchange = _load_bytes(
        opened, found.targets, group, rank=rank, world_size=world_size, exchange=exchange,
        master_addr=master_addr, master_port=master_port, verify=bool(verify), server=server,
        server_id=server_id, token=token if token is not None else os.environ.get("TESSERA_TOKEN"),
        timeout=float(timeout), progress=_progress_callback(progress), read_order=read_order,
        memory_tier=tier_dir,
    )
    for name, value in raw.items():
        if hasattr(report, name):
            setattr(report, name, value)
    for why in report.memory_tier_ignored:
        warnings.warn(f"rank {report.rank}: memory tier {os.fspath(memory_tier)}: {why}", stacklevel=2)
    _warn_unverified(str(checkpoint_id), bool(verify), report.bytes_unverified)

    _copy_back(found.copy_back, report)
    found.keep_alive.clear()
    _set_loaded(outer, state_dict, stateful, decoded + found.materialized)
    report.tensors_loaded = len(found.targets)
    report.objects_loaded = len(decoded)
    report.total_seconds = time.monotonic() - started
    return report


def _load_live(
    state_dict: MutableMapping[str, Any], checkpoint_id: str, registry: Any, options: Dict[str, Any]
) -> LoadReport:
    """:func:`load` of ``live://NAME[@STEP]``: one step for the whole job (rank 0 resolves it over
    the group), held by a lease while it loads; then the ordinary load of that step's
    ``live+file://`` location with the caller's ``options``."""
    from . import _live

    consumers = _group.default_group(options["process_group"], options["exchange"])
    step, location = _live.resolve_for_load(checkpoint_id, registry, consumers)
    try:
        with _live.Lease(location, options["timeout"]):
            report = load(state_dict, location, **options)
    except TesseraError as error:
        # A publisher rank that died or stopped: the same step from the durable checkpoint
        # the publication names, when committed; the whole load again, so no byte of the
        # failed attempt stays (every rank of the job decides alike, rank 0's answer).
        found = _live.fallback_for_load(
            checkpoint_id, step, location, error, consumers, options["storage_options"]
        )
        if found is None:
            raise
        report = load(state_dict, found[0], **options)
        report.durable_checkpoint, report.fallback = found
    report.step = step
    return report


def _live_delta(
    state_dict: MutableMapping[str, Any], checkpoint_id: str, registry: Any, options: Dict[str, Any]
) -> LoadReport:
    """:func:`load` of ``live://`` with ``delta=True``: :func:`_load_live` of the entries whose
    saved boxes changed since what this process last loaded into the same tensors
    (``_live.Delta``); the unchanged entries are left out of the load and keep their bytes."""
    from . import _live

    consumers = _group.default_group(options["process_group"], options["exchange"])
    delta = _live.Delta(registry, checkpoint_id, options.get("rename"), consumers)
    changed = delta.changed_entries(state_dict, options.get("storage_options"))
    # The same dict object where nothing is left out: Stateful values and nested dicts load
    # into it as usual; otherwise a dict of the changed entries, whose loaded values go back.
    subset = state_dict if len(changed) == len(state_dict) else {k: state_dict[k] for k in changed}
    report = _load_live(subset, delta.url, registry, options)
    if subset is not state_dict:
        for key in changed:
            state_dict[key] = subset[key]
    delta.loaded(state_dict, report)
    return report


def _stateful_states(state_dict: MutableMapping[str, Any]) -> Tuple[MutableMapping[str, Any], Dict[str, Any]]:
    """The state dict :func:`load` fills, and its Stateful values by key. Stateful values (a
    module, an optimizer) load as DCP loads them: into their ``state_dict()``, handed to their
    ``load_state_dict()`` once everything loaded."""
    stateful = {k: v for k, v in state_dict.items() if _state.is_stateful(v)}
    if not stateful:
        return state_dict, stateful
    return {k: (v.state_dict() if k in stateful else v) for k, v in state_dict.items()}, stateful


def _load_group(process_group: Any, exchange: Optional[bool], rank: Any, world_size: Any, timeout: float) -> Any:
    """The process group :func:`load` runs over (``None``: none), its load marked pending; rank
    and world size given besides one are refused."""
    group = _group.default_group(process_group, exchange)
    if group is not None:
        # Whatever fails from here on is this rank's failure of the group's load (see
        # `_group.joins_on_failure`): the other ranks hear of it instead of joining its next load.
        _group.pending_load(group, timeout)
    if group is not None and (rank is not None or world_size is not None):
        raise ValueError("rank and world_size come from the process group; do not pass them with one")
    return group


def _find_targets(
    opened: Any,
    checkpoint_id: str,
    state_dict: Mapping[str, Any],
    report: LoadReport,
    how: Tuple[Any, bool, bool, bool],
) -> "_LoadTargets":
    """The state dict's entries in the checkpoint ``opened`` (``how``: ``rename``, ``cast``,
    ``strict`` and whether a process group loads), sorted by :func:`_load_targets`; a missing key
    is an error naming it and near matches (``strict``), else listed in ``report.missing_keys``."""
    rename, cast, strict, grouped = how
    entries = json.loads(opened.entries())
    tensors: Dict[str, Any] = entries["tensors"]
    objects = set(entries["objects"])
    found = _load_targets(state_dict, tensors, objects, _state.renamer(rename), cast, grouped, report)
    if found.missing:
        if strict:
            raise TesseraError(_missing_message(checkpoint_id, found.missing, sorted(tensors) + sorted(objects)))
        report.missing_keys = [key for key, _fqn in found.missing]
    return found


@dataclass
class _LoadTargets:
    """What :func:`load` does with a state dict's entries, as :func:`_load_targets` sorts them."""

    # The load targets, the arrays they fill (kept alive until the load ends) and the staged
    # copies to copy into their tensors afterwards (``(tensor, staged)``).
    targets: list = field(default_factory=list)
    keep_alive: list = field(default_factory=list)
    copy_back: list = field(default_factory=list)
    # Non-tensor values to read: ``(key, fqn, path, value)``.
    wanted_objects: list = field(default_factory=list)
    # Keys the checkpoint lacks: ``(key, fqn)``.
    missing: list = field(default_factory=list)
    # Meta tensors replaced by new ones to load: ``(path, tensor)``, set into the state dict.
    materialized: list = field(default_factory=list)


def _load_targets(
    state_dict: Any,
    tensors: Dict[str, Any],
    objects: set,
    to_fqn: Callable[[str], Any],
    cast: bool,
    grouped: bool,
    report: LoadReport,
) -> _LoadTargets:
    """Sorts the flattened ``state_dict``'s entries: tensors into load targets (a target per
    local shard of a sharded tensor), non-tensor values the checkpoint holds (``objects``) into
    values to read, the rest into missing keys."""
    found = _LoadTargets()
    for key, path, value in _state.flatten(state_dict):
        fqn = to_fqn(key)
        if not isinstance(fqn, str):
            raise TypeError(f"rename({key!r}) returned a {type(fqn).__name__}, not a str")
        if _state.is_tensor_entry(value):
            if fqn not in tensors:
                found.missing.append((key, fqn))
                continue
            if _state.outside_mesh(value):
                continue  # this rank is not on the DTensor's mesh: it holds nothing of it
            if _state.is_meta(value):
                # A tensor or DTensor with no storage (a model built on the meta device): a new
                # one takes its place in the state dict, as dcp.load does, and is loaded.
                value = _state.materialize(value)
                found.materialized.append((path, value))
            boxes = (
                _state.sharded_boxes(value) if _state.is_sharded_tensor(value)
                else _state.chunk_boxes(fqn, value) if _state.plans_by_chunks(value)
                else None
            )
            if boxes is not None:
                # Each local shard is a box of the global tensor, loaded in place.
                for local, offsets in boxes:
                    filled, back = _destination(key, fqn, local, tensors[fqn]["dtype"], cast, grouped, report)
                    found.targets.append(_state.load_target(fqn, filled, offsets, None))
                    found.keep_alive.append(filled)
                    if back is not None:
                        found.copy_back.append(back)
                continue
            array, offsets, flat_start = _state.entry_array(key, value)
            filled, back = _destination(key, fqn, array, tensors[fqn]["dtype"], cast, grouped, report)
            found.targets.append(_state.load_target(fqn, filled, offsets, flat_start))
            found.keep_alive.append(filled)
            if back is not None:
                found.copy_back.append(back)
        elif fqn in objects:
            found.wanted_objects.append((key, fqn, path, value))
        else:
            found.missing.append((key, fqn))
    return found


def _read_objects(opened: Any, wanted_objects: list, allow_pickle: bool) -> list:
    """Reads and decodes the non-tensor values ``wanted_objects`` (``(key, fqn, path, value)``)
    from the checkpoint: ``(path, decoded value)`` each."""
    stored = opened.read_objects([fqn for _k, fqn, _p, _v in wanted_objects]) if wanted_objects else []
    return [
        (path, _objects.decode(key, data, like, allow_pickle=allow_pickle, archived=opened.format == "dcp"))
        for (key, _fqn, path, like), data in zip(wanted_objects, stored)
    ]


def _load_bytes(
    opened: Any,
    targets: list,
    group: Any,
    *,
    rank: Optional[int],
    world_size: Optional[int],
    exchange: Optional[bool],
    master_addr: Optional[str],
    master_port: Optional[int],
    verify: bool,
    server: Optional[str],
    server_id: Optional[str],
    token: Optional[str],
    timeout: float,
    progress: Optional[Progress],
    read_order: Optional[str],
    memory_tier: Optional[str],
) -> Tuple[dict, str]:
    """Loads the tensor ``targets``: over the torch process ``group``, or alone or over tessera's
    own rendezvous without one. Returns the load's report fields and how the ranks exchanged."""
    if group is not None:
        raw = _group.load_over_group(
            opened, targets, group, verify=verify, server=server, server_id=server_id,
            token=token, timeout=timeout, progress=progress, read_order=read_order,
            memory_tier=memory_tier,
        )
        return raw, "process_group"
    rank, world_size = _ranks(rank, world_size)
    rendezvous = _rendezvous(master_addr, master_port) if exchange else None
    if exchange and world_size > 1 and rendezvous is None:
        raise ValueError(
            "exchange=True needs a rendezvous: initialize torch.distributed (or pass process_group), "
            "pass master_addr and master_port, or run under torchrun (MASTER_ADDR, MASTER_PORT)"
        )
    request = _typed(
        _tessera.LoadRequest, rank=rank, world=world_size, rendezvous=rendezvous, server=server,
        checkpoint_id=server_id, token=token, verify=verify, dedup=True, timeout_s=timeout,
        read_order=read_order, memory_tier=memory_tier,
    )
    raw = json.loads(_tessera.load_into(opened, targets, request, progress))
    return raw, "tcp" if rendezvous is not None and world_size > 1 else "none"


def _copy_back(copy_back: list, report: LoadReport) -> None:
    """Copies the staged arrays into the tensors they stand for (``(tensor, staged)``), counting
    what went to a GPU (and the time until it is there) in ``report``."""
    h2d_started = time.monotonic()
    for dst, staged in copy_back:
        _copy_into(dst, staged)
        if _state.is_torch_tensor(dst) and dst.device.type == "cuda":
            report.h2d_bytes += int(dst.numel() * dst.element_size())
    if any(_state.is_torch_tensor(d) and d.device.type == "cuda" for d, _s in copy_back):
        import torch

        torch.cuda.synchronize()
        report.h2d_seconds += time.monotonic() - h2d_started


def _set_loaded(outer: Any, state_dict: Any, stateful: Dict[Any, Any], values: list) -> None:
    """Sets the loaded non-tensor and materialized ``values`` (``(path, value)``) into
    ``state_dict``, hands the Stateful entries their state dicts, and assigns every other
    top-level value back into the caller's mapping ``outer``."""
    for path, value in values:
        _state.set_element(state_dict, path, value)
    for key, value in stateful.items():
        value.load_state_dict(state_dict[key])
    # As dcp.load ends: every top-level value that is not Stateful is assigned back into the
    # caller's mapping (a mapping that watches its __setitem__ sees the load); Stateful entries
    # stay the caller's objects.
    for key in sorted(state_dict.keys(), key=str):
        if key not in stateful and key in outer:
            outer[key] = state_dict[key]

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
    every tensor with its dtype, shape and saved boxes (file, byte range), and ``objects``: every
    plain (non-tensor) value with its key, file, byte range and decoded ``value`` (or
    ``value_error`` saying why there is none), in the same shape for every format."""
    return json.loads(_tessera.inspect(str(checkpoint), _storage_env(storage_options)))


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def save(
    state_dict: Mapping[str, Any],
    checkpoint_id: Union[str, "os.PathLike[str]", None] = None,
    *,
    process_group: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    step: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    storage_options: Optional[Mapping[str, str]] = None,
    break_claim: bool = False,
    timeout: float = 300.0,
    memory_tier: Union[str, "os.PathLike[str]", None] = None,
    memory_tier_keep: int = 2,
    memory_tier_max_bytes: Optional[int] = None,
) -> SaveReport:
    """Saves ``state_dict`` as a tessera native checkpoint at ``checkpoint_id``, from every rank,
    like ``dcp.save``.

    Every rank of the job calls ``save`` with what it holds. Values: a whole array or tensor; a
    DTensor or an ``(array, offsets, global_shape)`` triple for a shard; any other value is a
    non-tensor value (plain values: ints, floats, strings, lists, dicts, tuples, sets, None;
    ``bytes`` and ``io.BytesIO`` are stored raw), flattened as DCP does. A box held by several
    ranks (data-parallel replicas) is written once. Each rank writes its own data file; rank 0
    commits (metadata, checksums, manifest last) once every rank has written, and on any failure
    nothing is committed. With a ``process_group`` (default: the initialized default group)
    rank and world size are the group's; the commit's rendezvous is ``master_addr``/
    ``master_port`` (default ``MASTER_ADDR`` and ``TESSERA_PORT`` or ``MASTER_PORT + 1``).

    Rank 0 takes an exclusive write claim on the directory (``.tessera-claim.json``) before any
    rank writes and removes it after the commit or a failure: a second job saving into the same
    place fails at once on every rank, naming the holder (pid, host, since when). A job killed
    while saving leaves its claim; once that job is surely gone, ``break_claim=True`` (on every
    rank; rank 0's counts) removes it and saves anyway. Never while the other job may still run.

    ``memory_tier=DIR`` (a node-local directory that outlives the process, e.g.
    ``/dev/shm/tessera/<run>``; ranks naming the same one on a host are one node) also leaves
    each rank's data file there once the checkpoint committed, so that a restarted job of any
    layout loads it from memory (``tessera.load(..., memory_tier=DIR)``). The tier keeps the
    newest ``memory_tier_keep`` checkpoints and at most ``memory_tier_max_bytes``; ``tessera gc
    DIR --memory-tier`` prunes it by hand. Only the copy folders tessera made there (each has its
    marker, ``.tessera-tier-copy.json``) are ever removed: a tier may be shared with other
    programs. A tier that is, holds or lies inside a checkpoint (the checkpoints' root, say) is
    refused before anything is written, and ``memory_tier=""`` is a ``ValueError``.

    ``save`` is ``async_save(...).result()``: the same snapshot into the process's staging pool,
    then the persist, waited for here.

    Returns:
        :class:`SaveReport` with the committed manifest (``report["step"]`` reads its fields).
    """
    state_dict, checkpoint_id = _dcp_order(state_dict, checkpoint_id, "save")
    from ._async_save import async_save

    handle = async_save(
        state_dict, checkpoint_id, process_group=process_group, rank=rank, world_size=world_size,
        step=step, master_addr=master_addr, master_port=master_port,
        storage_options=storage_options, break_claim=break_claim, timeout=timeout,
        memory_tier=memory_tier, memory_tier_keep=memory_tier_keep,
        memory_tier_max_bytes=memory_tier_max_bytes,
    )
    return handle.result()


_ASYNC_SAVE_NAMES = ("SaveHandle", "StagingPool", "async_save")


def __getattr__(name: str) -> Any:
    """The async save's names, imported on first use: a job that only loads (an eval or SFT
    job's first call) does not pay for the save machinery's import."""
    if name in _ASYNC_SAVE_NAMES:
        from . import _async_save

        for n in _ASYNC_SAVE_NAMES:
            globals()[n] = getattr(_async_save, n)
        return globals()[name]
    if name in ("publish", "Publication", "PublishReport"):
        from . import _live

        for n in ("publish", "Publication", "PublishReport"):
            globals()[n] = getattr(_live, n)
        return globals()[name]
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_ASYNC_SAVE_NAMES) | {"publish", "Publication", "PublishReport"})

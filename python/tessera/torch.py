"""tessera as a ``torch.distributed.checkpoint`` storage reader.

Code that loads with DCP switches to tessera by one argument::

    import torch.distributed.checkpoint as dcp
    import tessera.torch

    dcp.load(state_dict, storage_reader=tessera.torch.StorageReader("s3://ckpts/run1/step-1000"))

The checkpoint may be a native tessera checkpoint, a DCP directory (read in place, no conversion)
or safetensors (one file or HF-sharded), on a local path or an object store. DCP keeps doing what
it does (planning which saved chunks each rank's tensors overlap, resharding, non-tensor values);
tessera does the reading: only the byte ranges each read item asks for, checksum-verified.

This module imports torch; ``import tessera`` alone never does.
"""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import json

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

import tessera as _api

from . import _objects, _tessera
from ._tessera import TesseraError

__all__ = ["StorageReader"]

# tessera's dtype names (metadata/src/dtype.rs) -> torch's. A dtype torch does not have is left
# out: such a tensor is reported to DCP only if asked for, with an error naming it.
_TORCH_DTYPES = {
    "bool": "bool",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8_e4m3fn": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
    "f8_e4m3fnuz": "float8_e4m3fnuz",
    "f8_e5m2fnuz": "float8_e5m2fnuz",
}


def _torch_dtype(fqn: str, name: str) -> torch.dtype:
    dtype = getattr(torch, _TORCH_DTYPES.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise TesseraError(
            f"tensor {fqn}: dtype {name} has no torch equivalent in torch {torch.__version__}"
        )
    return dtype


class StorageReader(dcp.StorageReader):
    """Reads a checkpoint for ``torch.distributed.checkpoint.load`` through tessera.

    Args:
        path_or_url: a local path or a ``file://``, ``s3://``, ``gs://``, ``az://``,
            ``http(s)://`` URL of a native, DCP or safetensors checkpoint.
        storage_options: credentials and endpoints (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT``, ...)
            on top of the environment, as for :func:`tessera.load`.
        verify: check tensor bytes against the checksums the checkpoint records (native
            checkpoints: block checksums and per-box crc32c). Non-tensor objects are always
            checked against their crc32c where the format records one.
        registry: for ``live://NAME`` and ``live://NAME@STEP`` (a live publication, see
            :func:`tessera.publish`): the registry directory. Every rank resolves the step when
            DCP asks for the metadata; the coordinator's step is the one every rank then reads
            (handed on in the global plan's ``storage_data``), held by a lease while it reads;
            ``reader.step`` says which.

    What it does:

    * ``read_metadata`` opens the checkpoint once per reader (tessera's metadata: manifest or
      ``.metadata``, safetensors headers) and describes it as DCP ``Metadata``: every tensor with
      its dtype and one ``ChunkStorageMetadata`` per saved box, every non-tensor object as
      ``BytesStorageMetadata``. DCP's own planner then matches the state dict against it, as it
      would with ``FileSystemReader``: same keys, same resharding, same ``strict`` behaviour.
    * ``read_data`` reads, in one tessera call, exactly the bytes of this rank's read items: a
      sub-box of a saved chunk is a partial read (``FileSystemReader`` reads and unpickles the
      whole chunk), coalesced and concurrent, verified. Where the planner's destination is a
      contiguous CPU tensor of the checkpoint's dtype, the bytes land in it directly; otherwise
      in a staging tensor that is then copied (and cast, as DCP casts) into the destination.
    * Non-tensor entries: a DCP checkpoint's pickled objects are handed to
      ``planner.load_bytes`` unchanged (so they come back as with ``FileSystemReader``); a
      native checkpoint's objects come back as the ``bytes`` that ``tessera.save`` stored.

    What it does not do: share reads between ranks. DCP's protocol gives a reader no channel
    between ranks during ``read_data`` (only the plan all-gather before it), so a tensor
    replicated on several ranks is read by each of them; ``prepare_global_plan`` cannot turn
    that into one read plus a transfer without collectives DCP does not sequence. Each rank
    still reads only the bytes of its own items. :func:`tessera.load` with ``exchange=True``
    reads every shared byte once and passes it on.
    """

    def __init__(
        self,
        path_or_url: Union[str, os.PathLike],
        *,
        storage_options: Optional[Mapping[str, str]] = None,
        verify: bool = True,
        registry: Union[str, os.PathLike, None] = None,
    ) -> None:
        super().__init__()
        self.path = _location(path_or_url)
        self.registry = registry
        #: The step of a live publication this reader read (None for checkpoints).
        self.step: Optional[int] = None
        # A live:// URL's resolved location (live+file://...), else None: what _open opens.
        self._live_at: Optional[str] = None
        self.storage_options = dict(storage_options or {})
        self.verify = bool(verify)
        self.rank: Optional[int] = None
        # The last read_data's tessera report (bytes needed, read and fetched, requests, seconds
        # per phase), for a job that wants to log what its load cost; None before any read.
        self.report: Optional[Dict[str, Any]] = None
        self.load_id = str(uuid.uuid4())
        self._opened: Optional[_tessera.OpenedCheckpoint] = None
        self._tensors: Optional[Dict[str, Tuple[torch.dtype, List[int]]]] = None

    @property
    def checkpoint_id(self) -> str:
        """The path or URL this reader reads."""
        return self.path

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        """Starts a new read; with a ``checkpoint_id``, of that checkpoint. The opened checkpoint
        is kept while the id stays the same: committed checkpoints do not change."""
        self.load_id = str(uuid.uuid4())
        if checkpoint_id is not None:
            location = _location(checkpoint_id)
            if location != self.path:
                self.path = location
                self._opened = None
                self._tensors = None
                self._live_at = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """True for local paths and the URL schemes tessera opens (it does not touch storage:
        whether a checkpoint is there is for ``read_metadata`` to say)."""
        try:
            location = _location(checkpoint_id)
        except TypeError:
            return False
        if "://" not in location:
            return location != ""
        return location.split("://", 1)[0].lower() in _SCHEMES | {"live"}

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        """The checkpoint as DCP ``Metadata`` (see the class docs).

        Takes no ``rank``: tessera reads a checkpoint's global metadata (DCP's per-rank
        ``__<rank>.metadata`` of ``use_collectives=False`` saves is not a checkpoint tessera
        opens), and leaving the keyword out tells DCP not to retry with it.
        """
        if self.path.startswith("live://") and self._live_at is None:
            from . import _live

            self.step, self._live_at = _live.resolve(self.path, self.registry)
        opened = self._open()
        tensors = json.loads(opened.chunks())
        state: Dict[str, Any] = {}
        described: Dict[str, Tuple[torch.dtype, List[int]]] = {}
        for fqn, t in tensors.items():
            dtype = _torch_dtype(fqn, t["dtype"])
            described[fqn] = (dtype, [int(d) for d in t["shape"]])
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(t["shape"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(l))
                    for o, l in t["chunks"]
                ],
            )
        for key in json.loads(opened.entries())["objects"]:
            state[key] = BytesStorageMetadata()
        self._tensors = described
        # What DCP itself recorded (a DCP checkpoint): the nested path of every flattened key,
        # which `_load_state_dict_from_keys` and `dcp_to_torch_save` unflatten with, and the
        # metadata version.
        record = json.loads(opened.dcp_record()) or {}
        planner_data = {key: tuple(path) for key, path in record.get("planner_data", {}).items()}
        return Metadata(
            state_dict_metadata=state,
            planner_data=planner_data or None,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
            version=record.get("version"),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged: the read items already say which box of which chunk each tensor needs."""
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """Unchanged (see the class docs for why reads are not shared between ranks here), but
        for a live publication: the coordinator's step goes to every rank, which reads that one
        (the newest step may have moved between two ranks' ``read_metadata``)."""
        if self._live_at is None:
            return plans
        import dataclasses

        return [dataclasses.replace(p, storage_data={"live": self._live_at}) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Loads every tensor item of ``plan`` in one tessera call, then its non-tensor items
        (see the class docs). Returns a completed future, as ``FileSystemReader`` does."""
        chosen = plan.storage_data.get("live") if isinstance(plan.storage_data, dict) else None
        if chosen is not None and chosen != self._live_at:
            self._live_at, self._opened, self._tensors = chosen, None, None
            self.step = int(os.path.basename(chosen).rsplit("-", 1)[-1])
        if self._live_at is None:
            return self._read_data(plan, planner)
        from . import _live

        with _live.Lease(self._live_at, _NO_PEERS_TIMEOUT_S):
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        opened = self._open()
        if self._tensors is None:
            self.read_metadata()  # DCP always calls it first; a caller driving the reader may not
        tensors = self._tensors or {}
        regions = [
            self._region(tensors, item, planner)
            for item in plan.items
            if item.type != LoadItemType.BYTE_IO
        ]
        self._stage_where_needed(regions)
        targets = [r.target() for r in regions if r.into.numel() > 0]
        self.report = None
        if targets:
            # Each rank plans alone (rank 0 of 1): DCP gives no rendezvous to exchange over, so
            # the timeout (which bounds waiting on peers) never applies.
            request = _api._typed(
                _tessera.LoadRequest, verify=bool(self.verify), timeout_s=_NO_PEERS_TIMEOUT_S
            )
            report = _tessera.load_into(opened, targets, request)
            self.report = json.loads(report)
            _api._warn_unverified(self.path, bool(self.verify), int(self.report.get("bytes_unverified", 0)))
        for r in regions:
            if r.into is not r.dest:
                r.dest.copy_(r.into)  # DCP's own copy: casts, and moves to the device
            planner.commit_tensor(r.item, r.dest)

        byte_items = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if byte_items:
            keys = [item.storage_index.fqn for item in byte_items]
            for item, data in zip(byte_items, opened.read_objects(keys)):
                planner.load_bytes(item, self._object_stream(opened, item.storage_index.fqn, data))

        future: Future = Future()
        future.set_result(None)
        return future

    def _region(
        self, tensors: Dict[str, Tuple[torch.dtype, List[int]]], item: ReadItem, planner: LoadPlanner
    ) -> "_Region":
        """The global box a tensor read item asks for, and the planner's destination for it."""
        fqn = item.storage_index.fqn
        known = tensors.get(fqn)
        if known is None:
            raise TesseraError(
                f"tensor {fqn!r} is not in checkpoint {self.path} ({len(tensors)} tensors)"
            )
        chunk = item.storage_index.offset
        if chunk is None:
            raise TesseraError(
                f"tensor {fqn}: the read item names no saved chunk (checkpoint {self.path})"
            )
        offsets = [int(c) + int(s) for c, s in zip(chunk, item.storage_offsets)]
        lengths = [int(n) for n in item.lengths]
        dest = planner.resolve_tensor(item).detach()
        if list(dest.shape) != lengths:
            raise TesseraError(
                f"tensor {fqn}: the planner's destination has shape {list(dest.shape)} but the "
                f"read item asks for {lengths} at {offsets} (checkpoint {self.path})"
            )
        return _Region(item, fqn, known[0], offsets, lengths, dest, dest)

    @staticmethod
    def _stage_where_needed(regions: List["_Region"]) -> None:
        """Points each region's ``into`` at a fresh staging tensor unless its destination can take
        the bytes as they are: a plain, contiguous CPU tensor of the checkpoint's dtype whose
        memory no other region's destination shares."""
        direct = []
        for r in regions:
            d = r.dest
            if (
                type(d) is torch.Tensor  # a subclass's data_ptr need not be its elements
                and d.device.type == "cpu"
                and d.dtype == r.dtype
                and d.is_contiguous()
            ):
                direct.append(r)
            else:
                r.into = torch.empty(r.lengths, dtype=r.dtype)
        # Destinations that share memory (a planner may hand out overlapping views) would race
        # in one load: each later one of an overlap gets its own buffer.
        direct.sort(key=lambda r: r.dest.data_ptr())
        end = 0
        for r in direct:
            if r.dest.numel() == 0:
                continue
            start = r.dest.data_ptr()
            if start < end:
                r.into = torch.empty(r.lengths, dtype=r.dtype)
            else:
                end = start + r.dest.numel() * r.dest.element_size()

    def _object_stream(self, opened: Any, key: str, data: bytes) -> io.BytesIO:
        """What ``planner.load_bytes`` (which ``torch.load``s it) needs for one stored object."""
        if opened.format == "dcp":
            # DCP stored the object with torch.save: hand over its bytes as FileSystemReader does.
            return io.BytesIO(data)
        if opened.format == "native":
            # Converted from DCP: a torch.save archive, as it was. Saved by tessera.save: a plain-
            # value pickle, or a bytes value stored as it is; DCP gets the value torch.save'd.
            if _objects.is_torch_archive(data):
                return io.BytesIO(data)
            try:
                value: Any = _objects.decode(key, data, None, allow_pickle=False)
            except ValueError:
                value = bytes(data)
            stream = io.BytesIO()
            torch.save(value, stream)
            stream.seek(0)
            return stream
        raise TesseraError(
            f"object {key} of {opened.format} checkpoint {self.path}: tessera reads it as part of "
            "a larger pickle, not as a value DCP can load; load this checkpoint with tessera.load"
        )

    def _open(self) -> Any:
        if self._opened is None:
            from . import _open

            self._opened = _open(self._live_at or self.path, self.storage_options)
        return self._opened


_NO_PEERS_TIMEOUT_S = 300.0


@dataclass
class _Region:
    """One tensor read item: the global box it asks for, the planner's destination, and the
    tensor tessera loads into (the destination itself, or a staging tensor copied into it)."""

    item: ReadItem
    fqn: str
    dtype: torch.dtype
    offsets: List[int]
    lengths: List[int]
    dest: torch.Tensor
    into: torch.Tensor

    def target(self) -> _tessera.LoadTarget:
        """The native module's typed record of this region (see ``tessera._state.load_target``):
        host memory, always (``_stage_where_needed`` stages the rest)."""
        return _tessera.LoadTarget(
            fqn=self.fqn,
            dtype=str(self.into.dtype).replace("torch.", ""),
            shape=self.lengths,
            offsets=self.offsets,
            address=int(self.into.data_ptr()),
            nbytes=int(self.into.numel() * self.into.element_size()),
        )

# URL schemes tessera-storage opens (storage/src): everything else is a local path.
_SCHEMES = {"file", "s3", "gs", "az", "http", "https"}


def _location(value: Union[str, os.PathLike]) -> str:
    if isinstance(value, (str, os.PathLike)):
        return str(os.fspath(value))
    raise TypeError(f"a checkpoint is a path or URL string, not {type(value).__name__}")

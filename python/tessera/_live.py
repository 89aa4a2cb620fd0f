"""Live publications: a running job's state served from its own processes and loaded by other
jobs in any layout (``tessera.publish`` and ``tessera.load(..., "live://NAME")``).

Publisher side (every rank of the publishing job)::

    pub = tessera.publish(state, "policy", step=step, registry="/shared/registry")
    # the call returns once the state is copied (async_save's eager snapshot); the rest runs in
    # the background: this rank lays its boxes out as a native data file in memory, serves it
    # over HTTP from this process, and writes its part into the registry; rank 0 commits the step
    # (metadata, checksums recorded at snapshot time, manifest last) once every rank's part is
    # there.

Consumer side (any layout, any world size, alone or over its own process group)::

    report = tessera.load(state, "live://policy", registry="/shared/registry")
    report.step   # the newest complete step; "live://policy@42" asks for step 42

Registry layout and the step's format: ``tessera_ops::publish`` (Rust). A step is a native
checkpoint whose data files stay in the publishers' memory; the consumer opens it as
``live+file://<registry>/<name>/step-<N>`` and loads it with the ordinary plan, verified reads
(block crc32c and each box's crc32c, recorded by the publisher at snapshot time) and exchange.

**Keeping steps.** Each process serves the newest ``keep`` steps of a name it published. An older
step is retired at the next ``publish`` of that name unless a consumer holds a lease on it: a
load writes ``<step>/leases/<id>.json`` (its deadline: the load's ``timeout``, at most
:data:`MAX_LEASE_SECONDS`) before it opens the step and removes it when done; the publisher keeps
a leased step until the lease is gone or past its deadline, and checks again at each later
``publish``. Retiring removes the step's manifest (rank 0), so new loads no longer pick it, and
stops serving its bytes; rank 0 also removes the directories of the publication's retired steps
beyond the newest eight (``RETIRED_STEPS_KEPT``) that no lease holds; a load that still reads it fails naming the publisher rank (404), never
with wrong values.

**Durable fallback.** ``publish(..., durable=path)`` names a checkpoint of the same step on
storage (``<step>/durable.json``). A load that finds a publisher rank dead or not answering
loads the step from it instead, once it is committed and holds that step (:func:`fallback`;
over a consuming process group rank 0 decides for every rank); the whole load again, never
bytes of both sources.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import tessera as _api

from . import _async_save, _group, _state, _tessera
from ._tessera import TesseraError

#: The URL scheme of live publications.
SCHEME = "live://"
#: The longest a consumer's lease keeps a superseded step served, whatever its timeout says: a
#: consumer that died holding a lease costs the publisher this much memory time, no more
#: (``tessera_ops::publish::lease``, which writes and reads leases for every front end).
MAX_LEASE_SECONDS = _tessera.MAX_LEASE_SECONDS
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"publication name {name!r}: use 1 to 200 ASCII letters, digits, '_', '.' or '-', starting with a "
            "letter or digit"
        )
    return name


def _registry_dir(registry: Any) -> str:
    if registry is None:
        raise ValueError(
            "live:// publications need registry=: the directory both the publishing and the consuming job see"
        )
    path = os.fspath(registry)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"registry={registry!r}: name a directory")
    return os.path.abspath(path)


def step_dir(registry: str, name: str, step: int) -> str:
    return os.path.join(registry, name, f"step-{int(step):06d}")


@dataclass
class PublishReport(_api._Report):
    """What one rank's :func:`publish` did."""

    name: str = ""
    step: int = 0
    rank: int = 0
    world_size: int = 1
    #: Where this rank serves its data file (origin and path).
    url: str = ""
    path: str = ""
    #: Bytes of this rank's served data file (boxes aligned as the native format lays them).
    bytes: int = 0
    #: The file is in shared memory that consumers on this host read directly
    #: (``share_memory=True`` and a kernel that offers it); False: HTTP only.
    shared: bool = False
    #: The file was laid out in the shared memory of a step this process retired (its pages
    #: already faulted in; this process keeps up to two retired steps' memory for that).
    reused_memory: bool = False
    #: Rank 0: the committed step's manifest (None on other ranks).
    manifest: Optional[Dict[str, Any]] = None
    #: Seconds the call blocked (the eager copy) and the background part (layout, serve, commit).
    blocked_seconds: float = 0.0
    persist_seconds: float = 0.0
    #: Older steps this call retired, and ones kept past ``keep`` because a consumer leases them.
    retired: List[int] = field(default_factory=list)
    leased: List[int] = field(default_factory=list)


class Publication:
    """One step of a live publication on this rank: ``result()`` waits until this rank's part is
    served (rank 0: until the step is committed) and gives the :class:`PublishReport`;
    ``retire()`` stops serving it."""

    def __init__(self, name: str, step: int, registry: str, rank: int, world_size: int) -> None:
        #: The snapshot's handle, set once async_save returned (the persist may run before).
        self._handle: Any = None
        self.name = name
        self.step = step
        self.registry = registry
        self.rank = rank
        self.world_size = world_size
        self._path: Optional[str] = None
        self._retired = False

    def __repr__(self) -> str:
        return f"Publication({self.name}@{self.step}, rank {self.rank} of {self.world_size})"

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        self._handle.wait_snapshot(timeout)

    def done(self) -> bool:
        return self._handle.done()

    def result(self, timeout: Optional[float] = None) -> PublishReport:
        return self._handle.result(timeout)

    def retire(self) -> None:
        """Stops serving this step from this rank (rank 0 also removes its manifest first, so no
        new load picks it). Idempotent."""
        self._handle.wait(None)
        with _LOCK:
            _retire(self)
            steps = _SERVED.get((self.registry, self.name), [])
            if self in steps:
                steps.remove(self)


_LOCK = threading.Lock()
#: The steps this process serves, per (registry, name), oldest first.
_SERVED: Dict[Tuple[str, str], List[Publication]] = {}


def _retire(pub: Publication) -> None:
    if pub._retired:
        return
    directory = step_dir(pub.registry, pub.name, pub.step)
    if pub.rank == 0:
        # The manifest goes (no new load picks the step), and so do the directories of this
        # publication's older retired steps beyond the newest few (tessera_ops::publish::retire):
        # a registry does not grow with every step ever published.
        _tessera.retire_step(directory)
    if pub._path is not None:
        # Its memory is reused for a later step only when no consumer's lease runs on it (an
        # explicit retire() does not wait for leases): a consumer reading it keeps its bytes.
        _tessera.unpublish(pub._path, reuse_memory=not _tessera.step_leased(directory))
    pub._retired = True


def _supersede(key: Tuple[str, str], keep: int, report: PublishReport) -> None:
    """Retires this process's steps of ``key`` beyond the newest ``keep``, except leased ones."""
    with _LOCK:
        steps = _SERVED.get(key, [])
        steps.sort(key=lambda p: p.step)
        for pub in list(steps[: max(len(steps) - keep, 0)]):
            if _tessera.step_leased(step_dir(pub.registry, pub.name, pub.step)):
                report.leased.append(pub.step)
                continue
            _retire(pub)
            steps.remove(pub)
            report.retired.append(pub.step)


def publish(
    state_dict: Mapping[str, Any],
    name: str,
    *,
    step: int,
    registry: Any,
    process_group: Any = None,
    keep: int = 2,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    host: Optional[str] = None,
    pool: Optional[_async_save.StagingPool] = None,
    pool_bytes: Optional[int] = None,
    timeout: float = 300.0,
    durable: Any = None,
    share_memory: bool = True,
) -> Publication:
    """Publishes ``state_dict`` as step ``step`` of the live publication ``name`` in ``registry``.

    Every rank of the publishing job calls it (ranks and world from ``process_group``, the
    default group, or ``rank``/``world_size``; the group itself is never used: ranks meet only
    through the registry). The call copies the state into the staging pool (async_save's eager
    snapshot: no stall beyond the copy) and returns; in the background this rank lays its boxes
    out as a native data file in memory, serves it over HTTP from this process on ``host``
    (default ``127.0.0.1``; give the address consumers on other hosts reach) on an ephemeral port,
    and writes its part into the registry. Rank 0 commits the step once every rank's part is
    there (waiting up to ``timeout``), and only then can it be loaded: ``tessera.load(state,
    "live://NAME", registry=...)``. A box several ranks hold is served once (by the lowest rank).

    The newest ``keep`` steps stay served; older ones are retired at the next call unless a
    consumer still reads them (its lease; see the module doc). ``pub.retire()`` retires one now.

    ``durable``: a checkpoint of this same step that the job saves to storage (a path or URL,
    e.g. the ``checkpoint_id`` of its ``tessera.async_save(state, path, step=step)``), recorded
    in the step's registry entry (``durable.json``). A consumer whose load finds a publisher
    rank dead or unreachable loads the step from it instead, once it is committed and holds
    this step (see :func:`fallback`). The publication only names it: the save keeps its own
    schedule, storage and ranks' rendezvous, and the publisher's stall stays the eager copy.

    ``share_memory`` (default on, Linux): the data file is held in shared memory (a ``memfd``,
    freed with this process) that consumers on this host open through ``/proc/<pid>/fd`` and read
    by position straight into their tensors, instead of over HTTP; consumers elsewhere, or where
    the kernel refuses (another pid namespace, ptrace rules), read over HTTP as before. A consumer
    keeps what it opened until its load ends, so a publisher that retires the step or dies
    meanwhile does not fail it; its bytes are verified against the snapshot's checksums either
    way. ``report.bytes_from_publisher_memory`` says what a load read this way.
    """
    name = _check_name(name)
    registry_dir = _registry_dir(registry)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: a non-negative integer")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least the step just published")
    group = _group.default_group(process_group, None)
    if group is not None:
        import torch.distributed as dist

        if rank is not None or world_size is not None:
            raise ValueError("rank and world_size come from the process group; do not pass them with one")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    rank, world_size = _api._ranks(rank, world_size)
    directory = step_dir(registry_dir, name, step)
    if os.path.exists(os.path.join(directory, "parts", f"rank-{rank}.json")):
        raise TesseraError(f"rank {rank}: step {step} of {name} is already published in {registry_dir}")
    os.makedirs(directory, exist_ok=True)
    if durable is not None and rank == 0:
        # Before this rank's part, so before the manifest: a complete step names its fallback.
        _write_durable(directory, name, step, durable)
    key = (registry_dir, name)
    request = _api._typed(
        _tessera.PublishRequest, name=name, step=int(step), rank=int(rank), world=int(world_size),
        host=host or "127.0.0.1", share_memory=bool(share_memory),
    )
    pub = Publication(name, step, registry_dir, rank, world_size)

    def persist(handle: Any, boxes: list, objects: list, started: float) -> PublishReport:
        # Non-tensor values once, from rank 0: every rank has them, a step lists each key once.
        served = json.loads(_tessera.publish_part(directory, boxes, objects if rank == 0 else [], request))
        pub._path = served["path"]
        report = PublishReport(
            name=name, step=step, rank=rank, world_size=world_size, url=served["url"], path=served["path"],
            bytes=served["bytes"], shared=served["shared"], reused_memory=served["reused_memory"],
            blocked_seconds=handle.blocked_seconds,
        )
        with _LOCK:
            _SERVED.setdefault(key, []).append(pub)
        if rank == 0:
            report.manifest = json.loads(_tessera.commit_publication(directory, world_size, step, float(timeout)))
        _supersede(key, keep, report)
        report.persist_seconds = time.monotonic() - started
        return report

    ranks: Dict[str, Any] = {"process_group": group} if group is not None else {"rank": rank, "world_size": world_size}
    handle = _async_save.async_save(
        state_dict, directory, pool=pool, pool_bytes=pool_bytes, timeout=timeout, snapshot="eager",
        _persist=persist, **ranks,
    )
    pub._handle = handle
    return pub


#: The file of a step that names a durable checkpoint of the same step (``publish(durable=)``).
DURABLE_FILE = "durable.json"


def _durable_location(durable: Any) -> str:
    location = os.fspath(durable)
    if not isinstance(location, str) or not location.strip():
        raise ValueError(f"durable={durable!r}: name the checkpoint's path or URL")
    # A local path as an absolute one: the consumer runs elsewhere; a URL as given.
    return location if "://" in location else os.path.abspath(location)


def _write_durable(directory: str, name: str, step: int, durable: Any) -> None:
    path = os.path.join(directory, DURABLE_FILE)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as f:
        json.dump({"name": name, "step": int(step), "checkpoint": _durable_location(durable)}, f)
    os.replace(temp, path)


# ---- consumer side -------------------------------------------------------------------------


def _parse(url: str) -> Tuple[str, Optional[int]]:
    rest = url[len(SCHEME):]
    name, _, step = rest.partition("@")
    _check_name(name)
    if not step:
        return name, None
    if not step.isdigit():
        raise ValueError(f"{url}: the step after '@' must be a number (live://NAME@STEP)")
    return name, int(step)


def resolve(url: str, registry: Any) -> Tuple[int, str]:
    """The step ``url`` (``live://NAME`` or ``live://NAME@STEP``) names in ``registry`` and its
    location (``live+file://...``); raises naming what is missing when it is not complete. The
    rule is the registry listing's (``tessera live show``, the server's ``/v1/live``), written
    once in Rust."""
    name, step = _parse(url)
    root = _registry_dir(registry)
    try:
        found, directory = _tessera.resolve_live(root, name, step)
    except TesseraError as e:
        raise TesseraError(f"{url}: {e}") from None
    return int(found), "live+file://" + directory


class Lease:
    """A consumer's claim that it reads a step: the publisher keeps serving it until released or
    past its deadline (see the module doc; the format is ``tessera_ops::publish::lease``'s). A
    context manager."""

    def __init__(self, location: str, seconds: float) -> None:
        directory = location[len("live+file://"):]
        self._lease: Optional[Any] = None
        try:
            self._lease = _tessera.StepLease(directory, float(seconds))
        except OSError as e:
            # A registry this job may only read: the load goes on unprotected. Should the
            # publisher retire the step meanwhile, a read fails naming the publisher (404),
            # never with wrong values.
            import warnings

            warnings.warn(
                f"{e}: the publisher may retire the step while this load reads it",
                stacklevel=3,
            )

    @property
    def path(self) -> Optional[str]:
        """The lease file, while held."""
        return None if self._lease is None else self._lease.path

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def resolve_for_load(url: str, registry: Any, group: Any) -> Tuple[int, str]:
    """:func:`resolve` once for the whole consuming job: over ``group`` rank 0 resolves (the
    newest step could change between two ranks' looks) and every rank gets its answer, or its
    error."""
    if group is None:
        return resolve(url, registry)
    import torch.distributed as dist

    answer: List[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            answer[0] = ("ok",) + resolve(url, registry)
        except (TesseraError, ValueError) as e:
            answer[0] = ("error", type(e).__name__, str(e))
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast_object_list(answer, src=src, group=group)
    got = answer[0]
    if got[0] == "error":
        raise (ValueError if got[1] == "ValueError" else TesseraError)(f"{got[2]} (as coordinator rank 0 found it)")
    return int(got[1]), str(got[2])


#: What this process last loaded from each publication, for ``load(..., delta=True)``:
#: (registry, name) -> (the step, {state key: (its tensor's fingerprint, its saved boxes with
#: their checksums in that step)}).
_HELD: Dict[Tuple[str, str], Tuple[int, Dict[str, Tuple[Any, Any]]]] = {}


def _local(tensor: Any) -> Any:
    """This rank's tensor of a (D)Tensor: its local shard, or itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fingerprint(value: Any) -> Any:
    """What makes a state-dict value the same tensor with the same bytes as before, as far as
    torch can tell: its storage, shape, strides, dtype, placement and version counter (bumped by
    every in-place write through torch). None for values that are not (tensor) entries."""
    tensor, extra = value, ""
    if isinstance(value, tuple) and value and _state.is_torch_tensor(value[0]):
        tensor, extra = value[0], repr(value[1:])
    if not _state.is_torch_tensor(tensor):
        return None
    local = _local(tensor)
    return (
        local.data_ptr(), local._version, tuple(local.shape), tuple(local.stride()), str(local.dtype),
        repr(getattr(tensor, "placements", None)), extra,
    )


def forget(state_dict: Mapping[str, Any]) -> None:
    """Drops what delta loads recorded of the tensors of ``state_dict`` (by storage address): a
    load is about to write them."""
    written = set()
    for value in state_dict.values():
        fingerprint = _fingerprint(value)
        if fingerprint is not None:
            written.add(fingerprint[0])
    for key, (step, records) in list(_HELD.items()):
        kept = {k: r for k, r in records.items() if r[0][0] not in written}
        _HELD[key] = (step, kept)


class Delta:
    """One ``delta=True`` load of ``live://`` (see :func:`tessera.load`): the step the whole job
    loads (resolved once, as every live load is), the state-dict entries whose tensors still hold
    what this process last loaded into them and whose saved boxes did not change since, and,
    after the load, what the tensors hold now."""

    def __init__(self, registry: Any, url: str, rename: Any, group: Any) -> None:
        name, _ = _parse(url)
        self._key = (_registry_dir(registry), name)
        self._fqn = _state.renamer(rename)
        self.step, self._location = resolve_for_load(url, registry, group)
        #: The URL of exactly that step, for the load itself (a newer step committed meanwhile
        #: must not be loaded against this step's comparison).
        self.url = f"{SCHEME}{name}@{self.step}"
        self._signatures: Dict[str, Any] = {}
        self.unchanged: List[str] = []
        self.held_step: Optional[int] = None
        self.bytes_unchanged = 0

    def changed_entries(self, state_dict: Mapping[str, Any], storage_options: Any) -> List[str]:
        """The keys of ``state_dict`` to load: all but the unchanged ones."""
        keys = list(state_dict)
        fqns = [self._fqn(k) for k in keys]
        digests = _api._open(self._location, storage_options).box_digests(fqns)
        self._signatures = {fqn: d for fqn, d in zip(fqns, digests) if d is not None}
        held = _HELD.get(self._key)
        if held is not None:
            self.held_step = held[0]
        records = held[1] if held is not None else {}
        changed = []
        for key, value in state_dict.items():
            record = records.get(key)
            now = _fingerprint(value)
            signature = self._signatures.get(self._fqn(key))
            if record is not None and now is not None and signature is not None and record == (now, signature):
                self.unchanged.append(key)
                local = _local(value[0] if isinstance(value, tuple) else value)
                self.bytes_unchanged += local.numel() * local.element_size()
            else:
                changed.append(key)
        return changed

    def loaded(self, state_dict: Mapping[str, Any], report: Any) -> None:
        """Records what the tensors of ``state_dict`` hold now (this step) and fills the
        report's delta fields."""
        records = {}
        for key, value in state_dict.items():
            now = _fingerprint(value)
            signature = self._signatures.get(self._fqn(key))
            if now is not None and signature is not None:
                records[key] = (now, signature)
        _HELD[self._key] = (self.step, records)
        report.delta_from = self.held_step
        report.unchanged_keys = list(self.unchanged)
        report.bytes_unchanged = self.bytes_unchanged


#: How a live load's error names a publisher rank it could not read from (storage's LiveStore).
_PUBLISHER_FAILED = re.compile(r"publisher rank (\d+) at (\S+?):? ")


def _named_durable(location: str, step: int) -> Optional[str]:
    """The durable checkpoint the step at ``location`` names, if any."""
    directory = location[len("live+file://"):]
    try:
        with open(os.path.join(directory, DURABLE_FILE), encoding="utf-8") as f:
            entry = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise TesseraError(f"step {step} at {directory}: its {DURABLE_FILE} is unreadable: {e}") from None
    checkpoint = entry.get("checkpoint") if isinstance(entry, dict) else None
    if not isinstance(checkpoint, str) or entry.get("step") != step:
        raise TesseraError(f"step {step} at {directory}: its {DURABLE_FILE} names no checkpoint of step {step}: {entry!r}")
    return checkpoint


def fallback(url: str, step: int, location: str, error: BaseException, storage_options: Any = None) -> Optional[Tuple[str, str]]:
    """What a live load of ``step`` (at ``location``) that failed with ``error`` does next:
    ``None`` when the error names no publisher rank or the step names no durable checkpoint
    (the error stands); ``(checkpoint, why)`` to load the same step from its durable checkpoint
    (the whole load again: bytes of two sources are never mixed), ``why`` naming the publisher
    rank. Raises naming the dead publisher rank and the durable checkpoint when that one is not
    committed yet or holds another step."""
    text = str(error)
    failed = _PUBLISHER_FAILED.search(text)
    if failed is None:
        return None
    checkpoint = _named_durable(location, step)
    if checkpoint is None:
        return None
    rank, at = failed.group(1), failed.group(2)
    why = f"publisher rank {rank} at {at} failed during the load of {url} (step {step})"
    try:
        found = _api.inspect(checkpoint, storage_options=storage_options)
    except (TesseraError, ValueError, OSError) as e:
        raise TesseraError(
            f"{why}, and its durable checkpoint {checkpoint} is not committed (or not readable): {e}; "
            f"the load failed with: {text}"
        ) from error
    if found.get("step") != step:
        raise TesseraError(
            f"{why}, and its durable checkpoint {checkpoint} holds step {found.get('step')}, not {step}; "
            f"the load failed with: {text}"
        ) from error
    return checkpoint, f"{why}: loaded step {step} from its durable checkpoint {checkpoint}"


def fallback_for_load(
    url: str, step: int, location: str, error: BaseException, group: Any, storage_options: Any = None
) -> Optional[Tuple[str, str]]:
    """:func:`fallback` once for the whole consuming job: over ``group`` rank 0 decides (the
    durable checkpoint may be committed between two ranks' looks) and every rank follows,
    falling back together or failing with rank 0's reason."""
    if group is None:
        return fallback(url, step, location, error, storage_options)
    import torch.distributed as dist

    answer: List[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            found = fallback(url, step, location, error, storage_options)
            answer[0] = ("none",) if found is None else ("durable",) + found
        except TesseraError as e:
            answer[0] = ("error", str(e))
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast_object_list(answer, src=src, group=group)
    got = answer[0]
    if got[0] == "error":
        raise TesseraError(f"{got[1]} (as coordinator rank 0 found it)") from error
    if got[0] == "none":
        return None
    return str(got[1]), str(got[2])


__all__ = ["Publication", "PublishReport", "publish", "resolve", "fallback", "SCHEME", "MAX_LEASE_SECONDS", "DURABLE_FILE"]

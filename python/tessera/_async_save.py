"""Two-phase save: a fast *snapshot* of the state into host memory, then a background *persist*
through the native save-and-commit protocol, committed atomically by rank 0 (manifest last).

How the snapshot is taken (``snapshot=``):

- ``"eager"`` (default): the call copies every tensor into the staging pool and returns; the job
  may change its tensors right after it::

      handle = tessera.async_save(state, f"{root}/step-{step}")
      optimizer.step()                   # fine: the snapshot is taken
      ...
      handle.result()                    # SaveReport once committed, or the error

- ``"lazy"`` (DataStates-LLM): parameters and optimizer state do not change between one optimizer
  step and the next, so the copies run while the job computes forward and backward, and only the
  next step waits for them (a step pre-hook of ``optimizer=``; or the job calls
  ``handle.wait_snapshot()`` before changing anything)::

      handle = tessera.async_save(state, path, snapshot="lazy", optimizer=optimizer)
      loss.backward()                    # the copies run meanwhile
      optimizer.step()                   # waits for them only if they are not done

  The copies are checked at a point where the job's own in-place kernels have ended: the
  ``optimizer=``'s next step, ``handle.wait_snapshot()``, ``handle.result()`` (``wait()``,
  ``exception()``), the next ``async_save``, or the end of the main thread; the persist waits
  for that check (up to ``timeout``, then the save fails). A tensor whose version counter moved
  between the call and that point fails the save (:class:`ChangedBeforeCopy`) and nothing is
  committed. The check is not taken right after each copy because torch bumps the counter only
  after an in-place kernel has written: a kernel still running then would be missed and a torn
  tensor committed. A change that ended before the check point fails the save even if its copy
  happened to be taken first: nothing tells which came first.

  What the version counter cannot see is not detected: writes through ``tensor.data`` (it has a
  counter of its own; ``detach()`` and views share the tensor's), ``.numpy()`` or DLPack views,
  ``untyped_storage()``, native extensions, and in-place kernels another thread runs while the
  check point is taken. A job that writes saved tensors so before the check point must use
  ``snapshot="eager"``.

- ``"multi_step"`` (GoCkpt, :mod:`tessera._multi_step`): the copy spread over ``steps`` optimizer
  steps, earlier parts brought forward by replaying the optimizer on the host.

**Staging pool.** Every tensor is copied into one host buffer, allocated once per process and
reused by every save (it grows to the largest state seen). Reuse matters: a fresh allocation per
save pays the page faults (or, pinned, the page locking) of the whole state each time, which is
often slower than the copy itself. The pool is pinned (page-locked) when the state has CUDA
tensors, so device-to-host copies run as asynchronous DMA on a side stream; the snapshot is done
when an event recorded after the last copy has completed. ``pool_bytes`` (or the environment
variable ``TESSERA_SAVE_POOL_BYTES``) bounds it: a state larger than the bound is refused at once
with an error naming both sizes (there is no streaming fallback: a bounded pool that the state
does not fit would have to hold training until the first part is persisted, which is the stall
this design removes).

**One save in flight.** The pool holds the snapshot until the persist has finished, so a second
``async_save`` in the same process first waits for the previous one's persist (its own handle
still reports its outcome). Saving every step with a persist slower than a step therefore blocks
the loop for the difference; the report's ``waited_seconds`` says how long.

**Persist and commit.** A background thread calls the native save (``tessera_ops::save``): rank 0
claims the directory, every rank writes its share (a box replicated on several ranks is written
once, by the holder worst-fit balancing picks), and rank 0 writes metadata, checksums and the
manifest last once every rank reported success, then moves ``<parent>/latest`` to the step
directory (``step-<N>`` names). A write that fails transiently is retried (``RetryPolicy``: a
request up to 5 times, a multipart data file again from the start); the report's
``write_retries`` counts them. A failure anywhere (a rank dies, storage fails) commits nothing
and leaves ``latest`` where it was; every surviving rank's handle raises the error, which names
the rank or file. The process waits for a persist in flight before it exits normally.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import tessera as _api

from . import _group, _objects, _state, _tessera
from ._state import Box, Flat
from ._tessera import TesseraError

#: How :func:`async_save` can take its snapshot.
SNAPSHOT_MODES = ("eager", "lazy", "multi_step")

#: The most optimizer steps a multi-step snapshot (``steps=k``) spreads its copy over. GoCkpt's
#: k is a handful (each part is at least one tensor, so beyond the number of parameters more
#: steps only add empty parts), while the call sets up bookkeeping for every step at once
#: (``steps=10**6`` took 1.3 GiB before any copy) and the checkpoint lags the call by k - 1
#: steps. 1024 leaves every sensible k and refuses a step count passed by mistake.
MAX_MULTI_STEPS = 1024

#: Environment variable bounding the default staging pool, in bytes.
POOL_BYTES_ENV = "TESSERA_SAVE_POOL_BYTES"

# Every box starts on a 4 KiB boundary of the pool: page-aligned sources for the writer (the data
# files are 4 KiB aligned too) and no box shares a cache line or page with the next one's copy.
_ALIGN = 4096


def _parse_bytes(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of bytes") from None
    if value < 0:
        raise ValueError(f"{name}={value} must not be negative")
    return value


class StagingPool:
    """Host memory the snapshots of :func:`async_save` are copied into, allocated once and reused.

    It grows to the largest state saved through it (never shrinks) up to ``max_bytes`` (``None``:
    no bound). It is pinned (page-locked, for asynchronous device-to-host copies) from the first
    save with CUDA tensors on. One process has one default pool (bounded by
    ``TESSERA_SAVE_POOL_BYTES``); pass another with ``async_save(..., pool=...)``.
    """

    def __init__(self, max_bytes: Optional[int] = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must not be negative")
        self.max_bytes = max_bytes
        self._array: Any = None  # numpy uint8 view of the whole pool
        self._tensor: Any = None  # the torch tensor owning pinned memory, when pinned
        #: How many times the pool was (re)allocated: 1 after the first save when it is reused.
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._array is None else int(self._array.nbytes)

    @property
    def pinned(self) -> bool:
        return self._tensor is not None

    def reserve(self, nbytes: int, *, pinned: bool, bound: Optional[int], what: str) -> None:
        """Makes the pool hold at least ``nbytes`` (pinned if asked), or raises naming the sizes."""
        limit = self.max_bytes if bound is None else bound
        if limit is not None and nbytes > limit:
            raise TesseraError(
                f"{what} needs {nbytes:,} bytes of staging memory but the save pool is bounded to "
                f"{limit:,} bytes (pool_bytes= or {POOL_BYTES_ENV}); raise the bound, or save "
                "fewer tensors per call"
            )
        if self._array is not None and self._array.nbytes >= nbytes and (self.pinned or not pinned):
            return
        # Growth rounds up by an eighth so that a state that grows a little (a new optimizer
        # buffer) does not reallocate at every save.
        size = max(nbytes + nbytes // 8, self.nbytes)
        if limit is not None:
            size = min(size, limit)
        self._array = self._tensor = None  # drop the old pool before allocating the new one
        if pinned:
            import torch

            self._tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._array = self._tensor.numpy()
        else:
            import numpy as np

            self._array = np.empty(size, dtype=np.uint8)
        self.allocations += 1

    def region(self, offset: int, nbytes: int, like: Any) -> Any:
        """A view of ``[offset, offset + nbytes)`` with ``like``'s dtype and shape (a torch tensor
        when ``like`` is one, else a NumPy array)."""
        shape = tuple(int(d) for d in like.shape)
        if _state.is_torch_tensor(like):
            import torch

            raw = self._tensor[offset : offset + nbytes] if self._tensor is not None else torch.from_numpy(
                self._array[offset : offset + nbytes]
            )
            return raw.view(like.dtype).view(shape)
        return self._array[offset : offset + nbytes].view(like.dtype).reshape(shape)


_DEFAULT_POOL: Optional[StagingPool] = None
_LOCK = threading.Lock()
_IN_FLIGHT: Optional["SaveHandle"] = None


def default_pool() -> StagingPool:
    """The process's staging pool (bounded by ``TESSERA_SAVE_POOL_BYTES`` when set)."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        env = os.environ.get(POOL_BYTES_ENV, "").strip()
        _DEFAULT_POOL = StagingPool(_parse_bytes(POOL_BYTES_ENV, env) if env else None)
    return _DEFAULT_POOL


@dataclass
class _Entry:
    fqn: str
    source: Any  # the job's tensor or array (host or CUDA), read by the snapshot
    dtype: str
    shape: List[int]  # the tensor's global shape
    offsets: List[int]
    lengths: List[int]
    nbytes: int
    pool_offset: int = 0
    #: The source's torch version counter at the call (None for NumPy arrays).
    version: Optional[int] = None


def _entries(state_dict: Mapping[str, Any]) -> Tuple[List[_Entry], List[Tuple[str, bytes]]]:
    """The boxes and encoded non-tensor values of a state dict; raises for what cannot be saved,
    before anything starts."""
    entries: List[_Entry] = []
    objects: List[Tuple[str, bytes]] = []
    for fqn, _path, value in _state.flatten(state_dict):
        if _state.is_dtensor(value):
            array, offsets, shape = _state.dtensor_box(fqn, value)
        elif (
            isinstance(value, tuple)
            and len(value) == 3
            and _state.is_array(value[0])
            and all(isinstance(v, (list, tuple)) for v in value[1:])
        ):
            array, offsets, shape = value[0], [int(o) for o in value[1]], [int(d) for d in value[2]]
        elif isinstance(value, (Box, Flat)) or (isinstance(value, tuple) and _state.is_tensor_entry(value)):
            raise TypeError(
                f"{fqn}: save needs the global shape of a partial tensor: pass "
                "(array, offsets, global_shape) or a DTensor"
            )
        elif _state.is_array(value):
            array, offsets, shape = value, None, None
        else:
            # Encoded now, in the caller's thread: a value the job changes right after the call
            # (a step counter) is saved as it was at the call.
            objects.append((fqn, _objects.encode(fqn, value)))
            continue
        if _state.is_torch_tensor(array):
            array = array.detach()
            if array.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{fqn}: tensor is on {array.device}; tessera saves host or CUDA tensors")
        elif not hasattr(array, "__array_interface__"):
            raise TypeError(f"{fqn}: cannot save a {type(array).__name__}")
        dtype = _state.dtype_name(array)
        if _tessera.canonical_dtype(dtype) is None:
            raise TypeError(f"tensor {fqn}: tessera has no dtype {dtype}")
        lengths = [int(d) for d in array.shape]
        if offsets is None:
            offsets, shape = [0] * len(lengths), list(lengths)
        nbytes = _state.itemsize(array)
        for d in lengths:
            nbytes *= d
        entries.append(_Entry(fqn, array, dtype, list(shape), list(offsets), lengths, nbytes, version=_version(array)))
    return entries, objects


def _is_cuda(array: Any) -> bool:
    return _state.is_torch_tensor(array) and array.device.type == "cuda"


class SaveHandle:
    """The future of one :func:`async_save` on this rank (like ``dcp.async_save``'s).

    ``wait_snapshot()`` returns once every tensor has been copied out (the job may change them
    after it); ``result()`` returns the :class:`SaveReport` once the checkpoint is committed, or
    raises the error of this rank or of the commit (it names the rank or file that failed).
    """

    def __init__(self, checkpoint_id: str, rank: int, world_size: int, snapshot: str = "eager") -> None:
        self.checkpoint_id = checkpoint_id
        self.rank = rank
        self.world_size = world_size
        #: ``"eager"``, ``"lazy"`` or ``"multi_step"``.
        self.snapshot_mode = snapshot
        #: Seconds the ``async_save`` call blocked the training thread (eager: the whole copy).
        self.blocked_seconds = 0.0
        #: Seconds optimizer steps waited for snapshot copies (lazy and multi-step saves).
        self.step_wait_seconds = 0.0
        #: Seconds the snapshot copies took (multi-step: every part's copy and host replay).
        self.copy_seconds = 0.0
        #: Optimizer steps between the call and the state the checkpoint holds (multi-step:
        #: ``steps - 1``; 0 otherwise).
        self.steps_after_call = 0
        self._snapshot_done = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._snapshot_error: Optional[BaseException] = None
        self._report: Any = None
        self._thread: Optional[threading.Thread] = None
        # Lazy saves: the copies run in the save's thread while the job runs, and torch bumps a
        # tensor's version counter only after an in-place kernel has written, so a check right
        # after a copy can miss a kernel still writing. The check that counts is taken at a
        # point in the job where its earlier kernels have ended (_check_point); the persist
        # waits for it.
        self._lazy = snapshot == "lazy"
        self._entries: List["_Entry"] = []
        self._timeout = 300.0
        self._copied = threading.Event()
        self._checked = threading.Event()
        self._check_error: Optional[BaseException] = None
        self._check_lock = threading.Lock()
        #: The multi-step plan (tessera._multi_step.MultiStepSnapshot) of a multi-step save.
        self._multi: Any = None
        #: Whether the job was handed the save's error (else the process's exit says it).
        self._error_seen = False

    def __repr__(self) -> str:
        state = "committed" if self._report is not None else "failed" if self._error else (
            "persisting" if self._snapshot_done.is_set() else "snapshotting"
        )
        return f"<tessera.SaveHandle {self.checkpoint_id} rank {self.rank}: {state}>"

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        """Blocks until the snapshot is taken. After it returns the job may mutate its tensors.

        Raises the save's error if it failed before the snapshot was complete, and
        ``TimeoutError`` when ``timeout`` seconds pass first.

        Lazy saves: this is a point where the snapshot is checked (see :meth:`_check_point`), so
        call it in the thread that changes the tensors (or after that thread's changes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._check_point("handle.wait_snapshot()", timeout, final=False) or not self._snapshot_done.wait(
            _left(deadline)
        ):
            raise TimeoutError(f"rank {self.rank}: the snapshot of {self.checkpoint_id} took longer than {timeout} s")
        if self._snapshot_error is not None:
            self._error_seen = True
            raise self._snapshot_error

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the save is committed or failed; whether it is done (False on timeout).
        Lazy saves: a point where the snapshot is checked, as :meth:`wait_snapshot` is."""
        return self._wait(timeout, "handle.result()")

    def _wait(self, timeout: Optional[float], where: str) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._multi is not None and self._multi.pending():
            # Only the job's own steps end the window; a timeout, if it comes, should say who waited.
            self._multi.waited_in = threading.current_thread().name
        if not self._check_point(where, timeout, final=False):
            return False
        return self._done.wait(_left(deadline))

    def _check_point(self, where: str, timeout: Optional[float], *, final: bool) -> bool:
        """A lazy snapshot's check, at ``where``: a point the job reached after every in-place
        kernel it started before (the optimizer's next step, ``wait_snapshot()``, ``result()``,
        the process's exit). Waits for the copies, then compares every tensor's version counter
        with the one at the call: unchanged means no in-place write through the tensor (or a
        view or ``detach()`` of it, which share the counter) ended before this point, and a
        kernel still running would have to be one the job starts after it; so the copies, taken
        between the call and this point, hold the state at the call. A moved counter fails the
        save: the copy may hold part of the change, and nothing tells which part.

        Returns False when the copies are not complete within ``timeout`` and ``final`` is
        False (the caller may wait again); with ``final`` (the job goes on changing tensors now)
        that fails the save instead. True once checked (the outcome is the save's)."""
        if not self._lazy or self._checked.is_set():
            return True
        with self._check_lock:
            if self._checked.is_set():
                return True
            if not self._copied.wait(timeout):
                if not final:
                    return False
                self._check_error = TesseraError(
                    f"{where} came before the lazy snapshot's copies were complete (within {timeout:g} s): the job "
                    "changes the tensors from here on, so the copies cannot stand for the state at the call"
                )
            else:
                changed = [
                    e for e in self._entries if e.version is not None and e.source is not None and _version(e.source) != e.version
                ]
                if changed:
                    e = changed[0]
                    more = f" (and {len(changed) - 1} more tensors)" if len(changed) > 1 else ""
                    self._check_error = ChangedBeforeCopy(
                        f"tensor {e.fqn} was changed in place before its snapshot copy could be checked{more} (torch's "
                        f"version counter moved from {e.version} to {_version(e.source)} between the call and {where}): "
                        "the copy may hold part of that change; call handle.wait_snapshot() (or pass optimizer=) "
                        "before changing what was saved"
                    )
            self._checked.set()
            return True

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._done.is_set()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The save's error, or None once committed."""
        if not self.wait(timeout):
            raise TimeoutError(f"rank {self.rank}: the save of {self.checkpoint_id} is not done after {timeout} s")
        self._error_seen = self._error_seen or self._error is not None
        return self._error

    def result(self, timeout: Optional[float] = None) -> Any:
        """The :class:`SaveReport` of the committed checkpoint; raises the save's error."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._report


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds left until ``deadline`` (None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _fail(handle: SaveHandle, error: BaseException) -> None:
    if isinstance(error, TesseraError):
        message = str(error)
        prefix = f"rank {handle.rank} saving {handle.checkpoint_id}: "
        # The same class (ChangedBeforeCopy stays one), with the rank and checkpoint in front.
        error = type(error)(message if message.startswith(prefix) else prefix + message)
    handle._error = error


def _version(array: Any) -> Optional[int]:
    """torch's in-place change counter of a tensor (``None`` for a NumPy array): it moves with
    every in-place write to the tensor or a view of it, under ``no_grad`` too."""
    return int(array._version) if _state.is_torch_tensor(array) else None


class ChangedBeforeCopy(TesseraError):
    """A tensor was changed in place before its snapshot copy was complete: the copy may hold
    a mix of old and new values, so the save fails instead of committing it."""


def _check_unchanged(e: _Entry) -> None:
    if e.version is not None and _version(e.source) != e.version:
        raise ChangedBeforeCopy(
            f"tensor {e.fqn} was changed in place before its snapshot copy was complete (torch's "
            f"version counter moved from {e.version} to {_version(e.source)}): call "
            "handle.wait_snapshot() (or pass optimizer=) before changing what was saved"
        )


def _copy_entry(pool: StagingPool, e: _Entry, streams: Dict[Any, Any], ready: Dict[Any, Any]) -> None:
    """Copies one entry into its pool region (on a side stream for CUDA tensors)."""
    import numpy as np

    dst = pool.region(e.pool_offset, e.nbytes, e.source)
    if _is_cuda(e.source):
        import torch

        device = e.source.device
        stream = streams.get(device)
        if stream is None:
            # A side stream, so the device-to-host DMA does not queue behind (or in front of)
            # the job's kernels; it first waits for the work the job had queued at the call.
            stream = streams[device] = torch.cuda.Stream(device=device)
            stream.wait_event(ready[device])
        with torch.cuda.stream(stream):
            dst.copy_(e.source, non_blocking=True)
    elif _state.is_torch_tensor(dst):
        dst.copy_(e.source)
    else:
        np.copyto(dst, e.source, casting="no")


def _snapshot(pool: StagingPool, entries: List[_Entry], ready: Dict[Any, Any]) -> None:
    """Copies every entry into its pool region; returns when the copies are complete. A torch
    tensor changed in place since the call before its copy was complete fails it
    (:class:`ChangedBeforeCopy`), naming the tensor."""
    streams: Dict[Any, Any] = {}
    for e in entries:
        if e.nbytes == 0:
            continue
        _copy_entry(pool, e, streams, ready)
        if not _is_cuda(e.source):
            _check_unchanged(e)
    if streams:
        import torch

        for stream in streams.values():
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
        for e in entries:
            if _is_cuda(e.source):
                _check_unchanged(e)


def _await_check(handle: SaveHandle) -> None:
    """A lazy save's persist waits for the check of its copies (SaveHandle._check_point), so
    that a copy that may hold a change is never committed; bounded by the save's timeout."""
    if not handle._checked.wait(handle._timeout):
        with handle._check_lock:
            if not handle._checked.is_set():
                handle._check_error = TesseraError(
                    f"the lazy snapshot was copied, but within {handle._timeout:g} s the job reached no point where "
                    "the copy could be checked against later in-place changes (the next step of optimizer=, "
                    "handle.wait_snapshot(), handle.result()); nothing is committed rather than a copy that may "
                    "hold part of a change"
                )
                handle._checked.set()
    if handle._check_error is not None:
        raise handle._check_error


def _run(
    handle: SaveHandle,
    pool: StagingPool,
    entries: List[_Entry],
    objects: List[Tuple[str, bytes]],
    take_snapshot: Callable[[], Optional[List[Tuple[str, bytes]]]],
    native_args: Dict[str, Any],
    started: float,
    waited: float,
) -> None:
    """The save's background thread: the snapshot (``take_snapshot``, which may hand back the
    non-tensor values again, as of the step a multi-step snapshot holds), then the persist."""
    snapshot_started = time.monotonic()
    try:
        refreshed = take_snapshot()
        if refreshed is not None:
            objects = refreshed
        snapshot_seconds = time.monotonic() - snapshot_started
        handle._copied.set()
        if handle._lazy:
            _await_check(handle)
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the handle
        handle._copied.set()  # a check point waiting for the copies goes on
        if not isinstance(e, TesseraError):
            e = TesseraError(f"snapshot failed: {type(e).__name__}: {e}")
        _fail(handle, e)
        handle._snapshot_error = handle._error
        handle._snapshot_done.set()
        handle._done.set()
        return
    if handle.snapshot_mode != "multi_step":
        handle.copy_seconds = snapshot_seconds
    # The job's tensors are no longer read: drop them so the job may free or reuse them.
    boxes = []
    for e in entries:
        region = pool._array[e.pool_offset : e.pool_offset + e.nbytes]
        address = int(region.__array_interface__["data"][0])
        boxes.append(_tessera.HeldBox(
            fqn=e.fqn, dtype=e.dtype, global_shape=e.shape, offsets=e.offsets, lengths=e.lengths,
            address=address, nbytes=e.nbytes,
        ))
        e.source = None
    handle._snapshot_done.set()
    persist_started = time.monotonic()
    persist = native_args.get("persist")
    if persist is not None:
        # Another persist over the same snapshot (tessera.publish): it hands back the report.
        try:
            handle._report = persist(handle, boxes, objects, persist_started)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the handle
            _fail(handle, e)
        finally:
            handle._done.set()
        return
    try:
        request = _api._typed(
            _tessera.SaveRequest, rank=handle.rank, world=handle.world_size,
            rendezvous=native_args["rendezvous"], step=native_args["step"],
            storage_env=native_args["storage_env"], break_claim=native_args["break_claim"],
            timeout_s=native_args["timeout"], memory_tier=native_args["memory_tier"],
        )
        saved = _tessera.save(native_args["path"], boxes, objects, request)
        import json

        saved = json.loads(saved)
        handle._report = _api.SaveReport(
            checkpoint_id=handle.checkpoint_id,
            rank=handle.rank,
            world_size=handle.world_size,
            manifest=saved["manifest"],
            write_retries=saved["write_retries"],
            injected_write_faults=saved["injected_write_faults"],
            warning=saved["warning"],
            memory_tier=saved["memory_tier"],
            objects=len(objects),
            total_seconds=time.monotonic() - started,
            waited_seconds=waited,
            snapshot_seconds=handle.copy_seconds,
            persist_seconds=time.monotonic() - persist_started,
            staged_bytes=sum(e.nbytes for e in entries),
            snapshot=handle.snapshot_mode,
            blocked_seconds=handle.blocked_seconds,
            step_wait_seconds=handle.step_wait_seconds,
            steps_after_call=handle.steps_after_call,
        )
        tier = saved["memory_tier"]
        if tier is not None and tier.get("error"):
            import warnings

            warnings.warn(f"{handle.checkpoint_id} is committed, but {tier['error']}", stacklevel=1)
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the handle
        _fail(handle, e)
    finally:
        handle._done.set()


class StepHooks:
    """One step pre-hook and one post-hook per optimizer, registered the first time a save needs
    them and kept, calling whatever the save in flight set (``before``/``after``, or nothing).
    A hook cannot remove itself: torch iterates the optimizer's hook dictionaries while it calls
    them, and removing one there raises; so saves come and go by setting attributes."""

    _by_optimizer: "weakref.WeakKeyDictionary[Any, StepHooks]" = weakref.WeakKeyDictionary()

    def __init__(self, optimizer: Any) -> None:
        self.before: Optional[Callable[[Any], None]] = None
        self.after: Optional[Callable[[Any], None]] = None
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    @classmethod
    def of(cls, optimizer: Any) -> "StepHooks":
        hooks = cls._by_optimizer.get(optimizer)
        if hooks is None:
            hooks = cls._by_optimizer[optimizer] = StepHooks(optimizer)
        return hooks

    def _before(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        call = self.before
        if call is not None:
            call(optimizer)

    def _after(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        call = self.after
        if call is not None:
            call(optimizer)

    def release(self, *callbacks: Callable[[Any], None]) -> None:
        """Empties the slots that still hold one of ``callbacks`` (a later save may have taken
        them over since)."""
        if self.before in callbacks:
            self.before = None
        if self.after in callbacks:
            self.after = None


class _StepGate:
    """Holds the first step of each optimizer after a lazy save until its snapshot is complete
    and checked (:meth:`SaveHandle._check_point`). A snapshot that is not done within the
    save's timeout lets the step go and fails the save: the step changes tensors whose copies
    are not complete."""

    def __init__(self, handle: SaveHandle, optimizers: Sequence[Any], timeout: float) -> None:
        self._handle = handle
        self._timeout = timeout
        self._hooks = [StepHooks.of(opt) for opt in optimizers]
        for hooks in self._hooks:
            hooks.before = self._before_step

    def _before_step(self, _optimizer: Any) -> None:
        began = time.monotonic()
        # The step changes the tensors: the snapshot is checked here, or fails.
        self._handle._check_point("the optimizer's next step", self._timeout, final=True)
        self._handle.step_wait_seconds += time.monotonic() - began
        self.remove()

    def remove(self) -> None:
        for hooks in self._hooks:
            hooks.release(self._before_step)
        self._hooks = []


def _optimizers(optimizer: Any) -> List[Any]:
    if optimizer is None:
        return []
    found = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in found:
        if not callable(getattr(opt, "register_step_pre_hook", None)):
            raise TypeError(
                f"optimizer= takes torch optimizers (register_step_pre_hook); got {type(opt).__name__}"
            )
    return found


def async_save(
    state_dict: Mapping[str, Any],
    checkpoint_id: Union[str, "os.PathLike[str]", None] = None,
    *,
    process_group: Any = None,
    pool: Optional[StagingPool] = None,
    pool_bytes: Optional[int] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    step: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    storage_options: Optional[Mapping[str, str]] = None,
    break_claim: bool = False,
    timeout: float = 300.0,
    snapshot: str = "eager",
    optimizer: Any = None,
    steps: Optional[int] = None,
    memory_tier: Union[str, "os.PathLike[str]", None] = None,
    memory_tier_keep: int = 2,
    memory_tier_max_bytes: Optional[int] = None,
    _persist: Optional[Callable[..., Any]] = None,
) -> SaveHandle:
    """Starts saving ``state_dict`` as a native checkpoint at ``checkpoint_id``.

    Takes what :func:`tessera.save` takes (every rank calls it; values, replicas, the claim and
    ``break_claim`` as there) plus the staging ``pool`` (default: the process's) and
    ``pool_bytes``, a bound on it for this call, and how the snapshot is taken:

    - ``snapshot="eager"`` (default): the call returns once every tensor is copied into the pool;
      the job may change its tensors right after it. The persist runs in the background.
    - ``snapshot="lazy"`` (DataStates-LLM): the call returns at once and the copies run in the
      background while the job computes forward and backward, which only read parameters and
      optimizer state. With ``optimizer=`` (one or a list), a step pre-hook holds that optimizer's
      next ``step()`` until the copies are done, then removes itself; without it, call
      ``handle.wait_snapshot()`` before changing anything saved. That step (or
      ``wait_snapshot()``, ``result()``, the next ``async_save``, the main thread's end) is where
      the copies are checked: a torch tensor changed in place since the call (torch's version
      counter) fails the save, naming it, and nothing is committed. Writes that bypass the
      counter (``.data``, ``.numpy()``, native code) are not seen (see the module doc). Lazy
      saves take torch tensors only.
    - ``snapshot="multi_step", steps=k, optimizer=opt`` (GoCkpt): the copy is spread over ``k``
      optimizer steps, one part of the parameters (with their optimizer state) per step, and the
      updates of the steps since each part was copied are replayed on the host copy with the same
      optimizer class, hyper-parameters and gradients, so the checkpoint holds the state as it is
      when the ``k``-th step after the call begins (``handle.steps_after_call == k - 1``; name the
      checkpoint for that step). A tensor changed outside the optimizer during the window fails
      the save naming it; a second ``async_save`` while its steps are due fails at once. See
      :mod:`tessera._multi_step` for what it supports.

    ``memory_tier=DIR`` also leaves each rank's data file in its node's memory tier once the
    checkpoint committed (see :func:`tessera.save`), after the persist, in the background.

    ``_persist`` (tessera.publish's): called in the background thread as
    ``_persist(handle, boxes, objects, started)`` with the snapshot's boxes (``HeldBox`` records
    over the pool) instead of the native save; what it returns is the handle's result.

    ``handle.result()`` gives the committed :class:`SaveReport` or the error; the report and the
    handle say how long the call blocked, how long steps waited and what the copies took.

    At most one save is in flight per process: this call first waits for the previous save's
    persist to end (its handle keeps its outcome). Non-tensor values are encoded during the call
    (multi-step: again from the Stateful values, in the training thread, just before the step the
    checkpoint stands for).

    Raises at once (nothing started): ``TypeError``/``ValueError`` for a value tessera cannot save
    or a snapshot mode it cannot take, ``TesseraError`` when the state does not fit the pool's
    bound or a multi-step save still waits for this job's optimizer steps.
    """
    global _IN_FLIGHT
    state_dict, checkpoint_id = _api._dcp_order(state_dict, checkpoint_id, "async_save")
    started = time.monotonic()
    rank, world_size = _save_ranks(process_group, rank, world_size)
    rendezvous = _api._rendezvous(master_addr, master_port)
    if world_size > 1 and rendezvous is None and _persist is None:
        raise ValueError(
            f"saving from {world_size} ranks needs a rendezvous so that rank 0 can commit what "
            "every rank wrote: pass master_addr and master_port, or run under torchrun"
        )
    _check_snapshot(snapshot, steps)
    tier = _tier_args(memory_tier, memory_tier_keep, memory_tier_max_bytes)
    optimizers = _optimizers(optimizer)
    original = state_dict
    entries, objects = _snapshot_entries(state_dict, snapshot)
    multi = None
    if snapshot == "multi_step":
        from . import _multi_step

        if len(optimizers) != 1:
            raise ValueError("snapshot='multi_step' replays one optimizer's updates: pass optimizer=<the optimizer>")
        multi = _multi_step.MultiStepSnapshot.plan(entries, optimizers[0], steps, rank=rank, timeout=timeout)
    pool = pool if pool is not None else default_pool()
    offset = _lay_out(entries)
    cuda_devices = sorted({e.source.device for e in entries if _is_cuda(e.source)}, key=str)

    with _LOCK:
        waited = _wait_for_previous(rank, checkpoint_id)
        pool.reserve(
            offset,
            pinned=bool(cuda_devices),
            bound=pool_bytes,
            what=f"rank {rank}: the state to save at {checkpoint_id} ({len(entries)} tensors)",
        )
        ready = _ready_events(cuda_devices)
        handle = SaveHandle(str(checkpoint_id), rank, world_size, snapshot)
        handle._entries, handle._timeout, handle._multi = entries, float(timeout), multi
        native_args = {
            "path": str(checkpoint_id),
            "rendezvous": rendezvous,
            "step": step,
            "storage_env": _api._storage_env(storage_options),
            "break_claim": bool(break_claim),
            "timeout": float(timeout),
            "persist": _persist,
            "memory_tier": tier,
        }
        if multi is not None:
            take_snapshot: Callable[[], Optional[List[Tuple[str, bytes]]]] = lambda: multi.run(handle, pool)
            handle.steps_after_call = multi.steps - 1
        else:

            def take_snapshot() -> None:
                _snapshot(pool, entries, ready)

        # Not a daemon: a job that returns right after async_save still commits before it exits.
        thread = threading.Thread(
            target=_run,
            args=(handle, pool, entries, objects, take_snapshot, native_args, started, waited),
            name=f"tessera-save-rank{rank}",
            daemon=False,
        )
        handle._thread = thread
        _IN_FLIGHT = handle
        gate = _StepGate(handle, optimizers, timeout) if snapshot == "lazy" else None
        if multi is not None:
            multi.attach(handle, _objects_refresher(original))
        thread.start()
    if snapshot == "eager":
        # The copies run in the save's thread; the call returns once they are complete (or
        # raises at the save's timeout: the save goes on, `in_flight()` has its handle).
        handle.wait_snapshot(timeout)
    elif gate is not None and handle._snapshot_done.is_set():
        gate.remove()
    handle.blocked_seconds = time.monotonic() - started
    return handle


def _save_ranks(process_group: Any, rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """This rank and the job's size: the process group's (rank and world size given besides one
    are refused), else as given or torchrun's."""
    group = _group.default_group(process_group, None)
    if group is not None:
        import torch.distributed as dist

        if rank is not None or world_size is not None:
            raise ValueError("rank and world_size come from the process group; do not pass them with one")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return _api._ranks(rank, world_size)


def _check_snapshot(snapshot: str, steps: Optional[int]) -> None:
    """Refuses a snapshot mode :func:`async_save` does not know, and ``steps=`` outside a
    multi-step snapshot or over :data:`MAX_MULTI_STEPS`."""
    if snapshot not in SNAPSHOT_MODES:
        raise ValueError(f"snapshot={snapshot!r}: choose one of {', '.join(SNAPSHOT_MODES)}")
    if steps is not None and snapshot != "multi_step":
        raise ValueError(f"steps= is for snapshot='multi_step' (got snapshot={snapshot!r})")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > MAX_MULTI_STEPS:
        raise ValueError(
            f"steps={steps}: a multi-step snapshot spreads its copy over at most {MAX_MULTI_STEPS} optimizer "
            "steps (its per-step bookkeeping is taken at the call, and the checkpoint stands for the state "
            "steps - 1 steps later: a window that long outlasts any checkpoint interval)"
        )


def _tier_args(memory_tier: Any, keep: int, max_bytes: Optional[int]) -> Optional[Tuple[str, int, Optional[int]]]:
    """The native save's ``memory_tier``: the tier's directory, how many checkpoints it keeps and
    its byte budget, each checked (``None``: no tier)."""
    tier_dir = _api._memory_tier_dir(memory_tier)
    if tier_dir is None:
        return None
    keep = _api._memory_tier_int(keep, "memory_tier_keep", 1, "a tier keeps at least the checkpoint just saved")
    if max_bytes is not None:
        max_bytes = _api._memory_tier_int(max_bytes, "memory_tier_max_bytes", 0, "a byte budget cannot be negative")
    return tier_dir, int(keep), None if max_bytes is None else int(max_bytes)


def _snapshot_entries(state_dict: Mapping[str, Any], snapshot: str) -> Tuple[List[_Entry], List[Tuple[str, bytes]]]:
    """The tensors to copy and the non-tensor values (encoded) of ``state_dict``. Stateful values
    (a module, an optimizer) save their ``state_dict()``, as with ``dcp.save``; a lazy or
    multi-step snapshot takes torch tensors only (it detects changes by their version counter)."""
    if any(_state.is_stateful(v) for v in state_dict.values()):
        state_dict = {k: (v.state_dict() if _state.is_stateful(v) else v) for k, v in state_dict.items()}
    entries, objects = _entries(state_dict)
    if snapshot in ("lazy", "multi_step"):
        for e in entries:
            if e.version is None:
                raise TypeError(
                    f"{e.fqn}: a {snapshot} snapshot copies while the job runs and detects changes by torch's "
                    "version counter, which NumPy arrays lack: pass torch tensors, or snapshot='eager'"
                )
    return entries, objects


def _lay_out(entries: List[_Entry]) -> int:
    """Gives each entry its aligned offset in the staging pool; the bytes they take in all."""
    offset = 0
    for e in entries:
        e.pool_offset = offset
        offset += (e.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offset


def _wait_for_previous(rank: int, checkpoint_id: Any) -> float:
    """Waits (under ``_LOCK``) for the save in flight to end, since the pool still holds its
    snapshot until its persist ends; the seconds waited. A multi-step save still waiting for
    optimizer steps is an error instead: only this job can take them, after this call returns."""
    waited_from = time.monotonic()
    previous = _IN_FLIGHT
    if previous is not None and previous._multi is not None and previous._multi.pending():
        # Waiting here would wait for optimizer steps that only this job can take (after this
        # call returns): the training thread would stand still until the first save's timeout.
        ran = previous._multi.steps_ran()
        raise TesseraError(
            f"rank {rank}: async_save of {checkpoint_id}: the multi-step save of {previous.checkpoint_id} "
            f"still waits for optimizer steps ({ran} of {previous._multi.steps} ran), and a second save "
            "waits for the one in flight: step the optimizer "
            f"{previous._multi.steps - ran} more times (then this call waits only for its persist), or "
            "save with snapshot='eager' or 'lazy' before a multi-step window; nothing was started"
        )
    if previous is not None:
        # A lazy one is checked here: this thread's changes so far have ended.
        previous._wait(None, f"the next async_save (of {checkpoint_id})")
    return time.monotonic() - waited_from


def _ready_events(cuda_devices: List[Any]) -> Dict[Any, Any]:
    """A CUDA event per device, recorded on the caller's current stream: the copies must see the
    work queued so far."""
    ready: Dict[Any, Any] = {}
    if cuda_devices:
        import torch

        for device in cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready[device] = event
    return ready


def _objects_refresher(original: Mapping[str, Any]) -> Callable[[], Optional[List[Tuple[str, bytes]]]]:
    """For a multi-step save: the non-tensor values again, from fresh ``state_dict()`` calls of
    the Stateful values passed (an optimizer's learning rate moves with its schedule), or None
    when nothing passed is Stateful (the values encoded at the call stand)."""
    if not any(_state.is_stateful(v) for v in original.values()):
        return lambda: None

    def refresh() -> Optional[List[Tuple[str, bytes]]]:
        fresh = {k: (v.state_dict() if _state.is_stateful(v) else v) for k, v in original.items()}
        return _entries(fresh)[1]

    return refresh


def _at_exit() -> None:
    """Runs when the main thread ends, before the interpreter joins the save's thread (which is
    not a daemon, so that a save in flight still commits). A multi-step save still waiting for
    optimizer steps can get none now: it is abandoned at once instead of holding the process
    for its timeout. A lazy save not yet checked is checked here: every kernel the main thread
    started has ended."""
    import sys

    handle = _IN_FLIGHT
    if handle is None:
        return
    if handle._multi is not None and handle._multi.pending():
        sys.stderr.write(f"tessera: rank {handle.rank}: {handle._multi.abandon('the process exits')}\n")
        return
    if handle._lazy and not handle._checked.is_set() and not handle.done():
        handle._check_point("the process's exit", handle._timeout, final=True)
        if handle._check_error is not None:
            sys.stderr.write(
                f"tessera: rank {handle.rank}: the lazy save of {handle.checkpoint_id} is not committed: "
                f"{handle._check_error}\n"
            )
            return
    if handle.done() and handle._error is not None and not handle._error_seen:
        # A save that failed before the job asked (an early lazy check, a persist error): the
        # exit says so rather than leaving a checkpoint silently missing.
        sys.stderr.write(f"tessera: the save is not committed: {handle._error}\n")


# threading's exit hooks run before it joins non-daemon threads (atexit's run after: too late).
_register_at_exit = getattr(threading, "_register_atexit", None)
if _register_at_exit is not None:
    _register_at_exit(_at_exit)


def in_flight() -> Optional[SaveHandle]:
    """The handle of this process's save in flight (snapshot or persist), if any."""
    handle = _IN_FLIGHT
    return handle if handle is not None and not handle.done() else None


__all__: Sequence[str] = [
    "ChangedBeforeCopy",
    "SNAPSHOT_MODES",
    "SaveHandle",
    "StagingPool",
    "async_save",
    "default_pool",
    "in_flight",
]

"""Multi-step snapshots (GoCkpt): a checkpoint copied over ``k`` optimizer steps, one part per
step, brought to one consistent step by replaying the optimizer's updates on the host.

Timeline, for ``async_save(..., snapshot="multi_step", steps=k, optimizer=opt)`` called between
the optimizer steps of iterations N-1 and N (parts 0..k-1, each a set of parameters with their
optimizer state, balanced by bytes; tensors the optimizer does not update go with part 0):

- the call queues part 0's copy; it runs while iteration N computes forward and backward;
- before step N+j (a step pre-hook) the step waits for part j's copy if it is not done, and,
  for j < k-1, hands the save the gradients of parts 0..j (references, not copies) and the
  optimizer's hyper-parameters as they are for this step (a schedule moves the learning rate);
- after step N+j (a step post-hook) the save copies part j+1, again while iteration N+j+1
  computes forward and backward;
- the save's thread replays step N+j on the host copies of parts 0..j: the same optimizer
  class, built over the pool's copies of the parameters and of their optimizer state, with
  those gradients and hyper-parameters. After the pre-hook of step N+k-1 every part holds its
  value at that point, which is what the checkpoint commits.

So no step waits for a whole snapshot: a step waits only if one part's copy (plus the replay
queued before it) takes longer than one forward and backward.

Exactness: the replay runs torch's own optimizer implementation on tensors of the same shapes
and dtypes, with the same options (``foreach``, ``fused``, ``maximize``, ...), on the CPU. For
CPU training that is the same kernel as the training step, so the checkpoint is bitwise the
state an eager snapshot at step N+k-1 would hold (tested). The replay of a CUDA job would run a
different kernel (and a fused one rounds differently), so CUDA tensors are refused here: use
``snapshot="lazy"`` for them.

Supported optimizers: ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (exact classes: a subclass
may change the update). Their per-parameter state must be in the state dict being saved (as
``optimizer.state_dict()`` puts it there), so that each part's copy carries what the replay
updates; an optimizer that has not stepped yet (no state) is refused. Gradients are read by
reference: a job that zeroes them in place (``zero_grad(set_to_none=False)``) while the save's
thread may still be replaying them (the replay was not done when the step ended) is detected by
torch's version counter at the next step's pre-hook, and the save fails instead of committing
(not right after the replay: the counter moves only after the zeroing kernel has written). Such
a job's multi-step saves fail whenever a replay outlasts its step; ``set_to_none=True`` (torch's
default) hands each step new gradient tensors and is never refused. Every wait is bounded by the save's ``timeout``; a job that stops stepping before
``k`` steps ran fails the save, naming how many ran.

Changes outside the optimizer: the replay applies only the optimizer's updates, so the pre-hook
of every step (in the training thread, where the job's in-place kernels have ended) compares the
version counters of the parts copied so far with those read after the previous step (at the call
for the first): a parameter or state tensor rescaled, clamped or loaded between two steps fails
the save naming it, as does a tensor the optimizer does not update that changed at all since the
call. Writes that bypass the counter (``.data``, ``.numpy()``, native code) are not seen, as for
lazy snapshots.

Tied weights (one parameter saved under several names, an embedding and the output projection)
are copied and replayed once; every name gets the replayed value.

The window needs the job's steps: a second ``async_save`` while steps are still due fails at once,
naming this save and how many steps ran (waiting would wait for steps only the caller's thread can
take); when the main thread ends inside the window the save is abandoned at once (stderr says
after how many steps) instead of holding the process's exit for ``timeout``.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._tessera import TesseraError

#: Optimizer classes whose update the host replay reproduces (by class name, exact classes).
SUPPORTED = ("SGD", "Adam", "AdamW")


def _local(tensor: Any) -> Any:
    """The local tensor of a DTensor (what the optimizer's elementwise update runs on)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) and type(tensor).__name__ == "DTensor" else tensor


def _is_entry(value: Any) -> bool:
    """A box of the save (an entry with pool bytes), not an empty tensor standing in for one."""
    return hasattr(value, "pool_offset")


def _host(pool: Any, value: Any) -> Any:
    """The pool's copy of an entry, or a fresh empty tensor for an empty one."""
    import torch

    if _is_entry(value):
        return pool.region(value.pool_offset, value.nbytes, value.source)
    return torch.empty_like(value)


def _key(tensor: Any) -> Tuple[int, int, str, Tuple[int, ...]]:
    return (int(tensor.data_ptr()), int(tensor.numel()), str(tensor.dtype), tuple(tensor.shape))


class MultiStepSnapshot:
    """The plan and the running state of one multi-step snapshot (see the module doc)."""

    def __init__(self) -> None:
        self.steps = 0
        self.rank = 0
        self.timeout = 0.0
        self.optimizer: Any = None
        #: Entries per part (part 0 also holds what the optimizer does not update).
        self.parts: List[List[Any]] = []
        #: Per part: the optimizer's parameters in it, as (group index, param).
        self.part_params: List[List[Tuple[int, Any]]] = []
        #: For each parameter (by id): its entry (an empty tensor for an empty local shard) and
        #: its state entries by state name (empty tensors likewise).
        self.param_entry: Dict[int, Any] = {}
        self.state_entries: Dict[int, Dict[str, Any]] = {}
        #: Entries the optimizer does not update (copied with part 0; must not change after).
        self.static: List[Any] = []
        #: Entries the optimizer updates (parameters and their state), in part order.
        self.updated: List[List[Any]] = []
        #: A tensor saved under several names (tied weights): the entry the replay updates, and
        #: the others, which get its bytes once the last part is replayed.
        self.aliases: List[Tuple[Any, List[Any]]] = []
        #: Each updated entry's version counter at the last point outside an optimizer step (the
        #: call, then each step's post-hook), read in the training thread: between that point
        #: and the next step's pre-hook only the job, not the optimizer, can have changed it.
        self._marks: Dict[int, int] = {}
        #: Thread name of a wait on the handle while steps were still due (said in a timeout).
        self.waited_in: Optional[str] = None
        #: Per replayed step: set by the save's thread once the replay has read its gradients.
        self._replayed: List[threading.Event] = []
        #: The gradients handed to the last replay (step, [(param id, grad, version)]).
        self._handed: Optional[Tuple[int, List[Tuple[int, Any, int]]]] = None
        #: Those of a replay not done when its step ended: the job may change them in place
        #: while it reads them, which only the next pre-hook can see for sure.
        self._unreplayed: Optional[Tuple[int, List[Tuple[int, Any, int]]]] = None
        self._tasks: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
        self._ready: List[threading.Event] = []
        self._failed = threading.Event()
        self._next_step = 0
        self._hooks: Any = None
        self._handle: Any = None
        self._refresh_objects: Callable[[], Optional[List[Tuple[str, bytes]]]] = lambda: None
        self._shadow: Any = None
        self._shadow_params: Dict[int, Any] = {}

    # -- planning (in the caller's thread, before anything starts) ---------------------------

    @classmethod
    def plan(cls, entries: Sequence[Any], optimizer: Any, steps: Optional[int], *, rank: int, timeout: float) -> "MultiStepSnapshot":
        """Splits ``entries`` (the save's boxes) into ``steps`` parts by the optimizer's
        parameters; raises ``ValueError``/``TypeError`` for what the replay cannot reproduce."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
            raise ValueError(f"snapshot='multi_step' needs steps=k with k >= 2 optimizer steps (got steps={steps!r})")
        name = type(optimizer).__name__
        module = type(optimizer).__module__
        if name not in SUPPORTED or not module.startswith("torch.optim"):
            raise TypeError(
                f"snapshot='multi_step' replays the updates of torch.optim {', '.join(SUPPORTED)}; "
                f"{module}.{name} is not one of them (use snapshot='lazy')"
            )
        plan = cls()
        plan.steps, plan.rank, plan.timeout, plan.optimizer = steps, rank, float(timeout), optimizer
        # Every entry of a tensor: a weight tied to another (an embedding and the output
        # projection) is one parameter under two names.
        by_key: Dict[Tuple[int, int, str, Tuple[int, ...]], List[Any]] = {}
        for e in entries:
            if getattr(e.source, "device", None) is not None and e.source.device.type != "cpu":
                raise TypeError(
                    f"{e.fqn}: snapshot='multi_step' replays updates with CPU kernels, which match only CPU "
                    f"training; this tensor is on {e.source.device} (use snapshot='lazy')"
                )
            if e.nbytes:
                by_key.setdefault(_key(e.source), []).append(e)
        claimed: set = set()

        def claim(found: List[Any]) -> Any:
            for alias in found:
                claimed.add(id(alias))
            if len(found) > 1:
                plan.aliases.append((found[0], found[1:]))
            return found[0]
        params: List[Tuple[int, Any, int]] = []  # (group, param, bytes)
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                local = _local(p.detach())
                # An empty local shard (FSDP2 gives the last ranks none of a small tensor) has no
                # bytes to copy, but its optimizer state may (Adam's step count).
                found_param = by_key.get(_key(local)) if local.numel() else None
                entry = claim(found_param) if found_param else None
                if entry is None and local.numel():
                    raise ValueError(
                        f"snapshot='multi_step': a parameter the optimizer updates (shape {tuple(p.shape)}, group {g}) "
                        "is not in the state dict being saved; save the model's state with the optimizer's"
                    )
                what = entry.fqn if entry is not None else f"an empty shard of a parameter of group {g}"
                state = optimizer.state.get(p)
                if not state and p.requires_grad and name != "SGD":
                    raise ValueError(
                        f"snapshot='multi_step': {name} has no state for {what} yet (it has not stepped); "
                        "take the first checkpoint after a step, or with snapshot='lazy'"
                    )
                named: Dict[str, Any] = {}
                size = entry.nbytes if entry is not None else 0
                for state_name, value in (state or {}).items():
                    if not hasattr(value, "data_ptr"):
                        continue
                    local_state = _local(value.detach())
                    if not local_state.numel():
                        named[state_name] = local_state  # nothing to copy: the replay's own
                        continue
                    found = by_key.get(_key(local_state))
                    if not found:
                        raise ValueError(
                            f"snapshot='multi_step': the optimizer's {state_name!r} of {what} is not in the "
                            "state dict being saved; save optimizer.state_dict() (or the optimizer) with the model"
                        )
                    named[state_name] = claim(found)
                    size += named[state_name].nbytes
                plan.param_entry[id(p)] = entry if entry is not None else local
                plan.state_entries[id(p)] = named
                params.append((g, p, size))
        # Contiguous runs of parameters, balanced by bytes (with their optimizer state).
        total = sum(size for _, _, size in params) or 1
        plan.part_params = [[] for _ in range(steps)]
        plan.parts = [[] for _ in range(steps)]
        done = 0
        for g, p, size in params:
            part = min(steps - 1, (done * steps) // total)
            plan.part_params[part].append((g, p))
            plan.parts[part].extend(e for e in [plan.param_entry[id(p)], *plan.state_entries[id(p)].values()] if _is_entry(e))
            done += size
        plan.updated = [list(part) for part in plan.parts]
        plan.static = [e for e in entries if id(e) not in claimed]
        plan.parts[0][:0] = plan.static
        plan._ready = [threading.Event() for _ in range(steps)]
        plan._replayed = [threading.Event() for _ in range(steps)]
        return plan

    # -- the training thread's side -----------------------------------------------------------

    def attach(self, handle: Any, refresh_objects: Callable[[], Optional[List[Tuple[str, bytes]]]]) -> None:
        """Queues part 0's copy and hooks the optimizer's next ``steps`` steps.
        ``refresh_objects`` encodes the non-tensor values again (None: those of the call stand);
        it runs in the training thread, before the step the checkpoint stands for."""
        from ._async_save import StepHooks

        self._handle = handle
        self._refresh_objects = refresh_objects
        # At the call (the training thread): the versions _entries read are the marks of part
        # 0's window, and the references of every copy's own check.
        for part in self.updated:
            for e in part:
                self._marks[id(e)] = e.version
        self._tasks.put(("copy", 0))
        self._hooks = StepHooks.of(self.optimizer)
        self._hooks.before = self._before_step
        self._hooks.after = self._after_step

    def _detach(self) -> None:
        if self._hooks is not None:
            self._hooks.release(self._before_step, self._after_step)
        self._hooks = None

    def pending(self) -> bool:
        """Whether the save still waits for optimizer steps (only the job can take them)."""
        return not self._failed.is_set() and self._next_step < self.steps

    def steps_ran(self) -> int:
        """Optimizer steps after the call whose pre-hook the save has passed."""
        return self._next_step

    def abandon(self, why: str) -> str:
        """Fails the save at once (no step will come: ``why``); returns what it says."""
        message = (
            f"the multi-step save of {self._handle.checkpoint_id} is abandoned: {why} after {self._next_step} of "
            f"{self.steps} optimizer steps; nothing is committed"
        )
        self._fail(message)
        return message

    def _fail(self, message: str) -> None:
        self._failed.set()
        self._tasks.put(("fail", message))
        self._detach()

    def _gradient_changed(self) -> Optional[str]:
        """A gradient the job changed in place while a replay could still read it (training
        thread, once that replay is done: the part copied after it is ready). Its version
        counter moves only after the kernel wrote, so the replay's own check can miss a kernel
        still writing; here every kernel the job started has ended."""
        pending, self._unreplayed = self._unreplayed, None
        if pending is None:
            return None
        step, grads = pending
        for pid, grad, version in grads:
            if int(grad._version) != version:
                entry = self.param_entry[pid]
                what = entry.fqn if _is_entry(entry) else "an empty shard"
                return (
                    f"the gradient of {what} was changed in place (torch's version counter moved from {version} to "
                    f"{int(grad._version)}; zero_grad(set_to_none=False)?) while the save could still be replaying "
                    f"step {step + 1} of {self.steps} with it; the replayed state may be wrong (zero gradients with "
                    "set_to_none=True, the default, or use snapshot='lazy')"
                )
        return None

    def _changed_outside(self, upto: int) -> Optional[str]:
        """What changed outside the optimizer before the step of part ``upto`` (training thread):
        an updated entry of parts 0..``upto`` whose counter moved since the last post-hook (the
        host copy does not have that change, and the replay applies only the optimizer's), or an
        entry the optimizer does not update whose counter moved since the call."""
        from ._async_save import _version

        when = f"before optimizer step {upto + 1} of {self.steps} after the call"
        for e in self.static:
            if e.version is not None and _version(e.source) != e.version:
                return (
                    f"{e.fqn} was changed outside the optimizer {when} (torch's version counter moved from "
                    f"{e.version} to {_version(e.source)}); the optimizer does not update it, so its copy (taken "
                    "with part 0) is not its value at the step the checkpoint stands for (use snapshot='lazy' for "
                    "state that changes outside the optimizer)"
                )
        for part in self.updated[: upto + 1]:
            for e in part:
                was = self._marks[id(e)]
                if was is not None and _version(e.source) != was:
                    return (
                        f"{e.fqn} was changed outside the optimizer {when} (torch's version counter moved from {was} "
                        f"to {_version(e.source)} between two steps): its host copy is brought forward by replaying "
                        "the optimizer's updates only, so the checkpoint would hold a value the job never had (use "
                        "snapshot='lazy' for state that changes outside the optimizer)"
                    )
        return None

    def _before_step(self, optimizer: Any) -> None:
        j = self._next_step
        began = time.monotonic()
        self._ready[j].wait(self.timeout)
        self._handle.step_wait_seconds += time.monotonic() - began
        if self._failed.is_set() or not self._ready[j].is_set():
            # Failed, or not copied in time: the save fails (its thread says why); training goes on.
            self._fail(
                f"step {j + 1} of {self.steps} after the call came before part {j} was copied within {self.timeout:g} s"
            )
            return
        # Part j's copy ran between the last post-hook and now; the parts before it were brought
        # forward by replaying steps. Either holds only if nothing but the optimizer changed them.
        changed = self._changed_outside(j) or self._gradient_changed()
        if changed is not None:
            self._fail(changed)
            return
        self._next_step = j + 1
        if j == self.steps - 1:
            # The non-tensor values (a scheduler's learning rate, the optimizer's step count) as
            # of this step, taken here: the save's thread would read them whenever it gets to
            # them, after this step or the next had changed them. An error fails the save, not
            # the training step.
            try:
                finished: Tuple[Optional[List[Tuple[str, bytes]]], Optional[BaseException]] = (self._refresh_objects(), None)
            except Exception as e:  # noqa: BLE001 - handed to the save's thread
                finished = (None, e)
            self._tasks.put(("finish", finished))
            self._detach()
            return
        grads = []
        for part in self.part_params[: j + 1]:
            for _g, p in part:
                if p.grad is not None:
                    local = _local(p.grad.detach())
                    grads.append((id(p), local, int(local._version)))
        hyper = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        self._handed = (j, grads)
        self._tasks.put(("replay", (j, grads, hyper)))

    def _after_step(self, _optimizer: Any) -> None:
        from ._async_save import _version

        # Out of the optimizer's step: from here to the next pre-hook only the job changes tensors.
        if self._handed is not None and not self._replayed[self._handed[0]].is_set():
            # The job may now change those gradients in place while the replay reads them.
            self._unreplayed = self._handed
        self._handed = None
        for part in self.updated:
            for e in part:
                self._marks[id(e)] = _version(e.source)
        j = self._next_step  # the next step's part: its copy runs during forward and backward
        if j < self.steps:
            for e in self.parts[j]:
                if id(e) in self._marks:
                    e.version = self._marks[id(e)]  # what the copy's own check compares with
            self._tasks.put(("copy", j))

    # -- the save's thread --------------------------------------------------------------------

    def run(self, handle: Any, pool: Any) -> Optional[List[Tuple[str, bytes]]]:
        """Copies and replays as the hooks queue them until the last part; returns the non-tensor
        values as of that step (or None when those of the call stand). Raises on any failure."""
        from ._async_save import ChangedBeforeCopy, _snapshot, _version

        self._pool = pool
        copy_seconds = 0.0
        try:
            while True:
                try:
                    kind, arg = self._tasks.get(timeout=self.timeout)
                except queue.Empty:
                    waited = (
                        f" (meanwhile thread {self.waited_in!r} waited for this save: the steps must run before "
                        "handle.result())"
                        if self.waited_in is not None
                        else ""
                    )
                    raise TesseraError(
                        f"rank {self.rank}: multi-step snapshot: {self._next_step} of {self.steps} optimizer steps "
                        f"ran within {self.timeout:g} s; the checkpoint needs all {self.steps}{waited}"
                    ) from None
                began = time.monotonic()
                if kind == "copy":
                    # Each entry's version is its mark, read in the training thread when the
                    # copy was queued; the pre-hook of the part's step checks it again.
                    try:
                        _snapshot(pool, self.parts[arg], {})
                    except ChangedBeforeCopy:
                        # Said as the pre-hook would: no optimizer step ran since the copy was queued.
                        e = next(e for e in self.parts[arg] if e.version is not None and _version(e.source) != e.version)
                        raise TesseraError(
                            f"rank {self.rank}: multi-step snapshot: {e.fqn} was changed outside the optimizer while "
                            f"part {arg} was copied (torch's version counter moved from {e.version} to "
                            f"{_version(e.source)} between two steps): the copy may hold part of that change (use "
                            "snapshot='lazy' for state that changes outside the optimizer)"
                        ) from None
                    self._ready[arg].set()
                elif kind == "replay":
                    self._replay(*arg)
                elif kind == "finish":
                    for primary, aliases in self.aliases:
                        value = _host(pool, primary)
                        for alias in aliases:
                            _host(pool, alias).copy_(value)  # the tied names hold the replayed value
                    handle.copy_seconds = copy_seconds
                    objects, error = arg
                    if error is not None:
                        raise error
                    return objects
                else:
                    raise TesseraError(f"rank {self.rank}: multi-step snapshot: {arg}")
                copy_seconds += time.monotonic() - began
        except BaseException:
            self._failed.set()
            for ready in self._ready:
                ready.set()  # no step waits for a save that failed
            raise

    def _replay(self, step: int, grads: List[Tuple[int, Any, int]], hyper: List[Dict[str, Any]]) -> None:
        """Applies step N+``step`` to the host copies of parts 0..``step``."""
        shadow = self._shadow_optimizer()
        by_param = {pid: (grad, version) for pid, grad, version in grads}
        for part in self.part_params[: step + 1]:
            for _g, p in part:
                host = self._shadow_params[id(p)]
                held = by_param.get(id(p))
                host.grad = None if held is None else held[0]
        for group, values in zip(shadow.param_groups, hyper):
            group.update(values)
        shadow.step()
        for part in self.part_params[: step + 1]:
            for _g, p in part:
                self._shadow_params[id(p)].grad = None
        for pid, grad, version in grads:
            if int(grad._version) != version:
                entry = self.param_entry[pid]
                what = entry.fqn if _is_entry(entry) else "an empty shard"
                raise TesseraError(
                    f"rank {self.rank}: multi-step snapshot: the gradient of {what} was changed in place before "
                    "the save replayed its step (zero_grad(set_to_none=False)?); the replayed state would be wrong"
                )
        # A change still being written now is seen by the next pre-hook (_gradient_changed).
        self._replayed[step].set()

    def _shadow_optimizer(self) -> Any:
        """The optimizer's class over the pool's copies of the parameters and their state."""
        if self._shadow is not None:
            return self._shadow
        groups = []
        for g, group in enumerate(self.optimizer.param_groups):
            params = []
            for p in group["params"]:
                entry = self.param_entry.get(id(p))
                if entry is None:
                    continue
                host = _host(self._pool, entry)
                self._shadow_params[id(p)] = host
                params.append(host)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        shadow = type(self.optimizer)(groups)
        for pid, named in self.state_entries.items():
            host = self._shadow_params[pid]
            shadow.state[host] = {name: _host(self._pool, e) for name, e in named.items()}
        self._shadow = shadow
        return shadow


__all__: Sequence[str] = ["MultiStepSnapshot", "SUPPORTED"]

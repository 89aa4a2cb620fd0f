"""The failure agreement of a load over a torch process group, through the job's c10d store.

Collectives on the job's group (``all_gather_object``) wait for the group's own timeout, 30
minutes by default, and fail with a gloo error that names no rank. The rounds of the load
job before the exchange (``tessera_ops::job``: requests, memory tier, plan, plan agreement, read,
joint checks) go through the job's key-value store instead: each rank puts its own keys and
fetches only its own answers (rank 0, the coordinator, fetches every rank's), arrives at each
round with one marker and one counter, and waits with its own deadline:

- a rank that fails publishes its failure at once (one key, the first failure kept); every rank
  waiting in a step sees it within 0.1 s and raises naming that rank and its error, and a rank
  still planning or reading is cancelled within 100 ms (``GroupLoad.cancel``);
- every rank that has started the load beats (a counter in the store, once a second, from a
  thread: a rank stopped by SIGSTOP, a debugger, a stuck read in a system call or killed stops
  beating); each waiting rank watches the beat of the next rank in rank order (so every rank is
  watched by one, and the store serves O(world) calls a second in all), and one that sees it
  stand still for ``liveness`` seconds publishes it as failed, so every rank fails within
  ``liveness`` + a few seconds naming it;
- a rank that never arrives (never started the load) is waited for until ``timeout``, then named.

Keys live under ``tessera/<group>/<n>/`` where n counts this process's loads over the group (every
rank loads in the same order, as with any collective), so a failed load leaves nothing that a
later one reads. Every ``tessera.load`` over a group takes part, one that fails before its group
step included (it publishes that failure: ``_group.joins_on_failure``), so the counts of the ranks
stay in step; and the first step compares the checkpoint each rank opened, so two different loads
are never joined.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._tessera import TesseraError

# How often a rank beats. A waiting rank looks whether what it waits for is there with one store
# call, first after 2 ms, then at doubling intervals up to 20 ms per 64 ranks (at most 0.1 s: a
# job of many ranks costs the store few calls, a small one loses almost nothing to the poll), for
# a failure every 0.1 s, and at the next rank's beat once a second. (`Store.wait` with a short
# timeout would wake at once, but torch logs a warning for every wait that times out.)
_BEAT_S = 1.0
_POLL_S = (0.002, 0.02)
_LOOK_S = 0.1

_loads: Dict[str, int] = {}
_loads_lock = threading.Lock()


class Agreement:
    """One load's steps agreed through ``store`` by the ``world`` ranks of a group (this one is
    ``rank``); see the module docs. ``on_failure(message)`` is called from the beat thread when
    another rank's failure is seen while this rank works (not waits)."""

    def __init__(
        self,
        store: Any,
        group_name: str,
        rank: int,
        world: int,
        timeout: float,
        liveness: float,
        on_failure: Optional[Callable[[str], None]] = None,
    ) -> None:
        with _loads_lock:
            n = _loads.get(group_name, 0)
            _loads[group_name] = n + 1
        self._store = store
        self._prefix = f"tessera/{group_name}/{n}"
        self._rank, self._world = rank, world
        self._timeout, self._liveness = timeout, min(liveness, timeout)
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="tessera-agreement", daemon=True)
        # Whether a failure is already known to every rank (published here, or read from the
        # store): nothing to publish when the load unwinds.
        self._settled = False
        # `watch`: when it next looks, and the beats of the ranks it watches (value, since).
        self._next_watch = 0.0
        self._watched: Dict[int, Tuple[int, float]] = {}

    # -- keys -------------------------------------------------------------------------------
    def _key(self, *parts: Any) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    # -- the beat thread --------------------------------------------------------------------
    def start(self) -> "Agreement":
        self._store.add(self._key("beat", self._rank), 1)
        self._beats.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._beats.is_alive():
            self._beats.join(timeout=2 * _BEAT_S)

    def __enter__(self) -> "Agreement":
        return self.start()

    def __exit__(self, _type: Any, error: Optional[BaseException], _tb: Any) -> None:
        # Whatever left the load early (Ctrl-C, a bug) is this rank's failure: the others hear
        # of it now rather than when its beat goes quiet.
        if error is not None:
            self.fail_once("loading", error)
        self.close()

    def _beat(self) -> None:
        told = False
        while not self._stop.wait(_BEAT_S):
            try:
                self._store.add(self._key("beat", self._rank), 1)
                if not told and self._on_failure is not None and self._store.check([self._key("failed")]):
                    told = True
                    self._on_failure(self._failure_message(self._read_failure()))
            except Exception:  # the store is gone: the waits will say so
                return

    # -- failures ---------------------------------------------------------------------------
    def fail(self, step: str, error: BaseException) -> None:
        """Publishes this rank's failure (the first failure of the job is kept)."""
        self._settled = True
        self._publish(self._rank, step, f"{type(error).__name__}: {error}")

    def fail_once(self, step: str, error: BaseException) -> None:
        """Publishes this rank's failure unless a failure is already known to every rank (this
        rank's error reports another rank's)."""
        if not self._settled:
            self.fail(step, error)

    def _publish(self, culprit: int, step: str, message: str) -> None:
        try:
            self._store.compare_set(self._key("failed"), "", f"{culprit}\n{step}\n{message}")
        except Exception:  # the store is gone; this rank raises its own error anyway
            pass

    def _read_failure(self) -> Tuple[int, str, str]:
        text = self._store.get(self._key("failed")).decode("utf-8", "replace")
        rank, step, message = (text.split("\n", 2) + ["", ""])[:3]
        return int(rank), step, message

    def _failure_message(self, failure: Tuple[int, str, str]) -> str:
        rank, step, message = failure
        return f"rank {self._rank}: rank {rank} failed {step}: {message}"

    def _raise_if_failed(self) -> None:
        """Raises naming the rank whose failure was published, if one was."""
        if self._store.check([self._key("failed")]):
            self._settled = True
            raise TesseraError(self._failure_message(self._read_failure()))

    def _silent_for(self, rank: int, beats: Dict[int, Tuple[int, float]], now: float) -> Tuple[int, float]:
        """``rank``'s beat and the seconds it has stood still, as far as ``beats`` (this rank's
        last looks: beat seen, since when) tells."""
        beat = self._store.add(self._key("beat", rank), 0)
        seen, since = beats.get(rank, (beat, now))
        if beat != seen:
            seen, since = beat, now
        beats[rank] = (seen, since)
        return beat, now - since

    def _stopped(self, ranks: List[int], step: str) -> TesseraError:
        """The error naming ``ranks`` as stopped while ``step``, published as the first one's
        failure so that every rank names it."""
        self._settled = True
        self._publish(ranks[0], step, f"stopped: no sign of life for {self._liveness:g} s "
                      f"(stopped, hung in a system call, or killed; seen by rank {self._rank})")
        return TesseraError(
            f"rank {self._rank}: rank {_ranks(ranks)} stopped while {step}: no sign of "
            f"life for {self._liveness:g} s (stopped, hung in a system call, or killed)"
        )

    # -- the job's channel (tessera_ops::job: the rounds say what to put, fetch and wait for) --
    def _store_call(self, step: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except TesseraError:
            raise
        except Exception as e:
            raise TesseraError(
                f"rank {self._rank}: the job's store stopped answering while {step} (the process "
                f"hosting it, rank 0's or torchrun's agent, died?): {type(e).__name__}: {e}"
            ) from e

    def put(self, key: str, value: bytes, step: str) -> None:
        """Stores this rank's ``value`` under the load's ``key``."""
        self._store_call(step, lambda: self._store.set(self._key("job", key), value))

    def arrive(self, round_name: str, step: str) -> None:
        """Returns once every rank arrived at ``round_name``: one marker and one counter per
        rank; the last to arrive wakes the others. Raises naming the rank that failed, stopped or
        never arrived."""
        def arrive() -> None:
            self._store.set(self._key("arrived", round_name, self._rank), b"1")
            if self._store.add(self._key("arrived", round_name), 1) == self._world:
                self._store.set(self._key("arrived", round_name, "all"), b"1")
            else:
                self._wait_for(self._key("arrived", round_name, "all"), step, round_name)

        self._store_call(step, arrive)

    def fetch(self, keys: List[str], step: str) -> List[Optional[bytes]]:
        """The values of the load's ``keys`` now (after an arrival), ``None`` where no rank wrote
        one."""
        full = [self._key("job", k) for k in keys]
        if not full:
            return []

        def fetch() -> List[Optional[bytes]]:
            if self._store.check(full):
                return list(self._store.multi_get(full))
            return [self._store.get(k) if self._store.check([k]) else None for k in full]

        return self._store_call(step, fetch)

    def await_key(self, key: str, step: str) -> bytes:
        """The value of the load's ``key`` once the coordinator (rank 0) wrote it."""
        full = self._key("job", key)

        def await_key() -> bytes:
            self._wait_for(full, step, None)
            return self._store.get(full)

        return self._store_call(step, await_key)

    def _wait_for(self, key: str, step: str, round_name: Optional[str]) -> None:
        """Waits until ``key`` exists. Meanwhile every 0.1 s it looks for a published failure
        and once a second at the beat of the next rank in rank order (each waiting rank watches
        one: the job's liveness costs O(world) store calls a second in all, not per rank); at
        ``timeout`` it names the ranks that never arrived at ``round_name`` (one scan), or the
        coordinator that did not answer."""
        store, world, rank = self._store, self._world, self._rank
        started = time.monotonic()
        deadline = started + self._timeout
        next_watch = started + min(_BEAT_S, self._liveness / 2)
        # The beats seen so far in this load (not only in this wait): a rank that stopped while
        # this one worked (planned, read) is named as soon as this one waits again.
        beats = self._watched
        successor = (rank + 1) % world
        poll, poll_cap = _POLL_S[0], min(_LOOK_S, _POLL_S[1] * max(1.0, world / 64))
        next_look = started + _LOOK_S
        while True:
            if store.check([key]):
                return
            now = time.monotonic()
            if now < next_look:
                time.sleep(poll)
                poll = min(poll * 2, poll_cap)
                continue
            next_look = now + _LOOK_S
            self._raise_if_failed()
            if successor != rank and (now >= next_watch or successor not in beats):
                next_watch = now + _BEAT_S
                beat, silent = self._silent_for(successor, beats, now)
                # Only a rank that has started the load (beaten once) can stop beating.
                if beat > 0 and silent >= self._liveness:
                    raise self._stopped([successor], step)
            if now >= deadline:
                self._settled = True
                if round_name is None:
                    self._publish(0, step, f"did not answer within {self._timeout:g} s "
                                  f"(seen by rank {rank})")
                    raise TesseraError(
                        f"rank {rank}: rank 0, the job's coordinator, did not answer while {step} "
                        f"within {self._timeout:g} s (timeout=)"
                    )
                missing = [r for r in range(world)
                           if not store.check([self._key("arrived", round_name, r)])]
                culprit = missing[0] if missing else rank
                self._publish(culprit, step, f"did not arrive within {self._timeout:g} s "
                              f"(seen by rank {rank})")
                raise TesseraError(
                    f"rank {rank}: rank {_ranks(missing or [culprit])} did not reach {step} within "
                    f"{self._timeout:g} s (timeout=): never started the load, or too slow"
                )

    def watch(self, step: str, ranks: List[int]) -> None:
        """Raises (without waiting) when a rank published a failure, or one of ``ranks`` (those
        this rank waits on) has not beaten for ``liveness`` seconds; cheap enough to call once a
        second from a loop that waits on something else (the exchange)."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + _BEAT_S
        try:
            self._raise_if_failed()
            for r in ranks:
                _beat, silent = self._silent_for(r, self._watched, now)
                if silent >= self._liveness:
                    raise self._stopped([r], step)
        except TesseraError:
            raise
        except Exception:  # the store is gone: the exchange's own deadline still bounds the wait
            return


def _ranks(ranks: List[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    shown = ", ".join(map(str, ranks[:8]))
    return f"{shown}{' …' if len(ranks) > 8 else ''} ({len(ranks)} ranks)"


# Seconds without a beat after which a rank that started the load counts as stopped.
DEFAULT_LIVENESS_S = 10.0


def liveness_from_env() -> float:
    """``TESSERA_LIVENESS_S``, else :data:`DEFAULT_LIVENESS_S`."""
    import os

    text = os.environ.get("TESSERA_LIVENESS_S")
    if not text:
        return DEFAULT_LIVENESS_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"TESSERA_LIVENESS_S={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"TESSERA_LIVENESS_S={text!r} must be more than 0 seconds")
    return value


def for_group(group: Any, rank: int, world: int, timeout: float,
              on_failure: Optional[Callable[[str], None]] = None) -> Agreement:
    """The agreement of one load over ``group``, through the store of the job's default group,
    with the liveness bound of ``TESSERA_LIVENESS_S`` (default 10 s, at most ``timeout``)."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    name = getattr(group, "group_name", None) or "world"
    return Agreement(store, name, rank, world, timeout, liveness_from_env(), on_failure)

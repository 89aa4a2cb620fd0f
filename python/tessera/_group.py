"""Loading as one job over the job's own ``torch.distributed`` process group.

The load job's rounds before the exchange (``tessera_ops::job``, numbered as in ARCHITECTURE.md:
1 requests, 2 memory tier, 3 plan, 4 plan agreement, 5 read, 6 joint checks) run in Rust and are
pumped over the job's c10d store by ``_run_rounds``: each rank puts its hello (requests, tier
offer, the checkpoint as opened and its plan options); rank 0 fetches every hello, refuses a job
whose ranks opened different checkpoints or plan otherwise, plans the whole job once and puts
each rank's own rank plan; each rank fetches only its own, checks it against its requests and
reports the digests of what it passes its peers; rank 0 compares both ends of every pair (rank
plans of different plans are refused before any read); each rank reads its pieces and checks the
boxes read in parts with the folds of their other readers only. What a rank reads from the store
grows with its own share, not with the world. Then the exchange protocol
(tessera_loader::exchange::protocol, the one tessera's own transports run) says which messages to
send and receive, and `_drive` moves them with torch's point-to-point ops on the same group: gloo
for CPU groups, NCCL (messages staged in device memory) for NCCL-only groups. No second
rendezvous, no extra port.

Every rank takes part in every load's agreement, a load that fails before it reaches the group
(a missing key) included (``joins_on_failure``): loads are matched by their number on each rank,
so a rank that skipped one would join its next load to the others' current one.

Failures are agreed on through the job's store, not the group (``_agreement``): a rank that
fails is named on every rank within a poll, one that stops or dies within ``liveness`` seconds,
and none waits for the group's own timeout.
"""

from __future__ import annotations

import functools
import json
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _agreement, _tessera
from ._tessera import TesseraError


def default_group(process_group: Any, exchange: Optional[bool]) -> Any:
    """The group to load over: ``process_group``, else the default group when torch.distributed
    is initialized with more than one rank (unless ``exchange=False``), else None."""
    if process_group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return process_group
    if exchange is False:
        return None
    import sys

    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() <= 1:
        return None
    return dist.group.WORLD


# The group (and timeout) of this thread's `tessera.load` from when it found its group until it
# joins the group's agreement (`load_over_group`): a failure in between (a missing key, a dtype
# that does not match, a checkpoint this rank cannot open) is still published to the group.
_pending = threading.local()


def pending_load(group: Any, timeout: Any) -> None:
    """Notes that this thread's load runs over ``group`` (until it joins the agreement)."""
    _pending.load = (group, timeout)


def joins_on_failure(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (``tessera.load``), publishing a failure it raises after finding its group
    but before joining the group's agreement as this rank's failure of that load.

    Every rank must take part in every load's agreement: loads over a group are matched by
    their number on each rank (as collectives are), so a rank whose call raised before the
    agreement would be one load behind, and its next load (a fallback to an older checkpoint)
    would be joined with the other ranks' current one. Taking part with its failure keeps the
    counts in step, and the other ranks fail at once naming it rather than waiting out
    ``timeout=`` (or joining the wrong load)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _pending.load = None
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            pending = getattr(_pending, "load", None)
            if pending is not None:
                _publish_early_failure(*pending, error)
            raise
        finally:
            _pending.load = None

    return wrapper


def _publish_early_failure(group: Any, timeout: Any, error: BaseException) -> None:
    """Takes part in the agreement of the load ``error`` ended before it joined: the agreement's
    first step, failed with ``error`` (published at once; the other ranks raise naming it)."""
    _pending.load = None
    try:
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        try:
            seconds = float(timeout)
        except (TypeError, ValueError):
            seconds = 300.0
        agreement = _agreement.for_group(group, rank, world, seconds)
    except Exception:  # no group to tell after all: the caller raises its error anyway
        return
    with agreement:
        agreement.fail("preparing its requests", error)


def _transport_error(error: BaseException) -> str:
    """gloo's message without its source path and advice: ``Read error [addr]:port: Connection
    reset by peer``."""
    text = str(error).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically caused", 1)[0]


def _host_view(address: int, nbytes: int) -> Any:
    """A uint8 tensor over ``nbytes`` bytes of tessera's memory at ``address`` (no copy): the
    bytes of a message the protocol keeps alive until it hears the message went out."""
    import ctypes

    import torch

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _drive(
    exchange: Any, dist: Any, group: Any, rank: int, device: Any, global_rank: Callable[[int], int],
    timeout: float, deadline: float, agreement: Any,
) -> float:
    """Moves the bytes the exchange protocol asks for with torch's point-to-point ops on
    ``group`` and tells it what completed, until it says the exchange is over. The protocol
    (tessera_loader::exchange::protocol, the same one tessera's own transports run) decides
    every message: what to send to whom, what to receive, hand-shakes, direct copies and their
    acknowledgements. A framed message (whose receiver does not know its length) goes as its
    8-byte length under the pair tag + 1, then its bytes.

    gloo completes point-to-point work only inside ``wait()``, which blocks without seeing
    signals: a helper thread per operation in flight waits for it (waiting in any fixed order
    could deadlock: a hand-shake's answer comes only after the peer saw this rank's hello) and
    hands its completion to this thread, which takes them in short steps so that Ctrl-C and the
    deadline are seen here. Returns the seconds this thread waited for a completion (the
    peers' messages, its own sends' hand-offs) rather than posting or placing."""
    import torch

    completions: "queue.Queue[Tuple[Any, Optional[BaseException]]]" = queue.Queue()

    def wait(work: Any, peer: int, kind: str, done: Any, _keep: Any) -> None:
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{kind} with rank {peer}")
            work.wait(timedelta(seconds=left))
        except TimeoutError as e:
            completions.put((None, e))
            return
        except RuntimeError as e:
            completions.put((None, peer_failed(peer, kind, e)))
            return
        completions.put((done, None))

    waiters: List[threading.Thread] = []

    def wait_for(peer: int, work: Any, kind: str, done: Any, keep: Any) -> None:
        waiter = threading.Thread(
            target=wait, args=(work, peer, kind, done, keep), name=f"tessera-exchange-{peer}", daemon=True
        )
        waiter.start()
        waiters.append(waiter)

    def peer_failed(peer: int, kind: str, error: BaseException) -> TesseraError:
        return TesseraError(
            f"rank {rank}: rank {peer} failed or died during the exchange: the process group's "
            f"{'receive from' if kind == 'recv' else 'send to'} it failed: {_transport_error(error)}"
        )

    # Posting can fail too (gloo raises at once on a pair whose peer is gone).
    def isend(buffer: Any, peer: int, tag: int) -> Any:
        try:
            return dist.isend(buffer, dst=global_rank(peer), group=group, tag=tag)
        except RuntimeError as e:
            raise peer_failed(peer, "send", e) from None

    def irecv(buffer: Any, peer: int, tag: int) -> Any:
        try:
            return dist.irecv(buffer, src=global_rank(peer), group=group, tag=tag)
        except RuntimeError as e:
            raise peer_failed(peer, "recv", e) from None

    def receive(op: int, peer: int, tag: int, nbytes: int) -> None:
        # Empty messages (pieces of zero-size shards) are not sent: gloo may drop a zero-byte send.
        if nbytes == 0:
            completions.put((("received", op, None), None))
            return
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        wait_for(peer, irecv(buffer, peer, tag), "recv", ("received", op, buffer), buffer)

    def post(actions: List[Any]) -> None:
        for action in actions:
            op, kind, peer, tag, nbytes = action.op, action.kind, action.peer, action.tag, action.nbytes
            if kind == "recv":
                if nbytes < 0:
                    size = torch.zeros(1, dtype=torch.int64)
                    wait_for(peer, irecv(size, peer, tag + 1), "recv", ("size", op, peer, tag, size), size)
                else:
                    receive(op, peer, tag, nbytes)
                continue
            if kind == "send_framed":
                size = torch.tensor([nbytes], dtype=torch.int64)
                wait_for(peer, isend(size, peer, tag + 1), "send", None, size)
            if nbytes == 0:
                completions.put((("sent", op), None))
                continue
            data = _host_view(action.address, nbytes)
            buffer = data if device.type == "cpu" else data.to(device)
            wait_for(peer, isend(buffer, peer, tag), "send", ("sent", op), buffer)

    waited = 0.0
    try:
        post(exchange.start())
        while exchange.waiting_on() is not None:
            idle = time.monotonic()
            try:
                done, error = completions.get(timeout=0.05)
            except queue.Empty:
                waited += time.monotonic() - idle
                # A peer that failed or stopped is named within seconds, not at the deadline.
                agreement.watch("exchanging its pieces", exchange.waiting_on() or [])
                if time.monotonic() > deadline + 5:
                    error, done = TimeoutError("no completion"), None
                else:
                    continue
            else:
                waited += time.monotonic() - idle
            if isinstance(error, TimeoutError):
                raise TesseraError(
                    f"rank {rank}: the exchange over the process group timed out after {timeout:g} s "
                    f"(waiting on the messages of ranks {exchange.waiting_on() or []})"
                )
            if error is not None:
                raise error
            if done is None:
                continue
            if done[0] == "sent":
                post(exchange.sent(done[1]))
            elif done[0] == "size":
                _kind, op, peer, tag, size = done
                receive(op, peer, tag, int(size.item()))
            else:
                _kind, op, buffer = done
                if buffer is None:
                    post(exchange.received(op, None, 0, 0))
                else:
                    data = buffer if buffer.device.type == "cpu" else buffer.cpu()
                    post(exchange.received(op, data, data.data_ptr(), data.numel()))
        # Every operation posted has completed (the protocol heard of each that mattered; a
        # framed length went before its message): let their waiters return before the caller
        # may tear the group down under them.
        for waiter in waiters:
            waiter.join(max(0.0, deadline - time.monotonic()) + 1)
        return waited
    except BaseException:
        # Peers whose shares this rank did not copy hear so now, and fail at once naming it.
        try:
            works = [
                dist.isend(_host_view(a.address, a.nbytes).clone(), dst=global_rank(a.peer), group=group, tag=a.tag)
                for a in exchange.farewell()
            ]
            for work in works:
                work.wait(timedelta(seconds=2))
        except Exception:  # the failure being raised is the one to report
            pass
        raise


def _run_rounds(load: Any, agreement: Any, actions: List[Any], progress: Any) -> None:
    """Pumps the load job's rounds (``tessera_ops::job``, in Rust: requests, memory tier, plan,
    plan agreement, read, joint checks) over the job's store until they hand over to the
    exchange. Rust decides every round and does its local work; this moves the keys: what to
    put, where every rank must arrive, what to fetch or wait for. A failure the rounds report
    is published under its step (every other rank raises naming this one) and raised here."""
    step = "preparing its requests"
    while True:
        event, values = "", []
        for action in actions:
            kind, step = action.kind, action.step
            if kind == "put":
                agreement.put(action.key, action.value, step)
            elif kind == "arrive":
                agreement.arrive(action.key, step)
                event = "arrived"
            elif kind == "get":
                event, values = "got", agreement.fetch(action.keys, step)
            elif kind == "await":
                event, values = "got", [agreement.await_key(action.key, step)]
            elif kind == "read":
                try:
                    folds = load.read(progress)
                except Exception as e:
                    agreement.fail_once(step, e)
                    raise
                event, values = "read", [bytes(folds)]
            elif kind == "exchange":
                return
            else:  # "fail": this rank's failure in `step`
                error = TesseraError(action.message)
                agreement.fail(step, error)
                raise error
        try:
            actions = load.job_step(event, values)
        except BaseException as e:  # Ctrl-C, or cancelled because another rank failed
            agreement.fail_once(step, e)
            raise


def load_over_group(
    opened: Any,
    targets: list,
    group: Any,
    *,
    verify: bool,
    server: Optional[str],
    server_id: Optional[str],
    token: Optional[str],
    timeout: float,
    progress: Optional[Callable[[int, int], None]],
    read_order: Optional[str] = None,
    memory_tier: Optional[str] = None,
) -> dict:
    """One rank's load over ``group`` (see the module docs). Returns the rank's report."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    backend = str(dist.get_backend(group)).lower()
    # An NCCL-only group moves device memory; any group with gloo (``cpu:gloo,cuda:nccl`` too)
    # moves host memory, where tessera placed what it read.
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    load = None
    agreement = _agreement.for_group(
        group, rank, world, timeout, on_failure=lambda reason: load is not None and load.cancel(reason)
    )
    # From here every failure is this load's, published through its agreement.
    _pending.load = None
    with agreement:
        try:
            load = _tessera.group_load(opened, targets, rank, world, verify, memory_tier)
            # Direct copies between ranks of one host where the group moves host memory.
            actions = load.job_start(server=server, server_id=server_id, token=token,
                                     read_order=read_order, direct=device.type == "cpu")
        except Exception as e:
            agreement.fail("preparing its requests", e)
            raise
        _run_rounds(load, agreement, actions, progress)

        started = time.monotonic()
        deadline = started + timeout
        global_rank = lambda r: dist.get_global_rank(group, r) if group is not dist.group.WORLD else r  # noqa: E731
        exchange = load.exchange()
        try:
            waited = _drive(exchange, dist, group, rank, device, global_rank, timeout, deadline, agreement)
        except Exception as e:
            agreement.fail_once("exchanging its pieces", e)
            raise
        finally:
            # Peers still copying out of this rank's arrays fail from here on rather than keep
            # bytes of arrays the caller may change.
            exchange.close()
    # With the memory-tier copies not taken (or read from storage after all), each with why.
    return json.loads(load.finish(time.monotonic() - started, waited))


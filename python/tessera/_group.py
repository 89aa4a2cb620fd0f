"""Loading as one job over the job's own ``torch.distributed`` process group.

The ranks all-gather their requests over the group, each plans the whole job (the planner is
deterministic: every rank gets the same plan), reads its own pieces from storage, and the ring
exchange's messages move with torch's point-to-point ops on the same group: gloo for CPU groups,
NCCL (messages staged in device memory) for NCCL-only groups. No second rendezvous, no extra port.

Failures are agreed on: after planning and after reading, the ranks all-gather their status, so a
rank that failed is named on every rank instead of leaving the others waiting for its messages.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _tessera
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


def _agree(
    dist: Any, group: Any, world: int, rank: int, step: str, error: Optional[BaseException], payload: Any = None
) -> List[Any]:
    """All-gathers every rank's status after ``step`` (with ``payload``, returned in rank order
    when every rank succeeded); raises on every rank if any rank failed, naming the first failed
    rank and its error."""
    status: List[Any] = [None] * world
    mine = (None if error is None else f"{type(error).__name__}: {error}", payload)
    dist.all_gather_object(status, mine, group=group)
    failed = [(r, s[0]) for r, s in enumerate(status) if s[0] is not None]
    if error is not None:
        raise error
    if failed:
        r, message = failed[0]
        others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise TesseraError(f"rank {rank}: rank {r}{others} failed {step}: {message}")
    return [s[1] for s in status]


def _message_tags(messages: List[Tuple[int, int, int, int]]) -> List[int]:
    """A tag per message: its index among this rank's messages with the same peer, ordered by
    (exchange group, round), the parts of one round's share in their order (a stable sort).
    Sender and receiver both order a pair's messages that way, so tags match without carrying
    tessera's 64-bit tags through torch's int tags."""
    by_peer: Dict[int, List[int]] = {}
    for i, (peer, _bytes, group, rnd) in enumerate(messages):
        by_peer.setdefault(peer, []).append(i)
    tags = [0] * len(messages)
    for indices in by_peer.values():
        for tag, i in enumerate(sorted(indices, key=lambda i: (messages[i][2], messages[i][3]))):
            tags[i] = tag
    return tags


def _direct_pairs(
    dist: Any, group: Any, world: int, rank: int, load: Any, incoming: list, outgoing: list, device: Any
) -> Tuple[set, set]:
    """Which peers this rank copies shares from, and which copy from it: every rank all-gathers
    its hello (pid and exchange token, or that it declines), says which senders' memory it can
    read, and all-gathers that too. Ranks on one host then skip the group's sockets entirely
    (tessera_loader::cross_memory). NCCL-only groups keep to messages."""
    if device.type != "cpu":
        return set(), set()
    hellos: List[Any] = [None] * world
    dist.all_gather_object(hellos, load.hello(), group=group)
    senders = sorted({peer for peer, nbytes, _g, _r in incoming if nbytes > 0})
    readable = [peer for peer in senders if load.answer(peer, hellos[peer])]
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, readable, group=group)
    receivers = {peer for peer, nbytes, _g, _r in outgoing if nbytes > 0}
    return set(readable), {peer for peer in receivers if rank in everyone[peer]}


def _wait_all(pending: list, rank: int, timeout: float, deadline: float) -> None:
    """Waits for every ``(work, kind, peer, on_done)`` of ``pending``, calling ``on_done()`` as
    each completes. gloo completes point-to-point work only inside wait(), which blocks without
    seeing signals: a helper thread waits (so a message is placed as it arrives, while later ones
    are in flight) and this thread joins it in short steps, so Ctrl-C and the deadline are seen
    here."""
    outcome: Dict[str, Any] = {}

    def wait() -> None:
        try:
            for work, kind, peer, on_done in pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{kind} with rank {peer}")
                try:
                    work.wait(timedelta(seconds=left))
                except RuntimeError as e:
                    raise TesseraError(
                        f"rank {rank}: the exchange over the process group failed while it "
                        f"{'received from' if kind == 'recv' else 'sent to'} rank {peer}: {e}"
                    ) from None
                if on_done is not None:
                    on_done()
        except BaseException as e:  # handed to the joining thread
            outcome["error"] = e

    waiter = threading.Thread(target=wait, name="tessera-exchange", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.05)
        if waiter.is_alive() and time.monotonic() > deadline + 5:
            break
    if waiter.is_alive() or isinstance(outcome.get("error"), TimeoutError):
        raise TesseraError(
            f"rank {rank}: the exchange over the process group timed out after {timeout:g} s "
            f"(waiting on the messages of ranks {sorted({p for _w, _k, p, _d in pending})})"
        )
    if "error" in outcome:
        raise outcome["error"]


def _exchange(
    dist: Any, group: Any, rank: int, load: Any, device: Any, incoming: list, outgoing: list,
    in_tags: List[int], out_tags: List[int], copy_from: set, copied_by: set,
    global_rank: Callable[[int], int], timeout: float, deadline: float,
) -> None:
    """The ring's messages over the group. A message between ranks that copy directly goes in
    three steps (each a tag of its own): the descriptor's size, the descriptor (the receiver
    copies the share out of the sender's arrays on arrival), and the receiver's acknowledgement,
    until which the sender keeps its arrays. Every other message is its bytes."""
    import torch

    def tag(t: int, step: int) -> int:
        return t * 4 + step

    def isend(buffer: Any, peer: int, t: int) -> Any:
        return dist.isend(buffer, dst=global_rank(peer), group=group, tag=t)

    def irecv(buffer: Any, peer: int, t: int) -> Any:
        return dist.irecv(buffer, src=global_rank(peer), group=group, tag=t)

    step1, step2, step3 = [], [], []  # (work, kind, peer, on_done)
    sizes: Dict[int, Any] = {}
    descriptors: Dict[int, Any] = {}
    # Empty messages (pieces of zero-size shards) are not sent: gloo may drop a zero-byte send.
    for i, (peer, nbytes, _g, _r) in enumerate(incoming):
        if nbytes == 0:
            load.place(i, 0, 0)
        elif peer in copy_from:
            sizes[i] = torch.zeros(1, dtype=torch.int64)
            step1.append((irecv(sizes[i], peer, tag(in_tags[i], 1)), "recv", peer, None))
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

            def place(i: int = i, buffer: Any = buffer) -> None:
                data = buffer if buffer.device.type == "cpu" else buffer.cpu()
                load.place(i, data.data_ptr(), data.numel())

            step1.append((irecv(buffer, peer, tag(in_tags[i], 0)), "recv", peer, place))
    for i, (peer, nbytes, _g, _r) in enumerate(outgoing):
        if nbytes > 0 and peer in copied_by:
            descriptors[i] = torch.frombuffer(bytearray(load.describe(i)), dtype=torch.uint8)
            size = torch.tensor([descriptors[i].numel()], dtype=torch.int64)
            step1.append((isend(size, peer, tag(out_tags[i], 1)), "send", peer, None))
            continue
        host = torch.empty(nbytes, dtype=torch.uint8)
        load.gather(i, host.data_ptr(), nbytes)
        if nbytes == 0:
            continue
        buffer = host if device.type == "cpu" else host.to(device)
        step1.append((isend(buffer, peer, tag(out_tags[i], 0)), "send", peer, None))
    _wait_all(step1, rank, timeout, deadline)
    if not sizes and not descriptors:
        return

    for i, descriptor in descriptors.items():
        peer = outgoing[i][0]
        step2.append((isend(descriptor, peer, tag(out_tags[i], 2)), "send", peer, None))
    # A failed copy is acknowledged as failed (its sender then fails at once instead of at the
    # deadline) and raised once every acknowledgement is out.
    failed: Dict[int, BaseException] = {}
    for i, size in sizes.items():
        peer = incoming[i][0]
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)

        def copy(i: int = i, buffer: Any = buffer) -> None:
            try:
                load.copy(i, buffer.data_ptr(), buffer.numel())
            except Exception as e:
                failed[i] = e

        step2.append((irecv(buffer, peer, tag(in_tags[i], 2)), "recv", peer, copy))
    _wait_all(step2, rank, timeout, deadline)

    acks: Dict[int, Any] = {}
    for i in sizes:
        peer = incoming[i][0]
        ack = torch.full((1,), 0 if i in failed else 1, dtype=torch.uint8)
        step3.append((isend(ack, peer, tag(in_tags[i], 3)), "send", peer, None))
    for i in descriptors:
        peer = outgoing[i][0]
        acks[i] = torch.zeros(1, dtype=torch.uint8)

        def acknowledged(i: int = i, peer: int = peer) -> None:
            if int(acks[i].item()) != 1:
                raise TesseraError(
                    f"rank {rank}: rank {peer} could not copy its share (message {i}) out of this "
                    f"rank's memory; it names why"
                )

        step3.append((irecv(acks[i], peer, tag(out_tags[i], 3)), "recv", peer, acknowledged))
    _wait_all(step3, rank, timeout, deadline)
    if failed:
        raise next(iter(failed.values()))


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
    error: Optional[BaseException] = None
    try:
        load = _tessera.group_load(opened, targets, rank, world, verify)
        mine = load.requests_json()
    except Exception as e:  # every rank must reach the all-gather below
        error, mine = e, "[]"
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    outgoing: List[Tuple[int, int, int, int]] = []
    incoming: List[Tuple[int, int, int, int]] = []
    if error is None:
        try:
            outgoing, incoming = load.plan(gathered, True, server, server_id, token, read_order)
        except Exception as e:
            error = e
    _agree(dist, group, world, rank, "planning", error)

    folds = b""
    try:
        load.read(progress)
        # This rank's folds of saved boxes several ranks read in parts ride on the agreement;
        # every rank then checks the boxes it holds bytes of before anything is exchanged.
        folds = load.joint_folds()
    except KeyboardInterrupt:
        raise
    except Exception as e:
        error = e
    everyone = _agree(dist, group, world, rank, "reading its pieces", error, folds)
    try:
        load.check_joint(everyone)
    except Exception as e:
        error = e
    _agree(dist, group, world, rank, "checking the saved boxes read in parts", error)

    started = time.monotonic()
    deadline = started + timeout
    global_rank = lambda r: dist.get_global_rank(group, r) if group is not dist.group.WORLD else r  # noqa: E731
    in_tags, out_tags = _message_tags(incoming), _message_tags(outgoing)
    copy_from, copied_by = _direct_pairs(dist, group, world, rank, load, incoming, outgoing, device)
    try:
        _exchange(
            dist, group, rank, load, device, incoming, outgoing, in_tags, out_tags,
            copy_from, copied_by, global_rank, timeout, deadline,
        )
    finally:
        # Peers still copying out of this rank's arrays fail from here on rather than keep
        # bytes of arrays the caller may change.
        load.close()
    return json.loads(load.finish(time.monotonic() - started))


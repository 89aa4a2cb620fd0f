"""Type hints of the native module (python/src). Use the `tessera` package's API instead."""

from typing import Any, Callable, List, Optional, Sequence, Tuple

class TesseraError(Exception): ...

def version() -> str: ...
def inspect(checkpoint: str, storage_env: Sequence[Tuple[str, str]]) -> str: ...
def plan(
    checkpoint: str,
    layout_json: Optional[str],
    requests_json: Optional[str],
    rank: Optional[int],
    dedup: bool,
    storage_env: Sequence[Tuple[str, str]],
) -> str: ...
class OpenedCheckpoint:
    @property
    def location(self) -> str: ...
    @property
    def format(self) -> str: ...
    @property
    def step(self) -> Optional[int]: ...
    @property
    def warnings(self) -> List[str]: ...
    def entries(self) -> str: ...
    def dcp_record(self) -> str: ...
    def chunks(self) -> str: ...
    def read_objects(self, keys: Sequence[str]) -> list[bytes]: ...

def open_checkpoint(checkpoint: str, storage_env: Sequence[Tuple[str, str]]) -> OpenedCheckpoint: ...

class LoadTarget:
    """One state-dict entry to load into, built by keyword; a field of the wrong type or missing
    raises TypeError naming the entry and the field."""

    fqn: str
    dtype: str
    shape: List[int]
    offsets: Optional[List[int]]
    flat_start: Optional[int]
    address: int
    nbytes: int
    cuda_device: Optional[int]
    def __init__(
        self,
        *,
        fqn: str,
        dtype: str,
        shape: Sequence[int],
        address: int,
        nbytes: int,
        offsets: Optional[Sequence[int]] = None,
        flat_start: Optional[int] = None,
        cuda_device: Optional[int] = None,
    ) -> None: ...

class LoadRequest:
    """What a load of one rank asks besides its entries; every field has a default."""

    rank: int
    world: int
    rendezvous: Optional[Tuple[str, int]]
    server: Optional[str]
    checkpoint_id: Optional[str]
    token: Optional[str]
    verify: bool
    dedup: bool
    timeout_s: float
    read_order: Optional[str]
    memory_tier: Optional[str]
    def __init__(self) -> None: ...

def load_into(
    checkpoint: OpenedCheckpoint,
    targets: Sequence[LoadTarget],
    request: LoadRequest,
    progress: Optional[Callable[[int, int], None]] = None,
) -> str: ...
def rendezvous_endpoint(master_addr: Optional[str], master_port: Optional[int]) -> Optional[Tuple[str, int]]: ...

class HeldBox:
    """One box a saving rank holds, built by keyword; a field of the wrong type or missing raises
    TypeError naming the entry and the field."""

    fqn: str
    dtype: str
    global_shape: List[int]
    offsets: List[int]
    lengths: List[int]
    address: int
    nbytes: int
    def __init__(
        self,
        *,
        fqn: str,
        dtype: str,
        global_shape: Sequence[int],
        offsets: Sequence[int],
        lengths: Sequence[int],
        address: int,
        nbytes: int,
    ) -> None: ...

class SaveRequest:
    """What a save of one rank asks besides where and what; every field has a default."""

    rank: int
    world: int
    rendezvous: Optional[Tuple[str, int]]
    step: Optional[int]
    storage_env: List[Tuple[str, str]]
    break_claim: bool
    timeout_s: float
    memory_tier: Optional[Tuple[str, int, Optional[int]]]
    def __init__(self) -> None: ...

def save(
    path: str,
    boxes: Sequence[HeldBox],
    objects: Sequence[Tuple[str, bytes]],
    request: SaveRequest,
) -> str: ...

class PublishRequest:
    """What one rank's part of a live publication's step needs besides its boxes."""

    name: str
    step: int
    rank: int
    world: int
    host: str
    share_memory: bool
    def __init__(self) -> None: ...

def publish_part(
    step_dir: str,
    boxes: Sequence[HeldBox],
    objects: Sequence[Tuple[str, bytes]],
    request: PublishRequest,
) -> str: ...
def commit_publication(step_dir: str, world: int, step: int, timeout_s: float) -> str: ...
def unpublish(path: str) -> bool: ...
def damage_publication(path: str, offset: int) -> None:
    """``fault-injection`` builds only."""

def hold_publication(path: str, hold: bool) -> int:
    """``fault-injection`` builds only."""

def canonical_dtype(name: str) -> Optional[str]: ...

class JobAction:
    """A step of the job's rounds for the Python pump: kind "put", "arrive", "get", "await",
    "read", "exchange" or "fail"."""

    kind: str
    key: str
    keys: List[str]
    value: Optional[bytes]
    step: str
    message: str

class ExchangeAction:
    """An operation of the exchange for the Python driver: kind "send", "send_framed" or "recv"."""

    op: int
    kind: str
    peer: int
    tag: int
    nbytes: int
    address: int

class GroupExchange:
    """The exchange of one rank's process-group load, driven by the Python layer."""

    def start(self) -> List[ExchangeAction]: ...
    def sent(self, operation: int) -> List[ExchangeAction]: ...
    def received(self, operation: int, buffer: Any, address: int, nbytes: int) -> List[ExchangeAction]: ...
    def waiting_on(self) -> Optional[List[int]]: ...
    def farewell(self) -> List[ExchangeAction]: ...
    def close(self) -> None: ...

class GroupLoad:
    """One rank's load whose rounds and exchange the Python layer runs over a torch process group."""

    def job_start(
        self,
        *,
        server: Optional[str] = None,
        server_id: Optional[str] = None,
        token: Optional[str] = None,
        read_order: Optional[str] = None,
        direct: bool = False,
    ) -> List[JobAction]: ...
    def job_step(self, event: str, values: Sequence[Optional[bytes]]) -> List[JobAction]: ...
    def read(self, progress: Optional[Callable[[int, int], None]] = None) -> bytes: ...
    def exchange(self) -> GroupExchange: ...
    def cancel(self, reason: str) -> None: ...
    def finish(self, exchange_seconds: float, exchange_wait_seconds: float) -> str: ...

def group_load(
    checkpoint: OpenedCheckpoint,
    targets: Sequence[LoadTarget],
    rank: int,
    world: int,
    verify: bool,
    memory_tier: Optional[str] = None,
) -> GroupLoad: ...

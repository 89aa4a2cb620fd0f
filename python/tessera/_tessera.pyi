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
    def entries(self) -> str: ...
    def chunks(self) -> str: ...
    def read_objects(self, keys: Sequence[str]) -> list[bytes]: ...

def open_checkpoint(checkpoint: str, storage_env: Sequence[Tuple[str, str]]) -> OpenedCheckpoint: ...
def load_into(
    checkpoint: OpenedCheckpoint,
    targets: Sequence[
        Tuple[
            str, str, Sequence[int], Optional[Sequence[int]], Optional[int], int, int, Optional[int]
        ]
    ],
    rank: int,
    world: int,
    rendezvous: Optional[Tuple[str, int]],
    server: Optional[str],
    checkpoint_id: Optional[str],
    token: Optional[str],
    verify: bool,
    dedup: bool,
    timeout_s: float,
    progress: Optional[Callable[[int, int], None]],
    read_order: Optional[str] = None,
    memory_tier: Optional[str] = None,
) -> str: ...
def rendezvous_endpoint(master_addr: Optional[str], master_port: Optional[int]) -> Optional[Tuple[str, int]]: ...
def save(
    path: str,
    boxes: Sequence[Tuple[str, str, Sequence[int], Sequence[int], Sequence[int], int, int]],
    objects: Sequence[Tuple[str, bytes]],
    rank: int,
    world: int,
    rendezvous: Optional[Tuple[str, int]],
    step: Optional[int],
    storage_env: Sequence[Tuple[str, str]],
    break_claim: bool,
    timeout_s: float,
    memory_tier: Optional[Tuple[str, int, Optional[int]]] = None,
) -> str: ...

def canonical_dtype(name: str) -> Optional[str]: ...

class GroupLoad:
    """One rank's load whose exchange the Python layer runs over a torch process group."""

    def requests_json(self) -> str: ...
    def job_terms_json(
        self, server: Optional[str] = None, server_id: Optional[str] = None, read_order: Optional[str] = None
    ) -> str: ...
    def check_job_terms(self, all: Sequence[str]) -> None: ...
    def plan_digests(self) -> bytes: ...
    def check_plan_digests(self, all: Sequence[bytes]) -> None: ...
    def plan(
        self,
        all_requests: Sequence[str],
        dedup: bool,
        server: Optional[str] = None,
        server_id: Optional[str] = None,
        token: Optional[str] = None,
        read_order: Optional[str] = None,
        direct: bool = False,
        tier_offers: Optional[Sequence[str]] = None,
        tier_verified: Optional[Sequence[str]] = None,
    ) -> None: ...
    def tier_offer_json(self) -> str: ...
    def verify_tier(self, offers: Sequence[str]) -> str: ...
    def tier_ignored(self) -> List[str]: ...
    def read(self, progress: Optional[Callable[[int, int], None]] = None) -> bytes: ...
    def check_joint(self, folds: Sequence[bytes]) -> None: ...
    # Actions: (operation id, kind 0 send / 1 framed send / 2 receive, peer, pair tag, bytes
    # (-1: framed receive), address of a send's bytes).
    def exchange_start(self) -> list[Tuple[int, int, int, int, int, int]]: ...
    def exchange_sent(self, operation: int) -> list[Tuple[int, int, int, int, int, int]]: ...
    def exchange_received(
        self, operation: int, buffer: Any, address: int, nbytes: int
    ) -> list[Tuple[int, int, int, int, int, int]]: ...
    def exchange_done(self) -> bool: ...
    def exchange_waiting_on(self) -> list[int]: ...
    def exchange_farewell(self) -> list[Tuple[int, int, int, int, int, int]]: ...
    def close(self) -> None: ...
    def finish(self, exchange_seconds: float, exchange_wait_seconds: float) -> str: ...

def group_load(
    checkpoint: OpenedCheckpoint,
    targets: Sequence[
        Tuple[
            str, str, Sequence[int], Optional[Sequence[int]], Optional[int], int, int, Optional[int]
        ]
    ],
    rank: int,
    world: int,
    verify: bool,
    memory_tier: Optional[str] = None,
) -> GroupLoad: ...

"""Shared helpers of the tessera Python tests: the torch-written fixtures and NumPy arrays."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("TESSERA_DCP_FIXTURES", REPO / ".." / "shared" / "fixtures" / "dcp"))

DCP_FIXTURES = ["a_w1_plain", "b_w4_fsdp_shard0", "c_w4_dp2_tp2", "e_w2_fsdp2_adamw"]
LAYOUTS = ["w2_shard1", "w3_shard0"]

DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int64": np.int64,
    "float64": np.float64,
    "int32": np.int32,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def fixture(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"fixture {path} is missing (set TESSERA_DCP_FIXTURES)")
    return path


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def empty(dtype: str, shape) -> np.ndarray:
    # Filled with a pattern, not zeros, so a byte tessera failed to write cannot pass by luck.
    array = np.empty(tuple(shape), dtype=DTYPES[dtype])
    array.reshape(-1).view(np.uint8)[:] = 0xA5
    return array


def expected_tensors(name: str) -> dict:
    """fqn -> {dtype, shape, sha256} of a fixture's expected.json (every layout of it)."""
    doc = json.loads((fixture(name) / "expected.json").read_text())
    if "entries_by_dir" in doc:
        entries = {}
        for per_dir in doc["entries_by_dir"].values():
            entries.update(per_dir)
    else:
        entries = doc["entries"]
    return {k: v for k, v in entries.items() if v.get("kind", "tensor") == "tensor"}


def reference(name: str, layout: str) -> dict:
    return json.loads((fixture(name) / f"reference_{layout}.json").read_text())


def rank_state(ref: dict, rank: int) -> dict:
    """Rank `rank`'s state dict for a reference layout: an `(array, global offsets)` pair per
    tensor, of torch's local shape."""
    return {
        fqn: (empty(t["dtype"], t["ranks"][rank]["local_shape"]), t["ranks"][rank]["global_offset"])
        for fqn, t in ref["tensors"].items()
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> tuple:
    """``n`` distinct free ports (held at once while chosen, so no two are the same): e.g. torch's
    store and tessera's rendezvous, rather than trusting that the port after torch's is free."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return tuple(s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()


TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
S3_SERVER = Path(
    os.environ.get("TESSERA_S3_TEST_SERVER", TARGET / "debug" / "examples" / "s3_test_server")
)


class S3Server(tuple):
    """(root directory, client environment) of the test server, plus its own account of what it
    served to GETs (counted at the server, not by the client)."""

    proc = None

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def served(self, prefix: str = "") -> dict:
        """``{"get_requests", "get_body_bytes"}`` for URI paths (``/bucket/key``) under ``prefix``."""
        return self._ask(f"served {prefix}")

    def reset(self) -> None:
        self._ask("reset")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server on 127.0.0.1 (the loader's s3s-fs test server as a process,
    built by `make python-test`): yields an S3Server, which unpacks as (root directory, client
    environment)."""
    import subprocess

    if not S3_SERVER.exists():
        pytest.fail(
            f"{S3_SERVER} is missing: build it with `cargo build -p tessera-storage --features testing --example s3_test_server`"
        )
    root = tmp_path_factory.mktemp("s3")
    proc = subprocess.Popen(
        [str(S3_SERVER), str(root), "ckpts"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"{S3_SERVER} exited with {proc.wait()} before serving")
        server = S3Server((root, json.loads(line)))
        server.proc = proc
        yield server
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # The test server shuts down gracefully, waiting for its clients' idle keep-alive
            # connections; one still held open by this process keeps it waiting: end it.
            proc.kill()
            proc.wait(timeout=10)


TESSERA_BIN = Path(os.environ.get("TESSERA_BIN", TARGET / "debug" / "tessera"))


@pytest.fixture
def plan_server(tmp_path):
    """`tessera serve` on a free loopback port over a catalog root (built by `make python-test`):
    yields (catalog root, URL)."""
    import re
    import subprocess

    if not TESSERA_BIN.exists():
        pytest.fail(f"{TESSERA_BIN} is missing: build it with `cargo build --bin tessera`")
    root = tmp_path / "catalog"
    root.mkdir()
    proc = subprocess.Popen(
        [str(TESSERA_BIN), "serve", "--root", str(root), "--addr", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = proc.stdout.readline()
        found = re.search(r"listening on (http://\S+)", line)
        if not found:
            pytest.fail(f"tessera serve did not start: {line!r}, exit {proc.poll()}")
        yield root, found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Multi-process gloo jobs whose key-value store is hosted outside the ranks, as torchrun's agent
# hosts it (a rank that ends or dies does not take the store down).


def job_store(world: int):
    """The job's store, in this (the test's) process; its ``port`` is what ranks join."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


def join_job(rank: int, world: int, port: int, group_timeout: float = 60.0) -> None:
    """In a rank's process: the gloo default group over the job's store at ``port``."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=group_timeout)
    )


def reshard_rank(rank: int, port: int, world: int, root: str, tensors: int, group_timeout: float, out: str) -> None:
    """One rank of the issue's reshard over a real gloo job (a ``run_job`` target): saves
    ``tensors`` float32 DTensors [64, 256] Shard(0) with ``dcp.save``, loads them back as
    Shard(1) with ``tessera.load`` over the job's group, counting what tessera's rounds read
    from and write to the store. Writes ``out/rank<r>.json``: bytes read and written, store
    calls, bytes by kind of key, the load's seconds and whether every value is what was saved.
    The test (python/tests/test_group_scale.py) and the bench (benches/group_store_bytes.py)
    both run it."""
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tessera

    rows, cols = 64, 256
    join_job(rank, world, port, group_timeout=group_timeout)
    mesh = init_device_mesh("cpu", (world,))
    full = {f"layers.{i}.weight": torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + i
            for i in range(tensors)}
    dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, checkpoint_id=root)
    dist.barrier()
    wanted = {k: distribute_tensor(torch.zeros(rows, cols), mesh, [Shard(1)]) for k in full}
    counters = counting_agreements()
    started = time.monotonic()
    tessera.load(wanted, root, progress=False, timeout=120)
    seconds = time.monotonic() - started
    part = slice(rank * cols // world, (rank + 1) * cols // world)
    right = all(np.array_equal(wanted[k].to_local().numpy(), full[k][:, part].numpy()) for k in full)
    store = counters[0]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"read": store.read, "written": store.written, "calls": store.calls, "right": right, "seconds": seconds,
         "by_kind": store.by_kind, "written_by_kind": store.written_by_kind}
    ))
    dist.barrier()
    dist.destroy_process_group()


def run_job(target, world: int, args: tuple, out: Path, timeout: float = 120) -> dict:
    """Runs ``target(rank, port, *args, out)`` in ``world`` spawned rank processes over one job
    store; each writes ``out/rank<r>.json``. Returns those documents by rank; every rank must
    exit 0 within ``timeout`` seconds."""
    import multiprocessing as mp

    store = job_store(world)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, store.port, *args, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


class CountingStore:
    """A job's c10d store that counts what goes through it: calls, bytes read and written, and
    bytes read by kind of key (the part after tessera's load prefix ``tessera/<group>/<n>/``,
    rank numbers left out). Wrap the store of a load's agreement with ``counting_agreements``."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls = self.read = self.written = 0
        self.by_kind: dict = {}
        self.written_by_kind: dict = {}

    @staticmethod
    def _kind(key) -> str:
        key = key.decode() if isinstance(key, bytes) else key
        return "/".join(p for p in key.split("/")[3:] if not p.isdigit()) or key

    def _count(self, key, n: int) -> None:
        kind = self._kind(key)
        self.read += n
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n

    def set(self, key, value):
        self.calls += 1
        self.written += len(key) + len(value)
        kind = self._kind(key)
        self.written_by_kind[kind] = self.written_by_kind.get(kind, 0) + len(key) + len(value)
        return self._inner.set(key, value)

    def get(self, key):
        self.calls += 1
        value = self._inner.get(key)
        self._count(key, len(value))
        return value

    def multi_get(self, keys):
        self.calls += 1
        values = self._inner.multi_get(keys)
        for key, value in zip(keys, values):
            self._count(key, len(value))
        return values

    def check(self, keys):
        self.calls += 1
        return self._inner.check(keys)

    def add(self, key, amount):
        self.calls += 1
        self.written += len(key) + 8
        self.read += 8
        return self._inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self.calls += 1
        self.written += len(key) + len(desired)
        value = self._inner.compare_set(key, expected, desired)
        self.read += len(value)
        return value


def counting_agreements() -> list:
    """In a rank's process: from now on every load's agreement goes through a ``CountingStore``;
    returns the list the stores are appended to, one per load."""
    from tessera import _agreement

    stores = []
    real = _agreement.for_group

    def counted(*args, **kwargs):
        agreement = real(*args, **kwargs)
        agreement._store = CountingStore(agreement._store)
        stores.append(agreement._store)
        return agreement

    _agreement.for_group = counted
    return stores

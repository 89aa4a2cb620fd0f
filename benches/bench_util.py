"""Helpers the Python benchmarks share: what a process read and holds, a free loopback port, a
warm page cache, and the S3 test server as a child process. Imported by the scripts next to it
(`python benches/<script>.py` puts this folder first on `sys.path`, and torch's spawned workers
inherit it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
# `cargo build --release --example s3_test_server`.
S3_TEST_SERVER = REPO / "target" / "release" / "examples" / "s3_test_server"


def rchar() -> int:
    """Bytes this process got from read syscalls so far (`/proc/self/io` rchar: page cache hits
    included, mapped reads not)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def rss_gib() -> float:
    """This process's resident memory now (VmRSS), GiB: a load must give back what it took."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def minor_faults() -> int:
    """Page faults this process has taken so far (first touches of fresh memory among them)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm(path: str) -> None:
    """Reads every file under `path` once so that the loads find them in the page cache."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


class S3TestServer:
    """The S3 test server (`storage/examples/s3_test_server.rs`) as a child process serving
    `root` as `bucket` on 127.0.0.1, optionally behind one link of `bytes_per_second`; `env` is
    what it printed (its endpoint and credentials), `ask` sends it one command line and returns
    its JSON answer (what it served)."""

    def __init__(self, root: Path, bucket: str, bytes_per_second: Optional[int] = None):
        rate = [] if bytes_per_second is None else ["--bytes-per-second", str(bytes_per_second)]
        self.proc = subprocess.Popen(
            [str(S3_TEST_SERVER), str(root), *rate, bucket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.env = json.loads(self.proc.stdout.readline())

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

"""Helpers the Python benchmarks share: what a process read and holds, a free loopback port, a
warm page cache, the realistic model shapes, the bytes `dcp.load` reads for a rank, and the S3
test server as a child process. Imported by the scripts next to it
(`python benches/<script>.py` puts this folder first on `sys.path`, and torch's spawned workers
inherit it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


def scaled(x: int, scale: int, what: str) -> int:
    if x % scale:
        sys.exit(f"--scale {scale} does not divide {what} ({x})")
    return x // scale


def tensor_specs(model: str, layers: int, scale: int, moments: bool) -> list:
    """[(fqn, shape, dtype)] of `layers` layers of `model` (llama8b, llama70b, moe; wide: 8
    float32 matrices), widths divided by `scale`: the parameters (bf16), then (with `moments`)
    their fp32 Adam moments. The realistic shapes of the benchmarks (BENCHMARKS.md headline)."""
    params = []
    if model == "wide":
        rows, cols = scaled(4096, scale, "rows"), scaled(16384, scale, "cols")
        params = [(f"layer{i}.weight", (rows, cols), "fp32") for i in range(8)]
    else:
        if model == "llama8b":
            hidden, heads, kv_heads, head, inter = 4096, 32, 8, 128, 14336
        elif model == "llama70b":
            hidden, heads, kv_heads, head, inter = 8192, 64, 8, 128, 28672
        else:  # moe
            hidden, heads, kv_heads, head, inter = 2048, 16, 4, 128, 1408
        hidden = scaled(hidden, scale, "hidden")
        head = scaled(head, scale, "head dim")
        inter = scaled(inter, scale, "intermediate")
        q, kv = heads * head, kv_heads * head
        for layer in range(layers):
            p = f"model.layers.{layer}."
            params += [
                (p + "input_layernorm.weight", (hidden,), "bf16"),
                (p + "self_attn.q_proj.weight", (q, hidden), "bf16"),
                (p + "self_attn.k_proj.weight", (kv, hidden), "bf16"),
                (p + "self_attn.v_proj.weight", (kv, hidden), "bf16"),
                (p + "self_attn.o_proj.weight", (hidden, q), "bf16"),
                (p + "post_attention_layernorm.weight", (hidden,), "bf16"),
            ]
            if model == "moe":
                params.append((p + "mlp.gate.weight", (32, hidden), "bf16"))
                for e in range(32):
                    x = f"{p}mlp.experts.{e}."
                    params += [
                        (x + "gate_proj.weight", (inter, hidden), "bf16"),
                        (x + "up_proj.weight", (inter, hidden), "bf16"),
                        (x + "down_proj.weight", (hidden, inter), "bf16"),
                    ]
            else:
                params += [
                    (p + "mlp.gate_proj.weight", (inter, hidden), "bf16"),
                    (p + "mlp.up_proj.weight", (inter, hidden), "bf16"),
                    (p + "mlp.down_proj.weight", (hidden, inter), "bf16"),
                ]
    specs = list(params)
    if moments:
        for which in ("exp_avg", "exp_avg_sq"):
            specs += [(f"optim.state.{name}.{which}", shape, "fp32") for name, shape, _ in params]
    return specs


def dcp_blob_bytes(path: str, state: dict) -> int:
    """Bytes torch's FileSystemReader (`dcp.load`) reads for this rank's `state` (DTensors) of
    the DCP checkpoint at `path`: the whole blob of every saved chunk that overlaps the rank's
    shard of each tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = dcp.FileSystemReader(path).read_metadata()
    total = 0
    for fqn, dt in state.items():
        (mine,) = dt.__create_chunk_list__()
        for chunk in md.state_dict_metadata[fqn].chunks:
            if all(
                co < mo + ms and mo < co + cs
                for co, cs, mo, ms in zip(chunk.offsets, chunk.sizes, mine.offsets, mine.sizes)
            ):
                total += md.storage_data[MetadataIndex(fqn, chunk.offsets)].length
    return total


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

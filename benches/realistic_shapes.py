"""The realistic benchmark set (issue 31): `tessera.load` against torch's own `dcp.load`
(FileSystemReader) on checkpoints shaped like the models people train, into the target layouts
people load them into, in one 4-process gloo job on 127.0.0.1; then the CLI (`tessera load
--transport tcp`, 4 rank processes) on the same files.

Checkpoints (`--model`, or MODEL; default ``llama8b``): written by torch's `dcp.save` in a 4-rank
gloo job as FSDP2-style Shard(0) DTensors (every tensor's rows split in 4; a 1-D tensor's elements
split in 4). Only the transformer layers (no embeddings, no lm_head, no final norm); `--layers N`
repeats the layer N times (``model.layers.{0..N-1}.*``):

* ``llama8b``: Llama-3-8B layers: hidden 4096, 32 q heads of 128, 8 kv heads, SwiGLU 14336.
  Per layer ``input_layernorm.weight`` [4096], ``self_attn.{q,o}_proj.weight`` [4096, 4096],
  ``self_attn.{k,v}_proj.weight`` [1024, 4096], ``post_attention_layernorm.weight`` [4096],
  ``mlp.{gate,up}_proj.weight`` [14336, 4096], ``mlp.down_proj.weight`` [4096, 14336]; bf16
  parameters (``model.layers.0.self_attn.q_proj.weight``) PLUS fp32 Adam moments of every
  parameter (``optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg`` and ``.exp_avg_sq``):
  218M parameters, 2.18 GB a layer.
* ``llama70b``: Llama-3-70B layers: hidden 8192, 64 q heads of 128, 8 kv heads (k/v
  [1024, 8192]), SwiGLU 28672; bf16 parameters only (`--moments` adds the fp32 Adam moments):
  856M parameters, 1.71 GB a layer.
* ``moe``: an MoE layer: GQA attention (q, o [2048, 2048], k, v [512, 2048]), two RMSNorms
  [2048], a router ``mlp.gate.weight`` [32, 2048] and 32 experts of DeepSeek-V2-Lite size, each
  its own 2-D tensors ``mlp.experts.{e}.{gate,up}_proj.weight`` [1408, 2048] and
  ``mlp.experts.{e}.down_proj.weight`` [2048, 1408]; bf16 parameters plus fp32 Adam moments:
  288M parameters, 2.88 GB a layer (0.58 GB of it parameters; `--no-moments` leaves the
  moments out).
* ``wide`` (the old best case of benches/torch_load.py, labelled "best case"): 8 float32
  [4096, 16384] tensors ``layer{i}.weight``, no moments: 2.15 GB.

Values: a cheap hash of each element's global index and its tensor's number, as bit patterns
(finite floats, every element of a 16384-element run distinct), so that a misplaced or wrong byte
changes the digest. `--scale K` (or SCALE) divides hidden, head, intermediate and expert sizes by K
(GQA ratios and expert count kept) for smoke tests.

Target layouts (`--layouts`, or LAYOUTS; default all four), pre-touched DTensor destinations
built with `DTensor.from_local(..., run_check=False, shape=..., stride=...)` and torch's
`compute_local_shape_and_global_offset`. The same placement rules (first matching glob wins, as
tessera's layout JSON does) make the torch job's destinations and the CLI's layout JSON:

* ``shard1``: Shard(1) on a 1-D mesh of 4 for every 2-D tensor; 1-D tensors (the RMSNorm weights
  and their moments) Shard(0); a 2-D tensor whose dim 1 does not divide by 4 (none at full size)
  Shard(0), or Replicate when dim 0 does not divide either.
* ``tp2dp2``: a (dp 2, tp 2) mesh, Replicate on dp and Shard(1) on tp; 1-D tensors (and any 2-D
  tensor whose dim 1 is odd) Replicate on dp, Shard(0) on tp.
* ``megatron_tp4``: Megatron tensor parallelism over a 1-D mesh of 4: column-parallel weights
  (q/k/v, gate/up, the experts' gate/up; every ``wide`` tensor) Shard(0) by rows, row-parallel
  weights (o_proj, down_proj, the experts' down_proj) Shard(1) by columns, RMSNorms and the router
  Replicate; Adam moments placed like their parameter.
* ``fsdp_world2``: FSDP at another world size, Shard(0) over a world of 2: inside the 4-process
  job a (2, 2) mesh with Shard(0) on the first dim and Replicate on the second, so ranks {0, 1}
  both hold the first half of every tensor's rows and ranks {2, 3} the second half: every rank
  loads half of every tensor.

Loads (METHODS; default "tessera,dcp.load"), interleaved: for each layout, for each repetition,
each method in turn:

* ``tessera``: ``tessera.load(state, dcp_dir, progress=False, timeout=600)``, default settings
  (the exchange over the job's gloo group, the default read order, verification on);
* ``dcp.load``: ``torch.distributed.checkpoint.load(state, checkpoint_id=dcp_dir)``;
* side runs (opt-in): ``tessera read_order=storage``, ``tessera read_order=request``.

Then the CLI (CLI; default "tessera CLI"; CLI="" leaves it out; TESSERA_BIN, default
target/release/tessera, and left out with a note when absent): ``tessera load DCP_DIR --layout
LAYOUT.json --transport tcp --quiet --report-json FILE`` with the layout's 4 ranks; its seconds
are the whole command's wall time (process start, planning, rendezvous and exchange included).
The timed CLI runs write nothing (no ``--dump``); one extra untimed run per layout with ``--dump``
gives the digests.

The page cache is warmed before the load job (every checkpoint file read once), so the loads read
from memory. Each rank runs `torch.set_num_threads(1)`. Destinations are allocated and written once
before each timed call (no first-touch page faults in any load). Seconds: the slowest rank's call
(every rank starts after a barrier); medians over repetitions. Bytes from storage: tessera's
reports' ``bytes_read`` summed over ranks (``bytes_fetched`` with the checksum-block extension in
parentheses); for dcp.load what FileSystemReader reads, from the checkpoint's metadata (the whole
``torch.save`` blob of every saved chunk a rank's shard overlaps). Exchanged: tessera's
``bytes_received`` summed over ranks. rchar: the growth of ``/proc/self/io``'s rchar over the call,
summed over ranks. "vs dcp.load": dcp.load's median over this row's, both measured in this run.

Every method's first repetition hashes each rank's local shards (sha256 per tensor, raw bytes,
bf16 included; the CLI's from its ``--dump`` safetensors), and the digests must agree across
methods; the first method's first repetition is also compared with the value formula, element
for element. A benchmark of wrong bytes fails (exit 1 naming the layout, rank and tensor; the
table is still printed, the checkpoint kept).

Results go to DATA/<model>/results.json (the checkpoint is DATA/<model>/dcp, reused when present
and written for the same shapes, deleted at the end unless `--keep`; other `--layers`, `--scale` or
moments than the default add to the name: DATA/llama8b-4layers, DATA/moe-nomoments-scale16).

Usage:
  python benches/realistic_shapes.py [--model llama8b|llama70b|moe|wide] [--layers N]
      [--layouts shard1,tp2dp2,megatron_tp4,fsdp_world2] [--repeats 3] [--data DIR] [--keep]
      [--moments | --no-moments] [--scale K]
Environment: MODEL, LAYOUTS, METHODS, CLI, TESSERA_BIN, SCALE, BENCH_DATA.
Memory: the page cache holds the checkpoint, the ranks' destinations up to twice its size
(tp2dp2, fsdp_world2), plus dcp.load's own copies of the blobs it reads: ``llama8b`` and ``moe``
at 1 layer and ``llama70b`` at 1 layer fit a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench_util import dcp_blob_bytes, free_port, rchar, rss_gib, tensor_specs, warm

WORLD = 4
MODELS = ("llama8b", "llama70b", "moe", "wide")
ALL_LAYOUTS = ("shard1", "tp2dp2", "megatron_tp4", "fsdp_world2")
# "tessera read_order=storage" / "tessera read_order=request" (opt-in): another read order.
METHODS = [m for m in os.environ.get("METHODS", "tessera,dcp.load").split(",") if m]
CLI_METHODS = [m for m in os.environ.get("CLI", "tessera CLI").split(",") if m]
TESSERA_BIN = os.environ.get("TESSERA_BIN", "target/release/tessera")

# Mesh per layout: "1d" = (4,), "2d" = (2, 2) row-major (last dim fastest, as torch's
# init_device_mesh and tessera's layout JSON number the ranks).
MESH = {"shard1": "1d", "tp2dp2": "2d", "megatron_tp4": "1d", "fsdp_world2": "2d"}
MESH_JSON = {
    "shard1": [{"name": "dp", "size": 4}],
    "tp2dp2": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}],
    "megatron_tp4": [{"name": "tp", "size": 4}],
    "fsdp_world2": [{"name": "dp", "size": 2}, {"name": "rep", "size": 2}],
}
# Readable pattern rules; `layout_rules` puts exact-name rules in front of them for any tensor
# they would place otherwise than `wanted` says (none at full size).
PATTERN_RULES = {
    "shard1": [("*norm.weight*", ["shard(0)"]), ("*", ["shard(1)"])],
    "tp2dp2": [("*norm.weight*", ["replicate", "shard(0)"]), ("*", ["replicate", "shard(1)"])],
    "megatron_tp4": [
        ("*norm.weight*", ["replicate"]),
        ("*.mlp.gate.weight*", ["replicate"]),
        ("*o_proj.weight*", ["shard(1)"]),
        ("*down_proj.weight*", ["shard(1)"]),
        ("*", ["shard(0)"]),
    ],
    "fsdp_world2": [("*", ["shard(0)", "replicate"])],
}

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


# ---------------------------------------------------------------------------------------------
# Shapes


def nbytes(shape, dtype: str) -> int:
    n = DTYPE_BYTES[dtype]
    for s in shape:
        n *= s
    return n


def describe(specs: list) -> list:
    """Lines grouping the tensors by name pattern (layer and expert numbers as *)."""
    import re

    groups: dict = {}
    for name, shape, dtype in specs:
        key = re.sub(r"(layers|experts)\.\d+\.", r"\1.*.", name)
        key = re.sub(r"^layer\d+\.", "layer*.", key)
        g = groups.setdefault((key, tuple(shape), dtype), [0, 0])
        g[0] += 1
        g[1] += nbytes(shape, dtype)
    return [
        f"  {key} {list(shape)} {dtype} x{count} = {total:,} bytes"
        for (key, shape, dtype), (count, total) in groups.items()
    ]


# ---------------------------------------------------------------------------------------------
# Layouts


def role(name: str) -> str:
    """norm, router, row (row-parallel: o_proj, down_proj) or col (everything else)."""
    if name.startswith("optim.state."):
        name = name[len("optim.state."):].rsplit(".", 1)[0]  # the parameter's name
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith(".mlp.gate.weight"):
        return "router"
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "row"
    return "col"


def wanted(layout: str, name: str, shape) -> list:
    """What the docstring says `layout` does with one tensor (the rules must agree)."""
    def div(d, k):
        return d < len(shape) and shape[d] % k == 0

    if layout == "shard1":
        if len(shape) == 2 and div(1, 4):
            return ["shard(1)"]
        return ["shard(0)"] if div(0, 4) else ["replicate"]
    if layout == "tp2dp2":
        if len(shape) == 2 and div(1, 2):
            return ["replicate", "shard(1)"]
        return ["replicate", "shard(0)" if div(0, 2) else "replicate"]
    if layout == "megatron_tp4":
        r = role(name)
        return ["replicate"] if r in ("norm", "router") else ["shard(1)"] if r == "row" else ["shard(0)"]
    if layout == "fsdp_world2":
        return ["shard(0)", "replicate"]
    raise ValueError(f"unknown layout {layout!r}")


def first_match(rules: list, name: str) -> list:
    """tessera's rule matching (planner/src/layout.rs): the first rule whose glob (`*`, `?`)
    matches the FQN; fnmatchcase is the same glob for names without `[`."""
    for pattern, placements in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return placements
    raise ValueError(f"no rule matches {name}")


def layout_rules(layout: str, specs: list) -> list:
    """[(glob, placements)], first match wins: exact names for the exceptions, then patterns."""
    patterns = PATTERN_RULES[layout]
    exceptions = []
    for name, shape, _ in specs:
        assert "[" not in name and "*" not in name and "?" not in name, name
        want = wanted(layout, name, shape)
        if first_match(patterns, name) != want:
            exceptions.append((name, want))
    rules = exceptions + patterns
    for name, shape, _ in specs:
        assert first_match(rules, name) == wanted(layout, name, shape), name
    return rules


def layout_json(layout: str, rules: list) -> dict:
    return {"mesh": MESH_JSON[layout], "rules": [{"match": g, "placements": p} for g, p in rules]}


def torch_placements(placements: list) -> list:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in placements:
        out.append(Replicate() if p == "replicate" else Shard(int(p[len("shard("):-1])))
    return out


# ---------------------------------------------------------------------------------------------
# The torch job


def torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def local_box(shape, mesh, placements) -> tuple:
    """(local shape, global offsets) of this rank: torch's own computation, or an even split."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # older/newer torch: every chosen shape divides evenly
        compute_local_shape_and_global_offset = None
    if compute_local_shape_and_global_offset is not None:
        local, offset = compute_local_shape_and_global_offset(list(shape), mesh, placements)
        return tuple(local), tuple(offset)
    from torch.distributed.tensor import Shard

    local, offset = list(shape), [0] * len(shape)
    coords = mesh.get_coordinate()
    for size, coord, p in zip(mesh.shape, coords, placements):
        if isinstance(p, Shard):
            local[p.dim] //= size
            offset[p.dim] += coord * local[p.dim]
    return tuple(local), tuple(offset)


def contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def values(shape, offset, global_shape, seed: int, dtype: str):
    """The box `offset`+`shape` of tensor `seed`: bit patterns hashed from the global element
    index (bijective on 14 bits for bf16, 30 bits for fp32: finite, a 16384-run all distinct)."""
    import torch

    n = 1
    for s in shape:
        n *= s
    if len(shape) == 0 or n == 0:
        idx = torch.zeros(shape, dtype=torch.int64)
    else:
        # Global flat index of every element of the box (rows of a Shard(0) box are contiguous,
        # but this is right for any box).
        idx = torch.zeros((), dtype=torch.int64)
        strides = contiguous_stride(global_shape)
        for d, (size, off) in enumerate(zip(shape, offset)):
            axis = (torch.arange(off, off + size, dtype=torch.int64) * strides[d]).reshape(
                [size if i == d else 1 for i in range(len(shape))]
            )
            idx = idx + axis
        idx = idx.contiguous()
    idx.mul_(2654435761).add_(seed * 40503 + 12345)
    if dtype == "bf16":
        return idx.bitwise_and_(0x3FFF).to(torch.int16).view(torch.bfloat16)
    return idx.bitwise_and_(0x3FFFFFFF).to(torch.int32).view(torch.float32)


def make_checkpoint(dcp_dir: str, specs: list, meshes: dict) -> None:
    """FSDP2-style Shard(0) DTensors over the 4 ranks, written by torch's dcp.save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    mesh, placements = meshes["1d"], [Shard(0)]
    state = {}
    started = time.monotonic()
    for i, (name, shape, dtype) in enumerate(specs):
        local, offset = local_box(shape, mesh, placements)
        t = values(local, offset, shape, i, dtype)
        state[name] = DTensor.from_local(
            t, mesh, placements, run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
        )
    dist.barrier()
    if rank == 0:
        print(f"values: {time.monotonic() - started:.1f} s", flush=True)
    started = time.monotonic()
    dcp.save(state, checkpoint_id=dcp_dir)
    dist.barrier()
    if rank == 0:
        print(f"dcp.save: {time.monotonic() - started:.1f} s", flush=True)


def target_state(layout: str, specs: list, rules: list, meshes: dict) -> dict:
    """This rank's DTensor state dict for `layout`, destinations written (0xA5 bytes) so that
    the timed load pays no first-touch page faults."""
    import torch
    from torch.distributed.tensor import DTensor

    mesh = meshes[MESH[layout]]
    state = {}
    for name, shape, dtype in specs:
        placements = torch_placements(first_match(rules, name))
        local, _ = local_box(shape, mesh, placements)
        t = torch.empty(local, dtype=torch_dtype(dtype))
        t.view(torch.uint8).fill_(0xA5)
        state[name] = DTensor.from_local(
            t, mesh, placements, run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
        )
    return state


def digests(state: dict, specs: list) -> list:
    """sha256 (hex, 16 digits) of each local shard's raw bytes, in `specs` order."""
    import torch

    out = []
    for name, _, _ in specs:
        t = state[name].to_local().contiguous()
        out.append(hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest()[:16])
    return out


def wrong_values(state: dict, specs: list) -> list:
    """The tensors whose local shard differs from what `make_checkpoint` wrote there (computed
    again from the value formula): the digests agreeing across loads is not enough, all of them
    could have left a destination as it was."""
    import torch

    wrong = []
    for i, (name, shape, dtype) in enumerate(specs):
        dt = state[name]
        (chunk,) = dt.__create_chunk_list__()
        want = values(tuple(chunk.sizes), tuple(chunk.offsets), shape, i, dtype)
        if not torch.equal(dt.to_local().contiguous().view(torch.uint8), want.view(torch.uint8)):
            wrong.append(name)
    return wrong


def run_one(
    method: str, layout: str, specs: list, rules: list, meshes: dict, dcp_dir: str, hash_it: bool, check: bool
) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tessera

    state = target_state(layout, specs, rules, meshes)
    dist.barrier()
    before = rchar()
    started = time.perf_counter()
    if method == "dcp.load":
        dcp.load(state, checkpoint_id=dcp_dir)
        report = {}
    elif method.startswith("tessera"):
        kwargs = {}
        if "read_order=" in method:
            kwargs["read_order"] = method.split("read_order=")[1].split()[0]
        if "exchange=False" in method:
            kwargs["exchange"] = False
        report = tessera.load(state, dcp_dir, progress=False, timeout=600, **kwargs).to_dict()
    else:
        raise ValueError(f"unknown method {method!r}")
    seconds = time.perf_counter() - started
    read_syscalls = rchar() - before
    result = {
        "seconds": seconds,
        "rchar": read_syscalls,
        "bytes_needed": sum(v.to_local().numel() * v.to_local().element_size() for v in state.values()),
        "bytes_read": report.get("bytes_read"),
        "bytes_fetched": report.get("bytes_fetched"),
        "bytes_received": report.get("bytes_received"),
        "read_seconds": report.get("read_seconds"),
        "exchange_seconds": report.get("exchange_seconds"),
        "exchange_wait_seconds": report.get("exchange_wait_seconds"),
    }
    if method == "dcp.load":
        result["blob_bytes"] = dcp_blob_bytes(dcp_dir, state)
    if hash_it:
        result["sha"] = digests(state, specs)
    if check:
        result["wrong"] = wrong_values(state, specs)
    del state
    return result


def worker(rank: int, port: int, cfg: dict, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # 4 processes on few cores: no thread oversubscription
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        meshes = {
            "1d": init_device_mesh("cpu", (WORLD,)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")),
        }
        specs, dcp_dir = cfg["specs"], cfg["dcp"]
        if not os.path.exists(os.path.join(dcp_dir, ".metadata")):
            make_checkpoint(dcp_dir, specs, meshes)
        for layout in cfg["layouts"]:
            rules = cfg["rules"][layout]
            for rep in range(repeats):
                for m, method in enumerate(METHODS):
                    # The first repetition: every method's digests; the first method's values
                    # checked against the formula too (the others must have the same digests).
                    result = run_one(
                        method, layout, specs, rules, meshes, dcp_dir, hash_it=rep == 0, check=rep == 0 and m == 0
                    )
                    out[(layout, method, rep, rank)] = result
                    if rank == 0:
                        print(
                            f"{layout} rep {rep} {method}: {result['seconds']:.2f} s (rank 0"
                            + (
                                f": read {result['read_seconds']:.2f} s, exchange {result['exchange_seconds']:.2f} s"
                                if result.get("read_seconds") is not None
                                else ""
                            )
                            + f"; RSS {rss_gib():.2f} GiB)",
                            flush=True,
                        )
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The CLI


def safetensors_digests(path: str, specs: list) -> list:
    """`digests` of a `--dump` file: each tensor's raw bytes (bf16 as stored), in `specs` order."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        out = []
        for name, _, _ in specs:
            start, end = header[name]["data_offsets"]
            f.seek(base + start)
            out.append(hashlib.sha256(f.read(end - start)).hexdigest()[:16])
    return out


def run_cli(dcp_dir: str, layout_path: str, work: str, specs: list, dump: bool) -> list:
    """One `tessera load --transport tcp` of the layout's 4 ranks; per rank: seconds (the
    command's wall time, process start and planning included, the same for every rank) and its
    report; with `dump`, only the digests of what each rank loaded (from `--dump`)."""
    report_path = os.path.join(work, "cli-report.json")
    dump_dir = os.path.join(work, "cli-dump")
    cmd = [TESSERA_BIN, "load", dcp_dir, "--layout", layout_path, "--transport", "tcp", "--quiet",
           "--report-json", report_path]
    if dump:
        cmd += ["--dump", dump_dir]
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - started
    with open(report_path) as f:
        ranks = json.load(f)["ranks"]
    results = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        if dump:
            results.append({"sha": safetensors_digests(os.path.join(dump_dir, f"rank-{r['rank']}.safetensors"), specs)})
            continue
        results.append({
            "seconds": seconds,
            "rchar": None,  # other processes: not measured
            "bytes_needed": r["bytes_needed"],
            "bytes_read": r["bytes_read"],
            "bytes_fetched": r["bytes_fetched"],
            "bytes_received": r["bytes_received"],
            "read_seconds": r["read_seconds"],
            "exchange_seconds": r["exchange_seconds"],
            "exchange_wait_seconds": r.get("exchange_wait_seconds", 0.0),
        })
    if dump:
        shutil.rmtree(dump_dir)
    return results


# ---------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"machine: {cpu}, {cores} cores, {mem} RAM"


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("MODEL", "llama8b"), choices=MODELS)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--layouts", default=os.environ.get("LAYOUTS", ",".join(ALL_LAYOUTS)))
    parser.add_argument("--moments", action=argparse.BooleanOptionalAction, default=None,
                        help="fp32 Adam moments (default: with for llama8b and moe, without for llama70b and wide)")
    parser.add_argument("--scale", type=int, default=int(os.environ.get("SCALE", "1")),
                        help="divide hidden/head/intermediate/expert sizes by this (smoke tests)")
    parser.add_argument("--data", default=os.environ.get("BENCH_DATA", "target/bench-data/realistic_shapes"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args()

    layouts = [x for x in args.layouts.split(",") if x]
    for x in layouts:
        if x not in ALL_LAYOUTS:
            sys.exit(f"unknown layout {x!r}: pick from {','.join(ALL_LAYOUTS)}")
    moments = args.moments if args.moments is not None else args.model in ("llama8b", "moe")
    if args.model == "wide" and moments:
        sys.exit("wide has no moments")
    specs = tensor_specs(args.model, args.layers, args.scale, moments)
    default_moments = args.model in ("llama8b", "moe")
    tag = args.model
    if args.layers != 1:
        tag += f"-{args.layers}layers"
    if moments != default_moments:
        tag += "-moments" if moments else "-nomoments"
    if args.scale != 1:
        tag += f"-scale{args.scale}"
    work = os.path.abspath(os.path.join(args.data, tag))
    dcp_dir = os.path.join(work, "dcp")
    os.makedirs(work, exist_ok=True)
    # A checkpoint left by a run with other shapes under this name would be loaded wrongly.
    spec_path = os.path.join(work, "specs.json")
    spec_json = [[n, list(s), d] for n, s, d in specs]
    if os.path.exists(os.path.join(dcp_dir, ".metadata")):
        try:
            with open(spec_path) as f:
                same = json.load(f) == spec_json
        except (OSError, ValueError):
            same = False
        if not same:
            print(f"{dcp_dir}: written for other shapes, writing it again", flush=True)
            shutil.rmtree(dcp_dir)

    total = sum(nbytes(s, d) for _, s, d in specs)
    label = f"{args.model} (best case)" if args.model == "wide" else args.model
    print(machine())
    print(f"torch {torch.__version__}; world {WORLD} (gloo, 127.0.0.1); torch.set_num_threads(1) per rank")
    print(
        f"checkpoint: {label}, {args.layers} layer(s)"
        + (f", scale 1/{args.scale}" if args.scale != 1 else "")
        + (", with fp32 Adam moments" if moments else ", parameters only")
        + f": {len(specs)} tensors, {total:,} bytes ({total / 2**30:.2f} GiB), dcp.save Shard(0) at world {WORLD}"
    )
    for line in describe(specs):
        print(line)

    rules = {x: layout_rules(x, specs) for x in layouts}
    for x in layouts:
        with open(os.path.join(work, f"{x}.json"), "w") as f:
            json.dump(layout_json(x, rules[x]), f, indent=1)
    cfg = {"specs": specs, "dcp": dcp_dir, "layouts": layouts, "rules": rules}

    out = mp.Manager().dict()
    # The checkpoint is written by a first job, then the page cache is warmed, then the loads
    # run in a second job (same code; it finds the checkpoint and skips writing).
    if not os.path.exists(os.path.join(dcp_dir, ".metadata")):
        mp.spawn(worker, args=(free_port(), cfg, 0, out), nprocs=WORLD, join=True)
        with open(spec_path, "w") as f:
            json.dump(spec_json, f)
    started = time.monotonic()
    warm(dcp_dir)
    print(f"page cache warmed: {time.monotonic() - started:.1f} s", flush=True)
    mp.spawn(worker, args=(free_port(), cfg, args.repeats, out), nprocs=WORLD, join=True)
    results = dict(out)

    cli_methods = CLI_METHODS
    if cli_methods and not os.path.exists(TESSERA_BIN):
        print(f"note: {TESSERA_BIN} does not exist: the CLI rows are left out "
              "(cargo build --release, or TESSERA_BIN=...)", flush=True)
        cli_methods = []
    for layout in layouts:
        layout_path = os.path.join(work, f"{layout}.json")
        for method in cli_methods:
            for rep in range(args.repeats):
                ranks = run_cli(dcp_dir, layout_path, work, specs, dump=False)
                for r, result in enumerate(ranks):
                    results[(layout, method, rep, r)] = result
                print(f"{layout} rep {rep} {method}: {ranks[0]['seconds']:.2f} s (whole command)", flush=True)
            # The digests: one more run, untimed, with --dump.
            for r, result in enumerate(run_cli(dcp_dir, layout_path, work, specs, dump=True)):
                results[(layout, method, 0, r)]["sha"] = result["sha"]

    rows, mismatches = [], []
    for layout in layouts:
        shas = {}
        for method in METHODS + cli_methods:
            per_rep = [[results[(layout, method, rep, r)] for r in range(WORLD)] for rep in range(args.repeats)]
            shas[method] = [per_rep[0][r]["sha"] for r in range(WORLD)]
            seconds = [max(x["seconds"] for x in ranks) for ranks in per_rep]
            first = per_rep[0]
            row = {
                "layout": layout,
                "method": method,
                "cli": method in cli_methods,
                "seconds": seconds,
                "median": statistics.median(seconds),
                "needed": sum(x["bytes_needed"] for x in first),
                "rchar": None if first[0]["rchar"] is None else sum(x["rchar"] for x in first),
                "digest": hashlib.sha256("".join("".join(s) for s in shas[method]).encode()).hexdigest()[:16],
            }
            if method == "dcp.load":
                row["storage"] = sum(x["blob_bytes"] for x in first)
            else:
                row["storage"] = sum(x["bytes_read"] for x in first)
                row["fetched"] = sum(x["bytes_fetched"] for x in first)
                row["received"] = sum(x["bytes_received"] for x in first)
                # Where tessera's time went: median over repetitions of the slowest rank's.
                row["read_s"] = statistics.median(max(x["read_seconds"] for x in ranks) for ranks in per_rep)
                row["exchange_s"] = statistics.median(max(x["exchange_seconds"] for x in ranks) for ranks in per_rep)
                # The exchange of one plan, run to run (issue 31: it should vary by < 25 %).
                row["exchange_runs"] = [max(x["exchange_seconds"] for x in ranks) for ranks in per_rep]
                # The same less the time ranks waited on their peers (shares of peers still
                # reading, joint-check folds): each rank's own exchange work.
                row["exchange_work_runs"] = [
                    max(x["exchange_seconds"] - (x.get("exchange_wait_seconds") or 0.0) for x in ranks)
                    for ranks in per_rep
                ]
            rows.append(row)
        # Which tensors of which rank differ from the value formula (the first method), and
        # which differ between methods.
        ref_method = (METHODS + cli_methods)[0]
        for r in range(WORLD):
            for name in results[(layout, ref_method, 0, r)].get("wrong", []):
                mismatches.append(f"{layout}: rank {r} {name}: {ref_method} loaded other values than were saved")
        for method, ranks in shas.items():
            for r in range(WORLD):
                for (name, _, _), a, b in zip(specs, shas[ref_method][r], ranks[r]):
                    if a != b:
                        mismatches.append(f"{layout}: rank {r} {name}: {ref_method} {a} != {method} {b}")

    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({
            "machine": machine(),
            "model": args.model,
            "layers": args.layers,
            "scale": args.scale,
            "moments": moments,
            "checkpoint_bytes": total,
            "tensors": len(specs),
            "repeats": args.repeats,
            "digests_agree": not mismatches,
            "rows": rows,
        }, f, indent=1)

    print(
        f"\n{label}, {args.layers} layer(s), {total:,} bytes; seconds: the slowest rank's load call "
        "(the CLI: the whole command)"
    )
    print(
        "\n| layout | load | seconds (median of %d) | runs | read s / exchange s | bytes from storage "
        "| rchar (read syscalls) | exchanged | vs dcp.load |" % args.repeats
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in layouts:
        base = next((r for r in rows if r["layout"] == layout and r["method"] == "dcp.load"), None)
        needed = next(r for r in rows if r["layout"] == layout)["needed"]
        for r in (x for x in rows if x["layout"] == layout):
            storage = f"{r['storage']:,}"
            if "fetched" in r:
                storage += f" (fetched {r['fetched']:,})"
            runs = ", ".join(f"{s:.2f}" for s in r["seconds"])
            split = f"{r['read_s']:.2f} / {r['exchange_s']:.2f}" if "read_s" in r else ""
            if r.get("exchange_runs") and r["exchange_s"] >= 0.05:
                spread = (max(r["exchange_runs"]) - min(r["exchange_runs"])) / r["exchange_s"]
                split += f" (exchange {', '.join(f'{x:.2f}' for x in r['exchange_runs'])}: ±{spread * 50:.0f} %"
                work_runs = r.get("exchange_work_runs") or []
                own = statistics.median(work_runs) if work_runs else 0.0
                if own > 0:
                    work_spread = (max(work_runs) - min(work_runs)) / own
                    split += (
                        f"; less waits on peers {', '.join(f'{x:.2f}' for x in work_runs)}: "
                        f"±{work_spread * 50:.0f} %"
                    )
                split += ")"
            exchanged = f"{r['received']:,}" if "received" in r else ""
            name = f"{r['method']} (whole command)" if r["cli"] else r["method"]
            ratio = f"{base['median'] / r['median']:.2f}x" if base else ""
            rch = "" if r["rchar"] is None else format(r["rchar"], ",")
            print(
                f"| {layout} | {name} | {r['median']:.2f} | {runs} | {split} | {storage} | {rch} | "
                f"{exchanged} | {ratio} |"
            )
        print(f"| {layout} | (bytes needed by the ranks) | | | | {needed:,} | | | |")
    print(f"\nresults: {os.path.join(work, 'results.json')}")
    if mismatches:
        print(f"\nDIGEST MISMATCH: the loads disagree on the bytes ({len(mismatches)} rank shards):", file=sys.stderr)
        for line in mismatches[:50]:
            print("  " + line, file=sys.stderr)
        print(f"checkpoint kept: {dcp_dir}; layouts: {work}/<layout>.json", file=sys.stderr)
        sys.exit(1)
    print("digests: every load gave the same bytes on every rank")
    if not args.keep:
        shutil.rmtree(dcp_dir)


if __name__ == "__main__":
    main()

"""Online resharding (issue 43, "Measured"): a training job's state handed live to another job in
another layout, `tessera.publish` + `tessera.load("live://NAME@STEP")` against what users do
instead, in one run, interleaved, medians of `--repeats`.

Jobs (separate processes and separate `torch.distributed` worlds, each on its own TCPStore port;
the driver process hosts the stores and a control store that only sequences the benchmark):

* **publisher**: 4 ranks (gloo), FSDP-style: every tensor a Shard(0) DTensor over the 4 ranks.
  State: `--layers` Llama-3-8B-like layers at widths / `--scale` (GQA k/v, SwiGLU; the headline's
  shapes from `bench_util.tensor_specs`), plus `model.embed_tokens.weight` and `lm_head.weight`
  [`--vocab`, hidden] and `model.norm.weight`; bf16 parameters plus fp32 Adam moments
  (`optim.state.<param>.exp_avg`, `.exp_avg_sq`). Values: realistic_shapes' hashed bit patterns
  of each element's global index; a "training step" adds 1 to every element's bit pattern (in
  place), so every method moves a state no earlier method left at the consumer.
* **consumers** (`--consumers 2,3`): one job per world size C, Megatron tensor parallelism over C
  ranks: column-parallel q/k/v, gate/up and the vocabulary-parallel embedding and lm_head
  Shard(0) (rows), row-parallel o_proj/down_proj Shard(1) (columns), RMSNorms Replicate; Adam
  moments placed like their parameter. At C=3 most shards are uneven (torch's chunking).

Methods, per consumer world, in each repetition (their order rotates by repetition):

* ``tessera live cold``: every publisher rank calls `tessera.publish(state, NAME, step=S,
  registry=DIR)` (NAME new for this repetition and world); publisher rank 0 waits for the commit
  (`pub.result()`) and tells the consumers (control store); every consumer rank calls
  `tessera.load(state, "live://NAME@S", registry=DIR)` over its own group.
* ``tessera live warm``: the same with step S+1 of the same NAME, same layout: the consumer
  replays the plan it made for step S (`plan_reused` and `plan_seconds` are printed when the
  report has them). The process's plan cache is keyed by layout and requests, not by name, so
  from the second repetition on a "cold" load (a new NAME of the same layout) replays the plan
  too: only each consumer job's first load plans; `plan_reused` per row says which.
* ``gather+broadcast`` (OpenRLHF / verl's NCCL weight sync): per tensor, publisher rank 0
  gathers the full tensor from the FSDP shards (`dist.gather` in the publisher's group) and
  broadcasts it over a third gloo world {publisher rank 0, the consumer ranks} (what those tools
  build for the transfer); each consumer rank receives the full tensor into a preallocated buffer
  and copies its TP slice into its destination.
* ``dcp.save+load``: `dcp.save(state, checkpoint_id=DIR)` by the publisher job, then
  `dcp.load(state, checkpoint_id=DIR)` by the consumer job (local directory, page cache warm).
* ``tessera.save+load``: `tessera.save(state, DIR)` (the synchronous call: the consumer needs
  the committed checkpoint, so `async_save(...).result()` would be the same wait), then
  `tessera.load(state, DIR)` by the consumer job.

Seconds: from publisher rank 0 passing the start barrier (every process of both jobs meets there;
the publish/gather/save call follows at once) to the last consumer rank having its state loaded
(CLOCK_MONOTONIC is one clock for all processes of the host). Every consumer rank then compares
each local shard, bit for bit, with the publisher's state at that step (computed from the value
formula); a mismatch aborts the benchmark naming the method, rank and tensor.

Stall: before each `publish`, every publisher rank times an eager copy of its local shards
(`copy_` into preallocated CPU tensors); then the `publish` call itself (until it returns: the
snapshot is taken). Reported: medians over publishes of the slowest rank.

Profile of the live loads (medians): publish call (snapshot), publish-to-commit (background
layout, serving, registry parts, rank 0's commit), commit-to-load-start, and the consumer's
load: its read_seconds (reads from the publishers, verified: from their shared memory on this
host, `publish(share_memory=True)`, the default; over HTTP otherwise), exchange_seconds (inside the
consumer job), and the rest of its total_seconds (open, plan, bookkeeping; the resolve and the lease precede
the timed inner load and are not in it).

`--profile`: consumer rank 0 runs its live loads under cProfile; the last warm one's top
functions (cumulative) are printed per consumer world.

Usage (release module: `cd python && maturin develop --release && cd ..`):
    python benches/live_reshard.py [--layers 1] [--scale 2] [--vocab 8192] [--consumers 2,3]
        [--repeats 3] [--dir target/bench-live] [--http] [--profile]
Defaults: 0.82 GiB of state (36 tensors). Disk: one checkpoint at a time under --dir (dcp or
tessera, about the state's size), removed after each method; --dir is removed at the end.
Memory: the publisher job holds its state, the eager-copy buffers, the staging pool, up to two
served steps and the memory of up to two retired ones it lays later steps out in (about 7x the
state, ~6 GB at the defaults), each consumer job its state; plus the page cache of one
checkpoint. Each repetition's steps are retired after its warm load, so from the second
repetition on both live publishes lay out in a retired step's memory (the phases line says how
many did, and their persist against fresh memory's). A consumer checks its bytes by recomputing the expected values.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time

from bench_util import tensor_specs
from realistic_shapes import contiguous_stride, local_box, role, torch_dtype, values
from realistic_shapes import machine as shapes_machine

PUB_WORLD = 4
METHODS = ["tessera live", "gather+broadcast", "dcp.save+load", "tessera.save+load"]
TIMEOUT = datetime.timedelta(seconds=900)


def state_specs(layers: int, scale: int, vocab: int) -> list:
    """[(fqn, shape, dtype)]: embedding, `layers` Llama-3-8B-like layers, final norm, lm_head
    (bf16), then every parameter's two fp32 Adam moments."""
    layer_params = tensor_specs("llama8b", layers, scale, moments=False)
    hidden = layer_params[0][1][0]  # input_layernorm.weight [hidden]
    params = (
        [("model.embed_tokens.weight", (vocab, hidden), "bf16")]
        + layer_params
        + [("model.norm.weight", (hidden,), "bf16"), ("lm_head.weight", (vocab, hidden), "bf16")]
    )
    moments = [
        (f"optim.state.{name}.{which}", shape, "fp32") for which in ("exp_avg", "exp_avg_sq") for name, shape, _ in params
    ]
    return params + moments


def tp_placement(name: str):
    """Megatron TP: column-parallel (and vocabulary-parallel) Shard(0), row-parallel Shard(1),
    norms Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    r = role(name)
    return Replicate() if r in ("norm", "router") else Shard(1) if r == "row" else Shard(0)


def int_view(t):
    import torch

    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def nbytes_of(specs: list) -> int:
    total = 0
    for _, shape, dtype in specs:
        n = 2 if dtype == "bf16" else 4
        for s in shape:
            n *= s
        total += n
    return total


# ---------------------------------------------------------------------------------------------
# Sequencing between the jobs (the control store: not a process group, nothing moves over it)


class Control:
    def __init__(self, port: int) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    def barrier(self, key: str, n: int) -> None:
        if self.store.add(key, 1) == n:
            self.store.set(key + "/go", "1")
        self.store.wait([key + "/go"])

    def aborted(self) -> bool:
        return self.store.check(["abort"])

    def put(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str):
        self.store.wait([key])
        return json.loads(self.store.get(key))


def schedule(consumers: list, repeats: int) -> list:
    """[(idx, rep, C, method)]: each repetition runs every method for every consumer world; the
    method order rotates by repetition (live cold and warm stay a pair, in that order)."""
    out = []
    for rep in range(repeats):
        order = METHODS[rep % len(METHODS):] + METHODS[: rep % len(METHODS)]
        for c in consumers:
            for method in order:
                subs = ["tessera live cold", "tessera live warm"] if method == "tessera live" else [method]
                for m in subs:
                    out.append((len(out), rep, c, m))
    return out


# ---------------------------------------------------------------------------------------------
# Publisher job


def publisher(rank: int, ports: dict, args: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import tessera

    torch.set_num_threads(1)
    specs = state_specs(args["layers"], args["scale"], args["vocab"])
    store = dist.TCPStore("127.0.0.1", ports["pub"], is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=PUB_WORLD, timeout=TIMEOUT)
    ctl = Control(ports["control"])
    mesh = init_device_mesh("cpu", (PUB_WORLD,))
    state, copies = {}, []
    for i, (name, shape, dtype) in enumerate(specs):
        local, offset = local_box(shape, mesh, [Shard(0)])
        t = values(local, offset, shape, i, dtype).contiguous()
        state[name] = DTensor.from_local(
            t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
        )
        buf = torch.empty_like(t)
        buf.copy_(t)  # touched: the eager copy's baseline pays no first-touch faults
        copies.append((buf, t))
    # Transfer worlds of gather+broadcast: rank 0 and each consumer job's ranks.
    transfer = {}
    if rank == 0:
        for c in args["consumers"]:
            xstore = dist.TCPStore("127.0.0.1", ports[f"xfer{c}"], is_master=False, timeout=TIMEOUT)
            transfer[c] = dist.ProcessGroupGloo(xstore, 0, c + 1, TIMEOUT)
    # Rank 0's full-tensor buffers (one per shape and dtype: tensors go one at a time).
    full = {}
    if rank == 0:
        for name, shape, dtype in specs:
            key = (tuple(shape), dtype)
            if key not in full:
                full[key] = torch.empty(shape, dtype=torch_dtype(dtype)).view(-1).view(torch.uint8)
                full[key].fill_(0)
    registry = os.path.join(args["dir"], "registry")
    step = 0
    pubs: dict = {}
    results = []
    for idx, rep, c, method in schedule(args["consumers"], args["repeats"]):
        n = PUB_WORLD + c
        # The training step: every element's bit pattern + 1 (untimed).
        step += 1
        for t in state.values():
            int_view(t.to_local()).add_(1)
        result = {"idx": idx, "step": step}
        if method.startswith("tessera live"):
            started = time.perf_counter()
            for buf, t in copies:
                buf.copy_(t)
            result["eager_copy_s"] = time.perf_counter() - started
        ctl.barrier(f"start/{idx}", n)
        t0 = time.monotonic()
        if rank == 0:
            ctl.put(f"t0/{idx}", t0)
        if method.startswith("tessera live"):
            name = f"policy-c{c}-r{rep}"
            started = time.perf_counter()
            pub = tessera.publish(
                state, name, step=step, registry=registry, timeout=600, share_memory=not args["http"],
            )
            result["publish_call_s"] = time.perf_counter() - started
            pubs.setdefault(name, []).append(pub)
            report = pub.result(600)
            result["committed_at"] = time.monotonic() - t0
            if rank == 0:
                ctl.put(f"ready/{idx}", step)
            result["blocked_s"] = report.blocked_seconds
            result["persist_s"] = report.persist_seconds
            result["reused_memory"] = report.reused_memory
        elif method == "gather+broadcast":
            for name, shape, dtype in specs:
                local = state[name].to_local().view(-1).view(torch.uint8)
                if rank == 0:
                    buf = full[(tuple(shape), dtype)]
                    dist.gather(local, list(buf.chunk(PUB_WORLD)), dst=0)
                    transfer[c].broadcast(buf, 0).wait()
                else:
                    dist.gather(local, dst=0)
            if rank == 0:
                ctl.put(f"ready/{idx}", step)
        elif method == "dcp.save+load":
            path = os.path.join(args["dir"], f"dcp-{idx}")
            dcp.save(state, checkpoint_id=path)
            if rank == 0:
                ctl.put(f"ready/{idx}", path)
        elif method == "tessera.save+load":
            path = os.path.join(args["dir"], f"tessera-{idx}")
            tessera.save(state, path, master_addr="127.0.0.1", master_port=ports["tessera_save"], timeout=600)
            if rank == 0:
                ctl.put(f"ready/{idx}", path)
        result["done_at"] = time.monotonic() - t0
        ctl.barrier(f"end/{idx}", n)
        # Cleanup after the consumers are done (untimed).
        if method == "tessera live warm":
            for p in pubs.pop(f"policy-c{c}-r{rep}"):
                p.retire()
        if rank == 0 and method in ("dcp.save+load", "tessera.save+load"):
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        ctl.put(f"res/{idx}/p{rank}", result)
        if ctl.aborted():
            break
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Consumer jobs


def consumer(rank: int, c: int, ports: dict, args: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import tessera

    torch.set_num_threads(1)
    specs = state_specs(args["layers"], args["scale"], args["vocab"])
    store = dist.TCPStore("127.0.0.1", ports[f"cons{c}"], is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=c, timeout=TIMEOUT)
    ctl = Control(ports["control"])
    xstore = dist.TCPStore("127.0.0.1", ports[f"xfer{c}"], is_master=False, timeout=TIMEOUT)
    transfer = dist.ProcessGroupGloo(xstore, rank + 1, c + 1, TIMEOUT)
    mesh = init_device_mesh("cpu", (c,))
    state, where, boxes, full = {}, {}, {}, {}
    for i, (name, shape, dtype) in enumerate(specs):
        placement = tp_placement(name)
        local, offset = local_box(shape, mesh, [placement])
        where[name] = (local, offset, shape, i, dtype)
        t = torch.empty(local, dtype=torch_dtype(dtype))
        t.view(torch.uint8).fill_(0xA5)  # touched: no first-touch faults in any timed load
        state[name] = DTensor.from_local(
            t, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
        )
        boxes[name] = tuple(slice(o, o + s) for o, s in zip(offset, local))
        key = (tuple(shape), dtype)
        if key not in full:
            full[key] = torch.zeros(shape, dtype=torch_dtype(dtype))
    registry = os.path.join(args["dir"], "registry")
    for idx, rep, cw, method in schedule(args["consumers"], args["repeats"]):
        if cw != c:
            continue
        n = PUB_WORLD + c
        ctl.barrier(f"start/{idx}", n)
        result = {"idx": idx}
        if method == "gather+broadcast":
            for name, shape, dtype in specs:
                buf = full[(tuple(shape), dtype)]
                transfer.broadcast(buf.view(-1).view(torch.uint8), 0).wait()
                state[name].to_local().copy_(buf[boxes[name]])
            ctl.get(f"ready/{idx}")
        else:
            ready = ctl.get(f"ready/{idx}")
            result["ready_at"] = time.monotonic()
            if method.startswith("tessera live"):
                step = ready
                name = f"policy-c{c}-r{rep}"
                profile = None
                if args["profile"] and rank == 0:
                    import cProfile

                    profile = cProfile.Profile()
                    profile.enable()
                report = tessera.load(state, f"live://{name}@{step}", registry=registry, progress=False, timeout=600)
                if profile is not None:
                    import io
                    import pstats

                    profile.disable()
                    text = io.StringIO()
                    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
                    result["profile"] = text.getvalue()
                r = report.to_dict()
                result.update(
                    total_s=r["total_seconds"], read_s=r["read_seconds"], exchange_s=r["exchange_seconds"],
                    bytes_read=r["bytes_read"], bytes_fetched=r["bytes_fetched"], requests=r["requests"],
                    bytes_received=r["bytes_received"], loaded_step=r["step"],
                    from_memory=r.get("bytes_from_publisher_memory", 0),
                )
                if "plan_reused" in r:  # plan reuse across steps: shown when reported
                    result["plan_reused"] = r["plan_reused"]
                if "plan_seconds" in r:
                    result["plan_s"] = r["plan_seconds"]
                if report.step != step:
                    ctl.store.set("abort", f"{method} c{c} rank {rank}: loaded step {report.step}, asked {step}")
            elif method == "dcp.save+load":
                dcp.load(state, checkpoint_id=ready)
            else:
                r = tessera.load(state, ready, progress=False, timeout=600).to_dict()
                result.update(
                    total_s=r["total_seconds"], read_s=r["read_seconds"], exchange_s=r["exchange_seconds"],
                    requests=r["requests"], bytes_fetched=r["bytes_fetched"],
                )
        result["end"] = time.monotonic()
        # Every byte of every local shard against the publisher's state at this step.
        pub_step = idx_step(idx)
        for name, _, _ in specs:
            got = int_view(state[name].to_local())
            # The publisher's values before its first training step, plus one per step
            # (recomputed here rather than kept: memory is what this shared machine lacks).
            want = int_view(values(*where[name]).contiguous()).add_(pub_step)
            if not torch.equal(got, want):
                wrong = int((got != want).sum())
                ctl.store.set(
                    "abort", f"{method}, consumer world {c}, rank {rank}, tensor {name}: {wrong} elements differ "
                    f"from the publisher's state at step {pub_step}",
                )
                break
        ctl.barrier(f"end/{idx}", n)
        ctl.put(f"res/{idx}/c{rank}", result)
        if ctl.aborted():
            break
    dist.destroy_process_group()


def idx_step(idx: int) -> int:
    """The publisher's step during entry ``idx``: it takes one training step before each entry."""
    return idx + 1


# ---------------------------------------------------------------------------------------------
# Driver


def machine() -> str:
    """realistic_shapes' machine line (CPU, cores, RAM), with the load average at the start: the
    machine is shared, and the numbers say how busy it was."""
    load = os.getloadavg()
    system = f"{platform.system()} {platform.release()}"
    return f"{shapes_machine()}, {system}; load average at the start {load[0]:.2f}"


def main() -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--consumers", default="2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="target/bench-live")
    parser.add_argument(
        "--http", action="store_true",
        help="publish with share_memory=False: the consumers read over HTTP, as a consumer on another host does",
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile consumer rank 0's live loads; print the last of each world's"
    )
    parsed = parser.parse_args()
    consumers = [int(x) for x in parsed.consumers.split(",") if x]
    specs = state_specs(parsed.layers, parsed.scale, parsed.vocab)
    total = nbytes_of(specs)
    work = os.path.abspath(parsed.dir)
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    args = {
        "layers": parsed.layers, "scale": parsed.scale, "vocab": parsed.vocab, "consumers": consumers,
        "repeats": parsed.repeats, "dir": work, "profile": parsed.profile, "http": parsed.http,
    }
    print(f"command: python {' '.join(sys.argv)}")
    print(machine())
    print(
        f"state: {len(specs)} tensors, {total:,} bytes ({total / 2**30:.2f} GiB): {parsed.layers} llama8b layers at "
        f"widths / {parsed.scale}, embed_tokens and lm_head [{parsed.vocab}, hidden], bf16 parameters + fp32 Adam "
        f"moments; publisher FSDP Shard(0) over {PUB_WORLD} ranks; consumers TP over {consumers}",
        flush=True,
    )

    # Every world's store (and the control store) lives here, each on its own port.
    stores = {"control": dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)}
    stores["pub"] = dist.TCPStore("127.0.0.1", 0, PUB_WORLD, True, timeout=TIMEOUT, wait_for_workers=False)
    for c in consumers:
        stores[f"cons{c}"] = dist.TCPStore("127.0.0.1", 0, c, True, timeout=TIMEOUT, wait_for_workers=False)
        stores[f"xfer{c}"] = dist.TCPStore("127.0.0.1", 0, c + 1, True, timeout=TIMEOUT, wait_for_workers=False)
    ports = {k: s.port for k, s in stores.items()}
    from bench_util import free_port

    ports["tessera_save"] = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=publisher, args=(r, ports, args), name=f"pub{r}") for r in range(PUB_WORLD)]
    for c in consumers:
        procs += [ctx.Process(target=consumer, args=(r, c, ports, args), name=f"c{c}r{r}") for r in range(c)]
    started = time.monotonic()
    for p in procs:
        p.start()
    entries = schedule(consumers, parsed.repeats)
    control = stores["control"]
    results = {}
    try:
        for idx, rep, c, method in entries:
            keys = [f"res/{idx}/p{r}" for r in range(PUB_WORLD)] + [f"res/{idx}/c{r}" for r in range(c)]
            while not control.check(keys):
                if control.check(["abort"]):
                    break
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"bench processes {dead} failed (entry {idx}: {method}, consumers {c})")
                time.sleep(0.2)
            if control.check(["abort"]):
                raise SystemExit(f"ABORTED, wrong bytes: {control.get('abort').decode()}")
            pub = [json.loads(control.get(f"res/{idx}/p{r}")) for r in range(PUB_WORLD)]
            con = [json.loads(control.get(f"res/{idx}/c{r}")) for r in range(c)]
            t0 = json.loads(control.get(f"t0/{idx}"))
            seconds = max(x["end"] for x in con) - t0
            results[idx] = {"rep": rep, "c": c, "method": method, "seconds": seconds, "pub": pub, "con": con, "t0": t0}
            extra = ""
            if method.startswith("tessera live"):
                extra = (
                    f" (publish call {max(x['publish_call_s'] for x in pub):.3f} s, eager copy "
                    f"{max(x['eager_copy_s'] for x in pub):.3f} s, committed at {pub[0]['committed_at']:.2f} s, load "
                    f"{max(x['total_s'] for x in con):.2f} s: read {max(x['read_s'] for x in con):.2f} s, exchange "
                    f"{max(x['exchange_s'] for x in con):.2f} s"
                    + (f", plan {max(x['plan_s'] for x in con):.3f} s" if all("plan_s" in x for x in con) else "")
                    + f"{reused(con)})"
                )
            print(f"rep {rep} consumers {c} {method}: {seconds:.2f} s{extra}", flush=True)
        for p in procs:
            p.join(120)
    finally:
        # On a failure the other processes wait at a barrier for ever: end them.
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        shutil.rmtree(work, ignore_errors=True)
    print(f"whole run: {time.monotonic() - started:.0f} s")
    report(results, consumers, parsed.repeats, total)


def reused(con: list) -> str:
    """The consumers' `plan_reused` values, or that the report has no such field."""
    if not any("plan_reused" in x for x in con):
        return "; the report has no plan_reused field"
    return "; plan_reused " + ", ".join(sorted({str(x.get("plan_reused")) for x in con}))


def med(xs) -> float:
    return statistics.median(xs)


def report(results: dict, consumers: list, repeats: int, total: int) -> None:
    methods = ["tessera live cold", "tessera live warm", "gather+broadcast", "dcp.save+load", "tessera.save+load"]
    for c in consumers:
        rows = {m: [r for r in results.values() if r["c"] == c and r["method"] == m] for m in methods}
        medians = {m: med([r["seconds"] for r in rows[m]]) for m in methods}
        print(f"\n### Consumer TP{c} ({c} ranks) <- publisher FSDP {PUB_WORLD} ranks, {total / 2**30:.2f} GiB, "
              f"medians of {repeats}")
        print("| method | median s | runs | GB/s | this / live cold | this / live warm |")
        print("|---|---|---|---|---|---|")
        for m in methods:
            runs = ", ".join(f"{r['seconds']:.2f}" for r in rows[m])
            print(
                f"| {m} | {medians[m]:.2f} | {runs} | {total / 1e9 / medians[m]:.2f} | "
                f"{medians[m] / medians['tessera live cold']:.2f}x | {medians[m] / medians['tessera live warm']:.2f}x |"
            )
        for m in ("gather+broadcast", "dcp.save+load", "tessera.save+load"):
            side = med([max(x["done_at"] for x in r["pub"]) for r in rows[m]])
            line = f"{m}: publisher side done at {side:.2f} s (median, slowest rank)"
            if m != "gather+broadcast":
                ready = med([min(x["ready_at"] for x in r["con"]) - r["t0"] for r in rows[m]])
                line += f"; consumers told at {ready:.2f} s"
            if m == "tessera.save+load":
                load = med([max(x["total_s"] for x in r["con"]) for r in rows[m]])
                read = med([max(x["read_s"] for x in r["con"]) for r in rows[m]])
                exchange = med([max(x["exchange_s"] for x in r["con"]) for r in rows[m]])
                requests = med([sum(x["requests"] for x in r["con"]) for r in rows[m]])
                line += f"; load {load:.2f} s = read {read:.2f} s + exchange {exchange:.2f} s + other; {requests:.0f} reads"
            print(line)
        live = rows["tessera live cold"] + rows["tessera live warm"]
        for label, rs in (("cold", rows["tessera live cold"]), ("warm", rows["tessera live warm"])):
            publish = med([max(x["publish_call_s"] for x in r["pub"]) for r in rs])
            committed = med([r["pub"][0]["committed_at"] for r in rs])
            ready = med([min(x["ready_at"] for x in r["con"]) - r["t0"] for r in rs])
            load = med([max(x["total_s"] for x in r["con"]) for r in rs])
            read = med([max(x["read_s"] for x in r["con"]) for r in rs])
            exchange = med([max(x["exchange_s"] for x in r["con"]) for r in rs])
            rest = med([max(x["total_s"] - x["read_s"] - x["exchange_s"] for x in r["con"]) for r in rs])
            persist = med([max(x["persist_s"] for x in r["pub"]) for r in rs])
            # Publishes whose every rank laid out in a retired step's shared memory, and the
            # persist of those against the rest (fresh memory).
            reusing = [r for r in rs if all(x.get("reused_memory") for x in r["pub"])]
            fresh = [r for r in rs if r not in reusing]
            persist_by = "; ".join(
                f"{kind} {med([max(x['persist_s'] for x in r['pub']) for r in group]):.2f} s"
                for kind, group in (("in reused memory", reusing), ("in fresh memory", fresh))
                if group
            )
            requests = med([sum(x["requests"] for x in r["con"]) for r in rs])
            fetched = med([sum(x["bytes_fetched"] for x in r["con"]) for r in rs])
            from_memory = med([sum(x.get("from_memory", 0) for x in r["con"]) for r in rs])
            read_bytes = med([sum(x.get("bytes_read", 0) for x in r["con"]) for r in rs])
            plan = (
                f" (of it planning {med([max(x['plan_s'] for x in r['con']) for r in rs]):.3f} s)"
                if all("plan_s" in x for r in rs for x in r["con"])
                else ""
            )
            print(
                f"live {label} phases (medians, slowest rank): publish call {publish:.3f} s; background persist "
                f"(layout, serve, part; rank 0 also commits) {persist:.2f} s ({len(reusing)} of {len(rs)} "
                f"publishes in a retired step's memory: {persist_by}); committed at "
                f"{committed:.2f} s; consumers told at {ready:.2f} s; {requests:.0f} reads fetching {fetched:,.0f} bytes "
                f"(verification blocks included) for {read_bytes:,.0f} bytes of pieces, {from_memory:,.0f} of them "
                f"from the publishers' shared memory, the rest over HTTP; "
                f"load {load:.2f} s = read {read:.2f} s + exchange "
                f"{exchange:.2f} s + other (open, plan, bookkeeping; resolve and lease come before) {rest:.2f} s{plan}{reused([x for r in rs for x in r['con']])}"
            )
        cold, warm = medians["tessera live cold"], medians["tessera live warm"]
        print(
            f"goals: live vs gather+broadcast {medians['gather+broadcast'] / cold:.2f}x cold, "
            f"{medians['gather+broadcast'] / warm:.2f}x warm (goal 3x); live vs dcp.save+load "
            f"{medians['dcp.save+load'] / cold:.2f}x cold, {medians['dcp.save+load'] / warm:.2f}x warm (goal 3x); "
            f"warm vs cold {cold / warm:.2f}x (goal 1.5x)"
        )
        if any("profile" in r["con"][0] for r in live):
            print(f"consumer rank 0's last warm live load, cProfile:\n{rows['tessera live warm'][-1]['con'][0]['profile']}")
        eager = [max(x["eager_copy_s"] for x in r["pub"]) for r in live]
        call = [max(x["publish_call_s"] for x in r["pub"]) for r in live]
        print(
            f"publisher stall (slowest rank, {len(live)} publishes): publish call median {med(call):.3f} s, max "
            f"{max(call):.3f} s; eager copy_ of the same shards median {med(eager):.3f} s, max {max(eager):.3f} s; "
            f"ratio {med(call) / med(eager):.2f}"
        )


if __name__ == "__main__":
    main()

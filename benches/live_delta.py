"""Delta live loads (issue 43 item 5): a consumer holding step N loads step N+1 with
``tessera.load(..., "live://NAME", delta=True)`` against the same load without ``delta``.

One publisher process publishes a Llama-like bf16 model (``--layers`` layers of the benchmarks'
realistic Llama-3-8B shapes at widths / 2, ``bench_util.tensor_specs``: hidden 2048, GQA k/v,
SwiGLU; the 32000-row embedding, final norm and LM head) step after step; its "training step" changes only the tensors
being trained (``--train``: ``mlp``, the MLP projections, everything else frozen, as in a partial
fine-tune; or ``all``). A consumer process on the same host holds two copies of the model and
loads every step into both, in alternating order: one with ``delta=True`` (after its first load it
reads only the tensors whose saved boxes' checksums changed), one with a plain load. Times are the
load calls; after each step the two copies are compared bit for bit (untimed) and against the
publisher's values (a mismatch aborts). ``--http``: the publisher does not share its memory, so
the consumer reads over loopback HTTP (what a consumer on another host does).

    python benches/live_delta.py [--layers 4] [--steps 6] [--train mlp|all] [--http]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_util import tensor_specs

VOCAB = 32000


def model(layers: int) -> dict:
    """The published model's tensors, seeded: bf16 parameters only (what a policy publishes)."""
    import torch

    specs = tensor_specs("llama8b", layers, 2, moments=False)
    hidden = specs[0][1][0]  # input_layernorm.weight [hidden]
    shapes = {name: shape for name, shape, _ in specs}
    shapes.update({"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,),
                   "lm_head.weight": (VOCAB, hidden)})
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}


def trained(key: str, train: str) -> bool:
    return train == "all" or ".mlp." in key


def publisher(registry: str, args: dict, go, done) -> None:
    import torch
    import tessera

    state = model(args["layers"])
    pubs = []
    for step in range(1, args["steps"] + 1):
        if step > 1:
            for k, t in state.items():
                if trained(k, args["train"]):
                    t.view(torch.int16).add_(1)
        pub = tessera.publish(state, "policy", step=step, registry=registry, rank=0, world_size=1,
                              keep=2, share_memory=not args["http"])
        pub.result(600)
        pubs.append(pub)
        go.put(step)
        done.get(timeout=600)
    go.put(None)


def consumer(registry: str, args: dict, go, done, out) -> None:
    import torch
    import tessera

    expected = model(args["layers"])
    copies = {"delta": {k: torch.empty_like(t) for k, t in expected.items()},
              "plain": {k: torch.empty_like(t) for k, t in expected.items()}}
    rows = []
    step = go.get(timeout=600)
    while step is not None:
        if step > 1:
            for k, t in expected.items():
                if trained(k, args["train"]):
                    t.view(torch.int16).add_(1)
        order = ["delta", "plain"] if step % 2 else ["plain", "delta"]
        row = {"step": step}
        for method in order:
            started = time.perf_counter()
            report = tessera.load(copies[method], f"live://policy@{step}", registry=registry,
                                  delta=method == "delta", progress=False)
            row[method] = time.perf_counter() - started
            row[f"{method}_bytes"] = report.bytes_needed
            row[f"{method}_memory"] = report.bytes_from_publisher_memory
            if method == "delta":
                row["unchanged"] = len(report.unchanged_keys)
        for k, t in expected.items():
            for method in ("delta", "plain"):
                if not torch.equal(copies[method][k].view(torch.int16), t.view(torch.int16)):
                    raise SystemExit(f"step {step}: {method} load of {k} differs from the publisher's")
        rows.append(row)
        done.put(step)
        step = go.get(timeout=600)
    out.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--train", choices=["mlp", "all"], default="mlp")
    parser.add_argument("--http", action="store_true")
    args = vars(parser.parse_args())
    ctx = mp.get_context("spawn")
    go, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        registry = str(Path(tmp) / "registry")
        procs = [ctx.Process(target=publisher, args=(registry, args, go, done)),
                 ctx.Process(target=consumer, args=(registry, args, go, done, out))]
        for p in procs:
            p.start()
        rows = out.get(timeout=1800)
        for p in procs:
            p.join(60)
    state_bytes = sum(t.numel() * 2 for t in model(args["layers"]).values())
    print(f"command: python benches/live_delta.py --layers {args['layers']} --steps {args['steps']} "
          f"--train {args['train']}{' --http' if args['http'] else ''}")
    print(f"machine: {os.cpu_count()} cores; model {state_bytes / 1e9:.2f} GB bf16; "
          f"{'HTTP (share_memory=False)' if args['http'] else 'shared memory (same host)'}")
    print("| step | delta s | plain s | delta loaded bytes | plain loaded bytes | unchanged tensors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['delta']:.3f} | {r['plain']:.3f} | {r['delta_bytes']:,} | {r['plain_bytes']:,} | {r['unchanged']} |")
    later = rows[1:]
    d, p = statistics.median(r["delta"] for r in later), statistics.median(r["plain"] for r in later)
    print(f"steps 2-{rows[-1]['step']} (the consumer holds the step before): delta median {d:.3f} s, plain "
          f"median {p:.3f} s: {p / d:.2f}x; every copy equal to the publisher's, bit for bit")


if __name__ == "__main__":
    main()

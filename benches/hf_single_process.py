#!/usr/bin/env python3
"""One process loads a whole HF safetensors model (an index and its shards) into existing torch
tensors: `tessera.load` against the loop an SFT or eval job would write instead
(`safetensors.safe_open` + `copy_`), each in a fresh process (the first call pays what a job's
first load pays: imports, setup, page faults of the destinations are excluded: they are touched
before timing), page cache warm, runs interleaved, medians (issue 31 item 5).

The model: Llama-like bf16 layers at hidden `--hidden` (q/o h x h, GQA k/v h x h/4, SwiGLU
gate/up/down h x 2.75h, two norms), `--layers` of them, an embedding and an LM head of `--vocab`
rows, written with `safetensors.torch.save_file` into shards of about 500 MB and an index.

Usage (release module first):
    python benches/hf_single_process.py --layers 8 --hidden 2048 --runs 5 --dir /tmp/hf-model
    python benches/hf_single_process.py ... --cold   # as root: page cache dropped before every load, `cat` timed too
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
dir, method = sys.argv[1], sys.argv[2]
index = json.load(open(f"{dir}/model.safetensors.index.json"))
shapes = json.load(open(f"{dir}/shapes.json"))
dest = {k: torch.empty(v, dtype=torch.bfloat16) for k, v in shapes.items()}
for t in dest.values():
    t.fill_(0)  # destinations exist and are touched before the load, as a job's model is
t1 = time.perf_counter()
if method == "tessera":
    import tessera
    tessera.load(dest, dir, progress=False)
elif method == "cat":
    # What reading the shards costs at all: every shard file read once, as `cat` does.
    import os
    for file in sorted(set(index["weight_map"].values())):
        with open(f"{dir}/{file}", "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
else:
    from safetensors import safe_open
    by_file = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(f"{dir}/{file}", framework="pt") as f:
            for name in names:
                dest[name].copy_(f.get_tensor(name))
t2 = time.perf_counter()
print(json.dumps({"load": t2 - t1, "setup": t1 - t0, "bytes": sum(t.numel() * 2 for t in dest.values())}))
"""


def _write_model(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        return
    os.makedirs(args.dir, exist_ok=True)
    h, kv, ffn = args.hidden, args.hidden // 4, int(args.hidden * 2.75)
    shapes = {"model.embed_tokens.weight": [args.vocab, h], "lm_head.weight": [args.vocab, h], "model.norm.weight": [h]}
    for i in range(args.layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": [h, h], f"{p}.self_attn.k_proj.weight": [kv, h],
            f"{p}.self_attn.v_proj.weight": [kv, h], f"{p}.self_attn.o_proj.weight": [h, h],
            f"{p}.mlp.gate_proj.weight": [ffn, h], f"{p}.mlp.up_proj.weight": [ffn, h],
            f"{p}.mlp.down_proj.weight": [h, ffn], f"{p}.input_layernorm.weight": [h],
            f"{p}.post_attention_layernorm.weight": [h],
        })
    g = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= 500 << 20:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(args.dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * 2 for s in shards for t in s.values())}, "weight_map": weight_map}, f)
    with open(os.path.join(args.dir, "shapes.json"), "w") as f:
        json.dump(shapes, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default="target/hf-model")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before every load (root: writes /proc/sys/vm/drop_caches) "
                             "and time reading the shards once (`cat`) too")
    args = parser.parse_args()
    _write_model(args)
    # Warm the page cache: every file read once.
    for name in os.listdir(args.dir):
        with open(os.path.join(args.dir, name), "rb") as f:
            while f.read(64 << 20):
                pass
    results = {"tessera": [], "safe_open": []}
    if args.cold:
        results["cat"] = []
    for _ in range(args.runs):
        for method in results:  # interleaved
            if args.cold:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            out = subprocess.run([sys.executable, "-c", CHILD, args.dir, method], check=True, capture_output=True, text=True)
            results[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    gb = results["tessera"][0]["bytes"] / 1e9
    cache = "page cache dropped before every load" if args.cold else "page cache warm"
    print(f"{gb:.2f} GB of bf16 tensors, {args.layers} layers at hidden {args.hidden}, {cache}, "
          f"fresh process per load, medians of {args.runs}")
    print("| method | load s | GB/s | load s per run |")
    print("|---|---|---|---|")
    for method, rows in results.items():
        loads = [r["load"] for r in rows]
        med = statistics.median(loads)
        print(f"| {method} | {med:.3f} | {gb / med:.2f} | {', '.join(f'{x:.3f}' for x in loads)} |")
    ratio = statistics.median(r["load"] for r in results["safe_open"]) / statistics.median(r["load"] for r in results["tessera"])
    print(f"tessera vs safe_open + copy_: {ratio:.2f}x")
    if args.cold:
        ratio = statistics.median(r["load"] for r in results["cat"]) / statistics.median(r["load"] for r in results["tessera"])
        print(f"tessera vs cat (reading the shards once): {ratio:.2f}x")


if __name__ == "__main__":
    main()

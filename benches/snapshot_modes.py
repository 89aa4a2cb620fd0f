#!/usr/bin/env python3
"""What a checkpoint costs the training thread (issue 32): a CPU training loop that checkpoints
every `--every` steps with tessera.async_save in each snapshot mode (eager, lazy, multi-step)
and with dcp.async_save (thread and process executors), against the same loop without
checkpoints, in one run, modes interleaved, medians over `--rounds`.

The job: one training process (a world-1 gloo group) with `torch.set_num_threads(1)`, so the
machine's other core is free for the snapshot copy and the persist (on this 2-core machine; the
setting the issue names). The model has Llama-like layer shapes at hidden 1024: q/o projections
1024x1024, GQA k/v projections 1024x256, SwiGLU gate/up/down 1024x2816 (bf16 would be the
parameters' dtype on a GPU; on CPU the loop trains in float32), `--layers` of them, AdamW with
its two fp32 moments: the state saved is parameters + moments. Each step: forward and backward
of `--tokens` tokens, gradient clipping, AdamW step, a learning-rate schedule.

Per mode and round: the seconds of every step; a checkpoint step's **extra** time is its time
(for multi-step: the k steps it spans) minus the median step without checkpoint of the same run;
**longest/normal** is the longest step over the median normal step; **throughput** is steps per
second over the whole loop. tessera's handles also report the call's blocking time and the
optimizer steps' waits (lazy, multi-step).

Usage (release module first: `cd python && maturin develop --release && cd ..`):
    python benches/snapshot_modes.py --layers 3 --tokens 96 --steps 50 --every 5 --rounds 3 \
        --dir /work/main/target/bench-snapshot
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

MODES = ["none", "eager", "lazy", "multi_step", "dcp_thread", "dcp_process"]


def _model(layers: int):
    import torch

    hidden, kv, ffn = 1024, 256, 2816

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(hidden, hidden, bias=False)
            self.k = torch.nn.Linear(hidden, kv, bias=False)
            self.v = torch.nn.Linear(hidden, kv, bias=False)
            self.o = torch.nn.Linear(hidden, hidden, bias=False)
            self.gate = torch.nn.Linear(hidden, ffn, bias=False)
            self.up = torch.nn.Linear(hidden, ffn, bias=False)
            self.down = torch.nn.Linear(ffn, hidden, bias=False)
            self.norm = torch.nn.RMSNorm(hidden)

        def forward(self, x):
            h = self.norm(x)
            # Attention's projections (the score computation is left out: its cost does not
            # touch the state saved).
            v = self.v(h).repeat(1, hidden // kv)
            x = x + self.o(self.q(h) * torch.sigmoid(self.k(h).repeat(1, hidden // kv)) * v)
            h = self.norm(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(layers)])


def _run_mode(mode: str, args: argparse.Namespace, root: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    import tessera

    for old in os.listdir(root):  # a previous run's checkpoints of this mode
        if old.startswith(f"{mode}-"):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    model = _model(args.layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + 0.01 * s))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(args.tokens, 1024, generator=g) for _ in range(4)]

    def step(i: int) -> None:
        loss = model(data[i % 4]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad()

    for i in range(2):  # Adam has its state before the first checkpoint
        step(i)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t)
    )
    times, ckpt_steps, blocked, waited = [], [], [], []
    handles, futures = [], []
    previous_dirs: list = []
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    began = time.perf_counter()
    for i in range(args.steps):
        t0 = time.perf_counter()
        span = args.multi_steps if mode == "multi_step" else 1
        if (i + 1) % args.every == 0 and mode != "none" and i + span <= args.steps:
            path = os.path.join(root, f"{mode}-{i}")
            previous_dirs.append(path)
            state = {"model": model, "optim": optim}
            ckpt_steps.append(i)
            if mode in ("eager", "lazy", "multi_step"):
                extra = {"steps": args.multi_steps} if mode == "multi_step" else {}
                h = tessera.async_save(state, path, snapshot=mode, optimizer=None if mode == "eager" else optim, **extra)
                handles.append(h)
            else:
                if futures:
                    futures[-1].result()  # one save in flight, as tessera's
                kind = AsyncCheckpointerType.PROCESS if mode == "dcp_process" else AsyncCheckpointerType.THREAD
                futures.append(dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind))
            blocked.append(time.perf_counter() - t0)
        step(i)
        times.append(time.perf_counter() - t0)
        # Keep the disk to the last two checkpoints of the mode.
        while len(previous_dirs) > 2 and (handles or futures):
            old = previous_dirs.pop(0)
            shutil.rmtree(old, ignore_errors=True)
    total = time.perf_counter() - began
    for h in handles:
        h.result(timeout=600)
        waited.append(h.step_wait_seconds)
    for f in futures:
        f.result()
    for path in previous_dirs:
        shutil.rmtree(path, ignore_errors=True)
    normal = [t for i, t in enumerate(times) if not any(c <= i < c + span for c in ckpt_steps)]
    median = statistics.median(normal)
    extra = [sum(times[c : c + span]) - span * median for c in ckpt_steps]
    return {
        "state_mb": state_bytes / 1e6,
        "median_step": median,
        "extra": statistics.median(extra) if extra else 0.0,
        "longest_ratio": max(times) / median,
        "throughput": args.steps / total,
        "blocked": statistics.median(blocked) if blocked else 0.0,
        "step_wait": statistics.median(waited) if waited else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--multi-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dir", default="target/bench-snapshot")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    os.makedirs(args.dir, exist_ok=True)
    modes = args.modes.split(",")
    results: dict = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:  # interleaved: every round runs every mode once
            results[mode].append(_run_mode(mode, args, args.dir))
            print(f"round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr, flush=True)
    base = statistics.median(x["throughput"] for x in results.get("none", [{"throughput": float("nan")}]))
    print(f"state {results[modes[0]][0]['state_mb']:.0f} MB, {args.layers} layers, {args.tokens} tokens/step, "
          f"1 training thread, checkpoint every {args.every} of {args.steps} steps, medians of {args.rounds} rounds")
    print("| mode | median step s | extra per checkpoint s | call blocked s | step waited s | longest/normal step | steps/s | vs no checkpoint |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        rows = results[mode]

        def med(key: str) -> float:
            return statistics.median(x[key] for x in rows)

        print(f"| {mode} | {med('median_step'):.3f} | {med('extra'):.3f} | {med('blocked'):.3f} | {med('step_wait'):.3f} | "
              f"{med('longest_ratio'):.2f} | {med('throughput'):.2f} | {med('throughput') / base:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

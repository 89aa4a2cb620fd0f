"""One publisher rank of the web UI suite's live publication: `tessera.publish` (the real path:
the eager snapshot, this rank's data file served over HTTP, its part in the registry, rank 0's
commit) of a small state at each step given, waiting for each step's outcome.

    python publish_live.py REGISTRY RANK WORLD STEPS [TIMEOUT]

STEPS is comma-separated. A step rank 0 cannot commit within TIMEOUT seconds (a rank that never
publishes it) is reported and left incomplete, as a real job would leave it.
"""

import sys

import torch

import tessera

registry, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = [int(s) for s in sys.argv[4].split(",")]
timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 60.0
for step in steps:
    # Rows [2 * rank, 2 * rank + 2) of a (2 * world) x 4 weight, and a bias every rank holds.
    rows = torch.arange(8 * world, dtype=torch.float32).reshape(2 * world, 4)[2 * rank : 2 * rank + 2]
    state = {"layers.0.w": rows + step, "layers.0.b": torch.zeros(4) + step}
    pub = tessera.publish(state, "policy", step=step, registry=registry, rank=rank, world_size=world, timeout=timeout)
    try:
        report = pub.result(timeout + 60)
        print(f"rank {rank} step {step}: {report.bytes} bytes served", flush=True)
    except tessera.TesseraError as e:
        print(f"rank {rank} step {step}: not committed: {e}", flush=True)

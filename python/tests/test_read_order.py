"""The default read order is decided in one place, the planner's cost model, for every front end:
a torch job's `tessera.load` over its gloo group and `tessera load` of the same requests make the
same plan. Real torch, 2 gloo processes on 127.0.0.1, and the CLI binary."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import TESSERA_BIN, free_port

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import tessera  # noqa: E402

ROWS, COLS, WORLD = 1024, 128, 2


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _columns(rank: int) -> tuple:
    """Rank `rank`'s box of a Shard(1) layout: (offsets, lengths)."""
    width = COLS // WORLD
    return [0, rank * width], [ROWS, width]


def _job_rank(rank, world, port, path, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {
            "w": DTensor.from_local(
                torch.full((ROWS, COLS // world), -1.0), mesh, [Shard(1)], run_check=False,
                shape=torch.Size([ROWS, COLS]), stride=(COLS, 1),
            )
        }
        report = tessera.load(state, path, progress=False, timeout=60)
        (offset, width) = (_columns(rank)[0][1], _columns(rank)[1][1])
        out[rank] = (torch.equal(state["w"].to_local(), _full()[:, offset:offset + width]), report.to_dict())
    finally:
        dist.destroy_process_group()


def _cli(path, requests_file, *flags) -> dict:
    done = subprocess.run(
        [str(TESSERA_BIN), "load", str(path), "--requests", str(requests_file), "--json", *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_torch_job_and_the_cli_choose_the_same_read_order(tmp_path):
    """A [1024, 128] float32 matrix saved as one native box, loaded as Shard(1) on 2 ranks: every
    rank's column slice is 1024 row slices of 256 bytes, which the cost model reads in slabs
    (storage order) and relays (slices of 1 KiB and more it reads per request, by position). The torch job (default read order) and the CLI (default read order) read
    and send the same bytes rank by rank, and they are not request order's."""
    path = tmp_path / "native"
    tessera.save({"w": _full()}, str(path))
    out = mp.Manager().dict()
    mp.spawn(_job_rank, args=(WORLD, free_port(), str(path), out), nprocs=WORLD, join=True)

    requests = tmp_path / "requests.json"
    boxes = [_columns(rank) for rank in range(WORLD)]
    requests.write_text(json.dumps(
        {"ranks": [[{"fqn": "w", "offsets": offsets, "lengths": lengths}] for offsets, lengths in boxes]}
    ))
    default = _cli(path, requests)
    by_request = _cli(path, requests, "--read-order", "request")
    assert default["plan"]["slabs"] > 0 and default["plan"]["bytes_relayed"] > 0, default["plan"]
    for rank in range(WORLD):
        equal, job = out[rank]
        assert equal, rank
        cli = default["ranks"][rank]
        assert (job["bytes_read"], job["bytes_sent"]) == (cli["bytes_read"], cli["bytes_sent"]), (rank, job, cli)
    assert sum(out[rank][1]["bytes_sent"] for rank in range(WORLD)) > 0
    # Request order would make another plan: each rank its own columns, nothing sent.
    assert all(r["bytes_sent"] == 0 for r in by_request["ranks"]), by_request["ranks"]

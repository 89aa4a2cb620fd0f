"""DCP checkpoints saved compressed (`FileSystemWriter(_extensions=[ZStandard()])`, every blob a
zstd stream) load with tessera as torch loads them: resharded over a gloo job, through the
StorageReader, with a damaged stream refused naming its file. Real torch, real zstandard."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from conftest import join_job, run_job

import torch  # noqa: E402  (make python-test installs it)
import torch.distributed.checkpoint as dcp  # noqa: E402

import tessera  # noqa: E402
import tessera.torch  # noqa: E402

pytest.importorskip("zstandard", reason="DCP's ZStandard extension needs the zstandard module (make python-env installs it)")
from torch.distributed.checkpoint._extension import ZStandard  # noqa: E402

ROWS, COLS = 12, 10


def _full():
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5
    e = (torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) - 7).to(torch.bfloat16)
    return w, e


def _save_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    join_job(rank, 2, port)
    mesh = DeviceMesh("cpu", [0, 1])
    w, e = _full()
    state = {
        "w": distribute_tensor(w, mesh, [Shard(0)]),
        "e": distribute_tensor(e, mesh, [Shard(0)]),
        "zeros": torch.zeros(256, 256),
        "step": 11,
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]), process_group=dist.group.WORLD)
    Path(out, f"rank{rank}.json").write_text("{}")
    dist.destroy_process_group()


def _load_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    join_job(rank, 3, port)
    mesh = DeviceMesh("cpu", [0, 1, 2])
    state = {
        "w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
        "e": distribute_tensor(torch.zeros(ROWS, 4, dtype=torch.bfloat16), mesh, [Shard(0)]),
        "zeros": torch.ones(256, 256),
        "step": 0,
    }
    try:
        report = tessera.load(state, path, process_group=dist.group.WORLD, progress=False, timeout=60)
        result = {
            "w": state["w"].to_local().tolist(),
            "e": state["e"].to_local().float().tolist(),
            "zeros": bool(torch.all(state["zeros"] == 0)),
            "step": state["step"],
            "unverified": report.bytes_unverified,
        }
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> Path:
    """A checkpoint two gloo ranks saved with DCP's ZStandard extension."""
    root = tmp_path_factory.mktemp("zstd")
    path = root / "ckpt"
    run_job(_save_rank, 2, (str(path),), root)
    return path


def test_every_blob_of_the_checkpoint_is_a_zstd_stream(compressed):
    meta = dcp.FileSystemReader(str(compressed)).read_metadata()
    descriptors = {tuple(info.transform_descriptors or ()) for info in meta.storage_data.values()}
    assert descriptors == {("stream.zstd/1",)}, descriptors
    # Compressed for real: the zeros take far less than their 256 KiB.
    assert sum(f.stat().st_size for f in compressed.glob("*.distcp")) < 64 << 10


def test_a_compressed_checkpoint_reshards_over_a_gloo_job(compressed, tmp_path):
    got = run_job(_load_rank, 3, (str(compressed),), tmp_path)
    w, e = _full()
    cols = [(0, 4), (4, 8), (8, 10)]  # Shard(1) of 10 columns over 3 ranks
    rows = [(0, 4), (4, 8), (8, 12)]
    for rank in range(3):
        assert "error" not in got[rank], got[rank]
        lo, hi = cols[rank]
        assert got[rank]["w"] == w[:, lo:hi].tolist(), rank
        lo, hi = rows[rank]
        assert got[rank]["e"] == e[lo:hi].float().tolist(), rank
        assert got[rank]["zeros"] and got[rank]["step"] == 11
        # Each blob's zip CRC-32 covers its decoded storage: checked as for any DCP blob.
        assert got[rank]["unverified"] == 0


def test_the_storage_reader_loads_what_torchs_reader_loads(compressed):
    def empty():
        return {"w": torch.zeros(ROWS, COLS), "e": torch.zeros(ROWS, 4, dtype=torch.bfloat16), "zeros": torch.ones(256, 256), "step": 0}

    ours, theirs = empty(), empty()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: one process
        dcp.load(ours, storage_reader=tessera.torch.StorageReader(str(compressed)))
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(compressed)))
    for key in ("w", "e", "zeros"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["step"] == theirs["step"] == 11
    w, _ = _full()
    assert torch.equal(ours["w"], w)


def test_a_damaged_stream_is_refused_naming_its_file(compressed, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(compressed, damaged)
    meta = dcp.FileSystemReader(str(damaged)).read_metadata()
    # The blob of rank 0's half of "w": flip a byte in the middle of its stream.
    index = next(i for i in meta.storage_data if i.fqn == "w" and i.offset is not None and i.offset[0] == 0)
    info = meta.storage_data[index]
    data_file = damaged / info.relative_path
    raw = bytearray(data_file.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x20
    data_file.write_bytes(bytes(raw))
    state = {"w": torch.zeros(ROWS, COLS)}
    with pytest.raises(tessera.TesseraError) as refused:
        tessera.load(state, str(damaged), progress=False, strict=False)
    message = str(refused.value)
    assert info.relative_path in message, message


def _cli(*args: str):
    import subprocess

    from conftest import TESSERA_BIN

    if not TESSERA_BIN.exists():
        pytest.fail(f"{TESSERA_BIN} is missing: build it with `cargo build --bin tessera`")
    return subprocess.run([str(TESSERA_BIN), *args], capture_output=True, text=True, timeout=120)


def test_the_cli_verifies_and_converts_it(compressed, tmp_path):
    # Every blob is checked over its decoded bytes: 6 tensor storages (w and e in two halves,
    # zeros once) and the step object.
    run = _cli("verify", str(compressed))
    assert run.returncode == 0, run.stderr
    assert "ok, PyTorch DCP" in run.stdout and "match their zip CRC-32" in run.stdout, run.stdout
    out = tmp_path / "hf"
    run = _cli("convert", str(compressed), "--format", "safetensors", "--out", str(out))
    assert run.returncode == 0, run.stderr
    from safetensors.torch import load_file

    got = load_file(str(out / "model-00001-of-00001.safetensors"))
    w, e = _full()
    assert torch.equal(got["w"], w)
    assert torch.equal(got["e"], e)
    assert torch.equal(got["zeros"], torch.zeros(256, 256))


def test_the_cli_refuses_a_damaged_stream_naming_its_file(compressed, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(compressed, damaged)
    meta = dcp.FileSystemReader(str(damaged)).read_metadata()
    index = next(i for i in meta.storage_data if i.fqn == "w" and i.offset is not None and i.offset[0] == 0)
    info = meta.storage_data[index]
    data_file = damaged / info.relative_path
    raw = bytearray(data_file.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x20
    data_file.write_bytes(bytes(raw))
    # Either the stream no longer decodes (opening fails, exit 3) or it decodes to other bytes
    # (the storage's CRC-32 does not match, exit 4): both name the file.
    run = _cli("verify", str(damaged))
    assert run.returncode in (3, 4), (run.returncode, run.stdout, run.stderr)
    assert info.relative_path in run.stderr, run.stderr
    # The real file, not the name its decoded bytes go by in the checkpoint model.
    assert ".zstd not found" not in run.stderr, run.stderr
    assert f"{info.relative_path} bytes {info.offset}..{info.offset + info.length}" in run.stderr, run.stderr
    run = _cli("convert", str(damaged), "--format", "safetensors", "--out", str(tmp_path / "hf"))
    assert run.returncode in (3, 4), (run.returncode, run.stdout, run.stderr)
    assert info.relative_path in run.stderr, run.stderr
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()

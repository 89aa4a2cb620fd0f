"""DCP checkpoints are verified by default on every Python load path: each blob's zip CRC-32,
parts of a blob folded by the ranks that read them. One flipped byte in a blob's storage fails
`tessera.load` (one process, and over a gloo process group reading column halves) and
`tessera.torch.StorageReader`, naming the file, the box and the tensor; the intact checkpoint
loads with no warning."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import fixture, join_job, run_job

import torch  # noqa: E402  (make python-test installs it)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import tessera  # noqa: E402
import tessera.torch  # noqa: E402

A = "a_w1_plain"
# model.lm_head.weight: one 96 x 64 float32 blob of __0_0.distcp, stored transposed.
BLOB_AT, FLIP_AT = 309355, 309355 + 1000
NAMED = "__0_0.distcp bytes 310059..334635 (tensor model.lm_head.weight box [0..96, 0..64])"


def flipped(tmp_path: Path) -> Path:
    path = tmp_path / A
    shutil.copytree(fixture(A), path)
    distcp = path / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[FLIP_AT] ^= 0x10
    distcp.write_bytes(bytes(data))
    return path


def test_one_process_load_fails_naming_the_blob_and_the_intact_one_loads_without_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = tessera.load({"model.lm_head.weight": np.empty((96, 64), np.float32)}, str(fixture(A)), progress=False)
    assert report.boxes_verified == 1 and report.bytes_unverified == 0
    with pytest.raises(tessera.TesseraError) as failed:
        tessera.load({"model.lm_head.weight": np.empty((96, 64), np.float32)}, str(flipped(tmp_path)), progress=False)
    message = str(failed.value)
    assert "checksum mismatch in " in message and f"{NAMED}: its metadata records CRC-32 " in message, message


def test_a_part_read_alone_is_reported_unverified_with_a_warning():
    # One process reading a column half: nobody reads the other half, so the blob's CRC cannot
    # be folded whole without reading extra bytes; the report and a warning say so.
    with pytest.warns(UserWarning, match=r"12288 bytes of .* were read without a checksum"):
        report = tessera.load(
            {"model.lm_head.weight": (np.empty((96, 32), np.float32), (0, 32))}, str(fixture(A)), progress=False
        )
    assert report.bytes_unverified == 96 * 32 * 4


def _column_half(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    join_job(rank, 2, port)
    result = {}
    try:
        state = {"model.lm_head.weight": (np.empty((96, 32), np.float32), (0, 32 * rank))}
        report = tessera.load(state, path, process_group=dist.group.WORLD, progress=False, timeout=60)
        result = {"ok": True, "unverified": report.bytes_unverified}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": str(e)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _group_load(path: Path, out: Path) -> dict:
    return run_job(_column_half, 2, (str(path),), out)


def test_column_halves_over_a_process_group_are_checked_jointly(tmp_path):
    intact = _group_load(fixture(A), tmp_path)
    assert intact == {0: {"ok": True, "unverified": 0}, 1: {"ok": True, "unverified": 0}}, intact
    bad = _group_load(flipped(tmp_path), tmp_path)
    for rank, result in bad.items():
        message = result.get("error", "")
        assert "checksum mismatch in " in message, (rank, result)
        assert f"{NAMED}, read in parts by ranks [0, 1]: expected CRC-32 " in message, (rank, result)


def test_storage_reader_fails_naming_the_blob(tmp_path):
    state = {"model.lm_head.weight": torch.empty((96, 64))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dcp.load alone warns that it has no group
        dcp.load(state, storage_reader=tessera.torch.StorageReader(str(fixture(A))))
        # DCP wraps a reader's error in its CheckpointException (a BaseException).
        with pytest.raises(CheckpointException) as failed:
            dcp.load(state, storage_reader=tessera.torch.StorageReader(str(flipped(tmp_path))))
    message = str(failed.value)
    assert "checksum mismatch in " in message and f"{NAMED}: its metadata records CRC-32 " in message, message


def test_a_chunk_pointed_at_another_chunks_blob_is_refused_at_open(tmp_path):
    # Forged .metadata: two row chunks of one tensor share one blob. The blob's zip CRC is
    # right for its bytes, so only the open can tell (torch writes each chunk its own blob).
    import pickle

    path = tmp_path / "b"
    shutil.copytree(fixture("b_w4_fsdp_shard0"), path)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    chunks = sorted(
        (index for index in metadata.storage_data if index.fqn == "model.layers.0.attn.qkv.weight"),
        key=lambda index: tuple(index.offset),
    )
    metadata.storage_data[chunks[1]] = metadata.storage_data[chunks[0]]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(tessera.TesseraError) as refused:
        tessera.load({"model.layers.0.attn.qkv.weight": np.empty((192, 64), np.float32)}, str(path), progress=False)
    message = str(refused.value)
    assert "tensor model.layers.0.attn.qkv.weight chunk [0..48, 0..64]" in message, message
    assert "tensor model.layers.0.attn.qkv.weight chunk [48..96, 0..64]" in message, message
    assert "point at the same bytes" in message, message

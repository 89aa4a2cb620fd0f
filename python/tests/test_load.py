"""tessera.load into NumPy arrays, checked against what PyTorch wrote and what its own resharding
load gives each rank (shared/fixtures/dcp)."""

from __future__ import annotations

import multiprocessing
import shutil

import numpy as np
import pytest

import tessera
from conftest import (
    DCP_FIXTURES,
    LAYOUTS,
    empty,
    expected_tensors,
    fixture,
    free_port,
    rank_state,
    reference,
    sha256,
)


@pytest.mark.parametrize("name", DCP_FIXTURES + ["f_hf_w1_full"])
def test_whole_tensors_match_expected(name):
    tensors = expected_tensors(name)
    state = {fqn: empty(t["dtype"], t["shape"]) for fqn, t in tensors.items()}
    report = tessera.load(state, str(fixture(name)), progress=False)
    assert report["bytes_needed"] == sum(a.nbytes for a in state.values())
    for fqn, t in tensors.items():
        assert sha256(state[fqn]) == t["sha256"], fqn


@pytest.mark.parametrize("name", DCP_FIXTURES + ["f_hf_w1_full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_gets_torchs_bytes(name, layout):
    ref = reference(name, layout)
    world = ref["world_size"]
    for rank in range(world):
        state = rank_state(ref, rank)
        tessera.load(state, str(fixture(name)), rank=rank, world_size=world, progress=False)
        for fqn, t in ref["tensors"].items():
            assert sha256(state[fqn][0]) == t["ranks"][rank]["sha256"], (fqn, rank)


def test_box_and_dataclass_forms_agree():
    name = "c_w4_dp2_tp2"
    t = expected_tensors(name)["model.layers.0.attn.qkv.weight"]
    full = empty(t["dtype"], t["shape"])
    tessera.load({"model.layers.0.attn.qkv.weight": full}, str(fixture(name)), progress=False)
    part = empty(t["dtype"], [5, t["shape"][1] - 3])
    tessera.load(
        {"model.layers.0.attn.qkv.weight": tessera.Box(part, [7, 3])},
        str(fixture(name)),
        progress=False,
    )
    assert part.tobytes() == full[7:12, 3:].tobytes()


def test_flat_ranges_for_zero_buffers():
    name = "b_w4_fsdp_shard0"
    fqn = "model.pos_emb.weight"  # 98 rows saved 25/25/25/23: the range crosses saved chunks
    t = expected_tensors(name)[fqn]
    full = empty(t["dtype"], t["shape"])
    tessera.load({fqn: full}, str(fixture(name)), progress=False)
    flat = empty(t["dtype"], [1000])
    tessera.load({fqn: tessera.Flat(flat, 1500)}, str(fixture(name)), progress=False)
    assert flat.tobytes() == full.reshape(-1)[1500:2500].tobytes()


def test_nested_state_dict_is_flattened_like_dcp():
    name = "a_w1_plain"
    tensors = expected_tensors(name)
    t = tensors["model.lm_head.weight"]  # saved as a transposed (strided) view
    nested = {"model": {"lm_head.weight": empty(t["dtype"], t["shape"])}}
    tessera.load(nested, str(fixture(name)), progress=False)
    assert sha256(nested["model"]["lm_head.weight"]) == t["sha256"]


def test_file_url_and_progress_callback():
    name = "c_w4_dp2_tp2"
    tensors = expected_tensors(name)
    state = {fqn: empty(t["dtype"], t["shape"]) for fqn, t in tensors.items()}
    calls = []
    tessera.load(
        state, fixture(name).resolve().as_uri(), progress=lambda done, total: calls.append((done, total))
    )
    total = sum(a.nbytes for a in state.values())
    assert calls and calls[-1] == (total, total)
    assert all(sha256(state[f]) == t["sha256"] for f, t in tensors.items())


def test_safetensors_reference_files():
    h = fixture("h_reference_full_safetensors")
    expected = expected_tensors("c_w4_dp2_tp2")
    state = {fqn: empty(t["dtype"], t["shape"]) for fqn, t in expected.items()}
    tessera.load(state, str(h / "all_tensors_dcp_fqns.safetensors"), progress=False)
    for fqn, t in expected.items():
        assert sha256(state[fqn]) == t["sha256"], fqn


def _exchange_rank(args):
    name, layout, rank, world, port = args
    ref = reference(name, layout)
    state = rank_state(ref, rank)
    report = tessera.load(
        state,
        str(fixture(name)),
        rank=rank,
        world_size=world,
        exchange=True,
        master_addr="127.0.0.1",
        master_port=port,
        progress=False,
        timeout=60,
    )
    shas = {fqn: sha256(state[fqn][0]) for fqn in state}
    return report, shas


def test_exchange_across_processes_reads_each_byte_once():
    name, layout = "c_w4_dp2_tp2", "w3_shard0"
    ref = reference(name, layout)
    world, port = ref["world_size"], free_port()
    with multiprocessing.get_context("spawn").Pool(world) as pool:
        results = pool.map(_exchange_rank, [(name, layout, r, world, port) for r in range(world)])
    for rank, (report, shas) in enumerate(results):
        assert report["rank"] == rank
        for fqn, t in ref["tensors"].items():
            assert shas[fqn] == t["ranks"][rank]["sha256"], (fqn, rank)
    # Replicated 0-dim tensors (train_step, optimizer steps) are read by one rank and passed on.
    assert sum(r["bytes_received"] for r, _ in results) > 0
    assert sum(r["bytes_sent"] for r, _ in results) == sum(r["bytes_received"] for r, _ in results)
    needed = sum(r["bytes_needed"] for r, _ in results)
    assert sum(r["bytes_read"] for r, _ in results) < needed


def test_native_round_trip_through_save(tmp_path):
    name = "c_w4_dp2_tp2"
    tensors = expected_tensors(name)
    state = {fqn: empty(t["dtype"], t["shape"]) for fqn, t in tensors.items()}
    tessera.load(state, str(fixture(name)), progress=False)
    out = tmp_path / "run" / "step-7"
    manifest = tessera.save({**state, "extra.note": b"hello"}, str(out))
    assert manifest["step"] == 7 and manifest["tensors"] == len(tensors)
    info = tessera.inspect(str(out))
    assert info["format"] == "native" and len(info["tensors"]) == len(tensors)
    ref = reference(name, "w2_shard1")
    for rank in range(ref["world_size"]):
        part = rank_state(ref, rank)
        report = tessera.load(part, str(out), rank=rank, world_size=2, progress=False)
        assert report["bytes_fetched"] >= report["bytes_read"]  # verified: whole checksum blocks
        for fqn, t in ref["tensors"].items():
            assert sha256(part[fqn][0]) == t["ranks"][rank]["sha256"], (fqn, rank)


def test_native_load_detects_corruption(tmp_path):
    a = np.arange(100_000, dtype=np.float32)
    out = tmp_path / "ckpt"
    tessera.save({"w": a}, str(out))
    data = next((out / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[1234] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tessera.TesseraError, match=r"checksum"):
        tessera.load({"w": np.empty_like(a)}, str(out), progress=False)
    assert tessera.load({"w": np.empty_like(a)}, str(out), verify=False, progress=False)


def test_copied_checkpoint_loads_from_a_new_place(tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(fixture("b_w4_fsdp_shard0"), dst)
    t = expected_tensors("b_w4_fsdp_shard0")["model.tiny.weight"]  # has an empty saved chunk
    a = empty(t["dtype"], t["shape"])
    tessera.load({"model.tiny.weight": a}, str(dst), progress=False)
    assert sha256(a) == t["sha256"]


def test_report_names_read_and_io_amplification(tmp_path):
    # Eight 4,000-byte tensors (far below a 64 KiB checksum block) and one of 800,000 bytes.
    arrays = {f"small.{i}": np.arange(1000, dtype=np.float32) + i for i in range(8)}
    arrays["big"] = np.arange(200_000, dtype=np.float32)
    out = tmp_path / "ckpt"
    tessera.save(arrays, str(out))

    # Whole tensors: every box checked by its own crc32c, not a byte fetched beyond the data.
    state = {k: np.empty_like(v) for k, v in arrays.items()}
    report = tessera.load(state, str(out), progress=False)
    assert report["boxes_verified"] == 9 and report["verify_extra_bytes"] == 0
    assert report["read_amplification"] == 1.0 and report["io_amplification"] == 1.0
    assert all((state[k] == v).all() for k, v in arrays.items())

    # 100 elements inside the big tensor: the checksum block around them is fetched, and the I/O
    # figure says how much that costs while read amplification stays 1.0.
    part = np.empty(100, np.float32)
    report = tessera.load({"big": tessera.Flat(part, 100_000)}, str(out), progress=False)
    assert (part == arrays["big"][100_000:100_100]).all()
    assert report["bytes_read"] == 400 and report["read_amplification"] == 1.0
    assert report["bytes_fetched"] == 400 + report["verify_extra_bytes"] >= 64 * 1024
    assert report["io_amplification"] == report["bytes_fetched"] / 400

    # 100 elements of a small tensor: the whole 4,000-byte box instead of a 64 KiB block.
    part = np.empty(100, np.float32)
    report = tessera.load({"small.3": tessera.Flat(part, 500)}, str(out), progress=False)
    assert (part == arrays["small.3"][500:600]).all()
    assert report["bytes_fetched"] == 4000 and report["boxes_verified"] == 1
    assert report["io_amplification"] == 10.0


def test_a_metadata_only_checkpoint_is_refused_saying_so(tmp_path):
    """`tessera synth --metadata-only` writes no data files: tessera.load says the checkpoint is
    metadata-only, naming it, not that a data file is missing."""
    import subprocess

    from conftest import TESSERA_BIN

    layout = tmp_path / "dp1.json"
    layout.write_text(subprocess.run(
        [str(TESSERA_BIN), "layout", "fsdp", "--dp", "1"], check=True, capture_output=True, text=True,
    ).stdout)
    ckpt = tmp_path / "ck"
    subprocess.run(
        [str(TESSERA_BIN), "synth", "--model", "gpt-tiny", "--layout", str(layout), "--out", str(ckpt),
         "--metadata-only"],
        check=True, capture_output=True,
    )
    state = {"model.final_ln.weight": empty("float32", [64])}
    with pytest.raises(tessera.TesseraError, match=rf"{ckpt}: a metadata-only checkpoint has no data to load"):
        tessera.load(state, str(ckpt), progress=False)

"""Object-store URLs: the same loads and saves through a real S3-compatible server on 127.0.0.1."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera
from conftest import empty, expected_tensors, fixture, rank_state, reference, sha256


def test_dcp_fixture_through_s3(s3_server):
    root, env = s3_server
    shutil.copytree(fixture("c_w4_dp2_tp2"), root / "ckpts" / "c")
    ref = reference("c_w4_dp2_tp2", "w3_shard0")
    for rank in range(ref["world_size"]):
        state = rank_state(ref, rank)
        report = tessera.load(
            state, "s3://ckpts/c", rank=rank, world_size=3, storage_options=env, progress=False
        )
        assert report["requests"] > 0
        for fqn, t in ref["tensors"].items():
            assert sha256(state[fqn][0]) == t["ranks"][rank]["sha256"], (fqn, rank)
    assert tessera.inspect("s3://ckpts/c", storage_options=env)["format"] == "dcp"


def test_save_to_s3_and_load_back(s3_server):
    _root, env = s3_server
    tensors = expected_tensors("c_w4_dp2_tp2")
    state = {fqn: empty(t["dtype"], t["shape"]) for fqn, t in tensors.items()}
    tessera.load(state, str(fixture("c_w4_dp2_tp2")), progress=False)
    manifest = tessera.save(state, "s3://ckpts/native/step-5", storage_options=env)
    assert manifest["step"] == 5
    again = {fqn: empty(t["dtype"], t["shape"]) for fqn, t in tensors.items()}
    tessera.load(again, "s3://ckpts/native/step-5", storage_options=env, progress=False)
    for fqn, t in tensors.items():
        assert sha256(again[fqn]) == t["sha256"], fqn


def test_wrong_credentials_are_an_error(s3_server):
    _root, env = s3_server
    bad = {**env, "AWS_SECRET_ACCESS_KEY": "wrong"}
    with pytest.raises(tessera.TesseraError, match=r"s3://ckpts/c"):
        tessera.load({"x": np.empty(1, np.float32)}, "s3://ckpts/c", storage_options=bad, progress=False)


def test_report_counts_what_the_server_sent(s3_server):
    """A column reshard through S3: the bytes and requests the ranks report as transferred are what
    the server itself counts on the wire for the data files (over the reads of opening alone)."""
    root, env = s3_server
    shutil.copytree(fixture("c_w4_dp2_tp2"), root / "ckpts" / "served")
    ref = reference("c_w4_dp2_tp2", "w2_shard1")
    data = "/ckpts/served/__"  # the .distcp data files
    s3_server.reset()
    # Opening reads the .metadata and the zip headers; tessera.load opens the same way first.
    tessera._tessera.open_checkpoint("s3://ckpts/served", sorted(env.items()))
    opening = s3_server.served(data)
    reported = {"bytes": 0, "requests": 0, "needed": 0, "fetched": 0}
    served = {"get_body_bytes": 0, "get_requests": 0}
    for rank in range(ref["world_size"]):
        state = rank_state(ref, rank)
        s3_server.reset()
        report = tessera.load(state, "s3://ckpts/served", rank=rank, world_size=ref["world_size"], storage_options=env, progress=False)
        wire = s3_server.served(data)
        for key in served:
            served[key] += wire[key] - opening[key]
        reported["bytes"] += report.bytes_transferred
        reported["requests"] += report.requests
        reported["needed"] += report.bytes_needed
        reported["fetched"] += report.bytes_fetched
        for fqn, t in ref["tensors"].items():
            assert sha256(state[fqn][0]) == t["ranks"][rank]["sha256"], (fqn, rank)
    assert reported["bytes"] == served["get_body_bytes"] > 0
    assert reported["requests"] == served["get_requests"] > 0
    # Gaps between a column slice's rows ride along (README: --coalesce-gap; tests/s3_transfer.rs
    # holds the per-gap bound): the wire carries at least the needed bytes, and says so.
    assert reported["bytes"] >= reported["fetched"] >= reported["needed"]

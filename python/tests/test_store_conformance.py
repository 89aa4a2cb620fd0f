"""One conformance list, run against every object store of stores.py (moto's S3, Azurite's Azure
Blob, fake-gcs-server's GCS), each a real server of its kind written by others than tessera: what
users do with checkpoints in a store, checked by what the store itself holds and served
afterwards (counted at the server, or at a proxy in front of it, never by tessera).

The list: the catalog and plans of `tessera serve --root <store>`, `tessera plan`/`inspect` (CLI
and Python), partial loads whose bytes the server counts, native saves (multipart uploads, the
write claim first, the manifest last, `latest` after it), a second writer refused naming the
holder, two writers racing, `async_save`, `tessera verify`, `tessera convert` from and to the
store, and `tessera gc` of what a killed save left. A store this machine cannot start skips every
test, saying why; a store that refuses tessera's writes (fake-gcs-server refuses object_store's
GCS uploads: see stores.FakeGcs) skips the tests that write, quoting its answer, and runs the
others on checkpoints put there through its own client.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import urllib.request

import numpy as np
import pytest

import stores
import tessera
from conftest import TESSERA_BIN, fixture, rank_state, reference, sha256

C = "c_w4_dp2_tp2"
HOLDER = '{"pid": 4242, "host": "trainer-7", "created": "2026-01-02T03:04:05Z", "command": "tessera.save"}'
HELD = "is held by tessera.save pid 4242 on host trainer-7 since 2026-01-02T03:04:05Z"


@pytest.fixture(scope="module", params=sorted(stores.STORES))
def store(request):
    """A started store of each kind; stopped (its process gone) after the module's tests."""
    if not TESSERA_BIN.exists():
        pytest.fail(f"{TESSERA_BIN} is missing: build it with `cargo build --bin tessera`")
    server = stores.STORES[request.param]()
    try:
        try:
            server.start()
        except stores.StoreUnavailable as e:
            pytest.skip(f"{request.param} cannot run here: {e}")
        yield server
    finally:
        server.stop()


@pytest.fixture
def where(request, store) -> str:
    """A prefix in the store that only this test writes under."""
    return "t/" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")


def writing(store: stores.Store) -> None:
    """Skips the test where tessera cannot write into the store, saying why."""
    reason = store.writes()
    if reason is not None:
        pytest.skip(f"{store.name} takes no commits from tessera: {reason}")


def commit(store: stores.Store, where: str, saves: dict, tmp_path) -> None:
    """Saves each ``{path under where: state}`` into the store: with tessera where the store
    takes its writes, otherwise saved locally and put there through the store's own client (so
    that the read tests still run on it)."""
    if store.writes() is None:
        for path, state in saves.items():
            tessera.save(state, store.url_for(f"{where}/{path}"), storage_options=store.env)
        return
    local = tmp_path / "saved-locally"
    for path, state in saves.items():
        tessera.save(state, str(local / path))
    store.upload(local, where)


def cli(store: stores.Store, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The tessera binary with the store's settings in its environment, as a user sets them."""
    return subprocess.run(
        [str(TESSERA_BIN), *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, **store.env, **(env or {})},
    )


def ok(store: stores.Store, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = cli(store, *args, env=env)
    assert done.returncode == 0, f"tessera {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done


def check_reference(state: dict, ref: dict, rank: int) -> None:
    for fqn, t in ref["tensors"].items():
        assert sha256(state[fqn][0]) == t["ranks"][rank]["sha256"], (fqn, rank)


def load_reference(store: stores.Store, url: str, layout: str, **kwargs) -> None:
    """Loads every rank of the fixture's reference layout from `url` and checks torch's bytes."""
    ref = reference(C, layout)
    for rank in range(ref["world_size"]):
        state = rank_state(ref, rank)
        tessera.load(
            state, url, rank=rank, world_size=ref["world_size"], storage_options=store.env,
            progress=False, **kwargs,
        )
        check_reference(state, ref, rank)


def big_state() -> dict:
    # 20 MiB: the data file goes up in several multipart parts (8 MiB each).
    return {
        "big": np.arange(5 * 1024 * 1024, dtype=np.float32).reshape(5 * 1024, 1024),
        "small": np.arange(1000, dtype=np.int64),
        "train_state.epoch": 3,
        "train_state.name": "sft",
    }


def test_serve_catalogs_and_plans_the_checkpoints_in_the_store(store, where, tmp_path):
    store.upload(fixture(C), f"{where}/fixtures/c")
    commit(store, where, {f"run/step-{step}": {"w": np.full(8, step, np.float32)} for step in (1, 2)}, tmp_path)
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [str(TESSERA_BIN), "serve", "--root", store.url_for(where), "--addr", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, **store.env},
        )
    try:
        line = proc.stdout.readline()
        found = re.search(r"listening on (http://\S+)", line)
        assert found, f"tessera serve did not start: {line!r}, exit {proc.poll()}: {log.read_text()}"
        url = found.group(1)
        with urllib.request.urlopen(f"{url}/v1/checkpoints", timeout=30) as response:
            catalog = json.load(response)
        listed = {c["id"]: c for c in catalog["checkpoints"]}
        assert set(listed) == {"fixtures/c", "run/step-1", "run/step-2"}, catalog
        assert all(c["status"] == "committed" for c in listed.values()), catalog
        assert listed["fixtures/c"]["format"] == "dcp" and listed["run/step-2"]["format"] == "native"
        assert {r["run"]: r["latest"] for r in catalog["runs"]} == {"fixtures": None, "run": "run/step-2"}
        assert catalog["problems"] == []
        with urllib.request.urlopen(f"{url}/v1/checkpoints/run/latest", timeout=30) as response:
            assert json.load(response)["id"] == "run/step-2"
        # Ranks that plan on the server load right from the store.
        load_reference(store, store.url_for(f"{where}/fixtures/c"), "w2_shard1", server=url)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert re.search(r"^tessera_plan_computations_total 2$", metrics, re.M), metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_plan_and_inspect_see_the_store_as_a_local_copy(store, where):
    store.upload(fixture(C), f"{where}/c")
    url, local = store.url_for(f"{where}/c"), str(fixture(C))
    layout = str(fixture(C) / "layout_w3_shard0.json")
    remote_plan = json.loads(ok(store, "plan", url, "--layout", layout, "--json").stdout)
    assert remote_plan == json.loads(ok(store, "plan", local, "--layout", layout, "--json").stdout)
    rank_plan = json.loads(ok(store, "plan", url, "--layout", layout, "--rank", "2", "--json").stdout)
    assert rank_plan == json.loads(ok(store, "plan", local, "--layout", layout, "--rank", "2", "--json").stdout)
    remote = json.loads(ok(store, "inspect", url, "--json").stdout)
    assert remote["location"] == url
    expected = json.loads(ok(store, "inspect", local, "--json").stdout)
    assert remote["format"] == "dcp" and remote["tensors"] == expected["tensors"]
    assert tessera.inspect(url, storage_options=store.env)["tensors"] == expected["tensors"]
    assert tessera.plan(url, layout=layout, rank=2, storage_options=store.env)["summary"] == tessera.plan(local, layout=layout, rank=2)["summary"]


def test_a_partial_load_is_served_exactly_the_bytes_it_needs(store, where, tmp_path):
    url = store.url_for(f"{where}/step-1")
    state = big_state()
    commit(store, where, {"step-1": state}, tmp_path)
    for verify in (False, True):
        store.reset()
        rows = np.empty((40, 1024), np.float32)
        report = tessera.load(
            {"big": (rows, [100, 0])}, url, storage_options=store.env, progress=False, verify=verify
        )
        assert np.array_equal(rows, state["big"][100:140])
        served = store.served(f"{where}/step-1/data")
        assert report.bytes_needed == rows.nbytes
        assert served == {"get_requests": report.requests, "get_body_bytes": report.bytes_transferred}
        if not verify:
            # Nothing to check the slab against: one range request for exactly its bytes.
            assert served == {"get_requests": 1, "get_body_bytes": rows.nbytes}
        else:
            # Its block checksums widen it to whole 64 KiB blocks, no more.
            assert rows.nbytes < served["get_body_bytes"] <= rows.nbytes + 2 * 65536


def test_a_dcp_reshard_reports_what_the_server_sent(store, where):
    store.upload(fixture(C), f"{where}/c")
    url = store.url_for(f"{where}/c")
    ref = reference(C, "w2_shard1")
    store.reset()
    # Opening reads the .metadata and the zip headers; tessera.load opens the same way first.
    tessera._tessera.open_checkpoint(url, sorted(store.env.items()))
    opening = store.served(f"{where}/c/__")
    reported = {"bytes": 0, "requests": 0, "needed": 0}
    served = {"get_body_bytes": 0, "get_requests": 0}
    for rank in range(ref["world_size"]):
        state = rank_state(ref, rank)
        store.reset()
        report = tessera.load(state, url, rank=rank, world_size=ref["world_size"], storage_options=store.env, progress=False)
        wire = store.served(f"{where}/c/__")
        for key in served:
            served[key] += wire[key] - opening[key]
        reported["bytes"] += report.bytes_transferred
        reported["requests"] += report.requests
        reported["needed"] += report.bytes_needed
        check_reference(state, ref, rank)
    assert reported["bytes"] == served["get_body_bytes"] >= reported["needed"] > 0
    assert reported["requests"] == served["get_requests"] > 0


def test_a_save_takes_the_claim_first_and_commits_the_manifest_last(store, where):
    writing(store)
    url = store.url_for(f"{where}/run/step-7")
    state = big_state()
    store.reset()
    manifest = tessera.save(state, url, storage_options=store.env)
    assert manifest["step"] == 7
    changes = store.changes(f"{where}/run")
    created = [key for what, key in changes if what == "create"]
    # The claim before any data, the manifest after everything it commits, `latest` after the
    # manifest, and the claim released last.
    assert created[0] == "step-7/.tessera-claim.json", changes
    assert set(created[1:-2]) == {"step-7/data/rank-0.bin", "step-7/metadata.arrow", "step-7/checksums.arrow"}, changes
    assert created[-2:] == ["step-7/manifest.json", "latest"], changes
    assert changes[-1] == ("delete", "step-7/.tessera-claim.json"), changes
    assert store.read(f"{where}/run/latest").decode().strip() == "step-7"
    assert ".tessera-claim.json" not in store.keys(f"{where}/run/step-7")
    again = {k: np.empty_like(v) if isinstance(v, np.ndarray) else None for k, v in state.items()}
    tessera.load(again, url, storage_options=store.env, progress=False)
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(again[key], value), key
        else:
            assert again[key] == value, key


def test_a_second_writer_is_refused_naming_the_holder(store, where):
    writing(store)
    path = f"{where}/run/step-2"
    store.write(f"{path}/.tessera-claim.json", HOLDER.encode())
    with pytest.raises(tessera.TesseraError) as refused:
        tessera.save({"w": np.arange(4, dtype=np.float32)}, store.url_for(path), storage_options=store.env)
    assert HELD in str(refused.value) and "break_claim=True" in str(refused.value)
    refused = cli(
        store, "convert", str(fixture(C)), "--layout", str(fixture(C) / "layout_w2_shard1.json"),
        "--out", store.url_for(path),
    )
    assert refused.returncode != 0 and HELD in refused.stderr and "--break-claim" in refused.stderr, refused.stderr
    # Neither wrote a byte: the holder's claim is all there is.
    assert store.keys(path) == [".tessera-claim.json"]
    assert store.read(f"{path}/.tessera-claim.json") == HOLDER.encode()
    saved = tessera.save({"w": np.arange(4, dtype=np.float32)}, store.url_for(path), storage_options=store.env, break_claim=True)
    assert saved["tensors"] == 1
    assert ".tessera-claim.json" not in store.keys(path) and "manifest.json" in store.keys(path)


def _race_writer(args):
    url, env, value, barrier = args
    barrier.wait(60)
    try:
        tessera.save({"w": np.full(1024, value, np.float32)}, url, storage_options=env)
        return value, None
    except tessera.TesseraError as e:
        return value, str(e)


def test_two_writers_racing_into_one_location_one_commits(store, where):
    writing(store)
    url = store.url_for(f"{where}/run/step-1")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        outcomes = pool.map(_race_writer, [(url, store.env, float(v), barrier) for v in (1, 2)])
    winners = [value for value, error in outcomes if error is None]
    assert len(winners) == 1, outcomes
    (error,) = [error for _, error in outcomes if error is not None]
    # The loser fails on the winner's claim (naming it) or, when it came after the commit, on
    # the committed manifest: never a mix of the two.
    assert re.search(r"is held by \S+ pid \d+ on host", error) or "already holds a committed checkpoint" in error, error
    w = np.empty(1024, np.float32)
    tessera.load({"w": w}, url, storage_options=store.env, progress=False)
    assert np.array_equal(w, np.full(1024, winners[0], np.float32))
    assert ".tessera-claim.json" not in store.keys(f"{where}/run/step-1")


def test_async_save_commits_into_the_store(store, where):
    writing(store)
    url = store.url_for(f"{where}/run/step-3")
    state = big_state()
    handle = tessera.async_save(state, url, storage_options=store.env)
    report = handle.result(timeout=300)
    assert report["step"] == 3 and report["tensors"] == 2
    assert "manifest.json" in store.keys(f"{where}/run/step-3")
    big = np.empty_like(state["big"])
    tessera.load({"big": big}, url, storage_options=store.env, progress=False)
    assert sha256(big) == sha256(state["big"])


def test_verify_checks_the_store_and_names_a_damaged_file(store, where, tmp_path):
    url = store.url_for(f"{where}/step-1")
    commit(store, where, {"step-1": {"w": np.arange(64 * 1024, dtype=np.float32)}}, tmp_path)
    store.upload(fixture(C), f"{where}/c")
    assert json.loads(ok(store, "verify", url, "--json").stdout)["ok"] is True
    assert json.loads(ok(store, "verify", store.url_for(f"{where}/c"), "--json").stdout)["ok"] is True
    data = bytearray(store.read(f"{where}/step-1/data/rank-0.bin"))
    data[5000] ^= 0x40
    store.write(f"{where}/step-1/data/rank-0.bin", bytes(data))
    failed = cli(store, "verify", url)
    assert failed.returncode != 0 and "data/rank-0.bin" in failed.stderr, failed.stderr


def test_convert_reads_from_and_writes_to_the_store(store, where, tmp_path):
    writing(store)
    store.upload(fixture(C), f"{where}/dcp/c")
    layout = str(fixture(C) / "layout_w2_shard1.json")
    out = store.url_for(f"{where}/native/step-3")
    text = ok(store, "convert", store.url_for(f"{where}/dcp/c"), "--layout", layout, "--out", out).stdout
    assert "51 tensors" in text, text
    assert json.loads(ok(store, "verify", out, "--json").stdout)["ok"] is True
    load_reference(store, out, "w3_shard0")
    # A local checkpoint into the store, and one in the store out to a local directory.
    ok(store, "convert", str(fixture(C)), "--layout", layout, "--out", store.url_for(f"{where}/native/step-4"))
    load_reference(store, store.url_for(f"{where}/native/step-4"), "w2_shard1")
    assert store.keys(f"{where}/native/step-4") == store.keys(f"{where}/native/step-3")
    ok(store, "convert", out, "--format", "safetensors", "--out", str(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    load_reference(store, str(tmp_path / "hf"), "w3_shard0")


def test_gc_removes_what_a_killed_save_left_in_the_store(store, where):
    writing(store)
    layout = str(fixture(C) / "layout_w2_shard1.json")
    ok(store, "convert", str(fixture(C)), "--layout", layout, "--out", store.url_for(f"{where}/run/step-1"))
    killed = cli(
        store, "convert", str(fixture(C)), "--layout", layout, "--out", store.url_for(f"{where}/run/step-2"),
        env={"TESSERA_FAULT_ABORT_AFTER_FILES": "1"},
    )
    assert killed.returncode != 0
    left = store.keys(f"{where}/run/step-2")
    assert ".tessera-claim.json" in left and "data/rank-00000.bin" in left and "manifest.json" not in left, left
    # A save in progress: its claim names this test's process, alive on this host.
    host = open("/proc/sys/kernel/hostname").read().strip()
    store.write(
        f"{where}/run/step-3/.tessera-claim.json",
        json.dumps({"pid": os.getpid(), "host": host, "created": "2026-01-02T03:04:05Z", "command": "tessera.save"}).encode(),
    )
    store.write(f"{where}/run/step-3/data/rank-0.bin", b"\0" * 4096)
    committed = store.keys(f"{where}/run/step-1")
    dry = json.loads(ok(store, "gc", store.url_for(where), "--dry-run", "--json").stdout)
    assert [r["path"] for r in dry["removed"]] == ["run/step-2"] and store.keys(f"{where}/run/step-2") == left, dry
    report = json.loads(ok(store, "gc", store.url_for(where), "--json").stdout)
    assert [r["path"] for r in report["removed"]] == ["run/step-2"], report
    assert "pid" in report["removed"][0]["reason"] and "is not running" in report["removed"][0]["reason"], report
    assert report["bytes_removed"] > 0
    assert [(k["path"], "a live writer holds its claim" in k["reason"]) for k in report["kept"]] == [("run/step-3", True)], report
    assert store.keys(f"{where}/run/step-2") == []
    assert store.keys(f"{where}/run/step-1") == committed
    assert store.keys(f"{where}/run/step-3") == [".tessera-claim.json", "data/rank-0.bin"]

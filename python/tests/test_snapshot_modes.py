"""async_save's snapshot modes with real torch on CPU: eager (the call copies), lazy (DataStates-LLM:
the copy runs during forward/backward and the optimizer's next step waits for it) and multi-step
(GoCkpt: the copy spread over k steps, earlier parts brought forward by replaying the optimizer
on the host). Every checkpoint is compared bit for bit with the state it stands for; an FSDP2 +
AdamW job of 3 gloo ranks saves lazily and loads into another layout."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import free_port, join_job, run_job

import torch  # noqa: E402  (make python-test installs it)

import tessera  # noqa: E402
from tessera import _async_save  # noqa: E402


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )


def _forward_backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(32, 16, generator=g)).pow(2).mean().backward()


def _clone_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": {
            "state": {
                i: {name: t.detach().clone() for name, t in s.items()} for i, s in optim.state_dict()["state"].items()
            },
            "lrs": [g["lr"] for g in optim.param_groups],
        },
    }


def _trained(kind: str, seed: int):
    model = _mlp(seed)
    optim = (
        torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        if kind == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.7)
    for i in range(2):
        _forward_backward(model, 1000 + i)
        optim.step()
        sched.step()
        optim.zero_grad()
    return model, optim, sched


def _assert_checkpoint_is(path: str, kind: str, expected: dict) -> None:
    model, optim, _ = _trained(kind, seed=99)  # another model: everything must come from the file
    tessera.load({"model": model, "optim": optim}, path, progress=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected["model"][name]), name
    for i, state in optim.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, expected["optim"]["state"][i][name]), (i, name)
    assert [g["lr"] for g in optim.param_groups] == expected["optim"]["lrs"]


def test_eager_returns_with_the_copy_done_and_says_how_long_it_blocked(tmp_path):
    model, optim, _ = _trained("adamw", 1)
    expected = _clone_state(model, optim)
    handle = tessera.async_save({"model": model, "optim": optim}, str(tmp_path / "c"))
    assert handle.snapshot_mode == "eager" and handle._snapshot_done.is_set()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # right after the call: the snapshot is already taken
    report = handle.result(timeout=60)
    assert report.snapshot == "eager" and report.blocked_seconds >= report.snapshot_seconds > 0
    _assert_checkpoint_is(str(tmp_path / "c"), "adamw", expected)


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_lazy_copies_during_forward_backward_and_saves_the_state_at_the_call(tmp_path, with_optimizer):
    model, optim, sched = _trained("adamw", 2)
    expected = _clone_state(model, optim)
    kwargs = {"optimizer": optim} if with_optimizer else {}
    handle = tessera.async_save({"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="lazy", **kwargs)
    _forward_backward(model, 7)
    if not with_optimizer:
        handle.wait_snapshot(timeout=60)
    optim.step()  # with optimizer=: held by the save's step hook until the copies are done
    sched.step()
    optim.zero_grad()
    for i in range(2):  # later steps are not held
        _forward_backward(model, 8 + i)
        optim.step()
    report = handle.result(timeout=60)
    assert report.snapshot == "lazy" and report.steps_after_call == 0
    assert report.blocked_seconds < 1.0
    _assert_checkpoint_is(str(tmp_path / "c"), "adamw", expected)


def test_a_change_before_the_lazy_copy_fails_the_save_naming_the_tensor(tmp_path, monkeypatch):
    w = torch.arange(1000, dtype=torch.float32)
    release = threading.Event()
    real_copy = _async_save._copy_entry

    def held_copy(*args):
        release.wait(30)  # the copy starts only once the job has changed w
        real_copy(*args)

    monkeypatch.setattr(_async_save, "_copy_entry", held_copy)
    handle = tessera.async_save({"w": w}, str(tmp_path / "c"), snapshot="lazy")
    w.add_(1.0)  # the job writes before wait_snapshot(): a mistake the save must not commit
    release.set()
    with pytest.raises(tessera.TesseraError) as failed:
        handle.result(timeout=60)
    message = str(failed.value)
    assert "tensor w was changed in place before its snapshot copy was complete" in message, message
    assert isinstance(failed.value, _async_save.ChangedBeforeCopy)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_lazy_and_multi_step_refuse_what_they_cannot_take(tmp_path):
    import numpy as np

    model, optim, _ = _trained("adamw", 3)
    with pytest.raises(TypeError, match="NumPy arrays lack"):
        tessera.async_save({"a": np.zeros(3)}, str(tmp_path / "a"), snapshot="lazy")
    with pytest.raises(ValueError, match="choose one of eager, lazy, multi_step"):
        tessera.async_save({"a": torch.zeros(3)}, str(tmp_path / "a"), snapshot="later")
    with pytest.raises(ValueError, match="steps=k with k >= 2"):
        tessera.async_save({"m": model, "o": optim}, str(tmp_path / "a"), snapshot="multi_step", steps=1, optimizer=optim)
    with pytest.raises(ValueError, match="pass optimizer="):
        tessera.async_save({"m": model, "o": optim}, str(tmp_path / "a"), snapshot="multi_step", steps=2)
    rms = torch.optim.RMSprop(model.parameters())
    with pytest.raises(TypeError, match="torch.optim.rmsprop.RMSprop is not one of them"):
        tessera.async_save({"m": model}, str(tmp_path / "a"), snapshot="multi_step", steps=2, optimizer=rms)
    # The optimizer's state must travel with the parameters it updates.
    with pytest.raises(ValueError, match="the optimizer's 'step' of m.0.weight is not in the state dict"):
        tessera.async_save({"m": model}, str(tmp_path / "a"), snapshot="multi_step", steps=2, optimizer=optim)
    fresh = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="has not stepped"):
        tessera.async_save({"m": model, "o": fresh}, str(tmp_path / "a"), snapshot="multi_step", steps=2, optimizer=fresh)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("steps", [2, 4])
def test_multi_step_equals_an_eager_snapshot_at_the_named_step(tmp_path, kind, steps):
    model, optim, sched = _trained(kind, 4)
    handle = tessera.async_save(
        {"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="multi_step", steps=steps, optimizer=optim
    )
    assert handle.steps_after_call == steps - 1
    expected = None
    for j in range(steps + 1):
        _forward_backward(model, 50 + j)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)  # clipped grads are replayed
        if j == steps - 1:
            expected = _clone_state(model, optim)  # what an eager snapshot here would hold
        optim.step()
        sched.step()  # the learning rate moves every step: the replay must use each step's
        optim.zero_grad()
    report = handle.result(timeout=60)
    assert report.snapshot == "multi_step" and report.steps_after_call == steps - 1
    _assert_checkpoint_is(str(tmp_path / "c"), kind, expected)


def test_multi_step_fails_when_the_job_stops_stepping(tmp_path):
    model, optim, _ = _trained("adamw", 5)
    handle = tessera.async_save(
        {"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="multi_step", steps=3, optimizer=optim, timeout=2
    )
    _forward_backward(model, 1)
    optim.step()  # one of three steps, then nothing
    with pytest.raises(tessera.TesseraError, match="1 of 3 optimizer steps ran within 2 s"):
        handle.result(timeout=30)
    assert not (tmp_path / "c" / "manifest.json").exists()


# -- FSDP2 + AdamW over 3 gloo ranks ----------------------------------------------------------


def _fsdp_rank(rank: int, port: int, rendezvous_port: int, mode: str, path: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    join_job(rank, 3, port)
    os.environ.update(MASTER_ADDR="127.0.0.1", TESSERA_PORT=str(rendezvous_port))
    model = _mlp(0)
    mesh = init_device_mesh("cpu", (3,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    result: dict = {}
    try:
        for i in range(2):
            _forward_backward(model, 10 + i)
            optim.step()
            optim.zero_grad()
        def full_state():
            model_full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
            optim_full = {
                i: {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in s.items()}
                for i, s in optim.state_dict()["state"].items()
            }
            return model_full, optim_full

        # kill: no training after the call (FSDP2's collectives would fail first on a dead rank).
        steps = {"multi_step": 3, "lazy": 1, "kill": 0}[mode]
        extra = {"steps": steps} if mode == "multi_step" else {}
        if mode == "kill":
            extra = {"timeout": 10}
        full, optim_full = full_state()
        if mode == "kill" and rank == 2:
            # This rank dies in the middle of its lazy copy.
            def die(*_args):
                os._exit(9)

            _async_save._copy_entry = die
        handle = tessera.async_save(
            {"model": model, "optim": optim}, path, process_group=dist.group.WORLD,
            snapshot="multi_step" if mode == "multi_step" else "lazy", optimizer=optim, **{"timeout": 30, **extra},
        )
        for j in range(steps):
            _forward_backward(model, 20 + j)
            if j == steps - 1 and mode == "multi_step":
                full, optim_full = full_state()  # the state the multi-step checkpoint stands for
            optim.step()  # lazy: waits for this rank's copies; multi-step: for this step's part
            optim.zero_grad()
        try:
            report = handle.result(timeout=120)
        except tessera.TesseraError as e:
            Path(out, f"rank{rank}.json").write_text(json.dumps({"failed": str(e)}))
            return
        # Another layout: every rank loads whole tensors.
        dest = {
            "model": {k: torch.empty_like(v) for k, v in full.items()},
            "optim": {"state": {i: {n: torch.empty_like(t) for n, t in s.items()} for i, s in optim_full.items()}},
        }
        tessera.load(dest, path, process_group=dist.group.WORLD, progress=False, timeout=60, strict=False)
        wrong = [k for k, v in full.items() if not torch.equal(dest["model"][k], v)]
        wrong += [
            f"optim.{i}.{n}" for i, s in optim_full.items() for n, t in s.items() if not torch.equal(dest["optim"]["state"][i][n], t)
        ]
        result = {"wrong": wrong, "snapshot": report.snapshot, "tensors": len(full), "after": report.steps_after_call}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["lazy", "multi_step"])
def test_an_fsdp2_job_saves_and_the_state_it_stands_for_loads_into_another_layout(tmp_path, mode):
    got = run_job(_fsdp_rank, 3, (free_port(), mode, str(tmp_path / "c")), tmp_path)
    after = 2 if mode == "multi_step" else 0
    for rank in range(3):
        assert got[rank] == {"wrong": [], "snapshot": mode, "tensors": 6, "after": after}, (rank, got[rank])


def test_a_rank_killed_during_its_lazy_copy_leaves_nothing_committed(tmp_path):
    import multiprocessing as mp

    from conftest import job_store

    store = job_store(3)
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "c")
    port = free_port()  # tessera's rendezvous, the same for every rank
    procs = [ctx.Process(target=_fsdp_rank, args=(r, store.port, port, "kill", path, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    assert [p.exitcode for p in procs] == [0, 0, 9]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "missing ranks [2]" in got.get("failed", ""), (rank, got)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_the_readmes_training_loop_runs_and_its_checkpoints_hold_the_state_at_each_call(tmp_path, monkeypatch):
    import re
    import textwrap
    from types import SimpleNamespace

    from conftest import REPO

    text = (REPO / "README.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if 'snapshot="lazy"' in b]
    assert len(blocks) == 1, "README.md has one training loop with a lazy snapshot"
    net = _mlp(6)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, batch):
            return SimpleNamespace(loss=self.net(batch).pow(2).mean())

    model = Model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 16, generator=g) for _ in range(201)]
    expected = {}

    class Loader:
        def __iter__(self):
            for step, batch in enumerate(batches):
                if step % 100 == 0:
                    expected[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                yield batch

    monkeypatch.chdir(tmp_path)
    scope = {"tessera": tessera, "model": model, "optim": optim, "loader": Loader()}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    scope["handle"].result(timeout=60)
    for step, state in expected.items():
        got = {k: torch.empty_like(v) for k, v in state.items()}
        tessera.load({"model": got}, f"ckpts/run/step-{step}", progress=False)
        for key, value in state.items():
            assert torch.equal(got[key], value), (step, key)


# -- consistency: a lazy or multi-step checkpoint holds a state the job had, or fails ------------


def test_a_lazy_copy_taken_while_an_in_place_kernel_runs_is_refused(tmp_path, monkeypatch):
    """torch bumps a tensor's version counter only after the in-place kernel ran, so a copy
    checked right after it can miss a kernel that is still writing: the check must come at a
    point where no kernel of the job is in flight."""
    from torch.utils._python_dispatch import TorchDispatchMode

    w = torch.nn.Parameter(torch.arange(1 << 16, dtype=torch.float32))
    at_call = w.detach().clone()
    written, checked = threading.Event(), threading.Event()
    real_copy, real_check = _async_save._copy_entry, _async_save._check_unchanged

    def copy_after_the_write(*args):
        written.wait(30)  # the kernel has written every element, its version bump is still to come
        real_copy(*args)

    def check_then_let_the_kernel_end(e):
        try:
            real_check(e)
        finally:
            checked.set()

    class KernelStillRunning(TorchDispatchMode):
        # Runs below the version bump (ADInplaceOrView bumps after this returns): this is the
        # window in which a real kernel's writes are visible and the counter has not moved.
        def __torch_dispatch__(self, func, types, args, kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mul_.Tensor:
                written.set()
                checked.wait(30)
            return out

    monkeypatch.setattr(_async_save, "_copy_entry", copy_after_the_write)
    monkeypatch.setattr(_async_save, "_check_unchanged", check_then_let_the_kernel_end)
    handle = tessera.async_save({"w": w}, str(tmp_path / "c"), snapshot="lazy")
    with torch.no_grad(), KernelStillRunning():
        w.mul_(2)  # a mistake: changed before wait_snapshot(); the save must not commit it
    with pytest.raises(_async_save.ChangedBeforeCopy, match="tensor w was changed in place"):
        handle.result(timeout=60)
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert torch.equal(w.detach(), at_call * 2)


def test_lazy_in_place_changes_right_after_the_call_never_commit_another_state(tmp_path):
    """The issue's race, as a job writes it: no hooks, many trials. Every trial either fails
    naming the tensor or commits exactly the values at the call."""
    w = torch.nn.Parameter(torch.rand(1 << 22))  # 16 MiB: the copy and the kernel overlap
    committed = 0
    for trial in range(20):
        at_call = w.detach().clone()
        path = str(tmp_path / f"step-{trial}")
        handle = tessera.async_save({"w": w}, path, snapshot="lazy")
        with torch.no_grad():
            w.mul_(2)
        try:
            handle.result(timeout=60)
        except _async_save.ChangedBeforeCopy as e:
            assert "tensor w was changed in place" in str(e), str(e)
            assert not Path(path, "manifest.json").exists()
            continue
        got = {"w": torch.empty_like(at_call)}
        tessera.load(got, path, progress=False)
        assert torch.equal(got["w"], at_call), f"trial {trial} committed a state the job never had at the call"
        committed += 1
    assert committed == 0, "a change before the barrier is ambiguous: it must fail the save"


LAZY_JOB_EXITS = r"""
import sys, torch, tessera
w = torch.nn.Parameter(torch.arange(4096, dtype=torch.float32))
handle = tessera.async_save({"w": w}, sys.argv[1], snapshot="lazy", timeout=600)
if sys.argv[2] == "change":
    with torch.no_grad():
        w.add_(1.0)
if sys.argv[2] == "crash":
    raise RuntimeError("the job crashed")
"""


@pytest.mark.parametrize("how", ["exit", "crash", "change"])
def test_a_job_that_exits_after_a_lazy_save_commits_the_state_at_the_call_or_nothing(tmp_path, how):
    import subprocess
    import sys

    path = tmp_path / "c"
    done = subprocess.run([sys.executable, "-c", LAZY_JOB_EXITS, str(path), how], capture_output=True, text=True, timeout=120)
    if how == "change":
        # The change came before any point the save could check: nothing is committed, and the
        # exit says why instead of leaving a silent gap.
        assert not (path / "manifest.json").exists()
        assert "tensor w was changed in place" in done.stderr, done.stderr
        return
    assert done.returncode == (0 if how == "exit" else 1), done.stderr
    got = {"w": torch.empty(4096)}
    tessera.load(got, str(path), progress=False)
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("where", ["after_its_copy", "before_the_last_step"])
def test_multi_step_refuses_a_parameter_changed_outside_the_optimizer(tmp_path, kind, where):
    model, optim, _ = _trained(kind, 7)
    handle = tessera.async_save(
        {"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="multi_step", steps=3, optimizer=optim, timeout=60
    )
    for j in range(3):
        _forward_backward(model, 70 + j)
        if where == "after_its_copy" and j == 1:
            with torch.no_grad():
                model[0].weight.mul_(0.5)  # part 0 was copied before step 0: the replay cannot know
        if where == "before_the_last_step" and j == 2:
            with torch.no_grad():
                model[4].weight.mul_(0.5)  # in the last part's copy window
        optim.step()
        optim.zero_grad()
    with pytest.raises(tessera.TesseraError) as failed:
        handle.result(timeout=60)
    message = str(failed.value)
    name = "model.0.weight" if where == "after_its_copy" else "model.4.weight"
    assert f"{name} was changed outside the optimizer" in message, message
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_second_async_save_in_a_multi_step_window_fails_at_once_naming_the_pending_save(tmp_path):
    model, optim, sched = _trained("adamw", 8)
    first = str(tmp_path / "step-1")
    handle = tessera.async_save({"model": model, "optim": optim}, first, snapshot="multi_step", steps=3, optimizer=optim)
    _forward_backward(model, 80)
    optim.step()
    optim.zero_grad()
    outcome: dict = {}

    def second_save():
        try:
            tessera.async_save({"model": model, "optim": optim}, str(tmp_path / "step-2"))
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome["error"] = e

    caller = threading.Thread(target=second_save, daemon=True)
    caller.start()
    caller.join(30)  # bounded: the first save's own timeout is 300 s
    assert not caller.is_alive(), "the second async_save waited for optimizer steps its own thread must take"
    error = outcome.get("error")
    assert isinstance(error, tessera.TesseraError), outcome
    assert f"the multi-step save of {first} still waits for optimizer steps (1 of 3 ran)" in str(error), str(error)
    assert not (tmp_path / "step-2").exists()
    # The first save goes on: the job steps on and it commits the state it stands for.
    expected = None
    for j in range(1, 3):
        _forward_backward(model, 80 + j)
        if j == 2:
            expected = _clone_state(model, optim)
        optim.step()
        optim.zero_grad()
    handle.result(timeout=60)
    expected["optim"]["lrs"] = [g["lr"] for g in optim.param_groups]
    _assert_checkpoint_is(first, "adamw", expected)


def test_a_multi_step_save_that_times_out_says_a_thread_waited_for_it_instead_of_stepping(tmp_path):
    model, optim, _ = _trained("sgd", 9)
    handle = tessera.async_save(
        {"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="multi_step", steps=3, optimizer=optim, timeout=2
    )
    with pytest.raises(tessera.TesseraError) as failed:
        handle.result(timeout=60)  # the job waits instead of taking the 3 steps: bounded by timeout=2
    message = str(failed.value)
    assert "0 of 3 optimizer steps ran within 2 s; the checkpoint needs all 3" in message, message
    assert "thread 'MainThread' waited for this save: the steps must run before handle.result()" in message, message


MULTI_STEP_JOB_CRASHES = r"""
import sys, torch, tessera
model = torch.nn.Linear(8, 8)
optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(2):
    model(torch.ones(2, 8)).sum().backward(); optim.step(); optim.zero_grad()
handle = tessera.async_save({"m": model, "o": optim}, sys.argv[1], snapshot="multi_step", steps=3,
                            optimizer=optim, timeout=600)
model(torch.ones(2, 8)).sum().backward(); optim.step(); optim.zero_grad()
raise RuntimeError("the job crashed inside the window")
"""


def test_a_job_that_crashes_in_a_multi_step_window_exits_without_waiting_for_the_timeout(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "c"
    # timeout=600 in the job: a process held by its save would outlive this bound.
    done = subprocess.run([sys.executable, "-c", MULTI_STEP_JOB_CRASHES, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: the job crashed inside the window" in done.stderr
    assert f"the multi-step save of {path} is abandoned: the process exits after 1 of 3 optimizer steps" in done.stderr, done.stderr
    assert not (path / "manifest.json").exists()


class _Tied(torch.nn.Module):
    """A language model's shape in small: the output projection is the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_multi_step_saves_a_tied_weight_with_the_optimizers_updates(tmp_path, kind):
    model = _Tied()
    optim = (
        torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        if kind == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 32, (8, 4), generator=g) for _ in range(6)]

    def train(batch):
        model(batch).pow(2).mean().backward()

    for batch in batches[:2]:
        train(batch)
        optim.step()
        optim.zero_grad()
    assert "emb.weight" in model.state_dict() and "head.weight" in model.state_dict()
    handle = tessera.async_save(
        {"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="multi_step", steps=3, optimizer=optim, timeout=60
    )
    expected = None
    for j, batch in enumerate(batches[2:5]):
        train(batch)
        if j == 2:
            expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optim.step()
        optim.zero_grad()
    handle.result(timeout=60)
    got = {k: torch.empty_like(v) for k, v in expected.items()}
    tessera.load({"model": got}, str(tmp_path / "c"), progress=False, strict=False)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_multi_step_refuses_gradients_zeroed_in_place_while_the_replay_reads_them(tmp_path, monkeypatch):
    """The replay reads the gradients by reference in the save's thread; a job that zeroes them
    in place (zero_grad(set_to_none=False)) while it runs can hand it half-zeroed gradients, and
    torch bumps their version counters only after the kernel: a check in the save's thread right
    after the replay cannot see a kernel still writing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tessera import _multi_step

    model, optim, _ = _trained("sgd", 10)
    written, replayed = threading.Event(), threading.Event()
    real_replay = _multi_step.MultiStepSnapshot._replay

    def replay_after_the_zeroing(self, *args):
        written.wait(30)  # the kernel has zeroed the gradients, its version bump is still to come
        try:
            real_replay(self, *args)
        finally:
            replayed.set()

    class ZeroingStillRunning(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args, kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.zero_.default, torch.ops.aten._foreach_zero_.default):
                written.set()
                replayed.wait(30)
            return out

    monkeypatch.setattr(_multi_step.MultiStepSnapshot, "_replay", replay_after_the_zeroing)
    handle = tessera.async_save(
        {"model": model, "optim": optim}, str(tmp_path / "c"), snapshot="multi_step", steps=2, optimizer=optim, timeout=60
    )
    _forward_backward(model, 100)
    optim.step()
    with ZeroingStillRunning():
        optim.zero_grad(set_to_none=False)
    _forward_backward(model, 101)
    optim.step()
    with pytest.raises(tessera.TesseraError) as failed:
        handle.result(timeout=60)
    message = str(failed.value)
    assert "the gradient of model.0.weight was changed in place" in message, message
    assert not (tmp_path / "c" / "manifest.json").exists()

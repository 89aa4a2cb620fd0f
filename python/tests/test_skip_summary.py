"""`make test`'s count of skipped tests (.ci/skip_summary.py): Rust tests that print
`skipped: <reason>` (run with --show-output) and pytest's `-rs` lines become one summary line per
reason, appended to the summary file, and the command's exit status is kept."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / ".ci" / "skip_summary.py"

# What `cargo test ... -- --show-output` prints for two GPU tests that skipped and one that ran.
LIBTEST = """running 3 tests
test gpu_upload ... ok
test nccl_ring ... ok
test plain ... ok

successes:

---- gpu_upload stdout ----
skipped: no CUDA driver (libcuda.so.1 not found)

---- nccl_ring stdout ----
skipped: no CUDA driver (libcuda.so.1 not found)

---- plain stdout ----
loaded 3 tensors, no skipped: lines here are about tests


successes:
    gpu_upload
    nccl_ring
    plain

test result: ok. 3 passed; 0 failed; 0 ignored
"""

PYTEST = """..ss.s                                                                  [100%]
=========================== short test summary info ============================
SKIPPED [2] python/tests/test_torch.py:11: torch is not installed (CI has NumPy only)
SKIPPED [1] python/tests/test_torch.py:73: no CUDA device
3 passed, 3 skipped in 0.50s
"""


def run(tmp_path, label: str, output: str, status: int = 0):
    summary = tmp_path / "skips.txt"
    emit = f"import sys; sys.stdout.write({output!r}); sys.exit({status})"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), label, str(summary), "--", sys.executable, "-c", emit],
        capture_output=True,
        text=True,
    )
    return proc, summary


def test_rust_skips_are_counted_per_reason(tmp_path):
    proc, summary = run(tmp_path, "GPU tests", LIBTEST)
    assert proc.returncode == 0
    assert proc.stdout.startswith(LIBTEST)  # the command's own output passes through
    line = "skipped: 2 GPU tests (no CUDA driver (libcuda.so.1 not found))\n"
    assert proc.stdout.endswith(line)
    assert summary.read_text() == line


def test_pytest_skips_are_counted_and_appended(tmp_path):
    run(tmp_path, "GPU tests", LIBTEST)
    proc, summary = run(tmp_path, "Python tests", PYTEST)
    assert proc.stdout.endswith(
        "skipped: 1 Python tests (no CUDA device)\n"
        "skipped: 2 Python tests (torch is not installed (CI has NumPy only))\n"
    )
    assert summary.read_text().splitlines() == [
        "skipped: 2 GPU tests (no CUDA driver (libcuda.so.1 not found))",
        "skipped: 1 Python tests (no CUDA device)",
        "skipped: 2 Python tests (torch is not installed (CI has NumPy only))",
    ]


def test_no_skips_says_zero_and_a_failure_keeps_its_status(tmp_path):
    proc, summary = run(tmp_path, "GPU tests", "test result: FAILED. 1 passed; 1 failed\n", status=101)
    assert proc.returncode == 101
    assert summary.read_text() == "skipped: 0 GPU tests\n"

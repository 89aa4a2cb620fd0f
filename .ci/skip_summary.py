#!/usr/bin/env python3
"""Runs a test command, passing its output through, and says which tests it skipped.

usage: skip_summary.py LABEL SUMMARY_FILE -- COMMAND [ARGS...]

A test that cannot run on this machine passes while doing nothing (a GPU test without a CUDA
driver, a torch test without torch); counted as `ok`, it would hide that it never ran. This
counts them: Rust tests print `skipped: <reason>` and run with `--show-output`, so their output
comes back under `---- <test> stdout ----`; pytest with `-rs` prints `SKIPPED [n] file:line:
<reason>`. It prints one line per reason, `skipped: N LABEL (<reason>)` (or `skipped: 0 LABEL`),
appends those lines to SUMMARY_FILE for `make test` to repeat at the end, and exits with the
command's exit status.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

RUST_OUTPUT = re.compile(r"^---- (\S+) stdout ----$")
RUST_SKIP = re.compile(r"^skipped: (.+)$")
PYTEST_SKIP = re.compile(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.+)$")


def count_skips(lines) -> collections.Counter:
    """Skipped tests by reason, from a test command's output lines (echoed as they come)."""
    skips: collections.Counter = collections.Counter()
    test = None
    for line in lines:
        sys.stdout.write(line)
        sys.stdout.flush()
        line = line.rstrip("\n")
        if m := RUST_OUTPUT.match(line):
            test = m.group(1)
        elif m := PYTEST_SKIP.match(line):
            skips[m.group(2)] += int(m.group(1))
        elif (m := RUST_SKIP.match(line)) and test is not None:
            skips[m.group(1)] += 1
            test = None  # one skip per test, whatever else it printed
    return skips


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    label, summary, command = argv[0], Path(argv[1]), argv[3:]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert proc.stdout is not None
    skips = count_skips(proc.stdout)
    status = proc.wait()
    lines = [f"skipped: {n} {label} ({reason})" for reason, n in sorted(skips.items())]
    lines = lines or [f"skipped: 0 {label}"]
    print("\n".join(lines))
    summary.parent.mkdir(parents=True, exist_ok=True)
    with summary.open("a") as f:
        f.write("".join(line + "\n" for line in lines))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

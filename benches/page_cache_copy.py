"""How fast this machine copies out of the page cache, and what fresh memory costs.

Usage: python benches/page_cache_copy.py DIR   (DIR: a checkpoint directory; read once first so
that it is in the page cache). Needs NumPy. Prints, for the files under DIR:

- `pread` straight into one large, already touched destination (16 MiB and 128 KiB requests);
- `pread` into a 128 KiB / 256 KiB bounce buffer, then a user-space copy into the destination
  (what tessera's local reads do, `loader/src/positioned.rs`);
- one file read straight in with the destination 0, 8, 16, 64, 512, 2048 bytes off the file
  offset's alignment (tessera bounces only reads that are off modulo 64);
- the first touch of 1 GiB of fresh anonymous memory against rewriting it (wall, user, sys).

BENCHMARKS.md "Reading through a bounce buffer" has the numbers of this project's machines.
"""

import mmap
import os
import resource
import sys
import time

import numpy as np


def main() -> None:
    root = sys.argv[1]
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs)
    total = sum(os.path.getsize(f) for f in files)
    dest = np.empty(total, dtype=np.uint8)
    dest[:] = 1  # touched: the copies below pay no page faults

    def direct(chunk: int) -> None:
        off = 0
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            at = 0
            while (k := os.preadv(fd, [memoryview(dest[off : off + chunk])], at)) > 0:
                at += k
                off += k
            os.close(fd)

    def bounce(chunk: int) -> None:
        staged = np.empty(chunk, dtype=np.uint8)
        view = memoryview(staged)
        off = 0
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            at = 0
            while (k := os.preadv(fd, [view], at)) > 0:
                dest[off : off + k] = staged[:k]
                at += k
                off += k
            os.close(fd)

    for name, fn, chunk in [
        ("pread into the destination, 16 MiB requests", direct, 16 << 20),
        ("pread into the destination, 128 KiB requests", direct, 128 << 10),
        ("pread into a 128 KiB bounce buffer + copy", bounce, 128 << 10),
        ("pread into a 256 KiB bounce buffer + copy", bounce, 256 << 10),
    ]:
        started = time.perf_counter()
        fn(chunk)
        seconds = time.perf_counter() - started
        print(f"{name}: {total / 2**30:.2f} GiB in {seconds:.3f} s ({total / seconds / 1e9:.1f} GB/s)")

    # One file, read straight in with the destination shifted against the file offset.
    big = max(files, key=os.path.getsize)
    size = min(os.path.getsize(big), 1 << 30)
    base = dest.ctypes.data
    fd = os.open(big, os.O_RDONLY)
    for shift in [0, 8, 16, 64, 512, 2048]:
        start = (-base) % 4096 + shift
        began = time.perf_counter()
        at = 0
        while at < size:
            end = min(at + (16 << 20), size)
            at += os.preadv(fd, [memoryview(dest[start + at : start + end])], at)
        seconds = time.perf_counter() - began
        print(f"pread, destination {shift} bytes off the file offset's alignment: {size / seconds / 1e9:.1f} GB/s")
    os.close(fd)

    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        m = mmap.mmap(-1, 1 << 30)
        a = np.frombuffer(m, dtype=np.uint8)
        a[:] = 1
        touched = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
        a[:] = 2
        rewritten = time.perf_counter()
        print(
            f"1 GiB fresh memory: first touch {touched - started:.3f} s "
            f"(user {after.ru_utime - before.ru_utime:.3f} s, sys {after.ru_stime - before.ru_stime:.3f} s), "
            f"rewrite {rewritten - touched:.3f} s"
        )
        del a
        m.close()


if __name__ == "__main__":
    main()

"""How fast two processes on this machine's two CPUs pass 1 MiB through shared memory,
with nothing of cma's involved: the floor under every shared-memory path here.

Two processes, pinned to CPUs 0 and 1, take turns: one copies its 1 MiB into a shared
buffer (np.copyto) and raises a flag; the other, spinning on the flag, copies the
buffer out and answers the same way. Each direction has its own area of four buffers
used in turn, as cma's rings are (a 4 MiB window per direction, channel.py). Each run
is a fresh pair of processes; it prints the median one-way time (a copy in and a copy
out) per run, and np.copyto of the same size inside one process for scale.

    python docs/figures/cross_cpu_copy.py [--runs 6] [--size 1048576]

On a VM whose two vCPUs the host may place on cores that share a cache or on cores that
do not, runs differ by the placement, not by the code (docs/guide.md, section 6).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

ROUND_TRIPS = 300
SLOTS = 4


def turns(shared: mmap.mmap, size: int, me: int) -> list[float]:
    """Take ROUND_TRIPS turns with the other process; this side's round-trip times."""
    flag = np.frombuffer(shared, np.int64, 1)
    areas = [[np.frombuffer(shared, np.uint8, size, offset=4096 + (4 * side + k) * size)
              for k in range(SLOTS)] for side in (0, 1)]
    mine = np.full(size, me + 1, np.uint8)
    got = np.empty(size, np.uint8)
    times = []
    for i in range(2 * ROUND_TRIPS):
        start = time.perf_counter()
        buf = areas[i % 2][(i // 2) % SLOTS]
        if i % 2 == me:  # my turn to send
            np.copyto(buf, mine)
            flag[0] = i + 1
        else:
            while flag[0] != i + 1:
                pass
            np.copyto(got, buf)
        if me == 0 and i % 2:
            times.append(time.perf_counter() - start)
    return times


def one_run(size: int) -> float:
    """Median one-way microseconds of a fresh pair of processes."""
    shared = mmap.mmap(-1, 4096 + 2 * SLOTS * size)
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setaffinity(0, {1})
            turns(shared, size, 1)
        finally:
            os._exit(0)
    os.sched_setaffinity(0, {0})
    times = turns(shared, size, 0)
    os.waitpid(pid, 0)
    shared.close()
    # a round trip here is: wait for the peer's copy in, copy out, copy in (next turn)
    return statistics.median(times[50:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--size", type=int, default=1 << 20)
    args = parser.parse_args()
    src, dst = np.ones(args.size, np.uint8), np.empty(args.size, np.uint8)
    local = []
    for _ in range(200):
        start = time.perf_counter()
        np.copyto(dst, src)
        local.append(time.perf_counter() - start)
    print(f"{args.size} B: np.copyto in one process {statistics.median(local) * 1e6:.1f} us")
    for run in range(args.runs):
        print(f"run {run + 1}: one-way through shared memory {one_run(args.size):.1f} us", flush=True)


if __name__ == "__main__":
    main()

"""The host's slow spells, against MPICH: short loops of a 1 MiB ``Bcast`` through plain
mpi4py and through ``cma.mpi.Comm`` taking turns every few milliseconds, with the root
broadcasting the same buffer every call (as osu_bcast and cma-bench do) and writing new
data into it before every call (as a program does)::

    mpiexec -n 2 python3 bench/slow_spells.py [seconds] [--size BYTES]

Rank 0 prints one row per round (the four loops' µs per call, a timestamp), then a summary:
a round counts as in a spell when cma.mpi's same-buffer time is more than 3 times that
series' fastest tenth (the spells covered a quarter to two thirds of the time in runs
here, so a median would not tell the quiet level), and each kind of round
gets the range and median of mpi4py's time over cma.mpi's (above 1: cma faster).
docs/guide.md section 7 ("The slow spells") has what was measured and why.
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median

import numpy as np
from mpi4py import MPI

import cma.mpi

LOOP = 30  # calls per loop: a few ms, so that the four loops of a round share the host's state


def timed(comm: MPI.Comm, buf: np.ndarray, write: bool, counter: list[int]) -> float:
    """µs per Bcast over LOOP calls, the root writing new bytes into ``buf`` before each
    if ``write``."""
    root = comm.Get_rank() == 0
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(LOOP):
        if write and root:
            counter[0] += 1
            buf.fill(counter[0] & 0xFF)
        comm.Bcast(buf, 0)
    comm.Barrier()
    return (time.perf_counter() - start) / LOOP * 1e6


def spread(ratios: list[float]) -> str:
    if not ratios:
        return "no rounds"
    return f"{min(ratios):.2f}-{max(ratios):.2f}x (median {median(ratios):.2f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seconds", type=float, nargs="?", default=60.0)
    parser.add_argument("--size", type=int, default=1 << 20)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if world.Get_size() <= len(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[world.Get_rank()]})
    wrapped = cma.mpi.Comm(world)
    rank = world.Get_rank()
    buf = np.zeros(args.size, np.uint8)
    counter = [0]
    rows: list[tuple[float, float, float, float]] = []
    end = time.time() + args.seconds
    if rank == 0:
        print(f"# {args.size} B Bcast, {world.Get_size()} ranks, µs per call; loops of {LOOP} "
              "taking turns: same buffer mpi4py, cma.mpi | written each call mpi4py, cma.mpi",
              flush=True)
    while True:
        stop = np.array([time.time() > end], np.int8)
        world.Bcast(stop, 0)
        if stop[0]:
            break
        row = (timed(world, buf, False, counter), timed(wrapped, buf, False, counter),
               timed(world, buf, True, counter), timed(wrapped, buf, True, counter))
        rows.append(row)
        if rank == 0:
            print(f"{time.strftime('%H:%M:%S')} same buffer: mpi {row[0]:7.1f} cma {row[1]:7.1f} | "
                  f"written each call: mpi {row[2]:7.1f} cma {row[3]:7.1f}", flush=True)
        time.sleep(0.2)
    if rank == 0 and rows:
        quiet_level = sorted(r[1] for r in rows)[len(rows) // 10]
        spells = [r for r in rows if r[1] > 3 * quiet_level]
        quiet = [r for r in rows if r[1] <= 3 * quiet_level]
        for name, kind in (("in spells", spells), ("outside them", quiet)):
            print(f"{len(kind)} rounds {name}: mpi4py/cma.mpi same buffer "
                  f"{spread([r[0] / r[1] for r in kind])}, written each call "
                  f"{spread([r[2] / r[3] for r in kind])}")
    if wrapped.cma is not None:
        wrapped.cma.close()


if __name__ == "__main__":
    main()

"""The host's slow spells, against MPICH: short loops of a 1 MiB ``Bcast`` through plain
mpi4py and through ``cma.mpi.Comm``, with the root broadcasting the same buffer every call
(as osu_bcast and cma-bench do) and writing new data into it before every call (as a
program does)::

    mpiexec -n 2 python3 bench/slow_spells.py [seconds] [--size BYTES]

Each round runs the four loops of LOOP calls once, in an order that rotates from round to
round (so that a spell starting mid-round does not always fall on the same loop), after
one untimed round that faults everything in; ranks are pinned one per CPU where there are
as many CPUs, and rounds are 0.2 s apart. Rank 0 prints one row per round: each loop's µs
per call, and for the written loops also the root's share spent writing its buffer
(``fill``), timed apart from its Bcasts. Then a summary: a round counts as in a spell when
cma.mpi's same-buffer time is more than 3 times the value a tenth of the rounds are
faster than (the spells took a quarter to two thirds of the 1 MiB runs here, so a median
would not tell the quiet level); each kind of round gets the range and median of
mpi4py's time over cma.mpi's (above 1: cma faster) and the medians of the root's fills.
docs/guide.md section 7 ("The slow spells") has what was measured and why.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from statistics import median
from typing import Any

import numpy as np

LOOP = 30  # calls per loop: a few ms, so that the four loops of a round share the host's state
# a round: same buffer (mpi4py, cma.mpi), written each call (mpi4py, cma.mpi), in µs per call,
# then the root's fill per call in the two written loops
Round = tuple[float, float, float, float, float, float]


def sort_rounds(rows: Sequence[Round]) -> tuple[list[Round], list[Round], float]:
    """(rounds in spells, the others, the quiet level): a spell's cma.mpi same-buffer time
    is more than 3 times the level a tenth of the rounds are faster than."""
    level = sorted(r[1] for r in rows)[len(rows) // 10]
    return [r for r in rows if r[1] > 3 * level], [r for r in rows if r[1] <= 3 * level], level


def spread(ratios: Sequence[float]) -> str:
    if not ratios:
        return "no rounds"
    return f"{min(ratios):.2f}-{max(ratios):.2f}x (median {median(ratios):.2f}x)"


def summary(rows: Sequence[Round]) -> list[str]:
    """The summary lines of ``rows``."""
    spells, quiet, _ = sort_rounds(rows)
    lines = []
    for name, kind in (("in spells", spells), ("outside them", quiet)):
        fills = (f"; root's fill per call (median us) mpi4py {median(r[4] for r in kind):.1f}, "
                 f"cma.mpi {median(r[5] for r in kind):.1f}") if kind else ""
        lines.append(f"{len(kind)} rounds {name}: mpi4py/cma.mpi same buffer "
                     f"{spread([r[0] / r[1] for r in kind])}, written each call "
                     f"{spread([r[2] / r[3] for r in kind])}{fills}")
    return lines


def timed(comm: Any, buf: np.ndarray, write: bool, counter: list[int]) -> tuple[float, float]:
    """(µs per call, µs of it the root spent writing ``buf``) over LOOP Bcasts, the root
    writing new bytes into ``buf`` before each if ``write``."""
    root = comm.Get_rank() == 0
    clock = time.perf_counter
    filling = 0.0
    comm.Barrier()
    start = clock()
    for _ in range(LOOP):
        if write and root:
            counter[0] += 1
            began = clock()
            buf.fill(counter[0] & 0xFF)
            filling += clock() - began
        comm.Bcast(buf, 0)
    comm.Barrier()
    return (clock() - start) / LOOP * 1e6, filling / LOOP * 1e6


def main() -> None:
    from mpi4py import MPI  # (here: importing this file for sort_rounds starts no MPI)

    import cma.mpi

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("seconds", type=float, nargs="?", default=60.0)
    parser.add_argument("--size", type=int, default=1 << 20)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    pinned = world.Get_size() <= len(os.sched_getaffinity(0))
    if pinned:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[world.Get_rank()]})
    wrapped = cma.mpi.Comm(world)
    rank = world.Get_rank()
    buf = np.ones(args.size, np.uint8)
    counter = [0]
    loops = [(world, False), (wrapped, False), (world, True), (wrapped, True)]
    rows: list[Round] = []
    if rank == 0:
        print(f"# {args.size} B Bcast, {world.Get_size()} ranks "
              f"({'pinned' if pinned else 'not pinned: more ranks than CPUs'}), µs per call; "
              f"loops of {LOOP}: same buffer mpi4py, cma.mpi | written each call mpi4py, "
              "cma.mpi (root's fill)", flush=True)
    for comm, write in loops:  # (untimed: pages faulted in, rings touched)
        timed(comm, buf, write, counter)
    end = time.time() + args.seconds
    while True:
        stop = np.array([time.time() > end], np.int8)
        world.Bcast(stop, 0)
        if stop[0]:
            break
        turn = len(rows) % len(loops)
        got = {}
        for comm, write in loops[turn:] + loops[:turn]:
            got[(comm is wrapped, write)] = timed(comm, buf, write, counter)
        row: Round = (got[(False, False)][0], got[(True, False)][0], got[(False, True)][0],
                      got[(True, True)][0], got[(False, True)][1], got[(True, True)][1])
        rows.append(row)
        if rank == 0:
            print(f"{time.strftime('%H:%M:%S')} same buffer: mpi {row[0]:7.1f} cma {row[1]:7.1f} | "
                  f"written each call: mpi {row[2]:7.1f} cma {row[3]:7.1f} "
                  f"(fill {row[4]:6.1f} {row[5]:6.1f})", flush=True)
        time.sleep(0.2)
    if rank == 0 and rows:
        print("\n".join(summary(rows)))
    if wrapped.cma is not None:
        wrapped.cma.close()


if __name__ == "__main__":
    main()

"""Barrier through cma.mpi against MPI's own, and what each leaves for the call after it.

For each round (rounds alternate which library goes first), rank 0 prints the mean time
of a barrier called in a loop (``MPI.COMM_WORLD.Barrier`` and ``cma.mpi.Comm.Barrier``,
which is cma's own on one node), and of an 8-byte-a-rank ``Alltoall`` that MPI runs,
timed alone after each kind of barrier, the barrier itself untimed (OSU's pattern, which
cma-bench follows with the communicator's own barrier), each averaged over ranks::

    mpiexec -n 4 python bench/barrier.py --rounds 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import cma.mpi


def barriers(barrier: Callable[[], None], calls: int) -> float:
    """Mean us per barrier over a loop of ``calls``, after 100 untimed."""
    for _ in range(100):
        barrier()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        barrier()
    return (time.perf_counter() - start) / calls * 1e6


def after(barrier: Callable[[], None], call: Callable[[], None], calls: int) -> float:
    """Mean us of ``call`` alone, each one after an untimed ``barrier``."""
    total = 0.0
    for i in range(calls + 100):
        barrier()
        start = time.perf_counter()
        call()
        if i >= 100:
            total += time.perf_counter() - start
    return total / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    wrapped = cma.mpi.Comm(world)
    size = world.Get_size()
    send, recv = np.ones(8 * size, np.uint8), np.zeros(8 * size, np.uint8)

    def alltoall() -> None:
        MPI.Intracomm.Alltoall(world, send, recv)

    cases: dict[str, Callable[[], float]] = {
        "MPI Barrier": lambda: barriers(world.Barrier, args.calls),
        "cma.mpi Barrier": lambda: barriers(wrapped.Barrier, args.calls),
        "Alltoall after MPI's": lambda: after(world.Barrier, alltoall, args.calls),
        "Alltoall after cma.mpi's": lambda: after(wrapped.Barrier, alltoall, args.calls),
    }
    if world.Get_rank() == 0:
        print(f"{size} ranks; mean us, averaged over ranks", flush=True)
    for round_ in range(args.rounds):
        names = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        got = {name: world.allreduce(cases[name]()) / size for name in names}
        if world.Get_rank() == 0:
            print(f"round {round_}: " + " | ".join(f"{name} {got[name]:.2f}" for name in cases),
                  flush=True)
    if wrapped.cma is not None:
        wrapped.cma.close()  # (not Free: that would free COMM_WORLD)


if __name__ == "__main__":
    main()

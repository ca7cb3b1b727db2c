"""Why `mpi4py.bench pingpong -a numpy` runs faster than `-a none`, for every library.

pingpong allocates its buffers with ``numpy.empty`` (``-a numpy``) or ``bytearray``
(``-a none``) and never writes the send buffer. Pages of a ``numpy.empty`` array that
nobody wrote are all mappings of the kernel's one zero page, so every copy out of them
reads the same cache-hot 4 KiB; a ``bytearray`` is zero-filled by Python, so its pages
are real ones. This script times the same ping-pong (``Send``/``Recv`` of ``[buf, n,
MPI.BYTE]`` specs, as pingpong sends) with three send buffers: ``empty`` (never written,
as pingpong's), ``written`` (``numpy.full``) and ``bytearray``, over plain
``MPI.COMM_WORLD`` and through ``cma.mpi.Comm``, alternating which library goes first
in each round. Rank 0 prints the median one-way time of each (library, buffer, size)
over the rounds, and the minor page faults per round trip.

Run (docs/figures/regenerate.sh step 1n)::

    mpiexec -n 2 python bench/untouched_buffers.py --sizes 262144 1048576 --rounds 4
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import cma.mpi

BUFFERS: dict[str, Callable[[int], Any]] = {
    "empty": lambda n: np.empty(n, np.uint8),  # pingpong -a numpy's: never written
    "written": lambda n: np.full(n, 1, np.uint8),
    "bytearray": bytearray,  # pingpong -a none's: zero-filled by Python
}


def one_way_us(comm: Any, send: Any, recv: Any, loops: int) -> tuple[float, float]:
    """Mean one-way time of ``loops`` round trips, and minor faults per round trip."""
    rank = comm.Get_rank()
    for _ in range(10):  # warm-up: the receive buffer's pages, cma's connection
        round_trip(comm, rank, send, recv)
    comm.Barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(loops):
        round_trip(comm, rank, send, recv)
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return seconds / loops / 2 * 1e6, faults / loops


def round_trip(comm: Any, rank: int, send: Any, recv: Any) -> None:
    if rank == 0:
        comm.Send(send, 1, 0)
        comm.Recv(recv, 1, 0)
    else:
        comm.Recv(recv, 0, 0)
        comm.Send(send, 0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[262144, 1048576, 2097152])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--loops", type=int, default=300)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit("run with mpiexec -n 2")
    libraries = {"plain": world, "cma.mpi": cma.mpi.Comm(world)}
    times: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    faults: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for round_number in range(args.rounds):
        order = list(libraries) if round_number % 2 == 0 else list(reversed(libraries))
        for size in args.sizes:
            for kind, allocate in BUFFERS.items():
                for name in order:
                    send = [allocate(size), size, MPI.BYTE]
                    recv = [allocate(size), size, MPI.BYTE]
                    us, per_trip = one_way_us(libraries[name], send, recv, args.loops)
                    times[name, kind, size].append(us)
                    faults[name, kind, size].append(per_trip)
    if world.Get_rank() == 0:
        print(f"one-way us, median of {args.rounds} rounds (min-max), alternating which "
              f"library goes first; minor faults per round trip on rank 0")
        print(f"{'size':>9} {'buffer':>10} {'plain':>22} {'cma.mpi':>22} {'plain/cma':>9}"
              f" {'faults':>12}")
        for size in args.sizes:
            for kind in BUFFERS:
                cells = []
                for name in libraries:
                    t = times[name, kind, size]
                    cells.append(f"{statistics.median(t):8.1f} ({min(t):.1f}-{max(t):.1f})")
                ratio = statistics.median(times["plain", kind, size]) / \
                    statistics.median(times["cma.mpi", kind, size])
                fault_cells = "/".join(f"{statistics.median(faults[name, kind, size]):.2f}"
                                       for name in libraries)
                print(f"{size:>9} {kind:>10} {cells[0]:>22} {cells[1]:>22} {ratio:>9.2f}"
                      f" {fault_cells:>12}")


if __name__ == "__main__":
    main()

"""Collectives as idiomatic mpi4py code writes them: ``Bcast([buf, n, MPI.BYTE])`` and
``Allreduce([s, n, MPI.FLOAT], [r, n, MPI.FLOAT], op=MPI.SUM)``, a new spec list in
every call, back to back, with plain mpi4py and with ``cma.mpi.Comm`` in one job, in
the order plain, cma, cma, plain::

    mpiexec -n 2 python3 bench/inline_specs.py [rounds] [--heap]

Rank 0 prints, per collective and size, the mean time per call of each library's two
runs and plain's time over cma's (above 1: cma.mpi faster), from the slower of one
library's runs against the faster of the other's and back. Bcast's buffer is an mmap,
as in mpi4py's demo/osu_bcast.py; Allreduce's are NumPy float32 arrays.

``--heap``: sizes from 1 to 16 MiB, and cma.mpi with xmap on and its buffers from the
shared heap (``cma.empty``), as a program that adopts it writes; plain mpi4py keeps the
mmap and NumPy arrays, and is timed once more on the heap buffers (``plain-heap``), so
that what the buffers alone change shows apart from what cma does with them.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import cma.mpi

SIZES = (8, 64, 1 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20)
HEAP_SIZES = (1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)


def loops_for(nbytes: int) -> int:
    return 2000 if nbytes <= 8 << 10 else 400 if nbytes <= 128 << 10 else 100 \
        if nbytes <= 2 << 20 else 30


def timed(comm: MPI.Comm, call: Callable[[MPI.Comm], None], loops: int) -> float:
    """Mean µs per call over ``loops`` calls after 10 untimed ones and a barrier."""
    for _ in range(10):
        call(comm)
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(loops):
        call(comm)
    return (MPI.Wtime() - start) / loops * 1e6


Buffers = tuple[Any, np.ndarray, np.ndarray]  # Bcast's, Allreduce's send and receive


def make_buffers(nbytes: int, heap: bool) -> Buffers:
    n = nbytes // 4
    if heap:
        send = cma.empty(n, np.float32)
        send.fill(1)
        return cma.zeros(nbytes, np.uint8), send, cma.empty(n, np.float32)
    return mmap.mmap(-1, nbytes), np.ones(n, np.float32), np.empty(n, np.float32)


def calls(nbytes: int, buffers: Buffers) -> list[tuple[str, Callable[[MPI.Comm], None]]]:
    buf, send, recv = buffers
    n = nbytes // 4

    def bcast(comm: MPI.Comm) -> None:
        comm.Bcast([buf, nbytes, MPI.BYTE], 0)

    def allreduce(comm: MPI.Comm) -> None:
        comm.Allreduce([send, n, MPI.FLOAT], [recv, n, MPI.FLOAT], op=MPI.SUM)

    return [("Bcast", bcast), ("Allreduce", allreduce)]


def main() -> None:
    heap = "--heap" in sys.argv[1:]
    given = [a for a in sys.argv[1:] if a != "--heap"]
    rounds = int(given[0]) if given else 1
    world = MPI.COMM_WORLD
    wrapped = cma.mpi.Comm(world, xmap=True) if heap else cma.mpi.Comm(world)
    rank = world.Get_rank()
    if rank == 0:
        print(f"# inline specs, {world.Get_size()} ranks, {rounds} round(s) of plain, cma, cma, "
              f"plain; mean µs per call; plain/cma from the slowest against the fastest run"
              + ("; cma.mpi's buffers from the shared heap, xmap on; plain-heap: mpi4py on "
                 "those buffers" if heap else ""))
    for nbytes in HEAP_SIZES if heap else SIZES:
        theirs = make_buffers(nbytes, heap=False)
        ours_buffers = make_buffers(nbytes, heap=True) if heap else theirs
        for (name, plain_call), (_, our_call) in zip(calls(nbytes, theirs),
                                                     calls(nbytes, ours_buffers), strict=True):
            loops = loops_for(nbytes)
            plain: list[float] = []
            ours: list[float] = []
            on_heap: list[float] = []
            for _ in range(rounds):
                plain.append(timed(world, plain_call, loops))
                ours.append(timed(wrapped, our_call, loops))
                ours.append(timed(wrapped, our_call, loops))
                if heap:
                    on_heap.append(timed(world, our_call, loops))
                plain.append(timed(world, plain_call, loops))
            if name == "Allreduce":
                for _, _, recv in {id(b): b for b in (theirs, ours_buffers)}.values():
                    assert recv[0] == world.Get_size(), recv[0]
            if rank == 0:
                extra = f"  plain-heap {min(on_heap):8.2f}-{max(on_heap):8.2f}" if heap else ""
                print(f"{name:9s} {nbytes:>8d} B  plain {min(plain):8.2f}-{max(plain):8.2f}  "
                      f"cma {min(ours):8.2f}-{max(ours):8.2f}  plain/cma "
                      f"{min(plain) / max(ours):.2f}-{max(plain) / min(ours):.2f}{extra}", flush=True)
    if wrapped.cma is not None:
        wrapped.cma.close()


if __name__ == "__main__":
    main()

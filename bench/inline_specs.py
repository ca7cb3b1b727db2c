"""Collectives as idiomatic mpi4py code writes them: ``Bcast([buf, n, MPI.BYTE])`` and
``Allreduce([s, n, MPI.FLOAT], [r, n, MPI.FLOAT], op=MPI.SUM)``, a new spec list in
every call, back to back, with plain mpi4py and with ``cma.mpi.Comm`` in one job, in
the order plain, cma, cma, plain::

    mpiexec -n 2 python3 bench/inline_specs.py [rounds]

Rank 0 prints, per collective and size, the mean time per call of each library's two
runs and plain's time over cma's (above 1: cma.mpi faster), from the slower of one
library's runs against the faster of the other's and back. Bcast's buffer is an mmap,
as in mpi4py's demo/osu_bcast.py; Allreduce's are NumPy float32 arrays.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import cma.mpi

SIZES = (8, 64, 1 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20)


def loops_for(nbytes: int) -> int:
    return 2000 if nbytes <= 8 << 10 else 400 if nbytes <= 128 << 10 else 100


def timed(comm: MPI.Comm, call: Callable[[MPI.Comm], None], loops: int) -> float:
    """Mean µs per call over ``loops`` calls after 10 untimed ones and a barrier."""
    for _ in range(10):
        call(comm)
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(loops):
        call(comm)
    return (MPI.Wtime() - start) / loops * 1e6


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    world = MPI.COMM_WORLD
    wrapped = cma.mpi.Comm(world)
    rank = world.Get_rank()
    buf = mmap.mmap(-1, max(SIZES))
    if rank == 0:
        print(f"# inline specs, {world.Get_size()} ranks, {rounds} round(s) of plain, cma, cma, "
              f"plain; mean µs per call; plain/cma from the slowest against the fastest run")
    for nbytes in SIZES:
        n = nbytes // 4
        send, recv = np.ones(n, np.float32), np.empty(n, np.float32)

        def bcast(comm: MPI.Comm, nbytes: int = nbytes) -> None:
            comm.Bcast([buf, nbytes, MPI.BYTE], 0)

        def allreduce(comm: MPI.Comm, n: int = n, send: np.ndarray = send,
                      recv: np.ndarray = recv) -> None:
            comm.Allreduce([send, n, MPI.FLOAT], [recv, n, MPI.FLOAT], op=MPI.SUM)

        for name, call in (("Bcast", bcast), ("Allreduce", allreduce)):
            plain: list[float] = []
            ours: list[float] = []
            for _ in range(rounds):
                for comm in (world, wrapped, wrapped, world):
                    (plain if comm is world else ours).append(timed(comm, call, loops_for(nbytes)))
            if name == "Allreduce":
                assert recv[0] == world.Get_size(), recv[0]
            if rank == 0:
                print(f"{name:9s} {nbytes:>8d} B  plain {min(plain):8.2f}-{max(plain):8.2f}  "
                      f"cma {min(ours):8.2f}-{max(ours):8.2f}  plain/cma "
                      f"{min(plain) / max(ours):.2f}-{max(plain) / min(ours):.2f}", flush=True)
    if wrapped.cma is not None:
        wrapped.cma.close()


if __name__ == "__main__":
    main()

"""The all-to-all of bench/scale_rank.py, alone: pairwise ``Sendrecv`` rounds, timed.

Run as every rank of a job, with the library to use and the number of iterations::

    python3 -m cma.run -n 16 python3 bench/sendrecv_alltoall.py cma 30
    mpiexec -n 16 python3 bench/sendrecv_alltoall.py mpi 30      # plain mpi4py
    mpiexec -n 16 python3 bench/sendrecv_alltoall.py plugin 30   # cma.mpi.Comm(COMM_WORLD)

Further arguments: ``spec`` passes mpi4py's buffer specs, ``[row, n, MPI.BYTE]`` (cma-run:
``[row, n, "B"]``), written inline as most mpi4py code does, instead of the bare rows; a
number is the bytes per pair (8 unless given).

After one untimed iteration and a barrier, rank 0 prints the wall time per iteration and
the CPU time per rank and iteration (means over ranks) and the voluntary and involuntary
context switches per rank and iteration (getrusage). docs/figures/oversubscribed-
sendrecv-2026-11-28.txt has runs of it with old and new code alternating.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import numpy as np

lib, iterations = sys.argv[1], int(sys.argv[2])
specs = "spec" in sys.argv[3:]
block = int(next((arg for arg in sys.argv[3:] if arg.isdigit()), 8))
if lib == "cma":
    import cma

    comm = cma.COMM_WORLD
    comm.attach()
    BYTE: object = "B"
else:
    from mpi4py import MPI

    BYTE = MPI.BYTE
    if lib == "plugin":
        import cma.mpi

        comm = cma.mpi.Comm(MPI.COMM_WORLD)
    else:
        comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
send, recv = np.zeros((size, block), np.uint8), np.zeros((size, block), np.uint8)


def alltoall() -> None:
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        if specs:
            comm.Sendrecv([send[dst], block, BYTE], dst, 5, recvbuf=[recv[src], block, BYTE],
                          source=src, recvtag=5)
        else:
            comm.Sendrecv(send[dst], dst, 5, recvbuf=recv[src], source=src, recvtag=5)


alltoall()
comm.Barrier()
before = resource.getrusage(resource.RUSAGE_SELF)
start = time.perf_counter()
for _ in range(iterations):
    alltoall()
wall = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
mine = (wall, cpu, after.ru_nvcsw - before.ru_nvcsw, after.ru_nivcsw - before.ru_nivcsw)
every = comm.gather(mine, root=0)
if rank == 0:
    wall_ms, cpu_ms, vol, invol = (statistics.mean(r[i] for r in every) / iterations for i in range(4))
    print(f"{lib}{' spec' if specs else ''} {size} {block} B wall ms/iter {wall_ms * 1e3:.4f} "
          f"cpu ms/iter/rank {cpu_ms * 1e3:.4f} "
          f"vol cs {vol:.2f} invol cs {invol:.2f} per rank per iter")

"""cma.mpi decides whether ranks outnumber CPUs from the CPUs its ranks may run on.

Argument "one-cpu": every rank confines itself to the same CPU (as ``taskset -c 0 mpiexec``
or a one-CPU allocation would), so two ranks are more than their CPUs. "own-cpu": each rank
binds itself to a CPU of its own (as ``mpiexec --bind-to core``), so each rank's mask holds
one CPU and yet the ranks have a core each: the union of their masks counts. Each rank
prints "OK <rank>" at the end.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import cma.mpi

mode = sys.argv[1]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[0] if mode == "one-cpu" else cpus[rank % len(cpus)]})
comm = cma.mpi.Comm(world)
assert comm.cma is not None
expected = mode == "one-cpu"
assert comm.cma._progress.oversubscribed == expected, (mode, os.sched_getaffinity(0))
got = np.empty(4, np.int64)
comm.Sendrecv(np.full(4, rank), (rank + 1) % size, 1, got, (rank - 1) % size, 1)
assert (got == (rank - 1) % size).all()
print(f"OK {rank}")

"""What cma.mpi's progress hook costs plain MPI once cma's requests are over.

A plain ``MPI.COMM_WORLD`` ping-pong of 8 B, timed before any cma request and in three
rounds after one ``Isend``/``Irecv`` through the plugin has completed: the hook must
have left MPI's progress loop by then, so the rounds match. Under Open MPI it used to
stay registered, and every plain message paid a call into Python (docs/mpi.md,
"Requests"). Prints one line, on rank 0.

    mpiexec -n 2 python bench/mpi_hook_cost.py
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from untouched_buffers import one_way_us  # (bench/ is this script's directory)

import cma.mpi

ROUND_TRIPS = 20000

world = MPI.COMM_WORLD
rank = world.Get_rank()
message = bytearray(8)


def plain_us() -> float:
    """One-way microseconds of an 8 B ping-pong over plain ``MPI.COMM_WORLD``."""
    return one_way_us(world, message, message, ROUND_TRIPS)[0]


comm = cma.mpi.Comm(world)
before = plain_us()
if rank == 0:
    comm.Isend(np.ones(1), 1, 3).Wait()
elif rank == 1:
    comm.Irecv(np.empty(1), 0, 3).Wait()
after = [plain_us() for _ in range(3)]
if rank == 0:
    print(f"{MPI.Get_library_version().splitlines()[0][:40]}: plain 8 B one-way {before:.2f} us "
          f"before a cma request, after: {', '.join(f'{t:.2f}' for t in after)} us", flush=True)

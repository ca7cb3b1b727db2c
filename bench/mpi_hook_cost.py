"""What cma.mpi's progress hook costs plain MPI once cma's requests are over.

A plain ``MPI.COMM_WORLD`` ping-pong of 8 B, timed before any cma request and in three
rounds after one ``Isend``/``Irecv`` through the plugin has completed: the hook must
have left MPI's progress loop by then, so the rounds match. Under Open MPI it used to
stay registered, and every plain message paid a call into Python (docs/mpi.md,
"Requests"). Prints one line, on rank 0.

    mpiexec -n 2 python bench/mpi_hook_cost.py
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import cma.mpi

ROUND_TRIPS = 20000

world = MPI.COMM_WORLD
rank = world.Get_rank()
message = bytearray(8)


def one_way_us() -> float:
    world.Barrier()
    start = time.perf_counter()
    for _ in range(ROUND_TRIPS):
        if rank == 0:
            world.Send(message, 1, 1)
            world.Recv(message, 1, 1)
        else:
            world.Recv(message, 0, 1)
            world.Send(message, 0, 1)
    return (time.perf_counter() - start) / ROUND_TRIPS / 2 * 1e6


comm = cma.mpi.Comm(world)
before = one_way_us()
if rank == 0:
    comm.Isend(np.ones(1), 1, 3).Wait()
elif rank == 1:
    comm.Irecv(np.empty(1), 0, 3).Wait()
after = [one_way_us() for _ in range(3)]
if rank == 0:
    print(f"{MPI.Get_library_version().splitlines()[0][:40]}: plain 8 B one-way {before:.2f} us "
          f"before a cma request, after: {', '.join(f'{t:.2f}' for t in after)} us", flush=True)

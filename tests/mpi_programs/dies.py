"""Rank 1 dies (os._exit) while rank 0 waits in Recv from it (or, with the argument
"Irecv", in the Wait of an Irecv from it; with "Waitall", in MPI's own Waitall of that
Irecv, where cma runs in MPI's progress hook): the job must fail, not hang.

Under ``mpiexec -disable-auto-cleanup`` nothing but cma.mpi notices: rank 0 raises
cma.mpi.PeerGoneError (an MPI.Exception; in MPI's Waitall, MPI's error, after mpi4py
printed the PeerGone behind it), and ``python -m mpi4py`` aborts the job.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import cma.mpi

comm = cma.mpi.Comm(MPI.COMM_WORLD)
if comm.rank < 2:
    assert comm.cma is not None and {0, 1} <= set(comm.node_ranks), comm
comm.Barrier()
if comm.rank == 1:
    time.sleep(0.5)  # let rank 0 settle into its wait
    os._exit(3)
if comm.rank == 0:
    if sys.argv[1:] == ["Irecv"]:
        comm.Irecv(np.empty(4), 1, 0).Wait()
    elif sys.argv[1:] == ["Waitall"]:
        MPI.Request.Waitall([comm.Irecv(np.empty(4), 1, 0)])
    else:
        comm.Recv(np.empty(4), 1, 0)
comm.Barrier()  # the other ranks wait here until the job is torn down

"""cma.mpi.Comm with CMA_XMAP=1: a heap buffer received on the node through xmap (a bare
array and a buffer spec), counted by the node communicator's stats. Prints "OK <rank>"."""

import numpy as np
from mpi4py import MPI

import cma
import cma.mpi

comm = cma.mpi.Comm(MPI.COMM_WORLD)
n = 8 << 20
if comm.Get_rank() == 1:
    a = cma.empty(n, np.uint8)
    a[:] = 7
    comm.Send(a, 0, 1)
    comm.Send([a, n, MPI.BYTE], 0, 2)
    ok = True
else:
    buf = np.zeros(n, np.uint8)
    comm.Recv(buf, 1, 1)
    ok = bool((buf == 7).all())
    buf[:] = 0
    comm.Recv([buf, n, MPI.BYTE], 1, 2)
    ok = ok and bool((buf == 7).all())
    stats = comm._cma.stats()["xmap"]  # the node communicator's
    ok = ok and stats["messages"] == 2 and stats["user_copies"] == 1.0 and stats["cache_hits"] == 1
comm.Barrier()
if ok:
    print(f"OK {comm.Get_rank()}", flush=True)

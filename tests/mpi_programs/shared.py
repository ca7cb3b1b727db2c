"""cma.shared_array on cma.mpi.Comm: one array per node, its root the node's lowest rank.

Each node's root fills the array with its own rank + 1; after a Barrier every rank must see
its node root's rank + 1 (on pretend nodes, CMA_MPI_RANKS_PER_NODE, each node has its own
array), a non-root write must raise, and a writable array written by the node's highest
rank must be seen by the others of the node. With CMA_MPI_DISABLE=1 every rank must get
CmaError instead. Prints "OK <rank>".
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import cma.mpi
from cma.mpi.bootstrap import ENV_DISABLE, env_flag

comm = cma.mpi.Comm(MPI.COMM_WORLD)
rank = comm.Get_rank()
if env_flag(ENV_DISABLE):
    try:
        cma.shared_array(comm, 3)
        raise AssertionError(f"rank {rank}: shared_array worked without cma's node worlds")
    except cma.errors.CmaError as exc:
        assert ENV_DISABLE in str(exc), exc
    print(f"OK {rank}", flush=True)
    raise SystemExit(0)
node = comm.node_ranks or [rank]  # this node's ranks, in order (alone: just this one)
table = cma.shared_array(comm, (1000, 4), np.int64)
if rank == node[0]:
    table[:] = rank + 1
comm.Barrier()
assert (table == node[0] + 1).all(), (rank, node, table[0])
assert table.flags.writeable == (rank == node[0])
if rank != node[0]:
    try:
        table[0, 0] = -1
        raise AssertionError(f"rank {rank} wrote into a read-only shared array")
    except ValueError:
        pass
scratch = cma.shared_array(comm, 8, writable=True)
if rank == node[-1]:
    scratch[:] = 2.5
comm.Barrier()
assert (scratch == 2.5).all(), (rank, scratch)
assert cma.is_shared(table) and cma.is_shared(scratch)
comm.Barrier()
print(f"OK {rank}", flush=True)

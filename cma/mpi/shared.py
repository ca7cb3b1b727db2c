"""``cma.shared_array`` on a ``cma.mpi.Comm``: one array per node, over the node's cma world.

Registered with ``cma.shared`` when ``cma.mpi`` is imported, so ``cma.shared`` never
imports mpi4py. The node's cma communicator numbers the node's ranks in the wrapped
communicator's order, so its rank 0, the default root, is the node's lowest rank.
"""

from __future__ import annotations

from mpi4py import MPI

from ..comm import Comm as CmaComm
from ..errors import CmaError
from ..shared import register_node_comm
from .bootstrap import BARRIER_MPI, ENV_DISABLE, env_flag
from .comm import Comm


def node_comm(comm: Comm) -> CmaComm | None:
    """The cma communicator of this rank's node, or None when the rank is alone on its
    node (collective: with no cma world on any rank it asks every rank why)."""
    if comm.cma is not None:
        return comm.cma
    # no world here: this rank is alone on its node, or cma.mpi is disabled everywhere;
    # either way BARRIER_MPI means no rank has a world, so all of them take this branch
    if comm._barrier == BARRIER_MPI and MPI.Intracomm.allreduce(comm, env_flag(ENV_DISABLE),
                                                                 op=MPI.LOR):
        raise CmaError(f"cma.shared_array needs cma's node worlds, and {ENV_DISABLE} turned "
                       "them off: use MPI.Win.Allocate_shared, or unset it")
    return None


register_node_comm(Comm, node_comm)

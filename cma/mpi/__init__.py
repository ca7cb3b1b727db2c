"""mpi4py plugin: an mpi4py ``Intracomm`` whose on-node point-to-point goes through cma.

    from mpi4py import MPI
    import cma.mpi
    comm = cma.mpi.Comm(MPI.COMM_WORLD)

``Comm`` *is* an ``MPI.Intracomm`` (a second Python object on the same MPI handle, as
``mpi4py.util.pkl5.Comm`` is), so everything it does not override (collectives,
Split, attributes, Abort, Get_name, ...) is plain mpi4py, and it can be passed to
anything that takes an mpi4py communicator, C-level mpi4py functions included.

Routing is fixed per pair of ranks: a peer on this node always goes through one cma
world (one memfd segment shared by the node's ranks), a peer on another node always
through MPI. MPI's non-overtaking rule is per pair, so it holds in each channel.

Every request handed out is an ``MPI.Request`` (``requests``): MPI's own where the
operation completed at once or is off-node, else an MPI generalized request that cma
completes, so mpi4py's functions (``MPI.Request.Waitall`` & co.) take them. A rank
waiting inside MPI runs cma through a progress hook into the MPI library (``libmpi``).
Two things need care when a rank has peers of both kinds ("mixed"):

* progress: MPI progresses only inside MPI calls and cma only inside cma calls, and
  either may need this rank's help to finish a transfer (MPI rendezvous, cma's shm
  pipeline). The hook runs cma inside MPI's waits; waiting for cma, mixed ranks poll
  both in cma's wait loop (``MixedRank.progress_until``: ``Progress.wait_until`` with MPI's
  pass as its ``outside``), spinning briefly and then sleeping with a growing pause.
* ANY_SOURCE: a wildcard receive is matched lazily, by probing both channels and
  receiving exactly the message found (``mixed`` decides, ``mixedio`` probes and
  receives). To keep MPI's order of posted receives, a receive posted after an
  unmatched wildcard receive that could take the same messages waits behind it
  (``mixed.Wildcards``), and probes do not report messages such a waiting receive owns.

Node membership comes from ``Split_type(COMM_TYPE_SHARED)``, narrowed by
``CMA_MPI_NODES`` / ``CMA_MPI_RANKS_PER_NODE`` to pretend to be several nodes. The
node's lowest rank creates the world and serves its fds from its ``World``'s fd server
(cma.world's, the one every attached rank runs: an abstract Unix socket, SO_PEERCRED
checked both ways) to the node's announced pids, the world's id travelling in an MPI
bcast. ``CMA_MPI_DISABLE=1`` sends everything through MPI; ``CMA_MPI_COLLECTIVES``
(auto, cma, mpi) which library runs the collectives of a communicator on one node. docs/mpi.md is the user's
guide.

The modules: ``comm`` (the communicator: dispatch; its ``Message``), ``node`` (the
node's cma communicator), ``mixedio`` (a mixed rank's waits and wildcard receives:
``MixedRank``, which ``comm`` builds only on such a rank), ``requests`` (and the hook's
use), ``persistent`` (``Prequest``), ``libmpi`` (the MPI library's progress hook,
through ctypes), ``specs`` (buffer specs), ``datatypes`` (derived datatypes as blocks),
``bootstrap``, ``mixed`` (wildcards across both channels), ``hierarchy`` (collectives
over several nodes), ``routing`` (which library runs an all-on-node collective),
``errors``, ``mpiapi`` (what is taken from mpi4py), ``shared`` (``cma.shared_array`` per
node) and ``pkl5`` (``mpi4py.util.pkl5`` over a wrapper goes through the wrapper).
"""

from __future__ import annotations

from . import (
    pkl5,
    shared,  # noqa: F401 - registers cma.shared_array for cma.mpi.Comm
)
from .bootstrap import ENV_DISABLE, ENV_NODES, ENV_RANKS_PER_NODE
from .comm import Comm, Message
from .errors import PeerGoneError, TruncateError
from .persistent import Prequest
from .requests import Request

pkl5.install()  # mpi4py.util.pkl5 over a wrapper goes through it

__all__ = [
    "ENV_DISABLE", "ENV_NODES", "ENV_RANKS_PER_NODE", "Comm", "Message", "PeerGoneError",
    "Prequest", "Request", "TruncateError",
]

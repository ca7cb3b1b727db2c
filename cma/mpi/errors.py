"""mpi4py's exceptions for what cma reports: truncation and a vanished peer."""

from __future__ import annotations

from mpi4py import MPI

from ..errors import PeerGone, RequestActive, TruncationError


class TruncateError(MPI.Exception, TruncationError):
    """A receive buffer too small: ``MPI.Exception`` with ``ERR_TRUNCATE``, as mpi4py raises.

    Also a ``cma.errors.TruncationError`` carrying ``source`` (a rank of the wrapped
    communicator), ``tag``, ``nbytes`` and ``capacity``. The message is consumed.
    """

    def __init__(self, message: str, *, source: int, tag: int, nbytes: int, capacity: int):
        MPI.Exception.__init__(self, MPI.ERR_TRUNCATE)
        self.message = message
        self.source = source
        self.tag = tag
        self.nbytes = nbytes
        self.capacity = capacity

    def __str__(self) -> str:
        return self.message


class PeerGoneError(MPI.Exception, PeerGone):
    """An on-node peer exited while this rank needed it: ``MPI.Exception`` with ``ERR_OTHER``."""

    def __init__(self, message: str):
        MPI.Exception.__init__(self, MPI.ERR_OTHER)
        self.message = message

    def __str__(self) -> str:
        return self.message



class RequestActiveError(MPI.Exception, RequestActive):
    """``Start`` of a persistent request that is active: ``MPI.Exception`` with
    ``ERR_REQUEST``, as MPI_Start raises (MPICH), and a ``cma.errors.RequestActive``."""

    def __init__(self, message: str):
        MPI.Exception.__init__(self, MPI.ERR_REQUEST)
        self.message = message

    def __str__(self) -> str:
        return self.message

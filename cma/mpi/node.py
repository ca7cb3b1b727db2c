"""The cma communicator of a node's ranks, speaking mpi4py where its fast paths end."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..comm import Comm as CmaComm
from ..comm import Request as CmaRequest
from ..comm import Status as CmaStatus
from ..comm import send_view
from ..errors import CmaError
from .mpiapi import fill
from .specs import SPECS, SpecCache

if TYPE_CHECKING:
    from .comm import Comm


class NodeComm(CmaComm):
    """The cma communicator of this node's ranks, speaking mpi4py where the hot paths end.

    When every rank is on this node, its ranks are the wrapped communicator's and
    ``Comm`` hands out its point-to-point methods as its own (``HANDED_OUT``): a
    message then costs no wrapper frame, and a non-blocking call returns one request
    (``_NodeRequest``) instead of a wrapper around cma's. So buffer specs are converted,
    statuses filled and errors raised as mpi4py's here, on the paths the eager fast
    paths fall back to.
    """

    def __init__(self, mpi: Comm, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._mpi = mpi  # the wrapper: its _fail runs the error handler, raises its exception
        self._send_spec = SpecCache()
        self._recv_spec = SpecCache()
        self._mpi_scratch = CmaStatus()

    def _cached_view(self, buf: Any, convert: Callable[[Any], memoryview]) -> memoryview:
        if buf.__class__ in SPECS:  # [buf, MPI.DOUBLE] & co: never cached themselves
            buf = (self._send_spec if convert is send_view else self._recv_spec).convert(buf)
        return super()._cached_view(buf, convert)

    def _send(self, mv: memoryview, dest: Any, tag: Any) -> None:
        try:
            super()._send(mv, dest, tag)
        except CmaError as exc:
            self._mpi._fail(exc)

    def _recv(self, mv: memoryview, source: Any, tag: Any, status: Any) -> None:
        mpi_status = None if status is None or status.__class__ is CmaStatus else status
        scratch = self._mpi_scratch if mpi_status is not None else status
        try:
            super()._recv(mv, source, tag, scratch)
        except CmaError as exc:
            self._mpi._fail(exc, mpi_status)
        if mpi_status is not None:
            fill(mpi_status, scratch.source, scratch.tag, scratch.count)

    def _isend(self, mv: memoryview, dest: Any, tag: Any) -> CmaRequest:
        try:
            return super()._isend(mv, dest, tag)
        except CmaError as exc:
            self._mpi._fail(exc)

    def _irecv(self, mv: memoryview, source: Any, tag: Any) -> CmaRequest:
        try:
            return super()._irecv(mv, source, tag)
        except CmaError as exc:
            self._mpi._fail(exc)


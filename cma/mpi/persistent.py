"""Persistent requests (Send_init, Recv_init & co.) of on-node operations.

MPI has no persistent generalized request, and ``MPI.Prequest.Startall`` starts requests
inside MPI, where no Python of ours runs. So each of these requests carries a real
persistent request of MPI's own: a receive of zero bytes from this process on a private
communicator (a duplicate of ``MPI_COMM_SELF``), with a tag of its own. MPI starts and
waits for that one, and cma drives it: whoever starts the request (``Start`` here, or
MPI's ``Startall``, noticed by the progress hook as the private receive turning active)
starts the cma operation, and when that is over a zero-byte message to ourselves
completes the private receive. Then every MPI function that takes requests takes these
too. A receive's status is cma's in this class's own ``Wait``/``Test``; MPI's wait
functions report the private message's. docs/mpi.md has the figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from mpi4py import MPI

from ..errors import CmaError
from ..protocol import RecvOp, SendOp
from .errors import RequestActiveError
from .mpiapi import fill
from .requests import SERVED

if TYPE_CHECKING:
    from .node import NodeComm

NOTHING = [None, 0, MPI.BYTE]
IDLE, STARTING, RUNNING, DONE = 0, 1, 2, 3

_mpi_start = MPI.Prequest.Start
_mpi_wait = MPI.Request.Wait
_tags = itertools.count(1)
_ACTIVE = ("this persistent request is active (started, not yet completed by Wait or Test): "
           "complete it with Wait/Test before starting it again")


class Prequest(MPI.Prequest):
    """A persistent on-node operation of a ``cma.mpi.Comm`` (see the module docstring)."""

    __slots__ = ("_node", "_begin", "_op", "_state", "_tag")  # (mpi4py gives it __weakref__)
    _node: NodeComm
    _begin: Callable[[], SendOp | RecvOp | None]  # starts the cma operation (None: done)
    _op: SendOp | RecvOp | None
    _state: int
    _tag: int

    def _started(self) -> None:
        """It was started (by us or by MPI): start the cma operation."""
        self._state = RUNNING
        try:
            self._op = self._begin()
        except CmaError:
            self._op = None  # (the error is raised again by the next Wait's own attempt)
            raise
        finally:
            self._settled()

    def _settled(self) -> bool:
        """If the cma operation is over, complete MPI's side; whether it is."""
        op = self._op
        if self._state == RUNNING and (op is None or op.done):
            self._state = DONE
            # an Isend does not progress MPI, so the hook may post it
            self._node.private_comm().Isend(NOTHING, 0, self._tag).Free()
        return self._state != RUNNING

    def poll(self) -> None:
        """From the progress hook: notice a start by MPI's Startall, finish what is over."""
        state = self._state
        if state == RUNNING:
            self._settled()
        elif state != STARTING and self and SERVED.active(self):
            self._started()

    def Start(self) -> None:
        """mpi4py's ``Prequest.Start``: starts the cma operation (and MPI's zero-byte half).

        Starting it while active raises ``RequestActiveError``."""
        if self._state in (STARTING, RUNNING):
            raise RequestActiveError(_ACTIVE)
        previous, self._state = self._state, STARTING  # (MPI_Start might run the hook,
        try:                                           # which must leave it to us)
            _mpi_start(self)
        except MPI.Exception as exc:
            # (its operation over, not yet waited for) the state stays: left at STARTING,
            # the request never completed and Wait hung
            self._state = previous
            if exc.Get_error_class() == MPI.ERR_REQUEST:
                raise RequestActiveError(_ACTIVE) from exc
            raise
        self._started()

    def Wait(self, status: MPI.Status | None = None) -> Literal[True]:
        """mpi4py's ``Prequest.Wait``: waits inside cma, then completes MPI's half; the request stays
        inactive, not null. Fills ``status`` with cma's source, tag and count."""
        node = self._node
        if self._state not in (RUNNING, STARTING) and self and SERVED.active(self):
            self._started()  # started by MPI (Startall), noticed here first
        op = self._op
        if self._state == RUNNING and op is not None and not op.done:
            try:
                node.settle_op(op)
            finally:
                self._settled()
        _mpi_wait(self, status)
        if isinstance(op, RecvOp):
            if status is not None and op.matched_source >= 0:
                fill(status, node.comm_rank(op.matched_source), op.matched_tag, op.nbytes)
            if op.error is not None:
                error, op.error = op.error, None
                node._mpi._fail(error, status)
        return True

    def Test(self, status: MPI.Status | None = None) -> bool:
        """mpi4py's ``Prequest.Test``: one step of progress; if the operation is over, ``Wait``."""
        self.poll()
        if self._state == RUNNING:
            self._node.step_all()
            if not self._settled():
                return False
        return self.Wait(status)

    def Free(self) -> None:
        """mpi4py's ``Prequest.Free``: no longer watched by the progress hook, then freed in MPI."""
        self._node.forget(self)
        MPI.Prequest.Free(self)

    @classmethod
    def Startall(cls, requests: Sequence[MPI.Prequest]) -> None:
        """mpi4py's ``Prequest.Startall``: ``Start`` each request, in order."""
        for req in requests:
            req.Start()


def persistent_request(node: NodeComm, begin: Callable[[], SendOp | RecvOp | None]) -> Prequest:
    """A Prequest whose every start runs ``begin``."""
    tag = next(_tags)
    req = Prequest(node.private_comm().Recv_init(NOTHING, 0, tag))
    req._node = node
    req._begin = begin
    req._op = None
    req._state = IDLE
    req._tag = tag
    node.watch(req)
    return req


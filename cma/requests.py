"""Status, Request and Message: what cma's calls hand back, shaped like mpi4py's.

A request holds a protocol operation (``SendOp``/``RecvOp``) and the communicator that
moves it; waiting and testing ask that communicator to make progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import CmaError, ConcurrentUse
from .protocol import Arrival, RecvOp, SendOp
from .wire import ANY_SOURCE, ANY_TAG, PROC_NULL, UNDEFINED

if TYPE_CHECKING:
    from .comm import Comm


class Status:
    """Source, tag and size of a received message, as mpi4py's ``MPI.Status``."""

    __slots__ = ("source", "tag", "count", "error")

    def __init__(self) -> None:
        self.source = ANY_SOURCE
        self.tag = ANY_TAG
        self.count = 0
        self.error = 0

    def Get_source(self) -> int:
        """The message's source rank (``MPI.Status.Get_source``); also the attribute ``source``."""
        return self.source

    def Get_tag(self) -> int:
        """The message's tag (``MPI.Status.Get_tag``); also the attribute ``tag``."""
        return self.tag

    def Get_error(self) -> int:
        """The error code (``MPI.Status.Get_error``): always 0, cma raises its errors instead."""
        return self.error

    def Get_count(self, datatype: Any = None) -> int:
        """Number of elements of ``datatype`` (a typechar or NumPy dtype; bytes by default)."""
        if datatype is None:
            return self.count
        return self.count // np.dtype(datatype).itemsize

    def Get_elements(self, datatype: Any) -> int:
        """``Get_count`` (``MPI.Status.Get_elements``): cma's datatypes have no partial elements."""
        return self.Get_count(datatype)

    def _fill(self, source: int, tag: int, count: int) -> None:
        self.source = source
        self.tag = tag
        self.count = count

    def __repr__(self) -> str:
        return f"Status(source={self.source}, tag={self.tag}, count={self.count})"


class Request:
    """A non-blocking operation, as mpi4py's ``MPI.Request``."""

    __slots__ = ("_comm", "_op", "_object", "_also", "_spent")

    def __init__(self, comm: Comm, op: SendOp | RecvOp | None, is_object: bool = False,
                 also: SendOp | None = None) -> None:
        self._comm = comm
        self._op = op
        self._object = is_object
        self._also = also  # Isendrecv: the send this receive's request also waits for
        # completed by a Wait/Test: inactive from then on, as mpi4py's request becomes
        # REQUEST_NULL (a later Wait returns at once with an empty status)
        self._spent = False

    def _done(self) -> bool:
        op, also = self._op, self._also
        return (op is None or op.done) and (also is None or also.done)

    def Test(self, status: Status | None = None) -> bool:
        """Complete the request if it can (``MPI.Request.Test``): a pass of progress, then True if done.

        Finished as ``Wait`` would be (``status`` filled, an operation's error raised)."""
        if self._spent:
            _empty(status)
            return True
        if not self._done():
            self._comm.progress()
            if not self._done():
                return False
        self._finish(status)
        return True

    def Wait(self, status: Status | None = None) -> Literal[True]:
        """Block until the request completes (``MPI.Request.Wait``); fill ``status`` for a receive.

        Re-raises the operation's error (e.g. ``TruncationError``). Interrupted (Ctrl-C), a
        receive nothing matched yet is withdrawn; a matched receive or a send still completes
        during later calls."""
        if self._spent:
            _empty(status)
            return True
        for op in (self._op, self._also):
            if op is not None and not op.done:
                progress = self._comm._progress or self._comm._attach()
                try:
                    progress.wait(op)
                except ConcurrentUse:
                    raise  # (nothing was done: the request stays as it was, for a later Wait)
                except BaseException:
                    progress.withdraw(op)  # the caller gives up on it (a Ctrl-C, say)
                    raise
        self._finish(status)
        return True

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        """``Test``, returning ``(done, result)``: the received object (``irecv``), or ``None``
        (``MPI.Request.test``)."""
        if self._spent:
            _empty(status)
            return True, None
        if not self.Test(status):
            return False, None
        return True, self._result()

    def wait(self, status: Status | None = None) -> Any:
        """``Wait``, then return the received object (``irecv``) or view (``Irecv_view``), else ``None``
        (``MPI.Request.wait``)."""
        if self._spent:
            _empty(status)
            return None
        self.Wait(status)
        return self._result()

    def _finish(self, status: Status | None) -> None:
        self._spent = True
        op = self._op
        if isinstance(op, RecvOp):
            if status is not None:
                status._fill(op.matched_source, op.matched_tag, op.nbytes)
            if op.error is not None:
                error, op.error = op.error, None
                raise error

    def _result(self) -> Any:
        op = self._op
        if isinstance(op, RecvOp) and op.view and not self._object:
            return self._comm.load_view(op)
        if self._object and isinstance(op, RecvOp) and op.matched_source != PROC_NULL:
            return self._comm.load_object(op)
        return None

    @classmethod
    def Waitall(cls, requests: Sequence[Request], statuses: list[Status] | None = None
                ) -> Literal[True]:
        """Wait for every request, in order (``MPI.Request.Waitall``); ``statuses`` as long as
        ``requests``."""
        for i, req in enumerate(requests):
            req.Wait(statuses[i] if statuses is not None else None)
        return True

    @classmethod
    def waitall(cls, requests: Sequence[Request], statuses: list[Status] | None = None) -> list[Any]:
        """``wait`` for every request (``MPI.Request.waitall``): the list of results."""
        return [req.wait(statuses[i] if statuses is not None else None)
                for i, req in enumerate(requests)]

    def _ready(self) -> bool:
        """Whether a Wait would return at once, after a step of progress if needed (Test
        without finishing: a finished request reports an empty status from then on)."""
        if self._spent or self._done():
            return True
        self._comm.progress()
        return self._done()

    @classmethod
    def Testall(cls, requests: Sequence[Request], statuses: list[Status] | None = None) -> bool:
        """True, and every request finished, only if all are complete (``MPI.Request.Testall``); else none
        is finished."""
        if not all(req._ready() for req in requests):
            return False
        return cls.Waitall(requests, statuses)

    @classmethod
    def testall(cls, requests: Sequence[Request], statuses: list[Status] | None = None
                ) -> tuple[bool, list[Any] | None]:
        """``Testall``, returning ``(True, results)`` or ``(False, None)`` (``MPI.Request.testall``)."""
        if not cls.Testall(requests, statuses):
            return False, None
        return True, [req._result() for req in requests]

    @classmethod
    def Waitany(cls, requests: Sequence[Request], status: Status | None = None) -> int:
        """Wait until one active request completes and finish it (``MPI.Request.Waitany``): its index.

        Finished (inactive) requests are skipped; ``UNDEFINED`` if none is active, as
        mpi4py."""
        active = [req for req in requests if not req._spent]
        if not active:  # (mpi4py: none active, or none at all)
            _empty(status)
            return UNDEFINED
        comm = active[0]._comm
        box: list[int] = []

        def any_done() -> bool:
            for i, req in enumerate(requests):
                if not req._spent and req._done():
                    box.append(i)
                    return True
            return False

        (comm._progress or comm._attach()).wait_until(any_done, None)
        requests[box[0]].Wait(status)
        return box[0]

    @classmethod
    def waitany(cls, requests: Sequence[Request], status: Status | None = None) -> tuple[int, Any]:
        """``Waitany``, returning ``(index, result)`` (``MPI.Request.waitany``)."""
        index = cls.Waitany(requests, status)
        return index, None if index == UNDEFINED else requests[index]._result()


def _empty(status: Status | None) -> None:
    """An inactive request's status, as MPI's: any source, any tag, no bytes."""
    if status is not None:
        status._fill(ANY_SOURCE, ANY_TAG, 0)


class Message:
    """A message that a matched probe took out of matching, as mpi4py's ``MPI.Message``.

    Receive it once, with ``Recv``/``Irecv`` into a buffer or ``recv``/``irecv`` as an
    object; it is false afterwards. A probe of ``PROC_NULL`` gives an empty message.
    """

    __slots__ = ("_comm", "_arrival", "_taken")

    def __init__(self, comm: Comm, arrival: Arrival | None) -> None:
        self._comm = comm
        self._arrival = arrival  # None: PROC_NULL's
        self._taken = False

    def __bool__(self) -> bool:
        return not self._taken

    def _take(self) -> Arrival | None:
        if self._taken:
            raise CmaError("this message was received already")
        self._taken = True
        return self._arrival

    def Irecv(self, buf: Any) -> Request:
        """Receive this message into ``buf``, non-blocking (``MPI.Message.Irecv``); only once."""
        return self._comm._mrecv(self._take(), buf, False)

    def Recv(self, buf: Any, status: Status | None = None) -> None:
        """Receive this message into ``buf`` (``MPI.Message.Recv``); fills ``status``; only once."""
        self.Irecv(buf).Wait(status)

    def irecv(self) -> Request:
        """Receive this message as an object, non-blocking (``MPI.Message.irecv``); only once."""
        return self._comm._mrecv(self._take(), None, True)

    def recv(self, status: Status | None = None) -> Any:
        """Receive this message as an object (``MPI.Message.recv``); only once."""
        return self.irecv().wait(status)


def null_recv() -> RecvOp:
    op = RecvOp(PROC_NULL, ANY_TAG, None, matched_source=PROC_NULL, matched_tag=ANY_TAG)
    op.done = True
    return op

"""Requests of cma.mpi.Comm's non-blocking calls, with mpi4py's methods."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from mpi4py import MPI

from ..comm import Request as CmaRequest
from ..comm import Status as CmaStatus
from ..errors import CmaError
from ..protocol import ANY_SOURCE as CMA_ANY_SOURCE
from ..protocol import RecvOp, SendOp
from .mpiapi import BYTE, EMPTY, fill

if TYPE_CHECKING:
    from .comm import Comm
    from .node import NodeComm

ACTIVE, COMPLETE, INACTIVE = 0, 1, 2


class Request:
    """An mpi4py-style request on an on-node (cma) or off-node (MPI) operation.

    Not an ``MPI.Request`` (MPI could not progress cma): wait for a list with
    ``cma.mpi.Request.Waitall``, which also takes plain ``MPI.Request`` objects. A
    completed request becomes inactive: waiting again returns at once with an empty
    status, as for ``MPI.REQUEST_NULL``.
    """

    # Two kinds: cma's own request where every peer is on this node (NodeRequest),
    # else one that routes to either engine (RoutedRequest). What the methods below
    # need from them: _poll progresses once and says whether the request is complete,
    # _complete blocks until it is, _outcome is the (source, tag, bytes) it will report,
    # _report fills a status, raises a failure, hands over the value and leaves the
    # request inactive; _wrapper is the Comm it came from.
    __slots__ = ()

    def _poll(self) -> bool:
        raise NotImplementedError

    def _complete(self) -> None:
        raise NotImplementedError

    def _outcome(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def _report(self, status: MPI.Status | None) -> Any:
        raise NotImplementedError

    def _wrapper(self) -> Comm:
        raise NotImplementedError

    # -- mpi4py's API

    def Wait(self, status: MPI.Status | None = None) -> Literal[True]:
        self._complete()
        self._report(status)
        return True

    def wait(self, status: MPI.Status | None = None) -> Any:
        self._complete()
        return self._report(status)

    def Test(self, status: MPI.Status | None = None) -> bool:
        if not self._poll():
            return False
        self._report(status)
        return True

    def test(self, status: MPI.Status | None = None) -> tuple[bool, Any]:
        if not self._poll():
            return False, None
        return True, self._report(status)

    def Get_status(self, status: MPI.Status | None = None) -> bool:
        """Whether it has completed, without completing it (``status`` filled if so)."""
        if not self._poll():
            return False
        if status is not None:
            fill(status, *self._outcome())
        return True

    # -- many requests

    @staticmethod
    def _adopt(requests: Sequence[Request | MPI.Request]) -> list[Request]:
        """Our requests, plain MPI requests wrapped so that one loop progresses both."""
        first = next((r for r in requests if isinstance(r, Request)), None)
        if first is None and requests:
            raise TypeError("cma.mpi.Request.Waitall and friends need at least one request "
                            "from a cma.mpi.Comm; use MPI.Request's methods for plain ones")
        out = []
        for r in requests:
            if isinstance(r, Request):
                out.append(r)
            else:
                assert first is not None
                comm = first._wrapper()
                out.append(RoutedRequest(comm, None, r, False) if r else inactive(comm))
        return out

    @staticmethod
    def _report_all(requests: list[Request], statuses: list[MPI.Status] | None) -> list[Any]:
        if statuses is not None:
            statuses.extend(MPI.Status() for _ in range(len(requests) - len(statuses)))
        values = []
        first: BaseException | None = None
        for i, req in enumerate(requests):
            try:
                values.append(req._report(None if statuses is None else statuses[i]))
            except (MPI.Exception, CmaError) as exc:  # report every request, raise the first failure
                values.append(None)
                first = first or exc
        if first is not None:
            raise first
        return values

    @classmethod
    def Waitall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> Literal[True]:
        cls.waitall(requests, statuses)
        return True

    @classmethod
    def waitall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> list[Any]:
        reqs = cls._adopt(requests)
        for req in reqs:
            req._complete()
        return cls._report_all(reqs, statuses)

    @classmethod
    def Testall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> bool:
        return cls.testall(requests, statuses)[0]

    @classmethod
    def testall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> tuple[bool, list[Any] | None]:
        reqs = cls._adopt(requests)
        if not all([req._poll() for req in reqs]):  # a list: progress every one each time
            return False, None
        return True, cls._report_all(reqs, statuses)

    @classmethod
    def Waitany(cls, requests: Sequence[Request | MPI.Request],
                status: MPI.Status | None = None) -> int:
        return cls.waitany(requests, status)[0]

    @classmethod
    def waitany(cls, requests: Sequence[Request | MPI.Request],
                status: MPI.Status | None = None) -> tuple[int, Any]:
        """(index, value) of a completed request; (``MPI.UNDEFINED``, None) if none is active."""
        reqs = cls._adopt(requests)
        active = [i for i, req in enumerate(reqs) if req]
        if not active:
            if status is not None:
                fill(status, *EMPTY)
            return MPI.UNDEFINED, None
        found: list[int] = []

        def any_done() -> bool:
            found.extend(i for i in active if reqs[i]._poll())
            return bool(found)

        reqs[active[0]]._wrapper()._progress_until(any_done, None)
        return found[0], reqs[found[0]]._report(status)


class RoutedRequest(Request):
    """A request of a Comm with peers off its node: a cma or an MPI request inside, or
    (on a mixed rank) a receive still waiting behind a wildcard to be posted in either."""

    __slots__ = ("_comm", "_creq", "_mreq", "_object", "_peer", "_state", "_buf", "_source",
                 "_tag", "_record", "_error", "_value")
    _comm: Comm
    _creq: CmaRequest | None  # at most one of the two is set; neither while pending
    _mreq: MPI.Request | None
    _object: bool
    _peer: int  # cma rank of the on-node peer whose exit dooms this request, or -1
    _state: int
    # a receive waiting behind a wildcard (Comm._advance) keeps what it will be posted with
    _buf: Any
    _source: int
    _tag: int
    # set on completion, handed over by _report
    _record: tuple[int, int, int]
    _error: BaseException | None
    _value: Any

    def __init__(self, comm: Comm, creq: CmaRequest | None, mreq: MPI.Request | None,
                 is_object: bool, peer: int = -1) -> None:
        self._comm = comm
        self._creq = creq
        self._mreq = mreq
        self._object = is_object
        self._peer = peer
        self._state = ACTIVE

    def _wrapper(self) -> Comm:
        return self._comm

    # -- completion, kept until reported (so that Testall completes all or none)

    def _done_cma(self, cs: CmaStatus, error: CmaError | None, value: Any) -> None:
        self._state = COMPLETE
        self._creq = None
        self._record = (self._comm._ranks[cs.source], cs.tag, cs.count) if cs.source >= 0 else EMPTY
        self._error = error
        self._value = value

    def _done_mpi(self, st: MPI.Status, error: MPI.Exception | None, value: Any) -> None:
        self._state = COMPLETE
        self._mreq = None
        self._record = (st.Get_source(), st.Get_tag(), st.Get_elements(BYTE))
        self._error = error
        self._value = value

    def _poll(self) -> bool:
        """Progress this request's engine once; True when complete."""
        if self._state:
            return True
        if self._creq is None and self._mreq is None:  # waiting to be matched
            self._comm._advance()
        creq = self._creq
        if creq is not None:
            cs = self._comm._cstatus
            cs.source = CMA_ANY_SOURCE  # stays so for sends: cma fills only receive statuses
            value = None
            try:
                if self._object:
                    done, value = creq.test(cs)
                else:
                    done = creq.Test(cs)
            except CmaError as exc:
                self._done_cma(cs, exc, None)
                return True
            if done:
                self._done_cma(cs, None, value)
            return done
        mreq = self._mreq
        if mreq is None:
            return False
        st = MPI.Status()
        try:
            if self._object:
                done, value = mreq.test(st)
            else:
                done, value = mreq.Test(st), None
        except MPI.Exception as exc:
            self._done_mpi(st, exc, None)
            return True
        if done:
            self._done_mpi(st, None, value)
        return done

    def _complete(self) -> None:
        """Block until complete: inside its engine, or polling both engines on a mixed rank."""
        if self._state:
            return
        comm = self._comm
        creq, mreq = self._creq, self._mreq
        if comm._mixed or (creq is None and mreq is None):
            comm._progress_until(self._poll, self._peer)
        elif creq is not None:
            cs = comm._cstatus
            cs.source = CMA_ANY_SOURCE
            try:
                value = creq.wait(cs) if self._object else creq.Wait(cs)
            except CmaError as exc:
                self._done_cma(cs, exc, None)
                return
            self._done_cma(cs, None, value)
        elif mreq is not None:
            st = MPI.Status()
            try:
                value = mreq.wait(st) if self._object else mreq.Wait(st)
            except MPI.Exception as exc:
                self._done_mpi(st, exc, None)
                return
            self._done_mpi(st, None, value)

    def _report(self, status: MPI.Status | None) -> Any:
        """Fill ``status``, raise a failure, hand over the value; the request becomes inactive."""
        if self._state != COMPLETE:
            if status is not None:
                fill(status, *EMPTY)
            return None
        self._state = INACTIVE
        error, value = self._error, self._value
        self._error = self._value = None
        if status is not None:
            fill(status, *self._record)
        if error is not None:
            self._comm._fail(error, status)
        return value

    def _outcome(self) -> tuple[int, int, int]:
        return self._record if self._state == COMPLETE else EMPTY

    def __bool__(self) -> bool:
        """False once completed and reported, as ``MPI.REQUEST_NULL`` is."""
        return self._state != INACTIVE

    def __repr__(self) -> str:
        where = "cma" if self._creq is not None else "MPI" if self._mreq is not None else "pending"
        return f"<cma.mpi.Request {where} {('active', 'complete', 'inactive')[self._state]}>"


class _Finished:
    """The op of a NodeRequest once reported, or once waiting for it failed (PeerGone)."""

    __slots__ = ("error",)
    done = True

    def __init__(self, error: CmaError | None) -> None:
        self.error = error


_REPORTED = _Finished(None)


# (a cma request whose methods take MPI.Status where cma's take cma.Status: hence the ignore)
class NodeRequest(Request, CmaRequest):  # type: ignore[misc]
    """cma's own request, as a Comm whose peers are all on its node hands it out.

    One object per message instead of two: the node is the whole communicator, so cma's
    ranks are the wrapped communicator's and only statuses, errors and inactivity need
    mpi4py's behaviour, all of it here.
    """

    __slots__ = ()
    _comm: NodeComm
    _op: SendOp | RecvOp | _Finished | None  # type: ignore[assignment]

    def _wrapper(self) -> Comm:
        return self._comm._mpi

    def _poll(self) -> bool:
        op = self._op
        if op is None or op.done:
            return True
        try:
            self._comm._progress()
        except CmaError as exc:
            self._op = _Finished(exc)
            return True
        return op.done

    def _complete(self) -> None:
        op = self._op
        if op is not None and not op.done:
            try:
                self._comm._wait(op)  # type: ignore[arg-type]
            except CmaError as exc:
                self._op = _Finished(exc)

    def _outcome(self) -> tuple[int, int, int]:
        op = self._op
        if isinstance(op, RecvOp):
            return op.matched_source, op.matched_tag, op.nbytes
        return EMPTY

    def _report(self, status: MPI.Status | None) -> Any:
        op = self._op
        error: BaseException | None = None
        value = None
        if isinstance(op, RecvOp):
            error, op.error = op.error, None
            if error is None and self._object:
                value = self._result()  # cma's: the object received
        elif isinstance(op, _Finished):
            error = op.error
        if status is not None:
            fill(status, *self._outcome())
        self._op = _REPORTED
        if error is not None:
            self._comm._mpi._fail(error, status)
        return value

    def __bool__(self) -> bool:
        """False once completed and reported, as ``MPI.REQUEST_NULL`` is."""
        return self._op is not _REPORTED

    def __repr__(self) -> str:
        op = self._op
        state = "inactive" if op is _REPORTED else "complete" if op is None or op.done else "active"
        return f"<cma.mpi.Request cma {state}>"


def inactive(comm: Comm) -> RoutedRequest:
    req = RoutedRequest(comm, None, None, False)
    req._state = INACTIVE
    return req



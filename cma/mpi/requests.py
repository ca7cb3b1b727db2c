"""Requests of cma.mpi.Comm: MPI generalized requests that cma completes.

Every request the wrapper hands out is a real ``MPI.Request``, so every mpi4py function
that takes requests takes it: ``MPI.Request.Waitall`` and the rest, ``MPI.Prequest``'s
lists, libraries that keep requests in arrays. Which object a call returns:

* a send that completed as it was made (eager, or to ``PROC_NULL``), and a receive from
  ``PROC_NULL``: MPI's own request of the same operation towards ``PROC_NULL`` (one C
  call, ~0.25 us; MPI reports it complete with the status it gives such operations);
* anything else on-node: ``Request``, a subclass of ``MPI.Grequest`` carrying the cma
  operation. cma completes it (``MPI_Grequest_complete``) when the operation is done,
  and its query callback gives MPI the status (source, tag, count, cancelled, error).
  Its own ``Wait``/``Test`` wait inside cma (spinning, then sleeping on the doorbell)
  and hand the finished request to MPI; MPI's functions (``MPI.Request.Waitall``...)
  wait inside MPI, whose progress loop calls cma through a hook (``libmpi``);
* off-node operations: MPI's own requests, untouched.

Starting a generalized request costs ~1.4 us in MPICH (docs/mpi.md has the figures):
that, not the copy, is what a window of small non-blocking messages pays over plain MPI.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from mpi4py import MPI

from ..errors import CmaError, TruncationError
from ..protocol import RecvOp, SendOp
from ..wire import PROC_NULL as CMA_PROC_NULL
from .interrupts import DEFERRED
from .libmpi import HOOK_CALLBACKS, ProgressHook, make_hook
from .mpiapi import EMPTY, fill, mpi_irecv, mpi_isend

if TYPE_CHECKING:
    from .node import NodeComm

NULL_SPEC = [None, 0, MPI.BYTE]  # the empty message of a PROC_NULL stand-in

_start = MPI.Grequest.Start
_mpi_wait = MPI.Request.Wait
_mpi_test = MPI.Request.Test
_mpi_wait_obj = MPI.Request.wait
_mpi_test_obj = MPI.Request.test
_mpi_get_status = MPI.Request.Get_status
_mpi_cancel = MPI.Request.Cancel
_complete = MPI.Grequest.Complete
_complete_obj = MPI.Grequest.complete


def mpi_exception(error: BaseException) -> MPI.Exception:
    """The MPI error a failed cma operation reports inside MPI's own calls."""
    if isinstance(error, MPI.Exception):
        return error
    if isinstance(error, TruncationError):
        return MPI.Exception(MPI.ERR_TRUNCATE)
    return MPI.Exception(MPI.ERR_OTHER)


class Request(MPI.Grequest):
    """An on-node operation of a ``cma.mpi.Comm``: an MPI generalized request.

    ``Wait``, ``Test``, ``wait``, ``test``, ``Get_status`` and ``Cancel`` work inside cma
    and then let MPI retire the request; anything else (``MPI.Request.Waitall``,
    ``Free``, ``py2f``...) is MPI's own and works on it as on any request.
    """

    __slots__ = ("_node", "_op", "_also", "_object", "_over", "_failure", "_cancelled",
                 "_outcome", "_spec")
    _node: NodeComm
    _op: SendOp | RecvOp | None  # None: not yet posted (a wildcard waiting, mixed ranks)
    _also: SendOp | None  # Isendrecv: the send it also waits for
    _object: bool
    _over: bool  # MPI was told it is complete
    _failure: BaseException | None  # what waiting for it raised (e.g. the peer died)
    _cancelled: bool
    # set when a mixed rank's wildcard receive took an off-node message: its status
    _outcome: tuple[int, int, int] | None
    # a wildcard receive waiting to be posted (mixed ranks): buffer, source, tag
    _spec: tuple[Any, int, int] | None

    # -- what MPI asks

    def _status(self) -> tuple[int, int, int]:
        """(source, tag, bytes) as the wrapped communicator numbers ranks."""
        op = self._op
        if isinstance(op, RecvOp):
            if op.matched_source >= 0:
                return self._node.comm_rank(op.matched_source), op.matched_tag, op.nbytes
            if op.matched_source == CMA_PROC_NULL and op.done:
                return MPI.PROC_NULL, MPI.ANY_TAG, 0
        return self._outcome or EMPTY

    def _done_in_cma(self) -> bool:
        """Whether cma has finished with it (its operations done, or failed)."""
        op, also = self._op, self._also
        return self._failure is not None or op is not None and op.done \
            and (also is None or also.done)

    def _error(self) -> BaseException | None:
        op = self._op
        if isinstance(op, RecvOp) and op.error is not None:
            return op.error
        return self._failure

    # -- completion

    def _finish(self) -> None:
        """The operation is over: tell MPI (an object receive hands MPI the object)."""
        if self._over:
            return
        self._over = True
        op = self._op
        if isinstance(op, RecvOp) and op.view and not self._object and op.error is None \
                and op.matched_source >= 0:  # (recv_view: MPI hands out the view)
            _complete_obj(self, self._node.load_view(op))
            return
        if self._object and isinstance(op, RecvOp) and op.error is None and op.matched_source >= 0:
            try:
                value = self._node.load_object(op)
            except Exception as exc:  # a stream that does not unpickle fails this receive
                self._failure = exc
            else:
                _complete_obj(self, value)
                return
        _complete(self)

    def _fail(self, exc: BaseException) -> None:
        """Waiting for the operation failed (its peer died): complete it with the failure."""
        if self._over:
            return
        if self._op is not None:
            self._node._pending.pop(self._op, None)
        self._failure = exc
        self._over = True
        _complete(self)

    def _finish_elsewhere(self, outcome: tuple[int, int, int], value: Any) -> None:
        """A mixed rank's wildcard receive took an off-node message, received by MPI."""
        self._outcome = outcome
        self._over = True
        if self._object:
            _complete_obj(self, value)
        else:
            _complete(self)

    def _settle(self) -> BaseException | None:
        """Wait inside cma until the operation is over; the error to report, taken from it."""
        if not self._done_in_cma():
            try:
                self._node.settle(self)
            except CmaError as exc:
                self._fail(exc)
        error = self._error()
        if error is not None:  # reported by the caller, with more than MPI's error code
            self._failure = None
            if isinstance(self._op, RecvOp):
                self._op.error = None
        return error

    def _test_in_cma(self) -> bool:
        """Move cma once (as MPI_Test moves MPI); whether the operation is over."""
        if self._done_in_cma():
            return True
        try:
            self._node.step(self)
        except CmaError as exc:
            self._fail(exc)
            return True
        return self._done_in_cma()

    def _raise(self, error: BaseException, status: MPI.Status | None) -> None:
        self._node._mpi._fail(error, status)

    # -- mpi4py's API, done inside cma first

    def Wait(self, status: MPI.Status | None = None) -> Literal[True]:
        """mpi4py's ``Request.Wait``: waits inside cma (spin, then sleep on the doorbell), then MPI retires
        the request. Raises ``TruncateError``/``PeerGoneError`` with the details MPI's code lacks."""
        if self:
            error = self._settle()
            _mpi_wait(self, status)
            if error is not None:
                self._raise(error, status)
            return True
        return _mpi_wait(self, status)

    def wait(self, status: MPI.Status | None = None) -> Any:
        """mpi4py's ``Request.wait``: ``Wait``, then the received object (or ``None``)."""
        if self:
            error = self._settle()
            value = _mpi_wait_obj(self, status)
            if error is not None:
                self._raise(error, status)
            return value
        return _mpi_wait_obj(self, status)

    def Test(self, status: MPI.Status | None = None) -> bool:
        """mpi4py's ``Request.Test``: one step of cma's progress; if the operation is over, ``Wait``."""
        if self and not self._test_in_cma():
            return False
        return self.Wait(status)

    def test(self, status: MPI.Status | None = None) -> tuple[bool, Any]:
        """mpi4py's ``Request.test``: ``Test``, returning ``(done, object or None)``."""
        if self and not self._test_in_cma():
            return False, None
        return True, self.wait(status)

    def Get_status(self, status: MPI.Status | None = None) -> bool:
        """Whether it has completed, without completing it (``status`` filled if so)."""
        if self and not self._test_in_cma():
            return False
        return _mpi_get_status(self, status)

    get_status = Get_status

    def Cancel(self) -> None:
        """A receive not matched yet is withdrawn and completes as cancelled; a send is not
        cancelled (MPI 4.1 deprecates cancelling sends)."""
        if self and not self._over and self._node.cancel(self):
            self._cancelled = True
            if self._op is not None:
                self._node._pending.pop(self._op, None)
            self._over = True
            _complete(self)
        _mpi_cancel(self)

    # -- many requests: cma's own wait where every request is one node's, else MPI's

    @staticmethod
    def _ours(requests: Sequence[MPI.Request]) -> list[Request]:
        return [r for r in requests if isinstance(r, Request) and r]

    @classmethod
    def _one_node(cls, requests: Sequence[MPI.Request]) -> list[Request] | None:
        """Our active requests, if they are all the active ones and of one communicator
        (then cma alone can wait for them); else None, after making sure MPI's wait can
        (each posted, the hook armed)."""
        ours = cls._ours(requests)
        if ours and len(ours) == sum(1 for r in requests if r) \
                and all(req._node is ours[0]._node for req in ours):
            return ours
        for req in ours:
            req._node.post_waiting(req)
        return None

    @classmethod
    def _settle_all(cls, requests: Sequence[MPI.Request]) -> None:
        """Before MPI waits for all of them: settled inside cma where only cma is waited
        for (else MPI waits, its progress running cma's)."""
        ours = cls._one_node(requests)
        for req in ours or ():
            req._node.settle(req)

    @classmethod
    def _settle_any(cls, requests: Sequence[MPI.Request]) -> None:
        ours = cls._one_node(requests)
        if ours:
            ours[0]._node.settle_any(ours)

    # mpi4py's many-request calls below share their two lines (prepare in cma, then MPI's
    # own call): written out, not generated, so each keeps mpi4py's signature for mypy and help().
    @classmethod
    def Waitall(cls, requests: Sequence[MPI.Request],
                statuses: list[MPI.Status] | None = None) -> Literal[True]:
        """mpi4py's ``Request.Waitall``: cma waits if every active request is one node's, then MPI (else
        MPI waits for all, its progress hook moving cma)."""
        cls._settle_all(requests)
        return MPI.Request.Waitall(requests, statuses)

    @classmethod
    def waitall(cls, requests: Sequence[MPI.Request],
                statuses: list[MPI.Status] | None = None) -> list[Any]:
        """mpi4py's ``Request.waitall``, waited for as ``Waitall``: the received objects."""
        cls._settle_all(requests)
        return MPI.Request.waitall(requests, statuses)

    @classmethod
    def Waitany(cls, requests: Sequence[MPI.Request],
                status: MPI.Status | None = None) -> int:
        """mpi4py's ``Request.Waitany``: cma waits for one if every active request is one node's, then MPI
        picks (else MPI waits, its progress hook moving cma)."""
        cls._settle_any(requests)
        return MPI.Request.Waitany(requests, status)

    @classmethod
    def waitany(cls, requests: Sequence[MPI.Request],
                status: MPI.Status | None = None) -> tuple[int, Any]:
        """mpi4py's ``Request.waitany``, waited for as ``Waitany``: ``(index, object)``."""
        cls._settle_any(requests)
        return MPI.Request.waitany(requests, status)

    @classmethod
    def Waitsome(cls, requests: Sequence[MPI.Request],
                 statuses: list[MPI.Status] | None = None) -> list[int] | None:
        """mpi4py's ``Request.Waitsome``, waited for as ``Waitany``: the indices completed."""
        cls._settle_any(requests)
        return MPI.Request.Waitsome(requests, statuses)

    @classmethod
    def waitsome(cls, requests: Sequence[MPI.Request],
                 statuses: list[MPI.Status] | None = None
                 ) -> tuple[list[int] | None, list[Any] | None]:
        """mpi4py's ``Request.waitsome``, waited for as ``Waitany``: indices and objects."""
        cls._settle_any(requests)
        return MPI.Request.waitsome(requests, statuses)

    @classmethod
    def _step_all(cls, requests: Sequence[MPI.Request]) -> None:
        for req in cls._ours(requests):
            req._test_in_cma()

    # (the test family: two lines each as above, written out for the same reason)
    @classmethod
    def Testall(cls, requests: Sequence[MPI.Request],
                statuses: list[MPI.Status] | None = None) -> bool:
        """mpi4py's ``Request.Testall``, after one step of cma's progress for each of cma's requests."""
        cls._step_all(requests)
        return MPI.Request.Testall(requests, statuses)

    @classmethod
    def testall(cls, requests: Sequence[MPI.Request],
                statuses: list[MPI.Status] | None = None) -> tuple[bool, list[Any] | None]:
        """mpi4py's ``Request.testall``, after one step of cma's progress for each of cma's requests."""
        cls._step_all(requests)
        return MPI.Request.testall(requests, statuses)

    @classmethod
    def Testany(cls, requests: Sequence[MPI.Request],
                status: MPI.Status | None = None) -> tuple[int, bool]:
        """mpi4py's ``Request.Testany``, after one step of cma's progress for each of cma's requests."""
        cls._step_all(requests)
        return MPI.Request.Testany(requests, status)

    @classmethod
    def testany(cls, requests: Sequence[MPI.Request],
                status: MPI.Status | None = None) -> tuple[int, bool, Any | None]:
        """mpi4py's ``Request.testany``, after one step of cma's progress for each of cma's requests."""
        cls._step_all(requests)
        return MPI.Request.testany(requests, status)

    @classmethod
    def Testsome(cls, requests: Sequence[MPI.Request],
                 statuses: list[MPI.Status] | None = None) -> list[int] | None:
        """mpi4py's ``Request.Testsome``, after one step of cma's progress for each of cma's requests."""
        cls._step_all(requests)
        return MPI.Request.Testsome(requests, statuses)

    @classmethod
    def testsome(cls, requests: Sequence[MPI.Request],
                 statuses: list[MPI.Status] | None = None
                 ) -> tuple[list[int] | None, list[Any] | None]:
        """mpi4py's ``Request.testsome``, after one step of cma's progress for each of cma's requests."""
        cls._step_all(requests)
        return MPI.Request.testsome(requests, statuses)


def _query(status: MPI.Status, box: list[Request]) -> None:
    """MPI asks for the status of a completed request (in Wait, Waitall, Get_status...)."""
    req = box[0]
    fill(status, *req._status())
    if req._cancelled:
        status.Set_cancelled(True)
    error = req._error()
    if error is not None:
        # MPI keeps only the error code; mpi4py prints what the callback raised, so the
        # cause (which rank and pid exited, say) is still shown
        exc = mpi_exception(error)
        raise exc from (None if exc is error else error)


def _cancel(completed: bool, box: list[Request]) -> None:
    """MPI_Cancel's callback: Request.Cancel did the work. Given, so that mpi4py keeps
    the cancelled flag the query sets (it clears it for requests without one)."""


def start_request(node: NodeComm, op: SendOp | RecvOp | None, is_object: bool,
                  spec: tuple[Any, int, int] | None = None, also: SendOp | None = None
                  ) -> Request:
    """A generalized request for ``op`` (and ``also``), complete at once if they are done."""
    box: list[Request] = []
    req = Request(_start(_query, None, _cancel, (box,)))
    box.append(req)
    req._node = node
    req._op = op
    req._also = also
    req._object = is_object
    req._over = False
    req._failure = None
    req._cancelled = False
    req._outcome = None
    req._spec = spec
    if op is not None:
        if req._done_in_cma():
            req._finish()
        else:
            node.await_op(op if not op.done else also, req)  # type: ignore[arg-type]
    return req


def node_request(node: NodeComm, op: SendOp | RecvOp | None, is_object: bool = False,
                 also: SendOp | None = None) -> MPI.Request:
    """What a node communicator's non-blocking call returns (see the module's docstring)."""
    if also is not None and not also.done:
        return start_request(node, op, is_object, also=also)
    if op is None or op.__class__ is SendOp and op.done:
        return mpi_isend(node._mpi, NULL_SPEC, MPI.PROC_NULL)
    if op.done and isinstance(op, RecvOp) and op.matched_source == CMA_PROC_NULL:
        return mpi_irecv(node._mpi, NULL_SPEC, MPI.PROC_NULL)
    return start_request(node, op, is_object)


# ------------------------------------------------------------------ the hook

class ServedNodes:
    """The one progress hook of this process and the node communicators it serves (not
    cma's ``Progress``: this is what MPI's own waits call into).

    A communicator waits in the set while it has requests that MPI may be waiting for;
    a rank with peers on its node and elsewhere stays for its lifetime (its peers may
    need its progress while it waits in MPI for an off-node message).
    """

    def __init__(self) -> None:
        self._nodes: dict[NodeComm, None] = {}  # ordered, unlike a set
        # every one not closed, kept (as MPI keeps a communicator until it is freed: one
        # dropped without Free must still tell its peers at exit that it reads no more)
        self._live: dict[NodeComm, None] = {}
        self._hook: ProgressHook | None = None
        self._made = False

    def _poll(self) -> bool:
        for node in list(self._nodes):
            if not node.poll_requests():
                del self._nodes[node]
        return bool(self._nodes)

    def serve(self, node: NodeComm) -> None:
        """Have MPI's progress loop move ``node``'s requests from now on (the hook made, armed)."""
        if node not in self._nodes:
            self._nodes[node] = None
        if not self._made:
            self._make()
        if self._hook is not None:
            self._hook.arm()

    def track(self, node: NodeComm) -> None:
        """Keep ``node`` until it is dropped (closed): at exit it delivers what it queued."""
        self._live[node] = None

    def drop(self, node: NodeComm) -> None:
        """Stop moving ``node`` from MPI's progress loop (with none left, the hook rests),
        and forget it (closed)."""
        self._live.pop(node, None)
        self._nodes.pop(node, None)
        if not self._nodes and self._hook is not None:
            self._hook.rest()

    def active(self, request: MPI.Request) -> bool:
        """Whether a persistent request is started and not complete (see ProgressHook)."""
        assert self._hook is not None
        return self._hook.active(request)

    @property
    def available(self) -> bool:
        """Whether MPI's own wait functions can wait for cma's requests here."""
        if not self._made:
            self._make()
        return self._hook is not None

    def _make(self) -> None:
        self._made = True
        self._hook = make_hook(self._poll)
        if self._hook is not None:  # (a Ctrl-C in a callback from MPI: raised once MPI returns)
            DEFERRED.install(*HOOK_CALLBACKS, _query, _cancel)
        # (registered after the hook's close, so run before it: atexit runs last in first out)
        atexit.register(self.finish_sends)

    def finish_sends(self) -> None:
        """At exit, before mpi4py's MPI_Finalize: every communicator not closed tells its
        peers that this rank reads no more, then delivers what it queued behind full
        rings and the buffered sends its peers are to pull. Those sends were complete to
        MPI, and a peer waiting for them waited for ever once this rank left
        (tests/mpi_programs/queued.py, "exit"). The first step lets a peer that exits
        too stop waiting to deliver what this rank will never receive, on any of their
        communicators, so two exiting ranks do not wait for each other."""
        nodes = list(self._live)
        for node in nodes:
            node.reads_no_more()
        failed: list[CmaError] = []
        for node in nodes:
            try:
                node.finish_sends()
            except CmaError as exc:  # (the others still deliver theirs)
                failed.append(exc)
        if failed:
            raise failed[0]

    def raise_pending(self) -> None:
        """Raise what the callback caught (it may not unwind into the MPI library)."""
        hook = self._hook
        if hook is not None and hook.error is not None:
            error, hook.error = hook.error, None
            raise error


SERVED = ServedNodes()

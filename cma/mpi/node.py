"""The cma communicator of a node's ranks, speaking mpi4py where its fast paths end."""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from mpi4py import MPI

from ..comm import Comm as CmaComm
from ..comm import Request as CmaRequest
from ..comm import Status as CmaStatus
from ..comm import recv_view, send_view
from ..errors import CmaError
from ..progress import Progress, claim
from ..protocol import RecvOp, SendOp
from ..wire import ANY_SOURCE, ANY_TAG
from ..world import World
from . import specs
from .datatypes import Typed
from .mpiapi import fill
from .persistent import Prequest, persistent_request
from .requests import SERVED, Request, node_request
from .specs import NO_BYTES

if TYPE_CHECKING:
    from .comm import Comm
    from .mixedio import MixedRank

# How often a request that MPI waits for (inside MPI's progress loop, where cma never
# sleeps on its doorbell) checks whether its peer is still alive: as often as a sleeping
# cma wait wakes (progress.SLEEP_MS), so a death is noticed as soon (docs/mpi.md).
PEER_CHECK_SECONDS = 0.01
# How long a mixed rank's wildcard receive waits inside MPI before the hook warns: long
# beside any message's latency, short beside a hang someone is watching; chosen.
DEFERRED_WARNING_SECONDS = 2.0


class NodeComm(CmaComm):
    """The cma communicator of this node's ranks, speaking mpi4py where the hot paths end.

    When every rank is on this node, its ranks are the wrapped communicator's and
    ``Comm`` hands out its point-to-point methods as its own (``HANDED_OUT``): a
    message then costs no wrapper frame. So buffer specs are converted, statuses
    filled, errors raised and requests made as mpi4py's here, on the paths the eager
    fast paths fall back to. The requests are MPI's (``requests.node_request``); the
    ones cma completes wait in ``_pending`` for their operation.
    """

    make_request = staticmethod(node_request)  # type: ignore[assignment]

    def __init__(self, mpi: Comm, *args: Any, ranks: Sequence[int],
                 world: World | None = None, oversubscribed: bool | None = None,
                 **options: Any) -> None:
        """``world``: this rank's World, made before attaching (node rank 0's, whose fd
        server handed the world to the others); attach makes one otherwise.
        ``oversubscribed``: this node's ranks outnumber the CPUs the machine's ranks may
        run on."""
        super().__init__(*args, **options)
        self._world = world
        self._oversubscribed = oversubscribed
        self._mpi = mpi  # the wrapper: its _fail runs the error handler, raises its exception
        SERVED.track(self)
        self._ranks = list(ranks)  # cma rank -> rank of the wrapped communicator
        # peers elsewhere too: waits must keep MPI moving (set by cma.mpi.Comm, which
        # makes it; None on any other rank)
        self._mixed: MixedRank | None = None
        self._mpi_scratch = CmaStatus()
        self._pending: dict[SendOp | RecvOp, Request] = {}
        # persistent requests, by tag (MPI.Request defines == but no hash): weakly, so
        # that one dropped without Free stops being watched
        self._persistent: dict[int, weakref.ref[Prequest]] = {}
        self._private: MPI.Intracomm | None = None  # where persistent requests live in MPI
        self._next_peer_check = 0.0
        self._deferred_since = 0.0  # (mixed ranks) when the hook first saw a waiting wildcard
        self._warned = False
        # the last spec list sent with a datatype with gaps, and its Typed: packed anew
        # each call, converted once (its receive twin is kept in cma.Comm's spec cache)
        self._typed_spec: list[Any] = []
        self._typed: Typed | None = None

    def objects_from(self, ranks: Sequence[int], root: int) -> list[Any]:
        """At the ``root`` of a gather or reduce: the objects ``ranks`` alone send it
        through cma (``object_to``), in that order: cma.mpi's routing sends their large
        objects so, the rest through MPI (routing.ObjectWindow)."""
        self._coll_start(root)
        return [self._coll_recv_object(rank) for rank in ranks]

    def object_to(self, obj: Any, root: int) -> None:
        """Send ``obj`` to ``root``, which takes it with ``objects_from``."""
        self._coll_start(root)
        self._coll_wait(self._coll_send(None, root, obj))

    def packets_queued(self) -> None:
        """Hook (``cma.Comm.packets_queued``): MPI's progress hook sends them if this rank
        next waits inside MPI."""
        self._keep_moving()

    def waits_alone(self) -> bool:
        """Hook (``cma.Comm.waits_alone``): not on a mixed rank, whose waits keep MPI moving."""
        return self._mixed is None

    def comm_rank(self, rank: int) -> int:
        """The wrapped MPI communicator's rank of cma rank ``rank``."""
        return self._ranks[rank]

    # -- buffer specs, statuses and errors as mpi4py's

    def buffer_view(self, buf: Any, convert: Callable[[Any], memoryview]) -> memoryview:
        """Hook (``cma.Comm.buffer_view``): also mpi4py's tuple specs, ``None`` (no bytes) and a datatype
        with gaps, which stands in for the view as a ``Typed``."""
        typed = self._typed
        if typed is not None and buf.__class__ is list and buf and buf[0] is typed.owner \
                and buf == self._typed_spec and convert is send_view:
            return self._outgoing(typed)
        if buf.__class__ is tuple:  # (lists are cma's to convert and remember, as specs)
            # (spec_view's result is convert's already, or a Typed standing in for the view:
            # converted again, a tuple spec cost 1.15 us against 0.64 for its bytes alone)
            if self._progress is None:
                self._attach()
            return cast(memoryview, self.spec_view(buf, convert))
        elif buf is None:  # mpi4py's message of nothing (towards PROC_NULL, say)
            buf = NO_BYTES
        return super().buffer_view(buf, convert)

    def spec_view(self, spec: Sequence[Any], convert: Callable[[Any], memoryview]) -> Any:
        """mpi4py's buffer specs: [buf, count, MPI.BYTE], [buf, (count, displ), dt] & co.

        A datatype with gaps gives a ``Typed`` buffer in place of a view: a receive
        scatters into it; a send packs it, or above the eager limit offers its blocks as
        one iovec when they are few and large (datatypes.py says why).
        """
        found = specs.convert(spec)
        if found.__class__ is not Typed:
            return convert(found)
        if convert is recv_view:
            if found.readonly:
                raise BufferError("receive buffer is read-only: pass a bytearray or a writable array")
            return found
        if spec.__class__ is list and found.kept:
            self._typed_spec, self._typed = list(spec), found
        return self._outgoing(found)

    def _outgoing(self, typed: Typed) -> Any:
        """What a send of ``typed`` moves: its blocks as one iovec when it is a rendezvous
        of few, large blocks; otherwise a packed copy."""
        if typed.nbytes > self._eager_limit and typed.plan.few_large_blocks():
            return typed
        return typed.pack()

    def remember_spec(self, spec: list[Any], mv: memoryview, sending: bool) -> None:
        """Hook (``cma.Comm.remember_spec``): a receive's ``Typed`` is kept as a view would be."""
        if mv.__class__ is Typed:  # a receive's: kept as a view would be (sends: _typed)
            if not sending and mv.kept:
                self._recv_base, self._recv_spec = spec[0], list(spec)
                self._recv_spec_view, self._recv_cut = mv, None
            return
        super().remember_spec(spec, mv, sending)

    def load_object(self, op: RecvOp) -> Any:
        """An object receive that matched a buffer message loads it as mpi4py does: zero
        bytes are None, anything else is unpickled."""
        if op.is_object:
            return super().load_object(op)
        data = op.segments[0] if op.segments else b""
        return MPI.pickle.loads(data) if len(data) else None

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Any = None) -> None:
        """``cma.Comm.Sendrecv``, whose checks of the receive's arguments raise mpi4py's
        errors here (the calls it makes raise them already).

        A spec over a buffer other than the last one (a fresh row, as in a halo exchange)
        that names it whole is passed on as that buffer: converting and remembering the
        spec cost ~2 us a call more than the row (docs/mpi.md, "Use")."""
        if sendbuf.__class__ is list:
            sendbuf = _fresh_whole(sendbuf, self._send_base, self._send_obj)
        if recvbuf.__class__ is list:
            recvbuf = _fresh_whole(recvbuf, self._recv_base, self._recv_obj)
        try:
            super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        except CmaError as exc:
            self._mpi._fail(exc, None if status is None or status.__class__ is CmaStatus
                            else status)

    def general_send(self, mv: memoryview, dest: Any, tag: Any, started: SendOp | None = None
                     ) -> None:
        """Hook (``cma.Comm.general_send``): cma's errors raised as mpi4py's; keeps MPI's hook armed."""
        try:
            super().general_send(mv, dest, tag, started)
        except CmaError as exc:
            self._mpi._fail(exc)
        self._keep_moving()

    def general_recv(self, mv: memoryview, source: Any, tag: Any, status: Any) -> None:
        """Hook (``cma.Comm.general_recv``): fills an ``MPI.Status``, raises mpi4py's errors."""
        mpi_status = None if status is None or status.__class__ is CmaStatus else status
        scratch = self._mpi_scratch if mpi_status is not None else status
        try:
            super().general_recv(mv, source, tag, scratch)
        except CmaError as exc:
            self._mpi._fail(exc, mpi_status)
        self._keep_moving()
        if mpi_status is not None:
            fill(mpi_status, scratch.source, scratch.tag, scratch.count)

    def start_send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool,
                    eager: bool = True, sync: bool = False, pull_first: bool = False) -> SendOp:
        """Hook (``cma.Comm.start_send``): a ``Typed``'s blocks go as one iovec; keeps MPI's hook armed."""
        if segments and segments[0].__class__ is Typed:  # a datatype's blocks, as one iovec
            segments = segments[0].views()
        op = super().start_send(segments, dest, tag, is_object, eager, sync, pull_first)
        self._keep_moving()  # (an eager send completes once its packet is queued)
        return op

    def start_buffered_send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool
                        ) -> None:
        """Hook (``cma.Comm.start_buffered_send``): a ``Typed`` is packed first; keeps MPI's hook armed."""
        if segments and segments[0].__class__ is Typed:
            segments = [segments[0].pack()]
        super().start_buffered_send(segments, dest, tag, is_object)
        self._keep_moving()

    def general_isend(self, mv: memoryview, dest: Any, tag: Any) -> CmaRequest:
        """Hook (``cma.Comm.general_isend``): cma's errors raised as mpi4py's."""
        try:
            return super().general_isend(mv, dest, tag)  # (start_send keeps MPI moving)
        except CmaError as exc:
            self._mpi._fail(exc)

    def general_irecv(self, mv: memoryview, source: Any, tag: Any) -> CmaRequest:
        """Hook (``cma.Comm.general_irecv``): cma's errors raised as mpi4py's; keeps MPI's hook armed."""
        try:
            req = super().general_irecv(mv, source, tag)
        except CmaError as exc:
            self._mpi._fail(exc)
        self._keep_moving()
        return req

    def _keep_moving(self) -> None:
        """Keep MPI's progress hook armed while anything is in flight: a peer may wait for
        it while this rank waits in MPI's own calls (osu_bibw hung so: its eager sends
        completed into the queue, and the sender went on into MPI_Barrier)."""
        progress = self._progress
        if progress is not None and progress.in_flight():
            SERVED.serve(self)

    # -- the requests cma completes

    def operation_completed(self, op: SendOp | RecvOp) -> None:
        """Hook (``cma.Comm.operation_completed``): scatter a ``Typed`` receive, complete the MPI request
        waiting for ``op`` (an ``Isendrecv``'s once its send is done too)."""
        super().operation_completed(op)
        if op.__class__ is RecvOp and op.buffer.__class__ is Typed:
            op.buffer.finish()
        if self._pending:
            req = self._pending.pop(op, None)
            if req is not None:
                also = req._also
                if also is not None and not also.done:
                    self._pending[also] = req  # (Isendrecv) its send is still going
                else:
                    req._finish()

    def await_op(self, op: SendOp | RecvOp, req: Request) -> None:
        """``req`` completes when ``op`` does, whoever waits for it (cma or MPI)."""
        self._pending[op] = req
        SERVED.serve(self)

    def bind(self, req: Request, peer: int, tag: int) -> None:
        """Post the receive of a request made before it (a mixed rank's wildcard)."""
        assert req._spec is not None
        buf = req._spec[0]
        req._spec = None
        mv = None if req._object else self.buffer_view(buf, recv_view)
        op = (self._progress or self._attach()).post_recv(peer, tag, mv)
        req._op = op
        if op.done:
            req._finish()
        else:
            self.await_op(op, req)

    def settle(self, req: Request) -> None:
        """Wait inside cma (and MPI, on a mixed rank) until ``req``'s operation is over."""
        mixed = self._mixed
        if mixed is not None:  # (every request not posted yet, a wildcard's, is a mixed rank's)
            mixed.settle(req)
            return
        progress = self._progress or self._attach()
        for op in (req._op, req._also):
            if op is not None and not op.done:
                progress.wait(op)
        self._keep_moving()

    def settle_any(self, reqs: list[Request]) -> None:
        """Wait until one of ``reqs`` (all this communicator's) is over."""
        mixed = self._mixed
        if mixed is not None:
            mixed.progress_until(lambda: any(r._test_in_cma() for r in reqs), None)
            return
        (self._progress or self._attach()).wait_until(
            lambda: any(r._done_in_cma() for r in reqs), None)
        self._keep_moving()

    def step(self, req: Request) -> None:
        """Move everything once (``req`` is one of ours that is not over)."""
        mixed = self._mixed
        if mixed is not None:
            mixed.step()
        else:
            self.progress()

    def post_waiting(self, req: Request) -> None:
        """MPI is about to wait for ``req``: it must be posted and the hook armed."""
        if req._op is None:  # (a mixed rank's wildcard)
            assert self._mixed is not None
            self._mixed.settle(req, posted_only=True)
        SERVED.serve(self)

    def cancel(self, req: Request) -> bool:
        """Withdraw a receive nothing has matched yet; whether it was withdrawn."""
        op = req._op
        if op is None:  # (a mixed rank's wildcard)
            assert self._mixed is not None
            return self._mixed.withdraw(req)
        posted = self._matcher.posted
        if isinstance(op, RecvOp) and not op.done and op in posted:
            posted.remove(op)
            op.done = True
            return True
        return False

    def poll_requests(self) -> bool:
        """The hook's call from inside MPI: move cma, notice dead peers, start and finish
        persistent requests; whether to stay."""
        if self._closed or not self._needs_hook():
            # (nothing of ours is waiting: packets taken from the rings now would be
            # queued unexpected, and the receives that come for them would pay for that)
            return False
        self.progress()
        mixed = self._mixed
        if mixed is not None:
            if mixed.wildcards:
                mixed.match_wildcards(probe_mpi=False)
                self._warn_deferred()
            else:
                self._deferred_since = 0.0
        if self._pending:
            now = time.monotonic()
            if now >= self._next_peer_check:
                self._next_peer_check = now + PEER_CHECK_SECONDS
                self._check_peers()
        for tag, ref in list(self._persistent.items()):
            preq = ref()
            if preq is None:
                del self._persistent[tag]
            else:
                preq.poll()
        return self._needs_hook()

    def _needs_hook(self) -> bool:
        """Whether MPI's progress loop must move this communicator: requests of ours pending,
        persistent ones, data peers wait for, or peers off this node (see RequestSet)."""
        progress = self._progress
        return self._mixed is not None or bool(self._pending) or bool(self._persistent) or \
            progress is not None and progress.in_flight()

    def _warn_deferred(self) -> None:
        """Say once why a wait inside MPI may never end: a wildcard receive on a rank with
        peers on and off its node can take an off-node message only inside cma.mpi's own
        calls (probing MPI from MPI's progress loop is not allowed)."""
        now = time.monotonic()
        if not self._deferred_since:
            self._deferred_since = now
        elif now - self._deferred_since > DEFERRED_WARNING_SECONDS and not self._warned:
            self._warned = True
            warnings.warn(
                "cma.mpi: an ANY_SOURCE receive on a rank with peers on its node and elsewhere "
                "has waited for seconds inside MPI's own wait; off-node messages reach it only "
                "inside cma.mpi's calls: wait with req.Wait() or cma.mpi.Request.Waitall/Waitany "
                "(docs/mpi.md, 'Mixed ranks')", RuntimeWarning, stacklevel=1)

    # -- persistent requests

    def private_comm(self) -> MPI.Intracomm:
        """The duplicate of ``COMM_SELF`` where persistent requests' MPI halves live (made once)."""
        if self._private is None:
            self._private = MPI.COMM_SELF.Dup()
        return self._private

    def send_init(self, buf: Any, dest: int, tag: int, mode: str) -> Prequest:
        """A persistent send (mode: "standard", "sync" or "buffered") of a bound buffer."""
        bound = self.buffer_view(buf, send_view)
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        repack = specs.has_gaps(buf)  # packed at each start: the buffer changes in between

        def view() -> memoryview:
            return self.buffer_view(buf, send_view) if repack else bound

        if mode == "buffered":
            def begin() -> SendOp | RecvOp | None:
                self.start_buffered_send([view()], dest, tag, False)
                return None
        else:
            def begin() -> SendOp | RecvOp | None:
                return self.start_send([view()], dest, tag, False, sync=mode == "sync")
        return persistent_request(self, begin)

    def recv_init(self, buf: Any, source: int, tag: int) -> Prequest:
        """A persistent receive into a bound buffer (``MPI.Comm.Recv_init``) from cma rank ``source``."""
        mv = self.buffer_view(buf, recv_view)
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)

        def begin() -> SendOp | RecvOp | None:
            return (self._progress or self._attach()).post_recv(source, tag, mv)
        return persistent_request(self, begin)

    def watch(self, preq: Prequest) -> None:
        """Have MPI's progress hook start and finish ``preq`` (MPI's ``Startall`` must be noticed there)."""
        self._persistent[preq._tag] = weakref.ref(preq)
        SERVED.serve(self)  # MPI's Startall must be noticed inside MPI's waits

    def forget(self, preq: Prequest) -> None:
        """Stop watching ``preq`` (freed)."""
        self._persistent.pop(preq._tag, None)

    def settle_op(self, op: SendOp | RecvOp) -> None:
        """Wait until ``op`` is done (in both engines on a mixed rank)."""
        mixed = self._mixed
        if mixed is not None:
            peer = op.dest if isinstance(op, SendOp) else op.source
            mixed.progress_until(lambda: op.done, peer if peer >= 0 else None)
        else:
            (self._progress or self._attach()).wait(op)

    def step_all(self) -> None:
        """Move everything once: cma's progress (and MPI's, on a mixed rank)."""
        mixed = self._mixed
        if mixed is not None:
            mixed.step()
        else:
            self.progress()

    def _check_peers(self) -> None:
        """Fail the pending requests that wait for a peer that has exited (Progress decides)."""
        progress = self._progress
        assert progress is not None
        progress.notice_exits()
        if not progress.dead:
            return
        for op, req in list(self._pending.items()):
            error = progress.exit_error(op.dest if isinstance(op, SendOp) else op.source)
            if error is not None:
                req._fail(error)

    def finish_sends(self) -> None:
        """Wait until the packets queued behind full rings are in their peers' rings, and
        buffered sends received (unless the peer exited or reads no more): MPI_Finalize
        completes the sends MPI called complete, and this queue dies with the process (run
        at exit, before mpi4py's MPI_Finalize: ``ServedNodes.finish_sends``)."""
        progress = self._exiting_progress()
        if progress is None or not (progress.txq_pending or progress.buffered):
            return
        held = claim(self)
        try:
            progress.deliver_queued()
        finally:
            self._busy = held

    def reads_no_more(self) -> None:
        """At exit: tell the peers that this rank reads its rings no more, so that what
        they queued for it is moot (``Progress.deliver_queued`` stops waiting for it)."""
        progress = self._exiting_progress()
        if progress is not None:
            progress.world.mark_closed()

    def _exiting_progress(self) -> Progress | None:
        """What the steps at exit work on: the progress of a communicator attached, open,
        whole, and attached by this process (a forked child's exit is not this rank's)."""
        progress = self._progress
        if progress is None or self._closed or progress.broken or not progress.world.owned_here():
            return None
        return progress

    def close(self) -> None:
        """Close the world; requests still pending fail (nothing will complete them)."""
        SERVED.drop(self)
        self._persistent.clear()
        if self._private is not None:
            self._private.Free()
            self._private = None
        for req in list(self._pending.values()):
            req._fail(CmaError("the communicator was freed before this operation completed"))
        self._pending.clear()
        super().close()


def _fresh_whole(spec: list[Any], spec_base: Any, last: Any) -> Any:
    """The buffer ``spec`` names whole if it is none that cma remembered last (by spec or
    as itself), else ``spec``: the remembered ones take the cached paths."""
    if spec and spec[0] is not spec_base and spec[0] is not last \
            and specs.convert(spec) is spec[0]:
        return spec[0]
    return spec

"""cma.mpi.Comm: an mpi4py ``Intracomm`` whose on-node point-to-point goes through cma."""

from __future__ import annotations

import inspect
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, NoReturn

import numpy as np
from mpi4py import MPI

from ..collectives import OPS, Op
from ..comm import AUTO, NOT_TAKEN
from ..comm import Comm as CmaComm
from ..comm import Message as CmaMessage
from ..comm import Status as CmaStatus
from ..errors import CmaError, InvalidRank, InvalidTag, PeerGone, TruncationError
from ..protocol import ANY_SOURCE as CMA_ANY_SOURCE
from ..transports.xmap import View
from ..wire import PROC_NULL as CMA_PROC_NULL
from .bootstrap import BARRIER_CMA, BARRIER_MPI, BARRIER_NONBLOCKING, ENV_DISABLE, bootstrap, env_flag
from .errors import PeerGoneError, TruncateError
from .hierarchy import HIERARCHICAL, Hierarchy
from .mixedio import MixedRank
from .mpiapi import (
    ANY_SOURCE,
    ANY_TAG,
    SAME_WILDCARDS,
    fill,
    mpi_barrier,
    mpi_dup,
    mpi_free,
    mpi_ibarrier,
    mpi_improbe,
    mpi_improbe_obj,
    mpi_iprobe,
    mpi_irecv,
    mpi_irecv_obj,
    mpi_isend,
    mpi_isend_obj,
    mpi_isendrecv,
    mpi_isendrecv_replace,
    mpi_mprobe,
    mpi_mprobe_obj,
    mpi_probe,
    mpi_recv,
    mpi_recv_obj,
    mpi_send,
    mpi_send_obj,
    mpi_sendrecv,
    mpi_sendrecv_obj,
)
from .node import NodeComm
from .requests import SERVED
from .routing import (
    ENV_COLLECTIVES,
    LOCK_TABLE,
    MPI_OWN_DATATYPES,
    ObjectWindow,
    Route,
    env_mode_text,
    method,
    mode_of,
    routes,
)
from .specs import Unpacker, as_bytes, as_packed, snapshot

# methods an all-on-node Comm takes from its cma communicator (those its class does not
# override; Sendrecv only if it overrides none)
HANDED_OUT = ("Send", "Recv", "Isend", "Irecv", "Sendrecv")


class Comm(MPI.Intracomm):
    """An mpi4py ``Intracomm`` whose point-to-point with on-node peers goes through cma.

    ``Comm(MPI.COMM_WORLD)`` is collective over the wrapped communicator. ``transport``
    and ``options`` are those of ``cma.Comm`` ("auto" picks per message). Ranks, tags,
    statuses, requests and errors are mpi4py's; docs/mpi.md says what differs.
    """

    # __dict__: when every rank is on this node, an instance's HANDED_OUT methods are its
    # cma communicator's own bound methods (see NodeComm), found before the class's.
    __slots__ = ("_cma", "_cma_send", "_cma_recv", "_fast", "_local", "_ranks", "_mixed",
                 "_cstatus", "_barrier", "_transport", "_options", "_levels", "_routes",
                 "__dict__")
    _cma: NodeComm | None
    _cma_send: Callable[..., None]  # bound methods of _cma: one lookup less per message
    _cma_recv: Callable[..., None]
    # rank of the wrapped comm -> cma rank, for the blocking fast paths: empty on a mixed
    # rank (which must not block in cma); holds ANY_SOURCE when every peer is on-node
    _fast: dict[int, int]
    _local: dict[int, int]  # rank of the wrapped comm -> cma rank, for this node's ranks
    _ranks: list[int]  # cma rank -> rank of the wrapped comm
    # this rank has peers on this node and on others: its waits in both engines and its
    # wildcard receives (None on any other rank, whose paths never look further)
    _mixed: MixedRank | None
    _cstatus: CmaStatus  # reused: one thread uses a communicator at a time
    _barrier: int
    _transport: str
    _options: dict[str, Any]
    _levels: Hierarchy | None  # ranks on several nodes: made by the first collective that needs it
    # every rank on this node: the collectives MPI runs at some sizes (routing.routes)
    _routes: dict[str, Route]

    def __new__(cls, comm: MPI.Intracomm | None = None, transport: str = AUTO,
                **options: Any) -> Comm:
        self = super().__new__(cls, comm)
        # mpi4py's Dup and Clone build instances of this class without __init__: such a
        # bare instance sends everything through MPI (and Dup then wraps it properly).
        self._cma = None
        self._fast = {}
        self._local = {}
        self._ranks = []
        self._mixed = None
        self._cstatus = CmaStatus()
        self._barrier = BARRIER_MPI
        self._transport = transport
        self._options = options
        self._levels = None
        self._routes = {}
        return self

    def __init__(self, comm: MPI.Intracomm, transport: str = AUTO, **options: Any) -> None:
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"cma.mpi.Comm wraps an mpi4py Intracomm, got {comm!r}")
        # (every rank reads the same settings, or every rank raises)
        settings = MPI.Intracomm.allgather(self, (env_flag(ENV_DISABLE), env_mode_text()))
        if any(disable for disable, _ in settings):
            return
        modes = {mode_of(text) for _, text in settings}
        if len(modes) > 1:
            raise ValueError(f"the ranks set {ENV_COLLECTIVES} differently: "
                             f"{sorted({text for _, text in settings})}")
        if not SERVED.available:
            raise CmaError(
                f"cma.mpi needs a progress hook into the MPI library, known for MPICH and "
                f"Open MPI; this is {MPI.Get_library_version().splitlines()[0]!r} "
                f"(set {ENV_DISABLE}=1 to send everything through MPI)")
        self._cma, members, oversubscribed, self._barrier = bootstrap(self, transport, options)
        cma = self._cma
        if cma is None:
            return
        self._cma_send = cma.Send
        self._cma_recv = cma.Recv
        self._ranks = [rank for rank, _ in members]
        self._local = {rank: i for i, rank in enumerate(self._ranks)}
        if len(members) < self.Get_size():
            self._mixed = cma._mixed = MixedRank(self, cma, self._local, self._ranks,
                                                 oversubscribed)
            SERVED.serve(cma)  # MPI's waits keep this node's rings moving from now on
        else:
            self._fast = {**self._local, ANY_SOURCE: CMA_ANY_SOURCE}
            self._routes = routes(modes.pop(), len(members), ON_NODE_COLLECTIVES)
            # routed collectives as methods of this instance (a subclass's own stay): MPI's
            # own where MPI runs every size, else one frame; bound to this wrapper, so that
            # one kept past Free raises as MPI's on a freed communicator does (the instance
            # and its cma communicator hold each other already: no new cycle)
            for name, route in self._routes.items():
                if getattr(type(self), name) is getattr(Comm, name):
                    self.__dict__[name] = method(route, getattr(MPI.Intracomm, name).__get__(self),
                                                 _ON_NODE[name].__get__(self), self)
            kept = [name for name in HANDED_OUT if getattr(type(self), name) is not getattr(Comm, name)]
            for name in HANDED_OUT if SAME_WILDCARDS else ():
                # (the wrapper's Sendrecv calls Isend and Recv, which a subclass may change)
                if name not in kept and not (name == "Sendrecv" and kept):
                    self.__dict__[name] = getattr(cma, name)

    # -- what the wrapper adds

    @property
    def cma(self) -> CmaComm | None:
        """The cma communicator of this node's ranks (``stats()``, ``transports()``), if any."""
        return self._cma

    @property
    def node_ranks(self) -> list[int]:
        """Ranks of the wrapped communicator that this rank reaches through cma."""
        return list(self._ranks)

    def __repr__(self) -> str:
        if self._cma is None:
            return f"<cma.mpi.Comm rank {self.Get_rank()} of {self.Get_size()}, MPI only>"
        return (f"<cma.mpi.Comm rank {self.Get_rank()} of {self.Get_size()}, cma "
                f"({self._cma.transport}) to ranks {self._ranks}, MPI to the rest>")

    def _objects_from(self, ranks: Sequence[int], root: int) -> list[Any]:
        """``NodeComm.objects_from`` (the large objects of a gather or reduce,
        routing.ObjectWindow), its errors raised as mpi4py's."""
        objects: list[Any] = self._moving_objects(NodeComm.objects_from, ranks, root)
        return objects

    def _object_to(self, obj: Any, root: int) -> None:
        """``NodeComm.object_to``, its errors raised as mpi4py's."""
        self._moving_objects(NodeComm.object_to, obj, root)

    def _moving_objects(self, move: Callable[..., Any], *args: Any) -> Any:
        node = self._cma
        assert node is not None
        try:
            result = move(node, *args)
            node._keep_moving()  # (as after a collective: a FIN owed moves while in MPI)
            return result
        except CmaError as exc:
            self._fail(exc)

    # -- errors

    def _fail(self, exc: BaseException, status: MPI.Status | None = None) -> NoReturn:
        """Raise a cma error as mpi4py would, after the communicator's error handler ran
        (any other exception as it is)."""
        error: MPI.Exception
        if isinstance(exc, TruncationError):
            source = self._ranks[exc.source]
            error = TruncateError(
                f"message of {exc.nbytes} bytes from rank {source} (tag {exc.tag}) does not fit "
                f"the {exc.capacity}-byte receive buffer; it was consumed",
                source=source, tag=exc.tag, nbytes=exc.nbytes, capacity=exc.capacity)
            if status is not None:
                fill(status, source, exc.tag, 0)
        elif isinstance(exc, PeerGone):
            error = PeerGoneError(f"{exc} (cma ranks 0, 1, ... are ranks {self._ranks})")
        elif isinstance(exc, InvalidTag):
            error = MPI.Exception(MPI.ERR_TAG)
        elif isinstance(exc, InvalidRank):
            error = MPI.Exception(MPI.ERR_RANK)
        else:
            raise exc
        if status is not None:
            status.Set_error(error.Get_error_code())
        self.Call_errhandler(error.Get_error_code())
        raise error from exc

    # -- blocking buffer point-to-point

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """mpi4py's ``Send``: through cma to a rank on this node, through MPI to the others.

        Raises mpi4py's errors (``TruncateError``, ``PeerGoneError`` are
        ``MPI.Exception``s)."""
        peer = self._fast.get(dest)
        if peer is None:
            if dest in self._local:  # a mixed rank: wait in both engines
                self.Isend(buf, dest, tag).Wait()
            else:
                mpi_send(self, buf, dest, tag)  # (a mixed rank's hook keeps cma moving)
            return
        self._cma_send(buf, peer, tag)  # NodeComm converts specs, raises mpi4py's errors

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: MPI.Status | None = None) -> None:
        """mpi4py's ``Recv``: through cma from a rank on this node, through MPI from the others.

        ``ANY_SOURCE`` on a mixed rank probes both and receives the message found
        (docs/mpi.md)."""
        peer = self._fast.get(source)
        if peer is None:
            mixed = self._mixed
            if mixed is not None and mixed.waits_in_cma(source, tag):
                _wait_or_withdraw(self._irecv(buf, source, tag, False), status)
            else:
                mpi_recv(self, buf, source, tag, status)
            return
        self._cma_recv(buf, peer, tag, status)  # and fills an MPI.Status

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: MPI.Status | None = None) -> None:
        """mpi4py's ``Sendrecv``: the cma communicator's when both ranks are on this node's
        fast paths, else ``Isend``, ``Recv``, then wait for the send, each routed per peer.

        A source or receive tag MPI would refuse is refused before anything is sent."""
        cma = self._cma
        if cma is None:
            mpi_sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
            return
        fast = self._fast
        peer, origin = fast.get(dest), fast.get(source)
        if peer is not None and origin is not None:
            cma.Sendrecv(sendbuf, peer, sendtag, recvbuf, origin, recvtag, status)
            return
        # (posting the receive first instead, and withdrawing it when the send is refused,
        # lost a message: MPI's progress inside the refused Isend matched it first)
        if not _whole(source, lambda r: r in (ANY_SOURCE, MPI.PROC_NULL) or 0 <= r < self.Get_size()):
            self._fail(InvalidRank(f"source rank {source!r} is not in 0..{self.Get_size() - 1}"
                                   " (or ANY_SOURCE, PROC_NULL)"))
        if not _whole(recvtag, lambda t: t >= 0 or t == ANY_TAG):
            self._fail(InvalidTag(f"receive tag {recvtag!r} must be an int >= 0 or ANY_TAG"))
        send = self.Isend(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)
        send.Wait()

    def Sendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
                         recvtag: int = ANY_TAG, status: MPI.Status | None = None) -> None:
        """mpi4py's ``Sendrecv_replace``: a copy of ``buf`` is sent, the reply received into it."""
        if self._cma is None:
            MPI.Intracomm.Sendrecv_replace(self, buf, dest, sendtag, source, recvtag, status)
            return
        outgoing = snapshot(buf)
        self.Sendrecv(outgoing, dest, sendtag, buf, source, recvtag, status)

    # Ready mode may be implemented as standard mode (MPI-4.1, section 3.4).
    def Rsend(self, buf: Any, dest: int, tag: int = 0) -> None:
        """mpi4py's ``Rsend``: ready mode as standard mode (``Send``), as MPI-4.1 section 3.4 allows."""
        self.Send(buf, dest, tag)

    # -- non-blocking buffer point-to-point

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        """mpi4py's ``Isend``: through cma to a rank on this node, through MPI to the others.

        An on-node request is MPI's (a generalized request, or MPI's own when complete at
        once)."""
        peer = self._local.get(dest)
        if peer is None:
            return mpi_isend(self, buf, dest, tag)
        return self._cma.Isend(buf, peer, tag)  # type: ignore[union-attr,return-value]

    def Irsend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        """mpi4py's ``Irsend``: ready mode as standard mode (``Isend``)."""
        return self.Isend(buf, dest, tag)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> MPI.Request:
        """mpi4py's ``Irecv``: through cma from a rank on this node, through MPI from the others.

        An on-node request is an MPI generalized request (``cma.mpi.Request``)."""
        return self._irecv(buf, source, tag, False)

    def Isendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                  source: int = ANY_SOURCE, recvtag: int = ANY_TAG) -> MPI.Request:
        """mpi4py's ``Isendrecv``: through cma when both peers are on this node, else through MPI."""
        peer, origin = self._local.get(dest), self._fast.get(source)
        if self._cma is None or (peer is None and dest != MPI.PROC_NULL) or (
                origin is None and source != MPI.PROC_NULL):
            return mpi_isendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag)
        try:
            return self._cma.Isendrecv(  # type: ignore[return-value]
                sendbuf, CMA_PROC_NULL if peer is None else peer, sendtag, recvbuf,
                CMA_PROC_NULL if origin is None else origin, recvtag)
        except CmaError as exc:
            self._fail(exc)

    def Isendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
                          recvtag: int = ANY_TAG) -> MPI.Request:
        """mpi4py's ``Isendrecv_replace``: ``Isendrecv`` of a copy of ``buf`` into ``buf``."""
        if self._cma is None:
            return mpi_isendrecv_replace(self, buf, dest, sendtag, source, recvtag)
        outgoing = snapshot(buf)
        return self.Isendrecv(outgoing, dest, sendtag, buf, source, recvtag)

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> MPI.Prequest:
        """mpi4py's ``Recv_init``: a ``cma.mpi.Prequest`` from a rank on this node, MPI's from others.

        ``ANY_SOURCE`` on a mixed rank raises ``NotImplementedError``."""
        peer = self._fast.get(source)
        if peer is None and (self._mixed is not None and source == ANY_SOURCE
                             or source not in self._local):
            if self._mixed is not None and source == ANY_SOURCE:
                raise NotImplementedError(
                    "cma.mpi.Comm.Recv_init(ANY_SOURCE) on a rank with peers on its node and "
                    "elsewhere: not available (post an Irecv for each start instead)")
            return MPI.Intracomm.Recv_init(self, buf, source, tag)
        try:
            return self._cma.recv_init(  # type: ignore[union-attr]
                buf, self._local[source] if peer is None else peer, tag)
        except CmaError as exc:
            self._fail(exc)

    # -- matched probes (four one-line calls differing only in helper and object flag: an
    # alias cannot pass the flag, and each keeps mpi4py's signature)

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: MPI.Status | None = None) -> MPI.Message | None:
        """mpi4py's ``Improbe``: the matched message (a ``cma.mpi.Message`` on-node), or ``None``."""
        return self._improbe(source, tag, status, False)

    def Mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: MPI.Status | None = None) -> MPI.Message:
        """mpi4py's ``Mprobe``: ``Improbe`` that waits for a message."""
        return self._mprobe(source, tag, status, False)

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: MPI.Status | None = None) -> MPI.Message | None:
        """mpi4py's ``improbe``: ``Improbe`` of an object message (receive it with ``recv``)."""
        return self._improbe(source, tag, status, True)

    def mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: MPI.Status | None = None) -> MPI.Message:
        """mpi4py's ``mprobe``: ``Mprobe`` of an object message (receive it with ``recv``)."""
        return self._mprobe(source, tag, status, True)

    def _mprobe(self, source: int, tag: int, status: MPI.Status | None, is_object: bool
                ) -> MPI.Message:
        mixed = self._mixed
        if mixed is None and source not in self._fast:
            return (mpi_mprobe_obj if is_object else mpi_mprobe)(self, source, tag, status)
        found: list[MPI.Message] = []

        def probe() -> bool:
            message = self._improbe(source, tag, status, is_object)
            if message is not None:
                found.append(message)
            return message is not None

        if mixed is not None:
            mixed.progress_until(probe, self._local.get(source))
        else:
            cma = self._cma
            assert cma is not None
            try:
                cma.Probe(self._fast[source], tag)
            except CmaError as exc:
                self._fail(exc)
            probe()
        return found[0]

    def _improbe(self, source: int, tag: int, status: MPI.Status | None, is_object: bool
                 ) -> MPI.Message | None:
        cma = self._cma
        mixed = self._mixed
        if mixed is not None:
            st = MPI.Status()
            if not mixed.iprobe(source, tag, st):
                return None
            source, tag = st.Get_source(), st.Get_tag()  # exactly that message
        peer = self._fast.get(source) if mixed is None else self._local.get(source)
        if peer is None or cma is None:
            return (mpi_improbe_obj if is_object else mpi_improbe)(self, source, tag, status)
        cs = self._cstatus
        try:
            message = cma.Improbe(peer, tag, cs)
        except CmaError as exc:
            self._fail(exc)
        if message is None:
            return None
        if status is not None:
            fill(status, self._ranks[cs.source], cs.tag, cs.count)
        return Message.of(message)

    # -- objects (on-node: pickle protocol 5, large buffers out of band through cma)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """mpi4py's ``send`` of an object: through cma to a rank on this node, through MPI to the others."""
        peer = self._fast.get(dest)
        if peer is None:
            if dest in self._local:
                self.isend(obj, dest, tag).Wait()
            else:
                mpi_send_obj(self, obj, dest, tag)
            return
        try:
            self._cma.send(obj, peer, tag)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: MPI.Status | None = None, views: bool = False) -> Any:
        """mpi4py's ``recv`` of an object: through cma from a rank on this node, MPI from the others.

        On-node any size; off-node mpi4py's own, whose default buffer is bounded.
        ``views=True`` (xmap on): arrays of an on-node sender's shared heap arrive as
        read-only views of its memory (``cma.Comm.recv``); any other object, as usual."""
        peer = self._fast.get(source)
        if peer is not None and not views:
            try:
                obj = self._cma.take_object(peer, tag, status)  # type: ignore[union-attr,arg-type]
            except CmaError as exc:
                self._fail(exc, status)
            if obj is not NOT_TAKEN:
                return obj
        if peer is not None or self._mixed is not None and self._mixed.waits_in_cma(source, tag):
            return _wait_or_withdraw(self._irecv(buf, source, tag, True, views), status, True)
        return mpi_recv_obj(self, buf, source, tag, status)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> MPI.Request:
        """mpi4py's ``isend`` of an object: through cma to a rank on this node, MPI to the others."""
        peer = self._local.get(dest)
        if peer is None:
            return mpi_isend_obj(self, obj, dest, tag)
        try:
            return self._cma.isend(obj, peer, tag)  # type: ignore[union-attr,return-value]
        except CmaError as exc:
            self._fail(exc)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              views: bool = False) -> MPI.Request:
        """On-node: any size. Off-node: mpi4py's irecv, bounded unless ``buf`` is given.
        ``views``: as ``recv``'s."""
        return self._irecv(buf, source, tag, True, views)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: MPI.Status | None = None) -> Any:
        """mpi4py's ``sendrecv``: ``isend``, ``recv``, then wait for the send; the received object."""
        if self._cma is None:
            return mpi_sendrecv_obj(self, sendobj, dest, sendtag, recvbuf, source, recvtag,
                                    status)
        send = self.isend(sendobj, dest, sendtag)
        obj = self.recv(recvbuf, source, recvtag, status)
        send.Wait()
        return obj

    # -- views (xmap: a node communicator made with CMA_XMAP=1)

    def recv_view(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                  status: MPI.Status | None = None) -> Any:
        """``cma.Comm.recv_view``: from a rank on this node, the sender's heap memory itself
        where xmap is on; from any other (or a wildcard over ranks of both kinds), the
        message received into a new array, as a read-only ``cma.View``."""
        peer = self._fast.get(source)
        if peer is not None and self._cma is not None:
            try:
                if status is None:  # (the direct rendezvous's view; it fills cma's Status only)
                    return self._cma.recv_view(peer, tag)
                return self._cma.Irecv_view(peer, tag).wait(status)  # type: ignore[arg-type]  # (a node request: MPI's Status)
            except CmaError as exc:
                self._fail(exc)
        probed = MPI.Status()
        self.Probe(source, tag, probed)
        buf = np.empty(probed.Get_count(MPI.BYTE), np.uint8)
        self.Recv(buf, probed.Get_source(), probed.Get_tag(), status)
        buf.flags.writeable = False
        return buf.view(View)

    # -- probes

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: MPI.Status | None = None) -> bool:
        """mpi4py's ``Iprobe``: cma's rings for a rank on this node, MPI for the others.

        A mixed rank's ``ANY_SOURCE`` probes cma, then MPI; a message that a receive posted
        earlier will take is not reported."""
        mixed = self._mixed
        if mixed is not None:
            return mixed.iprobe(source, tag, status)
        peer = self._fast.get(source)
        if peer is None:
            return mpi_iprobe(self, source, tag, status)
        return self._iprobe_cma(peer, tag, status)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              status: MPI.Status | None = None) -> Literal[True]:
        """mpi4py's ``Probe``: waits until ``Iprobe`` would return True (a mixed rank polls both)."""
        mixed = self._mixed
        if mixed is not None:
            mixed.progress_until(lambda: mixed.iprobe(source, tag, status), self._local.get(source))
            return True
        peer = self._fast.get(source)
        if peer is None:
            return mpi_probe(self, source, tag, status)
        cs = self._cstatus
        try:
            self._cma.Probe(peer, tag, cs)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)
        if status is not None:
            fill(status, self._ranks[cs.source], cs.tag, cs.count)
        return True

    iprobe = Iprobe
    probe = Probe

    # -- synchronisation

    def Barrier(self) -> None:
        """cma's barrier on one node, else MPI's; either keeps pending cma transfers moving."""
        if self._barrier == BARRIER_CMA:
            try:
                self._cma.Barrier()  # type: ignore[union-attr]
            except CmaError as exc:
                self._fail(exc)
        elif self._barrier == BARRIER_NONBLOCKING:
            request = mpi_ibarrier(self)
            mixed = self._mixed  # (cma peers and a barrier across nodes: a mixed rank)
            if mixed is None:
                request.Wait()
            else:
                mixed.progress_until(request.Test, None)
        else:
            mpi_barrier(self)

    barrier = Barrier

    # -- collectives: cma's (cma/collectives.py) when every rank is on this node; with
    # ranks on several nodes, HIERARCHICAL ones through cma on each node and MPI between;
    # set below from ON_NODE_COLLECTIVES

    def _hierarchy(self) -> Hierarchy:
        if self._levels is None:  # (collective: every rank is in the same collective call)
            self._levels = Hierarchy(self, self._cma, self._ranks)
        return self._levels

    # -- communicators made from this one

    def Dup(self, info: MPI.Info | None = None) -> Comm:
        """A new cma.mpi.Comm (collective), with its own node worlds and this one's transport."""
        dup = mpi_dup(self) if info is None else mpi_dup(self, info)
        return type(self)(dup, self._transport, **self._options)

    def Clone(self) -> Comm:
        """mpi4py's ``Clone``: ``Dup()``, a new ``cma.mpi.Comm`` with cma worlds of its own."""
        return self.Dup()

    def Free(self) -> None:
        """Close this rank's cma world, then free the MPI communicator."""
        if self._levels is not None:
            self._levels.free()
            self._levels = None
        if self._cma is not None:
            self._cma.close()
            self._cma = None
        self._fast = {}
        self._local = {}
        self._mixed = None
        for name in (*HANDED_OUT, *self._routes):
            self.__dict__.pop(name, None)
        self._routes = {}
        self._barrier = BARRIER_MPI
        mpi_free(self)

    # -- internals: the cma half

    def _iprobe_cma(self, peer: int, tag: int, status: MPI.Status | None) -> bool:
        cs = self._cstatus
        try:
            found = self._cma.Iprobe(peer, tag, cs)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)
        if found and status is not None:
            fill(status, self._ranks[cs.source], cs.tag, cs.count)
        return found

    def _irecv(self, buf: Any, source: int, tag: int, is_object: bool,
               views: bool = False) -> MPI.Request:
        peer = self._fast.get(source)
        if peer is None:
            mixed = self._mixed
            if mixed is not None and mixed.wildcards.must_wait(source, tag):
                return mixed.irecv_wildcard(buf, source, tag, is_object)
            peer = self._local.get(source)
            if peer is None:
                return mpi_irecv_obj(self, buf, source, tag) if is_object \
                    else mpi_irecv(self, buf, source, tag)
        cma = self._cma
        assert cma is not None
        try:
            return cma.irecv(None, peer, tag, views=views) if is_object \
                else cma.Irecv(buf, peer, tag)  # type: ignore[return-value]
        except CmaError as exc:
            self._fail(exc)


def _whole(value: Any, valid: Callable[[int], bool]) -> bool:
    """Whether ``value`` is an integer (a NumPy one too, as mpi4py takes) that ``valid`` accepts."""
    try:
        return valid(operator.index(value))
    except TypeError:
        return False


class Message(MPI.Message):
    """A message a matched probe took from an on-node peer: receive it once.

    An ``MPI.Message`` whose receives go through cma; ``MPI.Message``'s class methods
    (``MPI.Message.Probe(comm, ...)``) probe MPI's own channel and never find it.
    """

    __slots__ = ("_message",)
    _message: CmaMessage

    @classmethod
    def of(cls, message: CmaMessage) -> Message:
        """Wrap a cma ``Message`` (what a node communicator's matched probe returned)."""
        wrapped = cls()
        wrapped._message = message
        return wrapped

    def __bool__(self) -> bool:
        return bool(self._message)

    def Irecv(self, buf: Any) -> MPI.Request:
        """mpi4py's ``Message.Irecv``: receive the message into ``buf`` through cma; only once."""
        return self._message.Irecv(buf)  # type: ignore[return-value]  # a node request

    def Recv(self, buf: Any, status: MPI.Status | None = None) -> None:
        """mpi4py's ``Message.Recv``: receive the message into ``buf`` through cma; only once."""
        self.Irecv(buf).Wait(status)

    def irecv(self) -> MPI.Request:
        """mpi4py's ``Message.irecv``: receive the object message through cma; only once."""
        return self._message.irecv()  # type: ignore[return-value]

    def recv(self, status: MPI.Status | None = None) -> Any:
        """mpi4py's ``Message.recv``: receive the object message through cma; only once."""
        return self.irecv().wait(status)


def _wait_or_withdraw(request: MPI.Request, status: MPI.Status | None,
                      is_object: bool = False) -> Any:
    """Wait for the receive a blocking call made; if the wait raises (a Ctrl-C), withdraw
    it unless something matched it already, so that it cannot take a later message into
    the buffer its caller gave up (cma.Comm's blocking receives do the same)."""
    try:
        return request.wait(status) if is_object else request.Wait(status)
    except BaseException:
        if request:  # (a wait that raised the receive's own error has retired it)
            request.Cancel()
        raise


def _send_mode(name: str) -> Callable[..., Any]:
    """mpi4py's ``name`` (Ssend, Bsend and their kin): through cma to on-node peers."""
    method = getattr(MPI.Intracomm, name)

    def call(self: Comm, buf: Any, dest: int, tag: int = 0) -> Any:
        peer = self._local.get(dest)
        if peer is None:
            return method(self, buf, dest, tag)
        try:
            return getattr(self._cma, name)(buf, peer, tag)
        except CmaError as exc:
            self._fail(exc)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"mpi4py's {name}: through cma to on-node peers, through MPI to the others."
    return call


for _name in ("Ssend", "Issend", "ssend", "issend", "Bsend", "Ibsend", "bsend", "ibsend"):
    setattr(Comm, _name, _send_mode(_name))


def _send_init(name: str, mode: str) -> Callable[..., Any]:
    """mpi4py's persistent send ``name``: a cma persistent request to on-node peers."""
    method = getattr(MPI.Intracomm, name)

    def call(self: Comm, buf: Any, dest: int, tag: int = 0) -> MPI.Prequest:
        peer = self._local.get(dest)
        if peer is None:
            return method(self, buf, dest, tag)
        try:
            return self._cma.send_init(buf, peer, tag, mode)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"mpi4py's {name}: through cma to on-node peers, through MPI to the others."
    return call


for _name, _mode in (("Send_init", "standard"), ("Rsend_init", "standard"),
                     ("Ssend_init", "sync"), ("Bsend_init", "buffered")):
    setattr(Comm, _name, _send_init(_name, _mode))


def _refuse_on_node(name: str, peers: Sequence[tuple[int, str, int]]) -> Callable[..., Any]:
    """An mpi4py method this wrapper cannot route through cma: MPI for off-node peers only.

    ``peers`` lists (position, keyword, default) of the rank arguments. Sent to an
    on-node peer through MPI, the message would miss a receive posted on cma, so refuse.
    """
    method = getattr(MPI.Intracomm, name)

    def call(self: Comm, *args: Any, **kwargs: Any) -> Any:
        for position, keyword, default in peers:
            rank = args[position] if len(args) > position else kwargs.get(keyword, default)
            if rank in self._local or (rank == ANY_SOURCE and self._cma is not None):
                raise NotImplementedError(
                    f"cma.mpi.Comm.{name} with on-node rank {rank}: not available through cma "
                    "(use Send/Isend/Recv/Irecv/probes, or CMA_MPI_DISABLE=1)")
        return method(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"mpi4py's {name} for off-node peers; NotImplementedError for on-node ones."
    return call


_REFUSED = {
    "Psend_init": [(2, "dest", MPI.PROC_NULL)], "Precv_init": [(2, "source", ANY_SOURCE)],
}
for _name, _peers in _REFUSED.items():
    if hasattr(MPI.Intracomm, _name):  # older mpi4py lacks some (Isendrecv, partitioned)
        setattr(Comm, _name, _refuse_on_node(_name, _peers))


# The collectives cma runs for a communicator whose ranks are all on this node (cma's
# ranks are then the communicator's). The uppercase reductions keep MPI's own for an op
# that is not predefined: every rank passes the same op, so every rank makes that choice.
ON_NODE_COLLECTIVES = (
    "Bcast", "Reduce", "Allreduce", "Reduce_scatter_block", "Reduce_scatter", "Scan", "Exscan",
    "Gather", "Gatherv", "Scatter", "Scatterv", "Allgather", "Allgatherv", "Alltoall", "Alltoallv",
    "Alltoallw", "bcast", "reduce", "allreduce", "gather", "scatter", "allgather", "alltoall",
)
_OP_POSITION = {"Reduce": 2, "Allreduce": 2, "Reduce_scatter_block": 2, "Reduce_scatter": 3,
                "Scan": 2, "Exscan": 2}
_PREDEFINED = tuple(getattr(MPI, name) for name in OPS)
_PREDEFINED_IDS = frozenset(map(id, _PREDEFINED))  # (mpi4py's own objects, which live on)


# each collective past its route, for routed instance methods (Comm.__init__)
_ON_NODE: dict[str, Callable[..., Any]] = {}


def _collective(name: str) -> Callable[..., Any]:
    through_mpi = getattr(MPI.Intracomm, name)
    through_cma = getattr(CmaComm, name)
    op_at = _OP_POSITION.get(name)
    typed = not name.islower()  # (an object collective's payload may hold datatypes: data)
    locked = not typed and LOCK_TABLE is not None
    across_nodes = name in HIERARCHICAL
    bcast = name == "Bcast"
    signature = inspect.signature(through_cma)
    # each buffer parameter's position and name, whether the collective writes it (for a
    # packed copy to be unpacked into after the call) and whether its count is a block's
    buffers = [BufferParameter(at, parameter, parameter in ("recvbuf", "buf"),
                               (name, parameter) in _BLOCK_COUNTS)
               for at, parameter in enumerate(list(signature.parameters)[1:])
               if parameter in ("sendbuf", "recvbuf", "buf")]

    def collective(self: Comm, *args: Any, **kwargs: Any) -> Any:
        route = self._routes.get(name)  # (only an all-on-node communicator has routes)
        if isinstance(route, ObjectWindow):
            return route.run(self, args, kwargs, through_mpi.__get__(self),
                             on_node.__get__(self))
        if route is not None and route(self, args, kwargs):
            return through_mpi(self, *args, **kwargs)
        return on_node(self, *args, **kwargs)

    def on_node(self: Comm, *args: Any, **kwargs: Any) -> Any:
        """The collective past its route (which a routed instance method has taken)."""
        barrier = self._barrier
        if barrier == BARRIER_MPI or barrier == BARRIER_NONBLOCKING and not across_nodes:
            return through_mpi(self, *args, **kwargs)
        unpacked: Sequence[tuple[Unpacker, np.ndarray]] = ()
        if typed and _derived_datatype(args, kwargs):
            # (a reduction's op needs MPI's datatype: MPICH refuses predefined ops on
            # derived ones, so such a call is MPI's to run or refuse)
            cma_call = None if op_at is not None else _with_cma_datatypes(
                args, kwargs, buffers, MPI.Comm.Get_size(self))
            if cma_call is None:
                return through_mpi(self, *args, **kwargs)
            args, kwargs, unpacked = cma_call
            if bcast and unpacked and (args[1] if len(args) > 1 else kwargs.get("root", 0)) \
                    == MPI.Comm.Get_rank(self):
                unpacked = ()  # (a Bcast's root sends its buffer: nothing to unpack)
        node_op = None
        if op_at is not None:
            op = args[op_at] if len(args) > op_at else kwargs.get("op", MPI.SUM)
            node_op = _node_op(op)
            if node_op is None:
                return through_mpi(self, *args, **kwargs)
            if len(args) > op_at:
                args = (*args[:op_at], node_op, *args[op_at + 1 :])
            else:
                kwargs["op"] = node_op
        node = self._cma
        try:
            if barrier == BARRIER_NONBLOCKING:
                call = signature.bind(None, *args, **kwargs)
                call.apply_defaults()
                arguments = dict(call.arguments)
                del arguments["self"]
                if op_at is not None:
                    arguments["op"], arguments["node_op"] = op, node_op
                getattr(self._hierarchy(), name)(**arguments)
                result = None
            elif locked:
                assert LOCK_TABLE is not None
                with LOCK_TABLE(self).setdefault(name, threading.Lock()):
                    result = through_cma(node, *args, **kwargs)
            else:
                result = through_cma(node, *args, **kwargs)
            for unpacker, packed in unpacked:  # (what the call wrote into a packed copy)
                unpacker.scatter(packed)
            # what this rank still owes a peer (a FIN queued behind a full ring) must move
            # while it waits in MPI's own calls next
            if node is not None:
                node._keep_moving()
            return result
        except InvalidRank as exc:  # (the only rank a collective takes is its root)
            self.Call_errhandler(MPI.ERR_ROOT)
            raise MPI.Exception(MPI.ERR_ROOT) from exc
        except CmaError as exc:
            self._fail(exc)

    _ON_NODE[name] = on_node
    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = (f"``MPI.Intracomm.{name}``: through cma when every rank is on this "
                          "node" + (", through cma on each node and MPI between nodes otherwise"
                                    if across_nodes else ", else MPI's") + " (docs/mpi.md).")
    return collective


def _node_op(op: Any) -> Op | None:
    """The op cma combines with on a node: a predefined op as it is, a commutative
    user-defined ``MPI.Op`` applied with ``Reduce_local``; None: MPI's to apply (an op
    that does not commute needs MPI's order of ranks)."""
    if id(op) in _PREDEFINED_IDS or isinstance(op, Op) or any(op == known for known in _PREDEFINED):
        return op  # (the identity test first: the loop of == took 0.5-0.8 us a call)
    if isinstance(op, MPI.Op) and op.Is_commutative():
        return Op(f"user-defined {op!r}", lambda inout, incoming: op.Reduce_local(incoming, inout), op)
    return None


def _derived_datatype(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a buffer spec names a derived datatype: cma's collectives take predefined
    ones (as NumPy dtypes); the others, gaps and all, are MPI's to lay out. (Alltoallw's
    datatypes come as a list inside the spec.) Bare arrays, roots and ops, then counts and
    mpi4py's own predefined datatypes, are passed over first: the whole test took 1.9 us
    of a small Allreduce."""
    for spec in (*args, *kwargs.values()) if kwargs else args:
        if spec.__class__ not in _NO_DATATYPE and _names_derived(spec):
            return True
    return False


_NO_DATATYPE = frozenset({np.ndarray, int, MPI.Op})  # (an argument of these names none)


def _names_derived(spec: Any) -> bool:
    """Whether one argument is a buffer spec naming a derived datatype."""
    if spec.__class__ is list or isinstance(spec, (list, tuple)):
        if len(spec) == 3 and id(spec[2]) in MPI_OWN_DATATYPES and spec[1].__class__ is int:
            return False  # ([buf, count, datatype], as most programs write it: in half the time)
        for item in spec:
            if item.__class__ is int or id(item) in MPI_OWN_DATATYPES:
                continue
            if _is_derived(item) or isinstance(item, (list, tuple)) and any(map(_is_derived, item)):
                return True
    return False


class BufferParameter(NamedTuple):
    """A collective's buffer parameter, as ``_with_cma_datatypes`` reads its spec."""

    at: int  # (its position)
    name: str
    written: bool  # (the collective writes it: a recvbuf, a Bcast's buf)
    per_rank: bool  # (a single count in its spec is a block's, one block a rank)


# the buffers whose single count is a block's, a block for each rank (mpi4py's reading)
_BLOCK_COUNTS = frozenset({("Gather", "recvbuf"), ("Allgather", "recvbuf"),
                           ("Scatter", "sendbuf"), ("Alltoall", "sendbuf"),
                           ("Alltoall", "recvbuf")})


def _with_cma_datatypes(args: tuple[Any, ...], kwargs: dict[str, Any],
                        buffers: list[BufferParameter], size: int
                        ) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[Unpacker, np.ndarray]]] | None:
    """The call as cma's collectives take it: every derived datatype without gaps read as
    bytes (``specs.as_bytes``), one with gaps or its bytes out of order over a packed copy
    of the elements it names (``specs.as_packed``), so that a rank passing one takes
    cma's path as its peers passing arrays do (MPI's would leave them waiting:
    docs/mpi.md); with the copies to unpack into the buffers the call writes. None where
    a spec stays MPI's to lay out (``specs._gapped``: Alltoallw's lists, a displacement
    with a single count, MPI.BOTTOM, a buffer of no whole number of elements...)."""
    unpacked: list[tuple[Unpacker, np.ndarray]] = []
    cma_args, cma_kwargs = list(args), dict(kwargs)
    for buffer in buffers:
        by_name = buffer.at >= len(args)
        spec = kwargs.get(buffer.name) if by_name else args[buffer.at]
        as_cma = as_bytes(spec)
        if as_cma is None and spec is not None:
            packed = as_packed(spec, size if buffer.per_rank else 1)
            if packed is None:
                return None
            as_cma, unpacker = packed
            if buffer.written and unpacker is not None:
                unpacked.append((unpacker, as_cma[0]))
        if by_name:
            if buffer.name in kwargs:
                cma_kwargs[buffer.name] = as_cma
        else:
            cma_args[buffer.at] = as_cma
    return tuple(cma_args), cma_kwargs, unpacked


def _is_derived(item: Any) -> bool:
    return isinstance(item, MPI.Datatype) and not item.is_predefined


for _name in ON_NODE_COLLECTIVES:
    setattr(Comm, _name, _collective(_name))

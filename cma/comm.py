"""Comm: the one send/recv API, shaped like mpi4py's (its requests: requests.py).

Two paths:

* the eager fast paths of ``Send``/``Recv``/``Isend``/``Irecv`` write or read one ring
  packet directly: no ctypes call, no request object, no pickling. They are taken only
  when they cannot change the outcome of matching (nothing posted, nothing unexpected,
  ring not backed up).
* everything else goes to the ``Progress`` built at attach (progress.py), which runs
  the protocol engine's actions and every wait; connect time is in connect.py.

A communicator is used by one thread at a time (like MPI_THREAD_SERIALIZED); a second
thread's call while one is inside raises ConcurrentUse (see ``_busy``).
"""

from __future__ import annotations

import mmap
import operator
import os
import pickle
import weakref
from _thread import get_ident
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from . import _linux, heap
from ._exporters import cai_array, dlpack_array
from .channel import FAST_SPINS, NOT_EAGER, RING_EMPTY, ChannelConfig, Inbox, Outbox
from .collectives import Collectives
from .connect import AUTO, NEVER, Connection, check_transport_name
from .direct import DIRECT_FROM, DirectRendezvous
from .errors import (
    BufferError,
    CommClosed,
    InvalidCount,
    InvalidDatatype,
    InvalidRank,
    InvalidTag,
    MessageTooLarge,
    NotTransferable,
    ProtocolError,
)
from .progress import Progress, claim, peer_slots
from .protocol import Arrival, Matcher, RecvOp, SendOp, completed_recv, posted_recv
from .requests import Message, Request, Status, null_recv
from .stats import EagerCounts
from .transports.xmap import View
from .wire import ANY_SOURCE, ANY_TAG, BARRIER_TAG, EAGER, OBJECT, PROC_NULL, TAG_MAX
from .world import ENV_TRANSPORT, ENV_WORLD, World, WorldFds, announce

# An Isend of at least this many bytes (within the eager limit) that finds the ring full
# goes as a rendezvous, which won from here on, instead of a copy queued for the ring
# (docs/architecture.md, "The eager fast path", has the runs). Send keeps queueing: two
# ranks that Send to each other before receiving must not wait for each other's receive.
QUEUED_COPY_LIMIT = 128 << 10

_EMPTY = np.empty(0, np.uint8)  # Barrier's messages
_NOTHING = object()  # what the view caches hold before the first call (never a user buffer)


# ------------------------------------------------------------------ buffers

def _as_bytes_view(mv: memoryview) -> memoryview:
    # (a strided byte view too must be refused: a rendezvous copies the contiguous bytes
    # from its first address, and its receive raised only after it was posted, mid-protocol)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if "O" in mv.format:
        raise BufferError("an array of Python objects holds pointers into its own process: "
                          "send it with the lowercase send() (pickled) instead")
    if not mv.c_contiguous:
        raise BufferError("buffer is not C-contiguous: pass a contiguous copy (np.ascontiguousarray)")
    try:
        return mv.cast("B")
    except TypeError:
        return np.frombuffer(mv, dtype=np.uint8).data


def _spec_view(spec: Sequence[Any]) -> memoryview:
    """An mpi4py-style buffer spec: [buf, typechar] or [buf, count, typechar]."""
    if len(spec) == 2:
        buf, datatype = spec
        count = None
    elif len(spec) == 3:
        buf, count, datatype = spec
    else:
        raise BufferError(f"buffer spec must be [buf, typechar] or [buf, count, typechar], got {spec!r}")
    itemsize = _spec_itemsize(datatype)
    view = _as_bytes_view(memoryview(buf))
    if count is None:
        return view
    elements = _as_int(count)
    if elements is None or elements < 0:
        raise InvalidCount(f"count {count!r} in a buffer spec must be a non-negative int "
                           "(the number of elements of the datatype to send or receive)")
    nbytes = elements * itemsize
    if nbytes > view.nbytes:
        raise BufferError(f"buffer spec asks for {nbytes} bytes of a {view.nbytes}-byte buffer")
    return view[:nbytes]


def _spec_itemsize(datatype: Any) -> int:
    """Bytes per element of a buffer spec's datatype: a NumPy typechar or dtype of fixed size."""
    try:
        # (np.dtype(None) would be float64: a missing datatype must not pass as one)
        dtype = None if datatype is None else np.dtype(datatype)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.hasobject or dtype.itemsize == 0:
        raise InvalidDatatype(
            f"unknown datatype {datatype!r} in buffer spec: give a NumPy typechar such as "
            "'b', 'i', 'f' or 'd', or a NumPy dtype of fixed-size values")
    return dtype.itemsize


def send_view(buf: Any) -> memoryview:
    if isinstance(buf, (list, tuple)):
        return _spec_view(buf)
    try:
        mv = memoryview(buf)
    except (TypeError, ValueError) as exc:
        if isinstance(buf, np.ndarray) and buf.dtype != object and buf.flags.c_contiguous:
            return buf.reshape(-1).view(np.uint8).data  # dtypes without a PEP 3118 code
        if hasattr(buf, "__dlpack__"):
            return dlpack_array(buf).data
        if hasattr(buf, "__cuda_array_interface__"):
            return cai_array(buf).data
        raise BufferError(f"{type(buf).__name__} supports neither the buffer protocol nor "
                          "DLPack nor the CUDA array interface") from exc
    return _as_bytes_view(mv)


def recv_view(buf: Any) -> memoryview:
    mv = send_view(buf)
    if mv.readonly:
        raise BufferError("receive buffer is read-only: pass a bytearray or a writable array")
    return mv


def _export(base: Any, cut: tuple[int, int]) -> memoryview:
    """Bytes [start, stop) of a fresh export of a bytearray or mmap (see remember_spec);
    the export itself where that is all of it (slicing it cost ~200 ns more here). A
    buffer that shrank below them since is refused, as converting the spec would."""
    mv = memoryview(base)
    if mv.nbytes == cut[1] and not cut[0]:
        return mv
    if mv.nbytes < cut[1]:
        raise BufferError(f"buffer spec asks for bytes {cut[0]}..{cut[1]} of a {mv.nbytes}-byte "
                          "buffer (it shrank since the spec was last used)")
    return mv[cut[0] : cut[1]]


# ------------------------------------------------------------------ Comm

EAGER_OBJECT = EAGER | OBJECT  # the packet of an object message within the eager limit
NOT_TAKEN = object()  # Comm.take_object found nothing it could take
# Types whose pickle can hold no out-of-band buffer: Comm._pickle skips the buffer callback
# for them (0.3 us less, docs/api.md "Objects").
PLAIN_PICKLES = frozenset({int, float, complex, bool, str, type(None)})


class Comm(Collectives):
    """A communicator of ``size`` ranks on one machine; this object is rank ``rank``.

    Hooks for subclasses (``cma.mpi``'s node communicator overrides them; their contract
    is docs/architecture.md, "What cma.Comm lets a subclass change"): ``make_request``,
    ``buffer_view``, ``spec_view``, ``remember_spec``, ``general_send``,
    ``general_recv``, ``general_isend``, ``general_irecv``, ``start_send``,
    ``start_buffered_send``, ``operation_completed``, ``load_object``, ``waits_alone``
    and ``packets_queued``. The fast paths call them on their way out only, so overriding one
    costs a hot path nothing.
    """

    # What the non-blocking calls return: a subclass may hand out requests of its own
    # (cma.mpi's node communicator: mpi4py's statuses and errors) at no cost per call.
    make_request: type[Request] = Request

    def __init__(self, fds: WorldFds, rank: int, transport: str = AUTO,
                 thresholds: dict[str, int] | None = None, **transport_options: Any) -> None:
        check_transport_name(transport)
        self._fds = fds
        self.rank = rank
        self.size = fds.size
        # Who is inside a call: 0 none, 1 a fast path, else the thread in a general path
        # (progress.claim). A fast path tests it last and sets it with no thread switch
        # possible in between; finding it set, it takes the general path, which raises
        # ConcurrentUse in another thread (cost: docs/reliability.md, "Two threads").
        self._busy = 0
        self._transport_name = transport
        self._transport_options = transport_options
        self._user_thresholds = dict(thresholds or {})  # what a pickled copy must rebuild from
        self._eager_limit = fds.config.eager_limit
        # Blocking sends from this size take the direct rendezvous (set at attach, when
        # there is one: direct.py)
        self._direct: DirectRendezvous | None = None
        self._direct_from = NEVER
        self._fast_spins = FAST_SPINS  # (Progress.fast_spins, from attach; spins_changed)
        # Whether this machine's ranks outnumber their CPUs (None: this world's size
        # against the CPUs its ranks may use, counted from attach on; cma.mpi knows better)
        self._oversubscribed: bool | None = None
        self._closed = False
        self._world: World | None = None
        self._progress: Progress | None = None  # built at attach: packets, copies, waits
        # What the fast paths read, made here and filled in place at attach (so that a
        # fast path holds them directly): the ring ends it may use now, by peer (None:
        # take the general path), which peer an inbox is from, and the matcher.
        self._fast_outboxes: list[Outbox | None] = peer_slots(self.size)
        self._fast_inboxes: list[Inbox | None] = peer_slots(self.size)
        self._inbox_peer: dict[Inbox, int] = {}
        self._matcher = Matcher()
        self._only_peer = 1 - rank if self.size == 2 else ANY_SOURCE
        self._eager_counts = EagerCounts()
        # One-entry view caches: repeated sends/receives of the same array skip the
        # buffer-protocol export (~0.2-0.5 us, the largest cost of a small message).
        # A receive still asks the array whether it is writeable (~40-90 ns): numpy
        # lets it be made read-only after its view was taken.
        self._send_obj: Any = _NOTHING
        self._send_view = memoryview(b"")
        self._recv_obj: Any = _NOTHING
        self._recv_view = memoryview(bytearray())
        # The same for the last buffer spec list: its buffer, a copy of the list, and the
        # view (arrays, bytes) or where in a fresh export of it the bytes are (bytearray,
        # mmap); see remember_spec.
        self._send_base: Any = _NOTHING
        self._send_spec: list[Any] = []
        self._send_spec_view = memoryview(b"")
        self._send_cut: tuple[int, int] | None = None
        self._recv_base: Any = _NOTHING
        self._recv_spec: list[Any] = []
        self._recv_spec_view = memoryview(b"")
        self._recv_cut: tuple[int, int] | None = None
        # An end this process never attaches (the one handed to a child) closes its fds when
        # it is garbage-collected, as multiprocessing's Connection does; see Pipe().
        self._release_unused = weakref.finalize(self, fds.close)
        self._announced = False  # this process is recorded as the one to attach this rank

    # -- mpi4py-style accessors

    def Get_rank(self) -> int:
        """This process's rank (``MPI.Comm.Get_rank``); also the attribute ``rank``."""
        return self.rank

    def Get_size(self) -> int:
        """The number of ranks (``MPI.Comm.Get_size``); also the attribute ``size``."""
        return self.size

    @property
    def transport(self) -> str:
        """The transport name given at creation (``"auto"`` or a transport's name)."""
        return self._transport_name

    def __repr__(self) -> str:
        return f"<cma.Comm rank {self.rank} of {self.size}, transport {self._transport_name!r}>"

    # -- pickling for multiprocessing (spawn/forkserver): the fds travel with the process

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        if self._closed or self._progress is not None:
            # Its rank lives in this process (attached) or nowhere (closed): a copy
            # elsewhere could never attach as that rank.
            raise NotTransferable(
                f"rank {self.rank} of this communicator is "
                + ("closed" if self._closed else f"attached in process {os.getpid()}")
                + ": only an end not used yet can be handed to another process (pass it "
                "to multiprocessing.Process before its first call)")
        fds = self._fds
        if self._announced:
            self._give_up_announcement()  # it goes on to another process
        return (_rebuild_comm, (fds.world_id, fds.size, DupFd(fds.memfd),
                                [DupFd(b) if b >= 0 else None for b in fds.doorbells],
                                fds.config.encode(),
                                self.rank, self._transport_name, self._user_thresholds,
                                self._transport_options))

    # -- connect time

    def _give_up_announcement(self) -> None:
        """No longer claim to be the process that will attach this end (0: unknown)."""
        self._announced = False
        _announced_ends.discard(self)
        announce(self._fds, self.rank, 0)

    def _attach(self) -> Progress:
        """Connect to every rank (each attaches too) and build this rank's Progress."""
        held = claim(self)  # (a second thread would connect this rank a second time)
        try:
            return self._connect_world()
        finally:
            self._busy = held

    def _connect_world(self) -> Progress:
        if self._closed:
            raise CommClosed(f"rank {self.rank}'s communicator is closed: make a new world "
                             "(cma.Pipe, cma-run) to talk again")
        self._release_unused.detach()  # attached: close() releases everything
        _announced_ends.discard(self)
        # (cma.mpi's node rank 0 has one already: its fd server handed the world over)
        world = self._world if self._world is not None else World(self._fds, self.rank)
        self._world = world
        connection = Connection(world, self.rank, self._transport_name, self._transport_options,
                                self._user_thresholds)
        # (the CPUs of the ranks attached by now, counted again by Progress as peers connect:
        # a world of two has connected its pair)
        decided_here = self._oversubscribed is None
        self._progress = Progress(
            world, connection, self._matcher, self._fast_outboxes, self._fast_inboxes, self._inbox_peer,
            self._eager_counts, self._ring,
            # (Comm's own hook does nothing: not calling it saves a frame per message)
            None if type(self).operation_completed is Comm.operation_completed
            else self.operation_completed,
            overlap=bool(self._transport_options.get("overlap")), owner=self,
            oversubscribed=self.size > _linux.usable_cpus(world.published_cpus())
            if decided_here else bool(self._oversubscribed), count_cpus=decided_here)
        self._direct = self._progress.direct
        if self._direct is not None:
            self._direct_from = DIRECT_FROM
        self._fast_spins = self._progress.fast_spins
        _attached_comms.add(self)
        return self._progress

    def attach(self) -> None:
        """Connect now instead of at the first operation (every rank must attach)."""
        if self._progress is None:
            self._attach()

    def connect(self, peer: int) -> None:
        """Connect ``peer`` now instead of at the first operation that names it (a world
        of two ranks connects at attach; docs/architecture.md, "Connect time")."""
        (self._progress or self._attach()).connect(self._check_dest(peer))

    def progress(self) -> bool:
        """Move whatever can move without blocking; True if anything did."""
        return (self._progress or self._attach()).poll()

    def transports(self) -> dict[int, dict[str, Any]]:
        """Per peer: the transports usable with it, the one a large message would use (as
        ``auto``'s thresholds decide), and why the others are unavailable. Connects every
        peer, and waits until each has connected back (each must be in a cma call)."""
        progress = self._progress or self._attach()
        connection = progress.connection
        for peer in progress.peers:
            progress.connect(peer)
        progress.wait_until(lambda: all(connection.learned(p) for p in progress.peers), None)
        return connection.report()

    # -- blocking buffer point-to-point (eager fast paths inline)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of a buffer (``MPI.Comm.Send``).

        Returns at once for a message within the eager limit (copied into the ring, or
        queued when the ring is full) and below 256 KiB (``direct.DIRECT_FROM``); a
        larger one returns once the transfer no longer needs ``buf``, which needs the
        receiver to have matched it (from 256 KiB, where the receiver can read this
        process, once it has copied it: the direct rendezvous)."""
        if buf is self._send_obj:
            mv = self._send_view
        elif buf.__class__ is list and buf and buf[0] is self._send_base and buf == self._send_spec:
            mv = self._send_spec_view if self._send_cut is None else _export(self._send_base, self._send_cut)
        elif buf.__class__ is bytearray:
            mv = memoryview(buf)
        else:
            mv = self.buffer_view(buf, send_view)
        n = mv.nbytes
        try:
            outbox = self._fast_outboxes[dest] if dest >= 0 else None
        except (IndexError, TypeError):  # (a rank out of range or not an int: refused below)
            outbox = None
        # (each branch tests _busy last, right before setting it: a taken jump between the
        # two would let another thread in, as on Python 3.10)
        if outbox is not None and type(tag) is int and tag >= 0:
            direct = self._direct
            if n >= self._direct_from and mv.__class__ is memoryview and direct is not None \
                    and tag <= TAG_MAX and (direct.can_pull(dest) or direct.can_map(dest, mv)):
                me = get_ident()
                if not self._busy:
                    # (held as the general paths hold it, through the wait for a send the
                    # engine took over: between the two another thread's call got in, this
                    # wait raised ConcurrentUse, "did nothing", with the RTS already out)
                    self._busy = me
                    try:
                        started = direct.send(outbox, mv, n, dest, tag)
                        if started is not None:
                            self.general_send(mv, dest, tag, started)
                    finally:
                        self._busy = 0
                    return
            elif n <= self._eager_limit and not self._busy:
                self._busy = 1
                try:
                    sleeping = outbox.put_eager(tag, mv, n)
                finally:
                    self._busy = 0
                if sleeping == 0:
                    return
                if sleeping > 0:
                    self._ring(dest)
                    return
        self.general_send(mv, dest, tag)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> None:
        """Blocking receive into a writable buffer (``MPI.Comm.Recv``); fills ``status``.

        A message larger than ``buf`` raises ``TruncationError`` (and is consumed)."""
        if buf is self._recv_obj and buf.flags.writeable:
            mv = self._recv_view
        elif buf.__class__ is list and buf and buf[0] is self._recv_base and buf == self._recv_spec \
                and (self._recv_cut is not None or self._recv_base.flags.writeable):
            mv = self._recv_spec_view if self._recv_cut is None else _export(self._recv_base, self._recv_cut)
        elif buf.__class__ is bytearray:
            mv = memoryview(buf)
        else:
            mv = self.buffer_view(buf, recv_view)
        matcher = self._matcher
        try:
            peer = self._only_peer if source == ANY_SOURCE else source
            inbox = self._fast_inboxes[peer] if peer >= 0 else None
        except (IndexError, TypeError):
            inbox = None
        if inbox is not None and type(tag) is int and tag >= ANY_TAG and not matcher.posted \
                and not matcher.unexpected and not self._busy:
            self._busy = 1
            try:
                n = inbox.take_eager(mv, tag)
                spins = self._fast_spins
                while n == RING_EMPTY and spins:
                    spins -= 1
                    n = inbox.take_eager(mv, tag)
                if n == NOT_EAGER and self._direct is not None and mv.__class__ is memoryview:
                    n = self._direct.recv(inbox, mv, tag)
            finally:
                self._busy = 0
            if n >= 0:
                if status is not None:
                    status.source = self._inbox_peer[inbox]
                    status.tag = inbox.last_tag
                    status.count = n
                return
            if n == RING_EMPTY and self._await_late(inbox, tag):
                self.Recv(buf, source, tag, status)  # (its packet is at the head now)
                return
        self.general_recv(mv, source, tag, status)

    def _await_late(self, inbox: Inbox, tag: int) -> bool:
        """For a Recv whose spin found the ring empty: sleep until the peer's next packet
        (``Progress.await_head``), for the fast path to take it on a second pass; False
        (nothing waited for) where the engine must wait instead."""
        progress = self._progress
        # (a tag out of range: the general path refuses it)
        return progress is not None and tag <= TAG_MAX and self.waits_alone() \
            and progress.await_head(inbox)

    def packets_queued(self) -> None:
        """Hook: a fast path left a packet queued behind a full ring (a direct receive's
        FIN); it goes out during this rank's next call into cma. cma.mpi makes sure a wait
        inside MPI is such a call."""

    def spins_changed(self) -> None:
        """Progress found that this rank has a CPU to itself after all (its later peers'
        masks): the fast paths spin from now on."""
        self._fast_spins = self._progress.fast_spins if self._progress is not None else FAST_SPINS

    def waits_alone(self) -> bool:
        """Hook: whether this rank's waits need move nothing but cma (``Recv`` may then sleep
        until its peer's next packet without the engine); cma.mpi's mixed ranks must keep
        MPI moving too."""
        return True

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Status | None = None) -> None:
        """Send and receive at once (``MPI.Comm.Sendrecv``): ``Isend``, ``Recv``, then wait for the send.

        The receive's arguments are checked before anything is sent. A message that Send
        would hand over at once (eager, below the direct rendezvous) makes no request;
        one of the direct rendezvous's sizes is offered as ``Send`` offers it, and waited
        for after the receive, which the peer's offer may meet on the fast path too."""
        if not (recvbuf is self._recv_obj and recvbuf.flags.writeable
                or recvbuf.__class__ is list and recvbuf and recvbuf[0] is self._recv_base
                and recvbuf == self._recv_spec
                and (self._recv_cut is not None or self._recv_base.flags.writeable)):
            self.buffer_view(recvbuf, recv_view)  # (remembered: Recv finds it at once)
        # (valid without the full checks: a rank, ANY_SOURCE or PROC_NULL; a tag or ANY_TAG)
        if not (source.__class__ is int and ANY_SOURCE <= source < self.size
                and recvtag.__class__ is int and ANY_TAG <= recvtag <= TAG_MAX):
            self._check_source(source)
            self._check_tag(recvtag, wildcard=True)
        mv: Any = None  # (the rest: Isend's lookups)
        if sendbuf is self._send_obj:
            mv = self._send_view
        elif sendbuf.__class__ is np.ndarray or sendbuf.__class__ is bytes:
            mv = self.buffer_view(sendbuf, send_view)
        elif sendbuf.__class__ is bytearray:
            mv = memoryview(sendbuf)
        elif sendbuf.__class__ is list:  # ([buf, n, MPI.BYTE], mpi4py's idiom)
            if sendbuf and sendbuf[0] is self._send_base and sendbuf == self._send_spec:
                cut = self._send_cut
                mv = self._send_spec_view if cut is None else _export(self._send_base, cut)
            else:
                mv = self.buffer_view(sendbuf, send_view)  # (remembered: Send finds it)
                if mv.__class__ is not memoryview or mv.obj is not sendbuf[0]:
                    mv = None  # (a datatype's packed copy is not: Isend packs it, once)
        n = NEVER if mv is None else mv.nbytes
        if n <= self._eager_limit and n < self._direct_from:
            # (where Send returns at once, as Isend's request would be complete)
            self.Send(sendbuf, dest, sendtag)
            self.Recv(recvbuf, source, recvtag, status)
            return
        if self._direct_from <= n < NEVER and mv.__class__ is memoryview \
                and self._sendrecv_direct(mv, dest, sendtag, recvbuf, source, recvtag, status):
            return
        send = self.Isend(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)
        send.Wait()

    def _sendrecv_direct(self, mv: memoryview, dest: Any, sendtag: Any, recvbuf: Any,
                         source: int, recvtag: int, status: Status | None) -> bool:
        """``Sendrecv``'s send offered as ``Send``'s direct rendezvous, then the receive,
        then the wait for the peer's copy: whether it was (False: nothing was sent; the
        arguments, the peer or a call under way in another thread call for the general path)."""
        direct = self._direct
        if direct is None or sendtag.__class__ is not int or not 0 <= sendtag <= TAG_MAX \
                or dest.__class__ is not int or not 0 <= dest < self.size:
            return False
        outbox = self._fast_outboxes[dest]
        if outbox is None or not (direct.can_pull(dest) or direct.can_map(dest, mv)):
            return False
        me = get_ident()
        if self._busy:  # (tested right before it is set, as in Send)
            return False
        self._busy = me
        try:
            op, in_ring = direct.offer(outbox, mv, mv.nbytes, dest, sendtag)
        finally:
            self._busy = 0
        progress = direct.progress
        progress.offered = op if in_ring else None  # (its FIN may come during the receive)
        try:
            self.Recv(recvbuf, source, recvtag, status)
        finally:
            progress.offered = None
        done = False
        if in_ring and not self._busy:
            self._busy = me
            try:
                done = direct.fin_came(op, dest)
            finally:
                self._busy = 0
        if not done:
            self.general_send(mv, dest, sendtag, op)
        return True

    # -- synchronous and buffered modes (mpi4py's Ssend and Bsend families)

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:
        """A send that returns once a receive has matched the message (``MPI_Ssend``)."""
        self.Issend(buf, dest, tag).Wait()

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Non-blocking synchronous send (``MPI.Comm.Issend``): completes once a receive has matched it."""
        mv = self.buffer_view(buf, send_view)
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return self.make_request(self, None)
        return self.make_request(self, self.start_send([mv], dest, tag, False, sync=True))

    def Bsend(self, buf: Any, dest: int, tag: int = 0) -> None:
        """A send that returns at once, the message copied (``MPI_Bsend``).

        cma needs no attached buffer: a message within the eager limit is copied into the
        ring (or the send queue), a larger one into memory of its own that the receiver
        reads when it matches; ``close()`` waits for those, as MPI_Buffer_detach does.
        """
        self.Ibsend(buf, dest, tag)

    def Ibsend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Non-blocking buffered send (``MPI.Comm.Ibsend``): the message is copied, the request is
        complete.

        No attached buffer is needed (see ``Bsend``)."""
        mv = self.buffer_view(buf, send_view)
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest != PROC_NULL:
            self.start_buffered_send([mv], dest, tag, False)
        return self.make_request(self, None)

    def start_buffered_send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool
                        ) -> None:
        """Hook: start a buffered send of ``segments`` (a copy the caller need not keep).

        Within the eager limit the packet itself is the copy; a larger message is copied to
        memory of its own, which ``close()`` waits for (docs/architecture.md, subclass
        hooks)."""
        if sum(s.nbytes for s in segments) <= self._eager_limit and len(segments) == 1:
            self.start_send(segments, dest, tag, is_object)  # complete once in a packet
            return
        self._refuse_beyond_memory(segments, "a buffered send (Bsend, bsend, or a blocking Send "
                                   "to oneself) copies its message first", "send it with Send or "
                                   "Isend to another rank, which copy from your buffer")
        copies = [memoryview(bytearray(s)) for s in segments]
        op = self.start_send(copies, dest, tag, is_object)
        progress = self._progress or self._attach()
        progress.buffered = [*(op for op in progress.buffered if not op.done), op]

    def _refuse_beyond_memory(self, segments: list[memoryview], why: str, instead: str) -> None:
        """MessageTooLarge, before anything is allocated or sent, for ``segments`` that would
        have to be allocated whole and hold more than this machine's memory and swap."""
        nbytes = sum(s.nbytes for s in segments)
        limit = (self._progress or self._attach()).engine.max_object_bytes
        if limit is not None and nbytes > limit:
            raise MessageTooLarge(f"{why}, and {nbytes} bytes is more than this machine's memory "
                                  f"and swap ({limit} bytes): {instead}")

    def Isendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                  source: int = ANY_SOURCE, recvtag: int = ANY_TAG) -> Request:
        """Send and receive at once (``MPI_Isendrecv``): one request, the receive's status."""
        smv = self.buffer_view(sendbuf, send_view)
        dest = self._check_dest(dest)
        sendtag = self._check_tag(sendtag)
        send = None if dest == PROC_NULL else self.start_send([smv], dest, sendtag, False)
        rmv = self.buffer_view(recvbuf, recv_view)
        source = self._check_source(source)
        recvtag = self._check_tag(recvtag, wildcard=True)
        if source == PROC_NULL:
            op = null_recv()
        else:
            op = (self._progress or self._attach()).post_recv(source, recvtag, rmv)
        return self.make_request(self, op, also=send)

    def Isendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0,
                          source: int = ANY_SOURCE, recvtag: int = ANY_TAG) -> Request:
        """``Isendrecv`` with one buffer: what is sent is copied first."""
        outgoing = bytes(self.buffer_view(buf, send_view))
        return self.Isendrecv(outgoing, dest, sendtag, buf, source, recvtag)

    # The general paths of Send and Recv, apart so that a subclass can adapt what they
    # raise and fill (cma.mpi's node communicator) without a frame on the hot paths.

    def general_send(self, mv: memoryview, dest: Any, tag: Any, started: SendOp | None = None
                     ) -> None:
        """Hook: ``Send``'s general path (arguments checked here, rendezvous, full ring);
        ``started``: the send's direct rendezvous (direct.py) is under way, to wait for.

        A subclass may translate errors; it must do the send exactly once."""
        if started is not None:
            assert self._progress is not None
            self._progress.wait(started)
            return
        # (a bytearray's fast path comes here before attaching)
        progress = self._progress or self._attach()
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return
        if dest == self.rank:  # (a rendezvous to ourselves would wait for our own Recv)
            self.start_buffered_send([mv], dest, tag, False)
            return
        progress.wait(self.start_send([mv], dest, tag, False))

    def general_recv(self, mv: memoryview, source: Any, tag: Any, status: Status | None) -> None:
        """Hook: ``Recv``'s general path (arguments checked here, posted receives, rendezvous).

        A subclass may translate errors and statuses; it must do the receive exactly once."""
        # (a bytearray's fast path comes here before attaching)
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            if status is not None:
                status._fill(PROC_NULL, ANY_TAG, 0)
            return
        Request(self, progress.post_recv(source, tag, mv)).Wait(status)

    # -- non-blocking buffer point-to-point

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Non-blocking send of a buffer (``MPI.Comm.Isend``); do not change ``buf`` until it completes.

        A message within the eager limit is complete on return (copied into the ring, or
        queued behind a full ring); from 128 KiB (QUEUED_COPY_LIMIT) one that finds the ring
        full goes as a rendezvous instead."""
        if buf is self._send_obj:
            mv = self._send_view
        elif buf.__class__ is list and buf and buf[0] is self._send_base and buf == self._send_spec:
            mv = self._send_spec_view if self._send_cut is None else _export(self._send_base, self._send_cut)
        elif buf.__class__ is bytearray:
            mv = memoryview(buf)
        else:
            mv = self.buffer_view(buf, send_view)
        n = mv.nbytes
        if n <= self._eager_limit:
            # An eager send is complete once its packet is in the ring or queued, so it
            # never blocks. Send's hot path is written out here again: calling Send cost
            # ~75 ns (a frame and a second view lookup) of a ~715 ns Isend.
            try:
                outbox = self._fast_outboxes[dest] if dest >= 0 else None
            except (IndexError, TypeError):
                outbox = None
            if outbox is not None and type(tag) is int and tag >= 0 and not self._busy:
                self._busy = 1
                try:
                    sleeping = outbox.put_eager(tag, mv, n)
                finally:
                    self._busy = 0
                if sleeping >= 0:
                    if sleeping:
                        self._ring(dest)
                    return self.make_request(self, None)
            if self._queues(n, outbox):
                self.general_send(mv, dest, tag)
                return self.make_request(self, None)
        return self.general_isend(mv, dest, tag)

    @staticmethod
    def _queues(n: int, outbox: Outbox | None) -> bool:
        """Whether an eager message of ``n`` bytes that the fast path could not put in the
        ring is copied into a packet queued for it (complete at once) rather than sent as
        a rendezvous (QUEUED_COPY_LIMIT): small ones, or ones the ring takes after all."""
        return n < QUEUED_COPY_LIMIT or outbox is not None and outbox.fits(n)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Non-blocking receive into a buffer (``MPI.Comm.Irecv``); do not read ``buf`` until it completes.

        A message already at the head of the ring, with no earlier receive posted, completes
        it on return."""
        # (Recv's view lookup, written out again as Isend writes out Send's)
        if buf is self._recv_obj and buf.flags.writeable:
            mv = self._recv_view
        elif buf.__class__ is list and buf and buf[0] is self._recv_base and buf == self._recv_spec \
                and (self._recv_cut is not None or self._recv_base.flags.writeable):
            mv = self._recv_spec_view if self._recv_cut is None else _export(self._recv_base, self._recv_cut)
        elif buf.__class__ is bytearray:
            mv = memoryview(buf)
        else:
            mv = self.buffer_view(buf, recv_view)
        matcher = self._matcher
        try:
            peer = self._only_peer if source == ANY_SOURCE else source
            inbox = self._fast_inboxes[peer] if peer >= 0 else None
        except (IndexError, TypeError):
            inbox = None
        if inbox is not None and type(tag) is int and ANY_TAG <= tag <= TAG_MAX:
            progress = self._progress
            if matcher.posted and progress is not None and inbox.ready():  # (None: closed)
                # Receives posted earlier match first: let them take what has arrived
                # for them (a window of Irecvs then finds its messages waiting, below).
                progress.drain_expected(peer)
            if not matcher.unexpected and progress is not None and not self._busy:
                self._busy = 1
                try:
                    if not matcher.posted:
                        # Already at the head of the ring with nothing ahead of it in
                        # matching order: complete now, as Recv would.
                        n = inbox.take_eager(mv, tag)
                        if n >= 0:
                            op = completed_recv(source, tag, mv, peer, inbox.last_tag, n)
                            return self.make_request(self, op)
                    # Nothing that arrived can match it: post it as Engine.recv would,
                    # without the general path's checks and calls (osu_bibw's window of
                    # Irecvs before their messages: docs/mpi.md, "Windows of requests").
                    op = posted_recv(source, tag, mv)
                    matcher.posted.append(op)
                finally:
                    self._busy = 0
                return self.make_request(self, op)
        return self.general_irecv(mv, source, tag)

    # Their general paths, apart for the same reason as general_send and general_recv.

    def general_isend(self, mv: memoryview, dest: Any, tag: Any) -> Request:
        """Hook: ``Isend``'s general path (arguments checked here; a rendezvous, also for an eager-sized
        message whose ring is full). A subclass must do the send exactly once."""
        if self._progress is None:  # (a bytearray's fast path comes here before attaching)
            self._attach()
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return self.make_request(self, None)
        # (for a message within the eager limit: the ring is full, and a rendezvous costs
        # less than copying the payload into a packet that waits for the ring; the
        # receiver pulls it where it can, see Policy.choose)
        return self.make_request(self, self.start_send([mv], dest, tag, False, eager=False))

    def general_irecv(self, mv: memoryview, source: Any, tag: Any) -> Request:
        """Hook: ``Irecv``'s general path (arguments checked here; posts the receive to the engine).

        A subclass must do the receive exactly once."""
        # (a bytearray's fast path comes here before attaching)
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            return self.make_request(self, null_recv())
        return self.make_request(self, progress.post_recv(source, tag, mv))

    # -- views (no copy: the sender's heap memory, mapped)

    def Irecv_view(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Receive a buffer message as a read-only view: its request's ``wait()`` returns a
        ``cma.View`` (a NumPy uint8 array). A rendezvous message whose send buffer is in
        the sender's heap, where xmap is on, is the sender's memory itself, and the
        sender's request completes only once the view is released (``release()``, a
        ``with`` block, or garbage collection: then at this rank's next cma call); any
        other message is a fresh array, copied as a receive would."""
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            return self.make_request(self, null_recv())
        return self.make_request(self, progress.post_recv(source, tag, None, view=True))

    def recv_view(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                  status: Status | None = None) -> View:
        """``Irecv_view(source, tag).wait(status)``: the message as a read-only ``cma.View``.

        A heap buffer's RTS at the head of the ring is mapped without the engine (the
        direct rendezvous, cma/direct.py), as a blocking ``Recv`` pulls one."""
        direct = self._direct
        if direct is not None and direct.xmap is not None and type(tag) is int and tag >= ANY_TAG:
            try:
                peer = self._only_peer if source == ANY_SOURCE else source
                inbox = self._fast_inboxes[peer] if peer >= 0 else None
            except (IndexError, TypeError):
                inbox = None
            got = self._view_from_ring(direct, inbox, tag)
            if got is not None:
                assert inbox is not None
                if isinstance(got, View):
                    if status is not None:
                        status.source = self._inbox_peer[inbox]
                        status.tag = inbox.last_tag
                        status.count = got.nbytes
                    return got
                if got == RING_EMPTY and self._await_late(inbox, tag):
                    return self.recv_view(source, tag, status)  # (its packet is at the head now)
        view: View = self.Irecv_view(source, tag).wait(status)
        return view

    def _view_from_ring(self, direct: DirectRendezvous, inbox: Inbox | None, tag: int,
                        capacity: int | None = None) -> View | int | None:
        """The fast path of a view receive: ``direct.view`` of ``inbox``'s head, spun on
        while the ring is empty (a View, RING_EMPTY or NOT_EAGER); None where the engine
        must take the receive (it has receives posted or messages waiting, another call is
        inside, or a view was released unannounced: its pass sends that FIN first)."""
        matcher = self._matcher
        if inbox is None or matcher.posted or matcher.unexpected or direct.xmap is None \
                or direct.xmap.released or self._busy:
            return None
        self._busy = 1
        try:
            got = direct.view(inbox, tag, capacity)
            spins = self._fast_spins
            while got.__class__ is int and got == RING_EMPTY and spins:
                spins -= 1
                got = direct.view(inbox, tag, capacity)
        finally:
            self._busy = 0
        return got

    def load_view(self, op: RecvOp) -> View:
        """What a view receive hands out: the mapped view, or the received bytes as one."""
        held, op.held = op.held, None
        if held is not None:
            return held
        if len(op.segments) == 1:
            arr = np.frombuffer(op.segments[0], np.uint8)
        else:
            arr = np.concatenate([np.frombuffer(s, np.uint8) for s in op.segments]) \
                if op.segments else np.empty(0, np.uint8)
        arr.flags.writeable = False
        return arr.view(View)

    # -- objects (pickle protocol 5, large buffers out of band through the transport)

    def _pickle(self, obj: Any) -> list[memoryview]:
        if obj.__class__ in PLAIN_PICKLES:
            return [memoryview(pickle.dumps(obj, 5))]
        oob: list[memoryview] = []
        limit = self._eager_limit

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            raw = buffer.raw()
            if raw.nbytes <= limit:
                return True  # small buffers stay in the stream
            oob.append(raw)
            return False

        stream = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
        progress = self._progress
        if oob and progress is not None and progress.xmap is not None \
                and all(heap.is_shared(buffer) for buffer in oob):
            # XMAP is offered only when every buffer is in the heap: the stream goes too
            # (a copy of a few hundred bytes, so that the arrays are not copied twice)
            held = heap.alloc(len(stream))
            held[:] = np.frombuffer(stream, np.uint8)
            return [held.data, *oob]
        return [memoryview(stream), *oob]

    def load_object(self, op: RecvOp) -> Any:
        """Hook: what an object receive returns: the unpickled object (a buffer message as a
        ``bytearray``); cma.mpi's decodes as mpi4py does."""
        if not op.is_object:
            return bytearray(op.segments[0]) if op.segments else bytearray()
        try:
            return self.unpickled(op.segments[0], op.segments[1:], op.matched_source,
                                  op.matched_tag, op.nbytes)
        except ProtocolError:
            op.segments = []  # (as unpickled drops its own: see there)
            raise
        finally:
            if op.view:
                op.segments = []  # (the object's arrays alone keep the sender's buffers now)

    @staticmethod
    def unpickled(stream: Any, buffers: list[Any], source: int, tag: int, nbytes: int) -> Any:
        """The object of a received pickle ``stream`` and its out-of-band ``buffers``."""
        try:
            return pickle.loads(stream, buffers=buffers)
        except Exception as exc:
            # The message was received whole and is consumed; the rings are untouched, so
            # the communicator stays usable, with this peer too. Its buffers are dropped
            # here: the traceback keeps this frame, and a view maps the peer's memory.
            buffers.clear()
            del stream, buffers
            raise ProtocolError(
                f"rank {source}'s object message (tag {tag}, {nbytes} "
                f"bytes) does not unpickle here: {type(exc).__name__}: {exc}. Either its bytes "
                "are not a pickle (the peer broke the protocol), or they name what this "
                "process cannot rebuild (a class must be importable here, not defined in "
                "the sender's __main__ only)", peer=source) from exc

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of a picklable object (``MPI.Comm.send``): ``isend(...).Wait()``,
        except that a pickle within the eager limit goes into the ring as ``Send``'s
        message would (the general path cost ~15 us more a message: docs/api.md)."""
        try:
            outbox = self._fast_outboxes[dest] if dest >= 0 else None
        except (IndexError, TypeError):  # (a rank out of range or not an int: refused below)
            outbox = None
        segments = None
        if outbox is not None and type(tag) is int and tag >= 0:
            segments = self._pickle(obj)
            stream = segments[0]
            n = stream.nbytes
            if len(segments) == 1 and n <= self._eager_limit and not self._busy:
                self._busy = 1
                try:
                    sleeping = outbox.put_eager(tag, stream, n, EAGER_OBJECT)
                finally:
                    self._busy = 0
                if sleeping >= 0:
                    if sleeping:
                        self._ring(dest)
                    return
        self._isend_object(obj, dest, tag, sync=False, segments=segments).Wait()

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Non-blocking send of a picklable object (``MPI.Comm.isend``); ``wait()`` returns ``None``.

        Pickled with protocol 5; buffers above the eager limit go out of band, as buffer
        messages do (do not change them until the request completes)."""
        return self._isend_object(obj, dest, tag, sync=False)

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """``send`` that returns once a receive has matched the message."""
        self.issend(obj, dest, tag).Wait()

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Non-blocking synchronous send of an object (``MPI.Comm.issend``): completes once matched."""
        return self._isend_object(obj, dest, tag, sync=True)

    def bsend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """``send`` that returns at once: the object's buffers are copied (see ``Bsend``)."""
        self.ibsend(obj, dest, tag)

    def ibsend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Non-blocking buffered send of an object (``MPI.Comm.ibsend``): complete on return (see
        ``Bsend``)."""
        return self._isend_object(obj, dest, tag, sync=False, buffered=True)

    def _isend_object(self, obj: Any, dest: Any, tag: Any, sync: bool, buffered: bool = False,
                      segments: list[memoryview] | None = None) -> Request:
        """``segments``: what ``_pickle(obj)`` returned already."""
        if self._progress is None:
            self._attach()
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return self.make_request(self, None)
        if segments is None:
            segments = self._pickle(obj)
        self._refuse_beyond_memory(segments, "an object's receiver allocates what it pickled to",
                                   "send its large arrays with Send, into receive buffers of "
                                   "their own (a file mapping can be larger than memory)")
        if buffered:
            self.start_buffered_send(segments, dest, tag, True)
            return self.make_request(self, None)
        return self.make_request(self, self.start_send(segments, dest, tag, True, sync=sync))

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None, views: bool = False) -> Any:
        """Blocking receive of an object of any size (``MPI.Comm.recv``); ``buf`` is accepted, unused.

        ``views=True``: see ``irecv``. A ``PROC_NULL`` source returns ``None``."""
        if views:
            return self.irecv(buf, source, tag, views=True).wait(status)
        obj = self.take_object(source, tag, status)
        if obj is NOT_TAKEN:
            return self.irecv(buf, source, tag).wait(status)
        return obj

    def take_object(self, source: int, tag: int, status: Status | None) -> Any:
        """``recv``'s hot path, as ``Recv``'s: an object message whose whole pickle is at
        the head of the ring, with no receive posted before, is taken from there (after a
        spin, or a sleep until the peer's next packet, if the ring is empty); NOT_TAKEN
        where the general path must receive."""
        inbox = self._idle_inbox(source, tag)
        if inbox is None:
            return NOT_TAKEN
        self._busy = 1
        try:
            n = inbox.eager_size(tag, EAGER_OBJECT)
            spins = self._fast_spins
            while n == RING_EMPTY and spins:
                spins -= 1
                n = inbox.eager_size(tag, EAGER_OBJECT)
            if n >= 0:
                stream = bytearray(n)
                n = inbox.take_eager(memoryview(stream), tag, EAGER_OBJECT)
        finally:
            self._busy = 0
        if n >= 0:
            source, tag = self._inbox_peer[inbox], inbox.last_tag
            if status is not None:
                status.source = source
                status.tag = tag
                status.count = n
            return self.unpickled(stream, [], source, tag, n)
        if n == RING_EMPTY and self._await_late(inbox, tag):
            return self.take_object(source, tag, status)  # (its packet is at the head now)
        return NOT_TAKEN

    def _idle_inbox(self, source: int, tag: int) -> Inbox | None:
        """The ring from ``source`` (a rank, or ANY_SOURCE with one peer) if a receive may
        take from it directly: nothing posted, nothing queued unexpected, not inside cma,
        ``tag`` a valid receive tag. (Recv keeps this inline: one call more costs every
        message.)"""
        matcher = self._matcher
        try:
            peer = self._only_peer if source == ANY_SOURCE else source
            inbox = self._fast_inboxes[peer] if peer >= 0 else None
        except (IndexError, TypeError):
            return None
        if inbox is None or type(tag) is not int or tag < ANY_TAG or matcher.posted \
                or matcher.unexpected or self._busy:
            return None
        return inbox

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              views: bool = False) -> Request:
        """Receive an object of any size (``buf`` is accepted for mpi4py compatibility, unused).

        ``views``: where the object's buffers all lie in the sender's heap and xmap is on,
        its arrays are read-only views of the sender's memory (no copy), and the sender's
        request completes once every one of them is garbage-collected (then, at this
        rank's next cma call)."""
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            return self.make_request(self, null_recv(), is_object=True)
        return self.make_request(self, progress.post_recv(source, tag, None, view=views),
                                 is_object=True)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Status | None = None) -> Any:
        """Send an object and receive one (``MPI.Comm.sendrecv``); returns the received object."""
        send = self.isend(sendobj, dest, sendtag)
        obj = self.recv(recvbuf, source, recvtag, status)
        send.Wait()
        return obj

    # -- probes

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Status | None = None) -> bool:
        """Whether a matching message has arrived (``MPI.Comm.Iprobe``); fills ``status``.

        The message stays to be received; a pass of progress runs first."""
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            if status is not None:
                status._fill(PROC_NULL, ANY_TAG, 0)
            return True
        progress.poll()
        arrival = progress.engine.probe(source, tag)
        if arrival is None:
            return False
        if status is not None:
            status._fill(arrival.source, arrival.tag, arrival.nbytes)
        return True

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: Status | None = None) -> Message | None:
        """A matched probe (``MPI_Improbe``): the message found, which no other receive can
        take from then on; ``None`` if there is none yet."""
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            if status is not None:
                status._fill(PROC_NULL, ANY_TAG, 0)
            return Message(self, None)
        arrival = progress.mprobe(source, tag)
        if arrival is None:
            return None
        if status is not None:
            status._fill(arrival.source, arrival.tag, arrival.nbytes)
        return Message(self, arrival)

    def Mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Status | None = None) -> Message:
        """``Improbe`` that waits for a message."""
        self.Probe(source, tag)
        message = self.Improbe(source, tag, status)
        assert message is not None  # probed just now, and only this thread receives
        return message

    improbe = Improbe
    mprobe = Mprobe

    def _mrecv(self, arrival: Arrival | None, buf: Any, is_object: bool) -> Request:
        """Receive the message of a matched probe (``buf`` unused for an object receive)."""
        if arrival is None:
            return self.make_request(self, null_recv(), is_object=is_object)
        mv = None if is_object else self.buffer_view(buf, recv_view)
        op = (self._progress or self._attach()).mrecv(arrival, mv)
        return self.make_request(self, op, is_object=is_object)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              status: Status | None = None) -> Literal[True]:
        """Wait until ``Iprobe`` would return True (``MPI.Comm.Probe``); fills ``status``.

        An eager message at the head of the ring, with no receive posted and none taken
        out of the rings before it, is reported from there and left in the ring for the
        receive that follows (its fast path then takes it)."""
        inbox = self._idle_inbox(source, tag)
        if inbox is not None:
            n = inbox.eager_at_head(tag)
            spins = self._fast_spins
            while n == RING_EMPTY and spins:
                spins -= 1
                n = inbox.eager_at_head(tag)
            if n >= 0:
                if status is not None:
                    status.source = self._inbox_peer[inbox]
                    status.tag = inbox.last_tag
                    status.count = n
                return True
            if n == RING_EMPTY and self._await_late(inbox, tag):
                return self.Probe(source, tag, status)  # (a packet is at the head now)
        progress = self._progress or self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source != PROC_NULL:
            progress.connect(source)  # (its exit must end the wait)
            progress.wait_until(lambda: progress.engine.probe(source, tag) is not None,
                             None if source == ANY_SOURCE else source)
        self.Iprobe(source, tag, status)
        return True

    iprobe = Iprobe
    probe = Probe

    # -- synchronisation

    def Barrier(self) -> None:
        """Dissemination barrier: ceil(log2 size) rounds of zero-byte messages (through the
        rings directly, as the collectives' messages go: a message that follows the
        barrier's stays in the ring for its own receive's fast path). Where this rank owes
        its peers anything (queued packets, a heap segment's announcement), it starts with
        a pass of progress, so that it is on its way before they leave the barrier; only
        then: a pass also drains the rings, and a peer's barrier message taken so went the
        slow way (docs/guide.md section 7, "Barrier", has the times)."""
        progress = self._progress or self._attach()
        if progress.owes():
            progress.poll()
        step = 1
        while step < self.size:
            dest = (self.rank + step) % self.size
            source = (self.rank - step) % self.size
            sending = self._coll_send(_EMPTY, dest, tag=BARRIER_TAG)
            self._coll_take(_EMPTY, source, tag=BARRIER_TAG)
            self._coll_wait(sending)
            step *= 2

    barrier = Barrier

    # -- statistics

    def stats(self) -> dict[str, dict[str, float]]:
        """What this process moved, per mechanism, counted as it happened.

        ``eager`` is the inline path (one user copy on each side, two on the receiving
        side for a message that arrived before its receive); the others are the
        transports that moved rendezvous messages. ``user_copies``/``kernel_copies`` are
        copied bytes per payload byte, so 1.0 means each byte was copied once here.
        """
        progress = self._progress
        if progress is None:
            return {"eager": self._eager_counts.report((), 0).as_dict()}
        boxes: list[Outbox | Inbox] = [*progress.outboxes.values(), *progress.inboxes.values()]
        out = {"eager": self._eager_counts.report(boxes, progress.engine.held_bytes).as_dict()}
        for name, transport in progress.transports.items():
            out[name] = transport.stats.as_dict()
        return out

    def reset_stats(self) -> None:
        """Zero the counters ``stats()`` reports (cma's own; mpi4py has none)."""
        progress = self._progress
        if progress is None:
            self._eager_counts.reset(())
            return
        progress.engine.held_bytes = 0
        self._eager_counts.reset([*progress.outboxes.values(), *progress.inboxes.values()])
        for transport in progress.transports.values():
            transport.stats.reset()

    # -- teardown

    def close(self) -> None:
        """Release the communicator (cma's own; ``Free`` is mpi4py's name); idempotent.

        First waits until every message a ``Send`` left queued behind a full ring is in the
        peer's ring (unless that peer exited), like ``MPI_Finalize``; then closes
        transports, drops the peers' fds and unmaps the segment, even when interrupted while
        waiting."""
        if self._closed:
            return
        held = claim(self)  # (unmapping the rings under another thread's call could crash it)
        self._closed = True
        self._send_obj = self._recv_obj = self._send_base = self._recv_base = _NOTHING
        self._last_inputs = self._last_bcast = None
        self._send_spec_view = self._recv_spec_view = memoryview(b"")
        try:
            if self._progress is not None:
                self._progress.close()
        finally:
            if self._world is not None:
                self._world.close()
                self._world = None
            self._progress = None
            self._fds.close()
            self._busy = held

    def Free(self) -> None:
        """``close()`` under mpi4py's name (``MPI.Comm.Free``)."""
        self.close()

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- argument checks

    def buffer_view(self, buf: Any, convert: Callable[[Any], memoryview]) -> memoryview:
        """Convert, attach if needed, and remember arrays and bytes (never resizable objects)
        and buffer specs (lists) over them, over bytearrays and over mmaps."""
        if self._progress is None:
            self._attach()
        if buf.__class__ is list:
            mv = self.spec_view(buf, convert)
            self.remember_spec(buf, mv, convert is send_view)
            return mv
        mv = convert(buf)
        if type(buf) is np.ndarray or type(buf) is bytes:
            if convert is send_view:
                self._send_obj, self._send_view = buf, mv
            else:
                self._recv_obj, self._recv_view = buf, mv
        return mv

    def spec_view(self, spec: list[Any], convert: Callable[[Any], memoryview]) -> memoryview:
        """The bytes a buffer spec names (cma's: [buf, typechar], [buf, count, typechar])."""
        return convert(spec)

    def remember_spec(self, spec: list[Any], mv: memoryview, sending: bool) -> None:
        """Keep what ``spec`` converted to, for the next call given an equal spec list (one
        written inline, ``[buf, n, MPI.BYTE]``, is a new list every call).

        For an array or bytes the view is kept; a bytearray or mmap is exported anew each
        time (~260 ns here) from the offsets kept here: a view kept alive would stop its
        owner from resizing or closing it.
        """
        base = spec[0]
        if mv.__class__ is not memoryview or mv.obj is not base:
            return  # not a view of the spec's buffer (cma.mpi: a datatype's packed copy)
        kind = base.__class__
        view = memoryview(b"")
        cut: tuple[int, int] | None = None
        if kind is np.ndarray or kind is bytes:
            view = mv
        elif kind is bytearray or kind is mmap.mmap:
            with memoryview(base) as whole:
                start = 0 if not mv.nbytes else \
                    _linux.buffer_address(mv) - _linux.buffer_address(whole)
            cut = (start, start + mv.nbytes)
        else:
            return
        if sending:
            self._send_base, self._send_spec = base, list(spec)
            self._send_spec_view, self._send_cut = view, cut
        else:
            self._recv_base, self._recv_spec = base, list(spec)
            self._recv_spec_view, self._recv_cut = view, cut

    def _check_dest(self, dest: Any) -> int:
        rank = _as_int(dest)
        if rank is None or (rank != PROC_NULL and not 0 <= rank < self.size):
            raise InvalidRank(f"destination rank {dest!r} is not in 0..{self.size - 1} (or PROC_NULL)")
        return rank

    def _check_source(self, source: Any) -> int:
        rank = _as_int(source)
        if rank is None or (rank not in (ANY_SOURCE, PROC_NULL) and not 0 <= rank < self.size):
            raise InvalidRank(
                f"source rank {source!r} is not in 0..{self.size - 1} (or ANY_SOURCE, PROC_NULL)")
        return rank

    def _check_tag(self, tag: Any, wildcard: bool = False) -> int:
        value = _as_int(tag)
        if value is None or value > TAG_MAX or (value < 0 and not (wildcard and value == ANY_TAG)):
            what = f"an int in 0..{TAG_MAX}" + (" or ANY_TAG" if wildcard else "")
            raise InvalidTag(f"tag {tag!r} must be {what}")
        return value

    # -- the general path

    def start_send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool,
                    eager: bool = True, sync: bool = False, pull_first: bool = False) -> SendOp:
        """Hook: start a send of ``segments`` in the engine and return its operation (every send that
        reaches the engine comes here). Overrides must pass plain memoryviews on."""
        return (self._progress or self._attach()).send(segments, dest, tag, is_object, eager, sync,
                                                       pull_first)

    def operation_completed(self, op: SendOp | RecvOp) -> None:
        """Told of every operation the engine completes (after its transport's stats
        counted it); here to be overridden."""

    def _ring(self, peer: int) -> None:
        _linux.ring_doorbell(self._fds.doorbells[peer])
        self._eager_counts.control_syscalls += 1



def _as_int(value: Any) -> int | None:
    """Integers and integer-likes such as NumPy's (as mpi4py accepts); None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# Ends announced by this process (see _rebuild_comm) and not attached yet.
_announced_ends: weakref.WeakSet[Comm] = weakref.WeakSet()


def _rebuild_comm(world_id: str, size: int, memfd: Any, doorbells: list[Any], config: str,
                  rank: int, transport: str, thresholds: dict[str, int],
                  options: dict[str, Any]) -> Comm:
    fds = WorldFds(world_id, size, memfd.detach(),
                   [-1 if b is None else b.detach() for b in doorbells], ChannelConfig.decode(config))
    comm = Comm(fds, rank, transport, thresholds, **options)
    # The process that unpickles an end (a spawned child) is the one that will use it:
    # recorded, its peers see it die before connecting instead of waiting for the timeout.
    announce(fds, rank, os.getpid())
    comm._announced = True
    _announced_ends.add(comm)
    return comm


def _after_fork_in_parent() -> None:
    # Parent or child may attach an end announced here: which one is unknown from now on.
    for comm in list(_announced_ends):
        if not comm._closed:
            comm._give_up_announcement()


# Attached in this process: a child forked from it inherits them, but not the rank.
_attached_comms: weakref.WeakSet[Comm] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The rank stays the parent's: a child writing into its rings would corrupt them.
    # Breaking costs the fast paths nothing, unlike a pid test per call.
    for comm in list(_attached_comms):
        comm._busy = 0  # (the thread inside a call at the fork is not in the child)
        progress = comm._progress
        if progress is not None and not progress.broken:
            progress.break_down(
                f"rank {comm.rank} is attached in process {os.getppid()}; a process forked from "
                "it cannot use that rank (hand a child an end before its first use, or make a "
                "new world)")


os.register_at_fork(after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def Pipe(transport: str = AUTO, *, config: ChannelConfig | None = None,
         thresholds: dict[str, int] | None = None, **options: Any) -> tuple[Comm, Comm]:
    """Two connected communicators of size 2 (rank 0 and rank 1), like multiprocessing.Pipe.

    Hand one end to a ``multiprocessing.Process`` (fork or spawn). Each end attaches on
    first use; the first operation waits until the other end is in use too.

    Each end holds 3 fds of its own (the segment and two doorbells). The end a process
    hands to a child and never uses itself is released when it is garbage-collected, as a
    ``multiprocessing.Connection`` is, so forgetting to close it leaks nothing. Closing
    one end does not close the other in the same process: the pattern "start a child
    with ``a``, close ``a``, then start another with ``b``" must keep working. An end
    that attached is released by ``close()`` (or a ``with`` block).

    If a child started with ``spawn`` or ``forkserver`` exits before using its end, the
    other end's first operation raises ``PeerGone`` naming it (the child records its pid
    when it unpickles the end). A child started by ``fork`` cannot be told from a slow
    one: the other end waits up to ``CMA_CONNECT_TIMEOUT`` and then says that rank never
    connected.
    """
    fds = WorldFds.create(2, config)
    a = Comm(fds, 0, transport, thresholds, **options)
    b = Comm(_shared_fds(fds), 1, transport, thresholds, **options)
    return a, b


def _shared_fds(fds: WorldFds) -> WorldFds:
    """Own duplicates, so each end closes its fds without pulling them from under the other."""
    return WorldFds(fds.world_id, fds.size, os.dup(fds.memfd),
                    [os.dup(b) for b in fds.doorbells], fds.config)


_world_comm: Comm | None = None


def world_comm() -> Comm:
    """The ``COMM_WORLD`` of this process: from ``cma-run``'s environment, else a world of one."""
    global _world_comm
    if _world_comm is None:
        text = os.environ.get(ENV_WORLD)
        if text:
            fds, rank = WorldFds.from_env(text)
        else:
            fds, rank = WorldFds.create(1), 0
        _world_comm = Comm(fds, rank, os.environ.get(ENV_TRANSPORT, AUTO))
    return _world_comm

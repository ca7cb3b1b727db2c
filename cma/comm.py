"""Comm: the one send/recv API, shaped like mpi4py's (its requests: requests.py).

The I/O half of the protocol: ``protocol.Engine`` decides, this module acts (rings,
transports, staging, doorbells). Two paths:

* the eager fast path of ``Send``/``Recv`` writes or reads one ring slot directly: no
  ctypes call, no request object, no pickling. It is taken only when it cannot change
  the outcome of matching (nothing posted, nothing unexpected, ring not backed up).
* everything else goes through the engine and ``_wait``'s progress loop.

A communicator is used by one thread at a time (like MPI_THREAD_SERIALIZED).
"""

from __future__ import annotations

import mmap
import operator
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal, cast

import numpy as np

from . import _linux
from ._exporters import cai_array, dlpack_array
from ._pool import ProcessPool
from .channel import ChannelConfig, Inbox, Outbox
from .errors import (
    BufferError,
    Cancelled,
    CmaError,
    CommBroken,
    InvalidCount,
    InvalidDatatype,
    InvalidRank,
    InvalidTag,
    NotTransferable,
    PeerGone,
    TransportUnavailable,
)
from .protocol import (
    PIPELINE,
    PROTOCOL_NAMES,
    PULL,
    PUSH,
    Action,
    Arrival,
    Complete,
    Deliver,
    Engine,
    Joiner,
    Pipeline,
    Policy,
    Pull,
    Push,
    RecvOp,
    SendOp,
    Stream,
    StreamIn,
    StreamOut,
    Transmit,
    completed_recv,
    slice_views,
    split_packet,
)
from .requests import Message, Request, Status, null_recv
from .transports import REGISTRY, Region, Transport, TransportStats
from .wire import ANY_SOURCE, ANY_TAG, BARRIER_TAG, EAGER, KIND_MASK, MORE, PROC_NULL
from .world import ENV_TRANSPORT, ENV_WORLD, PeerLink, World, WorldFds, announce

AUTO = "auto"
# Preference for large messages under "auto": fewest copies first.
AUTO_ORDER = ["cma", "vmfd", "shm"]
# Smallest rendezvous message each transport takes under "auto" (bytes). Here shm's
# pipelined double copy beat one-sided cma and vmfd copies at every size, and cma with both
# sides copying (SPLIT) matched it from 4 MiB (docs/transports.md has the runs); where
# one-sided copies win, lower them: thresholds={"cma": 0} also lifts the SPLIT rule.
NEVER = 1 << 62
# An Isend of at least this many bytes (within the eager limit) that finds the ring full
# goes as a rendezvous, which won from here on, instead of a copy queued for the ring
# (docs/architecture.md, "The eager fast path", has the runs). Send keeps queueing: two
# ranks that Send to each other before receiving must not wait for each other's receive.
QUEUED_COPY_LIMIT = 512 << 10
AUTO_THRESHOLDS = {"cma": 4 << 20, "vmfd": NEVER, "shm": 0}
AUTO_SPLIT_ONLY = {"cma"}

# How long a blocked call spins before it sleeps. Waking a sleeping process costs from
# ~10 us to several hundred on the project's VM (an idle vCPU must be woken), so a
# wait that a peer will end soon should spin rather than sleep.
SPIN_SECONDS = float(os.environ.get("CMA_SPIN_US", "1000")) * 1e-6
# A sender of a large rendezvous message spins for about as long as the peer's copy
# takes at this rate, yielding the CPU as it spins: the peer's copy threads need it.
SLOWEST_COPY_BYTES_PER_S = 1e9
YIELD_FROM_BYTES = 1 << 20
SLEEP_MS = 10
# Recv's fast path polls the ring this often (a poll of an empty ring costs ~0.1-0.2 us
# here: well under a millisecond in all) before the general path, which spins, then sleeps.
_FAST_SPINS = 4000

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
    """Bytes [start, stop) of a fresh export of a bytearray or mmap (see _remember_spec)."""
    return memoryview(base)[cut[0] : cut[1]]


def _region(mv: memoryview) -> Region:
    return Region(_linux.buffer_address(mv), mv.nbytes)


def _allocate(nbytes: int) -> memoryview:
    return np.empty(nbytes, dtype=np.uint8).data


# ------------------------------------------------------------------ Comm

class Comm:
    """A communicator of ``size`` ranks on one machine; this object is rank ``rank``."""

    # What the non-blocking calls return: a subclass may hand out requests of its own
    # (cma.mpi's node communicator: mpi4py's statuses and errors) at no cost per call.
    _request: type[Request] = Request

    def __init__(self, fds: WorldFds, rank: int, transport: str = AUTO,
                 thresholds: dict[str, int] | None = None, **transport_options: Any) -> None:
        if transport != AUTO and transport not in REGISTRY.classes:
            raise TransportUnavailable(
                f"unknown transport {transport!r}; registered: {', '.join(REGISTRY.classes)}, auto"
            )
        self._fds = fds
        self.rank = rank
        self.size = fds.size
        self._transport_name = transport
        self._transport_options = transport_options
        # overlap: a pipeline needs both processes inside cma calls, a pull does not
        self._overlap = bool(transport_options.get("overlap"))
        self._copier = ProcessPool(1, "cma-pull")  # overlap: runs pulls in the background
        self._pulls: deque[tuple[Future[None], Pull]] = deque()
        self._user_thresholds = dict(thresholds or {})  # what a pickled copy must rebuild from
        overlap = {"cma": 0} if self._overlap else {}
        self._thresholds = {**AUTO_THRESHOLDS, **overlap, **self._user_thresholds}
        self._eager_limit = fds.config.eager_limit
        self._attached = False
        self._closed = False
        self._world: World | None = None
        # One-entry view caches: repeated sends/receives of the same array skip the
        # buffer-protocol export (~0.2-0.5 us, the largest cost of a small message).
        # A receive still asks the array whether it is writeable (~40-90 ns): numpy
        # lets it be made read-only after its view was taken.
        self._lanes: dict[int, Outbox] = {}  # filled at attach; empty means "take the slow path"
        self._rlanes: dict[int, Inbox] = {}
        self._only_peer = ANY_SOURCE
        self._send_obj: Any = _NOTHING
        self._send_view = memoryview(b"")
        self._recv_obj: Any = _NOTHING
        self._recv_view = memoryview(bytearray())
        # The same for the last buffer spec list: its buffer, a copy of the list, and the
        # view (arrays, bytes) or where in a fresh export of it the bytes are (bytearray,
        # mmap); see _remember_spec.
        self._send_base: Any = _NOTHING
        self._send_spec: list[Any] = []
        self._send_spec_view = memoryview(b"")
        self._send_cut: tuple[int, int] | None = None
        self._recv_base: Any = _NOTHING
        self._recv_spec: list[Any] = []
        self._recv_spec_view = memoryview(b"")
        self._recv_cut: tuple[int, int] | None = None
        self._eager_base = (0, 0)  # ring counts at the last reset_stats()
        self._eager_extra = 0  # copies into packets queued for a full ring
        self._looped = (0, 0)  # eager messages and bytes sent to ourselves
        self._buffered: list[SendOp] = []  # Bsend's rendezvous messages, sent from copies
        self._control_syscalls = 0
        # An end this process never attaches (the one handed to a child) closes its fds when
        # it is garbage-collected, as multiprocessing's Connection does; see Pipe().
        self._release_unused = weakref.finalize(self, fds.close)
        self._announced = False  # this process is recorded as the one to attach this rank
        self._broken = ""  # why the communicator is unusable (see _break), or ""

    # -- mpi4py-style accessors

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    @property
    def transport(self) -> str:
        return self._transport_name

    def __repr__(self) -> str:
        return f"<cma.Comm rank {self.rank} of {self.size}, transport {self._transport_name!r}>"

    # -- pickling for multiprocessing (spawn/forkserver): the fds travel with the process

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        if self._closed or self._attached:
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
                                [DupFd(b) for b in fds.doorbells], fds.config.encode(),
                                self.rank, self._transport_name, self._user_thresholds,
                                self._transport_options))

    # -- connect time

    def _give_up_announcement(self) -> None:
        """No longer claim to be the process that will attach this end (0: unknown)."""
        self._announced = False
        _announced_ends.discard(self)
        announce(self._fds, self.rank, 0)

    def _attach(self) -> None:
        if self._closed:
            raise CmaError("communicator is closed")
        self._release_unused.detach()  # attached: close() releases everything
        _announced_ends.discard(self)
        world = World(self._fds, self.rank)
        self._world = world
        names = REGISTRY.practical() if self._transport_name == AUTO else [self._transport_name]
        # push concerns every transport (prefer RPUT, so every one that can write is set up
        # to: vmfd exchanges read-write fds); other options belong to the one named
        options = dict(self._transport_options)
        push = bool(options.pop("push", False))
        self._prefer_push = push
        self._split = bool(options.pop("split", True))
        options.pop("overlap", None)
        self._transports: dict[str, Transport] = {}
        for name in names:
            cls = REGISTRY.classes[name]
            writes = True if push and "push" in cls.styles else None  # None: the class default
            self._transports[name] = cls(world, writes=writes,
                                         **(options if self._transport_name != AUTO else {}))
        self._reasons: dict[int, dict[str, str]] = {}
        self._links: list[PeerLink | None] = [None] * self.size
        world.attach(self._probe_peers)
        self._setup_policy(names)
        self._outboxes = world.outboxes
        self._inboxes = world.inboxes
        self._peers = [p for p in range(self.size) if p != self.rank]
        self._txq: list[deque[tuple[int, int, int, bytes]]] = [deque() for _ in range(self.size)]
        self._txq_pending = 0
        self._loopback: deque[tuple[int, int, int, bytes]] = deque()
        self._out_streams: dict[int, Stream] = {}  # PIPELINE sends, per peer
        self._in_streams: dict[int, Stream] = {}  # PIPELINE receives, per peer
        self._dead: set[int] = set()
        self._joiner = Joiner()  # pieces of split control packets
        self._oversubscribed = self.size > (os.cpu_count() or 1)
        self._matcher = self._engine.matcher
        self._only_peer = 1 - self.rank if self.size == 2 else ANY_SOURCE
        # Fast lanes: peers whose eager messages may bypass the engine right now. A peer
        # leaves _lanes while packets to it wait in _txq (order), and _rlanes while
        # packets to ourselves wait in _loopback or ranks outnumber cores (no spinning).
        self._all_lanes = {p: box for p, box in enumerate(self._outboxes) if box is not None}
        self._all_rlanes = {p: box for p, box in enumerate(self._inboxes) if box is not None}
        self._rlane_rank = {box: p for p, box in self._all_rlanes.items()}
        self._lanes = dict(self._all_lanes)
        self._rlanes = {} if self._oversubscribed else dict(self._all_rlanes)
        self._attached = True

    def _probe_peers(self, world: World) -> dict[int, int]:
        masks = {}
        for peer in range(self.size):
            if peer == self.rank:
                continue
            link = PeerLink(world, peer)
            self._links[peer] = link
            mask = 0
            for bit, (name, transport) in enumerate(self._transports.items()):
                try:
                    transport.connect(link)
                    mask |= 1 << bit
                except (TransportUnavailable, CmaError, OSError) as exc:
                    self._reasons.setdefault(peer, {})[name] = str(exc)
            masks[peer] = mask
        return masks

    def _setup_policy(self, names: list[str]) -> None:
        world = self._world
        assert world is not None
        bits = {name: 1 << i for i, name in enumerate(names)}
        forced = None if self._transport_name == AUTO else self._transport_name
        if forced is not None:
            for r in range(self.size):
                for p in range(self.size):
                    if r != p and not world.reach(r, p) & bits[forced]:
                        reason = self._reasons.get(p, {}).get(forced) if r == self.rank else None
                        raise TransportUnavailable(
                            f"transport {forced!r} cannot be used from rank {r} to rank {p}"
                            + (f": {reason}" if reason else " (see that rank's error)")
                        )
        policy = Policy(
            order=[n for n in AUTO_ORDER if n in names] or names,
            thresholds=self._thresholds if forced is None else {},
            forced=forced,
            staged={n for n in names if "staged" in REGISTRY.classes[n].styles},
            push=self._prefer_push,
            split=self._split,
            # overlap wants pulls even one-sided: a pipeline needs both processes in cma
            split_only=(set() if forced is not None or self._overlap
                        else AUTO_SPLIT_ONLY - set(self._user_thresholds)),
        )
        for p in range(self.size):
            if p == self.rank:
                continue
            policy.pullable[p] = {n for n in names if world.reach(self.rank, p) & bits[n]
                                  and "pull" in REGISTRY.classes[n].styles}
            policy.pushable[p] = {n for n in names if world.reach(p, self.rank) & bits[n]
                                  and self._transports[n].writes}
        policy.pullable[self.rank] = {"self"}
        policy.order = ["self", *policy.order]
        if forced:
            policy.forced = None
            policy.order = ["self", forced]
        self._engine = Engine(self.rank, self._eager_limit, policy, PULL | PUSH | PIPELINE,
                              allocate=_allocate, region_of=_region)

    def attach(self) -> None:
        """Connect now instead of at the first operation (every rank must attach)."""
        if not self._attached:
            self._attach()

    def progress(self) -> bool:
        """Move whatever can move without blocking; True if anything did."""
        if not self._attached:
            self._attach()
        return self._progress()

    def transports(self) -> dict[int, dict[str, Any]]:
        """Per peer: the transports usable with it, the one a large message would use (as
        ``auto``'s thresholds decide), and why the others are unavailable."""
        if not self._attached:
            self._attach()
        policy = self._engine.policy
        report = {}
        for p in self._peers:
            usable = [n for n in policy.order if n in policy.pullable[p] | policy.pushable[p]
                      or n in policy.staged]
            mode, large = policy.choose(p, 1 << 40, PULL | PUSH | PIPELINE)
            report[p] = {"uses": large, "protocol": PROTOCOL_NAMES[mode], "usable": usable,
                         "unavailable": dict(self._reasons.get(p, {}))}
        return report

    # -- blocking buffer point-to-point (eager fast paths inline)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        if buf is self._send_obj:
            mv = self._send_view
        elif buf.__class__ is list and buf and buf[0] is self._send_base and buf == self._send_spec:
            mv = self._send_spec_view if self._send_cut is None else _export(self._send_base, self._send_cut)
        elif buf.__class__ is bytearray:
            mv = memoryview(buf)
        else:
            mv = self._cached_view(buf, send_view)
        n = mv.nbytes
        lane = self._lanes.get(dest)
        if lane is not None and n <= self._eager_limit and type(tag) is int and tag >= 0:
            sleeping = lane.put_eager(tag, mv, n)
            if sleeping == 0:
                return
            if sleeping > 0:
                self._ring(dest)
                return
        self._send(mv, dest, tag)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> None:
        if buf is self._recv_obj and buf.flags.writeable:
            mv = self._recv_view
        elif buf.__class__ is list and buf and buf[0] is self._recv_base and buf == self._recv_spec \
                and (self._recv_cut is not None or self._recv_base.flags.writeable):
            mv = self._recv_spec_view if self._recv_cut is None else _export(self._recv_base, self._recv_cut)
        elif buf.__class__ is bytearray and self._attached:  # (the matcher exists once attached)
            mv = memoryview(buf)
        else:
            mv = self._cached_view(buf, recv_view)
        matcher = self._matcher
        box = self._rlanes.get(self._only_peer if source == ANY_SOURCE else source)
        if box is not None and type(tag) is int and tag >= ANY_TAG and not matcher.posted \
                and not matcher.unexpected:
            n = box.take_eager(mv, tag)
            spins = _FAST_SPINS
            while n == -2 and spins:
                spins -= 1
                n = box.take_eager(mv, tag)
            if n >= 0:
                if status is not None:
                    status.source = self._rlane_rank[box]
                    status.tag = box.last_tag
                    status.count = n
                return
        self._recv(mv, source, tag, status)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Status | None = None) -> None:
        send = self.Isend(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)
        send.Wait()

    # -- synchronous and buffered modes (mpi4py's Ssend and Bsend families)

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:
        """A send that returns once a receive has matched the message (``MPI_Ssend``)."""
        self.Issend(buf, dest, tag).Wait()

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        mv = self._cached_view(buf, send_view)
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return self._request(self, None)
        return self._request(self, self._start_send([mv], dest, tag, False, sync=True))

    def Bsend(self, buf: Any, dest: int, tag: int = 0) -> None:
        """A send that returns at once, the message copied (``MPI_Bsend``).

        cma needs no attached buffer: a message within the eager limit is copied into the
        ring (or the send queue), a larger one into memory of its own that the receiver
        reads when it matches; ``close()`` waits for those, as MPI_Buffer_detach does.
        """
        self.Ibsend(buf, dest, tag)

    def Ibsend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        mv = self._cached_view(buf, send_view)
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest != PROC_NULL:
            self._start_buffered([mv], dest, tag, False)
        return self._request(self, None)

    def _start_buffered(self, segments: list[memoryview], dest: int, tag: int, is_object: bool
                        ) -> None:
        if sum(s.nbytes for s in segments) <= self._eager_limit and len(segments) == 1:
            self._start_send(segments, dest, tag, is_object)  # complete once in a packet
            return
        copies = [memoryview(bytearray(s)) for s in segments]
        self._buffered = [op for op in self._buffered if not op.done]
        self._buffered.append(self._start_send(copies, dest, tag, is_object))

    def Isendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                  source: int = ANY_SOURCE, recvtag: int = ANY_TAG) -> Request:
        """Send and receive at once (``MPI_Isendrecv``): one request, the receive's status."""
        smv = self._cached_view(sendbuf, send_view)
        dest = self._check_dest(dest)
        sendtag = self._check_tag(sendtag)
        send = None if dest == PROC_NULL else self._start_send([smv], dest, sendtag, False)
        rmv = self._cached_view(recvbuf, recv_view)
        source = self._check_source(source)
        recvtag = self._check_tag(recvtag, wildcard=True)
        if source == PROC_NULL:
            op = null_recv()
        else:
            op, actions = self._engine.recv(source, recvtag, rmv)
            self._run(actions)
        return self._request(self, op, also=send)

    def Isendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0,
                          source: int = ANY_SOURCE, recvtag: int = ANY_TAG) -> Request:
        """``Isendrecv`` with one buffer: what is sent is copied first."""
        outgoing = bytes(self._cached_view(buf, send_view))
        return self.Isendrecv(outgoing, dest, sendtag, buf, source, recvtag)

    # The general paths of Send and Recv, apart so that a subclass can adapt what they
    # raise and fill (cma.mpi's node communicator) without a frame on the hot paths.

    def _send(self, mv: memoryview, dest: Any, tag: Any) -> None:
        if not self._attached:  # (a bytearray's fast path comes here before attaching)
            self._attach()
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return
        self._wait(self._start_send([mv], dest, tag, False))

    def _recv(self, mv: memoryview, source: Any, tag: Any, status: Status | None) -> None:
        if not self._attached:  # (a bytearray's fast path comes here before attaching)
            self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            if status is not None:
                status._fill(PROC_NULL, ANY_TAG, 0)
            return
        op, actions = self._engine.recv(source, tag, mv)
        self._run(actions)
        Request(self, op).Wait(status)

    # -- non-blocking buffer point-to-point

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        if buf is self._send_obj:
            mv = self._send_view
        elif buf.__class__ is list and buf and buf[0] is self._send_base and buf == self._send_spec:
            mv = self._send_spec_view if self._send_cut is None else _export(self._send_base, self._send_cut)
        elif buf.__class__ is bytearray:
            mv = memoryview(buf)
        else:
            mv = self._cached_view(buf, send_view)
        n = mv.nbytes
        if n <= self._eager_limit:
            # An eager send is complete once its packet is in the ring or queued, so it
            # never blocks. Send's hot path is written out here again: calling Send cost
            # ~75 ns (a frame and a second view lookup) of a ~715 ns Isend.
            lane = self._lanes.get(dest)
            if lane is not None and type(tag) is int and tag >= 0:
                sleeping = lane.put_eager(tag, mv, n)
                if sleeping >= 0:
                    if sleeping:
                        self._ring(dest)
                    return self._request(self, None)
            if n < QUEUED_COPY_LIMIT or lane is not None and lane.fits(n):
                self._send(mv, dest, tag)
                return self._request(self, None)
        return self._isend(mv, dest, tag)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        # (Recv's view lookup, written out again as Isend writes out Send's)
        if buf is self._recv_obj and buf.flags.writeable:
            mv = self._recv_view
        elif buf.__class__ is list and buf and buf[0] is self._recv_base and buf == self._recv_spec \
                and (self._recv_cut is not None or self._recv_base.flags.writeable):
            mv = self._recv_spec_view if self._recv_cut is None else _export(self._recv_base, self._recv_cut)
        elif buf.__class__ is bytearray and self._attached:  # (the matcher exists once attached)
            mv = memoryview(buf)
        else:
            mv = self._cached_view(buf, recv_view)
        matcher = self._matcher
        box = self._rlanes.get(self._only_peer if source == ANY_SOURCE else source)
        if box is not None and type(tag) is int and tag >= ANY_TAG:
            peer = self._rlane_rank[box]
            if matcher.posted:
                # Receives posted earlier match first: let them take what has arrived
                # for them (a window of Irecvs then finds its messages waiting, below).
                self._drain(peer, True)
            if not matcher.posted and not matcher.unexpected:
                # Already at the head of the ring with nothing ahead of it in matching
                # order: complete now, as Recv would, instead of posting to the engine.
                n = box.take_eager(mv, tag)
                if n >= 0:
                    return self._request(self, completed_recv(source, tag, mv, peer, box.last_tag, n))
        return self._irecv(mv, source, tag)

    # Their general paths, apart for the same reason as _send and _recv.

    def _isend(self, mv: memoryview, dest: Any, tag: Any) -> Request:
        if not self._attached:  # (a bytearray's fast path comes here before attaching)
            self._attach()
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return self._request(self, None)
        # (for a message within the eager limit: the ring is full, and a rendezvous costs
        # less than copying the payload into a packet that waits for the ring; the
        # receiver pulls it where it can, see Policy.choose)
        return self._request(self, self._start_send([mv], dest, tag, False, eager=False))

    def _irecv(self, mv: memoryview, source: Any, tag: Any) -> Request:
        if not self._attached:  # (a bytearray's fast path comes here before attaching)
            self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            return self._request(self, null_recv())
        op, actions = self._engine.recv(source, tag, mv)
        self._run(actions)
        return self._request(self, op)

    # -- objects (pickle protocol 5, large buffers out of band through the transport)

    def _pickle(self, obj: Any) -> list[memoryview]:
        oob: list[memoryview] = []
        limit = self._eager_limit

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            raw = buffer.raw()
            if raw.nbytes <= limit:
                return True  # small buffers stay in the stream
            oob.append(raw)
            return False

        stream = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
        return [memoryview(stream), *oob]

    def _unpickle(self, op: RecvOp) -> Any:
        if not op.is_object:
            return bytearray(op.segments[0]) if op.segments else bytearray()
        stream, *buffers = op.segments
        return pickle.loads(stream, buffers=buffers)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.isend(obj, dest, tag).Wait()

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._isend_object(obj, dest, tag, sync=False)

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """``send`` that returns once a receive has matched the message."""
        self.issend(obj, dest, tag).Wait()

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._isend_object(obj, dest, tag, sync=True)

    def bsend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """``send`` that returns at once: the object's buffers are copied (see ``Bsend``)."""
        self.ibsend(obj, dest, tag)

    def ibsend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._isend_object(obj, dest, tag, sync=False, buffered=True)

    def _isend_object(self, obj: Any, dest: Any, tag: Any, sync: bool, buffered: bool = False
                      ) -> Request:
        if not self._attached:
            self._attach()
        dest = self._check_dest(dest)
        tag = self._check_tag(tag)
        if dest == PROC_NULL:
            return self._request(self, None)
        segments = self._pickle(obj)
        if buffered:
            self._start_buffered(segments, dest, tag, True)
            return self._request(self, None)
        return self._request(self, self._start_send(segments, dest, tag, True, sync=sync))

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> Any:
        return self.irecv(buf, source, tag).wait(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Receive an object of any size (``buf`` is accepted for mpi4py compatibility, unused)."""
        if not self._attached:
            self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            return self._request(self, null_recv(), is_object=True)
        op, actions = self._engine.recv(source, tag, None)
        self._run(actions)
        return self._request(self, op, is_object=True)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Status | None = None) -> Any:
        send = self.isend(sendobj, dest, sendtag)
        obj = self.recv(recvbuf, source, recvtag, status)
        send.Wait()
        return obj

    # -- probes

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Status | None = None) -> bool:
        if not self._attached:
            self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            if status is not None:
                status._fill(PROC_NULL, ANY_TAG, 0)
            return True
        self._progress()
        arrival = self._engine.probe(source, tag)
        if arrival is None:
            return False
        if status is not None:
            status._fill(arrival.source, arrival.tag, arrival.nbytes)
        return True

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: Status | None = None) -> Message | None:
        """A matched probe (``MPI_Improbe``): the message found, which no other receive can
        take from then on; ``None`` if there is none yet."""
        if not self._attached:
            self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source == PROC_NULL:
            if status is not None:
                status._fill(PROC_NULL, ANY_TAG, 0)
            return Message(self, None)
        self._progress()
        arrival = self._engine.mprobe(source, tag)
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
            return self._request(self, null_recv(), is_object=is_object)
        mv = None if is_object else self._cached_view(buf, recv_view)
        op, actions = self._engine.mrecv(arrival, mv)
        self._run(actions)
        return self._request(self, op, is_object=is_object)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              status: Status | None = None) -> Literal[True]:
        if not self._attached:
            self._attach()
        source = self._check_source(source)
        tag = self._check_tag(tag, wildcard=True)
        if source != PROC_NULL:
            self._wait_until(lambda: self._engine.probe(source, tag) is not None,
                             None if source == ANY_SOURCE else source)
        self.Iprobe(source, tag, status)
        return True

    iprobe = Iprobe
    probe = Probe

    # -- synchronisation

    def Barrier(self) -> None:
        """Dissemination barrier: ceil(log2 size) rounds of zero-byte messages."""
        if not self._attached:
            self._attach()
        empty = memoryview(bytearray(0))
        step = 1
        while step < self.size:
            dest = (self.rank + step) % self.size
            source = (self.rank - step) % self.size
            sent = self._start_send([empty], dest, BARRIER_TAG, False)
            op, actions = self._engine.recv(source, BARRIER_TAG, empty)
            self._run(actions)
            self._wait(op)
            self._wait(sent)
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
        eager = TransportStats(*self._looped, syscalls=self._control_syscalls)
        held = 0
        if self._attached:
            held = self._engine.held_bytes
            boxes: list[Outbox | Inbox] = [*self._all_lanes.values(), *self._all_rlanes.values()]
            for box in boxes:
                eager.messages += box.eager_count
                eager.bytes += box.eager_bytes
            eager.messages -= self._eager_base[0]
            eager.bytes -= self._eager_base[1]
        # a message to ourselves is copied twice here: into its packet and out of it
        eager.user_copy_bytes = eager.bytes + self._eager_extra + self._looped[1] + held
        out = {"eager": eager.as_dict()}
        if self._attached:
            for name, transport in self._transports.items():
                out[name] = transport.stats.as_dict()
        return out

    def reset_stats(self) -> None:
        self._eager_extra = self._control_syscalls = 0
        self._eager_base = self._looped = (0, 0)
        if self._attached:
            self._engine.held_bytes = 0
            current = self.stats()["eager"]
            self._eager_base = (int(current["messages"]), int(current["bytes"]))
            for transport in self._transports.values():
                transport.stats.reset()

    # -- teardown

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_obj = self._recv_obj = self._send_base = self._recv_base = _NOTHING
        self._send_spec_view = self._recv_spec_view = memoryview(b"")
        try:
            copier_stopped = self._copier.shutdown()
            if self._attached and not self._broken and self._world is not None \
                    and self._world.owned_here():
                if copier_stopped:
                    self._finish_pulls()  # no pull may outlive the fds it reads through
                self._overlap = False  # a pull matched from here on copies at once
                self._deliver_queued()  # including the FINs their senders wait for
                self._world.mark_closed()
        finally:
            if self._attached:
                for transport in self._transports.values():
                    for link in self._links:
                        if link is not None:
                            transport.disconnect(link)
                    transport.close()
            if self._world is not None:
                self._world.close()
                self._world = None
            self._attached = False
            self._fds.close()

    def Free(self) -> None:
        self.close()

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- argument checks

    def _cached_view(self, buf: Any, convert: Callable[[Any], memoryview]) -> memoryview:
        """Convert, attach if needed, and remember arrays and bytes (never resizable objects)
        and buffer specs (lists) over them, over bytearrays and over mmaps."""
        if not self._attached:
            self._attach()
        if buf.__class__ is list:
            mv = self._spec_view(buf, convert)
            self._remember_spec(buf, mv, convert is send_view)
            return mv
        mv = convert(buf)
        if type(buf) is np.ndarray or type(buf) is bytes:
            if convert is send_view:
                self._send_obj, self._send_view = buf, mv
            else:
                self._recv_obj, self._recv_view = buf, mv
        return mv

    def _spec_view(self, spec: list[Any], convert: Callable[[Any], memoryview]) -> memoryview:
        """The bytes a buffer spec names (cma's: [buf, typechar], [buf, count, typechar])."""
        return convert(spec)

    def _remember_spec(self, spec: list[Any], mv: memoryview, sending: bool) -> None:
        """Keep what ``spec`` converted to, for the next call given an equal spec list (one
        written inline, ``[buf, n, MPI.BYTE]``, is a new list every call).

        For an array or bytes the view is kept; a bytearray or mmap is exported anew each
        time (~60 ns) from the offsets kept here: a view kept alive would stop its owner
        from resizing or closing it.
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
        if value is None or (value < 0 and not (wildcard and value == ANY_TAG)):
            what = "a non-negative int" + (" or ANY_TAG" if wildcard else "")
            raise InvalidTag(f"tag {tag!r} must be {what}")
        return value

    # -- the general path

    def _start_send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool,
                    eager: bool = True, sync: bool = False) -> SendOp:
        op, actions = self._engine.send(dest, tag, segments, is_object, eager=eager, sync=sync)
        self._run(actions)
        return op

    def _peer_sleeping(self, peer: int) -> int:
        return self._all_lanes[peer].peer_sleeping[0]

    def _ring(self, peer: int) -> None:
        _linux.ring_doorbell(self._fds.doorbells[peer])
        self._control_syscalls += 1

    def _transmit(self, dest: int, kind: int, tag: int, aux: int, payload: bytes) -> None:
        if dest == self.rank:
            if kind & KIND_MASK == EAGER:
                self._looped = (self._looped[0] + 1, self._looped[1] + len(payload))
            self._loopback.append((kind, tag, aux, payload))
            self._rlanes = {}
            return
        limit = self._fds.config.max_packet
        if len(payload) > limit:  # (a control packet larger than the ring: see _drain)
            for piece_kind, piece in split_packet(kind, payload, limit):
                self._transmit(dest, piece_kind, tag, aux, piece)
            return
        queue = self._txq[dest]
        packet = (kind, tag, aux, payload)
        if queue or not self._put(dest, packet):
            queue.append(packet)
            self._txq_pending += 1
            self._lanes.pop(dest, None)
            return
        if self._peer_sleeping(dest):
            self._ring(dest)

    def _deliver_queued(self) -> None:
        """Wait until the packets queued for each peer are in its ring, and the buffered
        sends to it received, or moot.

        A send that found the ring full returned with its packet queued here; the ring
        outlives this process, the queue does not. Like MPI_Finalize after a buffered
        send, this waits for the peer to read: a peer that has exited or closed never
        will, and a peer that waits for this process to exit first deadlocks.
        """
        world = self._world
        assert world is not None
        for dest in self._peers:
            queue = self._txq[dest]
            buffered = [op for op in self._buffered if op.dest == dest]
            if (queue or buffered) and dest not in self._dead:
                try:
                    self._wait_until(lambda: not queue and all(op.done for op in buffered)  # noqa: B023
                                     or world.has_closed(dest), dest)  # noqa: B023
                except PeerGone:
                    pass
        self._buffered.clear()

    def _put(self, dest: int, packet: tuple[int, int, int, bytes]) -> bool:
        """Write one packet into ``dest``'s ring if it fits now."""
        kind, tag, aux, payload = packet
        if not self._all_lanes[dest].put(kind, tag, aux, payload):
            return False
        if kind & KIND_MASK == EAGER:
            self._eager_extra += len(payload)  # the copy into a bytes object before the ring
        return True

    def _flush(self) -> bool:
        moved = False
        for dest in self._peers:
            queue = self._txq[dest]
            sent = False
            while queue and self._put(dest, queue[0]):
                queue.popleft()
                self._txq_pending -= 1
                sent = True
            if not queue:
                self._lanes[dest] = self._all_lanes[dest]
            if sent and self._peer_sleeping(dest):
                self._ring(dest)
            moved = moved or sent
        return moved

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Transmit):
                self._transmit(action.dest, action.kind, action.tag, action.aux, action.payload)
            elif isinstance(action, Deliver):
                self._deliver(action.op, action.payload)
            elif isinstance(action, Pull):
                self._pull(action)
            elif isinstance(action, Push):
                self._push(action)
            elif isinstance(action, StreamOut):
                self._stream_of(self._out_streams, action.op.dest, True).add(action.op)
            elif isinstance(action, StreamIn):
                self._stream_of(self._in_streams, action.op.matched_source, False).add(action.op)
            elif isinstance(action, Complete):
                self._completed(action.op)

    def _deliver(self, op: RecvOp, payload: bytes | memoryview) -> None:
        n = len(payload)
        if op.buffer is None:
            op.segments = [memoryview(bytes(payload))]
        elif n:
            op.buffer[:n] = payload

    def _completed(self, op: SendOp | RecvOp) -> None:
        if op.mechanism in ("eager", "self") or (isinstance(op, RecvOp) and op.error is not None):
            return
        stats = self._transports[op.mechanism].stats
        stats.messages += 1
        stats.bytes += op.nbytes

    def _pull(self, action: Pull) -> None:
        op = action.op
        if action.peer == self.rank:
            op.mechanism = "self"
            self._copy_self(action.remote, action.local)
        else:
            link = self._links[action.peer]
            assert link is not None
            read = self._transports[action.transport].read
            if self._overlap:
                started = threading.Event()

                def copy() -> None:
                    started.set()
                    read(link, action.remote, action.local)

                future = self._copier.get().submit(copy)
                future.add_done_callback(self._wake_self)
                self._pulls.append((future, action))
                if len(self._pulls) == 1:
                    # Return once the thread runs: it needs the GIL to start the copy,
                    # and caller code computing in Python would keep it for a switch
                    # interval (5 ms); inside the system call it no longer needs it.
                    # (Behind an earlier pull, waiting would mean waiting for that copy.)
                    started.wait()
                return
            read(link, action.remote, action.local)
        self._run(self._engine.pulled(op, action.msgid))

    def _wake_self(self, _: Future[None]) -> None:
        """Ring our own doorbell from the copy thread, in case this rank sleeps in a wait."""
        if not self._closed:
            _linux.ring_doorbell(self._fds.doorbells[self.rank])

    def _finish_pulls(self) -> bool:
        """Complete the background pulls that are done, in order; True if any was."""
        pulls = self._pulls
        finished = False
        while pulls and pulls[0][0].done():
            future, action = pulls.popleft()
            error = future.exception()
            if isinstance(error, Exception):
                # The receive fails with it in Wait/Test, not whichever call is here;
                # FIN still releases the sender, as for a truncated message.
                action.op.error = error
            elif error is not None:
                raise error
            self._run(self._engine.pulled(action.op, action.msgid))
            finished = True
        return finished

    def _copy_self(self, remote: list[Region], local: list[memoryview]) -> None:
        offset = 0
        for region in remote:
            cursor = region.addr
            for piece in slice_views(local, offset, offset + region.nbytes):
                _linux.copy_from_address(piece, cursor)
                cursor += piece.nbytes
            offset += region.nbytes

    def _push(self, action: Push) -> None:
        op = action.op
        link = self._links[op.dest]
        assert link is not None
        self._transports[action.transport].write(link, action.local, action.remote)
        self._run(self._engine.pushed(op, action.recvid))

    # -- progress

    def _progress(self, skip: int = -1) -> bool:
        """One pass over everything that can move without blocking; True if anything did."""
        moved = False
        engine = self._engine
        if self._loopback:
            while self._loopback:
                kind, tag, aux, looped = self._loopback.popleft()
                self._run(engine.packet(self.rank, kind, tag, aux, looped))
            if not self._oversubscribed:
                self._rlanes = dict(self._all_rlanes)
            moved = True
        for peer in self._peers:
            if peer != skip:
                moved = self._drain(peer, False) or moved
        if self._txq_pending:
            moved = self._flush() or moved
        if self._out_streams or self._in_streams:
            moved = self._stream() or moved
        if self._pulls:
            moved = self._finish_pulls() or moved
        return moved

    def _drain(self, peer: int, only_expected: bool) -> bool:
        """Hand the packets that arrived from ``peer`` to the engine; True if there were any.

        ``only_expected``: stop at the first packet no posted receive takes, so that
        the messages behind it stay in the ring for the fast paths instead of being
        copied out as unexpected.
        """
        box = self._inboxes[peer]
        assert box is not None
        engine = self._engine
        matcher = self._matcher
        moved = False
        while box.ready() and (not only_expected or matcher.expects(peer, box.head_tag())):
            kind, tag, n, aux, payload = box.take()
            moved = True
            if kind & MORE or peer in self._joiner:
                joined = self._joiner.join(peer, kind, payload)
                box.release()
                if joined is not None:
                    self._run(engine.packet(peer, kind, tag, aux, joined))
                continue
            self._run(engine.packet(peer, kind, tag, aux, payload))
            box.release()
        if box.publish_tail() and self._peer_sleeping(peer):
            self._ring(peer)
        return moved

    def _stream_of(self, streams: dict[int, Stream], peer: int, sending: bool) -> Stream:
        stream = streams.get(peer)
        if stream is None:
            config = self._fds.config
            slot_bytes, slots = config.frag_size, config.stage_slots
            stream = streams[peer] = Stream(
                sending, lambda nbytes, first: Pipeline.for_message(nbytes, slot_bytes, slots, first))
        return stream

    def _stream(self) -> bool:
        """Advance PIPELINE transfers: fill free staging slots, drain filled ones."""
        moved = False
        for peer, stream in list(self._out_streams.items()):
            box = self._outboxes[peer]
            assert box is not None
            moved = self._pump(peer, stream, box.staging, box.drained(), box.filled,
                               box.publish_filled) or moved
            if not stream:
                del self._out_streams[peer]
        for peer, stream in list(self._in_streams.items()):
            inbox = self._inboxes[peer]
            assert inbox is not None
            moved = self._pump(peer, stream, inbox.staging, inbox.filled(), inbox.drained_count,
                               inbox.publish_drained) or moved
            if not stream:
                del self._in_streams[peer]
        return moved

    def _pump(self, peer: int, stream: Stream, staging: memoryview, peer_count: int,
              own_count: int, publish: Callable[[int], None]) -> bool:
        """Copy every fragment of ``stream`` that may move now, through ``staging``; True
        if any did. ``own_count``: the running count this side last published. The
        protocol's Stream says what goes where; the copies are here."""
        slot_bytes = self._fds.config.frag_size
        copied = False
        while True:
            step = stream.next(peer_count, own_count)
            if step is None:
                op = stream.through()
                if op is None:
                    break
                if stream.sending:
                    self._run(self._engine.streamed_out(op))  # type: ignore[arg-type]
                else:
                    self._run(self._engine.streamed_in(op))  # type: ignore[arg-type]
                continue
            op, slot, start, stop = step
            transport = self._transports.get(op.mechanism) or self._transports["shm"]
            copy = transport.stage if stream.sending else transport.drain
            window = staging[slot * slot_bytes : slot * slot_bytes + (stop - start)]
            at = 0
            for piece in slice_views(op.segments, start, stop):
                copy(window[at : at + piece.nbytes], piece)
                at += piece.nbytes
            own_count = stream.copied()
            publish(own_count)
            copied = True
        if copied and self._peer_sleeping(peer):
            self._ring(peer)
        return copied

    def _wait(self, op: SendOp | RecvOp) -> None:
        if op.done:
            return
        peer = op.dest if isinstance(op, SendOp) else op.source
        large = isinstance(op, SendOp) and op.nbytes >= YIELD_FROM_BYTES
        spin = max(SPIN_SECONDS, op.nbytes / SLOWEST_COPY_BYTES_PER_S) if large else SPIN_SECONDS
        self._wait_until(lambda: op.done, None if peer == ANY_SOURCE else peer, spin, large)

    def _wait_until(self, done: Callable[[], bool], peer: int | None,
                    spin: float = SPIN_SECONDS, yield_cpu: bool = False) -> None:
        """Progress until ``done()``: spin for ``spin`` seconds, then sleep on the doorbell.

        ``peer`` is the rank whose exit makes waiting pointless (None: any rank may answer).
        ``yield_cpu``: call sched_yield while spinning (always so when ranks outnumber cores).
        """
        try:
            self._wait_loop(done, peer, spin, yield_cpu)
        except CmaError:
            raise  # raised on purpose, where the state is whole
        except BaseException as exc:
            if not _raised_while_idle(exc):
                self._break(f"{type(exc).__name__} interrupted rank {self.rank} while it was "
                            "handling its peers' packets; what it shares with them may be half "
                            "updated")
            raise

    def _wait_loop(self, done: Callable[[], bool], peer: int | None, spin: float,
                   yield_cpu: bool) -> None:
        world = self._world
        assert world is not None
        deadline = 0.0
        yield_cpu = yield_cpu or self._oversubscribed
        while not done():
            if self._progress():
                deadline = 0.0
                continue
            if yield_cpu:
                os.sched_yield()
            now = time.perf_counter()
            if not deadline:
                deadline = now + spin
                continue
            if now < deadline and not self._pulls:
                continue  # (a background pull needs the GIL back, and rings when done)
            world.set_sleeping(1)
            try:
                if self._progress() or done():
                    continue
                gone = world.sleep(SLEEP_MS)
                self._control_syscalls += 1
            finally:
                world.set_sleeping(0)
            # The deadline stays expired: only progress (above) earns a new spin, so a
            # waiter that wakes to nothing every SLEEP_MS sleeps again at once instead of
            # spinning (1 ms in 11 was 9 % of a CPU per idle waiter, taken from the peer).
            if gone:
                self._peers_gone(gone, done, peer)

    def _withdraw(self, op: SendOp | RecvOp) -> None:
        """Take a receive whose caller gave up waiting (an exception left its Wait) out of
        matching, if nothing matched it yet: the next receive gets the message instead.

        A receive already matched is not withdrawn (as MPI_Cancel): its copy may be under
        way, so it completes into its buffer during later calls. A send cannot be
        withdrawn either: its peer was told of it and takes it when it receives.
        """
        if self._broken or not isinstance(op, RecvOp):
            return
        posted = self._matcher.posted
        if op in posted:
            posted.remove(op)
            op.error = Cancelled(
                f"this receive (source {op.source}, tag {op.tag}) was withdrawn when an exception "
                "left its Wait; nothing was received into its buffer")
            op.done = True

    def _break(self, reason: str) -> None:
        """Make every later operation raise CommBroken(reason); close() still releases all."""
        self._broken = reason
        # (the general paths all go through the engine, so each now raises at its first use)
        self._engine = cast(Engine, _BrokenEngine(reason))
        self._lanes = {}  # (so the fast paths take the general ones)
        self._rlanes = {}
        self._txq_pending = 0  # (a flush would put peers back in _lanes)

    def _peers_gone(self, gone: list[int], done: Callable[[], bool], peer: int | None) -> None:
        self._bury(gone)
        if done():
            return
        if peer is not None and peer in self._dead:
            raise PeerGone(f"rank {peer} exited before completing this operation")
        if peer is None and self._dead.issuperset(self._peers):
            raise PeerGone("every other rank has exited; nothing can complete this operation")

    def _bury(self, gone: list[int]) -> None:
        """Take what the exited ranks left in the rings, then mark them dead."""
        world = self._world
        assert world is not None
        while self._progress():
            pass
        for r in gone:
            self._dead.add(r)
            os.close(world.pidfds[r])
            world.pidfds[r] = -1


class _BrokenEngine:
    """Stands in for a broken communicator's engine: any use raises CommBroken."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str) -> Any:
        raise CommBroken(f"this communicator is unusable: {self.reason}. Close it; the ranks "
                         "must start a new world (cma.Pipe, cma-run) to talk again")


# Where a wait holds nothing half done: its loop's own steps, its sleep and what these
# call directly (the done() predicate, a comprehension), but not a pass of progress.
_IDLE_CODE = frozenset({Comm._wait_until.__code__, Comm._wait_loop.__code__,
                        World.sleep.__code__, World.set_sleeping.__code__,
                        _linux.wait_readable.__code__})
_BUSY_CODE = frozenset({Comm._progress.__code__, Comm._peers_gone.__code__})


def _raised_while_idle(exc: BaseException) -> bool:
    """Whether ``exc`` (e.g. a signal handler's KeyboardInterrupt, which Python raises
    between any two bytecodes) came from a waiting rank's sleep or loop, not from the
    middle of its handling of a packet or a copy."""
    codes = []
    tb = exc.__traceback__
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    innermost = codes[-1]
    if innermost in _IDLE_CODE:
        return True
    return len(codes) > 1 and codes[-2] in _IDLE_CODE and innermost not in _BUSY_CODE


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
    fds = WorldFds(world_id, size, memfd.detach(), [b.detach() for b in doorbells],
                   ChannelConfig.decode(config))
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


os.register_at_fork(after_in_parent=_after_fork_in_parent)


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

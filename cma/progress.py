"""Progress: the I/O half of a communicator, built when it attaches.

``protocol.Engine`` decides; ``Progress`` acts: it writes the engine's packets into the
rings (or queues them behind a full ring, or loops them back to this rank), hands the
packets that arrive to the engine, runs the copies it asks for (pulls, pushes, PIPELINE
fragments through the staging slots), waits (spin, then sleep on the doorbell), connects
peers on first use (its own, and those that connected to it), and notices peers that
exit. ``cma.Comm`` keeps the API and the eager fast paths; it shares with this object
the dicts of ring ends its fast paths may use (``fast_outboxes``, ``fast_inboxes``) and
the matcher, which this object mutates in place (a peer not connected has no entry).
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from _thread import get_ident
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import CodeType
from typing import Any, cast

import numpy as np

from . import _linux, heap
from .channel import FAST_SPINS, Inbox, Outbox
from .connect import Connection
from .direct import DirectRendezvous
from .errors import (
    Cancelled,
    CmaError,
    CommBroken,
    ConcurrentUse,
    PeerGone,
    ProtocolError,
    RegistrationCacheFull,
    TransportFault,
    WindowError,
)
from .overlap import BackgroundPulls
from .protocol import (
    PIPELINE,
    PULL,
    PUSH,
    Action,
    Arrival,
    Complete,
    Deliver,
    Engine,
    Joiner,
    MapView,
    Matcher,
    Pipeline,
    Pull,
    Push,
    RecvOp,
    SendOp,
    Stream,
    StreamIn,
    StreamOut,
    Transmit,
    Unmap,
    eager_received,
    encode_unmap,
    slice_views,
    split_packet,
)
from .stats import EagerCounts
from .transports import Region
from .transports.xmap import XmapTransport
from .wire import ANY_SOURCE, EAGER, FIN, KIND_MASK, MORE, UNMAP, HeapRef
from .world import PeerLink, World

# How long a blocked call spins before it sleeps. Waking a sleeping process costs from
# ~10 us to several hundred on the project's VM (an idle vCPU must be woken), so a
# wait that a peer will end soon should spin rather than sleep. 1 ms is chosen as a few
# times the slow wake-ups, not measured against other spins (docs/architecture.md,
# "Waiting"; the wake-up costs: KERNEL-FACTS.md).
SPIN_SECONDS = float(os.environ.get("CMA_SPIN_US", "1000")) * 1e-6
# A sender of a large rendezvous message spins for about as long as the peer's copy
# takes at this rate, yielding the CPU as it spins: the peer's copy threads need it.
# 1 GB/s is a floor well under the ~12 GB/s of one copy stream here (docs/architecture.md,
# "Protocols"), so the spin rarely ends before the copy; chosen, not measured.
SLOWEST_COPY_BYTES_PER_S = 1e9
# From here on such a sender's copy time (>= 1 ms at that rate) exceeds SPIN_SECONDS
# anyway, so the longer, yielding spin applies; below it the usual spin does.
YIELD_FROM_BYTES = 1 << 20
# The sleep's timeout only catches a doorbell lost to a reordered store and load
# (docs/architecture.md, "Waiting"): an idle waiter that wakes this often costs
# 1.2-1.6 % of a CPU (measured, same section). The value is chosen, not tuned.
SLEEP_MS = 10
# A wait that must also move an engine that cannot ring the doorbell (cma.mpi's MPI on a
# rank with peers off this node) sleeps in pauses doubling from the min to the max instead:
# an off-node message is seen within about the pause (docs/mpi.md, "Mixed ranks"). The
# first pause is about two wake-ups (~10 us each here, KERNEL-FACTS.md); the last bounds
# the extra latency after an idle phase. Chosen, not measured.
OUTSIDE_PAUSE_MIN = 20e-6
OUTSIDE_PAUSE_MAX_MS = 1
# A rank about to sleep hands back the pages of each ring it writes that has had no new
# packet for this long (docs/architecture.md, "Memory per rank": a pair's two 8 MiB rings
# touched anew cost ~10 ms of page faults here, so at most ~1 % of a pair this quiet).
QUIET_SECONDS = 1.0

Packet = tuple[int, int, int, bytes]  # kind, tag, aux, payload


# The ``_busy`` word while a View.release in any thread sends its FINs: a call that finds
# it waits the few microseconds that takes instead of raising ConcurrentUse, since the
# release is no use of the communicator the user made (Progress.flush_released_views).
FLUSHING = -1


def claim(comm: Any) -> int:
    """Mark ``comm`` as in a call of this thread; what its ``_busy`` word held, to put back
    (0 free, 1 a fast path, else a thread's ident: a call nested in this thread's own passes).

    ConcurrentUse if another thread is inside (after waiting out a view's release,
    FLUSHING). The word is tested and set with no call or taken jump in between, so the
    GIL cannot switch threads there (docs/reliability.md, "Two threads on one
    communicator"). The entries of Progress that other modules call claim it, inline (a
    decorator's call cost ~0.5 us more here); the rest run inside them."""
    me = get_ident()
    held: int = comm._busy
    if not held:
        comm._busy = me
    elif held != me:
        if held == FLUSHING:
            while comm._busy == FLUSHING:
                time.sleep(0)  # (lets the releasing thread finish)
            return claim(comm)
        raise ConcurrentUse(
            f"rank {comm.rank}'s communicator used by two threads at once: another thread "
            "is inside a call on it (this call did nothing). A communicator is for one "
            "thread at a time: use one per thread (a cma.Pipe per pair of threads) or a "
            "lock of your own around calls")
    return held


def peer_slots(size: int) -> list[Any]:
    """A table of the ring ends the fast paths may use, indexed by rank (None: take the
    general path). A list, not a dict: a float rank raises TypeError instead of finding
    rank 1 under 1.0, so it reaches the general path, which refuses it; a fast path tests
    ``rank >= 0`` first, and the two cost what ``dict.get`` did."""
    return [None] * size


def empty_slots(slots: list[Any]) -> None:
    """Set every slot of ``slots`` to None, in place (the fast paths hold the list)."""
    slots[:] = [None] * len(slots)


def _region(mv: memoryview) -> Region:
    return Region(_linux.buffer_address(mv), mv.nbytes)


def _allocate(nbytes: int) -> memoryview:
    return np.empty(nbytes, dtype=np.uint8).data


class Progress:
    """Moves one attached rank's packets and copies; every wait of the rank runs here."""

    def __init__(self, world: World, connection: Connection, matcher: Matcher,
                 fast_outboxes: list[Outbox | None], fast_inboxes: list[Inbox | None],
                 inbox_peer: dict[Inbox, int], counts: EagerCounts,
                 ring: Callable[[int], None],
                 completed: Callable[[SendOp | RecvOp], None] | None, overlap: bool,
                 owner: Any, oversubscribed: bool, count_cpus: bool = False) -> None:
        """``matcher``, ``fast_outboxes``, ``fast_inboxes`` and ``inbox_peer`` are the
        communicator's, filled here; ``ring(peer)`` rings a peer's doorbell, and
        ``completed(op)``, if given, is told of every operation the engine completes.
        ``owner``: the communicator, whose ``_busy`` word the entries claim (``claim``).
        ``oversubscribed``: the machine's ranks outnumber the CPUs they can run on;
        ``count_cpus``: that was decided on the CPU masks the ranks published, which are
        counted again as each peer connects (``_count_cpus``), so that a rank that attached
        first stops counting itself crowded once the ranks' masks say otherwise."""
        self.owner = owner
        self.world = world
        self.rank = rank = world.rank
        self.size = size = world.size
        self.config = world.config
        self.connection = connection
        self.transports = connection.transports
        self.links = connection.links
        self.matcher = matcher
        xmap = self.transports.get(XmapTransport.name)
        self.xmap = xmap if isinstance(xmap, XmapTransport) else None
        self.engine = Engine(rank, self.config.eager_limit, connection.policy,
                             PULL | PUSH | PIPELINE, allocate=_allocate, region_of=_region,
                             matcher=matcher, max_object_bytes=_linux.memory_bytes(),
                             heap_of=self._heap_ref if self.xmap is not None else None)
        self.peers = [p for p in range(size) if p != rank]
        # The peers connected so far (connect): their ring ends, by peer, and a list that
        # connect replaces rather than extends, so that a pass over it may connect more.
        self.outboxes: dict[int, Outbox] = {}
        self.inboxes: dict[int, Inbox] = {}
        self.connected: list[int] = []
        # The heads of the rings into this rank (one row of the world's header), and the
        # row as it was at the start of the last pass that drained every ring whose head
        # had moved: while the two are equal no ring has a packet (a pass of an idle wait
        # with N-1 peers costs one comparison: docs/architecture.md, "The heads matrix").
        self.heads_row = world.heads_row()
        self.heads_drained = b""
        self.oversubscribed = oversubscribed
        connection.policy.crowded = oversubscribed
        # Whether to count the ranks' CPUs again as peers connect: only if it was decided
        # on them, and where no union of masks can outnumber the machine's CPUs
        self.counting_cpus = count_cpus and size <= (os.cpu_count() or 1)
        # How often a fast path polls an empty ring (a blocking receive's, a direct
        # send's for its FIN): only with a core to itself, since a spin when ranks
        # outnumber cores holds back the peer it waits for.
        self.fast_spins = 0 if self.oversubscribed else FAST_SPINS
        # when a rank about to sleep next looks for quiet rings (release_quiet_rings)
        self.quiet_look = time.perf_counter() + QUIET_SECONDS
        # A direct send whose FIN may come while this rank waits for something else (a
        # Sendrecv's offer during its receive): await_head takes that FIN itself.
        self.offered: SendOp | None = None
        # The ring ends the fast paths may use right now: a peer's outbox leaves
        # fast_outboxes while packets to it wait in txq (order), and the inboxes leave
        # fast_inboxes while packets to ourselves wait in loopback.
        self.fast_outboxes = fast_outboxes
        self.fast_inboxes = fast_inboxes
        self.inbox_peer = inbox_peer
        self.txq: list[deque[Packet]] = [deque() for _ in range(size)]
        self.txq_pending = 0
        self.txq_bytes = 0  # payload bytes waiting in the txqs
        self.loopback: deque[Packet] = deque()
        self.out_streams: dict[int, Stream] = {}  # PIPELINE sends, per peer
        self.in_streams: dict[int, Stream] = {}  # PIPELINE receives, per peer
        self.dead: set[int] = set()
        self.joiner = Joiner()  # pieces of split control packets
        self.buffered: list[SendOp] = []  # Bsend's rendezvous messages, sent from copies
        self.counts = counts
        self.ring = ring
        self.completed = completed
        # overlap: a pipeline needs both processes inside cma calls, a pull does not
        self.overlap = overlap
        self.pulls = BackgroundPulls(self._wake_self)
        self.broken = ""  # why the communicator is unusable (see break_down), or ""
        self.closing = False
        # a peer that connects to this rank sets this word: then poll maps the pair
        self.connects = world.connects
        # Blocking Send/Recv's direct rendezvous (direct.py), and recv_view's, except where
        # pulls run in the background (overlap)
        self.direct = DirectRendezvous(self) if not overlap else None
        for peer in self.peers:
            if connection.links[peer] is not None:  # (a world of two: connected at attach)
                self._add(peer)

    # -- peers connected on first use

    def connect(self, peer: int) -> None:
        """Connect ``peer`` (connect.py, ``World.open_pair``) unless it is: the first
        operation that names a peer does, and so does a peer that connected to this rank."""
        owner = self.owner
        held = claim(owner)
        try:
            self._connect(peer)
        finally:
            owner._busy = held

    def _connect(self, peer: int) -> None:
        if peer in self.outboxes or peer == self.rank or peer < 0:
            return
        try:
            self.connection.connect(peer)
        except PeerGone:
            if self.world.outboxes[peer] is None:
                raise  # it never attached
            # it attached and exited before this rank connected: take what it sent, as
            # bury does, and let a wait on it end (_wait_loop)
            self._add(peer)
            self.dead.add(peer)
            while self.drain(peer, False):
                pass
            return
        self._add(peer)

    def _add(self, peer: int) -> None:
        outbox, inbox = self.world.outboxes[peer], self.world.inboxes[peer]
        assert outbox is not None and inbox is not None
        self.outboxes[peer] = outbox
        self.inboxes[peer] = inbox
        self.inbox_peer[inbox] = peer
        self.connected = [*self.connected, peer]
        self.heads_drained = b""  # (its ring may hold packets from before it connected)
        if self.oversubscribed and self.counting_cpus:
            self._count_cpus()
        if not self.broken and not self.closing:
            if not self.txq[peer]:
                self.fast_outboxes[peer] = outbox
            if not self.loopback:
                self.fast_inboxes[peer] = inbox

    def _count_cpus(self) -> None:
        """Count the CPUs of the ranks attached by now again (a peer has just connected);
        with as many as ranks and the cgroup's quota allowing, stop waiting as ranks that
        share CPUs wait. A quota that allows fewer ends the counting (it stays)."""
        cpus = self.world.published_cpus()
        if len(cpus) < self.size:
            return
        self.counting_cpus = False
        if self.size > _linux.usable_cpus(cpus):
            return
        self.oversubscribed = self.connection.policy.crowded = False
        self.fast_spins = FAST_SPINS
        if self.direct is not None:
            self.direct.spins = FAST_SPINS
        self.owner.spins_changed()

    def accept(self) -> bool:
        """Connect the peers that have connected to this rank since it last looked; True
        if there were any (their packets may be waiting)."""
        self.connects[0] = 0  # (before looking: a peer that sets it after is seen next time)
        new = self._newly_connected()
        for peer in new:
            try:
                self._connect(peer)
            except PeerGone:
                self.dead.add(peer)  # connected to this rank and exited since
        return bool(new)

    # -- operations the communicator starts

    def send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool,
             eager: bool = True, sync: bool = False, pull_first: bool = False) -> SendOp:
        """Start a send in the engine (connecting ``dest`` first if need be) and run its
        actions; ``pull_first``: a rendezvous is offered PULL_FIRST (protocol.py)."""
        owner = self.owner
        held = claim(owner)
        try:
            if dest not in self.outboxes:
                self._connect(dest)
            op, actions = self.engine.send(dest, tag, segments, is_object, eager=eager, sync=sync,
                                           pull_first=pull_first)
            self.run(actions)
            return op
        finally:
            owner._busy = held

    def post_recv(self, source: int, tag: int, buffer: memoryview | None, view: bool = False
                  ) -> RecvOp:
        """Post a receive in the engine (connecting ``source`` first if need be) and run its actions."""
        owner = self.owner
        held = claim(owner)
        try:
            if source not in self.outboxes:
                self._connect(source)  # (its exit must end the wait; ANY_SOURCE: none)
            op, actions = self.engine.recv(source, tag, buffer, view)
            self.run(actions)
            return op
        finally:
            owner._busy = held

    def in_flight(self) -> bool:
        """Whether this rank holds data its peers wait for that moves only when it runs
        cma: packets queued behind a full ring, pipelines, background pulls."""
        return bool(self.txq_pending or self.out_streams or self.in_streams or self.pulls)

    def owes(self) -> bool:
        """``in_flight``, or xmap's news its peers wait for: views of their pages released,
        segments given back, not yet announced."""
        xmap = self.xmap
        return self.in_flight() or xmap is not None and bool(xmap.released or xmap.given_back)

    # -- the engine's actions

    def run(self, actions: list[Action]) -> None:
        """Carry out the engine's actions: packets, deliveries, pulls, pushes, streams, completions."""
        for action in actions:
            if isinstance(action, Transmit):
                self.transmit(action.dest, action.kind, action.tag, action.aux, action.payload)
            elif isinstance(action, Deliver):
                self._deliver(action.op, action.payload)
            elif isinstance(action, Pull):
                self._pull(action)
            elif isinstance(action, Push):
                self._push(action)
            elif isinstance(action, StreamOut):
                self._stream_of(self.out_streams, action.op.dest, True).add(action.op)
            elif isinstance(action, StreamIn):
                self._stream_of(self.in_streams, action.op.matched_source, False).add(action.op)
            elif isinstance(action, Complete):
                self._count_completed(action.op)
                if self.completed is not None:
                    self.completed(action.op)
            elif isinstance(action, MapView):
                self._map_view(action)
            elif isinstance(action, Unmap):
                if self.xmap is not None:
                    self.xmap.forget(action.peer, action.segments)

    def transmit(self, dest: int, kind: int, tag: int, aux: int, payload: bytes) -> None:
        """Send one control packet: to this rank through the loopback, else into ``dest``'s ring, or its
        queue when the ring is full or others wait (split when larger than a ring packet)."""
        if dest == self.rank:
            if kind & KIND_MASK == EAGER:
                self.counts.looped(len(payload))
            self.loopback.append((kind, tag, aux, payload))
            empty_slots(self.fast_inboxes)
            return
        limit = self.config.max_packet
        if len(payload) > limit:  # (a control packet larger than the ring: see drain)
            for piece_kind, piece in split_packet(kind, payload, limit):
                self.transmit(dest, piece_kind, tag, aux, piece)
            return
        queue = self.txq[dest]
        packet = (kind, tag, aux, payload)
        if queue or not self._put(dest, packet):
            queue.append(packet)
            self.txq_pending += 1
            self.txq_bytes += len(payload)
            self.fast_outboxes[dest] = None
            return
        if self.peer_sleeping(dest):
            self.ring(dest)

    def peer_sleeping(self, peer: int) -> int:
        """Whether ``peer`` has said it is about to sleep (then a packet for it rings its doorbell)."""
        return self.outboxes[peer].peer_sleeping[0]

    def _put(self, dest: int, packet: Packet) -> bool:
        """Write one packet into ``dest``'s ring if it fits now."""
        kind, tag, aux, payload = packet
        if not self.outboxes[dest].put(kind, tag, aux, payload):
            return False
        if kind & KIND_MASK == EAGER:
            self.counts.queued_copy_bytes += len(payload)  # the copy into a bytes object
        return True

    def _flush(self) -> bool:
        moved = False
        for dest in self.connected:
            queue = self.txq[dest]
            sent = False
            while queue and self._put(dest, queue[0]):
                self.txq_bytes -= len(queue.popleft()[3])
                self.txq_pending -= 1
                sent = True
            if not queue:
                self.fast_outboxes[dest] = self.outboxes[dest]
            if sent and self.peer_sleeping(dest):
                self.ring(dest)
            moved = moved or sent
        return moved

    def _deliver(self, op: RecvOp, payload: bytes | memoryview) -> None:
        n = len(payload)
        if op.buffer is None:
            op.segments = [memoryview(bytes(payload))]
        elif n:
            op.buffer[:n] = payload

    def _count_completed(self, op: SendOp | RecvOp) -> None:
        if op.mechanism in ("eager", "self") or (isinstance(op, RecvOp) and op.error is not None):
            return
        stats = self.transports[op.mechanism].stats
        stats.messages += 1
        stats.bytes += op.nbytes

    def _pull(self, action: Pull) -> None:
        op = action.op
        if action.heap is not None:
            # (never on overlap's thread: the mapping cache is this thread's)
            assert self.xmap is not None and action.rts is not None
            link = self.links[action.peer]
            assert link is not None
            try:
                self.xmap.read_heap(link, action.remote, action.heap, action.local)
            except RegistrationCacheFull:
                self.run(self.engine.map_refused(op, action.peer, action.rts))
                return
            self.run(self.engine.pulled(op, action.msgid))
            return
        if action.peer == self.rank:
            op.mechanism = "self"
            self._copy_self(action.remote, action.local)
        else:
            link = self.links[action.peer]
            assert link is not None
            transport = self.transports[action.transport]
            read = self._checked(transport.read, action.peer) if transport.by_pid else transport.read
            if self.overlap:
                self.pulls.start(lambda: read(link, action.remote, action.local), action)
                return
            read(link, action.remote, action.local)
        self.run(self.engine.pulled(op, action.msgid))

    # -- xmap: mapping peers' heap segments

    def _heap_ref(self, dest: int, mv: memoryview) -> HeapRef | None:
        """Where a send buffer lies in our heap, offered to ``dest`` (None: not in it)."""
        if dest == self.rank or not mv.nbytes:
            return None
        where = heap.locate(mv)
        if where is None:
            return None
        assert self.xmap is not None
        return self.xmap.offer(where, dest)

    def _map_view(self, action: MapView) -> None:
        xmap = self.xmap
        link = self.links[action.peer]
        assert xmap is not None and link is not None
        op = action.op
        mapped = []
        try:
            for ref, size in zip(action.refs, action.sizes, strict=True):
                mapped.append(xmap.map_view(link, ref, size))
        except BaseException as exc:
            xmap.view_released([lease for _, lease in mapped])
            if not isinstance(exc, RegistrationCacheFull):
                raise
            # every mapping is held by views: this one is a copy instead (api.md, recv_view)
            self.run(self.engine.map_refused(op, action.peer, action.rts))
            return
        views = xmap.hand_out([held for held, _ in mapped], action.peer, action.msgid,
                              [lease for _, lease in mapped], self.flush_released_views)
        if op.is_object or len(views) > 1:  # (load_object unpickles from them)
            op.segments = [view.data for view in views]
        else:
            op.held = views[0]
        self.run(self.engine.view_mapped(op))

    def release_views(self) -> None:
        """Send the FINs of the views released since (their senders' requests complete)."""
        xmap = self.xmap
        assert xmap is not None
        while xmap.released:
            peer, msgid, leases = xmap.released.popleft()
            xmap.view_released(leases)
            if peer not in self.dead and not self.broken and not self.closing:
                self.run(self.engine.view_released(peer, msgid))

    def flush_released_views(self) -> None:
        """``View.release``'s flush, from any thread: the FINs at once if no call is inside
        the communicator (a call that starts meanwhile waits: FLUSHING); else that call's
        next pass sends them (``release_views``), woken by the doorbell if it sleeps.
        (Unclaimed, a release in a second thread moved the engine and the rings under the
        first one's feet.)"""
        owner = self.owner
        held = owner._busy
        if not held:  # (tested and set with no call or taken jump between: claim's rule)
            owner._busy = FLUSHING
        else:
            if not self.closing:
                _linux.ring_doorbell(self.world.fds.doorbells[self.rank])
            return
        try:
            self.release_views()
        finally:
            owner._busy = 0

    def announce_given_back(self) -> None:
        """Tell the peers that mapped our heap segments which of them we gave back."""
        assert self.xmap is not None
        for dest, segments in self.xmap.take_given_back().items():
            if dest not in self.dead and not self.broken:
                self.transmit(dest, UNMAP, 0, len(segments), encode_unmap(segments))

    def confirm_pid(self, peer: int) -> None:
        """PeerGone unless ``peer``'s pid still names the process that attached as it: once
        that process is reaped, its pid may belong to an unrelated one."""
        pidfd = self.world.pidfds[peer]
        if pidfd < 0 or not _linux.pid_still_held(pidfd):
            raise PeerGone(f"rank {peer} (pid {self.world.pid_of(peer)}) exited; its pid may "
                           "belong to another process now, so nothing is copied from or to it")

    def _checked(self, copy: Callable[[PeerLink, Any, Any], None], peer: int
                 ) -> Callable[[PeerLink, Any, Any], None]:
        """``copy`` (by pid) between two ``confirm_pid``: before, nothing is read from or
        written to another process unless the peer dies during the copy; after, what was
        read then is not handed on as the peer's."""
        confirm = self.confirm_pid

        def checked(link: PeerLink, first: Any, second: Any) -> None:
            confirm(peer)
            copy(link, first, second)
            confirm(peer)
        return checked

    def _wake_self(self, _: Future[None]) -> None:
        """Ring our own doorbell from the copy thread, in case this rank sleeps in a wait."""
        if not self.closing:
            _linux.ring_doorbell(self.world.fds.doorbells[self.rank])

    def _finish_pulls(self) -> bool:
        """Complete the background pulls that are done, in order; True if any was."""
        finished = False
        for action in self.pulls.finished():
            self.run(self.engine.pulled(action.op, action.msgid))
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
        link = self.links[op.dest]
        assert link is not None
        transport = self.transports[action.transport]
        write = self._checked(transport.write, op.dest) if transport.by_pid else transport.write
        write(link, action.local, action.remote)
        self.run(self.engine.pushed(op, action.recvid))

    # -- progress

    def _poll(self) -> bool:
        """One pass over everything that can move without blocking; True if anything did."""
        moved = False
        engine = self.engine
        if self.connects[0]:
            moved = self.accept()
        if self.loopback:
            while self.loopback:
                kind, tag, aux, looped = self.loopback.popleft()
                self.run(engine.packet(self.rank, kind, tag, aux, looped))
            for peer, inbox in self.inboxes.items():
                self.fast_inboxes[peer] = inbox
            moved = True
        heads = self.heads_row.tobytes()
        drained = self.heads_drained
        if heads != drained:
            # (left stale if the pass is cut short, or a peer connects during it)
            self.heads_drained = b""
            connected = self.connected
            if drained:  # only the rings whose head moved since they were drained
                now, then = memoryview(heads).cast("q"), memoryview(drained).cast("q")
                news = [peer for peer in connected if now[peer] != then[peer]]
            else:
                news = connected
            for peer in news:
                moved = self.drain(peer, False) or moved
            if self.connected is connected:
                self.heads_drained = heads
        if self.txq_pending:
            moved = self._flush() or moved
        if self.out_streams or self.in_streams:
            moved = self._stream() or moved
        if self.pulls:
            moved = self._finish_pulls() or moved
        xmap = self.xmap
        if xmap is not None and (xmap.released or xmap.given_back):
            if xmap.released:
                self.release_views()
            if xmap.given_back:
                self.announce_given_back()
            moved = True
        return moved

    def poll(self) -> bool:
        """``_poll`` for other modules, the communicator claimed (a wait's passes are not)."""
        owner = self.owner
        held = claim(owner)
        try:
            return self._poll()
        finally:
            owner._busy = held

    def drain_expected(self, peer: int) -> None:
        """``drain(peer, True)`` for ``Comm.Irecv``'s fast path."""
        owner = self.owner
        held = claim(owner)
        try:
            self.drain(peer, True)
        finally:
            owner._busy = held

    def mprobe(self, source: int, tag: int) -> Arrival | None:
        """A pass of progress, then the engine's matched probe (``Comm.Improbe``)."""
        owner = self.owner
        held = claim(owner)
        try:
            self._poll()
            return self.engine.mprobe(source, tag)
        finally:
            owner._busy = held

    def mrecv(self, arrival: Arrival, buffer: memoryview | None) -> RecvOp:
        """Receive a matched probe's message (``Comm.Mrecv`` and co)."""
        owner = self.owner
        held = claim(owner)
        try:
            op, actions = self.engine.mrecv(arrival, buffer)
            self.run(actions)
            return op
        finally:
            owner._busy = held

    def drain(self, peer: int, only_expected: bool) -> bool:
        """Hand the packets that arrived from ``peer`` to the engine; True if there were any.

        ``only_expected``: stop at the first packet no posted receive takes, so that
        the messages behind it stay in the ring for the fast paths instead of being
        copied out as unexpected.
        """
        box = self.inboxes[peer]
        engine = self.engine
        matcher = self.matcher
        posted = matcher.posted
        joiner = self.joiner
        moved = False
        try:
            while box.ready():
                if posted:
                    tag = box.head_tag()
                    i = matcher.posted_index(peer, tag)
                    if i < 0:
                        if only_expected:
                            break
                    elif posted[i].buffer.__class__ is memoryview and peer not in joiner \
                            and not self.broken:
                        # A plain eager message for a posted buffer receive it fits: copied
                        # from the ring into the buffer, as Recv's fast path does, not through
                        # the engine's packet and actions (docs/mpi.md, "Windows of requests");
                        # a broken communicator's engine refuses it instead
                        op = posted[i]
                        n = box.take_eager(op.buffer, tag)  # type: ignore[arg-type]
                        if n >= 0:
                            del posted[i]
                            eager_received(op, peer, tag, n)
                            moved = True
                            if self.completed is not None:
                                self.completed(op)
                            continue
                elif only_expected:
                    break
                kind, tag, n, aux, payload = box.take()
                moved = True
                if kind & MORE or peer in self.joiner:
                    joined = self.joiner.join(peer, kind, payload)
                    box.release()
                    if joined is not None:
                        self.run(engine.packet(peer, kind, tag, aux, joined))
                    continue
                self.run(engine.packet(peer, kind, tag, aux, payload))
                box.release()
        except ProtocolError as exc:
            # raised by the decoders before anything moved on the packet's word
            self.break_down(str(exc))
            raise
        except (TransportFault, WindowError) as exc:
            # a copy the packet asked for: regions the peer does not have (or exposed)
            self.break_down(f"rank {peer} sent a rendezvous whose regions could not be copied ({exc})")
            raise
        if box.publish_tail() and self.peer_sleeping(peer):
            self.ring(peer)
        return moved

    def _stream_of(self, streams: dict[int, Stream], peer: int, sending: bool) -> Stream:
        stream = streams.get(peer)
        if stream is None:
            config = self.config
            slot_bytes, slots = config.frag_size, config.stage_slots
            stream = streams[peer] = Stream(
                sending, lambda nbytes, first: Pipeline.for_message(nbytes, slot_bytes, slots, first))
        return stream

    def _stream(self) -> bool:
        """Advance PIPELINE transfers: fill free staging slots, drain filled ones."""
        moved = False
        for peer, stream in list(self.out_streams.items()):  # (a pump may start streams)
            box = self.outboxes[peer]
            moved = self._pump(peer, stream, box.staging, box.drained(), box.filled,
                               box.publish_filled) or moved
        for peer, stream in list(self.in_streams.items()):
            inbox = self.inboxes[peer]
            moved = self._pump(peer, stream, inbox.staging, inbox.filled(), inbox.drained_count,
                               inbox.publish_drained) or moved
        for streams in (self.out_streams, self.in_streams):
            for peer in [p for p, stream in streams.items() if not stream]:
                del streams[peer]
        return moved

    def _pump(self, peer: int, stream: Stream, staging: memoryview, peer_count: int,
              own_count: int, publish: Callable[[int], None]) -> bool:
        """Copy every fragment of ``stream`` that may move now, through ``staging``; True
        if any did. ``own_count``: the running count this side last published. The
        protocol's Stream says what goes where; the copies are here."""
        slot_bytes = self.config.frag_size
        copied = False
        while True:
            step = stream.next(peer_count, own_count)
            if step is None:
                op = stream.through()
                if op is None:
                    break
                if stream.sending:
                    self.run(self.engine.streamed_out(op))  # type: ignore[arg-type]
                else:
                    self.run(self.engine.streamed_in(op))  # type: ignore[arg-type]
                continue
            op, slot, start, stop = step
            transport = self.transports.get(op.mechanism) or self.transports["shm"]
            copy = transport.stage if stream.sending else transport.drain
            window = staging[slot * slot_bytes : slot * slot_bytes + (stop - start)]
            at = 0
            for piece in slice_views(op.segments, start, stop):
                copy(window[at : at + piece.nbytes], piece)
                at += piece.nbytes
            own_count = stream.copied()
            publish(own_count)
            copied = True
        if copied and self.peer_sleeping(peer):
            self.ring(peer)
        return copied

    # -- waiting

    def wait(self, op: SendOp | RecvOp) -> None:
        """Progress until ``op`` is done; a large send spins about as long as its copy should take,
        yielding the CPU (``wait_until`` for the rest)."""
        if op.done:
            return
        peer = op.dest if isinstance(op, SendOp) else op.source
        large = isinstance(op, SendOp) and op.nbytes >= YIELD_FROM_BYTES
        spin = max(SPIN_SECONDS, op.nbytes / SLOWEST_COPY_BYTES_PER_S) if large else SPIN_SECONDS
        self.wait_until(lambda: op.done, None if peer == ANY_SOURCE else peer, spin, large)

    def wait_until(self, done: Callable[[], bool], peer: int | None,
                   spin: float = SPIN_SECONDS, yield_cpu: bool = False,
                   outside: Callable[[], object] | None = None) -> None:
        """Progress until ``done()``: spin for ``spin`` seconds, then sleep on the doorbell.

        ``peer`` is the rank whose exit makes waiting pointless (None: any rank may answer).
        ``yield_cpu``: call sched_yield while spinning (always so when ranks outnumber cores).
        ``outside``: one pass of another engine that must move too (cma.mpi's MPI on a
        rank with peers off this node), called every pass. It cannot ring the doorbell, so
        the sleeps are pauses doubling from OUTSIDE_PAUSE_MIN to OUTSIDE_PAUSE_MAX_MS, and
        ``peer`` None means that no exit ends the wait (an off-node rank may answer).
        ``done`` is then called once a pass, and once more only to return (mprobe's takes
        the message it finds).
        """
        owner = self.owner
        held = claim(owner)
        try:
            self._wait_loop(done, peer, spin, yield_cpu, outside)
        except CmaError:
            raise  # raised on purpose, where the state is whole
        except BaseException as exc:
            if not _raised_while_idle(exc):
                self.break_down(f"{type(exc).__name__} interrupted rank {self.rank} while it "
                                "was handling its peers' packets; what it shares with them may "
                                "be half updated")
            raise
        finally:
            owner._busy = held

    def _wait_loop(self, done: Callable[[], bool], peer: int | None, spin: float,
                   yield_cpu: bool, outside: Callable[[], object] | None) -> None:
        deadline = look = 0.0
        yield_cpu = yield_cpu or self.oversubscribed
        slept = False
        pause = OUTSIDE_PAUSE_MIN
        exits_end_it = peer is not None or outside is None
        while not done():
            if outside is not None:
                outside()
            # Once asleep, a pass runs only if there is work: a Ctrl-C landing inside an
            # empty pass (every SLEEP_MS) would otherwise break the communicator (#23).
            if (not slept or self._has_work()) and self._poll():
                deadline = 0.0
                slept = False
                pause = OUTSIDE_PAUSE_MIN
                continue
            if yield_cpu:
                os.sched_yield()
            now = time.perf_counter()
            if not deadline:
                deadline = now + spin
                look = now + SLEEP_MS * 1e-3
                continue
            if now < deadline and not self.pulls:
                # A long spin (a large send's: as long as the peer's copy may take) looks
                # for exited peers every SLEEP_MS, as sleeping would; a receiver killed
                # mid-copy was noticed only when the spin ended, 1 s per GiB.
                if now >= look:
                    look = now + SLEEP_MS * 1e-3
                    gone = self.world.sleep(0)  # (pidfds and doorbell; we poll rings anyway)
                    if gone:
                        self.bury(gone)
                        error = self.exit_error(peer)
                        if error is not None and exits_end_it and not done():
                            raise error
                continue  # (a background pull needs the GIL back, and rings when done)
            # The deadline stays expired: only progress (above) earns a new spin, so a
            # waiter that wakes to nothing every SLEEP_MS sleeps again at once instead of
            # spinning (1 ms in 11 was 9 % of a CPU per idle waiter, taken from the peer).
            if outside is None:
                self.doze(SLEEP_MS, done, idle=slept)
            elif pause < OUTSIDE_PAUSE_MAX_MS / 1000:
                time.sleep(pause)
                pause *= 2
            else:
                self.doze(OUTSIDE_PAUSE_MAX_MS, idle=slept)
            slept = True
            if self.dead and exits_end_it:
                error = self.exit_error(peer)
                if error is not None:
                    if done():
                        return
                    raise error

    def await_head(self, inbox: Inbox) -> bool:
        """Wait until a packet is at the head of ``inbox``, leaving it there for a fast path
        to take (a blocking Recv's, whose spin found the ring empty): spin (yielding the
        CPU at each look when ranks outnumber CPUs), then sleep on the doorbell. False, at
        once or later, when this rank has anything else to do (a packet from another peer,
        a queue, a stream, a pull, a peer connecting or exiting): the caller then waits in
        the engine, which does it all. Taking a late message as
        the fast path does spares it the engine's handling (docs/architecture.md, "Direct
        rendezvous", has the cost)."""
        owner = self.owner
        held = claim(owner)
        try:
            world = self.world
            deadline = time.perf_counter() + SPIN_SECONDS
            yield_cpu = self.oversubscribed
            while not inbox.ready():
                if self._busy_elsewhere() or self.dead or self.broken:
                    return inbox.ready()  # (the work found may be its packet, come since)
                if yield_cpu:
                    os.sched_yield()
                if time.perf_counter() < deadline:
                    continue
                for peer, box in self.inboxes.items():
                    box.publish_tail()
                    # The fast path publishes room without ringing: a sender asleep for room
                    # would sleep out its SLEEP_MS while this rank waits for it. Rung once
                    # per room made, so two ranks waiting here never ring each other awake.
                    if box.room_told != box.tail_published:
                        box.room_told = box.tail_published
                        if self.peer_sleeping(peer):
                            self.ring(peer)
                world.set_sleeping(1)
                try:
                    if self._busy_elsewhere():
                        return inbox.ready()
                    self.release_quiet_rings()
                    gone = world.sleep(SLEEP_MS)
                    self.counts.control_syscalls += 1
                finally:
                    world.set_sleeping(0)
                if gone:  # (not buried here: the engine's wait finds the pidfds still ready)
                    return inbox.ready()
            return True
        finally:
            owner._busy = held

    def _busy_elsewhere(self) -> bool:
        """``_has_work``, but for the FIN of the ``offered`` send, which is taken here (as
        the offer's own spin would): in an all-to-all of Sendrecvs it often comes while
        the receive waits, and the engine's wait would cost that receive ~130 us
        (docs/architecture.md, "Direct rendezvous")."""
        if not self._has_work():
            return False
        op = self.offered
        if op is None or not self.took_offered_fin(self.inboxes[op.dest]):
            return True
        return self._has_work()

    def took_offered_fin(self, inbox: Inbox) -> bool:
        """Whether the packet at the head of ``inbox`` was the FIN of the ``offered`` send,
        now taken (the send is complete)."""
        op = self.offered
        if op is None or op.done or inbox.peer != op.dest or inbox.take_if(FIN, op.msgid):
            return False
        self.engine.direct_done(op)
        return True

    def doze(self, timeout_ms: int, done: Callable[[], bool] | None = None,
             idle: bool = False) -> None:
        """Sleep on this rank's doorbell and its peers' pidfds for up to ``timeout_ms``,
        unless the rings moved, ``done()``, or a peer connected, once the sleeping flag is
        up; peers that exited meanwhile are buried (``exit_error`` then says whom a wait
        may no longer expect).

        ``done`` may be left out where calling it twice would take two messages (mprobe).
        ``idle``: this wait has slept already, so a pass runs only if there is work (a
        Ctrl-C landing inside an empty pass, every SLEEP_MS, would break the communicator).
        """
        world = self.world
        world.set_sleeping(1)
        try:
            # (accept: a peer's hint may have been lost, cleared here as it was set)
            if (not idle or self._has_work()) and (self._poll() or self.accept()) \
                    or done is not None and done():
                return
            self.release_quiet_rings()
            gone = world.sleep(timeout_ms)
            self.counts.control_syscalls += 1
        finally:
            world.set_sleeping(0)
        if gone:
            self.bury(gone)

    def release_quiet_rings(self) -> None:
        """Hand back the pages of the rings this rank writes whose head and published tail
        have not moved since the last look (at least QUIET_SECONDS ago) but did since the
        last release (a reader that was late frees pages when it catches up): a pair that
        went quiet holds no more shared memory than its rings' control pages and the
        pages of packets not yet read. Only the writer may do it
        (Outbox.release_free_pages), so a rank does it as it goes to sleep, at most every
        QUIET_SECONDS (``quiet_look``). Where the
        kernel refuses, this rank stops trying and says so once: it only saves memory."""
        if time.perf_counter() < self.quiet_look:
            return
        try:
            for out in self.outboxes.values():
                ends = out.ends()
                if ends == out.quiet and ends != out.released:
                    self.counts.control_syscalls += out.release_free_pages()
                out.quiet = ends
        except CmaError as exc:
            self.quiet_look = float("inf")
            warnings.warn(f"rank {self.rank} keeps its rings' pages from now on: {exc}",
                          RuntimeWarning, stacklevel=2)
            return
        self.quiet_look = time.perf_counter() + QUIET_SECONDS

    def _has_work(self) -> bool:
        """Whether a pass of progress would find anything to do; reads only, so a signal
        raised in here leaves nothing half done. (The first pass of a wait published
        every tail the fast paths consumed; later passes publish their own.)"""
        if self.loopback or self.txq_pending or self.out_streams or self.in_streams or self.pulls:
            return True
        xmap = self.xmap
        if xmap is not None and (xmap.released or xmap.given_back):
            return True
        # (a packet came since the last full pass: it may be in a ring still, or taken
        # already by a fast path, which consumes without that pass)
        if self.heads_row.tobytes() != self.heads_drained:
            for box in self.inboxes.values():
                if box.ready():
                    return True
        return bool(self._newly_connected())

    def _newly_connected(self) -> list[int]:
        """The peers that connected to this rank and that it has not connected back (reads
        only: a wait asks it while idle)."""
        if len(self.outboxes) == len(self.peers):
            return []
        return [r for r in self.world.connected_to_me() if r not in self.outboxes and r not in self.dead]

    def withdraw(self, op: SendOp | RecvOp) -> None:
        """Take a receive whose caller gave up waiting (an exception left its Wait) out of
        matching, if nothing matched it yet: the next receive gets the message instead.

        A receive already matched is not withdrawn (as MPI_Cancel): its copy may be under
        way, so it completes into its buffer during later calls. A send cannot be
        withdrawn either: its peer was told of it and takes it when it receives.
        """
        if self.broken or not isinstance(op, RecvOp):
            return
        owner = self.owner
        held = claim(owner)
        try:
            posted = self.matcher.posted
            if op in posted:
                posted.remove(op)
                op.error = Cancelled(
                    f"this receive (source {op.source}, tag {op.tag}) was withdrawn when an "
                    "exception left its Wait; nothing was received into its buffer")
                op.done = True
        finally:
            owner._busy = held

    def break_down(self, reason: str) -> None:
        """Make every later operation raise CommBroken(reason); close() still releases all."""
        self.broken = reason
        # (the general paths all go through the engine, so each now raises at its first use)
        self.engine = cast(Engine, _BrokenEngine(reason))
        empty_slots(self.fast_outboxes)  # (so the fast paths take the general ones)
        empty_slots(self.fast_inboxes)
        self.txq_pending = 0  # (a flush would put peers back in fast_outboxes)

    # -- peers that exit

    def notice_exits(self) -> None:
        """Bury the peers whose pidfds report an exit, without sleeping (a wait inside
        another library's loop, which never sleeps in ``doze``)."""
        owner = self.owner
        held = claim(owner)
        try:
            # (a sleep of 0 ms: it drains a rung doorbell too, which loses no wake-up, since
            # every sleeper polls its rings once its flag is up)
            gone = self.world.sleep(0)
            if gone:
                self.bury(gone)
        finally:
            owner._busy = held

    def exit_error(self, peer: int | None) -> PeerGone | None:
        """The error of a wait for ``peer`` (None or ANY_SOURCE: any rank may answer) now
        that the ranks in ``dead`` have exited, or None if it may still end. The one place
        that decides a peer is gone, for cma.Comm's waits and cma.mpi's alike. A wildcard
        wait ends once every connected peer has exited and every other rank is known to
        have exited too (one never connected may still send)."""
        if peer is None or peer == ANY_SOURCE:
            if self.dead.issuperset(self.connected) and all(
                    self.world.exited(r) for r in self.peers if r not in self.outboxes):
                return PeerGone("every other rank has exited; nothing can complete this operation")
            return None
        if peer in self.dead:
            return PeerGone(f"rank {peer} (pid {self.world.pid_of(peer)}) exited before "
                            "completing this operation")
        return None

    def bury(self, gone: list[int]) -> None:
        """Take what the exited ranks left in the rings, then mark them dead."""
        world = self.world
        while self._poll():
            pass
        for r in gone:
            self.dead.add(r)
            world.unwatch(r)

    # -- teardown

    def deliver_queued(self) -> None:
        """Wait until the packets queued for each peer are in its ring, and the buffered
        sends to it received, or moot.

        A send that found the ring full returned with its packet queued here; the ring
        outlives this process, the queue does not. Like MPI_Finalize after a buffered
        send, this waits for the peer to read: a peer that has exited or closed never
        will, and a peer that waits for this process to exit first deadlocks.
        """
        world = self.world
        for dest in self.connected:
            queue = self.txq[dest]
            buffered = [op for op in self.buffered if op.dest == dest]
            if (queue or buffered) and dest not in self.dead:
                try:
                    self.wait_until(lambda: not queue and all(op.done for op in buffered)  # noqa: B023
                                    or world.has_closed(dest), dest)  # noqa: B023
                except PeerGone:
                    pass
        self.buffered.clear()

    def close(self) -> None:
        """Finish what peers wait for (when this process attached the rank and the
        communicator is whole), then release the transports; the world is the caller's."""
        self.closing = True
        try:
            copier_stopped = self.pulls.shutdown()
            if not self.broken and self.world.owned_here():
                if copier_stopped:
                    self._finish_pulls()  # no pull may outlive the fds it reads through
                self.overlap = False  # a pull matched from here on copies at once
                self.deliver_queued()  # including the FINs their senders wait for
                self.world.mark_closed()
        finally:
            empty_slots(self.fast_outboxes)  # (their views die with the world)
            empty_slots(self.fast_inboxes)
            self.connection.close()


class _BrokenEngine:
    """Stands in for a broken communicator's engine: any use raises CommBroken."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str) -> Any:
        raise CommBroken(f"this communicator is unusable: {self.reason}. Close it; the ranks "
                         "must start a new world (cma.Pipe, cma-run) to talk again")


# Where a wait holds nothing half done: its loop's own steps, its sleep and what these
# call directly (the done() predicate, a comprehension), the read-only look for work,
# but not a pass of progress.
_IDLE_CODE = frozenset({Progress.wait_until.__code__, Progress._wait_loop.__code__,
                        Progress.doze.__code__, Progress.exit_error.__code__,
                        Progress.release_quiet_rings.__code__, Outbox.release_free_pages.__code__,
                        _linux.release_pages.__code__,
                        Progress._has_work.__code__, Progress._newly_connected.__code__,
                        World.connected_to_me.__code__, Inbox.ready.__code__,
                        Inbox._position.__code__, BackgroundPulls.__bool__.__code__,
                        World.sleep.__code__, World.set_sleeping.__code__,
                        _linux.EpollSet.wait.__code__})
_BUSY_CODE = frozenset({Progress._poll.__code__, Progress.bury.__code__,
                        Progress.accept.__code__})


def _raised_while_idle(exc: BaseException) -> bool:
    """Whether ``exc`` (e.g. a signal handler's KeyboardInterrupt, which Python raises
    between any two bytecodes) came from a waiting rank's sleep or loop, not from the
    middle of its handling of a packet or a copy: every frame it left from the wait
    inward is idle code, but for the innermost, which may be any leaf an idle frame
    calls (the ``done()`` predicate, an ``outside`` pass) other than a pass of progress."""
    codes = []
    tb = exc.__traceback__
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    # A handler written in Python (cma.mpi's deferred SIGINT, a program's own) raises in
    # frames of its own: the signal landed in the frame that runs under them.
    handlers = _python_signal_handlers()
    for depth in range(len(codes) - 1, 0, -1):
        if codes[depth] in handlers:
            del codes[depth:]
            break
    *callers, innermost = codes
    return all(code in _IDLE_CODE for code in callers) and (
        innermost in _IDLE_CODE or innermost not in _BUSY_CODE)


def _python_signal_handlers() -> set[CodeType]:
    """The code of every signal handler written in Python that is installed now."""
    codes = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except ValueError:  # (a number this platform reserves)
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            codes.add(code)
    return codes

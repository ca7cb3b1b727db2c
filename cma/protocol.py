"""The message protocols, written once and free of I/O.

Like h11, this module takes events (a send or receive posted by the user, a control
packet arrived from a peer, a copy finished) and returns actions (transmit a packet,
pull or push bytes with a transport, stream fragments through staging, complete an
operation). It never touches shared memory, file descriptors or processes, so every
rule here is unit-tested without them (tests/test_protocol.py).

Protocols, chosen per message:

EAGER      payload <= eager limit travels inline in the control packet.
RGET       sender posts RTS with its regions; receiver pulls them and answers FIN.
RPUT       sender posts RTS; receiver answers CTS with its regions; sender pushes, sends FIN.
PIPELINE   sender posts RTS; receiver answers CTS; fragments flow through staging
           slots shared by the pair, both sides copying at once.
SPLIT      sender posts RTS with its regions; receiver answers CTS with the regions of
           the second half of its buffer and pulls the first half while the sender
           pushes the second; each side sends FIN when its half is in. A single copy
           with both processes' CPUs on it: one process_vm_readv stream is bounded
           by one core's copy rate, well below what the memory system gives two.

The receiver picks RGET, RPUT or PIPELINE when it matches the RTS, because only the
receiver knows whether it may read the sender's memory (ptrace rules are not
symmetric: a non-dumpable sender refuses readers but may still write to them).
"""

from __future__ import annotations

import heapq
import itertools
import operator
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import MessageTooLarge, ProtocolError, TruncationError
from .wire import (
    ANY_SOURCE,
    ANY_TAG,
    CTS,
    EAGER,
    FIN,
    KIND_MASK,
    MORE,
    OBJECT,
    RTS,
    SYNC,
    UNMAP,
    HeapRef,
    Region,
)

# transfer modes, offered by the sender in RTS and chosen by the receiver in CTS/pull
PULL = 1
PUSH = 2
PIPELINE = 4
SPLIT = 8  # a receiver's choice only: needs PULL and PUSH offered
# offered with PULL when every send buffer lies in the sender's shared heap: the RTS then
# carries a HeapRef per buffer, and a receiver that can map the sender's heap (xmap)
# copies from its own mapping, or hands out a view of it (recv_view)
XMAP = 16
# offered with PULL by a sender that offers one buffer to several readers at once (a flat
# Bcast's root): a receiver pulls it with any transport that can, whatever auto's choice
# for one message would be (SPLIT or a push would have the sender copy for every reader)
PULL_FIRST = 32
OFFER_BITS = PULL | PUSH | PIPELINE | XMAP | PULL_FIRST
REGION_OFFER_BITS = OFFER_BITS & ~XMAP  # (an RTS of a region alone)
PROTOCOL_NAMES = {PULL: "RGET", PUSH: "RPUT", PIPELINE: "PIPELINE", SPLIT: "SPLIT", XMAP: "XMAP"}
# No Linux user address space reaches 2**56 (x86-64's 5-level paging stops just below):
# a region a peer names beyond it, or wrapping round, is a forgery, not a buffer.
ADDRESS_LIMIT = 1 << 56
# the flags each packet kind may carry
KIND_FLAGS = {EAGER: OBJECT | SYNC, RTS: OBJECT, CTS: 0, FIN: 0, UNMAP: 0}
HEAP_REF_WORDS = len(HeapRef._fields)


def split_point(nbytes: int) -> int:
    """Where a SPLIT message's halves meet: half way, on a page boundary (0: too small)."""
    return nbytes // 2 & ~4095


def slice_regions(regions: Sequence[Region], start: int, stop: int) -> list[Region]:
    """The non-empty parts of ``regions`` holding bytes [start, stop) of their concatenation."""
    out = []
    base = 0
    for addr, nbytes in regions:
        lo, hi = max(start, base), min(stop, base + nbytes)
        if lo < hi:
            out.append(Region(addr + lo - base, hi - lo))
        base += nbytes
    return out


def slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The non-empty views covering bytes [start, stop) of the concatenation of ``views``."""
    out = []
    base = 0
    for view in views:
        lo, hi = max(start, base), min(stop, base + view.nbytes)
        if lo < hi:
            out.append(view[lo - base : hi - base])
        base += view.nbytes
        if base >= stop:
            break
    return out


def tag_matches(wanted: int, tag: int) -> bool:
    return wanted == tag or (wanted == ANY_TAG and tag >= 0)


def source_matches(wanted: int, source: int) -> bool:
    return wanted == source or wanted == ANY_SOURCE


# ------------------------------------------------------------------ wire formats

def encode_rts(msgid: int, offers: int, sizes: Sequence[int], regions: Sequence[Region] | None,
               heap: Sequence[HeapRef] | None = None) -> bytes:
    """``heap`` (with ``regions``, and XMAP in ``offers``): where each buffer lies in the
    sender's shared heap."""
    words = array("q", [msgid, offers, len(sizes)])
    words.extend(sizes)
    if regions is not None:
        for region in regions:
            words.append(region.addr)
    if heap is not None:
        for ref in heap:
            words.extend(ref)
    return words.tobytes()


# An RTS of one buffer offered by its region, as encode_rts lays it out (msgid, offers, 1,
# size, address): what a blocking Send's direct rendezvous writes and its Recv reads
# without the engine (cma/direct.py; docs/architecture.md, "Direct rendezvous").
ONE_REGION_RTS = struct.Struct("5q")


def encode_one_region_rts(msgid: int, offers: int, addr: int, nbytes: int) -> bytes:
    """``encode_rts(msgid, offers, [nbytes], [Region(addr, nbytes)])``, in a tenth of its time."""
    return ONE_REGION_RTS.pack(msgid, offers, 1, nbytes, addr)


def decode_one_region_rts(words: Sequence[int], nbytes: int) -> tuple[int, int, Region] | None:
    """The msgid, offers and region of an RTS (its ``ONE_REGION_RTS`` words) if it offers
    one buffer of ``nbytes`` by a region of some user address space, for a pull; else None
    (``decode_rts`` reads it, and names what is wrong with it)."""
    msgid, offers, nseg, size, addr = words
    if nseg != 1 or size != nbytes or not offers & PULL or offers & ~REGION_OFFER_BITS \
            or size < 0 or not 0 <= addr <= ADDRESS_LIMIT - size:
        return None
    return msgid, offers, Region(addr, size)


# An RTS of one buffer in the sender's shared heap, as encode_rts lays it out (msgid,
# offers with XMAP, 1, size, address, then the six words of its HeapRef): what the direct
# rendezvous writes for a heap buffer where xmap is on, and its Recv or recv_view reads.
ONE_HEAP_RTS = struct.Struct(f"{5 + HEAP_REF_WORDS}q")
ONE_HEAP_RTS_WORDS = ONE_HEAP_RTS.size // 8


def encode_one_heap_rts(msgid: int, offers: int, addr: int, nbytes: int, ref: HeapRef) -> bytes:
    """``encode_rts(msgid, offers | XMAP, [nbytes], [Region(addr, nbytes)], [ref])``, fast."""
    return ONE_HEAP_RTS.pack(msgid, offers | XMAP, 1, nbytes, addr, *ref)


def decode_one_heap_rts(words: Sequence[int], nbytes: int) -> tuple[int, int, Region, HeapRef] | None:
    """The msgid, offers, region and HeapRef of an RTS (its ``ONE_HEAP_RTS`` words) if it
    offers one buffer of ``nbytes`` in the sender's heap, as ``decode_rts`` checks it; else
    None (``decode_rts`` reads it, and names what is wrong with it)."""
    msgid, offers, nseg, size, addr = words[:5]
    ref = HeapRef(*words[5:])
    if nseg != 1 or size != nbytes or offers & (PULL | XMAP) != PULL | XMAP \
            or offers & ~OFFER_BITS \
            or size < 0 or not 0 <= addr <= ADDRESS_LIMIT - size \
            or not _places(ref, size):
        return None
    return msgid, offers, Region(addr, size), ref


def _places(ref: HeapRef, size: int) -> bool:
    """Whether ``ref`` can place a buffer of ``size`` bytes in a heap segment."""
    return (0 <= ref.segment and 1 <= ref.generation and 0 <= ref.offset
            and ref.offset + size <= ref.extent <= ADDRESS_LIMIT and 0 <= ref.fd
            and 0 <= ref.inode)


@dataclass
class RtsInfo:
    msgid: int
    offers: int
    sizes: list[int]
    regions: list[Region] | None
    heap: list[HeapRef] | None = None


def _words(payload: bytes | memoryview, at_least: int, what: str, peer: int) -> array[int]:
    if len(payload) % 8 or len(payload) < 8 * at_least:
        raise ProtocolError(f"rank {peer} broke the protocol: {what} of {len(payload)} bytes "
                            f"(whole 8-byte words, at least {at_least}, expected)", peer=peer)
    words = array("q")
    words.frombytes(payload)
    return words


def check_regions(regions: Sequence[Region], what: str, peer: int) -> None:
    """ProtocolError unless every region is a stretch of some user address space."""
    for addr, nbytes in regions:
        if not (0 <= addr and 0 <= nbytes and addr + nbytes <= ADDRESS_LIMIT):
            raise ProtocolError(f"rank {peer} broke the protocol: {what} names {nbytes} bytes at "
                                f"{addr:#x}, which no process's memory holds", peer=peer)


def decode_rts(payload: bytes | memoryview, peer: int = -1) -> RtsInfo:
    """An RTS's fields; ProtocolError (naming ``peer``) if they do not hang together."""
    words = _words(payload, 3, "an RTS", peer)
    msgid, offers, nseg = words[0], words[1], words[2]
    mapped = bool(offers & XMAP)
    lengths = (3 + (2 + HEAP_REF_WORDS) * nseg,) if mapped else (3 + nseg, 3 + 2 * nseg)
    if not (0 <= nseg and len(words) in lengths) or offers & ~OFFER_BITS \
            or (mapped or offers & PULL_FIRST) and not offers & PULL:
        raise ProtocolError(f"rank {peer} broke the protocol: an RTS of {len(words)} words "
                            f"claims {nseg} buffers, offers {offers:#x}", peer=peer)
    sizes = list(words[3 : 3 + nseg])
    addrs = words[3 + nseg : 3 + 2 * nseg]
    regions = [Region(a, n) for a, n in zip(addrs, sizes, strict=True)] if len(addrs) == nseg else None
    check_regions(regions or [Region(0, n) for n in sizes], "an RTS", peer)
    heap = None
    if mapped:
        at = 3 + 2 * nseg
        heap = [HeapRef(*words[at + i * HEAP_REF_WORDS : at + (i + 1) * HEAP_REF_WORDS])
                for i in range(nseg)]
        for ref, size in zip(heap, sizes, strict=True):
            if not _places(ref, size):
                raise ProtocolError(f"rank {peer} broke the protocol: an RTS places a buffer of "
                                    f"{size} bytes in its heap at {ref}, which no segment "
                                    "holds", peer=peer)
    return RtsInfo(msgid, offers, sizes, regions, heap)


def encode_unmap(segments: Sequence[tuple[int, int]]) -> bytes:
    """An UNMAP's payload: the (index, generation) of each heap segment given back."""
    words = array("q")
    for index, generation in segments:
        words.extend((index, generation))
    return words.tobytes()


def decode_unmap(payload: bytes | memoryview, count: int, peer: int = -1) -> list[tuple[int, int]]:
    """An UNMAP's segments; ProtocolError (naming ``peer``) unless it holds ``count`` of them."""
    words = _words(payload, 0, "an UNMAP", peer)
    if count < 0 or len(words) != 2 * count:
        raise ProtocolError(f"rank {peer} broke the protocol: an UNMAP of {len(words)} words "
                            f"for {count} segments", peer=peer)
    return [(words[2 * i], words[2 * i + 1]) for i in range(count)]


def encode_cts(msgid: int, recvid: int, mode: int, transport: str, regions: Sequence[Region]) -> bytes:
    words = array("q", [msgid, recvid, mode, len(regions)])
    for region in regions:
        words.extend((region.addr, region.nbytes))
    return words.tobytes() + transport.encode()


@dataclass
class CtsInfo:
    msgid: int
    recvid: int
    mode: int
    transport: str
    regions: list[Region]


def decode_cts(payload: bytes | memoryview, peer: int = -1) -> CtsInfo:
    """A CTS's fields; ProtocolError (naming ``peer``) if they do not hang together."""
    head = _words(bytes(payload[:32]), 4, "a CTS", peer)
    msgid, recvid, mode, nreg = head
    end = 32 + 16 * nreg
    name = bytes(payload[end:]) if 0 <= nreg and end <= len(payload) else b""
    if not name.isascii() or not name.isalnum() or mode not in (PUSH, SPLIT, PIPELINE):
        raise ProtocolError(f"rank {peer} broke the protocol: a CTS of {len(payload)} bytes "
                            f"with mode {mode:#x} and {nreg} regions", peer=peer)
    body = array("q")
    body.frombytes(bytes(payload[32:end]))
    regions = [Region(body[2 * i], body[2 * i + 1]) for i in range(nreg)]
    check_regions(regions, "a CTS", peer)
    return CtsInfo(msgid, recvid, mode, name.decode(), regions)


# ------------------------------------------------------------------ operations

@dataclass(eq=False)
class SendOp:
    dest: int
    tag: int
    segments: list[memoryview]
    nbytes: int
    is_object: bool
    msgid: int = 0
    mechanism: str = "eager"
    copies_left: int = 1  # copies still to finish before done: 2 for SPLIT (ours and the peer's)
    done: bool = False
    # what the peer may still send about this message (anything else is a forgery)
    awaits_cts: bool = False  # an RTS went out: a CTS, or a FIN if the peer pulls
    awaits_fin: bool = False


class Scattered(Protocol):
    """A receive buffer in several places (cma.mpi's MPI datatypes with gaps): eager
    payloads are copied in with ``buffer[:n] = payload``, a rendezvous lands in the
    views ``segments(n)`` returns."""

    nbytes: int
    readonly: bool

    def __setitem__(self, cut: slice, payload: Any) -> None: ...

    def segments(self, nbytes: int) -> list[memoryview]:
        """Where a rendezvous of ``nbytes`` lands: views of the buffer's blocks, or of a staging area."""


@dataclass(eq=False)
class RecvOp:
    source: int
    tag: int
    buffer: memoryview | Scattered | None  # None: an object receive, buffers allocated on match
    recvid: int = 0
    # filled on match
    matched_source: int = ANY_SOURCE
    matched_tag: int = ANY_TAG
    nbytes: int = 0
    is_object: bool = False
    segments: list[memoryview] = field(default_factory=list)
    mechanism: str = "eager"
    error: Exception | None = None
    copies_left: int = 1
    done: bool = False
    awaits_fin: bool = False  # RPUT or SPLIT: the sender's FIN says its copy is in
    # recv_view: no buffer; the sender's memory is mapped and handed out in place if it can
    # be (the FIN waits until the view is released), else the message lands in a new one
    view: bool = False
    held: Any = None  # recv_view: what the I/O layer handed out (the mapped view)

    @property
    def capacity(self) -> int:
        """Bytes the receive buffer holds (-1: an object receive, buffers allocated on match)."""
        return -1 if self.buffer is None else self.buffer.nbytes


def posted_recv(source: int, tag: int, buffer: memoryview | Scattered) -> RecvOp:
    """A buffer receive as ``Engine.recv`` posts it, built without the dataclass __init__:
    parsing its keywords cost ~320 ns against ~120 here (Comm.Irecv's fast paths make
    one per call). The fields not set keep the defaults the dataclass leaves on the class."""
    op = _new_recv_op(RecvOp)
    op.source = source
    op.tag = tag
    op.buffer = buffer
    op.segments = []
    return op


def eager_received(op: RecvOp, matched_source: int, matched_tag: int, nbytes: int) -> None:
    """``op`` received a plain eager message that a fast path copied into its buffer
    straight from the ring: what ``Engine._receive_matched`` records for one that fits."""
    op.matched_source = matched_source
    op.matched_tag = matched_tag
    op.nbytes = nbytes
    op.done = True


def completed_recv(source: int, tag: int, buffer: memoryview, matched_source: int,
                   matched_tag: int, nbytes: int) -> RecvOp:
    """A buffer receive that completed as it was made (Comm.Irecv finding its message at
    the head of the ring): ``posted_recv``'s, with ``eager_received``'s fields."""
    op = posted_recv(source, tag, buffer)
    eager_received(op, matched_source, matched_tag, nbytes)
    return op


# bound once: looking up object.__new__ per call cost ~30 ns of posted_recv's ~120
_new_recv_op = object.__new__


@dataclass(eq=False)
class Arrival:
    """A message that arrived before a receive matched it (the unexpected queue)."""

    source: int
    tag: int
    is_object: bool
    nbytes: int
    eager: bytes | None  # inline payload, copied out of the ring
    rts: RtsInfo | None
    sync: int = 0  # a synchronous eager send's msgid: FIN it once matched


# ------------------------------------------------------------------ actions

@dataclass
class Transmit:
    dest: int
    kind: int
    tag: int
    aux: int  # the packet's fourth word: what it holds depends on the kind (wire.py)
    payload: bytes


@dataclass
class Deliver:
    """Copy an inline payload into the receive's buffer(s)."""

    op: RecvOp
    payload: bytes | memoryview


@dataclass
class Pull:
    """Copy the peer's ``remote`` regions into ``local`` (the receive's segments, or part)."""

    op: RecvOp
    peer: int
    transport: str
    remote: list[Region]
    local: list[memoryview]
    msgid: int
    heap: list[HeapRef] | None = None  # xmap: copy from our mapping of the peer's heap
    rts: RtsInfo | None = None  # (with heap: the RTS, answered again if mapping is refused)


@dataclass
class MapView:
    """Map the buffers ``refs`` name in the peer's heap (of ``sizes`` bytes) and hand them
    out as ``op``'s views; the FIN for ``msgid`` goes when every one of them is released
    (``Engine.view_released``)."""

    op: RecvOp
    peer: int
    refs: list[HeapRef]
    sizes: list[int]
    msgid: int
    rts: RtsInfo  # answered again (a copy) if mapping is refused: Engine.map_refused


@dataclass
class Unmap:
    """``peer`` gave these heap segments (index, generation) back: drop our mappings of them."""

    peer: int
    segments: list[tuple[int, int]]


@dataclass
class Push:
    """Copy ``local`` (the send's segments, or part) into the peer's ``remote`` regions."""

    op: SendOp
    transport: str
    remote: list[Region]
    local: list[memoryview]
    recvid: int


@dataclass
class StreamOut:
    op: SendOp


@dataclass
class StreamIn:
    op: RecvOp


@dataclass
class Complete:
    op: SendOp | RecvOp


Action = Transmit | Deliver | Pull | Push | StreamOut | StreamIn | Complete | MapView | Unmap


# ------------------------------------------------------------------ matching

class Arrivals:
    """The unexpected queue: arrivals in the order they came, kept per source, so that a
    receive from one source looks at that source's arrivals alone. With one queue for
    all, a Gather's root at 8 ranks, its senders thousands of calls ahead, scanned them
    all at every receive (docs/guide.md section 7, "An unexpected queue per source").
    ANY_SOURCE takes the earliest match over the sources' queues."""

    __slots__ = ("_by_source", "_arrived", "_count")

    def __init__(self) -> None:
        self._by_source: dict[int, deque[tuple[int, Arrival]]] = {}
        self._arrived = 0  # arrivals so far: each one's place in the order
        self._count = 0

    def append(self, arrival: Arrival) -> None:
        """``arrival`` is the latest: last of its source's, and numbered after all before it."""
        queue = self._by_source.get(arrival.source)
        if queue is None:
            queue = self._by_source[arrival.source] = deque()
        queue.append((self._arrived, arrival))
        self._arrived += 1
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Arrival]:
        """Every arrival, in the order they came."""
        return (arrival for _, arrival in heapq.merge(*self._by_source.values(),
                                                        key=operator.itemgetter(0)))

    def _find(self, source: int, tag: int) -> tuple[deque[tuple[int, Arrival]], int] | None:
        if not self._count:  # (a wildcard probe of an empty queue: no walk over the sources)
            return None
        if source != ANY_SOURCE:
            queue = self._by_source.get(source)
            if queue:
                for i, (_, arrival) in enumerate(queue):
                    if tag_matches(tag, arrival.tag):
                        return queue, i
            return None
        best: tuple[deque[tuple[int, Arrival]], int] | None = None
        earliest = self._arrived
        for queue in self._by_source.values():
            for i, (arrived, arrival) in enumerate(queue):
                if tag_matches(tag, arrival.tag):
                    if arrived < earliest:
                        best, earliest = (queue, i), arrived
                    break
        return best

    def first(self, source: int, tag: int) -> Arrival | None:
        """The earliest arrival matching (source, tag), left in the queue; None if none."""
        found = self._find(source, tag)
        return None if found is None else found[0][found[1]][1]

    def take(self, source: int, tag: int) -> Arrival | None:
        """``first``, taken out of the queue."""
        found = self._find(source, tag)
        if found is None:
            return None
        queue, i = found
        arrival = queue[i][1]
        del queue[i]
        self._count -= 1
        if not queue:  # (so that a wildcard walks only the sources with arrivals waiting)
            del self._by_source[arrival.source]
        return arrival


class Matcher:
    """MPI matching: posted receives and unexpected arrivals, both in order.

    A receive takes the first arrival it matches; an arrival goes to the first posted
    receive that matches it. Arrivals from one source are fed in the order they were
    sent, which gives MPI's non-overtaking rule per pair.
    """

    def __init__(self) -> None:
        self.posted: list[RecvOp] = []
        self.unexpected = Arrivals()

    def find_unexpected(self, source: int, tag: int) -> Arrival | None:
        """The earliest arrived message matching (source, tag), left in the queue; None if none."""
        return self.unexpected.first(source, tag)

    def take_unexpected(self, source: int, tag: int) -> Arrival | None:
        """``find_unexpected``, and the message taken out of the queue."""
        return self.unexpected.take(source, tag)

    def posted_index(self, source: int, tag: int) -> int:
        """Where in ``posted`` the earliest receive that takes an arrival from (source,
        tag) is; -1 if none does."""
        for i, op in enumerate(self.posted):
            if source_matches(op.source, source) and tag_matches(op.tag, tag):
                return i
        return -1

    def expects(self, source: int, tag: int) -> bool:
        """Whether a posted receive would take an arrival from ``source`` with ``tag``."""
        return self.posted_index(source, tag) >= 0

    def take_posted(self, source: int, tag: int) -> RecvOp | None:
        """The earliest posted receive that matches an arrival from (source, tag), taken out; None if none."""
        i = self.posted_index(source, tag)
        return None if i < 0 else self.posted.pop(i)


# ------------------------------------------------------------------ pipeline schedule

class Pipeline:
    """Which bytes of a message go through which staging slot, and when.

    The pair shares ``slots`` slots of ``frag`` bytes and two running counts: fragments
    filled by the sender and fragments drained by the receiver, across all messages.
    Fragment i of this message lives in slot (first + i) % slots. The sender may fill
    fragment i once the receiver has drained fragment i - slots; the receiver may drain
    it once the sender has filled it.
    """

    # below this a fragment's fixed cost (two counter updates, a possible doorbell) weighs
    # on its copy; 64 KiB is the eager limit's size, chosen, not measured against others
    MIN_FRAGMENT = 64 << 10

    def __init__(self, nbytes: int, frag: int, slots: int, first: int) -> None:
        self.nbytes = nbytes
        self.frag = frag
        self.slots = slots
        self.first = first
        self.count = -(-nbytes // frag)
        self.next = 0  # next fragment index to fill (sender) or drain (receiver)

    @classmethod
    def for_message(cls, nbytes: int, slot_bytes: int, slots: int, first: int) -> Pipeline:
        """Fragments small enough that every slot is in use (so both sides copy at once)
        yet at least MIN_FRAGMENT (per-fragment overhead) and at most a slot."""
        spread = -(-nbytes // slots)
        frag = min(slot_bytes, max(cls.MIN_FRAGMENT, -(-spread // 4096) * 4096))
        return cls(nbytes, frag, slots, first)

    @property
    def finished(self) -> bool:
        """Whether every fragment of the message has been filled (sender) or drained (receiver)."""
        return self.next >= self.count

    @property
    def end(self) -> int:
        """The running fragment count once this message is through."""
        return self.first + self.count

    def _fragment(self) -> tuple[int, int, int]:
        i = self.next
        start = i * self.frag
        return (self.first + i) % self.slots, start, min(self.nbytes, start + self.frag)

    def fill(self, drained: int) -> tuple[int, int, int] | None:
        """(slot, start, stop) the sender may fill now, given the receiver's drained count."""
        if self.finished or self.first + self.next - drained >= self.slots:
            return None
        return self._fragment()

    def drain(self, filled: int) -> tuple[int, int, int] | None:
        """(slot, start, stop) the receiver may drain now, given the sender's filled count."""
        if self.finished or self.first + self.next >= filled:
            return None
        return self._fragment()

    def finish_fragment(self) -> int:
        """Mark the current fragment done; returns the new running count to publish."""
        self.next += 1
        return self.first + self.next


class Stream:
    """The PIPELINE messages going one way through one pair's staging slots, in order, as
    one side moves them: the sender fills slots, the receiver drains them.

    Sans-IO: ``next`` says which bytes of which message go through which slot now,
    ``copied`` marks them done and gives the running count to publish, ``through`` hands
    back a message whose bytes are all through (for the engine's streamed_out/_in). The
    caller copies, publishes the counts and wakes the peer.
    """

    def __init__(self, sending: bool, pipeline: Callable[[int, int], Pipeline]) -> None:
        self.sending = sending
        self.pipeline = pipeline  # (nbytes, first fragment's running count) -> Pipeline
        self.ops: deque[SendOp | RecvOp] = deque()
        self.pipe: Pipeline | None = None  # the first message's, once it has started

    def __bool__(self) -> bool:
        return bool(self.ops)

    def add(self, op: SendOp | RecvOp) -> None:
        """Queue a message behind those this stream moves already (one at a time, in order)."""
        self.ops.append(op)

    def next(self, peer_count: int, own_count: int) -> tuple[SendOp | RecvOp, int, int, int] | None:
        """(op, slot, start, stop) to copy now, or None. ``peer_count``: the fragments the
        peer has published (drained, for a sender; filled, for a receiver);
        ``own_count``: ours, where the next message's fragments start."""
        if not self.ops:
            return None
        pipe = self.pipe
        if pipe is None:
            pipe = self.pipe = self.pipeline(self.ops[0].nbytes, own_count)
        step = pipe.fill(peer_count) if self.sending else pipe.drain(peer_count)
        return None if step is None else (self.ops[0], *step)

    def copied(self) -> int:
        """The fragment ``next`` gave is copied: the running count to publish."""
        assert self.pipe is not None
        return self.pipe.finish_fragment()

    def through(self) -> SendOp | RecvOp | None:
        """The first message, taken out, if all its fragments are through."""
        if self.pipe is not None and self.pipe.finished:
            self.pipe = None
            return self.ops.popleft()
        return None


# The largest control packet split_packet may make: an RTS of 16 Mi buffers (16 bytes each)
MAX_JOINED_BYTES = 1 << 28


def split_packet(kind: int, payload: bytes, limit: int) -> list[tuple[int, bytes]]:
    """A control packet whose payload exceeds ``limit`` (an RTS listing thousands of
    buffers) as pieces of at most ``limit`` bytes, each but the last flagged MORE."""
    starts = range(0, len(payload), limit)
    return [(kind | (MORE if start + limit < len(payload) else 0), payload[start : start + limit])
            for start in starts]


class Joiner:
    """Joins the pieces of split control packets, per peer (split_packet's other end)."""

    def __init__(self, limit: int = MAX_JOINED_BYTES) -> None:
        self.partial: dict[int, bytearray] = {}
        self.limit = limit

    def __contains__(self, peer: int) -> bool:
        return peer in self.partial

    def join(self, peer: int, kind: int, payload: bytes | memoryview) -> bytes | None:
        """The whole payload once its last piece is in (MORE clear), else None."""
        joined = self.partial.setdefault(peer, bytearray())
        if len(joined) + len(payload) > self.limit:
            del self.partial[peer]
            raise ProtocolError(f"rank {peer} broke the protocol: a control packet split in pieces "
                                f"grew past {self.limit} bytes, more than any RTS or CTS lists",
                                peer=peer)
        joined += payload
        if kind & MORE:
            return None
        del self.partial[peer]
        return bytes(joined)


# ------------------------------------------------------------------ transport choice

@dataclass
class Policy:
    """Which mechanism moves a rendezvous message: the receiver's choice, per message.

    ``pullable[peer]`` / ``pushable[peer]`` hold the transports that connect-time probes
    found usable to read that peer's memory / for that peer to write ours. ``order``
    is the preference for large messages; under ``auto`` a transport is used from
    ``thresholds[name]`` bytes up (measured by cma-bench, see docs/transports.md).
    ``forced`` names the one transport the user asked for, if any.
    """

    order: list[str] = field(default_factory=lambda: ["shm"])
    pullable: dict[int, set[str]] = field(default_factory=dict)
    pushable: dict[int, set[str]] = field(default_factory=dict)
    staged: set[str] = field(default_factory=lambda: {"shm"})
    thresholds: dict[str, int] = field(default_factory=dict)
    forced: str | None = None
    push: bool = False  # prefer RPUT to RGET where both work
    split: bool = False  # SPLIT where a transport both pulls from and pushes to the peer
    # ranks outnumber the CPUs: a SPLIT's second copier has no CPU to itself, and waits for
    # the sender's push; the receiver pulls all of it instead (docs/transports.md, "SPLIT")
    crowded: bool = False
    split_only: set[str] = field(default_factory=set)  # unforced, used only where SPLIT works
    # called with a peer missing from ``pushable`` (it has not connected back yet, as far as
    # this rank knew): may fill its entry in
    learn: Callable[[int], None] | None = None
    mappable: set[int] = field(default_factory=set)  # peers whose heap we may map (xmap)

    def choose(self, peer: int, nbytes: int, offers: int, ring_full: bool = False
               ) -> tuple[int, str]:
        """``ring_full``: the message is within the eager limit and came as a rendezvous
        because the sender's ring was full, i.e. the sender is posting sends faster than
        we take them (an osu_bw window). It is pulled if any transport can, whatever its
        threshold: a pull needs nothing more from the sender, whereas a pipeline or a
        push waits for a sender still busy posting, and a window of them ran at a fifth
        of the eager rate (1 MiB: ~400 against ~35 us per message, ~40 pulled). So is a
        message offered PULL_FIRST, push=True or not (by the transport named, if one is)."""
        if peer not in self.pushable and self.learn is not None:
            self.learn(peer)
        pull = self.pullable.get(peer, set())
        push = self.pushable.get(peer, set())
        if offers & PULL and (offers & PULL_FIRST or ring_full and self.forced is None):
            for name in [self.forced] if self.forced else self.order:
                if name in pull:
                    return PULL, name
        for name in [self.forced] if self.forced else self.order:
            split = (self.split and name in pull and name in push and offers & PULL
                     and offers & PUSH and split_point(nbytes) > 0)
            if self.forced is None and (nbytes < self.thresholds.get(name, 0)
                                        or name in self.split_only and not split):
                continue
            if self.push and name in push and offers & PUSH:
                return PUSH, name
            if split:
                return (PULL if self.crowded else SPLIT), name
            if name in pull and offers & PULL:
                return PULL, name
            if name in push and offers & PUSH:
                return PUSH, name
            if name in self.staged and offers & PIPELINE:
                return PIPELINE, name
        return PIPELINE, "shm"


# ------------------------------------------------------------------ the engine

class Engine:
    """Matching plus the rendezvous state machines of one rank. No I/O."""

    def __init__(
        self,
        rank: int,
        eager_limit: int,
        policy: Policy,
        offers: int,
        allocate: Callable[[int], memoryview],
        region_of: Callable[[memoryview], Region],
        matcher: Matcher | None = None,
        heap_of: Callable[[int, memoryview], HeapRef | None] | None = None,
        max_object_bytes: int | None = None,
    ) -> None:
        """``heap_of(dest, buffer)``: where a send buffer lies in this process's shared heap
        (None: not in it), to offer XMAP to ``dest``; None when this rank does not let peers
        map its heap. ``max_object_bytes``: larger object messages are refused before
        anything is allocated for them (no process on this machine can have sent one)."""
        self.rank = rank
        self.heap_of = heap_of
        self.max_object_bytes = max_object_bytes
        self.allocate = allocate
        self.region_of = region_of
        self.eager_limit = eager_limit
        self.policy = policy
        self.offers = offers
        # (given: the communicator's, which its fast paths hold from before the engine exists)
        self.matcher = matcher if matcher is not None else Matcher()
        self._ids = itertools.count(1)
        self.sends: dict[int, SendOp] = {}
        self.recvs: dict[int, RecvOp] = {}
        # bytes copied to keep an eager payload that arrived before its receive (stats)
        self.held_bytes = 0

    # -- user events

    def send(
        self,
        dest: int,
        tag: int,
        segments: list[memoryview],
        is_object: bool = False,
        expose: bool = True,
        eager: bool = True,
        sync: bool = False,
        pull_first: bool = False,
    ) -> tuple[SendOp, list[Action]]:
        """``expose``: offer the receiver to pull from ``segments`` (RGET) by their regions;
        ``eager=False``: a rendezvous even for a message within the eager limit;
        ``sync``: complete only once a receive has matched the message (MPI_Ssend): an
        eager one waits for the receiver's FIN, a rendezvous does anyway;
        ``pull_first``: a rendezvous exposed is offered PULL_FIRST."""
        nbytes = sum(s.nbytes for s in segments)
        op = SendOp(dest, tag, segments, nbytes, is_object)
        flag = OBJECT if is_object else 0
        if eager and nbytes <= self.eager_limit and len(segments) == 1:
            payload = segments[0].tobytes()
            if sync:
                op.msgid = next(self._ids)
                op.awaits_fin = True
                self.sends[op.msgid] = op
                return op, [Transmit(dest, EAGER | SYNC | flag, tag, op.msgid, payload)]
            op.done = True
            return op, [Transmit(dest, EAGER | flag, tag, 0, payload), Complete(op)]
        op.msgid = next(self._ids)
        self.sends[op.msgid] = op
        regions = [self.region_of(s) for s in segments] if expose else None
        offers = self.offers if expose else self.offers & ~PULL
        if pull_first and offers & PULL:
            offers |= PULL_FIRST
        heap: list[HeapRef] | None = None
        if expose and self.heap_of is not None and offers & PULL:
            refs = [self.heap_of(dest, s) for s in segments]
            if refs and None not in refs:
                heap = refs  # type: ignore[assignment]  # (no None among them)
                offers |= XMAP
        rts = encode_rts(op.msgid, offers, [s.nbytes for s in segments], regions, heap)
        op.awaits_cts = op.awaits_fin = True
        return op, [Transmit(dest, RTS | flag, tag, nbytes, rts)]

    def direct_send(self, dest: int, tag: int, segment: memoryview) -> SendOp:
        """A send of ``segment`` whose RTS (of one buffer, every transfer mode offered, and
        its place in the heap if it lies there: the direct rendezvous) the I/O layer writes
        itself, registered before that RTS goes out: a CTS or FIN for it is then the
        engine's to take whenever the I/O layer stops waiting, however it stops (an
        interrupt included)."""
        op = SendOp(dest, tag, [segment], segment.nbytes, False, next(self._ids))
        op.awaits_cts = op.awaits_fin = True
        self.sends[op.msgid] = op
        return op

    def direct_done(self, op: SendOp) -> None:
        """The I/O layer took ``op``'s FIN itself: the send is complete."""
        del self.sends[op.msgid]
        op.awaits_cts = op.awaits_fin = False
        op.done = True

    def recv(self, source: int, tag: int, buffer: memoryview | None, view: bool = False
             ) -> tuple[RecvOp, list[Action]]:
        """``view`` (with no buffer): hand the message out in place if it is in the
        sender's heap and we may map it (MapView), else in a new buffer."""
        op = RecvOp(source, tag, buffer, view=view)
        arrival = self.matcher.take_unexpected(source, tag)
        if arrival is None:
            self.matcher.posted.append(op)
            return op, []
        return op, self._receive_matched(op, arrival)

    def probe(self, source: int, tag: int) -> Arrival | None:
        """The earliest arrived message matching (source, tag), left for a receive (``MPI_Iprobe``)."""
        return self.matcher.find_unexpected(source, tag)

    def mprobe(self, source: int, tag: int) -> Arrival | None:
        """A matched probe (MPI_Mprobe): the message found is taken out of matching, so that
        no other receive can take it; ``mrecv`` receives it."""
        return self.matcher.take_unexpected(source, tag)

    def mrecv(self, arrival: Arrival, buffer: memoryview | None) -> tuple[RecvOp, list[Action]]:
        """Receive a message a matched probe took (``buffer`` None: an object receive)."""
        op = RecvOp(arrival.source, arrival.tag, buffer)
        return op, self._receive_matched(op, arrival)

    # -- packets from peers

    def packet(self, source: int, kind: int, tag: int, aux: int, payload: bytes | memoryview
               ) -> list[Action]:
        """Handle one control packet from ``source`` (one the ring or the loopback delivered): the actions
        it causes."""
        base = kind & KIND_MASK
        is_object = bool(kind & OBJECT)
        if kind & ~(KIND_MASK | KIND_FLAGS.get(base, 0)) or base not in KIND_FLAGS:
            raise ProtocolError(f"rank {source} broke the protocol: unknown packet kind "
                                f"{kind:#x}", peer=source)
        if base == EAGER:
            sync = aux if kind & SYNC else 0
            op = self.matcher.take_posted(source, tag)
            if op is None:
                if isinstance(payload, bytes):
                    held = payload  # already owned (a loopback packet): kept without a copy
                else:
                    held = bytes(payload)
                    self.held_bytes += len(held)
                self.matcher.unexpected.append(
                    Arrival(source, tag, is_object, len(held), held, None, sync))
                return []
            return self._receive_matched(
                op, Arrival(source, tag, is_object, len(payload), None, None, sync), payload)
        if base == RTS:
            rts = decode_rts(payload, source)
            if aux != sum(rts.sizes):
                raise ProtocolError(f"rank {source} broke the protocol: an RTS for {aux} bytes "
                                    f"lists buffers of {sum(rts.sizes)}", peer=source)
            limit = self.max_object_bytes
            if is_object and limit is not None and aux > limit:
                raise ProtocolError(f"rank {source} broke the protocol: an object message of {aux} "
                                    f"bytes, more than this machine's memory and swap ({limit}); "
                                    "no process here can have sent it", peer=source)
            arrival = Arrival(source, tag, is_object, aux, None, rts)
            op = self.matcher.take_posted(source, tag)
            if op is None:
                self.matcher.unexpected.append(arrival)
                return []
            return self._receive_matched(op, arrival)
        if base == CTS:
            return self._cts(source, decode_cts(payload, source))
        if base == UNMAP:
            return [Unmap(source, decode_unmap(payload, aux, source))]
        return self._fin(source, aux)

    def _receive_matched(self, op: RecvOp, arrival: Arrival,
                         inline: bytes | memoryview | None = None) -> list[Action]:
        """Start receiving ``arrival`` into ``op``, the receive it matched: deliver an eager
        payload (``inline``: still in the ring), consume a message too large for the buffer
        (or, for an object receive, for this machine's memory), or answer an RTS with the
        protocol the policy chooses (pull, CTS, stream)."""
        op.matched_source = arrival.source
        op.matched_tag = arrival.tag
        op.nbytes = arrival.nbytes
        op.is_object = arrival.is_object
        rts = arrival.rts
        truncated = op.buffer is not None and arrival.nbytes > op.buffer.nbytes
        if truncated:
            op.error = TruncationError(
                f"message of {arrival.nbytes} bytes from rank {arrival.source} (tag {arrival.tag}) "
                f"does not fit the {op.capacity}-byte receive buffer; it was consumed",
                source=arrival.source,
                tag=arrival.tag,
                nbytes=arrival.nbytes,
                capacity=op.capacity,
            )
        limit = self.max_object_bytes
        if op.buffer is None and limit is not None and arrival.nbytes > limit:
            # (an object message this large was refused in ``packet``: this is a buffer
            # message, which a sender may have in a file mapping or untouched memory)
            truncated = True  # consumed unallocated, as a truncated one is
            op.error = MessageTooLarge(
                f"a message of {arrival.nbytes} bytes from rank {arrival.source} (tag "
                f"{arrival.tag}) matched an object receive, which would allocate it, and it is "
                f"more than this machine's memory and swap ({limit} bytes); it was consumed. "
                "Receive it with Recv into a buffer of your own (a file mapping can be larger)")
        if rts is None:
            op.done = True
            released = [Transmit(arrival.source, FIN, 0, arrival.sync, b"")] if arrival.sync else []
            if truncated:
                return [*released, Complete(op)]
            payload = inline if inline is not None else arrival.eager
            assert payload is not None
            return [Deliver(op, payload), *released, Complete(op)]
        if truncated:
            # The sender is released as if received: the error belongs to the receiver.
            op.done = True
            return [Transmit(arrival.source, FIN, 0, rts.msgid, b""), Complete(op)]
        return self._answer_rts(op, arrival.source, rts, arrival.source in self.policy.mappable)

    def map_refused(self, op: RecvOp, source: int, rts: RtsInfo) -> list[Action]:
        """The receiver could not map ``source``'s heap for ``op`` (a MapView, or a Pull
        from the heap): its registration cache is full of mappings in use. Answer the RTS
        as if XMAP had not been offered: the message is copied (a view of it is a copy)."""
        return self._answer_rts(op, source, rts, mappable=False)

    def _answer_rts(self, op: RecvOp, source: int, rts: RtsInfo, mappable: bool) -> list[Action]:
        """Answer the RTS of a matched rendezvous message: map it (``mappable``, a view),
        pull it, or send the CTS the policy's protocol needs."""
        actions: list[Action] = []
        buffer = op.buffer
        nbytes = op.nbytes
        mapped = mappable and rts.heap is not None and rts.regions is not None
        if mapped and op.view:
            assert rts.heap is not None
            op.mechanism = "xmap"
            return [MapView(op, source, rts.heap, rts.sizes, rts.msgid, rts)]
        if buffer is None:
            op.segments = [self.allocate(n) for n in rts.sizes]
        elif isinstance(buffer, memoryview):
            op.segments = [buffer[:nbytes]]
        else:
            op.segments = buffer.segments(nbytes)
        if mapped:
            assert rts.regions is not None
            op.mechanism = "xmap"
            return [Pull(op, source, "xmap", rts.regions, op.segments, rts.msgid, rts.heap, rts)]
        mode, transport = self.policy.choose(source, nbytes, rts.offers,
                                             ring_full=nbytes <= self.eager_limit)
        op.mechanism = transport
        op.recvid = next(self._ids)
        if mode == PULL and rts.regions is not None:
            actions.append(Pull(op, source, transport, rts.regions, op.segments, rts.msgid))
            return actions
        if mode == SPLIT and rts.regions is not None:
            # CTS first, so the sender copies its half while we copy ours
            n, cut = nbytes, split_point(nbytes)
            op.copies_left = 2
            op.awaits_fin = True
            self.recvs[op.recvid] = op
            ours = slice_regions([self.region_of(s) for s in op.segments], cut, n)
            actions.append(Transmit(source, CTS, 0, rts.msgid,
                                    encode_cts(rts.msgid, op.recvid, SPLIT, transport, ours)))
            actions.append(Pull(op, source, transport, slice_regions(rts.regions, 0, cut),
                                slice_views(op.segments, 0, cut), rts.msgid))
            return actions
        if mode == PUSH:
            op.awaits_fin = True
            self.recvs[op.recvid] = op
            regions = [self.region_of(s) for s in op.segments]
            actions.append(Transmit(source, CTS, 0, rts.msgid,
                                    encode_cts(rts.msgid, op.recvid, PUSH, transport, regions)))
            return actions
        actions.append(StreamIn(op))
        actions.append(Transmit(source, CTS, 0, rts.msgid,
                                encode_cts(rts.msgid, op.recvid, PIPELINE, transport, [])))
        return actions

    def _cts(self, source: int, cts: CtsInfo) -> list[Action]:
        op = self.sends.get(cts.msgid)
        total = sum(region.nbytes for region in cts.regions)
        fault = ""
        if op is None or op.dest != source or not op.awaits_cts:
            fault = f"a CTS for message {cts.msgid}, which awaits none from it"
        elif cts.transport not in self.policy.order and cts.transport not in self.policy.staged \
                or cts.transport == "self":
            fault = f"a CTS naming transport {cts.transport!r}, not one of this rank's"
        elif total != (0 if cts.mode == PIPELINE else
                       op.nbytes - split_point(op.nbytes) if cts.mode == SPLIT else op.nbytes):
            fault = (f"a {PROTOCOL_NAMES[cts.mode]} CTS with regions of {total} bytes for a "
                     f"message of {op.nbytes}")
        if fault:
            raise ProtocolError(f"rank {source} broke the protocol: {fault}", peer=source)
        assert op is not None
        op.awaits_cts = False
        op.awaits_fin = cts.mode == SPLIT
        op.mechanism = cts.transport
        if cts.mode == PUSH:
            return [Push(op, cts.transport, cts.regions, op.segments, cts.recvid)]
        if cts.mode == SPLIT:
            op.copies_left = 2
            cut = op.nbytes - total
            return [Push(op, cts.transport, cts.regions, slice_views(op.segments, cut, op.nbytes),
                         cts.recvid)]
        del self.sends[op.msgid]  # streamed: no FIN will name it
        return [StreamOut(op)]

    def _fin(self, source: int, msgid: int) -> list[Action]:
        """The peer finished its copy: all of an RGET/RPUT message, or its half of a SPLIT."""
        send = self.sends.get(msgid)
        if send is not None and send.dest == source and send.awaits_fin:
            send.awaits_cts = send.awaits_fin = False
            return self._copy_done(self.sends, msgid)
        recv = self.recvs.get(msgid)
        if recv is not None and recv.matched_source == source and recv.awaits_fin:
            recv.awaits_fin = False
            return self._copy_done(self.recvs, msgid)
        raise ProtocolError(f"rank {source} broke the protocol: a FIN for message {msgid}, "
                            "which awaits none from it", peer=source)

    def _copy_done(self, table: dict[int, SendOp] | dict[int, RecvOp], key: int) -> list[Action]:
        op = table[key]
        op.copies_left -= 1
        if op.copies_left:
            return []
        del table[key]
        op.done = True
        return [Complete(op)]

    # -- copies finished (reported by the I/O layer)

    def pulled(self, op: RecvOp, msgid: int) -> list[Action]:
        """The receiver's copy of ``op`` is done: FIN to the sender; complete unless its SPLIT half is
        still out."""
        fin = Transmit(op.matched_source, FIN, 0, msgid, b"")
        if op.recvid in self.recvs:  # SPLIT: done when the sender's half is in too
            return [fin, *self._copy_done(self.recvs, op.recvid)]
        op.done = True
        return [fin, Complete(op)]

    def view_mapped(self, op: RecvOp) -> list[Action]:
        """A MapView's view is handed out: the receive is complete, the sender is not."""
        op.done = True
        return [Complete(op)]

    def view_released(self, peer: int, msgid: int) -> list[Action]:
        """The view of a MapView from ``peer`` was released: it may reuse its buffer now."""
        return [Transmit(peer, FIN, 0, msgid, b"")]

    def pushed(self, op: SendOp, recvid: int) -> list[Action]:
        """The sender's copy of ``op`` is done: FIN to the receiver; complete unless its SPLIT half is
        still out."""
        return [Transmit(op.dest, FIN, 0, recvid, b""), *self._copy_done(self.sends, op.msgid)]

    def streamed_out(self, op: SendOp) -> list[Action]:
        """The last PIPELINE fragment of ``op`` is filled: the send is complete."""
        op.done = True
        return [Complete(op)]

    def streamed_in(self, op: RecvOp) -> list[Action]:
        """The last PIPELINE fragment of ``op`` is drained: the receive is complete."""
        op.done = True
        return [Complete(op)]


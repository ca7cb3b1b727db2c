"""Per-pair control channels: single-producer/single-consumer rings in shared memory.

One memfd-backed segment holds everything a world of N ranks shares:

    header      per rank: pid, sleeping flag, connect phase; then which transports each
                rank reaches each peer with (the reach matrix)
    per ordered pair (i -> j), page aligned:
        control page    head (written by i), tail (by j), staging filled (by i), drained (by j),
                        each on its own cache line so the two sides never write the same line
        slots           ``slots`` packets of ``slot_size`` bytes: 4 header words + payload
        staging         ``stage_slots`` fragments of ``frag_size`` bytes for the PIPELINE protocol

A packet is four int64 words (kind, tag, nbytes, aux) and a payload. A packet larger
than one slot spans consecutive slots, every piece but the last flagged MORE.
Publishing is a plain store to ``head``: on x86-64 stores become visible in program
order, so the payload is visible before the head that announces it. The consumer
publishes ``tail`` only every half ring (and whenever it goes idle), which keeps
the hot path at one shared store per message on each side.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from ._linux import PAGE_SIZE
from .protocol import ANY_TAG, EAGER, KIND_MASK

HEADER_WORDS = 4
HEADER_BYTES = HEADER_WORDS * 8
MORE = 0x200  # packet continues in the next slot

# control page word offsets (64-byte cache lines apart, 128 to defeat adjacent-line prefetch)
HEAD = 0
TAIL = 16
FILLED = 32
DRAINED = 48

# header: a preamble, one 128-byte block per rank, then the reach matrix (size x size words)
PREAMBLE_WORDS = 16
RANK_BLOCK_WORDS = 16
PID = 0  # words within a rank block
SLEEPING = 1
PHASE = 2


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ChannelConfig:
    """Sizes of the shared segment. ``eager_limit`` is the largest inline payload.

    64 KiB: on the project machine an eager 64 KiB message costs ~5 us one way while
    the cheapest rendezvous (RTS, one kernel copy, FIN) costs ~40 us, most of it the
    per-call price of process_vm_readv / preadv from Python (see docs/transports.md).
    """

    eager_limit: int = 65536
    slots: int = 64
    frag_size: int = 1 << 20
    stage_slots: int = 4

    @property
    def slot_size(self) -> int:
        return _round_up(self.eager_limit + HEADER_BYTES, 64)

    @property
    def pair_bytes(self) -> int:
        ring = _round_up(self.slots * self.slot_size, PAGE_SIZE)
        staging = _round_up(self.stage_slots * self.frag_size, PAGE_SIZE)
        return PAGE_SIZE + ring + staging

    def header_bytes(self, size: int) -> int:
        words = PREAMBLE_WORDS + size * RANK_BLOCK_WORDS + size * size
        return _round_up(words * 8, PAGE_SIZE)

    def segment_bytes(self, size: int) -> int:
        return self.header_bytes(size) + size * (size - 1) * self.pair_bytes

    def encode(self) -> str:
        return f"{self.eager_limit},{self.slots},{self.frag_size},{self.stage_slots}"

    @classmethod
    def decode(cls, text: str) -> ChannelConfig:
        eager, slots, frag, stage = (int(x) for x in text.split(","))
        return cls(eager, slots, frag, stage)

    def validate(self) -> None:
        if self.eager_limit < 0 or self.slots < 2 or self.slots & (self.slots - 1):
            raise ValueError("slots must be a power of two >= 2 and eager_limit >= 0")
        if self.frag_size < PAGE_SIZE or self.stage_slots < 1:
            raise ValueError(f"frag_size must be >= {PAGE_SIZE} and stage_slots >= 1")


class Outbox:
    """Producer end of the ring from this rank to one peer."""

    __slots__ = ("ctl", "data", "words", "nslots", "mask", "slot_size", "slot_words",
                 "head", "tail_seen", "staging", "filled", "peer_sleeping", "eager_bytes",
                 "other_slots")

    def __init__(self, pair: memoryview, config: ChannelConfig, peer_sleeping: memoryview) -> None:
        self.peer_sleeping = peer_sleeping  # the receiver's "about to sleep" word
        # eager messages = slots used - other_slots: no per-message counter on the hot path
        self.eager_bytes = 0
        self.other_slots = 0
        self.ctl = pair[:PAGE_SIZE].cast("q")
        ring_bytes = config.slots * config.slot_size
        self.data = pair[PAGE_SIZE : PAGE_SIZE + ring_bytes]
        self.words = self.data.cast("q")
        staging_at = PAGE_SIZE + _round_up(ring_bytes, PAGE_SIZE)
        self.staging = pair[staging_at : staging_at + config.stage_slots * config.frag_size]
        self.nslots = config.slots
        self.mask = config.slots - 1
        self.slot_size = config.slot_size
        self.slot_words = config.slot_size // 8
        self.head = self.ctl[HEAD]
        self.tail_seen = self.ctl[TAIL]
        self.filled = self.ctl[FILLED]

    def free_slots(self) -> int:
        if self.head - self.tail_seen >= self.nslots:
            self.tail_seen = self.ctl[TAIL]
        return self.nslots - (self.head - self.tail_seen)

    def put_eager(self, tag: int, payload: memoryview, n: int) -> int:
        """The hot path: one EAGER packet of at most eager_limit bytes.

        Returns -1 (nothing written) when the ring is full, else the receiver's sleeping
        flag: non-zero means the caller must ring its doorbell.
        """
        h = self.head
        if h - self.tail_seen >= self.nslots:
            self.tail_seen = self.ctl[TAIL]
            if h - self.tail_seen >= self.nslots:
                return -1
        off = (h & self.mask) * self.slot_size
        if n:
            self.data[off + HEADER_BYTES : off + HEADER_BYTES + n] = payload
            self.eager_bytes += n
        w = off >> 3
        words = self.words
        words[w] = EAGER
        words[w + 1] = tag
        words[w + 2] = n
        self.head = h = h + 1
        self.ctl[HEAD] = h
        return self.peer_sleeping[0]

    def pieces(self, nbytes: int) -> int:
        return max(1, -(-nbytes // (self.slot_size - HEADER_BYTES)))

    def put(self, kind: int, tag: int, aux: int, payload: bytes | memoryview) -> bool:
        """Any packet, spanning slots if needed; False (nothing written) when it does not fit yet."""
        total = len(payload)
        room = self.slot_size - HEADER_BYTES
        count = self.pieces(total)
        if count > self.nslots:
            raise ValueError(f"control packet of {total} bytes exceeds the ring ({self.nslots} slots)")
        if self.free_slots() < count:
            return False
        h = self.head
        view = memoryview(payload)
        for i in range(count):
            piece = view[i * room : (i + 1) * room]
            off = ((h + i) & self.mask) * self.slot_size
            self.data[off + HEADER_BYTES : off + HEADER_BYTES + len(piece)] = piece
            w = off >> 3
            self.words[w] = kind | (MORE if i < count - 1 else 0)
            self.words[w + 1] = tag
            self.words[w + 2] = len(piece)
            self.words[w + 3] = aux
        self.head = h + count
        self.ctl[HEAD] = self.head
        if kind & KIND_MASK == EAGER:
            self.eager_bytes += total
        else:
            self.other_slots += count
        return True

    @property
    def eager_messages(self) -> int:
        return self.head - self.other_slots

    def publish_filled(self, count: int) -> None:
        self.filled = count
        self.ctl[FILLED] = count

    def drained(self) -> int:
        return self.ctl[DRAINED]


class Inbox:
    """Consumer end of the ring from one peer to this rank."""

    __slots__ = ("ctl", "data", "words", "nslots", "mask", "slot_size", "tail",
                 "tail_published", "staging", "drained_count", "half", "w", "last_tag",
                 "eager_bytes", "other_slots")

    def __init__(self, pair: memoryview, config: ChannelConfig) -> None:
        self.last_tag = 0
        self.eager_bytes = 0
        self.other_slots = 0
        self.ctl = pair[:PAGE_SIZE].cast("q")
        ring_bytes = config.slots * config.slot_size
        self.data = pair[PAGE_SIZE : PAGE_SIZE + ring_bytes]
        self.words = self.data.cast("q")
        staging_at = PAGE_SIZE + _round_up(ring_bytes, PAGE_SIZE)
        self.staging = pair[staging_at : staging_at + config.stage_slots * config.frag_size]
        self.nslots = config.slots
        self.half = config.slots // 2
        self.mask = config.slots - 1
        self.slot_size = config.slot_size
        self.tail = self.ctl[TAIL]
        self.tail_published = self.tail
        self.w = self.slot()
        self.drained_count = self.ctl[DRAINED]

    def ready(self) -> bool:
        return self.ctl[HEAD] != self.tail

    def slot(self) -> int:
        """Word index of the header of the oldest unconsumed packet."""
        return ((self.tail & self.mask) * self.slot_size) >> 3

    def payload(self, w: int, n: int) -> memoryview:
        off = (w << 3) + HEADER_BYTES
        return self.data[off : off + n]

    def release(self) -> None:
        self.tail = t = self.tail + 1
        self.w = ((t & self.mask) * self.slot_size) >> 3
        if t - self.tail_published >= self.half:
            self.tail_published = t
            self.ctl[TAIL] = t

    def take_eager(self, buf: memoryview, tag: int) -> int:
        """The hot path: if the oldest packet is an EAGER one matching ``tag`` that fits in
        ``buf``, copy it there, consume it and return its size (its tag in ``last_tag``).

        -2: the ring is empty; -1: the oldest packet needs the general path.
        """
        if self.ctl[HEAD] == self.tail:
            return -2
        w = self.w
        words = self.words
        t = words[w + 1]
        if words[w] != EAGER or (t != tag and (tag != ANY_TAG or t < 0)):
            return -1
        n = words[w + 2]
        if n > buf.nbytes:
            return -1
        if n:
            off = (w << 3) + HEADER_BYTES
            buf[:n] = self.data[off : off + n]
            self.eager_bytes += n
        self.last_tag = t
        self.tail = tail = self.tail + 1
        self.w = ((tail & self.mask) * self.slot_size) >> 3
        if tail - self.tail_published >= self.half:
            self.tail_published = tail
            self.ctl[TAIL] = tail
        return n

    @property
    def eager_messages(self) -> int:
        return self.tail - self.other_slots
    def publish_tail(self) -> bool:
        """Make consumed slots reusable now; True if anything new was published."""
        if self.tail_published == self.tail:
            return False
        self.tail_published = self.tail
        self.ctl[TAIL] = self.tail
        return True

    def take(self) -> tuple[int, int, int, int, memoryview | bytes]:
        """Consume one whole packet (joining MORE pieces): kind, tag, nbytes, aux, payload.

        The payload of a single-slot packet is a view valid until the next release.
        """
        w = self.slot()
        words = self.words
        kind, tag, n, aux = words[w], words[w + 1], words[w + 2], words[w + 3]
        if kind & KIND_MASK == EAGER:
            self.eager_bytes += n
        else:
            self.other_slots += 1
        if not kind & MORE:
            return kind, tag, n, aux, self.payload(w, n)
        parts = bytearray()
        while kind & MORE:
            parts += self.payload(w, n)
            self.release()
            while not self.ready():
                pass  # the producer writes every piece before publishing the head
            w = self.slot()
            kind, n = words[w], words[w + 2]
            self.other_slots += 1
        parts += self.payload(w, n)
        return kind, tag, len(parts), aux, bytes(parts)

    def filled(self) -> int:
        return self.ctl[FILLED]

    def publish_drained(self, count: int) -> None:
        self.drained_count = count
        self.ctl[DRAINED] = count


def pair_views(mm: mmap.mmap, size: int, rank: int, config: ChannelConfig,
               sleeping: list[memoryview]) -> tuple[list[Outbox | None], list[Inbox | None]]:
    """The outboxes (this rank -> peer) and inboxes (peer -> this rank), indexed by peer."""
    view = memoryview(mm)
    base = config.header_bytes(size)
    pb = config.pair_bytes

    def pair(src: int, dst: int) -> memoryview:
        index = src * (size - 1) + (dst if dst < src else dst - 1)
        return view[base + index * pb : base + (index + 1) * pb]

    outs: list[Outbox | None] = [None] * size
    ins: list[Inbox | None] = [None] * size
    for peer in range(size):
        if peer != rank:
            outs[peer] = Outbox(pair(rank, peer), config, sleeping[peer])
            ins[peer] = Inbox(pair(peer, rank), config)
    return outs, ins

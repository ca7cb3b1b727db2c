"""Per-pair control channels: single-producer/single-consumer rings in shared memory.

One memfd-backed segment holds everything a world of N ranks shares:

    header      per rank: pid, sleeping flag, connect phase, connect hint, doorbell fd
                number; then which transports each rank reaches each peer with (the
                reach matrix); then the head of every ring, one row per receiver (the
                heads matrix: a receiver reads all its rings' heads at once)
    per ordered pair (i -> j), page aligned:
        control page    tail (written by j), staging filled (by i), drained (by j), each
                        on its own cache line so the two sides never write the same line
        ring            ``ring_bytes`` of packets, each taking only its own size
        staging         ``stage_slots`` fragments of ``frag_size`` bytes for the PIPELINE protocol

A packet is four int64 words (kind, tag, nbytes, aux) and its payload, rounded up to
64 bytes, laid end to end; a PAD packet sends the reader back to the start of the ring.
``head`` and ``tail`` are running byte counts. Variable sizes keep small messages
within a few cache lines and let an eager message of up to ``eager_limit`` bytes take
one contiguous stretch.

The writer uses the window (the first half of the ring and a page: ``window_bytes``)
while the reader keeps up: a packet that would cross the end of the window goes to the
start instead, behind a PAD, as soon as the reader has freed the space there. Only a
reader that falls behind lets packets spill past the window. The bytes a PAD skips
count as in flight until the reader passes it, so right after a jump the ring can look
full: a further packet waits in the sender's queue (progress.py) until the reader takes
the one at the start.
Why a window: the bytes a ping-pong cycles through decide the cost of a large eager
message here (docs/architecture.md, "The control channel", has the runs).

Publishing is a plain store to ``head``: on x86-64 stores become visible in program
order, so the payload is visible before the head that announces it. The consumer
publishes ``tail`` only every sixteenth of the ring (and whenever it goes idle), which
keeps the hot path at one shared store per message on each side and lets the writer
see the start of the ring free by the time it reaches the end of the window.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ._linux import PAGE_SIZE, buffer_address, populate, release_pages
from .errors import InvalidConfig, ProtocolError
from .wire import ANY_TAG, EAGER, KIND_MASK

HEADER_BYTES = 32  # four int64 words: kind, tag, nbytes, aux
PAD = 0x7F  # packet kind: skip to the start of the ring
ALIGN = 64  # a packet starts on a cache line, so a header never straddles two
# A packet of n payload bytes takes (PACKET_ROUND + n) & PACKET_MASK bytes of ring. The hot
# paths use these two constants, and one struct call for the three words an EAGER header
# needs, because on CPython every extra operation there is measurable in 8-byte latency.
PACKET_ROUND = HEADER_BYTES + ALIGN - 1
PACKET_MASK = -ALIGN
# kind, tag, nbytes; nbytes unsigned, so that a negative length a corrupt peer wrote
# reads as a huge one and fails take_eager's size test, at no cost to the hot path
EAGER_HEADER = struct.Struct("qqQ")

# What the hot paths' calls answer instead of a size or a flag: put_eager found the ring
# full; take_eager found it empty, or found a packet that is not for it (not EAGER, another
# tag, too large for the buffer) and so for the general path.
RING_FULL = -1
RING_EMPTY = -2
NOT_EAGER = -1
# How often a blocking receive's fast path polls the ring (a poll of an empty ring costs
# ~0.1-0.2 us here: well under a millisecond in all) before the general path, which
# spins, then sleeps.
FAST_SPINS = 4000

# control page word offsets (128 bytes apart, to defeat adjacent-line prefetch)
HEAD = 0
TAIL = 16
FILLED = 32
DRAINED = 48

# header: a preamble, one 128-byte block per rank, the reach matrix (size x size words),
# then the heads matrix (heads_word)
PREAMBLE_WORDS = 16
RANK_BLOCK_WORDS = 16
PID = 0  # words within a rank block
SLEEPING = 1
PHASE = 2
LAUNCHED = 3  # the pid of the process started to attach this rank, when its starter knows it
# set to 1 by any peer that has just connected to this rank (its reach word towards this rank
# is published), cleared by this rank as it looks: the hint to map that peer's channels
CONNECTS = 4
# the number of this rank's doorbell fd in its own process, for peers to take with
# pidfd_getfd (World.open_pair); -1 (never published) sends them to its fd server
DOORBELL = 5
# the CPUs this rank may run on, a bitmap of CPU_WORDS words (CPU c at bit c % 64 of word
# c // 64, folded modulo CPU_WORDS * 64 on larger machines): peers count the CPUs of the
# whole world, as a launcher that pins each rank to its own core leaves each mask one CPU
CPUS = 6
CPU_WORDS = 8
assert CPUS + CPU_WORDS <= RANK_BLOCK_WORDS
# in a reach word: the rank has probed the peer (a mask of 0 alone would read as "not yet")
REACH_PUBLISHED = 1 << 62


MIN_RING_BYTES = 256 << 10  # eager limit 64 KiB, like MPICH's and Open MPI's shared-memory paths
# A ring whose window is kept resident faults it in once its writer first passes this
# far: the pair carries traffic (a few hundred small packets do not get there).
RESIDENT_FROM = 64 << 10


def channel_budget(size: int) -> int:
    """Bytes of channels (rings and staging) a rank of a world of ``size`` >= 3 ranks maps at most."""
    return (8 + size) << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def packet_bytes(nbytes: int) -> int:
    return (PACKET_ROUND + nbytes) & PACKET_MASK


def window_bytes(ring_bytes: int) -> int:
    """Where a writer whose reader keeps up stays: the first half of the ring and a page
    (a sixteenth of a ring smaller than 64 KiB), so that two packets of the eager limit (a
    quarter of the ring, 64 bytes more each with their headers) fit one after the other
    with small ones between. At exactly half the second often jumped back to the start,
    where only the bytes before the jump are free until the reader passes it, and found
    the ring full (docs/architecture.md, "The control channel")."""
    return ring_bytes // 2 + min(PAGE_SIZE, ring_bytes // 16)


@dataclass(frozen=True)
class ChannelConfig:
    """Sizes of the shared segment.

    ``eager_limit`` is the largest message sent inline (2 MiB: below it two cache-warm
    copies through the ring beat a rendezvous's handshake here; docs/architecture.md
    has the runs). ``ring_bytes`` (a power of two, at least 4 x eager_limit) bounds what
    is in flight per direction; its window (``window_bytes``: half of it and a page),
    which a reader that keeps up never leaves, stays cache-warm. ``frag_size`` and
    ``stage_slots`` shape the staging area of the shm pipeline. These defaults are for
    two ranks; ``for_ranks`` sizes a world.
    """

    eager_limit: int = 2 << 20
    ring_bytes: int = 8 << 20
    frag_size: int = 1 << 20
    stage_slots: int = 4

    @classmethod
    def for_ranks(cls, size: int) -> ChannelConfig:
        """The default sizes for a world of ``size`` ranks.

        Each rank maps its 2(N-1) channels, so from three ranks on the ring shrinks with N
        (a power of two, 256 KiB to 8 MiB, staging half a ring) to keep them within
        ``channel_budget(N)``; two ranks keep the large ring their eager speed needs.
        docs/architecture.md, "Memory per rank", has the bound and the measurements.
        """
        if size <= 2:
            return cls()
        ring = 8 << 20
        channels = 2 * (size - 1)
        while ring > MIN_RING_BYTES and channels * (PAGE_SIZE + ring + ring // 2) > channel_budget(size):
            ring //= 2
        return cls(eager_limit=ring // 4, ring_bytes=ring, frag_size=ring // 8, stage_slots=4)

    @property
    def window(self) -> int:
        """Where a writer whose reader keeps up stays (``window_bytes``)."""
        return window_bytes(self.ring_bytes)

    @staticmethod
    def keeps_windows(size: int) -> bool:
        """Whether a world of ``size`` ranks keeps its rings' windows resident once they
        carry traffic: two ranks, whose 4 MiB windows cost ~4 ms of page faults on a
        first pass and again after every quiet spell that handed them back; from three
        ranks a window is at most 512 KiB and a rank writes N-1 of them, so they come on
        first touch and go back when quiet (docs/architecture.md, "Resident windows")."""
        return size == 2

    @property
    def pair_bytes(self) -> int:
        """Bytes of one channel (one direction of a pair): control page, ring, staging."""
        staging = _round_up(self.stage_slots * self.frag_size, PAGE_SIZE)
        return PAGE_SIZE + self.ring_bytes + staging

    def header_bytes(self, size: int) -> int:
        """Bytes of a world's header (preamble, rank blocks, reach matrix, heads matrix),
        whole pages."""
        return _round_up(heads_word(size, 0, size) * 8, PAGE_SIZE)

    def segment_bytes(self, size: int) -> int:
        """Bytes of the whole shared segment of a world of ``size`` ranks."""
        return self.header_bytes(size) + size * (size - 1) * self.pair_bytes

    def pair_offset(self, size: int, src: int, dst: int) -> int:
        """Where the channel ``src -> dst`` starts in the segment (a page boundary)."""
        index = src * (size - 1) + (dst if dst < src else dst - 1)
        return self.header_bytes(size) + index * self.pair_bytes

    def encode(self) -> str:
        """The sizes as text, for ``CMA_WORLD`` (``decode`` reads it back)."""
        return f"{self.eager_limit},{self.ring_bytes},{self.frag_size},{self.stage_slots}"

    @classmethod
    def decode(cls, text: str) -> ChannelConfig:
        """The config ``encode`` wrote."""
        eager, ring, frag, stage = (int(x) for x in text.split(","))
        return cls(eager, ring, frag, stage)

    def validate(self) -> None:
        """Raise ``InvalidConfig`` unless the sizes can work (ring a power of two, eager limit <= ring/4)."""
        ring = self.ring_bytes
        if ring < PAGE_SIZE or ring & (ring - 1):
            raise InvalidConfig(f"ring_bytes must be a power of two >= {PAGE_SIZE}")
        if not 0 <= self.eager_limit <= ring // 4:
            raise InvalidConfig("eager_limit must be between 0 and ring_bytes / 4")
        if self.frag_size < PAGE_SIZE or self.stage_slots < 1:
            raise InvalidConfig(f"frag_size must be >= {PAGE_SIZE} and stage_slots >= 1")

    @property
    def max_packet(self) -> int:
        """The largest control packet payload (half the ring, so one always fits eventually)."""
        return self.ring_bytes // 2 - HEADER_BYTES


def _channel_parts(pair: memoryview, config: ChannelConfig
                  ) -> tuple[memoryview, memoryview, memoryview, memoryview]:
    """The parts of one channel both its ends view: the control page as int64 words, the
    ring's bytes, the same bytes as int64 words, and the staging slots."""
    ring = config.ring_bytes
    data = pair[PAGE_SIZE : PAGE_SIZE + ring]
    staging_at = PAGE_SIZE + ring
    return (pair[:PAGE_SIZE].cast("q"), data, data.cast("q"),
            pair[staging_at : staging_at + config.stage_slots * config.frag_size])


class Outbox:
    """Producer end of the ring from this rank to one peer."""

    __slots__ = ("ctl", "data", "words", "size", "window", "mask", "head", "head_word",
                 "tail_seen", "staging", "filled", "peer_sleeping", "eager_bytes", "eager_count",
                 "pages", "ring_at", "kept", "stretching", "released", "quiet")

    def __init__(self, pair: memoryview, config: ChannelConfig, peer_sleeping: memoryview,
                 head_word: memoryview | None = None, resident: bool = False) -> None:
        """``resident``: fault the window in once the ring carries traffic, and never hand
        it back (``ChannelConfig.keeps_windows``)."""
        self.peer_sleeping = peer_sleeping  # the receiver's "about to sleep" word
        self.eager_bytes = 0
        self.eager_count = 0
        self.ctl, self.data, self.words, self.staging = _channel_parts(pair, config)
        # where the head is published: the world's heads matrix (heads_word), or alone
        # the control page's HEAD word
        self.head_word = self.ctl[HEAD : HEAD + 1] if head_word is None else head_word
        self.size = config.ring_bytes
        self.window = config.window
        self.mask = config.ring_bytes - 1
        self.head = self.head_word[0]
        self.tail_seen = self.ctl[TAIL]
        self.filled = self.ctl[FILLED]
        # the mapping whose pages release_free_pages hands back, and where the ring starts
        # in it (None: the channel is no shared mapping, as in some tests); the bytes at
        # the ring's start it keeps (a resident window, once faulted in); the ring's
        # (head, published tail) at the last release, and at the last look of
        # Progress.release_quiet_rings
        self.pages = pair.obj if isinstance(pair.obj, mmap.mmap) else None
        self.ring_at = 0
        if self.pages is not None:
            with memoryview(self.pages) as whole:
                self.ring_at = buffer_address(self.data) - buffer_address(whole)
        self.kept = 0
        # (a first stretch short of the window: the first packet past it takes the slow
        # path of put_eager, which faults the whole window in: _reserve)
        self.stretching = resident and self.pages is not None and RESIDENT_FROM < self.window
        if self.stretching:
            self.window = RESIDENT_FROM
        self.released = self.quiet = self.ends()

    def _fits(self, end: int) -> bool:
        """Whether the ring may hold bytes up to the running count ``end``."""
        if end - self.tail_seen > self.size:
            self.tail_seen = self.ctl[TAIL]
            return end - self.tail_seen <= self.size
        return True

    def _place(self, need: int) -> int:
        """The running count where a packet of ``need`` bytes would start now, or -1 if full.

        Past the window, back to the start of the ring once the reader has freed it; else
        on into the second half while the packet fits before the end.
        """
        h = self.head
        pos = h & self.mask
        if pos + need > self.window:
            lap = h + self.size - pos  # where the next lap starts
            if self._fits(lap + need):
                return lap
            if pos + need > self.size:
                return -1
        return h if self._fits(h + need) else -1

    def _reserve(self, need: int) -> int:
        """Byte offset where a packet of ``need`` bytes goes (after padding), or -1 if full."""
        if self.stretching and (self.head & self.mask) + need > self.window:
            self._make_window_resident()
        start = self._place(need)
        if start < 0:
            return -1
        if start != self.head:
            self.words[(self.head & self.mask) >> 3] = PAD
            self.head = start
        return start & self.mask

    def _make_window_resident(self) -> None:
        """The ring carries traffic: fault its whole window in, in one call, and keep it.
        A writer's first pass through fresh pages cost ~27 us per 32 KiB here against ~3
        once they are resident (docs/architecture.md, "Resident windows")."""
        self.stretching, self.window = False, window_bytes(self.size)
        resident = min(_round_up(self.window, PAGE_SIZE), self.size)  # (pages larger than 4 KiB)
        if populate(buffer_address(self.data), resident):
            self.kept = resident

    def fits(self, nbytes: int) -> bool:
        """Whether a packet of ``nbytes`` payload bytes would be published now."""
        return self._place(packet_bytes(nbytes)) >= 0

    def put_eager(self, tag: int, payload: memoryview, n: int, kind: int = EAGER) -> int:
        """The hot path: one EAGER packet of at most eager_limit bytes (``kind``: EAGER with
        its flags, OBJECT for a pickle stream).

        Returns RING_FULL (nothing published) when the ring is full or the tag does not fit
        a packet's word, else the receiver's sleeping flag: non-zero means the caller must
        ring its doorbell.
        """
        need = (PACKET_ROUND + n) & PACKET_MASK
        h = self.head
        pos = h & self.mask
        if pos + need > self.window or h + need - self.tail_seen > self.size:
            pos = self._reserve(need)  # goes back to the start, or finds the ring full
            if pos < 0:
                return RING_FULL
            h = self.head
        if n:
            self.data[pos + HEADER_BYTES : pos + HEADER_BYTES + n] = payload
            self.eager_bytes += n
        try:
            EAGER_HEADER.pack_into(self.data, pos, kind, tag, n)
        except struct.error:
            return RING_FULL  # a tag beyond int64, left unpublished for the general path to refuse
        self.eager_count += 1
        self.head = self.head_word[0] = h + need
        return self.peer_sleeping[0]

    def put(self, kind: int, tag: int, aux: int, payload: bytes | memoryview) -> bool:
        """Any packet up to ``max_packet`` bytes; False (nothing published) when it does not fit yet."""
        n = len(payload)
        if HEADER_BYTES + n > self.size // 2:
            raise ValueError(f"control packet of {n} bytes exceeds half the ring ({self.size} bytes)")
        need = packet_bytes(n)
        pos = self._reserve(need)
        if pos < 0:
            return False
        self.data[pos + HEADER_BYTES : pos + HEADER_BYTES + n] = payload
        w = pos >> 3
        self.words[w] = kind
        self.words[w + 1] = tag
        self.words[w + 2] = n
        self.words[w + 3] = aux
        if kind & KIND_MASK == EAGER:
            self.eager_bytes += n
            self.eager_count += 1
        self.head += need
        self.head_word[0] = self.head
        return True

    def ends(self) -> tuple[int, int]:
        """(head, the reader's published tail): while neither moves, the ring is quiet."""
        return self.head, self.ctl[TAIL]

    def release_free_pages(self) -> int:
        """Hand the kernel back the ring's whole pages that hold no packet, but for a
        resident window (``kept``); the system calls that took (0-2). The free part, from
        the head to the reader's published tail a lap on, is this writer's alone (the
        reader reads only below the head), so no one reads or writes those pages
        meanwhile; a later packet there faults in a zeroed page."""
        self.released = head, tail = self.ends()
        if self.pages is None or not head - self.size <= tail <= head:
            return 0  # (a tail outside that is a broken peer's: nothing is surely free)
        self.tail_seen = tail
        start = head & self.mask
        end = start + tail + self.size - head  # may run past the ring's end: then two pieces
        calls = 0
        for first, last in ((start, min(end, self.size)), (0, end - self.size)):
            first = max(first, self.kept)
            first = -(-(self.ring_at + first) // PAGE_SIZE) * PAGE_SIZE  # whole pages only
            last = (self.ring_at + last) // PAGE_SIZE * PAGE_SIZE
            if last > first:
                release_pages(self.pages, first, last - first)
                calls += 1
        return calls

    def publish_filled(self, count: int) -> None:
        """Tell the reader that ``count`` pipeline fragments in all have been filled."""
        self.filled = count
        self.ctl[FILLED] = count

    def drained(self) -> int:
        """How many pipeline fragments in all the reader has drained."""
        return self.ctl[DRAINED]


class Inbox:
    """Consumer end of the ring from one peer to this rank."""

    __slots__ = ("ctl", "data", "words", "size", "mask", "tail", "tail_published", "staging",
                 "drained_count", "publish_every", "last_tag", "eager_bytes", "eager_count",
                 "pending", "peer", "max_payload", "room_told", "head_word")

    def __init__(self, pair: memoryview, config: ChannelConfig, peer: int = -1,
                 head_word: memoryview | None = None) -> None:
        self.peer = peer  # the rank that writes this ring (named by ProtocolError)
        self.max_payload = config.max_packet
        self.last_tag = 0
        self.eager_bytes = 0
        self.eager_count = 0
        self.pending = 0  # size of the packet returned by take(), consumed by release()
        self.ctl, self.data, self.words, self.staging = _channel_parts(pair, config)
        self.head_word = self.ctl[HEAD : HEAD + 1] if head_word is None else head_word  # (Outbox's)
        self.size = config.ring_bytes
        self.publish_every = config.ring_bytes // 16
        self.mask = config.ring_bytes - 1
        self.tail = self.ctl[TAIL]
        # room_told: the published tail a sender asleep for room last heard of (await_head)
        self.tail_published = self.room_told = self.tail
        self.drained_count = self.ctl[DRAINED]

    def _position(self) -> int:
        """Offset of the oldest packet, skipping padding; -1 when the ring is empty."""
        t = self.tail
        if self.head_word[0] == t:
            return -1
        pos = t & self.mask
        if self.words[pos >> 3] == PAD:
            self.tail = t = t + self.size - pos
            if self.head_word[0] == t:
                return -1
            return 0
        return pos

    def ready(self) -> bool:
        """Whether a packet waits at the head of the ring."""
        return self._position() >= 0

    def _consume(self, need: int) -> None:
        self.tail = t = self.tail + need
        if t - self.tail_published >= self.publish_every:
            self.tail_published = t
            self.ctl[TAIL] = t

    def take_eager(self, buf: memoryview, tag: int, kind: int = EAGER) -> int:
        """The hot path: if the oldest packet is an EAGER one (of ``kind``: EAGER with its
        flags) matching ``tag`` that fits in ``buf``, copy it there, consume it and return
        its size (its tag in ``last_tag``).

        RING_EMPTY: the ring is empty; NOT_EAGER: the oldest packet needs the general path.
        """
        tail = self.tail
        if self.head_word[0] == tail:
            return RING_EMPTY
        pos = tail & self.mask
        found, t, n = EAGER_HEADER.unpack_from(self.data, pos)
        if found != kind:
            if found != PAD:
                return NOT_EAGER
            pos = self._position()
            if pos < 0:
                return RING_EMPTY
            tail = self.tail
            found, t, n = EAGER_HEADER.unpack_from(self.data, pos)
            if found != kind:
                return NOT_EAGER
        if t != tag and (tag != ANY_TAG or t < 0):
            return NOT_EAGER
        if n > buf.nbytes:
            return NOT_EAGER
        if n:
            try:
                buf[:n] = self.data[pos + HEADER_BYTES : pos + HEADER_BYTES + n]
            except ValueError:
                # A length running past the end of the ring (a corrupt peer): the slice
                # came out short and nothing was copied; take() names the fault.
                return NOT_EAGER
            self.eager_bytes += n
        self.eager_count += 1
        self.last_tag = t
        self.tail = tail = tail + ((PACKET_ROUND + n) & PACKET_MASK)
        if tail - self.tail_published >= self.publish_every:
            self.tail_published = tail
            self.ctl[TAIL] = tail
        return n

    def eager_size(self, tag: int, kind: int) -> int:
        """The payload size of the oldest packet if it is an EAGER one of ``kind`` matching
        ``tag`` (what ``take_eager`` would take), else RING_EMPTY or NOT_EAGER."""
        pos = self._position()
        if pos < 0:
            return RING_EMPTY
        found, t, n = EAGER_HEADER.unpack_from(self.data, pos)
        if found != kind or t != tag and (tag != ANY_TAG or t < 0) or n > self.size:
            return NOT_EAGER  # (a length beyond the ring: a corrupt peer, which take() names)
        return n

    def eager_at_head(self, tag: int) -> int:
        """If the oldest packet is an EAGER one (with any flags) matching ``tag``, its
        payload size (its tag in ``last_tag``; nothing is consumed), else RING_EMPTY or
        NOT_EAGER. (An RTS is not reported: a probe must match it into the engine, for the
        Irecv after the probe to start its copy at once; test_overlap.py.)"""
        pos = self._position()
        if pos < 0:
            return RING_EMPTY
        w = pos >> 3
        words = self.words
        t = words[w + 1]
        if words[w] & KIND_MASK != EAGER or t != tag and (tag != ANY_TAG or t < 0):
            return NOT_EAGER
        self.last_tag = t
        return words[w + 2]

    def head_of(self, kind: int, nbytes: int) -> int:
        """Where the oldest packet starts, in ``words``, if it is of ``kind`` with a payload of
        ``nbytes`` bytes lying in the ring: its four header words (kind, tag, nbytes, aux),
        then its payload. -1 otherwise. ``consume(nbytes)`` takes it out of the ring."""
        pos = self._position()
        if pos < 0:
            return -1
        w = pos >> 3
        if self.words[w] != kind or self.words[w + 2] != nbytes \
                or pos + HEADER_BYTES + nbytes > self.size \
                or self.head_word[0] - self.tail < packet_bytes(nbytes):
            return -1
        return w

    def consume(self, nbytes: int) -> None:
        """Take the oldest packet, of ``nbytes`` bytes of payload, out of the ring."""
        self._consume(packet_bytes(nbytes))

    def take_if(self, kind: int, aux: int) -> int:
        """If the oldest packet is an empty one of ``kind`` holding ``aux`` (the FIN a
        direct rendezvous waits for), consume it: 0. RING_EMPTY: the ring is empty;
        NOT_EAGER: another packet is oldest."""
        pos = self._position()
        if pos < 0:
            return RING_EMPTY
        w = pos >> 3
        words = self.words
        if words[w] != kind or words[w + 3] != aux or words[w + 2]:
            return NOT_EAGER
        self._consume(PACKET_ROUND & PACKET_MASK)
        return 0

    def head_tag(self) -> int:
        """The tag of the oldest packet (the ring must be ready), left in the ring."""
        return self.words[(self._position() >> 3) + 1]

    def take(self) -> tuple[int, int, int, int, memoryview]:
        """The oldest packet (the ring must be ready): kind, tag, nbytes, aux, payload.

        The payload is a view into the ring, valid until ``release()``.
        """
        pos = self._position()
        w = pos >> 3
        words = self.words
        kind, tag, n, aux = words[w], words[w + 1], words[w + 2], words[w + 3]
        in_flight = self.head_word[0] - self.tail
        if not 0 <= n <= min(self.max_payload, self.size - pos - HEADER_BYTES) \
                or not packet_bytes(n) <= in_flight <= self.size or kind == PAD:
            raise ProtocolError(self._framing_fault(pos, kind, n, in_flight), peer=self.peer)
        if kind & KIND_MASK == EAGER:
            self.eager_bytes += n
            self.eager_count += 1
        self.pending = packet_bytes(n)
        return kind, tag, n, aux, self.data[pos + HEADER_BYTES : pos + HEADER_BYTES + n]

    def _framing_fault(self, pos: int, kind: int, n: int, in_flight: int) -> str:
        if kind == PAD:
            what = "a skip-to-start marker at the start of the ring"
        elif not 0 <= n <= self.max_payload:
            what = f"a length of {n} bytes (a packet holds 0..{self.max_payload})"
        elif n > self.size - pos - HEADER_BYTES:
            what = f"{n} bytes at offset {pos}, past the end of the {self.size}-byte ring"
        else:
            what = (f"{in_flight} bytes in flight, not between this packet's "
                    f"{packet_bytes(n)} and the ring's {self.size}")
        return (f"rank {self.peer} broke the protocol: the packet at the head of its ring "
                f"to this rank has {what}")

    def release(self) -> None:
        """Consume the packet ``take`` returned (its payload view is invalid from now on)."""
        self._consume(self.pending)

    def publish_tail(self) -> bool:
        """Make consumed space reusable now; True if anything new was published."""
        if self.tail_published == self.tail:
            return False
        self.tail_published = self.tail
        self.ctl[TAIL] = self.tail
        return True

    def filled(self) -> int:
        """How many pipeline fragments in all the writer has filled."""
        return self.ctl[FILLED]

    def publish_drained(self, count: int) -> None:
        """Tell the writer that ``count`` pipeline fragments in all have been drained."""
        self.drained_count = count
        self.ctl[DRAINED] = count


def heads_stride(size: int) -> int:
    """Words per row of the heads matrix: ``size``, in whole cache lines, so that no two
    receivers' rows share a line."""
    return _round_up(size, ALIGN // 8)


def heads_word(size: int, src: int, dst: int) -> int:
    """Header word of the head of the ring ``src -> dst``: the heads matrix follows the
    reach matrix, one row per receiver, so that a receiver sees every ring's head in one
    read of its row (``Progress._poll``: a pass with nothing new costs one comparison,
    not a look at each of N-1 rings)."""
    base = _round_up(PREAMBLE_WORDS + size * RANK_BLOCK_WORDS + size * size, ALIGN // 8)
    return base + dst * heads_stride(size) + src


def pair_boxes(pair: Callable[[int, int], memoryview], head: Callable[[int, int], memoryview],
               rank: int, peer: int, config: ChannelConfig, peer_sleeping: memoryview,
               resident: bool = False) -> tuple[Outbox, Inbox]:
    """The outbox (this rank -> peer) and inbox (peer -> this rank) of one connected pair.

    ``pair(src, dst)`` gives the bytes of the channel ``src -> dst`` (``pair_bytes`` long),
    ``head(src, dst)`` the word where its head is published; ``resident``: the outbox
    keeps its window resident (``ChannelConfig.keeps_windows``).
    """
    return (Outbox(pair(rank, peer), config, peer_sleeping, head(rank, peer), resident),
            Inbox(pair(peer, rank), config, peer, head(peer, rank)))

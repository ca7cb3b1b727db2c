"""The direct rendezvous: a blocking ``Send`` of ``DIRECT_FROM`` bytes or more and the
blocking ``Recv`` that takes it, without the engine.

The sender registers its send with its engine (``Engine.direct_send``), writes an RTS
offering its buffer by region (every transfer mode offered, as the engine's RTS)
straight into the ring and spins for the receiver's FIN. A receiver whose ``Recv`` finds
that RTS at the head of the ring, matching and fitting, pulls it with one copy
(``process_vm_readv``) and answers FIN, also without the engine. Anything else takes the
general path with nothing lost: the receiver leaves the RTS in the ring for its engine
(which may answer it with a CTS), and the sender, seeing another packet, tired of
spinning or interrupted, leaves the rest to its engine, which knows the send already.
The packets are the engine's own, so either side may be on either path.

A send buffer in the shared heap, where xmap is on, is offered with its place in the heap
too (an XMAP RTS): a receiver that may map the sender's heap copies it out of its mapping,
and its ``recv_view`` hands the mapping out as a view, both without the engine; one that
may not pulls it by its region.

Why: the engine's RGET costs ~130 us of Python per message here, against a 10-120 us
copy from 64 KiB to 1 MiB, so the ring's two copies were faster up to the 2 MiB eager
limit (docs/architecture.md, "Direct rendezvous", has the runs).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import _linux, heap
from .channel import NOT_EAGER, RING_EMPTY, Inbox, Outbox
from .connect import NEVER
from .errors import CmaError
from .protocol import (
    ONE_HEAP_RTS,
    ONE_HEAP_RTS_WORDS,
    ONE_REGION_RTS,
    PULL,
    PULL_FIRST,
    XMAP,
    SendOp,
    decode_one_heap_rts,
    decode_one_region_rts,
    encode_one_heap_rts,
    encode_one_region_rts,
)
from .transports import REGISTRY
from .transports.base import Region
from .transports.xmap import View
from .wire import ANY_TAG, FIN, RTS, HeapRef

if TYPE_CHECKING:
    from .progress import Progress

ENV_DIRECT_FROM = "CMA_DIRECT_FROM"


def direct_from(setting: str) -> int:
    """``CMA_DIRECT_FROM``: a size in bytes, "off", or "" for the default (256 KiB)."""
    if setting == "":
        return 256 << 10
    if setting == "off":
        return NEVER
    try:
        value = int(setting)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_DIRECT_FROM}={setting!r}: give a size in bytes or 'off'")
    return max(value, 1)  # (an empty message has no region to offer)


# The smallest message a blocking Send offers directly. Below it the eager ring's two
# copies took less time than one copy plus the handshake on 2026-11-28's host; on a host
# whose ring copies stay in cache (2026-11-24's: 1 MiB in 60 us, MPICH's one copy 96)
# the ring may win further up, hence the setting (docs/architecture.md, "Direct
# rendezvous").
DIRECT_FROM = direct_from(os.environ.get(ENV_DIRECT_FROM, ""))


def one_copy_pull(name: str) -> bool:
    """Whether transport ``name`` pulls a peer's bytes with one copy in all (cma's
    process_vm_readv), the only pull the direct path uses."""
    cls = REGISTRY.classes[name]
    return "pull" in cls.styles and cls.copies.total == 1


class DirectRendezvous:
    """Both halves of the direct rendezvous for one attached rank (its ``Progress``)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.rank = progress.rank
        self.world = progress.world
        self.inboxes = progress.inboxes
        self.links = progress.links
        self.transports = progress.transports
        self.policy = progress.connection.policy
        self.eager_limit = progress.config.eager_limit
        self.offers = progress.engine.offers
        self.ring = progress.ring
        # (without spins the sender's engine waits, yielding the CPU)
        self.spins = progress.fast_spins
        names = progress.connection.names
        # the reach bits (World.reach) of the transports that pull with one copy: a pull of
        # two (vmfd's bounce page) loses to the ring's two copies plus the handshake
        # (1.2-1.9x the time from 256 KiB to 2 MiB: docs/architecture.md, "Direct rendezvous")
        self.pull_bits = sum(1 << i for i, name in enumerate(names) if one_copy_pull(name))
        self.pullers: dict[int, bool] = {}  # per peer: whether it can pull from this rank
        self.mappers: dict[int, bool] = {}  # per peer: whether it maps this rank's heap
        self.pull_via: dict[int, str] = {}  # per peer: _pull_via's answer
        self.fast_outboxes = progress.fast_outboxes
        self.owner = progress.owner
        self.joiner = progress.joiner  # (a peer in it has sent part of a split control packet)
        # xmap: a send buffer in the heap is offered by its HeapRef too (heap_of: where it
        # lies, None off the heap), and a receiver that may map its peer's heap copies from
        # its mapping or hands it out as a view (docs/guide.md section 5)
        self.xmap = progress.xmap
        self.heap_of = progress.engine.heap_of
        self.mappable = self.policy.mappable
        # xmap's reach bit (after the transports' bits; 0 with xmap off): a peer that has
        # it towards this rank maps its heap, and needs no pull for a buffer there
        self.map_bit = 1 << len(names) if self.xmap is not None else 0

    def can_pull(self, peer: int) -> bool:
        """Whether ``peer`` has published that a transport of its reaches this rank's memory
        to read it (until it has, it is asked again)."""
        known = self.pullers.get(peer)
        return self._reaches(peer, self.pull_bits, self.pullers) if known is None else known

    def can_map(self, peer: int, mv: memoryview) -> bool:
        """Whether ``peer`` maps this rank's heap and ``mv`` lies in it: a peer that cannot
        pull takes such a buffer out of its mapping (``can_pull``'s alternative)."""
        known = self.mappers.get(peer)
        if known is None:
            known = self._reaches(peer, self.map_bit, self.mappers)
        return known and heap.locate(mv) is not None

    def _reaches(self, peer: int, bits: int, known: dict[int, bool]) -> bool:
        """Whether ``peer``'s published reach towards this rank has one of ``bits``,
        remembered in ``known`` once it has published (False until then)."""
        world = self.world
        if not world.reach_published(peer, self.rank):
            return False
        reaches = known[peer] = bool(world.reach(peer, self.rank) & bits)
        return reaches

    def send(self, outbox: Outbox, mv: memoryview, n: int, dest: int, tag: int) -> SendOp | None:
        """Offer ``mv`` (``n`` > 0 bytes, C-contiguous) to ``dest`` and spin until it has
        copied it: None. Otherwise the send, the engine's, for the caller to wait on."""
        op, in_ring = self.offer(outbox, mv, n, dest, tag)
        return None if in_ring and self.fin_came(op, dest) else op

    def offer(self, outbox: Outbox | None, mv: memoryview, n: int, dest: int, tag: int,
              pull_first: bool = False) -> tuple[SendOp, bool]:
        """Offer ``mv`` to ``dest``: the send, the engine's, and whether its RTS went into
        the ring (else it is queued behind a full ring, and the engine sends it);
        ``pull_first``: offered PULL_FIRST (protocol.py)."""
        progress = self.progress
        ref = None
        xmap, heap_of = self.xmap, self.heap_of
        if xmap is not None and heap_of is not None:  # (both or neither: xmap on)
            if xmap.given_back:  # (a rank on fast paths only runs no pass)
                progress.announce_given_back()
                outbox = self.fast_outboxes[dest]  # (None if an UNMAP waits for room: after it)
            ref = heap_of(dest, mv)
        op = progress.engine.direct_send(dest, tag, mv)
        offers = self.offers | PULL_FIRST if pull_first else self.offers
        if ref is None:
            rts = encode_one_region_rts(op.msgid, offers, _linux.local_address(mv), n)
        else:
            rts = encode_one_heap_rts(op.msgid, offers, _linux.local_address(mv), n, ref)
        if outbox is None or not outbox.put(RTS, tag, n, rts):
            progress.transmit(dest, RTS, tag, n, rts)
            return op, False
        if outbox.peer_sleeping[0]:
            self.ring(dest)
        return op, True

    def fin_came(self, op: SendOp, dest: int) -> bool:
        """Spin for ``dest``'s FIN of ``op``: whether it came (the send is done); if not,
        the engine takes it later."""
        if op.done:
            return True  # (the engine took it, with the packets before it)
        inbox = self.inboxes[dest]
        msgid = op.msgid
        spins = self.spins
        while True:  # (one look at least: with no spins, ranks outnumber CPUs)
            got = inbox.take_if(FIN, msgid)
            if got == 0:
                self.progress.engine.direct_done(op)
                return True
            if got != RING_EMPTY or not spins:
                return False  # (another packet first: the engine takes it, and then the FIN)
            spins -= 1

    def recv(self, inbox: Inbox, mv: memoryview, tag: int) -> int:
        """If the packet at the head of ``inbox`` is an RTS for this receive (``tag``) that
        fits ``mv`` and that the policy pulls: copy it into ``mv``, FIN the sender and
        return its size (its tag in ``inbox.last_tag``). NOT_EAGER, the packet left in
        the ring, when the general path must take it; it also raises what it meets."""
        at, size = self._rts_at(inbox)
        if at < 0:
            # (a Sendrecv with one peer both ways: the FIN of its own offer may come first)
            if not self.progress.took_offered_fin(inbox):
                return NOT_EAGER
            at, size = self._rts_at(inbox)
            if at < 0:
                if not inbox.ready():
                    return RING_EMPTY
                at, size = self._rts_at(inbox)  # (one may have come between the two looks)
                if at < 0:
                    return NOT_EAGER
        words = inbox.words
        t = words[at + 1]
        nbytes = words[at + 3]
        if t != tag and (tag != ANY_TAG or t < 0) or nbytes > mv.nbytes:
            return NOT_EAGER
        peer = inbox.peer
        if size == ONE_HEAP_RTS.size:
            heap_offer = decode_one_heap_rts(words[at + 4 : at + 4 + ONE_HEAP_RTS_WORDS], nbytes)
            if heap_offer is None:
                return NOT_EAGER
            msgid, offers, region, ref = heap_offer
            if peer in self.mappable:  # (as the engine answers it: from our mapping)
                return self._read_heap(inbox, mv, region, ref, msgid, t)
            offers &= ~XMAP
        else:
            offer = decode_one_region_rts(words[at + 4 : at + 9], nbytes)
            if offer is None:
                return NOT_EAGER
            msgid, offers, region = offer
        if nbytes <= self.eager_limit:
            name = self.pull_via.get(peer)
            if name is None:
                name = self.pull_via[peer] = self._pull_via(peer, offers)
        else:
            mode, name = self.policy.choose(peer, nbytes, offers)
            if mode != PULL:
                name = ""
        if not name:
            return NOT_EAGER
        transport = self.transports[name]
        link = self.links[peer]
        assert link is not None
        local = mv if nbytes == mv.nbytes else mv[:nbytes]
        progress = self.progress
        try:
            if transport.by_pid:  # (Progress._checked's two checks, written out: no wrapper frame)
                progress.confirm_pid(peer)
                transport.read(link, (region,), (local,))
                progress.confirm_pid(peer)
            else:
                transport.read(link, (region,), (local,))
        except CmaError:
            # (left in the ring: the general path copies again and raises what it meets
            # there, as the caller's hooks translate it, cma.mpi's into mpi4py's)
            return NOT_EAGER
        except BaseException as exc:
            progress.break_down(f"{type(exc).__name__} interrupted rank {self.rank} while it "
                                f"copied a message from rank {peer}; that message is half "
                                "received and its sender waits")
            raise
        self._received(inbox, size, msgid)
        stats = transport.stats
        stats.messages += 1
        stats.bytes += nbytes
        inbox.last_tag = t
        return nbytes

    def _rts_at(self, inbox: Inbox) -> tuple[int, int]:
        """Where the RTS at the head of ``inbox`` starts (as ``head_of``) and its payload's
        size, if it is one the direct path reads (of one region, or of one heap buffer,
        which a rank that cannot map it pulls by its region); (-1, 0) otherwise."""
        if inbox.peer in self.joiner:
            return -1, 0  # (the head is the next piece of a split packet, not a packet)
        at = inbox.head_of(RTS, ONE_REGION_RTS.size)
        if at >= 0:
            return at, ONE_REGION_RTS.size
        at = inbox.head_of(RTS, ONE_HEAP_RTS.size)
        if at >= 0:
            return at, ONE_HEAP_RTS.size
        return -1, 0

    def _heap_rts_at(self, inbox: Inbox) -> int:
        """``_rts_at`` for the RTS of a heap buffer alone (what a view takes)."""
        return -1 if inbox.peer in self.joiner else inbox.head_of(RTS, ONE_HEAP_RTS.size)

    def _received(self, inbox: Inbox, size: int, msgid: int) -> None:
        """Take the RTS (its payload ``size`` bytes) out of ``inbox`` and FIN its sender,
        whose send of ``msgid`` is then complete (for a view: once the view is released)."""
        peer = inbox.peer
        try:
            inbox.consume(size)
            outbox = self.fast_outboxes[peer]
            if outbox is None or not outbox.put(FIN, 0, msgid, b""):
                self.progress.transmit(peer, FIN, 0, msgid, b"")  # (queued behind others)
                self.owner.packets_queued()  # (it goes out in a later call: cma.mpi's hook)
            elif outbox.peer_sleeping[0]:
                self.ring(peer)
        except BaseException as exc:
            self.progress.break_down(f"{type(exc).__name__} interrupted rank {self.rank} while it "
                                     f"told rank {peer} that its message was received")
            raise

    def _read_heap(self, inbox: Inbox, mv: memoryview, region: Region, ref: HeapRef,
                   msgid: int, tag: int) -> int:
        """``recv``'s copy of a heap buffer out of this rank's mapping of it (xmap)."""
        xmap = self.xmap
        assert xmap is not None
        nbytes = region.nbytes
        link = self.links[inbox.peer]
        assert link is not None
        try:
            xmap.read_heap(link, (region,), (ref,), (mv if nbytes == mv.nbytes else mv[:nbytes],))
        except CmaError:  # (RegistrationCacheFull too)
            return NOT_EAGER  # (the general path copies again, or copies some other way)
        except BaseException as exc:
            self.progress.break_down(f"{type(exc).__name__} interrupted rank {self.rank} while it "
                                     f"copied a message from rank {inbox.peer}; that message is "
                                     "half received and its sender waits")
            raise
        self._received(inbox, ONE_HEAP_RTS.size, msgid)
        xmap.stats.messages += 1
        xmap.stats.bytes += nbytes
        inbox.last_tag = tag
        return nbytes

    def view(self, inbox: Inbox, tag: int, capacity: int | None = None) -> View | int:
        """If the packet at the head of ``inbox`` is the RTS of a heap buffer for this
        receive (``tag``; no more than ``capacity`` bytes, if given) and this rank may map
        its sender's heap: a view of it (its tag in ``inbox.last_tag``), the sender's FIN
        sent at its release. RING_EMPTY or NOT_EAGER (the packet left in the ring) as
        ``recv``."""
        at = self._heap_rts_at(inbox)
        if at < 0:
            if not inbox.ready():
                return RING_EMPTY
            at = self._heap_rts_at(inbox)  # (one may have come between the two looks)
            if at < 0:
                return NOT_EAGER
        xmap = self.xmap
        assert xmap is not None
        words = inbox.words
        t = words[at + 1]
        nbytes = words[at + 3]
        peer = inbox.peer
        if t != tag and (tag != ANY_TAG or t < 0) or peer not in self.mappable \
                or capacity is not None and nbytes > capacity:
            return NOT_EAGER
        offer = decode_one_heap_rts(words[at + 4 : at + 4 + ONE_HEAP_RTS_WORDS], nbytes)
        if offer is None:
            return NOT_EAGER
        msgid, _, _, ref = offer
        link = self.links[peer]
        assert link is not None
        try:
            held, lease = xmap.map_view(link, ref, nbytes)
        except CmaError:  # (RegistrationCacheFull too)
            return NOT_EAGER  # (the general path raises it, or hands out a copy)
        progress = self.progress
        try:
            view = xmap.hand_out([held], peer, msgid, [lease], progress.flush_released_views)[0]
            inbox.consume(ONE_HEAP_RTS.size)
        except BaseException as exc:
            progress.break_down(f"{type(exc).__name__} interrupted rank {self.rank} while it "
                                f"mapped a message from rank {peer}; its sender waits")
            raise
        xmap.stats.messages += 1
        xmap.stats.bytes += nbytes
        inbox.last_tag = t
        return view

    def _pull_via(self, peer: int, offers: int) -> str:
        """The transport that pulls a rendezvous within the eager limit from ``peer`` (the
        policy's choice, the same for every such message), or "" if none pulls."""
        mode, name = self.policy.choose(peer, self.eager_limit, offers, ring_full=True)
        return name if mode == PULL else ""

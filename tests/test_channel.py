"""The packet ring of cma/channel.py, one process: an Outbox and an Inbox over one buffer.

These pin where packets land (the writer stays in its window, the first half of the ring
and a page, while the reader keeps up) and that packets come out in order, whole,
whatever the interleaving.
"""

from __future__ import annotations

import os
import random
from collections import deque

import pytest
from conftest import COUNTS_RING_PAGES

from cma import _linux
from cma.channel import (
    EAGER,
    HEAD,
    NOT_EAGER,
    RESIDENT_FROM,
    RING_EMPTY,
    ChannelConfig,
    Inbox,
    Outbox,
    packet_bytes,
    window_bytes,
)
from cma.protocol import ANY_TAG, FIN, RTS

CONFIG = ChannelConfig(eager_limit=16 << 10, ring_bytes=64 << 10, frag_size=4096, stage_slots=1)
BIG = CONFIG.eager_limit
BIG_PACKET = packet_bytes(BIG)


@pytest.fixture
def ring():
    pair = memoryview(bytearray(CONFIG.pair_bytes))
    sleeping = memoryview(bytearray(8)).cast("q")
    return Outbox(pair, CONFIG, sleeping), Inbox(pair, CONFIG)


@pytest.fixture
def shared_ring():
    """The ring over a shared mapping of a memfd, as a world's channels are: its writer
    can hand pages back. Also the memfd, whose allocated bytes say how many it holds."""
    fd = _linux.memfd_segment("test-ring", CONFIG.pair_bytes)
    try:
        pair = memoryview(_linux.map_shared(fd, CONFIG.pair_bytes))
        sleeping = memoryview(bytearray(8)).cast("q")
        yield Outbox(pair, CONFIG, sleeping), Inbox(pair, CONFIG), fd
    finally:
        os.close(fd)  # (the mapping goes with the last view of it)


def allocated(fd: int) -> int:
    """Bytes of memory a memfd holds."""
    return os.fstat(fd).st_blocks * 512


def put(out: Outbox, tag: int, n: int) -> bool:
    return out.put_eager(tag, memoryview(bytes([tag % 256]) * n), n) >= 0


def take(inbox: Inbox) -> tuple[int, int, int]:
    """(offset in the ring, tag, size) of the oldest packet, consumed and checked."""
    offset = inbox._position()
    assert offset >= 0, "the ring is empty"
    buf = memoryview(bytearray(BIG))
    n = inbox.take_eager(buf, ANY_TAG)
    assert n >= 0
    assert bytes(buf[:n]) == bytes([inbox.last_tag % 256]) * n
    return offset, inbox.last_tag, n


def test_ping_pong_of_large_packets_stays_in_the_window(ring):
    """Packets of the eager limit, each read before the next: two fit the window one after
    the other, then the writer goes back to the start."""
    out, inbox = ring
    offsets = []
    for i in range(10):
        assert put(out, i, BIG)
        offsets.append(take(inbox)[0])
    assert offsets == [0, BIG_PACKET] * 5
    assert 2 * BIG_PACKET <= CONFIG.window < 3 * BIG_PACKET


@pytest.mark.parametrize("ring_bytes", [_linux.PAGE_SIZE << k for k in range(12)])
def test_the_window_holds_two_packets_of_the_largest_eager_limit_within_the_ring(ring_bytes):
    """Every ring size a config may have, from a page to 8 MiB: two packets of a quarter of
    the ring fit the window, which ends before the ring does, on a page boundary where a
    resident window is faulted in (from RESIDENT_FROM)."""
    window = window_bytes(ring_bytes)
    assert 2 * packet_bytes(ring_bytes // 4) <= window < ring_bytes
    if window > RESIDENT_FROM:
        assert window % _linux.PAGE_SIZE == 0


def test_two_packets_of_the_eager_limit_go_back_to_back_after_one_was_read(ring):
    """The writer one packet of the eager limit on, read: two more back to back both go
    into the ring. With the window at half the ring the first went back to the start and
    the second found the ring full (its bytes held the jump's PAD, not yet passed by the
    reader), and an Isend of 2 MiB went as a rendezvous."""
    out, inbox = ring
    assert put(out, 1, BIG)
    assert take(inbox) == (0, 1, BIG)
    assert put(out, 2, BIG) and put(out, 3, BIG)
    assert [take(inbox) for _ in range(2)] == [(BIG_PACKET, 2, BIG), (0, 3, BIG)]


def test_small_packets_cycle_through_the_window_only(ring):
    out, inbox = ring
    offsets = set()
    for i in range(2000):
        assert put(out, i, 1000)
        offsets.add(take(inbox)[0])
    assert max(offsets) + packet_bytes(1000) <= CONFIG.window
    assert len(offsets) > 20  # it does move on: a packet is not written over its unread self


def test_lagging_reader_lets_packets_spill_into_the_second_half(ring):
    out, inbox = ring
    assert put(out, 1, BIG) and put(out, 2, BIG) and put(out, 3, BIG)  # 3 past the window
    assert take(inbox) == (0, 1, BIG)
    assert put(out, 4, BIG)  # the start is free again
    assert [take(inbox) for _ in range(3)] == [(BIG_PACKET, 2, BIG), (2 * BIG_PACKET, 3, BIG),
                                               (0, 4, BIG)]


def test_full_ring_refuses_until_the_reader_frees_the_start(ring):
    out, inbox = ring
    fitted = 0
    while put(out, fitted, BIG):
        fitted += 1
    assert fitted == CONFIG.ring_bytes // BIG_PACKET
    assert take(inbox) == (0, 0, BIG)
    assert put(out, fitted, BIG)
    assert [take(inbox) for _ in range(fitted)] == [
        (i * BIG_PACKET, i, BIG) for i in range(1, fitted)] + [(0, fitted, BIG)]


def test_packet_waits_when_neither_the_end_nor_the_freed_start_holds_it(ring):
    out, inbox = ring
    small = BIG - 84  # a packet 64 bytes shorter than BIG_PACKET
    assert put(out, 0, small) and put(out, 1, BIG) and put(out, 2, BIG)
    assert take(inbox) == (0, 0, small)
    assert not put(out, 3, BIG)  # 64 bytes short at the start, 192 at the end
    assert take(inbox) == (packet_bytes(small), 1, BIG)
    assert put(out, 3, BIG)
    assert [take(inbox)[:2] for _ in range(2)] == [(packet_bytes(small) + BIG_PACKET, 2), (0, 3)]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("releases", [False, True])
def test_random_interleaving_keeps_every_packet_in_order(ring, shared_ring, seed, releases):
    """Both writers (put, put_eager) and both readers (take, take_eager) in random turns;
    ``fits`` foretells every write. ``releases``: over a shared mapping, the writer also
    hands its free pages back now and then, which must lose no packet in flight."""
    out, inbox = shared_ring[:2] if releases else ring
    rnd = random.Random(seed)
    in_flight: deque[tuple[int, int]] = deque()
    buf = memoryview(bytearray(BIG))
    sent = 0
    for _ in range(3000):
        if releases and rnd.random() < 0.05:
            out.release_free_pages()
            continue
        if rnd.random() < 0.5:
            n = rnd.choice([0, 8, 1000, rnd.randrange(BIG + 1)])
            payload = bytes([sent % 256]) * n
            fits = out.fits(n)
            if rnd.random() < 0.5:
                written = out.put(EAGER, sent, 0, payload)
            else:
                written = out.put_eager(sent, memoryview(payload), n) >= 0
            assert written == fits
            if written:
                in_flight.append((sent, n))
                sent += 1
            continue
        if not inbox.ready():
            assert not in_flight, "a written packet is not visible"
            inbox.publish_tail()
            continue
        if rnd.random() < 0.5:
            n = inbox.take_eager(buf, ANY_TAG)
            tag, data = inbox.last_tag, bytes(buf[:n])
        else:
            kind, tag, n, _, view = inbox.take()
            assert kind == EAGER
            data = bytes(view)
            inbox.release()
        assert (tag, n) == in_flight.popleft()
        assert data == bytes([tag % 256]) * n
        if rnd.random() < 0.2:
            inbox.publish_tail()
    assert sent > 500


@pytest.mark.parametrize("start", range(0, CONFIG.ring_bytes, 1472))
def test_drained_ring_takes_the_largest_control_packet_from_any_position(ring, start):
    out, inbox = ring
    while out.head < start:  # move both ends to ``start`` (give or take one packet)
        assert put(out, 0, 1000)
        take(inbox)
    inbox.publish_tail()
    payload = bytes(range(256)) * (CONFIG.max_packet // 256) + bytes(CONFIG.max_packet % 256)
    assert out.put(EAGER, 7, 0, payload)
    kind, tag, n, _, view = inbox.take()
    assert (kind, tag, n, bytes(view)) == (EAGER, 7, CONFIG.max_packet, payload)


@pytest.mark.parametrize("seed", range(5))
def test_a_taken_payload_stays_intact_until_released(ring, seed):
    """The writer fills every byte the reader has published free; the held view survives."""
    out, inbox = ring
    rnd = random.Random(seed)
    filler = 255
    for i in range(100):
        tag = i % filler
        assert put(out, tag, rnd.choice([0, 8, rnd.randrange(BIG + 1)]))
        kind, taken_tag, n, _, view = inbox.take()
        held = bytes(view)
        assert (kind, taken_tag, held) == (EAGER, tag, bytes([tag]) * n)
        inbox.publish_tail()
        fillers = 0
        while put(out, filler, rnd.randrange(1, BIG + 1)):
            fillers += 1
        assert fillers > 0
        assert bytes(view) == held
        inbox.release()
        for _ in range(fillers):
            assert take(inbox)[1] == filler


def test_head_of_finds_a_packet_of_that_kind_and_size_and_consume_takes_it(ring):
    out, inbox = ring
    assert inbox.head_of(RTS, 40) == -1  # empty
    payload = bytes(range(40))
    assert out.put(RTS, 5, 300_000, payload)
    assert inbox.head_of(RTS, 48) == -1 and inbox.head_of(FIN, 40) == -1
    at = inbox.head_of(RTS, 40)
    assert at >= 0
    assert list(inbox.words[at : at + 4]) == [RTS, 5, 40, 300_000]
    assert bytes(inbox.words[at + 4 : at + 9]) == payload
    inbox.consume(40)
    assert inbox.head_of(RTS, 40) == -1 and not inbox.ready()


def test_head_of_refuses_a_packet_whose_head_runs_past_what_was_published(ring):
    out, inbox = ring
    assert out.put(RTS, 5, 300_000, bytes(40))
    inbox.ctl[HEAD] = inbox.tail + 64  # (a corrupt peer's head: the packet takes 128 bytes)
    assert inbox.head_of(RTS, 40) == -1


def test_take_if_takes_only_the_empty_packet_named(ring):
    out, inbox = ring
    assert inbox.take_if(FIN, 3) == RING_EMPTY
    assert out.put(FIN, 0, 4, b"")
    assert inbox.take_if(FIN, 3) == NOT_EAGER  # another message's FIN: left in place
    assert inbox.take_if(RTS, 4) == NOT_EAGER
    assert inbox.take_if(FIN, 4) == 0
    assert inbox.take_if(FIN, 4) == RING_EMPTY
    assert out.put(FIN, 0, 5, b"x")
    assert inbox.take_if(FIN, 5) == NOT_EAGER  # (a FIN has no payload)


def test_the_writer_hands_back_the_free_pages_and_keeps_what_is_in_flight(shared_ring):
    """release_free_pages frees every whole page from the head to the published tail a
    lap on: the pages of packets not yet read stay, and so do their bytes."""
    out, inbox, fd = shared_ring
    page = _linux.PAGE_SIZE
    assert allocated(fd) <= page  # (the control page)
    while out.head < 4 * CONFIG.ring_bytes:  # laps of large packets: the window is touched
        assert put(out, 1, BIG)
        take(inbox)
    inbox.publish_tail()
    touched = allocated(fd)
    assert touched >= page + BIG  # the control page and the pages those packets touched
    # in flight while the pages go back (two that need no jump back to the start, which
    # would leave the ring looking full: nothing free to hand back)
    assert put(out, 2, 100) and put(out, 3, 5000)
    assert out.release_free_pages() >= 1
    in_flight = packet_bytes(100) + packet_bytes(5000)
    # what stays: the control page and the pages the two packets (and the one before
    # them, in the first of those pages) touch
    assert allocated(fd) <= page + in_flight + 2 * page < touched
    assert [take(inbox)[1:] for _ in range(2)] == [(2, 100), (3, 5000)]
    inbox.publish_tail()
    assert out.release_free_pages() >= 1
    assert allocated(fd) <= 2 * page
    for tag in range(4, 40):  # new packets through the released pages
        assert put(out, tag, BIG)
        assert take(inbox)[1:] == (tag, BIG)


@COUNTS_RING_PAGES
def test_a_resident_window_is_faulted_in_once_the_ring_carries_traffic_and_kept():
    """An Outbox made ``resident`` holds no more than the pages its packets touched until
    its writer first passes RESIDENT_FROM; then its whole window is faulted in at once, and
    a release hands back only the pages past it (those packets spilled into while the
    reader lagged)."""
    config = ChannelConfig(eager_limit=16 << 10, ring_bytes=4 * RESIDENT_FROM,
                           frag_size=4096, stage_slots=1)
    page, window, big = _linux.PAGE_SIZE, config.window, config.eager_limit
    fd = _linux.memfd_segment("test-ring", config.pair_bytes)
    try:
        pair = memoryview(_linux.map_shared(fd, config.pair_bytes))
        sleeping = memoryview(bytearray(8)).cast("q")
        out, inbox = Outbox(pair, config, sleeping, resident=True), Inbox(pair, config)
        sent = 0
        while out.head + packet_bytes(big) <= RESIDENT_FROM:  # (the first stretch)
            assert put(out, sent, big)
            sent += 1
        assert allocated(fd) <= page + out.head + page < window
        while out.head & out.mask < window + big:  # a lagging reader: packets spill past it
            assert put(out, sent, big)
            sent += 1
        spilled = allocated(fd)
        assert out.window == window  # (the whole window once resident, as ChannelConfig has it)
        assert spilled >= window + big
        for tag in range(sent):
            assert take(inbox)[1:] == (tag, big)
        inbox.publish_tail()
        assert out.release_free_pages() >= 1
        assert window <= allocated(fd) <= window + 2 * page < spilled
        for tag in range(sent, sent + 40):  # on through the kept window
            assert put(out, tag, big)
            assert take(inbox)[1:] == (tag, big)
    finally:
        os.close(fd)


@COUNTS_RING_PAGES
def test_populate_faults_whole_pages_in():
    """populate makes the pages resident in one call; it takes whole pages only."""
    page = _linux.PAGE_SIZE
    fd = _linux.memfd_segment("test-populate", 16 * page)
    mm = _linux.map_shared(fd, 16 * page)
    try:
        assert allocated(fd) == 0
        with memoryview(mm) as view:
            start = _linux.buffer_address(view)
            assert _linux.populate(start + 4 * page, 8 * page)
            assert allocated(fd) == 8 * page
            with pytest.raises(ValueError):
                _linux.populate(start + 1, page)
    finally:
        mm.close()
        os.close(fd)


def test_a_ring_that_is_no_shared_mapping_hands_nothing_back(ring):
    out, inbox = ring
    assert put(out, 1, BIG)
    assert out.release_free_pages() == 0
    assert take(inbox)[1:] == (1, BIG)

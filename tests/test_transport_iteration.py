"""The iteration every memory-reaching transport shares (base.Transfer), and its split
over threads (base.SplitCopy, cma's and xmap's), driven sans-IO.

A fake batch copy reads "remote" addresses as offsets into a bytes object and, like the
kernel, may move fewer bytes than it was offered: the iteration must deliver every byte
once, in order, never offer more than the limits allow, and never spin.
"""

from __future__ import annotations

import errno
import mmap
import random
import sys
import threading

import pytest

from cma.errors import BufferError, TransportFault
from cma.transports.base import BatchLimits, Region, SplitCopy, Transfer


def _cuts(rng: random.Random, total: int, pieces: int) -> list[int]:
    """``pieces`` sizes adding up to ``total``, some of them 0."""
    points = sorted(rng.randrange(total + 1) for _ in range(pieces - 1))
    return [b - a for a, b in zip([0, *points], [*points, total], strict=True)]


@pytest.mark.parametrize("seed", range(60))
def test_every_byte_arrives_once_in_order_within_the_limits(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.choice([1, 7, 100, 4096, 10_000])
    source = rng.randbytes(total)
    base = 1000  # remote addresses start here, so an offset slip shows
    # one span a side in some runs: the iteration's shortcut for those
    region_sizes = _cuts(rng, total, rng.choice([1, rng.randint(1, 40)]))
    starts = [base + sum(region_sizes[:i]) for i in range(len(region_sizes))]
    regions = [Region(addr, n) for addr, n in zip(starts, region_sizes, strict=True)]
    buffers = [memoryview(bytearray(n)) for n in _cuts(rng, total, rng.choice([1, rng.randint(1, 40)]))]
    limits = BatchLimits(local_spans=rng.randint(1, 5), remote_spans=rng.randint(1, 5),
                         nbytes=rng.randint(1, total + 1))

    def batch(views: list[memoryview], lens: list[int], addrs: list[int],
              remote_lens: list[int]) -> int:
        offered = sum(lens)
        assert offered == sum(remote_lens) <= limits.nbytes
        assert 0 < len(views) <= limits.local_spans and 0 < len(addrs) <= limits.remote_spans
        assert [view.nbytes for view in views] == lens and all(lens) and all(remote_lens)
        moved = rng.randint(1, offered)  # short, as the kernel may be
        data = b"".join(source[a - base : a - base + n] for a, n in zip(addrs, remote_lens, strict=True))
        pos = 0
        for view in views:
            n = min(view.nbytes, moved - pos)
            view[:n] = data[pos : pos + n]
            pos += n
        return moved

    transfer = Transfer(buffers, regions, writable=True, what="test")
    assert transfer.total == total
    middle = rng.randrange(total + 1)
    outcomes = [transfer.run(batch, limits, 0, middle), transfer.run(batch, limits, middle, total)]
    assert [o.error for o in outcomes] == [None, None]
    assert sum(o.copied for o in outcomes) == total
    assert b"".join(bytes(b) for b in buffers) == source


def test_a_call_that_moves_nothing_stops_the_copy() -> None:
    transfer = Transfer([memoryview(bytearray(10))], [Region(0, 10)], writable=True, what="test")
    outcome = transfer.run(lambda *batch: 0, BatchLimits(1, 1, 10))
    assert isinstance(outcome.error, TransportFault) and outcome.error.errno == errno.EIO
    assert "no progress" in str(outcome.error)
    assert (outcome.calls, outcome.copied) == (1, 0)


def test_sides_are_checked_once_before_any_copy() -> None:
    with pytest.raises(BufferError, match="must be equal"):
        Transfer([memoryview(bytearray(3))], [Region(0, 4)], writable=True, what="test")
    with pytest.raises(BufferError, match="read-only"):
        Transfer([memoryview(bytes(4))], [Region(0, 4)], writable=True, what="test")
    with pytest.raises(TransportFault, match="not valid"):
        Transfer([memoryview(bytearray(4))], [Region(-1, 4)], writable=True, what="test")
    empty = Transfer([memoryview(bytearray(0))], [Region(5, 0)], writable=True, what="test")
    assert empty.total == 0 and empty.run(lambda *batch: 0, BatchLimits(1, 1, 1)).calls == 0


@pytest.mark.parametrize("seed", range(16))
def test_a_split_copy_from_views_delivers_every_byte_once_across_threads(seed: int) -> None:
    """xmap's shape: the remote side is views of a mapping, one span pair per batch; a
    copy at or above the threshold runs as page-multiple ranges, the first on this
    thread and the others on the pool's."""
    rng = random.Random(seed)
    total = rng.choice([1, 4095, 3 * mmap.PAGESIZE + 5, 100_000, 300_000])
    source = rng.randbytes(total)
    cuts = _cuts(rng, total, rng.choice([1, rng.randint(1, 6)]))
    sources = [memoryview(source)[sum(cuts[:i]) : sum(cuts[: i + 1])] for i in range(len(cuts))]
    buffers = [memoryview(bytearray(n)) for n in _cuts(rng, total, rng.choice([1, rng.randint(1, 6)]))]
    threads = rng.randint(1, 4)
    split = SplitCopy(threads, rng.choice([0, 0, total, total + 1]), "test-split")
    ran_on: set[int] = set()

    def batch(views: list[memoryview], lens: list[int], spans: list[memoryview],
              span_lens: list[int]) -> int:
        assert len(views) == len(spans) == 1 and lens == span_lens == [spans[0].nbytes]
        views[0][:] = spans[0]
        ran_on.add(threading.get_ident())
        return lens[0]

    ranges = split.run(Transfer.from_views(buffers, sources, what="test"), batch,
                       BatchLimits(1, 1, sys.maxsize))
    split.close()
    assert b"".join(bytes(b) for b in buffers) == source
    assert all(outcome.error is None for _, outcome in ranges)
    starts = [start for start, _ in ranges]
    if threads == 1 or total < split.threshold or total <= mmap.PAGESIZE:
        assert starts == [0] and ran_on == {threading.get_ident()}
    else:
        assert 1 < len(starts) <= threads
        assert all(start % mmap.PAGESIZE == 0 for start in starts)
        # each range copied exactly its bytes, up to the next range
        assert [outcome.copied for _, outcome in ranges] == \
            [b - a for a, b in zip(starts, [*starts[1:], total], strict=True)]
        assert threading.get_ident() in ran_on and len(ran_on) > 1

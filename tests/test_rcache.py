"""The registration cache (cma/rcache.py) against a small reference model, in all four modes.

No kernel: ``map`` hands out ``FakeMapping`` objects that remember when they were made
and whether they were unmapped, and "memory going away" is a ``give_back`` event on a
clock. The state machine checks that the cache maps and unmaps exactly what the model
says, keeps its limits, and never lets a lease reach a mapping that was unmapped or
whose memory was given back after it was made.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
from dataclasses import dataclass, field

import pytest
from conftest import stop_process
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from cma import _linux
from cma.errors import RegistrationCacheFull, StaleRegistration
from cma.rcache import Lease, RegistrationCache

SPACES = (0, 1)
ALIGN = 4
MAX_BYTES = 64
MAX_ENTRIES = 3


@dataclass(eq=False)
class FakeMapping:
    space: int
    base: int
    size: int
    made_at: int
    unmapped: bool = False


@dataclass(eq=False)
class ModelEntry:
    space: int
    base: int
    size: int
    refs: int = 0
    findable: bool = True
    valid: bool = True

    def covers(self, space: int, base: int, size: int) -> bool:
        return self.space == space and self.base <= base and base + size <= self.base + self.size

    def touches(self, space: int, base: int, size: int) -> bool:
        return self.space == space and self.base < base + size and base < self.base + self.size


@dataclass
class Model:
    """What the cache should do, with lists and linear scans instead of indices."""

    leave_pinned: bool
    max_bytes: int | None
    max_entries: int | None
    mapped: list[ModelEntry] = field(default_factory=list)  # every entry not yet unmapped
    lru: list[ModelEntry] = field(default_factory=list)  # released and cached, oldest first

    def acquire(self, space: int, base: int, size: int) -> tuple[ModelEntry, list[ModelEntry]]:
        """The entry the lease gets and the entries unmapped on the way; raises when full."""
        covering = [e for e in self.mapped if e.findable and e.covers(space, base, size)]
        if covering:
            entry = max(covering, key=lambda e: e.base)
            if entry in self.lru:
                self.lru.remove(entry)
            entry.refs += 1
            return entry, []
        lo = base - base % ALIGN
        hi = -(-(base + size) // ALIGN) * ALIGN
        same = [e for e in self.mapped if e.findable and e.space == space and e.base == lo]
        goes = [e for e in same if e.refs == 0]  # unmapped now; one in use is only retired
        if self.max_bytes is not None and hi - lo > self.max_bytes:
            raise RegistrationCacheFull("too large")
        victims = []
        candidates = [e for e in self.lru if e not in goes]
        while (self.max_bytes is not None and self._bytes(goes + victims) + hi - lo > self.max_bytes
               or self.max_entries is not None and self._count(goes + victims) + 1 > self.max_entries):
            if not candidates:
                raise RegistrationCacheFull("all in use")
            victims.append(candidates.pop(0))
        unmapped = goes + victims
        for e in same:
            e.findable = False
        for e in unmapped:
            self.mapped.remove(e)
            self.lru.remove(e)
        entry = ModelEntry(space, lo, hi - lo, refs=1)
        self.mapped.append(entry)
        return entry, unmapped

    def _bytes(self, leaving: list[ModelEntry]) -> int:
        return sum(e.size for e in self.mapped if e not in leaving)

    def _count(self, leaving: list[ModelEntry]) -> int:
        return sum(1 for e in self.mapped if e not in leaving)

    def release(self, entry: ModelEntry) -> bool:
        """True when the entry is unmapped by this release."""
        entry.refs -= 1
        if entry.refs:
            return False
        if entry.findable and self.leave_pinned:
            self.lru.append(entry)
            return False
        self.mapped.remove(entry)
        return True

    def invalidate(self, space: int, base: int, size: int) -> tuple[int, list[ModelEntry]]:
        """How many entries are dropped, and those of them unmapped now."""
        dropped = [e for e in self.mapped if e.valid and e.touches(space, base, size)]
        gone = []
        for e in dropped:
            e.findable = e.valid = False
            if e.refs == 0:
                self.mapped.remove(e)
                self.lru.remove(e)
                gone.append(e)
        return len(dropped), gone

    def flush(self) -> list[ModelEntry]:
        gone, self.lru = self.lru, []
        for e in gone:
            self.mapped.remove(e)
        return gone


@dataclass(eq=False)
class Held:
    lease: Lease[FakeMapping]
    entry: ModelEntry
    space: int
    base: int
    size: int


ranges = st.tuples(st.sampled_from(SPACES), st.integers(0, 40), st.integers(1, 24))


class CacheMachine(RuleBasedStateMachine):
    leave_pinned = True
    max_bytes: int | None = None
    max_entries: int | None = None

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.given_back: list[tuple[int, int, int, int]] = []  # (space, base, size, when)
        self.mapped_now: list[FakeMapping] = []
        self.unmapped_now: list[FakeMapping] = []
        self.cache: RegistrationCache[FakeMapping] = RegistrationCache(
            self._map, self._unmap, leave_pinned=self.leave_pinned, max_bytes=self.max_bytes,
            max_entries=self.max_entries, align=ALIGN)
        self.model = Model(self.leave_pinned, self.max_bytes, self.max_entries)
        self.handles: dict[int, FakeMapping] = {}  # id(model entry) -> the mapping it stands for
        self.hits = self.misses = 0
        self.live: list[Held] = []  # leases acquired and not released
        self.made: list[FakeMapping] = []

    def _map(self, space: object, base: int, size: int) -> FakeMapping:
        assert isinstance(space, int)
        self.clock += 1
        mapping = FakeMapping(space, base, size, self.clock)
        self.mapped_now.append(mapping)
        self.made.append(mapping)
        return mapping

    def _unmap(self, mapping: FakeMapping) -> None:
        assert not mapping.unmapped, "a mapping was unmapped twice"
        mapping.unmapped = True
        self.unmapped_now.append(mapping)

    def _expect_unmapped(self, entries: list[ModelEntry]) -> None:
        assert sorted(map(id, self.unmapped_now)) == sorted(id(self.handles.pop(id(e))) for e in entries)
        self.unmapped_now.clear()

    @rule(target=held, where=ranges)
    def acquire(self, where: tuple[int, int, int]) -> Held | object:
        space, base, size = where
        try:
            entry, unmapped = self.model.acquire(space, base, size)
        except RegistrationCacheFull:
            before = self.cache.stats.evictions
            with pytest.raises(RegistrationCacheFull):
                self.cache.acquire(base, size, space)
            assert not self.mapped_now and not self.unmapped_now, "a failed acquire changed mappings"
            assert self.cache.stats.evictions == before
            self.misses += 1
            return multiple()
        lease = self.cache.acquire(base, size, space)
        if self.mapped_now:
            self.misses += 1
            (made,) = self.mapped_now
            self.mapped_now.clear()
            assert (made.space, made.base, made.size) == (entry.space, entry.base, entry.size)
            self.handles[id(entry)] = made
        else:
            self.hits += 1
        self._expect_unmapped(unmapped)
        assert lease.mapping is self.handles[id(entry)]
        item = Held(lease, entry, space, base, size)
        self.live.append(item)
        return item

    @rule(item=consumes(held))
    def release(self, item: Held) -> None:
        self.live.remove(item)
        item.lease.release()
        if self.model.release(item.entry):
            self._expect_unmapped([item.entry])
        else:
            assert not self.unmapped_now
        with pytest.raises(StaleRegistration):
            item.lease.release()
        with pytest.raises(StaleRegistration):
            item.lease.mapping  # noqa: B018 - the access is the test

    @rule(where=ranges)
    def give_back(self, where: tuple[int, int, int]) -> None:
        """The memory of a range went away (a peer gave its segment back)."""
        space, base, size = where
        self.clock += 1
        self.given_back.append((space, base, size, self.clock))
        dropped, gone = self.model.invalidate(space, base, size)
        assert self.cache.invalidate(base, size, space) == dropped
        self._expect_unmapped(gone)

    @rule(item=held)
    def use(self, item: Held) -> None:
        """A lease either reaches a live mapping of memory not given back since, or fails."""
        if not item.entry.valid:
            with pytest.raises(StaleRegistration):
                item.lease.mapping  # noqa: B018 - the access is the test
            return
        mapping = item.lease.mapping
        assert not mapping.unmapped, "a lease reached an unmapped mapping"
        assert mapping.space == item.space
        assert mapping.base <= item.base and item.base + item.size <= mapping.base + mapping.size
        assert item.lease.offset(item.base) == item.base - mapping.base
        for space, base, size, when in self.given_back:
            overlaps = space == mapping.space and base < mapping.base + mapping.size \
                and mapping.base < base + size
            assert not (overlaps and when > mapping.made_at), "a mapping outlived its memory"

    @precondition(lambda self: self.leave_pinned)
    @rule()
    def flush(self) -> None:
        gone = self.model.flush()
        assert self.cache.flush() == len(gone)
        self._expect_unmapped(gone)

    @invariant()
    def accounting(self) -> None:
        stats = self.cache.stats
        assert stats.entries == len(self.model.mapped) == len(self.cache)
        assert stats.bytes_mapped == sum(e.size for e in self.model.mapped)
        assert (stats.hits, stats.misses) == (self.hits, self.misses)
        if self.max_bytes is not None:
            assert stats.bytes_mapped <= self.max_bytes
        if self.max_entries is not None:
            assert stats.entries <= self.max_entries
        assert sum(1 for m in self.handles.values() if m.unmapped) == 0

    def teardown(self) -> None:
        """Releasing every lease and flushing unmaps every mapping made, each once."""
        for item in self.live:
            item.lease.release()
        self.cache.flush()
        assert len(self.cache) == 0 and self.cache.stats.bytes_mapped == 0
        assert all(m.unmapped for m in self.made)


def machine(leave_pinned: bool, limited: bool) -> type[CacheMachine]:
    attrs = {"leave_pinned": leave_pinned, "max_bytes": MAX_BYTES if limited else None,
             "max_entries": MAX_ENTRIES if limited else None}
    return type(f"Cache_{'pinned' if leave_pinned else 'unpinned'}_{'limited' if limited else 'unlimited'}",
                (CacheMachine,), attrs)


# RCACHE_EXAMPLES=1000 for a longer hunt than CI's budget allows (the default runs in seconds)
STATE_MACHINE_SETTINGS = settings(max_examples=int(os.environ.get("RCACHE_EXAMPLES", "20")),
                                  stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
TestPinnedUnlimited = machine(True, False).TestCase
TestPinnedLimited = machine(True, True).TestCase
TestUnpinnedUnlimited = machine(False, False).TestCase
TestUnpinnedLimited = machine(False, True).TestCase
for case in (TestPinnedUnlimited, TestPinnedLimited, TestUnpinnedUnlimited, TestUnpinnedLimited):
    case.settings = STATE_MACHINE_SETTINGS
del case  # else pytest collects the last one a second time under this name


# ---------------------------------------------------------------- the semantics, one example each

class Recorder:
    def __init__(self) -> None:
        self.maps: list[tuple[object, int, int]] = []
        self.unmaps: list[tuple[object, int, int]] = []

    def map(self, space: object, base: int, size: int) -> tuple[object, int, int]:
        self.maps.append((space, base, size))
        return (space, base, size)

    def unmap(self, handle: tuple[object, int, int]) -> None:
        self.unmaps.append(handle)


def test_a_larger_registration_serves_a_smaller_request_and_stays_while_used() -> None:
    rec = Recorder()
    cache = RegistrationCache(rec.map, rec.unmap, leave_pinned=False)
    big = cache.acquire(0, 100)
    small = cache.acquire(10, 20)
    assert small.mapping is big.mapping and small.offset(10) == 10
    big.release()
    assert rec.unmaps == []  # the smaller user keeps it alive
    small.release()
    assert rec.unmaps == [(0, 0, 100)]
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_leave_pinned_keeps_a_released_registration_for_the_next_user() -> None:
    rec = Recorder()
    cache = RegistrationCache(rec.map, rec.unmap, leave_pinned=True)
    cache.acquire(0, 100).release()
    with cache.acquire(0, 100):
        pass
    assert rec.maps == [(0, 0, 100)] and rec.unmaps == []
    assert cache.flush() == 1 and rec.unmaps == [(0, 0, 100)]


def test_the_same_base_larger_evicts_and_maps_again() -> None:
    rec = Recorder()
    cache = RegistrationCache(rec.map, rec.unmap)
    cache.acquire(0, 100).release()
    grown = cache.acquire(0, 200)
    assert rec.maps == [(0, 0, 100), (0, 0, 200)] and rec.unmaps == [(0, 0, 100)]
    assert cache.stats.evictions == 1 and grown.mapping == (0, 0, 200)


def test_an_in_use_registration_whose_memory_went_away_is_unusable() -> None:
    rec = Recorder()
    cache = RegistrationCache(rec.map, rec.unmap)
    lease = cache.acquire(4096, 4096, space="peer")
    assert cache.invalidate(0, 8192, space="other") == 0
    assert cache.invalidate(8000, 1, space="peer") == 1
    with pytest.raises(StaleRegistration):
        lease.mapping  # noqa: B018 - the access is the test
    again = cache.acquire(4096, 4096, space="peer")  # a miss: maps the memory there now
    assert len(rec.maps) == 2 and again.mapping == ("peer", 4096, 4096)
    lease.release()
    assert rec.unmaps == [("peer", 4096, 4096)]


def test_a_full_cache_says_so_and_evicts_nothing() -> None:
    rec = Recorder()
    cache = RegistrationCache(rec.map, rec.unmap, max_bytes=100)
    held = cache.acquire(0, 60)
    cache.acquire(100, 30).release()
    with pytest.raises(RegistrationCacheFull, match="release leases or raise the limits"):
        cache.acquire(200, 50)
    assert rec.unmaps == []
    cache.acquire(300, 40).release()  # fits once the released one is evicted
    assert rec.unmaps == [(0, 100, 30)] and cache.stats.evictions == 1
    with pytest.raises(RegistrationCacheFull, match="larger than the cache's limit"):
        cache.acquire(0, 101)
    held.release()


# ---------------------------------------------------------------- with real mappings

def _truncated_segment_is_never_read() -> None:
    """In a child: mappings of real memfds; a segment cut to 0 bytes (reading a mapping of
    it would raise SIGBUS) is invalidated, and no lease reaches its mapping again."""
    fds = {name: _linux.memfd_segment(f"rcache-{name}", 1 << 16) for name in ("a", "b")}
    cache: RegistrationCache[mmap.mmap] = RegistrationCache(
        lambda space, base, size: _linux.map_shared(fds[space], size, base), lambda mm: mm.close(),
        align=mmap.PAGESIZE)
    held = cache.acquire(100, 1000, "a")
    held.mapping[100] = 7
    with cache.acquire(0, 1 << 16, "b") as other:
        other.mapping[0] = 1
    os.ftruncate(fds["a"], 0)  # the owner gives the memory back
    assert cache.invalidate(0, 1 << 16, "a") == 1
    with pytest.raises(StaleRegistration):
        held.mapping  # noqa: B018 - the access is the test
    held.release()
    os.ftruncate(fds["a"], 1 << 16)
    with cache.acquire(100, 1000, "a") as again:  # maps the memory that is there now
        assert again.mapping[100] == 0
    with cache.acquire(0, 10, "b") as other:
        assert other.mapping[0] == 1 and cache.stats.hits == 1
    cache.flush()
    assert len(cache) == 0
    for fd in fds.values():
        os.close(fd)


def test_a_segment_given_back_is_never_read_through_a_cached_mapping() -> None:
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_truncated_segment_is_never_read)
    child.start()
    stop_process(child, 30.0)
    assert child.exitcode == 0, f"the child failed (exit code {child.exitcode}; -7 is SIGBUS)"

"""The registration cache: mappings of peer memory, made once and reused.

Sans-IO: what a registration *is* (an ``mmap`` of a peer's heap segment, a vmfd
window) is decided by the ``map``/``unmap`` callables the owner passes in; the cache
only decides when to call them. The semantics are those MPI libraries converged on
(Open MPI's rcache, UCX's ucs_rcache), described with their numbers in
docs/registration.md: interval lookup of a covering registration, reference counts,
``leave_pinned``, limits with LRU eviction, the same-base conflict, invalidation.

Ranges live in *spaces* (any hashable: a peer and its segment, say); ranges of
different spaces never cover each other.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import RegistrationCacheFull, StaleRegistration

H = TypeVar("H")


@dataclass
class CacheStats:
    """What the cache did since it was made: lookups served and mappings made and undone."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0  # unmapped to make room, or replaced by a larger one at the same base
    invalidations: int = 0  # registrations dropped because their memory went away
    bytes_mapped: int = 0  # bytes currently mapped (in use, cached, or invalidated but still in use)
    entries: int = 0  # registrations currently mapped


class Registration(Generic[H]):
    """One mapping of ``[base, base + size)`` in ``space``, shared by every lease on it."""

    __slots__ = ("base", "size", "space", "_handle", "refs", "findable", "valid")

    def __init__(self, space: Hashable, base: int, size: int, handle: H) -> None:
        self.space = space
        self.base = base
        self.size = size
        self._handle = handle
        self.refs = 0
        self.findable = True  # in the lookup index (false once superseded or invalidated)
        self.valid = True  # false once its memory went away: never used again

    @property
    def end(self) -> int:
        """The address just past the registered range."""
        return self.base + self.size

    def covers(self, base: int, size: int) -> bool:
        """Whether [base, base + size) lies within the registered range."""
        return self.base <= base and base + size <= self.end

    def __repr__(self) -> str:
        state = "valid" if self.valid else "invalidated"
        return f"<Registration {self.space!r} [{self.base:#x}, {self.end:#x}) refs={self.refs} {state}>"


class Lease(Generic[H]):
    """One user's hold on a registration, from ``acquire`` to ``release`` (or a ``with`` block)."""

    __slots__ = ("registration", "_cache", "_released")

    def __init__(self, cache: RegistrationCache[H], registration: Registration[H]) -> None:
        self.registration = registration
        self._cache = cache
        self._released = False

    @property
    def mapping(self) -> H:
        """The mapping; ``StaleRegistration`` once released or once its memory went away."""
        if self._released:
            raise StaleRegistration("this lease was released; acquire the range again")
        if not self.registration.valid:
            raise StaleRegistration(
                f"the memory of {self.registration!r} went away (invalidated) while this lease "
                "held it; acquire the range again to map the memory that is there now")
        return self.registration._handle

    def offset(self, address: int) -> int:
        """Where ``address`` of the space lies within the mapping."""
        return address - self.registration.base

    def release(self) -> None:
        """Give the hold back (once; a second release raises ``StaleRegistration``)."""
        if self._released:
            raise StaleRegistration("this lease was already released")
        self._released = True
        self._cache._release(self.registration)

    def __enter__(self) -> Lease[H]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RegistrationCache(Generic[H]):
    """Mappings of ranges, looked up by covering interval and reference counted.

    ``map(space, base, size)`` makes a mapping, ``unmap(handle)`` undoes it; each is
    called once per registration. With ``leave_pinned`` a registration whose last lease
    is released stays mapped on an LRU list until it is evicted, superseded or
    invalidated; without it, it is unmapped at once. ``max_bytes``/``max_entries``
    bound what is mapped: a miss first unmaps least-recently-released registrations,
    and raises ``RegistrationCacheFull`` (evicting nothing) when those cannot make
    enough room. ``align`` rounds a miss's range out, so neighbouring requests hit.
    """

    def __init__(
        self,
        map: Callable[[Hashable, int, int], H],  # noqa: A002 - the operation's name
        unmap: Callable[[H], None],
        *,
        leave_pinned: bool = True,
        max_bytes: int | None = None,
        max_entries: int | None = None,
        align: int = 1,
    ) -> None:
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, not {align}")
        for name, limit in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be at least 1 (or None for no limit), not {limit}")
        self._map = map
        self._unmap = unmap
        self.leave_pinned = leave_pinned
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.align = align
        # per space: bases in order, and the findable registration at each base
        self._bases: dict[Hashable, list[int]] = {}
        self._at: dict[Hashable, dict[int, Registration[H]]] = {}
        self._lru: OrderedDict[Registration[H], None] = OrderedDict()  # released, oldest first
        # in use but no longer findable (replaced by a larger one): still invalidated with their memory
        self._retired: dict[Hashable, set[Registration[H]]] = {}
        self.stats = CacheStats()

    # ------------------------------------------------------------ lookups

    def acquire(self, base: int, size: int, space: Hashable = 0) -> Lease[H]:
        """A lease on a registration covering ``[base, base + size)``, mapping it on a miss."""
        if size < 1 or base < 0:
            raise ValueError(f"a range needs base >= 0 and size >= 1, not ({base}, {size})")
        found = self._covering(space, base, size)
        if found is not None:
            self.stats.hits += 1
            if found.refs == 0:  # cached by leave_pinned: in use again
                del self._lru[found]
        else:
            self.stats.misses += 1
            found = self._register(space, base, size)
        found.refs += 1
        return Lease(self, found)

    def _covering(self, space: Hashable, base: int, size: int) -> Registration[H] | None:
        """The findable registration with the highest base that covers the range."""
        bases = self._bases.get(space)
        if not bases:
            return None
        at = self._at[space]
        for i in range(bisect.bisect_right(bases, base) - 1, -1, -1):
            reg = at[bases[i]]
            if reg.covers(base, size):
                return reg
        return None

    def _register(self, space: Hashable, base: int, size: int) -> Registration[H]:
        lo = base & ~(self.align - 1)
        hi = -(-(base + size) // self.align) * self.align
        old = self._at.get(space, {}).get(lo)
        # the same base mapped smaller (a segment that grew): the new mapping replaces it
        freed = old.size if old is not None and old.refs == 0 else 0
        self._make_room(hi - lo, freed, 1 if freed else 0, keep=old)
        if old is not None:
            self._drop(old)
            self.stats.evictions += 1
        handle = self._map(space, lo, hi - lo)
        reg: Registration[H] = Registration(space, lo, hi - lo, handle)
        self._at.setdefault(space, {})[lo] = reg
        bisect.insort(self._bases.setdefault(space, []), lo)
        self.stats.bytes_mapped += reg.size
        self.stats.entries += 1
        return reg

    def _make_room(self, size: int, freed: int, freed_entries: int, keep: Registration[H] | None) -> None:
        """Evict released registrations, oldest first, until ``size`` more bytes fit."""
        bytes_over = entries_over = 0
        if self.max_bytes is not None:
            if size > self.max_bytes:
                raise RegistrationCacheFull(
                    f"a mapping of {size} bytes is larger than the cache's limit of "
                    f"{self.max_bytes} bytes; raise max_bytes")
            bytes_over = self.stats.bytes_mapped - freed + size - self.max_bytes
        if self.max_entries is not None:
            entries_over = self.stats.entries - freed_entries + 1 - self.max_entries
        if bytes_over <= 0 and entries_over <= 0:
            return
        victims = []
        for reg in self._lru:
            if bytes_over <= 0 and entries_over <= 0:
                break
            if reg is keep:
                continue
            victims.append(reg)
            bytes_over -= reg.size
            entries_over -= 1
        if bytes_over > 0 or entries_over > 0:
            raise RegistrationCacheFull(
                f"cannot map {size} more bytes: {self.stats.bytes_mapped} bytes in "
                f"{self.stats.entries} mappings are mapped (limits: max_bytes={self.max_bytes}, "
                f"max_entries={self.max_entries}) and too few are released; release leases "
                "or raise the limits")
        for reg in victims:
            self._drop(reg)
            self.stats.evictions += 1

    # ------------------------------------------------------------ release and removal

    def _release(self, reg: Registration[H]) -> None:
        reg.refs -= 1
        if reg.refs:
            return
        if reg.findable and self.leave_pinned:
            self._lru[reg] = None
            return
        if reg.findable:
            self._unfind(reg)
        elif reg.valid:
            self._unretire(reg)
        self._do_unmap(reg)

    def _unretire(self, reg: Registration[H]) -> None:
        retired = self._retired[reg.space]
        retired.discard(reg)
        if not retired:
            del self._retired[reg.space]

    def _unfind(self, reg: Registration[H]) -> None:
        if not reg.findable:
            return
        reg.findable = False
        at = self._at[reg.space]
        del at[reg.base]
        bases = self._bases[reg.space]
        del bases[bisect.bisect_left(bases, reg.base)]
        if not bases:
            del self._bases[reg.space], self._at[reg.space]

    def _do_unmap(self, reg: Registration[H]) -> None:
        self.stats.bytes_mapped -= reg.size
        self.stats.entries -= 1
        self._unmap(reg._handle)

    def _drop(self, reg: Registration[H]) -> None:
        """Take ``reg`` out of lookups; unmap it now if unused, else at its last release."""
        self._unfind(reg)
        if reg.refs == 0:
            self._lru.pop(reg, None)
            self._do_unmap(reg)
        elif reg.valid:
            self._retired.setdefault(reg.space, set()).add(reg)

    def invalidate(self, base: int, size: int, space: Hashable = 0) -> int:
        """The memory of ``[base, base + size)`` went away: drop every registration touching it.

        Replaced registrations still in use are included. Unused ones are unmapped now;
        leases still held on one fail from now on (``StaleRegistration``) and it is
        unmapped when the last is released. Returns how many registrations were dropped.
        """
        bases = self._bases.get(space, [])
        at = self._at.get(space, {})
        hit = [at[b] for b in bases[: bisect.bisect_left(bases, base + size)] if at[b].end > base]
        for reg in hit:
            reg.valid = False
            self._drop(reg)
        retired = [reg for reg in self._retired.get(space, ()) if reg.base < base + size and reg.end > base]
        for reg in retired:
            reg.valid = False
            self._unretire(reg)
        self.stats.invalidations += len(hit) + len(retired)
        return len(hit) + len(retired)

    def flush(self) -> int:
        """Unmap every released registration (those ``leave_pinned`` keeps); how many."""
        victims = list(self._lru)
        for reg in victims:
            self._drop(reg)
        return len(victims)

    def __len__(self) -> int:
        """Registrations currently mapped."""
        return self.stats.entries

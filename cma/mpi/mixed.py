"""Wildcard receives on a rank with peers on its node and elsewhere: who may take what.

A receive that could take a message from either channel (cma for this node's ranks, MPI
for the others) cannot be posted to either engine: it waits here, with every receive
posted after it that could take the same messages, until a probe of one channel finds
a message for it. Sans-IO, as ``cma.protocol`` is: ``Wildcards`` decides, the caller
probes and receives (``cma.mpi.mixedio.MixedRank.match_wildcards``), and
tests/test_mixed_matching.py drives it with no MPI at all, checked against the reference
model of MPI matching that the engine's matching tests use too (tests/matching_model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .mpiapi import ANY_SOURCE, ANY_TAG

Item = TypeVar("Item")
# (source, tag) of a message a probe found, or None
Found = tuple[int, int] | None


def _matches(wanted_source: int, wanted_tag: int, source: int, tag: int) -> bool:
    return (wanted_source == source or wanted_source == ANY_SOURCE) and \
        (wanted_tag == tag or wanted_tag == ANY_TAG)


class Wildcards(Generic[Item]):
    """The receives waiting behind a wildcard receive, in the order they were posted.

    ``local(source)`` says whether a rank is on this node (its messages come through
    cma); ANY_SOURCE is on neither, as a wildcard may take from both.
    """

    def __init__(self, local: Callable[[int], bool]) -> None:
        self.local = local
        self.waiting: list[tuple[Item, int, int]] = []  # (item, source, tag), in post order
        self.cma_first = True  # which channel the next pass probes first (they alternate)

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def must_wait(self, source: int, tag: int) -> bool:
        """Whether a new receive for (source, tag) waits here: it is a wildcard over both
        channels, or a waiting receive could take a message it could take (it must not
        overtake that one)."""
        return source == ANY_SOURCE or any(
            (s == source or s == ANY_SOURCE) and (t == tag or t == ANY_TAG or tag == ANY_TAG)
            for _, s, t in self.waiting)

    def add(self, item: Item, source: int, tag: int) -> None:
        """Queue a receive of (source, tag) behind those waiting, in posted order."""
        self.waiting.append((item, source, tag))

    def remove(self, item: Item) -> bool:
        """Withdraw a waiting receive (cancelled); whether it was waiting."""
        for i, entry in enumerate(self.waiting):
            if entry[0] is item:
                del self.waiting[i]
                return True
        return False

    def owner(self, source: int, tag: int) -> Item | None:
        """The waiting receive that a message from ``source`` with ``tag`` goes to: the
        earliest posted that matches it (a probe must not report such a message)."""
        for item, s, t in self.waiting:
            if _matches(s, t, source, tag):
                return item
        return None

    def matches(self, probe: Callable[[bool, int, int], Found], probe_mpi: bool = True
                ) -> Iterator[tuple[Item, bool, int, int]]:
        """One pass over the waiting receives in post order: for each, probe its
        channels (``probe(on_cma, source, tag)``: the first message either has for it)
        and yield (item, on_cma, source, tag) when it is the earliest waiting receive
        that matches what was found. The caller takes that message for the item before
        asking for the next (the item has left the queue by then).

        ``probe_mpi=False`` probes cma's channel only (inside MPI's progress loop).
        """
        self.cma_first = not self.cma_first  # alternate: neither channel starves the other
        order = (self.cma_first, not self.cma_first)
        earlier: list[tuple[Item, int, int]] = []  # waiting receives this pass kept
        for entry in list(self.waiting):
            item, source, tag = entry
            taken = False
            for on_cma in order:
                if on_cma and not (source == ANY_SOURCE or self.local(source)):
                    continue
                if not on_cma and (not probe_mpi or self.local(source)):
                    continue
                found = probe(on_cma, source, tag)
                if found is None:
                    continue
                if any(_matches(s, t, *found) for _, s, t in earlier):
                    break  # an earlier waiting receive takes it, on a later pass
                self.waiting.remove(entry)
                taken = True
                yield item, on_cma, found[0], found[1]
                break
            if not taken:
                earlier.append(entry)

"""The classic double copy: the sender copies into a shared staging slot, the receiver copies out.

The protocol layer pipelines fragments through several slots, so while the receiver
drains slot k the sender fills slot k+1 and both processes copy at once.
"""

from __future__ import annotations

from typing import ClassVar

from .base import Copies, Transport


class ShmTransport(Transport):
    name: ClassVar[str] = "shm"
    copies: ClassVar[Copies] = Copies(user=2, kernel=0)
    styles: ClassVar[frozenset[str]] = frozenset({"staged"})

    def stage(self, slot: memoryview, fragment: memoryview) -> None:
        """Copy ``fragment`` into the shared slot (the first of the pipeline's two user copies)."""
        n = fragment.nbytes
        slot[:n] = fragment
        self.stats.count_copy(user=n)

    def drain(self, slot: memoryview, fragment: memoryview) -> None:
        """Copy the shared slot out into ``fragment`` (the second user copy)."""
        n = fragment.nbytes
        fragment[:] = slot[:n]
        self.stats.count_copy(user=n)

"""The eager path's counts behind ``Comm.stats()``.

The rings count the eager messages and bytes that cross them (no counter on the hot
path: docs/architecture.md, "Copy accounting"); what they cannot see is kept here: the
messages a rank sent itself, the copies into packets that waited for a full ring, the
doorbell and sleep system calls, and the ring counts at the last ``reset_stats()``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .channel import Inbox, Outbox
from .transports import TransportStats


class EagerCounts:
    """What the eager path moved beyond the rings' own counts, since the last reset."""

    __slots__ = ("looped_messages", "looped_bytes", "queued_copy_bytes", "control_syscalls",
                 "ring_messages_at_reset", "ring_bytes_at_reset")

    def __init__(self) -> None:
        self.looped_messages = 0  # eager messages this rank sent to itself
        self.looped_bytes = 0
        self.queued_copy_bytes = 0  # copied into a bytes object before the ring (a full ring)
        self.control_syscalls = 0  # doorbells rung, sleeps, ring pages handed back
        self.ring_messages_at_reset = 0
        self.ring_bytes_at_reset = 0

    def looped(self, nbytes: int) -> None:
        """Count an eager message this rank sent to itself (through the loopback)."""
        self.looped_messages += 1
        self.looped_bytes += nbytes

    def report(self, boxes: Iterable[Outbox | Inbox], held_bytes: int) -> TransportStats:
        """The eager path's totals: ``boxes`` are every ring end of this rank, ``held_bytes``
        the bytes the engine copied to keep messages that arrived before their receive."""
        eager = TransportStats(self.looped_messages, self.looped_bytes,
                               syscalls=self.control_syscalls)
        for box in boxes:
            eager.messages += box.eager_count
            eager.bytes += box.eager_bytes
        eager.messages -= self.ring_messages_at_reset
        eager.bytes -= self.ring_bytes_at_reset
        # a message to ourselves is copied twice here: into its packet and out of it
        eager.user_copy_bytes = eager.bytes + self.queued_copy_bytes + self.looped_bytes + held_bytes
        return eager

    def reset(self, boxes: Iterable[Outbox | Inbox]) -> None:
        """Start a new period: the rings' counts so far no longer count."""
        self.looped_messages = self.looped_bytes = 0
        self.queued_copy_bytes = self.control_syscalls = 0
        self.ring_messages_at_reset = self.ring_bytes_at_reset = 0
        for box in boxes:
            self.ring_messages_at_reset += box.eager_count
            self.ring_bytes_at_reset += box.eager_bytes

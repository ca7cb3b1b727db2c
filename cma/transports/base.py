"""The small interface every copy mechanism implements.

Modelled on Open MPI's single-copy framework and UCX's scopy transports: a transport
knows how to reach a peer and how to copy bytes; it knows nothing about matching,
eager or rendezvous, which live once in ``cma.protocol``.

Styles:

``pull``
    the receiver copies from the sender's memory (``read``); used by RGET.
``push``
    the sender copies into the receiver's memory (``write``); used by RPUT.
``staged``
    both sides copy through a shared staging area (``stage``/``drain``); used by PIPELINE.
"""

from __future__ import annotations

import errno
import mmap
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar, Generic, Protocol, TypeVar

from .._pool import ProcessPool
from ..errors import BufferError, CmaError, TransportFault, TransportUnavailable
from ..wire import Region as Region  # (re-exported: transports name it from here)


@dataclass(frozen=True)
class Copies:
    """CPU copies of each payload byte for one rendezvous message, as the mechanism is built."""

    user: int
    kernel: int

    @property
    def total(self) -> int:
        """CPU copies of each payload byte in all, user space and kernel."""
        return self.user + self.kernel


class Peer(Protocol):
    """What a transport may know about the process at the other end."""

    rank: int
    pid: int

    def fetch_fd(self, name: str) -> int:
        """A file descriptor the peer exposed under ``name``, passed over SCM_RIGHTS."""
        ...

    def take_fd(self, number: int, name: str) -> int:
        """The peer's fd ``number`` (pidfd_getfd), or failing that the one it exposed as ``name``."""
        ...


class Host(Protocol):
    """What a transport may ask of its own process's bootstrap."""

    def expose_fd(self, name: str, opener: Callable[[], int]) -> None:
        """Serve ``opener()``'s fd to verified peers that ask for ``name``."""
        ...

    def withdraw_fd(self, name: str) -> None:
        """Stop serving ``name``."""
        ...


@dataclass
class TransportStats:
    """Counters kept as copies happen (not derived from declarations).

    ``user_copy_bytes`` / ``kernel_copy_bytes`` count every byte a CPU copied in user
    space or in the kernel, so copies per message = copy bytes / payload bytes.
    """

    messages: int = 0
    bytes: int = 0
    user_copy_bytes: int = 0
    kernel_copy_bytes: int = 0
    syscalls: int = 0
    # copies may run on a background thread (overlap=True) while this one copies too
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_copy(self, *, user: int = 0, kernel: int = 0, syscalls: int = 0) -> None:
        """Add copied bytes and system calls (thread-safe: overlap's thread counts too)."""
        with self._lock:
            self.user_copy_bytes += user
            self.kernel_copy_bytes += kernel
            self.syscalls += syscalls

    def reset(self) -> None:
        """Zero the counters in place: a copy still running counts into the new period."""
        with self._lock:
            self.messages = self.bytes = self.user_copy_bytes = 0
            self.kernel_copy_bytes = self.syscalls = 0

    def as_dict(self) -> dict[str, float]:
        """What ``Comm.stats()`` shows: messages, bytes, copies per payload byte, system calls."""
        moved = self.bytes or 1
        return {
            "messages": self.messages,
            "bytes": self.bytes,
            "user_copies": self.user_copy_bytes / moved if self.bytes else 0.0,
            "kernel_copies": self.kernel_copy_bytes / moved if self.bytes else 0.0,
            "syscalls": self.syscalls,
        }


class Transport:
    """One copy mechanism. Subclasses set the class attributes and the methods of their styles."""

    name: ClassVar[str]
    copies: ClassVar[Copies]
    styles: ClassVar[frozenset[str]]
    # shown for comparison only: ``auto`` never uses it, cma-bench's ``all`` leaves it out
    teaching: ClassVar[bool] = False
    # Reaches the peer by its pid number (process_vm_*, ptrace), which the kernel gives to
    # a new process once the peer has exited: the caller checks the peer's pidfd around it.
    by_pid: ClassVar[bool] = False
    # Whether the protocol may ask this transport to ``write`` (RPUT, SPLIT's pushed half).
    # The class value is the default: True where writing needs nothing more than reading.
    writes: bool = False

    def __init__(self, host: Host, *, writes: bool | None = None, **options: object) -> None:
        """``writes``: set up to write into peers or not (None: the transport's default).

        Peers must be set up alike: a transport writes through what its peer exposed.
        """
        self.host = host
        if writes is not None:
            if writes and "push" not in self.styles:
                raise ValueError(f"{self.name} cannot write into a peer's memory")
            self.writes = writes
        self.stats = TransportStats()
        if options:
            raise TypeError(f"{self.name}: unknown options {sorted(options)}")

    def probe(self, peer: Peer) -> str | None:
        """None when usable with ``peer``, else a reason a person can act on."""
        return None

    def connect(self, peer: Peer) -> None:
        """Per-peer set-up at connect time; raises ``TransportUnavailable`` with the reason."""
        reason = self.probe(peer)
        if reason is not None:
            raise TransportUnavailable(f"transport {self.name!r} with rank {peer.rank}: {reason}")

    def disconnect(self, peer: Peer) -> None:
        """Release what ``connect`` acquired for ``peer``."""

    def close(self) -> None:
        """Release everything; the transport is not used afterwards."""

    def read(self, peer: Peer, remote: Sequence[Region], local: Sequence[memoryview]) -> None:
        """Pull: copy the concatenation of the peer's regions into the local buffers."""
        raise NotImplementedError(f"{self.name} does not pull")

    def write(self, peer: Peer, local: Sequence[memoryview], remote: Sequence[Region]) -> None:
        """Push: copy the local buffers into the concatenation of the peer's regions."""
        raise NotImplementedError(f"{self.name} does not push")

    def stage(self, slot: memoryview, fragment: memoryview) -> None:
        """Staged: copy a fragment into a staging slot shared with the peer."""
        raise NotImplementedError(f"{self.name} is not staged")

    def drain(self, slot: memoryview, fragment: memoryview) -> None:
        """Staged: copy a staging slot shared with the peer out into a fragment."""
        raise NotImplementedError(f"{self.name} is not staged")


def _local_byte_views(buffers: Sequence[memoryview], *, writable: bool, what: str) -> list[memoryview]:
    """The non-empty local buffers as flat byte views; BufferError for any a copy cannot use."""
    views = []
    for i, buf in enumerate(buffers):
        if not buf.nbytes:
            continue
        if not buf.c_contiguous:
            raise BufferError(f"{what}: local buffer {i} is not C-contiguous; pass a contiguous copy")
        if writable and buf.readonly:
            raise BufferError(f"{what}: local buffer {i} is read-only and cannot receive data")
        views.append(buf.cast("B") if buf.ndim != 1 or buf.format != "B" else buf)
    return views


# ---------------------------------------------------------------- the shared copy iteration
#
# As UCX's scopy base does (uct_scopy_ep_tx over an iov iterator): every transport that
# reaches a peer's memory copies (local spans x remote spans) through ``Transfer.run``,
# and supplies only its batch copy (one system call's worth, or one memory copy out of a
# mapping) and that call's limits; ``SplitCopy`` runs a large one on several threads.


@dataclass(frozen=True)
class BatchLimits:
    """What one call of a transport's batch copy takes: spans on each side, bytes in all."""

    local_spans: int
    remote_spans: int
    nbytes: int


# Bytes one copy call moves at most, below what the kernel would take (MAX_RW_COUNT, ~2 GiB).
# For as long as a call runs the kernel keeps the peer's memory, even after the peer died,
# and its death is noticed only between calls: 64 MiB is 7-25 ms of copying here, 1 GiB
# 0.1-0.4 s, and a call's own cost is microseconds (docs/reliability.md, "Peers killed").
CALL_BYTES = 64 << 20

# A transport's batch copy: (local views, their lengths, remote spans, their lengths),
# as many bytes on each side, within its limits -> bytes moved. The kernel may move fewer;
# a call that moves none must raise (or return 0, which the iteration turns into a fault).
_Span = TypeVar("_Span", memoryview, int)
BatchCopy = Callable[[list[memoryview], list[int], list[_Span], list[int]], int]


def _cut_view(view: memoryview, lo: int, hi: int) -> memoryview:
    return view[lo:hi]


def _cut_address(addr: int, lo: int, hi: int) -> int:
    return addr + lo


class _Cursor(Generic[_Span]):
    """A position in one side's non-empty spans, read as one stream of bytes."""

    __slots__ = ("spans", "lens", "ends", "cut", "pos", "index")

    def __init__(
        self, spans: list[_Span], lens: list[int], ends: list[int],
        cut: Callable[[_Span, int, int], _Span], pos: int,
    ) -> None:
        self.spans: list[_Span] = spans
        self.lens = lens
        self.ends = ends  # the stream position after each span: bisect finds spans
        self.cut: Callable[[_Span, int, int], _Span] = cut  # the part [lo, hi) of a span
        self.pos = pos
        self.index = bisect_right(ends, pos)  # the span holding byte ``pos``

    def take(self, count: int, limit: int) -> tuple[list[_Span], list[int], int]:
        """Up to ``count`` spans from the position, at most ``limit`` bytes: (spans, lens, total).

        Slices, not a loop per span (a datatype may bring 1024); the position stays where
        it is, since the call may move fewer bytes than it was offered.
        """
        i, pos, ends = self.index, self.pos, self.ends
        stop = min(pos + limit, ends[min(i + count, len(ends)) - 1])
        k = bisect_left(ends, stop, i) + 1  # spans[i:k] hold bytes [pos, stop)
        spans, lens = self.spans[i:k], self.lens[i:k]
        keep = lens[-1] - (ends[k - 1] - stop)  # the last span's bytes before ``stop``
        if keep != lens[-1]:
            spans[-1] = self.cut(spans[-1], 0, keep)
            lens[-1] = keep
        skip = pos - (ends[i] - self.lens[i])  # the first span's bytes already moved
        if skip:
            spans[0] = self.cut(spans[0], skip, lens[0])
            lens[0] -= skip
        return spans, lens, stop - pos

    def advance(self, nbytes: int) -> None:
        self.pos += nbytes
        self.index = bisect_right(self.ends, self.pos, self.index)


class Outcome:
    """What one run of a transfer achieved: bytes, batch calls, the error that stopped it."""

    __slots__ = ("copied", "calls", "error")

    def __init__(self) -> None:
        self.copied = 0
        self.calls = 0
        self.error: CmaError | None = None


class Transfer(Generic[_Span]):
    """One copy between local buffers and a peer's memory, each side read as one byte stream.

    The remote side is regions of the peer's address space (``Transfer(buffers, regions)``,
    spans are addresses: cma, vmfd, ptrace) or views of a mapping of the peer's memory in
    this process (``Transfer.from_views``: xmap). Built once per message, which checks both
    sides and that they hold as many bytes; ``run`` then copies a range of the stream
    through a transport's batch copy.
    """

    __slots__ = ("what", "total", "views", "view_lens", "view_ends", "remote", "remote_lens",
                 "remote_ends", "cut_remote")
    remote: list[_Span]
    cut_remote: Callable[[_Span, int, int], _Span]  # the part [lo, hi) of a remote span

    def __init__(
        self: Transfer[int], buffers: Sequence[memoryview], regions: Sequence[Region], *,
        writable: bool, what: str
    ) -> None:
        """``writable``: the copy fills the local buffers (a read), so they must take data."""
        for i, (addr, nbytes) in enumerate(regions):
            if addr < 0 or nbytes < 0 or addr + nbytes > 1 << 64:
                raise TransportFault(
                    errno.EINVAL, f"{what}: region {i} (addr {addr:#x}, {nbytes} bytes) is not valid"
                )
        self._build(buffers, [addr for addr, nbytes in regions if nbytes],
                    [nbytes for _, nbytes in regions if nbytes], _cut_address,
                    writable=writable, what=what)

    @staticmethod
    def from_views(buffers: Sequence[memoryview], sources: Sequence[memoryview], *,
                   what: str) -> Transfer[memoryview]:
        """A copy of the concatenated byte views ``sources`` into ``buffers``."""
        transfer: Transfer[memoryview] = object.__new__(Transfer)
        spans = [source for source in sources if source.nbytes]
        transfer._build(buffers, spans, [span.nbytes for span in spans], _cut_view,
                        writable=True, what=what)
        return transfer

    def _build(self, buffers: Sequence[memoryview], remote: list[_Span], remote_lens: list[int],
               cut_remote: Callable[[_Span, int, int], _Span], *, writable: bool, what: str) -> None:
        self.what = what
        self.views = _local_byte_views(buffers, writable=writable, what=what)
        self.view_lens = [view.nbytes for view in self.views]
        self.view_ends = list(accumulate(self.view_lens))
        self.remote = remote
        self.remote_lens = remote_lens
        self.remote_ends = list(accumulate(remote_lens))
        self.cut_remote = cut_remote
        self.total = self.remote_ends[-1] if self.remote_ends else 0
        local = self.view_ends[-1] if self.view_ends else 0
        if local != self.total:
            raise BufferError(
                f"{what}: the remote side holds {self.total} bytes but the local buffers "
                f"{local}; they must be equal"
            )

    def run(self, batch: BatchCopy[_Span], limits: BatchLimits, start: int = 0,
            stop: int | None = None) -> Outcome:
        """Copy bytes [start, stop) of the stream (all of it by default) batch by batch.

        Each batch is as much as ``limits`` allow from the position, which then advances by
        what the call moved. An error stops the run and is returned in the outcome rather
        than raised, so the bytes and calls before it can be counted (and parallel runs
        over other ranges finish).
        """
        stop = self.total if stop is None else stop
        outcome = Outcome()
        pos = start
        try:
            count = stop - start
            if 0 < count <= limits.nbytes and len(self.views) == 1 == len(self.remote):
                # one span a side (most messages, and each thread's range of one): one
                # call may take the range whole, without cursors
                view, span = self.views[0], self.remote[0]
                if count != self.total:
                    view, span = view[start:stop], self.cut_remote(span, start, stop)
                pos += self._call(batch, outcome, [view], [count], [span], [count])
            if pos < stop:
                local = _Cursor(self.views, self.view_lens, self.view_ends, _cut_view, pos)
                remote = _Cursor(self.remote, self.remote_lens, self.remote_ends, self.cut_remote, pos)
            while pos < stop:
                spans, rlens, nbytes = remote.take(limits.remote_spans, min(limits.nbytes, stop - pos))
                views, lens, local_bytes = local.take(limits.local_spans, nbytes)
                if local_bytes < nbytes:  # the local side ran out of spans first
                    spans, rlens, nbytes = remote.take(limits.remote_spans, local_bytes)
                moved = self._call(batch, outcome, views, lens, spans, rlens)
                pos += moved
                local.advance(moved)
                remote.advance(moved)
        except CmaError as exc:
            outcome.error = exc
        return outcome

    def _call(self, batch: BatchCopy[_Span], outcome: Outcome, views: list[memoryview],
              lens: list[int], spans: list[_Span], span_lens: list[int]) -> int:
        """One batch call, counted into ``outcome`` (a call that raises counts too): bytes moved."""
        outcome.calls += 1
        moved = batch(views, lens, spans, span_lens)
        if not moved:  # the kernel reports failure only when nothing moved; never spin
            raise TransportFault(errno.EIO, f"{self.what}: a copy call made no progress")
        outcome.copied += moved
        return moved


class SplitCopy:
    """Runs a large ``Transfer`` as page-multiple byte ranges on ``threads`` threads at once
    (this one and a pool's), for transports whose batch copy lets go of the GIL.

    A copy below ``threshold`` bytes, or with one thread, runs whole on this thread.
    """

    def __init__(self, threads: int, threshold: int, name: str) -> None:
        self.threads = threads
        self.threshold = threshold
        self._pool = ProcessPool(threads - 1, name)

    def run(self, transfer: Transfer[_Span], batch: BatchCopy[_Span], limits: BatchLimits,
            split_batch: BatchCopy[_Span] | None = None) -> list[tuple[int, Outcome]]:
        """Copy all of ``transfer``: (start, outcome) of each range, in stream order.

        ``split_batch``: the batch copy to use instead when the copy is split (one that
        lets go of the GIL, where ``batch`` is cheaper on one thread).
        """
        total = transfer.total
        if self.threads == 1 or total < self.threshold or total <= mmap.PAGESIZE:
            return [(0, transfer.run(batch, limits))]
        share = -(-total // self.threads // mmap.PAGESIZE) * mmap.PAGESIZE
        batch = split_batch or batch
        pool = self._pool.get()
        futures: list[tuple[int, Future[Outcome]]] = [
            (start, pool.submit(transfer.run, batch, limits, start, min(start + share, total)))
            for start in range(share, total, share)
        ]
        first = transfer.run(batch, limits, 0, share)
        return [(0, first), *((start, future.result()) for start, future in futures)]

    def close(self) -> None:
        """Stop the copy threads."""
        self._pool.shutdown()


@dataclass
class Registry:
    """Transport classes by name, in the order ``auto`` prefers them for large messages."""

    classes: dict[str, type[Transport]] = field(default_factory=dict)

    def add(self, cls: type[Transport]) -> type[Transport]:
        """Register a transport class under its name (usable as a class decorator)."""
        self.classes[cls.name] = cls
        return cls

    def practical(self) -> list[str]:
        """The names of every transport but the teaching ones: what ``auto`` chooses among."""
        return [name for name, cls in self.classes.items() if not cls.teaching]

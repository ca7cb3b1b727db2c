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
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar, Generic, Protocol, TypeVar

from ..errors import BufferError, CmaError, TransportFault, TransportUnavailable
from ..wire import Region as Region  # (re-exported: transports name it from here)


@dataclass(frozen=True)
class Copies:
    """CPU copies of each payload byte for one rendezvous message, as the mechanism is built."""

    user: int
    kernel: int

    @property
    def total(self) -> int:
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

    # pull: copy the concatenation of the peer's regions into the local buffers
    def read(self, peer: Peer, remote: Sequence[Region], local: Sequence[memoryview]) -> None:
        raise NotImplementedError(f"{self.name} does not pull")

    # push: copy the local buffers into the concatenation of the peer's regions
    def write(self, peer: Peer, local: Sequence[memoryview], remote: Sequence[Region]) -> None:
        raise NotImplementedError(f"{self.name} does not push")

    # staged: copy a fragment into / out of a staging slot shared with the peer
    def stage(self, slot: memoryview, fragment: memoryview) -> None:
        raise NotImplementedError(f"{self.name} is not staged")

    def drain(self, slot: memoryview, fragment: memoryview) -> None:
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
# reaches a peer's memory copies (local spans x remote regions) through ``Transfer.run``,
# and supplies only its batch copy, one system call's worth, and that call's limits.


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

# A transport's batch copy: (local views, their lengths, remote addresses, their lengths),
# as many bytes on each side, within its limits -> bytes moved. The kernel may move fewer;
# a call that moves none must raise (or return 0, which the iteration turns into a fault).
BatchCopy = Callable[[list[memoryview], list[int], list[int], list[int]], int]

_Span = TypeVar("_Span", memoryview, int)


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


class Transfer:
    """One copy between local buffers and a peer's regions, each side read as one byte stream.

    Built once per message, which checks the buffers and regions and that both sides hold
    as many bytes; ``run`` then copies a range of the stream through a transport's batch
    copy.
    """

    __slots__ = ("what", "total", "views", "view_lens", "view_ends", "addrs", "region_lens",
                 "region_ends")

    def __init__(
        self, buffers: Sequence[memoryview], regions: Sequence[Region], *, writable: bool, what: str
    ) -> None:
        """``writable``: the copy fills the local buffers (a read), so they must take data."""
        self.what = what
        self.views = _local_byte_views(buffers, writable=writable, what=what)
        self.view_lens = [view.nbytes for view in self.views]
        self.view_ends = list(accumulate(self.view_lens))
        for i, (addr, nbytes) in enumerate(regions):
            if addr < 0 or nbytes < 0 or addr + nbytes > 1 << 64:
                raise TransportFault(
                    errno.EINVAL, f"{what}: region {i} (addr {addr:#x}, {nbytes} bytes) is not valid"
                )
        self.addrs = [addr for addr, nbytes in regions if nbytes]
        self.region_lens = [nbytes for _, nbytes in regions if nbytes]
        self.region_ends = list(accumulate(self.region_lens))
        self.total = self.region_ends[-1] if self.region_ends else 0
        local = self.view_ends[-1] if self.view_ends else 0
        if local != self.total:
            raise BufferError(
                f"{what}: the remote regions hold {self.total} bytes but the local buffers "
                f"{local}; they must be equal"
            )

    def run(self, batch: BatchCopy, limits: BatchLimits, start: int = 0,
            stop: int | None = None) -> Outcome:
        """Copy bytes [start, stop) of the stream (all of it by default) batch by batch.

        Each batch is as much as ``limits`` allow from the position, which then advances by
        what the call moved. An error stops the run and is returned in the outcome rather
        than raised, so the bytes and calls before it can be counted (and parallel runs
        over other ranges finish).
        """
        stop = self.total if stop is None else stop
        local = _Cursor(self.views, self.view_lens, self.view_ends, _cut_view, start)
        remote = _Cursor(self.addrs, self.region_lens, self.region_ends, _cut_address, start)
        outcome = Outcome()
        pos = start
        try:
            while pos < stop:
                addrs, rlens, nbytes = remote.take(limits.remote_spans, min(limits.nbytes, stop - pos))
                views, lens, local_bytes = local.take(limits.local_spans, nbytes)
                if local_bytes < nbytes:  # the local side ran out of spans first
                    addrs, rlens, nbytes = remote.take(limits.remote_spans, local_bytes)
                outcome.calls += 1
                moved = batch(views, lens, addrs, rlens)
                if not moved:  # the kernel reports failure only when nothing moved; never spin
                    raise TransportFault(errno.EIO, f"{self.what}: a copy call made no progress")
                outcome.copied += moved
                pos += moved
                local.advance(moved)
                remote.advance(moved)
        except CmaError as exc:
            outcome.error = exc
        return outcome


@dataclass
class Registry:
    """Transport classes by name, in the order ``auto`` prefers them for large messages."""

    classes: dict[str, type[Transport]] = field(default_factory=dict)

    def add(self, cls: type[Transport]) -> type[Transport]:
        self.classes[cls.name] = cls
        return cls

    def practical(self) -> list[str]:
        """The names of every transport but the teaching ones: what ``auto`` chooses among."""
        return [name for name, cls in self.classes.items() if not cls.teaching]

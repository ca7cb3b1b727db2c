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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from ..errors import BufferError, TransportFault, TransportUnavailable
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


class Host(Protocol):
    """What a transport may ask of its own process's bootstrap."""

    def expose_fd(self, name: str, opener: Callable[[], int]) -> None:
        """Serve ``opener()``'s fd to verified peers that ask for ``name``."""
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


def local_byte_views(buffers: Sequence[memoryview], *, writable: bool, what: str) -> list[memoryview]:
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


def matched_total(regions: Sequence[Region], views: Sequence[memoryview], *, what: str) -> int:
    """The bytes to copy: the regions' total, each region checked, equal to the views' total."""
    for i, (addr, nbytes) in enumerate(regions):
        if addr < 0 or nbytes < 0 or addr + nbytes > 1 << 64:
            raise TransportFault(
                errno.EINVAL, f"{what}: region {i} (addr {addr:#x}, {nbytes} bytes) is not valid"
            )
    wanted = sum(region.nbytes for region in regions)
    total = sum(view.nbytes for view in views)
    if wanted != total:
        raise BufferError(
            f"{what}: the remote regions hold {wanted} bytes but the local buffers {total}; "
            "they must be equal"
        )
    return wanted


def pair_regions(
    regions: Sequence[Region], views: Sequence[memoryview], what: str
) -> list[tuple[Region, list[memoryview]]]:
    """Each non-empty region with the slices of ``views`` that hold its bytes, in order.

    The regions are checked, and must hold as many bytes as the views (``matched_total``).
    """
    matched_total(regions, views, what=what)
    pairs = []
    index, offset = 0, 0  # the next unassigned byte is views[index][offset]
    for region in regions:
        part: list[memoryview] = []
        need = region.nbytes
        while need:
            view = views[index]
            n = min(need, view.nbytes - offset)
            part.append(view[offset : offset + n] if n < view.nbytes else view)
            need -= n
            offset += n
            if offset == view.nbytes:
                index, offset = index + 1, 0
        if part:
            pairs.append((region, part))
    return pairs


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

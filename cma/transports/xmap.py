"""xmap: the receiver maps the sender's shared-heap segment and copies from it, or uses it
in place (XPMEM-like, on a stock kernel).

A send buffer in the sender's heap (``cma.empty`` and friends: memfd segments) is offered
in the RTS by place (``wire.HeapRef``: segment index, generation, offset, the fd's number
and inode). The receiver takes the segment's fd once, with ``pidfd_getfd`` where ptrace
rules allow or else from the sender's fd server (SO_PEERCRED-checked), checks its inode,
maps the whole file read-only and closes the fd, and keeps the mapping in a registration
cache (``cma.rcache``) keyed by (peer rank, pid, segment index, generation). From then on
a message costs one user copy out of the mapping (``read_heap``) and no system call, or
none at all when it is handed out in place (``map_view``, ``Comm.recv_view``).

Generations are never reused, so a mapping is never used for a segment other than the one
it was made of. The memory of a segment given back lives on while a peer maps it, so the
sender announces it (UNMAP, sent by progress from ``take_given_back``) and the receiver
drops its mappings (``forget``); a receiver that sees an index come back with a newer
generation drops the older one too, announced or not.

Not in ``REGISTRY``: it moves only heap buffers, so it is set up beside the transport a
communicator uses (the ``xmap`` option), and the protocol picks it per message.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from .. import _linux, heap
from ..errors import CmaError, TransportFault
from ..rcache import CacheStats, Lease, RegistrationCache
from ..wire import HeapRef
from .base import BatchLimits, Copies, Host, Peer, Region, SplitCopy, Transfer, Transport, TransportStats

# A copy of at least this many bytes is cut in two, one half per thread: NumPy releases
# the GIL while it copies, and one core's copy rate is below what memory gives two.
SPLIT_FROM = 4 << 20
# one copy out of the mapping: one local span from one source span, any length
LIMITS = BatchLimits(local_spans=1, remote_spans=1, nbytes=sys.maxsize)
# Mappings kept per communicator (each is one VMA; the kernel allows 65530 by default).
MAX_ENTRIES = 1024
# System calls to map a segment: pidfd_getfd, two fstat, fcntl (seals), the reservation and
# the mmap over it, close (counted as such: where ptrace rules refuse pidfd_getfd, the fd
# server's socket, connect, send, recvmsg and close come on top, uncounted).
MAP_SYSCALLS = 7
ADDRESS_LIMIT = 1 << 56  # above any user address (as protocol.ADDRESS_LIMIT): a whole space

Space = tuple[int, int, int, int]  # (peer rank, peer pid, segment index, generation)


def fd_name(index: int, generation: int) -> str:
    """The name a heap segment's fd is served under by its owner's fd server."""
    return f"heap-{index}-{generation}"


class View(np.ndarray):
    """What ``Comm.recv_view`` returns: a read-only NumPy array, of the sender's memory
    when it came through xmap (else of a fresh copy). ``release()`` (or the end of a
    ``with`` block, or garbage collection of the last array derived from it) tells the
    sender it may reuse its buffer; views and slices of it share the one release."""

    _release: Callable[[], None] | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._release = getattr(obj, "_release", None)

    def release(self) -> None:
        """Give the sender's buffer back (once; later calls do nothing). The memory stays
        mapped while this array lives, but the sender may overwrite it from now on."""
        release = self._release
        if release is not None:
            release()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class XmapStats(TransportStats):
    """xmap's copy counts and, beside them, its registration cache's."""

    def __init__(self, cache: CacheStats, views: Callable[[], int]) -> None:
        super().__init__()
        self._cache = cache
        self._views = views
        self._cache_base = (0, 0, 0, 0)

    def as_dict(self) -> dict[str, float]:
        """``TransportStats.as_dict`` plus the registration cache's counts since the last reset."""
        out = super().as_dict()
        c = self._cache
        hits, misses, evictions, invalidations = self._cache_base
        out.update(cache_hits=c.hits - hits, cache_misses=c.misses - misses,
                   cache_evictions=c.evictions - evictions,
                   cache_invalidations=c.invalidations - invalidations,
                   bytes_mapped=c.bytes_mapped, mappings=c.entries, views_held=self._views())
        return out

    def reset(self) -> None:
        """Zero the counters; the cache's counts are taken from here on."""
        super().reset()
        c = self._cache
        self._cache_base = (c.hits, c.misses, c.evictions, c.invalidations)


# Every XmapTransport of this process, for the fork hook below.
_made: weakref.WeakSet[XmapTransport] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A fork may land while the fd server's thread holds _serving (its answers dup a
    # segment's fd under it); the child has no such thread, and its close() takes the lock.
    for transport in _made:
        transport._serving = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class XmapTransport(Transport):
    name: ClassVar[str] = "xmap"
    copies: ClassVar[Copies] = Copies(user=1, kernel=0)  # 0 for a view
    styles: ClassVar[frozenset[str]] = frozenset({"map"})

    def __init__(self, host: Host, *, writes: bool | None = None, max_entries: int | None = MAX_ENTRIES,
                 max_bytes: int | None = None, threads: int = 2, **options: object) -> None:
        super().__init__(host, writes=writes, **options)
        self.cache: RegistrationCache[mmap.mmap] = RegistrationCache(
            self._map, self._unmap, max_entries=max_entries, max_bytes=max_bytes)
        self.views_held = 0
        self.stats = XmapStats(self.cache.stats, lambda: self.views_held)
        # sender: the segments offered, (index, generation) -> (inode, a read-only fd of
        # it, ranks offered to), and those given back since (appended by the heap, in any
        # thread); the fd server's thread dups the fds, under _serving
        self._offered: dict[tuple[int, int], tuple[int, int, set[int]]] = {}
        self._serving = threading.Lock()
        _made.add(self)
        self.given_back: deque[tuple[int, int]] = deque()
        # receiver: released views, (peer, msgid, leases), appended by their finalizers in
        # any thread; progress sends the FINs
        self.released: deque[tuple[int, int, list[Lease[mmap.mmap]]]] = deque()
        self._spaces: dict[tuple[int, int], Space] = {}  # (rank, index) -> its mapped space
        self._wanted: tuple[Peer, HeapRef] | None = None  # what the cache's next map is of
        # a second thread only where a second CPU may run it (cma-bench --bind pins each
        # process to one: the two halves would only take turns)
        self._split = SplitCopy(max(1, min(threads, len(os.sched_getaffinity(0)))), SPLIT_FROM,
                                "cma-xmap")
        heap.HEAP.listen(self._segment_given_back)

    # ------------------------------------------------------------ the sender's side

    def offer(self, where: heap.Location, dest: int) -> HeapRef | None:
        """The HeapRef of a send buffer at ``where`` for rank ``dest``, its segment served
        on the fd server from the first offer until it is given back; None (no XMAP) if
        the segment cannot be reopened read-only (no /proc)."""
        segment = where.segment
        key = (segment.index, segment.generation)
        offered = self._offered.get(key)
        if offered is None:
            # a read-only open of its own: what peers take (either way) maps read-only only
            try:
                read_only = _linux.reopen_read_only(segment.fd)
            except OSError:
                return None
            offered = (_linux.file_inode(read_only), read_only, set())
            with self._serving:
                self._offered[key] = offered
            self.host.expose_fd(fd_name(*key), lambda: self._serve(key))
        offered[2].add(dest)
        return HeapRef(segment.index, segment.generation, where.offset,
                       segment.file_offset + segment.size, offered[1], offered[0])

    def _serve(self, key: tuple[int, int]) -> int:
        """The fd server's opener (its thread): a dup of the segment's read-only fd."""
        with self._serving:
            offered = self._offered.get(key)
            if offered is None:
                raise CmaError(f"heap segment {key[0]} (generation {key[1]}) was given back")
            return _linux.dup_fd(offered[1])

    def _segment_given_back(self, segment: heap.Segment) -> None:
        # (under the heap's lock, maybe in another thread: only take note)
        if (segment.index, segment.generation) in self._offered:
            self.given_back.append((segment.index, segment.generation))

    def take_given_back(self) -> dict[int, list[tuple[int, int]]]:
        """Per rank, the segments offered to it and given back since the last call (for
        UNMAP); their fds are no longer served."""
        out: dict[int, list[tuple[int, int]]] = {}
        while self.given_back:
            key = self.given_back.popleft()
            with self._serving:
                offered = self._offered.pop(key, None)
            if offered is None:
                continue
            self.host.withdraw_fd(fd_name(*key))
            _linux.close_fd(offered[1])
            for rank in offered[2]:
                out.setdefault(rank, []).append(key)
        return out

    # ------------------------------------------------------------ the receiver's side

    def read_heap(self, peer: Peer, remote: Sequence[Region], refs: Sequence[HeapRef],
                  local: Sequence[memoryview]) -> None:
        """Copy the peer's heap buffers (``refs``, sized as ``remote``) into ``local``."""
        leases = [self._lease(peer, ref, region.nbytes) for region, ref in zip(remote, refs, strict=True)]
        try:
            sources = [memoryview(lease.mapping)[ref.offset : ref.offset + region.nbytes]
                       for lease, ref, region in zip(leases, refs, remote, strict=True)]
            copied = self._copy(peer, sources, local)
            for source in sources:
                source.release()
        finally:
            for lease in leases:
                lease.release()
        self.stats.count_copy(user=copied)

    def map_view(self, peer: Peer, ref: HeapRef, nbytes: int
                 ) -> tuple[np.ndarray[Any, Any], Lease[mmap.mmap]]:
        """A read-only array of the peer's ``nbytes`` at ``ref``, and the lease that keeps
        its mapping (release it once the array is given back: ``released``)."""
        lease = self._lease(peer, ref, nbytes)
        try:
            held: np.ndarray[Any, Any] = np.frombuffer(lease.mapping, np.uint8, nbytes, ref.offset)
        except BaseException:
            lease.release()
            raise
        self.views_held += 1
        return held, lease

    def hand_out(self, helds: list[np.ndarray[Any, Any]], peer: int, msgid: int,
                 leases: list[Lease[mmap.mmap]], flush: Any) -> list[View]:
        """``helds`` as Views; once each is released (explicitly, or when the last array of
        it dies), (peer, msgid, leases) is queued in ``released`` and, if the last release
        was explicit, ``flush`` is called."""
        left = [len(helds)]
        lock = threading.Lock()  # (finalizers may run in any thread)

        def one_released() -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            self.released.append((peer, msgid, leases))

        return [self._hand_out_one(held, one_released, flush) for held in helds]

    @staticmethod
    def _hand_out_one(held: np.ndarray[Any, Any], released: Callable[[], None], flush: Any) -> View:
        done = weakref.finalize(held, released)
        done.atexit = False
        flush_ref = weakref.WeakMethod(flush)  # (a bound method of the communicator's progress)

        def release() -> None:
            if done.alive:
                done()
                send = flush_ref()
                if send is not None:
                    send()

        view = held.view(View)
        view._release = release
        return view

    def view_released(self, leases: list[Lease[mmap.mmap]]) -> None:
        """A view was released: give back the mappings it held."""
        for lease in leases:
            self.views_held -= 1
            lease.release()

    def forget(self, rank: int, segments: Sequence[tuple[int, int]]) -> None:
        """``rank`` gave these (index, generation) back: drop our mappings of them."""
        for index, generation in segments:
            space = self._spaces.get((rank, index))
            if space is not None and space[3] == generation:
                del self._spaces[(rank, index)]
                self.cache.invalidate(0, ADDRESS_LIMIT, space)

    def _lease(self, peer: Peer, ref: HeapRef, nbytes: int) -> Lease[mmap.mmap]:
        if ref.offset + nbytes > ref.extent:
            raise TransportFault(0, f"xmap read from rank {peer.rank}: {nbytes} bytes at offset "
                                 f"{ref.offset} run past the segment's {ref.extent}")
        space: Space = (peer.rank, peer.pid, ref.segment, ref.generation)
        older = self._spaces.get((peer.rank, ref.segment))
        if older is not None and older != space:
            # the index came back with a newer generation (or a new process holds the
            # rank): the segment we mapped is gone, announced or not
            self.cache.invalidate(0, ADDRESS_LIMIT, older)
        self._spaces[(peer.rank, ref.segment)] = space
        self._wanted = (peer, ref)
        try:
            return self.cache.acquire(0, ref.extent, space)
        finally:
            self._wanted = None

    def _map(self, space: object, base: int, size: int) -> mmap.mmap:
        """The cache's miss: take the peer's segment fd, check it, map it whole, close it."""
        assert self._wanted is not None
        peer, ref = self._wanted
        fd = peer.take_fd(ref.fd, fd_name(ref.segment, ref.generation))
        try:
            if _linux.file_inode(fd) != ref.inode:
                raise TransportFault(0, f"xmap: rank {peer.rank}'s fd {ref.fd} is not the heap "
                                     f"segment it named (inode {ref.inode}); refusing to map it")
            if not _linux.cannot_shrink(fd):
                raise TransportFault(0, f"xmap: rank {peer.rank}'s heap segment {ref.segment} is "
                                     "not sealed against shrinking: cut short while mapped, it "
                                     "would kill this process (SIGBUS); refusing to map it")
            if _linux.file_size(fd) < size:
                raise TransportFault(0, f"xmap: rank {peer.rank}'s heap segment {ref.segment} holds "
                                     f"{_linux.file_size(fd)} bytes, not the {size} it named")
            mm = _linux.map_shared(fd, size, 0, writable=False)
        finally:
            _linux.close_fd(fd)
        self.stats.count_copy(syscalls=MAP_SYSCALLS)
        return mm

    @staticmethod
    def _unmap(mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:
            pass  # a view of it is still out there: the mapping goes with the last one

    def _copy(self, peer: Peer, sources: Sequence[memoryview], local: Sequence[memoryview]) -> int:
        """Copy the concatenation of ``sources`` into that of ``local``: bytes copied."""
        transfer = Transfer.from_views(local, sources, what=f"xmap read from rank {peer.rank}")
        # np.copyto lets go of the GIL while it copies, which a second thread needs (a
        # memoryview assignment does not, and costs less on one thread)
        ranges = self._split.run(transfer, _copy_out, LIMITS, _copy_out_nogil)
        for _, outcome in ranges:
            if outcome.error is not None:
                raise outcome.error
        return transfer.total

    # ------------------------------------------------------------ teardown

    def disconnect(self, peer: Peer) -> None:
        """Drop every mapping of ``peer``'s segments."""
        for key in [k for k in self._spaces if k[0] == peer.rank]:
            self.cache.invalidate(0, ADDRESS_LIMIT, self._spaces.pop(key))

    def close(self) -> None:
        """Stop serving this rank's segments and drop every mapping of peers' segments."""
        heap.HEAP.unlisten(self._segment_given_back)
        with self._serving:
            offered, self._offered = self._offered, {}
        for key, (_, read_only, _) in offered.items():
            self.host.withdraw_fd(fd_name(*key))
            _linux.close_fd(read_only)
        for space in list(self._spaces.values()):
            self.cache.invalidate(0, ADDRESS_LIMIT, space)
        self._spaces.clear()
        self.cache.flush()
        self._split.close()


def _copy_out(views: list[memoryview], lens: list[int], sources: list[memoryview],
              source_lens: list[int]) -> int:
    views[0][:] = sources[0]
    return lens[0]


def _copy_out_nogil(views: list[memoryview], lens: list[int], sources: list[memoryview],
                    source_lens: list[int]) -> int:
    np.copyto(np.frombuffer(views[0], np.uint8), np.frombuffer(sources[0], np.uint8))
    return lens[0]

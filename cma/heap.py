"""The shared heap: NumPy arrays whose memory lives in memfd segments that peers can map.

Arrays of up to ``LARGEST_BLOCK`` bytes are blocks of shared *slabs* (one 2 MiB
segment per block size, powers of two); larger ones get a segment of their own,
rounded to 2 MiB and advised for transparent huge pages from 2 MiB up. An array's
memory goes back to the heap when its last view is garbage-collected: a slab block
is reused, a segment of its own is given back to the kernel. Every segment mapped
in this process has an index (reused once given back) and a generation (never
reused), so a peer that cached a mapping of (index) can tell it is stale.

Heap arrays travel through ``multiprocessing`` (queues, pipes, pools) by handle: the
reducer registered with ``ForkingPickler`` sends the segment's fd and the array's
place in it, and the receiver maps the same pages. A slab block that went out this
way is never handed out again (the receiver may still be using it). Numbers and
the huge-page measurement: docs/guide.md section 5.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from . import _linux
from .errors import CmaError

# A slab is one huge page's worth (x86-64's 2 MiB), so it holds eight of the largest
# blocks; the smallest block is a cache line, so two arrays never share one. The sizes
# are chosen, not measured against others (the heap's costs: docs/guide.md section 5).
SLAB_BYTES = 2 << 20
SMALLEST_BLOCK = 64
LARGEST_BLOCK = 256 << 10  # above this an array gets a segment of its own
HUGE_PAGE = _linux.huge_page_size()
_BLOCK_TYPES = {1 << k: ctypes.c_char * (1 << k)
                for k in range(SMALLEST_BLOCK.bit_length() - 1, LARGEST_BLOCK.bit_length())}


@dataclass(frozen=True, eq=False)
class Segment:
    """One memfd mapped in this process: a slab, an array's own segment, or one imported."""

    index: int  # reused after the segment is given back
    generation: int  # never reused: (index, generation) names this mapping for good
    fd: int  # valid while the mapping lives; a peer maps the same pages through it
    address: int  # where the mapping starts in this process
    size: int  # bytes mapped
    kind: str  # "slab", "own" or "imported" (received from another process)
    file_offset: int = 0  # where the mapping starts in the file (non-zero only for imports)


@dataclass(frozen=True)
class Location:
    """Where an address lies in the heap: the segment and the byte offset in its file."""

    segment: Segment
    offset: int


class _Slab:
    __slots__ = ("segment", "mm", "block", "untouched", "free", "used", "exported", "retired")

    def __init__(self, segment: Segment, mm: mmap.mmap, block: int) -> None:
        self.segment = segment
        self.mm: mmap.mmap | None = mm  # dropped when retired; live blocks keep the mapping alive
        self.block = block
        self.untouched = 0  # blocks from here on were never handed out (still zero)
        self.free: list[int] = []  # blocks handed out and returned
        self.used = 0
        self.exported: set[int] = set()  # blocks whose handle went to another process
        self.retired = False  # no block is handed out of it again


class Heap:
    """The allocator behind ``cma.empty`` and friends; one per process (``HEAP``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._starts: list[int] = []  # segment addresses, sorted
        self._segments: list[Segment] = []  # in the same order
        self._slabs: dict[int, _Slab] = {}  # by segment index
        self._partial: dict[int, list[_Slab]] = {}  # by block size: slabs with a free block
        self._slab_count: dict[int, int] = {}  # by block size: slabs not retired
        self._free_indices: list[int] = []
        self._next_index = 0
        self._generations = itertools.count(1)
        # told of every segment of ours (not imported) given back, under the lock and in
        # any thread: xmap announces them to the peers that mapped them
        self._listeners: list[Callable[[Segment], None]] = []

    # ------------------------------------------------------------ locking
    # A finalizer can run in any thread, at any allocation, even inside a locked
    # section of this thread: if the lock is taken it leaves its work in _pending,
    # which whoever holds the lock does before letting go.

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._drain()
            yield
            self._drain()

    def _drain(self) -> None:
        while self._pending:
            func, args = self._pending.pop()
            func(*args)

    def _finalized(self, func: Callable[..., None], *args: Any) -> None:
        if self._lock.acquire(blocking=False):
            try:
                func(*args)
                self._drain()
            finally:
                self._lock.release()
        else:
            self._pending.append((func, args))

    # ------------------------------------------------------------ segments

    def _add_segment(self, fd: int, mm: mmap.mmap, kind: str, file_offset: int = 0) -> Segment:
        """Enter a new mapping; ``fd`` (its file) is closed once the mapping is gone."""
        if self._free_indices:
            index = self._free_indices.pop()
        else:
            index = self._next_index
            self._next_index += 1
        address = _linux.local_address(memoryview(mm))
        segment = Segment(index, next(self._generations), fd, address, len(mm), kind, file_offset)
        # An entry still overlapping is a mapping the kernel has already undone (it gave
        # the address out again) whose finalizer has not run yet: drop it now.
        end = address + len(mm)
        lo = bisect.bisect_left(self._starts, address)
        while lo and self._segments[lo - 1].address + self._segments[lo - 1].size > address:
            lo -= 1
        hi = bisect.bisect_left(self._starts, end)
        del self._starts[lo:hi], self._segments[lo:hi]
        self._starts.insert(lo, address)
        self._segments.insert(lo, segment)
        weakref.finalize(mm, self._finalized, self._forget, segment).atexit = False
        return segment

    def _forget(self, segment: Segment) -> None:
        """The segment's mapping is gone: close its fd, drop its entry and index."""
        _linux.close_fd(segment.fd)
        i = bisect.bisect_left(self._starts, segment.address)
        if i < len(self._segments) and self._segments[i] is segment:
            del self._starts[i], self._segments[i]
        self._slabs.pop(segment.index, None)
        self._free_indices.append(segment.index)
        if segment.kind != "imported":
            for listener in self._listeners:
                listener(segment)

    def listen(self, listener: Callable[[Segment], None]) -> None:
        """Call ``listener(segment)`` for each segment of ours given back from now on: it
        runs under the heap's lock, maybe in another thread, so it must only take note."""
        with self._locked():
            self._listeners.append(listener)

    def unlisten(self, listener: Callable[[Segment], None]) -> None:
        """Stop calling ``listener`` (one ``listen`` registered); nothing if it is not listening."""
        with self._locked():
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _new_segment(self, nbytes: int, kind: str) -> tuple[Segment, mmap.mmap]:
        # sealed against shrinking: a peer that maps it (xmap) can rely on every page
        fd = _linux.memfd_segment("cma-heap", nbytes, sealed=True)
        try:
            mm = _linux.map_shared(fd, nbytes)
        except BaseException:
            _linux.close_fd(fd)
            raise
        if nbytes >= HUGE_PAGE:
            _linux.advise_huge_pages(mm)
        return self._add_segment(fd, mm, kind), mm

    def locate(self, address: int) -> Location | None:
        """The segment holding ``address`` and the offset in its file, if it is in the heap."""
        with self._lock:  # _locked() written out: every array multiprocessing pickles comes here
            if self._pending:
                self._drain()
            return self._locate(address)

    def _locate(self, address: int) -> Location | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        segment = self._segments[i]
        if address >= segment.address + segment.size:
            return None
        return Location(segment, segment.file_offset + address - segment.address)

    # ------------------------------------------------------------ allocation

    def allocate(self, nbytes: int) -> tuple[Any, bool]:
        """A buffer of at least ``nbytes`` in the heap, and whether it is fresh (all zeros)."""
        with self._locked():
            if nbytes > LARGEST_BLOCK:
                size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE if nbytes >= HUGE_PAGE else \
                    -(-nbytes // _linux.PAGE_SIZE) * _linux.PAGE_SIZE
                return self._new_segment(size, "own")[1], True
            return self._allocate_block(max(SMALLEST_BLOCK, 1 << (nbytes - 1).bit_length()))

    def _allocate_block(self, block: int) -> tuple[ctypes.Array[ctypes.c_char], bool]:
        partial = self._partial.setdefault(block, [])
        if not partial:
            slab = _Slab(*self._new_segment(SLAB_BYTES, "slab"), block)
            self._slabs[slab.segment.index] = slab
            self._slab_count[block] = self._slab_count.get(block, 0) + 1
            partial.append(slab)
        slab = partial[-1]
        fresh = not slab.free
        if fresh:
            i = slab.untouched
            slab.untouched += 1
        else:
            i = slab.free.pop()
        slab.used += 1
        if not slab.free and slab.untouched == SLAB_BYTES // block:
            partial.pop()
        assert slab.mm is not None  # a retired slab is never in _partial
        token = _BLOCK_TYPES[block].from_buffer(slab.mm, i * block)
        weakref.finalize(token, self._finalized, self._free_block, slab, i).atexit = False
        return token, fresh

    def _free_block(self, slab: _Slab, i: int) -> None:
        slab.used -= 1
        if slab.retired:
            return
        if i not in slab.exported:
            if not slab.free and slab.untouched == SLAB_BYTES // slab.block:  # it was full
                self._partial[slab.block].append(slab)
            slab.free.append(i)
        # keep one slab per block size for the next allocation; give back the others
        if slab.used == 0 and (slab.exported or self._slab_count[slab.block] > 1):
            self._retire(slab)

    def _retire(self, slab: _Slab) -> None:
        slab.retired = True
        partial = self._partial[slab.block]
        if slab in partial:
            partial.remove(slab)
        self._slab_count[slab.block] -= 1
        slab.mm = None  # unmapped (and its fd closed) once its last block is gone

    def trim(self) -> int:
        """Give back the empty slabs kept for the next allocations; how many."""
        with self._locked():
            empty = [slab for slab in self._slabs.values() if slab.used == 0 and not slab.retired]
            for slab in empty:
                self._retire(slab)
            return len(empty)

    def exported(self, location: Location) -> None:
        """A handle to the memory at ``location`` went to another process: never reuse it."""
        with self._locked():
            slab = self._slabs.get(location.segment.index)
            if slab is not None and slab.segment is location.segment:
                slab.exported.add(location.offset // slab.block)

    def imported(self, fd: int, start: int, length: int, writable: bool = True) -> mmap.mmap:
        """Map ``[start, start + length)`` of another process's segment (``start`` page-aligned),
        read-only unless ``writable``; the heap owns ``fd`` from here on, and closes it when
        the mapping is gone."""
        try:
            _linux.close_on_exec([fd])  # fds received over SCM_RIGHTS arrive inheritable
            size = _linux.file_size(fd)
            if start + length > size:
                raise CmaError(f"a heap handle names bytes [{start}, {start + length}) of a segment "
                               f"of {size} bytes: it does not come from a cma heap, or was altered")
            mm = _linux.map_shared(fd, length, start, writable)
        except BaseException:
            _linux.close_fd(fd)
            raise
        with self._locked():
            self._add_segment(fd, mm, "imported", start)
        return mm

    # ------------------------------------------------------------ fork

    def _before_fork(self) -> None:
        self._lock.acquire()

    def _after_fork_in_parent(self) -> None:
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        """The child shares the parent's slabs: it must not hand out their free blocks too."""
        self._lock = threading.Lock()
        self._pending.clear()
        self._listeners.clear()  # (the parent's communicators, which the child cannot use)
        with self._locked():  # dropping a mapping may run a finalizer: it waits for the lock
            for slab in self._slabs.values():
                slab.retired = True
                slab.mm = None
            self._partial.clear()
            self._slab_count.clear()


HEAP = Heap()
os.register_at_fork(before=HEAP._before_fork, after_in_parent=HEAP._after_fork_in_parent,
                    after_in_child=HEAP._after_fork_in_child)


# ---------------------------------------------------------------- the public functions

def _shape_tuple(shape: int | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
    if min(dims, default=0) < 0:
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return dims


def empty(shape: int | tuple[int, ...] | list[int], dtype: DTypeLike = float,
          order: str = "C") -> np.ndarray[Any, Any]:
    """A new uninitialised array in the shared heap (``numpy.empty``'s arguments)."""
    return _new(shape, dtype, order, zero=False)


def zeros(shape: int | tuple[int, ...] | list[int], dtype: DTypeLike = float,
          order: str = "C") -> np.ndarray[Any, Any]:
    """A new array of zeros in the shared heap (``numpy.zeros``'s arguments)."""
    return _new(shape, dtype, order, zero=True)


def empty_like(a: Any, dtype: DTypeLike | None = None) -> np.ndarray[Any, Any]:
    """An uninitialised heap array of ``a``'s shape and dtype, Fortran-ordered if ``a`` is."""
    arr = np.asarray(a)
    order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
    return _new(arr.shape, arr.dtype if dtype is None else dtype, order, zero=False)


def alloc(nbytes: int) -> np.ndarray[Any, Any]:
    """``nbytes`` uninitialised bytes in the shared heap, as a 1-D ``uint8`` array."""
    return _new(nbytes, np.uint8, "C", zero=False)


def _new(shape: int | tuple[int, ...] | list[int], dtype: DTypeLike, order: str,
         zero: bool) -> np.ndarray[Any, Any]:
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    dims = _shape_tuple(shape)
    kind = np.dtype(dtype)
    if kind.hasobject:
        raise TypeError(f"dtype {kind} holds Python objects, whose pointers mean nothing to "
                        "another process; the shared heap takes fixed-size values only")
    buffer, fresh = HEAP.allocate(math.prod(dims) * kind.itemsize)
    arr: np.ndarray[Any, Any] = np.ndarray(dims, kind, buffer=buffer, order="F" if order == "F" else "C")
    if zero and not fresh:
        arr.fill(0)
    return arr


def _as_array(obj: Any) -> np.ndarray[Any, Any]:
    return obj if isinstance(obj, np.ndarray) else np.asarray(memoryview(obj))


def _extent(arr: Any) -> tuple[int, int, int]:
    """(lowest address, one past the highest, address of the first element) of an array."""
    flags = arr.flags
    if flags.c_contiguous and flags.writeable and arr.nbytes:
        start = _linux.local_address(memoryview(arr))  # ~6x faster than __array_interface__
        return start, start + arr.nbytes, start
    start = arr.__array_interface__["data"][0]
    lo = hi = start
    for n, stride in zip(arr.shape, arr.strides, strict=True):
        if n == 0:
            return start, start, start
        if stride < 0:
            lo += stride * (n - 1)
        else:
            hi += stride * (n - 1)
    return lo, hi + arr.itemsize, start


def is_shared(obj: Any) -> bool:
    """Whether an array (or the buffer an object exports) lies in the shared heap."""
    return locate(obj) is not None


def locate(obj: Any) -> Location | None:
    """Where an array's memory lies in the heap (segment, offset, generation), or ``None``.

    ``None`` too when the array reaches past the end of its segment.
    """
    if obj.__class__ is memoryview and obj.c_contiguous and obj.nbytes:
        # (a message's bytes, as the senders hold them: 4 us through an array, ~1 without)
        lo = _linux.local_address(obj)
        hi = lo + obj.nbytes
    else:
        lo, hi, _ = _extent(_as_array(obj))
    found = HEAP.locate(lo)
    if found is None or hi - lo > found.segment.size - (lo - found.segment.address):
        return None
    return found


# ---------------------------------------------------------------- multiprocessing

def _reduce_ndarray(arr: np.ndarray[Any, Any]) -> Any:
    """Pickle a heap array as (its segment's fd, its place); any other array by value."""
    lo, hi, start = _extent(arr)
    found = HEAP.locate(lo) if hi > lo else None
    if found is None or hi - lo > found.segment.size - (lo - found.segment.address):
        return arr.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    HEAP.exported(found)
    segment = found.segment
    base = segment.file_offset - segment.address  # address -> offset in the file
    return _rebuild_ndarray, (reduction.DupFd(segment.fd), lo + base, hi + base, start + base,
                              arr.shape, arr.strides, arr.dtype, bool(arr.flags.writeable))


def _rebuild_ndarray(dup: Any, lo: int, hi: int, start: int, shape: tuple[int, ...],
                     strides: tuple[int, ...], dtype: np.dtype[Any], writeable: bool
                     ) -> np.ndarray[Any, Any]:
    first = lo - lo % mmap.ALLOCATIONGRANULARITY
    mm = HEAP.imported(dup.detach(), first, hi - first)
    arr: np.ndarray[Any, Any] = np.ndarray(shape, dtype, buffer=mm, offset=start - first,
                                           strides=strides)
    arr.flags.writeable = writeable
    return arr


reduction.ForkingPickler.register(np.ndarray, _reduce_ndarray)

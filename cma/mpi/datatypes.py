"""MPI datatypes with gaps (vector, indexed, struct, subarray, resized, pair types) as the
contiguous byte blocks cma moves.

A datatype is decoded once (``Datatype.decode``, i.e. MPI_Type_get_envelope/contents) into
its blocks, kept per datatype object. A message of ``count`` elements of it becomes a
``Typed`` buffer: NumPy gathers its blocks into one packet (eager sends) and scatters a
packet straight into them (receives), block by block in type-map order as MPI_Pack does;
above the eager limit a sender with few, large blocks offers them as one iovec (no pack
copy), and a receiver with few, large blocks takes them the same way. docs/mpi.md,
"Datatypes with gaps", says which path a message takes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from mpi4py import MPI

from ..protocol import slice_views

# Above the eager limit, blocks are offered as an iovec (each a view the transport copies
# into or out of) only when they are few and large: a view and its address cost ~1 µs
# each, which a pack or unpack copy repays for blocks of a few KiB (docs/mpi.md).
IOVEC_MAX_BLOCKS = 1024  # one process_vm_readv (IOV_MAX)
IOVEC_MIN_BLOCK = 16 << 10

# Predefined pair types whose two fields leave a gap (MPI_SHORT_INT: short, pad, int):
# their layout is C's, as NumPy's aligned structs give it.
_PAIRS = {"SHORT_INT": "i2", "LONG_DOUBLE_INT": "g", "DOUBLE_INT": "f8", "LONG_INT": "i8",
          "FLOAT_INT": "f4"}


def byte_array(data: Any) -> np.ndarray:
    """``data``'s bytes as a uint8 array, no copy (an empty array for no bytes)."""
    view = memoryview(data)
    return np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.zeros(0, np.uint8)


@functools.lru_cache(maxsize=64)
def pair_datatype(dtype: np.dtype) -> MPI.Datatype | None:
    """The predefined pair type (``MPI.DOUBLE_INT``, ...) laid out as ``dtype``, a
    structured dtype of (value, index) fields in C's layout, as cma's MINLOC and MAXLOC
    take them; None for any other dtype (mpi4py maps NumPy's own dtypes, not these)."""
    fields = dtype.fields
    if fields is None or len(fields) != 2:
        return None
    laid_out = [fields[name][:2] for name in dtype.names or ()]
    for name, code in {**_PAIRS, "TWOINT": "i4"}.items():
        pair = np.dtype([("value", code), ("index", "i4")], align=True)
        assert pair.fields is not None
        if laid_out == [pair.fields["value"][:2], pair.fields["index"][:2]] \
                and dtype.itemsize == pair.itemsize:
            return getattr(MPI, name, None)
    return None


class Layout:
    """One element of a datatype: its blocks (byte offset, length) in type-map order,
    adjacent ones merged, and its extent."""

    __slots__ = ("offsets", "lengths", "lb", "extent", "size", "true_lb", "true_ub", "plans",
                 "__weakref__")

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, datatype: MPI.Datatype) -> None:
        self.offsets, self.lengths = _merge(offsets, lengths)
        self.lb, self.extent = datatype.Get_extent()
        self.size = datatype.Get_size()
        true_lb, true_extent = datatype.Get_true_extent()
        self.true_lb, self.true_ub = true_lb, true_lb + true_extent
        self.plans: dict[tuple[int, int], Plan] = {}  # (count, displ) -> Plan, a few kept

    @property
    def contiguous(self) -> bool:
        """Elements are gap-free and follow each other (a count of them is one block)."""
        return len(self.lengths) <= 1 and self.size == self.extent and \
            (not self.size or int(self.offsets[0]) == 0)

    def plan(self, count: int, displ: int) -> Plan:
        """The ``Plan`` of ``count`` elements from element ``displ`` (a few kept for reuse)."""
        key = (count, displ)
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= 8:  # halo exchanges reuse a few; anything else recomputes
                self.plans.clear()
            plan = self.plans[key] = Plan(self, count, displ)
        return plan


class Plan:
    """Where the bytes of ``count`` elements at element ``displ`` of a buffer are: blocks
    (start, length) in message order, grouped by length for NumPy to copy."""

    __slots__ = ("starts", "lengths", "nbytes", "lowest", "highest", "groups", "last")

    def __init__(self, layout: Layout, count: int, displ: int) -> None:
        origin = displ * layout.extent
        per = np.arange(count, dtype=np.int64) * layout.extent + origin
        starts = (per[:, None] + layout.offsets[None, :]).ravel()
        lengths = np.tile(layout.lengths, count)
        self.starts, self.lengths = _merge(starts, lengths)
        self.nbytes = int(self.lengths.sum())
        if count and len(self.lengths):
            self.lowest = origin + layout.true_lb
            self.highest = origin + (count - 1) * layout.extent + layout.true_ub
        else:
            self.lowest = self.highest = 0
        packed = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        self.groups = [Group(int(length), self.starts[self.lengths == length],
                             packed[self.lengths == length]) for length in np.unique(self.lengths)]
        self.last: Typed | None = None  # the last Typed made of it, for a buffer used again

    def check(self, nbytes: int) -> None:
        """Raise ``ValueError`` if the blocks reach outside a buffer of ``nbytes`` (as MPI leaves
        undefined)."""
        if self.lowest < 0 or self.highest > nbytes:
            raise ValueError(f"message: the datatype reaches bytes {self.lowest}..{self.highest} "
                             f"of a {nbytes}-byte buffer")

    @property
    def single(self) -> bool:
        """Whether the bytes are one block (then a plain view, no packing)."""
        return len(self.lengths) == 1

    def few_large_blocks(self) -> bool:
        """Whether the blocks go as one iovec: at most IOVEC_MAX_BLOCKS, averaging IOVEC_MIN_BLOCK bytes."""
        n = len(self.lengths)
        return n <= IOVEC_MAX_BLOCKS and self.nbytes >= IOVEC_MIN_BLOCK * n


class Group:
    """The blocks of one length: their starts in the buffer and in the packet. Where they
    form a grid (first + sum of i_k * stride_k, as vectors and subarrays do) and follow
    each other in the packet, NumPy copies them as one strided array, in words as wide
    as the length allows; otherwise block by block, as overlapping records."""

    __slots__ = ("length", "starts", "packed", "record", "grid", "word", "words")

    def __init__(self, length: int, starts: np.ndarray, packed: np.ndarray) -> None:
        self.length = length
        self.starts = starts
        self.packed = packed
        self.record = np.dtype((np.void, length))
        in_order = len(packed) > 0 and packed[0] == 0 and bool((np.diff(packed) == length).all())
        self.grid = _grid(starts) if in_order else None
        # One element per block where NumPy copies that fast (a machine word, or a short
        # record: ~1 and ~3 ns a block); longer blocks as rows of words, as a row of a
        # few words costs ~7 ns of loop overhead (docs/mpi.md, "Datatypes with gaps").
        if length in (1, 2, 4, 8):
            self.word, self.words = np.dtype(f"u{length}"), 0
        elif length <= 64:
            self.word, self.words = self.record, 0
        else:
            width = next(w for w in (8, 4, 2, 1) if length % w == 0)
            self.word, self.words = np.dtype(f"u{width}"), length // width

    def view(self, base: np.ndarray) -> np.ndarray:
        """The group's blocks in ``base``: a strided array over the grid (of words per
        block, for long blocks), or ``base`` as overlapping records (to index with
        ``starts``)."""
        if self.grid is None:
            return _records(base, self.record)
        first, shape, strides = self.grid
        if self.words:
            shape, strides = (*shape, self.words), (*strides, self.word.itemsize)
        return np.ndarray(shape=shape, dtype=self.word, buffer=base, offset=first, strides=strides)

    def gather(self, blocks: np.ndarray, out: np.ndarray) -> None:
        """Copy this group's blocks (``blocks``: its view of the buffer) into the packet ``out``."""
        if self.grid is not None:
            np.copyto(self.packed_view(out, blocks), blocks)
        else:
            _records(out, self.record)[self.packed] = blocks[self.starts]

    def scatter(self, packet: np.ndarray, blocks: np.ndarray) -> None:
        """Copy this group's bytes of ``packet`` into its blocks (``blocks``: its view of the buffer)."""
        if self.grid is not None:
            np.copyto(blocks, self.packed_view(packet, blocks))
        else:
            blocks[self.starts] = _records(packet, self.record)[self.packed]

    def packed_view(self, packet: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """The group's bytes at the start of ``packet``, shaped as its blocks."""
        return packet[: len(self.starts) * self.length].view(self.word).reshape(blocks.shape)


def _grid(starts: np.ndarray, depth: int = 4) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """(first, shape, strides) with starts == first + sum(i_k * strides[k]) in C order over
    ``shape``, up to ``depth`` dimensions; None when the starts form no such grid."""
    n = len(starts)
    if n == 0:
        return None
    first = int(starts[0])
    if n == 1:
        return first, (1,), (0,)
    steps = np.diff(starts)
    stride = int(steps[0])
    breaks = np.flatnonzero(steps != stride)
    inner = n if not len(breaks) else int(breaks[0]) + 1
    if n % inner:
        return None
    rows = starts.reshape(n // inner, inner)
    if not (rows - rows[:, :1] == rows[0] - first).all():
        return None
    if n == inner:
        return first, (inner,), (stride,)
    if depth == 1:
        return None
    outer = _grid(rows[:, 0], depth - 1)
    if outer is None:
        return None
    return first, (*outer[1], inner), (*outer[2], stride)


def _records(array: np.ndarray, record: np.dtype) -> np.ndarray:
    """``array``'s bytes as overlapping records of ``record.itemsize`` bytes, one at every
    byte: indexing it with block starts copies whole blocks, one memcpy each."""
    return np.ndarray(shape=(max(array.nbytes - record.itemsize + 1, 0),), dtype=record,
                      buffer=array, strides=(1,))


def _merge(offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty blocks and join each block to the one before it when they touch."""
    keep = lengths > 0
    offsets, lengths = offsets[keep].astype(np.int64), lengths[keep].astype(np.int64)
    if len(offsets) < 2:
        return offsets, lengths
    new = np.empty(len(offsets), dtype=bool)
    new[0] = True
    new[1:] = offsets[1:] != offsets[:-1] + lengths[:-1]
    group = np.cumsum(new) - 1
    return offsets[new], np.bincount(group, weights=lengths).astype(np.int64)


# ------------------------------------------------------------------ decoding

def _blocks(datatype: MPI.Datatype) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of one element of ``datatype``, in type-map order."""
    base, combiner, params = datatype.decode()
    try:
        if combiner == "NAMED":
            return _named_blocks(datatype)
        if combiner in ("DUP", "RESIZED"):  # (RESIZED changes lb and extent only)
            return _blocks(base)
        ext = base.Get_extent()[1] if combiner != "STRUCT" else 0  # (a struct has no one base)
        if combiner == "CONTIGUOUS":
            return _place(base, [0], [params["count"]])
        if combiner in ("VECTOR", "HVECTOR"):
            stride = params["stride"] * (ext if combiner == "VECTOR" else 1)
            count = params["count"]
            return _place(base, np.arange(count) * stride, np.full(count, params["blocklength"]))
        if combiner in ("INDEXED", "HINDEXED", "INDEXED_BLOCK", "HINDEXED_BLOCK"):
            displs = np.asarray(params["displacements"], dtype=np.int64)
            if not combiner.startswith("H"):
                displs = displs * ext
            if "blocklengths" in params:
                counts = np.asarray(params["blocklengths"], dtype=np.int64)
            else:
                counts = np.full(len(displs), params["blocklength"], dtype=np.int64)
            return _place(base, displs, counts)
        if combiner == "STRUCT":
            parts = [_place(member, [displ], [n]) for n, displ, member in
                     zip(params["blocklengths"], params["displacements"], params["datatypes"],
                         strict=True)]
            if not parts:
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        if combiner == "SUBARRAY":
            sizes, subsizes, starts = params["sizes"], params["subsizes"], params["starts"]
            if params["order"] == MPI.ORDER_FORTRAN:
                sizes, subsizes, starts = sizes[::-1], subsizes[::-1], starts[::-1]
            strides = np.cumprod([1, *sizes[:0:-1]])[::-1] * ext
            rows = np.zeros(1, dtype=np.int64)  # starts of the runs along the last dimension
            for stride, sub, first in zip(strides[:-1], subsizes[:-1], starts[:-1], strict=True):
                rows = (rows[:, None] + (np.arange(sub) + first)[None, :] * stride).ravel()
            return _place(base, rows + starts[-1] * ext, np.full(len(rows), subsizes[-1]))
    finally:
        _free_decoded(base, combiner, params)
    raise NotImplementedError(
        f"cma.mpi.Comm cannot yet move a {combiner} datatype to on-node peers "
        "(pack it with datatype.Pack, or set CMA_MPI_DISABLE=1)")


def _named_blocks(datatype: MPI.Datatype) -> tuple[np.ndarray, np.ndarray]:
    size = datatype.Get_size()
    true_lb, true_extent = datatype.Get_true_extent()
    if size == true_extent:
        return np.array([true_lb], np.int64), np.array([size], np.int64)
    for name, code in _PAIRS.items():
        if datatype == getattr(MPI, name, MPI.DATATYPE_NULL):
            fields = np.dtype([("value", code), ("index", "i4")], align=True).fields
            assert fields is not None
            return (np.array([fields["value"][1], fields["index"][1]], np.int64),
                    np.array([fields["value"][0].itemsize, 4], np.int64))
    raise NotImplementedError(f"cma.mpi.Comm cannot move the predefined datatype {datatype} "
                              "to on-node peers (set CMA_MPI_DISABLE=1)")


def _place(base: MPI.Datatype, starts: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """The blocks of runs of ``counts[i]`` consecutive ``base`` elements from byte
    ``starts[i]``, in order. A run of a gap-free base is one block: a subarray of a
    million doubles in 40 rows decodes as 40 blocks, not a million."""
    offsets, lengths = _blocks(base)
    ext = base.Get_extent()[1]
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if len(offsets) == 1 and lengths[0] == ext:
        return starts + offsets[0], counts * lengths[0]
    total = int(counts.sum())
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    elements = np.repeat(starts, counts) + within * ext
    return ((elements[:, None] + offsets[None, :]).ravel(), np.tile(lengths, len(elements)))


def _free_decoded(base: MPI.Datatype, combiner: str, params: dict[str, Any]) -> None:
    """decode() hands out new handles of derived member types: free them (not named ones)."""
    if combiner == "NAMED":
        return
    members = params["datatypes"] if combiner == "STRUCT" else [base]
    for member in members:
        if not member.is_predefined:
            member.Free()


# datatype object -> its Layout; an object freed (or collected) leaves the cache
_LAYOUTS: dict[int, tuple[int, Layout]] = {}


def layout(datatype: MPI.Datatype) -> Layout:
    """The decoded blocks of ``datatype``, kept while the object lives with the same handle."""
    key = id(datatype)
    entry = _LAYOUTS.get(key)
    handle = datatype.handle
    if entry is not None and entry[0] == handle:
        return entry[1]
    if handle == MPI.DATATYPE_NULL.handle:
        raise ValueError("message: the datatype is MPI.DATATYPE_NULL (freed?)")
    found = Layout(*_blocks(datatype), datatype)
    _LAYOUTS[key] = (handle, found)
    if not datatype.is_predefined:
        weakref.finalize(datatype, _LAYOUTS.pop, key, None)
    return found


class Typed:
    """A buffer spec's elements of a datatype with gaps: what cma moves for it.

    Receives copy eager packets into it (``typed[:n] = packet``) and ask it for the views
    a rendezvous copies into (``segments``); a receive whose blocks are many takes the
    message whole into ``staging`` and scatters it from there once complete (``finish``).
    Two receives into one buffer at once are erroneous in MPI; here they would share it.
    """

    __slots__ = ("plan", "owner", "base", "blocks", "nbytes", "readonly", "staging", "kept",
                 "grid")

    def __init__(self, plan: Plan, owner: Any, base: np.ndarray) -> None:
        self.plan = plan
        self.owner = owner  # the buffer object given: the same one again reuses this
        self.base = base  # the whole buffer, as bytes
        self.blocks = [group.view(base) for group in plan.groups]
        self.nbytes = plan.nbytes
        self.readonly = not base.flags.writeable
        self.staging: np.ndarray | None = None
        # may be kept for the next call with this buffer (not a resizable one: see _KEPT)
        self.kept = owner.__class__ in _KEPT
        only = plan.groups[0] if len(plan.groups) == 1 else None
        # (one group on a grid: the common case, copied without a Python step per group)
        self.grid = (self.blocks[0], only.word) if only is not None and only.grid is not None \
            else None

    def __setitem__(self, cut: slice, packet: Any) -> None:
        grid = self.grid
        if grid is not None and len(packet) == self.nbytes:
            blocks, word = grid
            np.copyto(blocks, np.frombuffer(packet, dtype=word).reshape(blocks.shape))
            return
        self.scatter(np.frombuffer(packet, dtype=np.uint8))

    def __bytes__(self) -> bytes:
        return self.pack().tobytes()

    def pack(self) -> memoryview:
        """A packed copy, blocks back to back in type-map order (as MPI_Pack gives)."""
        if self.grid is not None:
            return self.grid[0].copy().reshape(-1).view(np.uint8).data  # (one allocation and copy)
        groups = self.plan.groups
        out = np.empty(self.nbytes, dtype=np.uint8)
        for group, blocks in zip(groups, self.blocks, strict=True):
            group.gather(blocks, out)
        return out.data

    def scatter(self, packet: np.ndarray) -> None:
        """Copy ``packet``'s bytes (as many as it has) into the blocks, in order."""
        n = packet.nbytes
        if n == self.nbytes:
            for group, blocks in zip(self.plan.groups, self.blocks, strict=True):
                group.scatter(packet, blocks)
            return
        # a shorter message fills the first blocks and part of one
        done = 0
        base = self.base
        for start, length in zip(self.plan.starts.tolist(), self.plan.lengths.tolist(), strict=True):
            take = min(length, n - done)
            if take <= 0:
                break
            base[start : start + take] = packet[done : done + take]
            done += take

    def views(self) -> list[memoryview]:
        """One memoryview per block of the buffer, in message order (a rendezvous's iovec)."""
        base = self.base.data
        return [base[start : start + length]
                for start, length in zip(self.plan.starts.tolist(), self.plan.lengths.tolist(),
                                         strict=True)]

    def segments(self, nbytes: int) -> list[memoryview]:
        """Where a rendezvous of ``nbytes`` lands: the blocks, or one staging area."""
        if self.plan.few_large_blocks():
            return slice_views(self.views(), 0, nbytes)
        self.staging = np.empty(nbytes, dtype=np.uint8)
        return [self.staging.data]

    def finish(self) -> None:
        """A rendezvous into the staging area is complete: scatter it."""
        if self.staging is not None:
            staging, self.staging = self.staging, None
            self.scatter(staging)


class ElementRows:
    """Whole elements of a datatype, each one row of a buffer's words and its blocks
    columns of that row: a pack is one NumPy take over the rows, an unpack one
    assignment. (Typed copies block by block: a 1 MiB vector of int64s, two of every
    three, packed in 1.3 ms that way, in 0.09 ms so; docs/mpi.md, "Semantics and
    limits", has the runs.)"""

    __slots__ = ("rows", "columns")

    def __init__(self, rows: np.ndarray, columns: np.ndarray) -> None:
        self.rows, self.columns = rows, columns

    @classmethod
    def of(cls, found: Layout, elements: int, base: np.ndarray) -> ElementRows | None:
        """The rows of ``elements`` elements from the start of ``base`` (a buffer's
        bytes); None where they are not rows (an element reaching past its extent, or
        the last one past the buffer)."""
        extent = found.extent
        if not elements or elements * extent > base.nbytes:
            return None
        shape = _ROW_SHAPES.get(found)
        if shape is None:
            shape = _ROW_SHAPES[found] = _row_shape(found)
        if shape is False:
            return None
        word, columns = shape
        return cls(base[: elements * extent].view(word).reshape(elements, -1), columns)

    def pack(self) -> np.ndarray:
        """The elements' bytes in type-map order, a new array."""
        return np.take(self.rows, self.columns, axis=1).reshape(-1).view(np.uint8)

    def scatter(self, packed: np.ndarray) -> None:
        """Copy a packed copy's bytes into the elements."""
        self.rows[:, self.columns] = packed.view(self.rows.dtype).reshape(len(self.rows), -1)


def _row_shape(found: Layout) -> tuple[np.dtype[Any], np.ndarray] | Literal[False]:
    """An element's words (the widest that divides its extent, offsets and lengths) and
    which of them its blocks are, in type-map order; False where an element's blocks reach
    past its extent (elements that overlap: not rows)."""
    extent = found.extent
    if extent <= 0 or not len(found.lengths) or int((found.offsets + found.lengths).max()) > extent:
        return False
    word = next(w for w in (8, 4, 2, 1)
                if not extent % w and not (found.offsets % w).any() and not (found.lengths % w).any())
    columns = np.concatenate([np.arange(offset // word, (offset + length) // word)
                              for offset, length in zip(found.offsets.tolist(),
                                                        found.lengths.tolist(), strict=True)])
    return np.dtype(f"u{word}"), columns


# each Layout's row shape, worked out once (17 us of a 21 us pack of 64 KiB otherwise)
_ROW_SHAPES: weakref.WeakKeyDictionary[Layout, Any] = weakref.WeakKeyDictionary()


# buffers a Typed may keep a reference to (not resizable: a bytearray's export would block
# its resizing, as cma.Comm's view caches explain)
_KEPT = (np.ndarray, bytes)


def typed(buf: Any, count: int | None, displ: int, found: Layout,
          bytes_of: Callable[[Any], memoryview]) -> Typed | memoryview:
    """``count`` elements (None: as many as fit) of a datatype with gaps (its ``found``
    layout) from element ``displ`` of ``buf``: a Typed buffer, or a byte view when they
    are one block."""
    if displ < 0 or count is not None and count < 0:
        raise ValueError(f"message: a count of {count} at {displ} is not a message")
    if count is not None:
        plan = found.plan(count, displ)
        last = plan.last
        if last is not None and last.owner is buf:
            return last
    view = bytes_of(buf)
    if count is None:
        count = max((view.nbytes - displ * found.extent) // found.extent, 0) if found.extent > 0 else 0
        plan = found.plan(count, displ)
    plan.check(view.nbytes)
    if plan.single:  # (one block: a subarray's face in one piece, say)
        start = int(plan.starts[0])
        return view[start : start + plan.nbytes]
    made = Typed(plan, buf, byte_array(view))
    if made.kept:
        plan.last = made
    return made

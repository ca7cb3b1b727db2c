"""mpi4py buffer specs (``[buf, count, MPI.BYTE]`` & co) as the bytes cma moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..comm import send_view
from .datatypes import ElementRows, Layout, Typed, byte_array, layout, typed

_fromcode = getattr(MPI.Datatype, "fromcode", None) or MPI._typedict.__getitem__  # mpi4py 4 / 3
Unpacker = ElementRows | Typed  # (what copies a packed copy's bytes into a buffer's elements)
SPECS = frozenset((list, tuple))  # what an mpi4py buffer spec (not a plain buffer) is
NO_BYTES = memoryview(bytearray())  # [None, ...]: zero bytes, writable (receives take it too)


def _contiguous_size(datatype: MPI.Datatype) -> int | None:
    """Bytes per element if elements are gap-free bytes (what cma can move), else None."""
    try:
        size: int = datatype.Get_size()
        if size and datatype.Get_extent() == (0, size) and datatype.Get_true_extent() == (0, size):
            return size
    except MPI.Exception:
        pass  # a datatype this MPI lacks (e.g. Fortran types in a C-only build)
    return None


# id() of mpi4py's predefined datatype objects -> element size, for gap-free ones: the
# buffer specs of the hot path are looked up here instead of asking MPI each time.
_SIZES: dict[int, int] = {
    id(datatype): size for datatype in vars(MPI).values()
    if isinstance(datatype, MPI.Datatype) and (size := _contiguous_size(datatype)) is not None
}


def _itemsize(datatype: Any, buf: Any) -> int | Layout:
    """Bytes per element of a spec's datatype (an MPI.Datatype, a typechar, or None), or
    the datatype's decoded Layout when it has gaps."""
    size = _SIZES.get(id(datatype))
    if size is not None:
        return size
    if datatype is None:
        return memoryview(buf).itemsize
    if isinstance(datatype, str):
        datatype = _fromcode(datatype)
    found = layout(datatype)  # (decoded once per datatype object)
    return found.size if found.contiguous else found


def has_gaps(spec: Any) -> bool:
    """Whether ``spec`` is a buffer spec whose datatype has gaps (converts to ``Typed``)."""
    if spec.__class__ not in SPECS or len(spec) < 2:
        return False
    datatype = spec[-1]
    if id(datatype) in _SIZES or datatype is None or isinstance(datatype, (int, tuple, list)):
        return False
    return not isinstance(_itemsize(datatype, None), int)


def _scaled(counts: Any, by: int) -> Any:
    """A spec's count, displacement, a sequence of them or a (counts, displacements)
    pair, in elements ``by`` times smaller (bytes, for elements of ``by`` bytes)."""
    if counts is None:
        return None
    if isinstance(counts, tuple):
        return tuple(_scaled(part, by) for part in counts)
    if isinstance(counts, (int, np.integer)):
        return int(counts) * by
    return [int(count) * by for count in counts]


def as_bytes(spec: Any) -> Any:
    """``spec`` with a derived datatype whose elements are one gap-free run of bytes in
    order (``Layout.contiguous``) read as bytes (``MPI.BYTE``'s typechar), its counts and
    displacements scaled to match; ``spec`` itself where it names no derived datatype;
    None where one stays MPI's to lay out: gaps, bytes out of order or repeated (a
    reordered struct or indexed type), a displacement with a single count (cma's
    collectives take none), or the per-rank datatype lists of Alltoallw."""
    if spec.__class__ not in SPECS or len(spec) < 2:
        return spec
    datatype = spec[-1]
    if id(datatype) in _SIZES or datatype is None or isinstance(datatype, (str, int)):
        return spec  # (mpi4py's own datatypes, a typechar, a count: the usual specs)
    buf, *counts = spec[:-1]
    if isinstance(datatype, (list, tuple)) or not _collective_counts(counts):
        return None
    if not isinstance(datatype, MPI.Datatype) or datatype.is_predefined:
        return spec
    try:
        size = _itemsize(datatype, None)
    except (ValueError, NotImplementedError, MPI.Exception):
        return None
    if not isinstance(size, int) or not size:
        return None
    if not counts:  # [buf, datatype]: as many whole elements as the buffer holds
        if buf is not None and memoryview(buf).nbytes % size:
            return None  # (MPI's to refuse)
        return [buf, "B"]
    return [buf, *(_scaled(count, size) for count in counts), "B"]


def _collective_counts(counts: list[Any]) -> bool:
    """Whether a spec's counts are a form cma's collectives take: none, a count, per-rank
    counts, (counts, displacements); not a displacement beside a single count
    (``[buf, count, displ, D]``, ``[buf, (count, displ), D]``: MPI's), nor Alltoallw's
    datatypes or a datatype out of its place."""
    if any(isinstance(item, MPI.Datatype) or isinstance(item, (list, tuple)) and any(
            isinstance(inner, MPI.Datatype) for inner in item) for item in counts):
        return False
    return not (len(counts) == 2 and isinstance(counts[0], (int, np.integer)) or len(counts) == 1
                and isinstance(counts[0], tuple) and isinstance(counts[0][0], (int, np.integer)))


def _gapped(spec: Any, blocks: int) -> tuple[Any, list[Any], Layout, int] | None:
    """A spec ``as_bytes`` leaves to MPI because its datatype has gaps or its bytes out
    of order or repeated, in a form cma's collectives take: its buffer, counts, layout
    and how many elements it names (``blocks`` of ``count`` where it gives one count;
    the furthest a v-form's blocks reach; with no count, all the buffer holds, which
    must be whole, as mpi4py asks); None otherwise (MPI's, to run or refuse)."""
    if spec.__class__ not in SPECS or len(spec) < 2:
        return None
    datatype = spec[-1]
    if not isinstance(datatype, MPI.Datatype) or datatype.is_predefined:
        return None
    buf, *counts = spec[:-1]
    if buf is MPI.BOTTOM or not _collective_counts(counts):
        return None  # (absolute addresses: MPI's)
    try:
        found = layout(datatype)
    except (ValueError, NotImplementedError, MPI.Exception):
        return None
    if found.contiguous or found.extent <= 0 or found.true_lb < 0:
        return None
    if not counts:
        nbytes = 0 if buf is None else send_view(buf).nbytes
        if nbytes % found.extent:
            return None
        return buf, counts, found, nbytes // found.extent
    first = counts[0]
    if isinstance(first, (int, np.integer)):
        return buf, counts, found, int(first) * blocks
    sizes, displs = first if isinstance(first, tuple) else (first, counts[1] if len(counts) > 1 else None)
    if displs is None:  # (blocks back to back)
        return buf, counts, found, sum(map(int, sizes))
    return buf, counts, found, max((int(start) + int(size) for start, size
                                    in zip(displs, sizes, strict=True) if size), default=0)


def as_packed(spec: Any, blocks: int) -> tuple[list[Any], Unpacker | None] | None:
    """For a spec ``as_bytes`` leaves to MPI (a datatype with gaps, or its bytes out of
    order), as cma's collectives take it: the spec over a packed copy of the elements it
    names (``blocks``: how many blocks its count is for), in type-map order as MPI_Pack
    lays them out, its counts and displacements scaled to bytes as ``as_bytes`` scales
    them; and what unpacks the copy into the buffer once a collective has written it
    (None where nothing can be written: a None buffer, which a rank other than a root
    passes; a read-only buffer, whose copy is read-only too, so that a receive into it
    raises as into the buffer). None where the spec stays MPI's (``_gapped``)."""
    found = _gapped(spec, blocks)
    if found is None:
        return None
    buf, counts, kind, elements = found
    scaled = [_scaled(count, kind.size) for count in counts]
    if buf is None:
        return [None, *scaled, "B"], None
    view = send_view(buf)
    base = byte_array(view)
    rows = ElementRows.of(kind, elements, base)
    unpacker: Unpacker
    if rows is not None:
        packed, unpacker = rows.pack(), rows
    else:
        plan = kind.plan(elements, 0)
        plan.check(view.nbytes)
        blockwise = Typed(plan, buf, base)
        packed, unpacker = byte_array(blockwise.pack()), blockwise
    if view.readonly:
        packed.flags.writeable = False
        return [packed, *scaled, "B"], None
    return [packed, *scaled, "B"], unpacker


def as_packed_unfilled(spec: Any, blocks: int) -> list[Any] | None:
    """The spec ``as_packed`` makes of ``spec``, over an unfilled array of the packed
    copy's length, for the routing to size as its peers' arrays (no packing, no Plan);
    None where ``as_packed`` makes none."""
    found = _gapped(spec, blocks)
    if found is None:
        return None
    buf, counts, kind, elements = found
    stand_in = None if buf is None else np.empty(elements * kind.size, np.uint8)
    return [stand_in, *(_scaled(count, kind.size) for count in counts), "B"]


def convert(spec: Sequence[Any]) -> Any:
    """An mpi4py buffer spec as something cma takes: the buffer itself, a byte view, or
    (a datatype with gaps) a ``Typed`` buffer.

    Accepts mpi4py's point-to-point forms: [buf, datatype], [buf, count],
    [buf, count, datatype], [buf, (count, displ), datatype] and
    [buf, count, displ, datatype], datatypes as MPI.Datatype or typechar.
    """
    n = len(spec)
    displ = 0
    count: Any = None
    if n == 2:
        buf, datatype = spec
        if id(datatype) in _SIZES:
            return NO_BYTES if buf is None else buf  # the whole buffer: nothing to build
        if isinstance(datatype, (int, tuple, list)):
            count, datatype = datatype, None
    elif n == 3:
        buf, count, datatype = spec
    elif n == 4:
        buf, count, displ, datatype = spec
    else:
        raise ValueError(f"message: expecting 2 to 4 items, got {n}")
    if isinstance(count, (tuple, list)):
        count, displ = count
    if buf is None:
        if count:
            raise ValueError("message: a None buffer needs a count of 0")
        return NO_BYTES
    itemsize = _itemsize(datatype, buf)
    if not isinstance(itemsize, int):
        return typed(buf, count, displ, itemsize, send_view)
    if buf.__class__ is np.ndarray and not displ and count is not None \
            and count * itemsize == buf.nbytes and count >= 0:
        return buf  # the whole array (the usual spec): its size needs no view (~1 us)
    view = send_view(buf)
    if count is None:
        if view.nbytes % itemsize:
            raise ValueError(f"message: buffer length {view.nbytes} is not a multiple of "
                             f"datatype size {itemsize}")
        return buf
    start = displ * itemsize
    stop = start + count * itemsize
    if start == 0 and stop == view.nbytes:
        return buf
    if stop > view.nbytes or count < 0 or displ < 0:
        raise ValueError(f"message: {count} elements at {displ} exceed a {view.nbytes}-byte buffer")
    return view[start:stop]


def snapshot(buf: Any) -> bytes:
    """A copy of the bytes a buffer or spec names (what Sendrecv_replace sends)."""
    if buf is None:
        return b""
    found = convert(buf) if buf.__class__ in SPECS else buf
    return bytes(found) if found.__class__ is Typed else bytes(send_view(found))

"""Collective operations of ``cma.Comm`` (Bcast, Reduce, Allreduce, ...), with mpi4py's
signatures, built on the communicator's own point-to-point messages.

``Collectives`` is a mixin: ``cma.Comm`` inherits it, and it reaches the communicator
only through three private primitives (``_coll_send``, ``_coll_recv``, ``_coll_wait``)
that post messages with cma's own negative tags, which ``ANY_TAG`` and every user
receive ignore, so a collective never matches a user's message. Large messages therefore
move as any message of their size does (eager through the ring, or a rendezvous through
the transport: single copy with cma), and ``comm.stats()`` counts them.

Which algorithm runs where, and what each copies, is in docs/guide.md ("Collectives").
The algorithms are the classic ones of MPICH and Open MPI's tuned component: binomial
trees, van de Geijn's broadcast (a scatter, then an allgather by recursive doubling or
along a chain), recursive doubling, and Rabenseifner's reduce-scatter + allgather (by
recursive halving and doubling, or by rings).
"""

from __future__ import annotations

import itertools
import mmap
import operator
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._exporters import cai_array, dlpack_array
from .channel import NOT_EAGER, RING_EMPTY, RING_FULL
from .errors import BufferError, CmaError, InvalidCount, InvalidDatatype, InvalidRank
from .protocol import SendOp
from .transports.xmap import View
from .wire import COLLECTIVE_TAG

if TYPE_CHECKING:
    from .channel import Inbox, Outbox
    from .direct import DirectRendezvous
    from .progress import Packet, Progress
    from .protocol import Matcher, RecvOp

__all__ = [
    "BAND", "BOR", "BXOR", "IN_PLACE", "LAND", "LOR", "LXOR", "MAX", "MAXLOC", "MIN",
    "MINLOC", "Op", "PROD", "SUM", "Collectives",
]

# Thresholds in bytes of the whole message (the same on every rank, so every rank picks
# the same algorithm), measured on this 2-CPU machine kind (docs/guide.md section 7, "The
# switch points"). MPICH's bcast switch and the first guess for Reduce's: kept, though at
# 3-8 ranks here the trees won most sizes, since those ranks were oversubscribed.
BCAST_SCATTER_FROM = 512 << 10  # and 3 ranks or more: van de Geijn instead of a binomial tree
# From 3 ranks, a Bcast of this many bytes or more, where it is a rendezvous (above the
# eager limit), goes flat (XHC's shape): every reader takes the whole message out of the
# root's memory, all at once, one copy each. Against van de Geijn at 3-8 ranks it took
# 0.19-0.59 of the time at 1-4 MiB by the mean over ranks, and 0.70-1.07 at 512 KiB at 3-4
# ranks (docs/guide.md section 7, "A flat Bcast").
BCAST_FLAT_FROM = 1 << 20
# A binomial Bcast of BCAST_PIPELINE_FROM to BCAST_PIPELINE_UNTIL bytes goes in eager pieces
# of BCAST_PIECE, so that a reader copies one out of its ring while its parent copies the
# next in. At 2 ranks that took 0.41-0.81x the time of one message at 2-8 MiB by the mean
# in three jobs (one turn of 8 MiB: 1.06) and was level or mixed at 1 MiB and 12-16 MiB;
# from 512 KiB at 3 ranks or more van de Geijn beat it, and such sizes go flat or van de
# Geijn there, so pieces run at 2 ranks (docs/guide.md section 7, "Bcast in pieces").
BCAST_PIPELINE_FROM = 2 << 20
BCAST_PIPELINE_UNTIL = 8 << 20
BCAST_PIECE = 1 << 20
# At 2 ranks, an Allreduce's ring steps (reduce-scatter, allgather) whose blocks are above
# the eager limit and at most RING_PIECES_UNTIL go in eager pieces of RING_PIECE bytes, each
# combined as it comes while the peer copies the next in: 0.74-0.89 of the time of whole
# blocks at 6-16 MiB in one job (whose 32 MiB read 1.49-1.88), 0.54-0.96 in another (32 MiB
# 0.89-0.94); a Reduce's reduce-scatter was mixed (0.81-1.26): neither 32 MiB nor Reduce
# goes in pieces. 1 MiB pieces took 1.7-3.2x at 12-32 MiB until the writer's window grew by a
# page (channel.window_bytes) and held four of them, not three; since, level with 512 KiB ones.
# A block the peer maps (xmap) goes whole: combined from the mapping, it took 0.53-0.73 of
# 1 MiB pieces' time at 6-16 MiB (docs/guide.md section 7, "Allreduce in pieces").
RING_PIECE = 512 << 10
RING_PIECES_UNTIL = 8 << 20
# a reduce-scatter + allgather (by halving and doubling, or by the ring) instead of recursive
# doubling, whose fewer steps won below it at 2, 3, 4 and 8 ranks (at 8 ranks the
# reduce-scatter took 1.75-2.04x doubling's time at 16-64 KiB, 0.63-0.71x at 256 KiB)
ALLREDUCE_SCATTER_FROM = 256 << 10
# Over 5 or more ranks that are no power of two, a reduce-scatter by halving below this
# size, by the ring from it: at 6 ranks the two tied at 4 MiB and the ring won at 16 MiB,
# where the odd rank of each of halving's pairs moves 2 n more (docs/guide.md section 7,
# "Many ranks")
HALVING_UNTIL = 4 << 20
REDUCE_SCATTER_FROM = 512 << 10  # reduce-scatter + gather to the root instead of a binomial tree
# A collective's message (an array, or an object's pickle) that finds the ring full is
# copied into a queued packet only if it is smaller than QUEUED_COPY_LIMIT (Isend's,
# 128 KiB), and only while less than this waits queued in all (for every peer together);
# else it goes as a rendezvous: every rank is in the collective, so none waits for ever.
# A call returns only once what it queued has gone out (_settle), so this bounds what one
# call queues (a root of many readers), and no root runs ahead of its readers. (Isend
# keeps queueing: a program may exit after its Waitall, and the queue is delivered as it
# exits.)
QUEUED_BYTES_LIMIT = 8 << 20
# Where xmap is on, a collective's message of at least this many bytes from the shared heap
# goes as a rendezvous its reader copies once out of its mapping of the sender's pages, or
# combines straight from them, instead of twice through the ring; so does one above the
# eager limit where that is lower (3 ranks or more: ChannelConfig.for_ranks), a rendezvous
# anyway. Below, the ring's two copies cost less than the rendezvous's round trip: a 1 MiB
# Bcast took 86-90 us mapped against 56 eager, a 2 MiB one 114-117 against 162-164
# (docs/guide.md section 7, "From the shared heap"). The rule is written out where it is
# applied, in _coll_send and _coll_take_view: both are on every hop's path.
XMAP_HOP_FROM = 2 << 20

UINT8 = np.dtype(np.uint8)  # (NumPy's builtin dtypes are one object each: _bytes tests `is`)


# ------------------------------------------------------------------ IN_PLACE and ops

class _InPlace:
    """The type of ``cma.IN_PLACE``: one instance, which pickles to itself."""

    _instance: _InPlace | None = None

    def __new__(cls) -> _InPlace:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "cma.IN_PLACE"

    def __reduce__(self) -> str:
        return "IN_PLACE"


IN_PLACE = _InPlace()


def _mpi() -> Any:
    """mpi4py's MPI module if the program imported it, else None (cma never imports it)."""
    return sys.modules.get("mpi4py.MPI")


def _is_in_place(buf: Any) -> bool:
    """``IN_PLACE``, mpi4py's, or ``None``, which mpi4py reads as IN_PLACE where a
    collective allows it (e.g. the root's sendbuf of Gather, recvbuf of Scatter)."""
    if buf is IN_PLACE or buf is None:
        return True
    mpi = _mpi()
    return mpi is not None and buf is getattr(mpi, "IN_PLACE", None)


class Op:
    """A predefined reduction operation (``cma.SUM``, ``cma.MAX``, ...).

    ``op(a, b)`` combines two Python objects, as mpi4py's ``MPI.Op`` does for the
    lowercase methods (two NumPy arrays of one dtype and shape elementwise, into a new
    array); the uppercase methods combine arrays in place with ``combine``. Every
    predefined operation is commutative.
    """

    __slots__ = ("name", "_combine", "_objects", "_combines", "_into")

    def __init__(self, name: str, combine: Callable[[np.ndarray, np.ndarray], None],
                 objects: Callable[[Any, Any], Any],
                 into: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None) -> None:
        self.name = name
        self._combine = combine
        self._objects = objects
        self._combines: set[np.dtype] = set()  # dtypes check() has accepted (0.7 us each)
        self._into = into

    def __call__(self, a: Any, b: Any) -> Any:
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
                and a.shape == b.shape:
            out = a.copy()
            self._combine(out, b)
            return out
        return self._objects(a, b)

    def combine(self, inout: np.ndarray, incoming: np.ndarray) -> None:
        """``inout = inout op incoming``, elementwise, into ``inout``'s memory."""
        self._combine(inout, incoming)

    def combine_from_lower(self, inout: np.ndarray, lower: np.ndarray) -> None:
        """What the lower rank's ``combine(lower, inout)`` leaves, into ``inout``
        (``lower`` is scratch, and may be overwritten): two ranks that combine each other's
        arrays so get the same bits (MIN and MAX of -0.0 and +0.0, NaN payloads)."""
        if self._into is not None:
            self._into(inout, lower, inout)
        else:
            self._combine(lower, inout)
            np.copyto(inout, lower)

    def combine_into(self, out: np.ndarray, a: np.ndarray, incoming: np.ndarray) -> None:
        """``out = a op incoming``, elementwise (``combine`` on a copy of ``a`` in ``out``,
        in one pass where the op is a ufunc)."""
        if self._into is not None:
            self._into(out, a, incoming)
        else:
            np.copyto(out, a)
            self._combine(out, incoming)

    def check(self, dtype: np.dtype) -> None:
        """Raise ``InvalidDatatype`` if this operation cannot combine arrays of ``dtype``
        (called before any message moves, so a refusal leaves no peer waiting)."""
        if dtype in self._combines:
            return
        empty = np.empty(0, dtype)
        try:
            self._combine(empty, empty)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidDatatype(f"{self.name} cannot combine arrays of dtype {dtype}: {exc}") \
                from exc
        self._combines.add(dtype)

    def __repr__(self) -> str:
        return f"cma.{self.name}"

    def __reduce__(self) -> str:
        return self.name


def _ufunc(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], None]:
    def combine(inout: np.ndarray, incoming: np.ndarray) -> None:
        ufunc(inout, incoming, out=inout)
    return combine


def _ufunc_into(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    def combine_into(out: np.ndarray, a: np.ndarray, incoming: np.ndarray) -> None:
        ufunc(a, incoming, out=out)
    return combine_into


def _loc(better: np.ufunc) -> Callable[[np.ndarray, np.ndarray], None]:
    """MINLOC/MAXLOC over a structured dtype of two fields, (value, index): the better
    value wins, a tie goes to the smaller index (MPI's rule)."""
    def combine(inout: np.ndarray, incoming: np.ndarray) -> None:
        names = inout.dtype.names
        if names is None or len(names) != 2:
            raise TypeError("MINLOC and MAXLOC need a structured dtype of two fields "
                            "(value, index), e.g. [('v', 'f8'), ('i', 'i4')]")
        value, index = names
        a_value, b_value = inout[value], incoming[value]
        take = better(b_value, a_value) | ((b_value == a_value) & (incoming[index] < inout[index]))
        inout[take] = incoming[take]
    return combine


def _maxloc_objects(a: Any, b: Any) -> Any:
    return a if (a[0], -a[1]) >= (b[0], -b[1]) else b


SUM = Op("SUM", _ufunc(np.add), operator.add, _ufunc_into(np.add))
PROD = Op("PROD", _ufunc(np.multiply), operator.mul, _ufunc_into(np.multiply))
MIN = Op("MIN", _ufunc(np.minimum), min, _ufunc_into(np.minimum))
MAX = Op("MAX", _ufunc(np.maximum), max, _ufunc_into(np.maximum))
LAND = Op("LAND", _ufunc(np.logical_and), lambda a, b: a and b, _ufunc_into(np.logical_and))
LOR = Op("LOR", _ufunc(np.logical_or), lambda a, b: a or b, _ufunc_into(np.logical_or))
LXOR = Op("LXOR", _ufunc(np.logical_xor), lambda a, b: bool(a) != bool(b), _ufunc_into(np.logical_xor))
BAND = Op("BAND", _ufunc(np.bitwise_and), operator.and_, _ufunc_into(np.bitwise_and))
BOR = Op("BOR", _ufunc(np.bitwise_or), operator.or_, _ufunc_into(np.bitwise_or))
BXOR = Op("BXOR", _ufunc(np.bitwise_xor), operator.xor, _ufunc_into(np.bitwise_xor))
MINLOC = Op("MINLOC", _loc(np.less), min)  # (value, index) tuples compare as MPI ranks them
MAXLOC = Op("MAXLOC", _loc(np.greater), _maxloc_objects)
OPS = {op.name: op for op in (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR,
                              MINLOC, MAXLOC)}


def _array_op(op: Any) -> Op:
    """cma's op for ``op``: one of cma's, or mpi4py's predefined op of the same name."""
    if isinstance(op, Op):
        return op
    mpi = _mpi()
    if mpi is not None and isinstance(op, mpi.Op):
        for name, ours in OPS.items():
            if op == getattr(mpi, name):
                return ours
    raise TypeError(f"{op!r} is not a predefined reduction: the uppercase collectives take "
                    f"cma.{', cma.'.join(OPS)} (or mpi4py's ops of those names)")


def _in_type_of(result: np.ndarray, source: np.ndarray) -> np.ndarray:
    """``source`` in ``result``'s dtype, as a reduction whose every rank has a recvbuf
    combines (docs/api.md): ``source`` itself, or a copy cast by NumPy's same_kind rule (a
    float into an int recvbuf raises TypeError here, before any message moves)."""
    if result.dtype == source.dtype:
        return source
    return source.astype(result.dtype, casting="same_kind")


def _object_op(op: Any) -> Callable[[Any, Any], Any]:
    if callable(op):
        return op
    raise TypeError(f"op {op!r} is not callable: give a cma op or a function of two objects")


# ------------------------------------------------------------------ buffer specs

_MPI_CONSTANTS: dict[int, Any] = {}


def mpi_datatype_constants(mpi: Any) -> dict[int, Any]:
    """mpi4py's own datatype objects (MPI.FLOAT, MPI.BYTE, ...: module attributes, which
    live as long as the module, so their ids name no other object), by id."""
    if not _MPI_CONSTANTS:
        _MPI_CONSTANTS.update((id(value), value) for value in vars(mpi).values()
                              if isinstance(value, mpi.Datatype))
    return _MPI_CONSTANTS


# The dtypes of mpi4py's own datatype objects, by id, as they are met: dtlib takes 0.9 us
# to answer. Others (a Dup, Match_size's, a derived one) are not kept, so this holds at
# most mpi4py's few dozen.
_MPI_DTYPES: dict[int, tuple[Any, np.dtype]] = {}


def _dtype(datatype: Any) -> np.dtype:
    known = _MPI_DTYPES.get(id(datatype))
    if known is not None and known[0] is datatype:
        return known[1]
    mpi = _mpi()
    if mpi is not None and isinstance(datatype, mpi.Datatype):
        from mpi4py.util import dtlib  # (already loaded with mpi4py.MPI's users)

        mapped = np.dtype(dtlib.to_numpy_dtype(datatype))
        if mpi_datatype_constants(mpi).get(id(datatype)) is datatype:
            _MPI_DTYPES[id(datatype)] = (datatype, mapped)
        return mapped
    try:
        dtype = None if datatype is None else np.dtype(datatype)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.hasobject or dtype.itemsize == 0:
        raise InvalidDatatype(f"unknown datatype {datatype!r}: give a NumPy typechar or dtype "
                              "of fixed-size values")
    return dtype


def _whole(buf: Any, writable: bool) -> np.ndarray:
    """The buffer as a flat array of its own element type (no copy); None is an empty
    buffer, as in mpi4py's specs ``[None, "B"]``."""
    if buf is None:
        return np.empty(0, np.uint8)
    if isinstance(buf, np.ndarray):
        array = buf
    else:
        try:
            array = np.asarray(memoryview(buf))
        except (TypeError, ValueError) as exc:
            if hasattr(buf, "__dlpack__"):
                array = dlpack_array(buf, typed=True)
            elif hasattr(buf, "__cuda_array_interface__"):
                array = cai_array(buf).view(np.dtype(buf.__cuda_array_interface__["typestr"]))
            else:
                raise BufferError(f"{type(buf).__name__} exports neither a buffer nor DLPack "
                                  "nor the CUDA array interface") from exc
    if array.dtype.hasobject:
        raise BufferError("an array of Python objects: use the lowercase (object) methods")
    if not array.flags.c_contiguous:
        raise BufferError("buffer is not C-contiguous: pass np.ascontiguousarray(x)")
    if writable and not array.flags.writeable:
        raise BufferError("receive buffer is read-only: pass a writable array")
    return array.reshape(-1)


def _retype(array: np.ndarray, datatype: Any) -> np.ndarray:
    dtype = _dtype(datatype)
    if array.dtype == dtype:
        return array
    raw = array.view(np.uint8)
    if raw.size % dtype.itemsize:
        raise BufferError(f"a {raw.size}-byte buffer is no whole number of {dtype} elements")
    return raw.view(dtype)


def _count(value: Any) -> int:
    try:
        count = operator.index(value)
    except TypeError:
        count = -1
    if count < 0:
        raise InvalidCount(f"count {value!r} must be a non-negative int")
    return count


def _is_count(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _message(spec: Any, writable: bool, blocks: int = 1) -> np.ndarray:
    """A buffer spec of ``blocks`` equal blocks: ``buf``, ``[buf, datatype]``,
    ``[buf, count]`` or ``[buf, count, datatype]`` (count per block, as mpi4py counts);
    the flat array of the blocks, ``blocks * count`` elements."""
    count: int | None = None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2 and _is_count(spec[1]):
            array, count = _whole(spec[0], writable), _count(spec[1])
        elif len(spec) == 2:
            array = _retype(_whole(spec[0], writable), spec[1])
        elif len(spec) == 3:
            array = _retype(_whole(spec[0], writable), spec[2])
            count = _count(spec[1])
        else:
            raise BufferError(f"buffer spec must be [buf, datatype], [buf, count] or "
                              f"[buf, count, datatype], got {len(spec)} items")
    else:
        array = _whole(spec, writable)
    if count is None:
        count = array.size // blocks
    if count * blocks > array.size:
        raise BufferError(f"{blocks} block(s) of {count} elements do not fit a buffer of "
                          f"{array.size}")
    return array[: count * blocks]


class KeptMessage:
    """What a buffer or buffer spec named at one call, for the next call given the same
    buffer, or an equal spec list over it (a spec written inline, ``[buf, n, MPI.BYTE]``,
    is a new list every call): working it out again took 2-4 us, more than a small
    collective's messages (docs/guide.md, section 7).

    No reference to the buffer is kept, not even a weak one (which stops NumPy's
    ``resize``): only its identity, kind, dtype and size, which must all match, and the
    element type and count the spec made of it. The bytes are exported anew from the
    buffer given at each call (~0.3 us), so its owner can still resize, close or free
    it, and an array whose data moved is read where it lies now. (A flat array of the kept
    element type and count is its own message.)"""

    __slots__ = ("rest", "base_id", "kind", "base_dtype", "base_nbytes", "count", "dtype")

    def __init__(self, rest: list[Any] | None, base: Any, count: int, dtype: np.dtype) -> None:
        self.rest = rest  # the spec's items after the buffer; None for a bare buffer
        self.base_id, self.kind = id(base), base.__class__
        self.base_dtype = base.dtype if self.kind is np.ndarray else None
        self.base_nbytes = _nbytes(base)
        self.count, self.dtype = count, dtype

    @classmethod
    def of(cls, buf: Any, array: np.ndarray) -> KeptMessage | None:
        """Keep what ``buf`` named (``array``, which starts where its buffer starts); None
        for a buffer of another kind than an array, a bytearray or an mmap."""
        rest, base = None, buf
        if buf.__class__ is list and buf:
            rest, base = buf[1:], buf[0]
        kind = base.__class__
        if kind is not np.ndarray and kind is not bytearray and kind is not mmap.mmap:
            return None
        return cls(rest, base, array.size, array.dtype)

    def get(self, buf: Any, writable: bool) -> np.ndarray | None:
        """The array ``buf`` names if it is the kept buffer and spec (writable if asked),
        else None."""
        rest = self.rest
        if rest is None:
            base = buf
        elif buf.__class__ is list and buf and buf[1:] == rest:
            base = buf[0]
        else:
            return None
        kind = self.kind
        if id(base) != self.base_id or base.__class__ is not kind:
            return None
        try:
            if kind is np.ndarray:
                dtype = base.dtype  # (NumPy's builtin dtypes are one object each: `is` first)
                if dtype is not self.base_dtype and dtype != self.base_dtype \
                        or base.nbytes != self.base_nbytes:
                    return None
                if dtype is self.dtype and base.ndim == 1 and base.size == self.count \
                        and base.flags.c_contiguous:  # (the array the spec names: 0.1 us less)
                    return None if writable and not base.flags.writeable else base
            elif len(base) != self.base_nbytes:
                return None
            array = np.frombuffer(base, self.dtype, self.count)
        except ValueError:  # closed, shrunk, not contiguous: worked out anew, which says why
            return None
        return None if writable and not array.flags.writeable else array


def _nbytes(base: Any) -> int:
    return base.nbytes if base.__class__ is np.ndarray else len(base)


def _vmessage(spec: Any, writable: bool, size: int) -> tuple[np.ndarray, list[int], list[int]]:
    """A v-form spec, as mpi4py reads it: ``[buf, counts, datatype]``, ``[buf, (counts,
    displs), datatype]``, ``[buf, counts, displs, datatype]`` or those without the
    datatype. ``counts`` is a sequence of element counts per rank or one count for all;
    ``displs`` a sequence of displacements, one stride (rank r's block at r * stride), or
    None (blocks end to end). A bare buffer or ``[buf, datatype]`` is ``size`` equal blocks."""
    counts: Any = None
    displs: Any = None
    datatype: Any = None
    if isinstance(spec, (list, tuple)):
        buf, *rest = spec
        if len(rest) == 3:
            counts, displs, datatype = rest
        elif len(rest) == 2 and isinstance(rest[0], tuple) or len(rest) == 1 and \
                isinstance(rest[0], tuple):
            counts, displs = rest[0]
            datatype = rest[1] if len(rest) == 2 else None
        elif len(rest) == 2 and (_is_count(rest[1]) or isinstance(rest[1], (list, np.ndarray))):
            counts, displs = rest  # [buf, counts, displs]
        elif len(rest) == 2:
            counts, datatype = rest
        elif len(rest) == 1 and (_is_count(rest[0]) or isinstance(rest[0], (list, np.ndarray))):
            counts = rest[0]
        elif len(rest) == 1:
            datatype = rest[0]
        else:
            raise BufferError("v-form spec must be [buf, counts, datatype], "
                              "[buf, (counts, displs), datatype] or [buf, counts, displs, datatype]")
        array = _whole(buf, writable)
        if datatype is not None:
            array = _retype(array, datatype)
    else:
        array = _whole(spec, writable)
    if counts is None:
        counts = array.size // size
    counts = [_count(counts)] * size if _is_count(counts) else [_count(c) for c in counts]
    if displs is None:
        displs = [sum(counts[:i]) for i in range(len(counts))]
    elif _is_count(displs):
        displs = [i * _count(displs) for i in range(size)]
    displs = [_count(d) for d in displs]
    if len(counts) != size or len(displs) != size:
        raise BufferError(f"v-form spec needs {size} counts and displacements, got "
                          f"{len(counts)} and {len(displs)}")
    for c, d in zip(counts, displs, strict=True):
        if d + c > array.size:
            raise BufferError(f"block of {c} elements at {d} overruns a buffer of {array.size}")
    return array, counts, displs


def _wmessage(spec: Any, writable: bool, size: int) -> tuple[np.ndarray, list[int], list[int]]:
    """A w-form spec, as mpi4py reads it: ``[buf, datatypes]`` (one element of each at
    offset 0), ``[buf, (counts, displs), datatypes]`` or ``[buf, counts, displs,
    datatypes]``, with displacements in bytes and a datatype per rank (or one for all);
    the buffer's bytes and each rank's block as (byte counts, byte displacements)."""
    if not isinstance(spec, (list, tuple)) or len(spec) not in (2, 3, 4):
        raise BufferError("w-form spec must be [buf, datatypes], [buf, (counts, displs), "
                          "datatypes] or [buf, counts, displs, datatypes]")
    if len(spec) == 2:
        buf, datatypes = spec
        counts: Any = [1] * size
        displs: Any = [0] * size
    elif len(spec) == 3:
        buf, (counts, displs), datatypes = spec
    else:
        buf, counts, displs, datatypes = spec
    raw = _whole(buf, writable).view(np.uint8)
    dtypes = ([_dtype(t) for t in datatypes] if isinstance(datatypes, (list, tuple))
              else [_dtype(datatypes)] * size)
    counts, displs = [_count(c) for c in counts], [_count(d) for d in displs]
    if not len(counts) == len(displs) == len(dtypes) == size:
        raise BufferError(f"w-form spec needs {size} counts, displacements and datatypes, got "
                          f"{len(counts)}, {len(displs)} and {len(dtypes)}")
    nbytes = [c * t.itemsize for c, t in zip(counts, dtypes, strict=True)]
    for n, d in zip(nbytes, displs, strict=True):
        if d + n > raw.size:
            raise BufferError(f"block of {n} bytes at byte {d} overruns a buffer of {raw.size}")
    return raw, nbytes, displs


def _bytes(array: np.ndarray) -> memoryview:
    if array.dtype is UINT8:  # (a Bcast's message is bytes already; the view cost 0.25 us)
        return array.data
    return array.view(np.uint8).data


def _copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src``'s bytes over ``dst`` (a rank's own block: no message involved)."""
    if src.nbytes < dst.nbytes:
        raise BufferError(f"a block of {dst.nbytes} bytes cannot come from {src.nbytes}")
    dst.view(np.uint8)[:] = src.view(np.uint8)[: dst.nbytes]


def _last_queued(progress: Progress, dest: int) -> Packet | None:
    """The packet this rank queued last for ``dest``, if any waits queued: right after a
    send or a FIN that went to the queue, that one (every later packet queues behind it)."""
    queue = progress.txq[dest]
    return queue[-1] if queue else None


def _cuts(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` nearly equal blocks of ``n`` elements: parts + 1 offsets."""
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


# (input or None for IN_PLACE, result or None, the op given, result_here, its Op)
KeptInputs = tuple[KeptMessage | None, KeptMessage | None, Any, bool, Op]


# ------------------------------------------------------------------ the mixin

class Collectives:
    """The collective operations of ``cma.Comm`` (mpi4py's names and signatures)."""

    rank: int
    size: int
    # the last reduction's input and result (None: IN_PLACE, no result here), op, and flags
    _last_inputs: KeptInputs | None = None
    _last_bcast: KeptMessage | None = None  # the last Bcast's buffer, as bytes
    _queued_to: dict[int, Packet] | None = None  # dest -> a message's packet queued (_mark_queued)

    if TYPE_CHECKING:  # what cma.Comm provides (docs/architecture.md, "What cma.Comm lets ...")
        _progress: Progress | None
        _direct: DirectRendezvous | None
        _fast_outboxes: list[Outbox | None]
        _fast_inboxes: list[Inbox | None]
        _fast_spins: int
        _matcher: Matcher
        _eager_limit: int
        _busy: int

        def _ring(self, peer: int) -> None: ...
        def _attach(self) -> Progress: ...
        def start_send(self, segments: list[memoryview], dest: int, tag: int, is_object: bool,
                       eager: bool = True, sync: bool = False, pull_first: bool = False
                       ) -> SendOp: ...
        def _pickle(self, obj: Any) -> list[memoryview]: ...
        def _queues(self, n: int, outbox: Outbox | None) -> bool: ...
        def _view_from_ring(self, direct: DirectRendezvous, inbox: Inbox | None, tag: int,
                            capacity: int | None = None) -> View | int | None: ...
        def _await_late(self, inbox: Inbox, tag: int) -> bool: ...
        def load_object(self, op: RecvOp) -> Any: ...

    # -- the primitives: private point-to-point under COLLECTIVE_TAG (or Barrier's tag)

    def _coll_send(self, data: np.ndarray | None, dest: int, obj: Any = None,
                   tag: int = COLLECTIVE_TAG, pull_first: bool = False) -> SendOp | None:
        """Start sending ``data`` (an array) or, if None, the object ``obj`` to ``dest``;
        None when it is complete already (an eager message written into the ring).
        ``pull_first``: a rendezvous is offered PULL_FIRST, for ``dest`` to take out of
        this rank's memory itself wherever a transport can, whatever would be chosen for
        one message (SPLIT, a push: this rank's copies), as a flat Bcast's root offers it."""
        if data is None:
            stream = self._pickle(obj)
            n = sum(segment.nbytes for segment in stream)
            box = self._fast_outboxes[dest]
            op = self.start_send(stream, dest, tag, True,
                                 eager=box is not None and box.fits(n) or self._may_queue(n))
            self._mark_queued(dest)
            return op
        view = _bytes(data)
        n = view.nbytes
        if (n >= XMAP_HOP_FROM or n > self._eager_limit) and n:
            direct = self._direct
            if direct is not None and (pull_first or direct.xmap is not None
                                       and direct.can_map(dest, view)):
                return self._offer(direct, view, dest, tag, pull_first)
        box = self._fast_outboxes[dest]
        if box is not None and n <= self._eager_limit and not self._busy:
            # Send's fast path: straight into the ring. The engine's path would first copy
            # the payload into a packet (3 copies per eager message instead of 2: guide.md).
            self._busy = 1  # (as in Send: another thread's call now raises ConcurrentUse)
            try:
                sleeping = box.put_eager(tag, view, n)
            finally:
                self._busy = 0
            if sleeping != RING_FULL:
                if sleeping:
                    self._ring(dest)
                return None
        if n > self._eager_limit or self._may_queue(n):
            op = self.start_send([view], dest, tag, False, pull_first=pull_first)
            self._mark_queued(dest)
            return op
        return self.start_send([view], dest, tag, False, eager=False)

    def _mark_queued(self, dest: int) -> None:
        """Note the message just sent to ``dest`` if it was queued (the ring full): the
        collective's wait for it then waits until it has gone out (``_settle``)."""
        progress = self._progress
        if progress is not None and progress.txq_pending:
            packet = _last_queued(progress, dest)
            if packet is not None:
                if self._queued_to is None:
                    self._queued_to = {}
                self._queued_to[dest] = packet

    def _offer(self, direct: DirectRendezvous, view: memoryview, dest: int, tag: int,
               pull_first: bool = False) -> SendOp:
        """Send ``view`` to ``dest`` as the direct rendezvous's offer (its region, and its
        place in this rank's heap if it lies there): its RTS straight into the ring (the
        engine's path cost ~20 us more a hop), or queued behind packets waiting for
        ``dest``; ``pull_first``: offered PULL_FIRST."""
        if self._busy:  # (another thread's call: the general path raises ConcurrentUse)
            return self.start_send([view], dest, tag, False, eager=False, pull_first=pull_first)
        progress = self._progress or self._attach()
        if dest not in progress.outboxes:
            progress.connect(dest)  # (a peer not met yet: lazily connected from 3 ranks)
        self._busy = 1
        try:  # (no fast outbox while packets to dest wait queued: the RTS queues behind them)
            op, _ = direct.offer(self._fast_outboxes[dest], view, view.nbytes, dest, tag, pull_first)
        finally:
            self._busy = 0
        return op

    def _may_queue(self, n: int) -> bool:
        """Whether a message of ``n`` bytes that the ring cannot take now may wait in a
        queued copy, rather than for its reader as a rendezvous: Isend's size rule
        (Comm._queues; not its "the ring has room again", which would copy through the
        engine what the fast path can put), and while less than QUEUED_BYTES_LIMIT waits
        queued. Queued without bound, the root of back-to-back 1 MiB Bcasts ran ahead,
        every copy faulting in fresh heap pages (guide.md, section 7, "A root that runs
        ahead")."""
        progress = self._progress
        return self._queues(n, None) and (progress is None
                                          or progress.txq_bytes < QUEUED_BYTES_LIMIT)

    def _coll_recv(self, data: np.ndarray | None, source: int, tag: int = COLLECTIVE_TAG) -> RecvOp:
        """Post a receive into ``data`` (an array), or of an object if None, from ``source``."""
        progress = self._progress or self._attach()
        return progress.post_recv(source, tag, None if data is None else _bytes(data))

    def _coll_wait(self, *ops: SendOp | RecvOp | None) -> None:
        """Wait for every one of ``ops`` (None: complete); on an error, take the receives
        not yet matched out of matching, so that a later collective cannot match them."""
        progress = self._progress or self._attach()
        try:
            for op in ops:
                if op is None or op.__class__ is SendOp and self._fin_taken(op):
                    continue
                progress.wait(op)
                error = getattr(op, "error", None)
                if error is not None:
                    raise error
                if progress.txq_pending:
                    if isinstance(op, SendOp):
                        marks = self._queued_to
                        self._settle(op.dest, marks.pop(op.dest, None) if marks else None)
                    elif op.mechanism != "eager":  # (its FIN may be queued, the last packet
                        # then, or behind what the same pass of the engine queued after it)
                        self._settle_fin(op.source)
        except BaseException:
            for op in ops:
                if op is not None:
                    progress.withdraw(op)
            raise

    def _fin_taken(self, op: SendOp) -> bool:
        """Whether the FIN that completes ``op`` (a rendezvous) was taken from the head of
        its reader's ring without the engine, at once or once it came (``_await_late``), as
        a direct rendezvous's ``Send`` takes it; False (nothing taken) where the engine
        must wait: another packet first, a receive posted, or other work for this rank.
        In the engine's wait, the reader's next message behind the FIN was taken too, as an
        unexpected one, and the next receive then went through the engine as well. Only
        before any CTS (the reader pulls or maps it all): after one, this rank pushes and
        its engine completes and counts the send."""
        direct, inbox = self._direct, self._fast_inboxes[op.dest]
        if direct is None or inbox is None or not (op.awaits_cts and op.awaits_fin):
            return False
        while not self._busy and not self._matcher.posted:
            self._busy = 1
            try:
                came = direct.fin_came(op, op.dest)
            finally:
                self._busy = 0
            if came:
                return True
            if inbox.ready() or not self._await_late(inbox, COLLECTIVE_TAG):
                return False
        return False

    def _coll_take(self, data: np.ndarray, source: int, tag: int = COLLECTIVE_TAG) -> None:
        """Receive into ``data`` from ``source`` and wait for it: straight from the ring, as
        Recv's fast path takes a message, when nothing else waits in matching; else posted."""
        inbox = self._fast_inboxes[source]
        matcher = self._matcher
        if inbox is not None and not matcher.posted and not matcher.unexpected and not self._busy:
            # (Recv's loop; kept inline there, where one call more costs every message)
            view = _bytes(data)
            self._busy = 1
            try:
                n = inbox.take_eager(view, tag)
                spins = self._fast_spins
                while n == RING_EMPTY and spins:
                    spins -= 1
                    n = inbox.take_eager(view, tag)
                direct = self._direct if n == NOT_EAGER else None
                if direct is not None:
                    n = direct.recv(inbox, view, tag)  # (Recv's: an RTS it may read)
            finally:
                self._busy = 0
            if n >= 0:
                if direct is not None:
                    self._settle_fin(source)
                return
            if n == RING_EMPTY and self._await_late(inbox, tag):
                self._coll_take(data, source, tag)  # (its packet is at the head now)
                return
        self._coll_wait(self._coll_recv(data, source, tag))

    def _settle_fin(self, peer: int) -> None:
        """``_settle`` for the FIN just sent to ``peer`` for a message received: if it was
        queued, it is the last packet in ``peer``'s queue."""
        progress = self._progress
        if progress is not None and progress.txq_pending:
            self._settle(peer, _last_queued(progress, peer))

    def _settle(self, peer: int, packet: Packet | None) -> None:
        """Wait until ``packet`` (``_last_queued``; None: none), queued by this rank for
        ``peer``, has gone into ``peer``'s ring. A collective's packet that found the ring
        full (a message, or the FIN of one received) goes out at this rank's next call into
        cma: left queued when the collective returned, it kept ``peer`` waiting in the
        collective until that call, for ever if none came (docs/guide.md section 7,
        "Nothing left queued"). Packets queued after it (a user's Isend, an UNMAP) are not
        waited for: ``peer`` may not need them."""
        progress = self._progress
        if packet is None or progress is None:
            return
        queue, world = progress.txq[peer], progress.world
        if any(p is packet for p in queue):
            progress.wait_until(lambda: all(p is not packet for p in queue) or world.has_closed(peer),
                                peer)

    def _coll_take_view(self, tmp: np.ndarray, source: int) -> np.ndarray:
        """Receive a message that will only be read (combined) from ``source``: a read-only
        view of the sender's own pages where it comes through xmap (no copy; ``_done_with``
        it once read: the sender's send completes then), else received into ``tmp``."""
        direct = self._direct
        n = tmp.nbytes
        if direct is None or direct.xmap is None or n < XMAP_HOP_FROM and n <= self._eager_limit \
                or not n:
            self._coll_take(tmp, source)
            return tmp
        inbox = self._fast_inboxes[source]
        got = self._view_from_ring(direct, inbox, COLLECTIVE_TAG, n)
        if isinstance(got, View):
            return self._as_incoming(got, tmp)
        if got.__class__ is int:
            if got == NOT_EAGER:  # (eager, or an RTS to copy)
                self._coll_take(tmp, source)
                return tmp
            if inbox is not None and self._await_late(inbox, COLLECTIVE_TAG):
                return self._coll_take_view(tmp, source)  # (its packet is at the head now)
        op = (self._progress or self._attach()).post_recv(source, COLLECTIVE_TAG, _bytes(tmp),
                                                           view=True)
        self._coll_wait(op)
        held, op.held = op.held, None
        return tmp if held is None else self._as_incoming(held, tmp)

    @staticmethod
    def _as_incoming(view: View, tmp: np.ndarray) -> np.ndarray:
        """``view`` shaped as ``tmp``; a shorter message (a program whose ranks disagree on
        the count: erroneous) is copied into ``tmp`` instead, as the copying paths leave it."""
        if view.nbytes == tmp.nbytes:
            return view.view(tmp.dtype).reshape(tmp.shape)
        _bytes(tmp)[: view.nbytes] = view.data
        view.release()
        return tmp

    def _done_with(self, incoming: np.ndarray, source: int) -> None:
        """Release what ``_coll_take_view`` returned from ``source``, if it was a view of
        its pages: its FIN goes at once, or, behind a full ring, once the ring has room."""
        if isinstance(incoming, View):
            incoming.release()
            self._settle_fin(source)

    def _coll_recv_object(self, source: int) -> Any:
        op = self._coll_recv(None, source)
        self._coll_wait(op)
        return self.load_object(op)

    def _coll_start(self, root: Any = None) -> int:
        """Attach if need be; ``root`` checked and returned as an int (mpi4py takes any
        integer, NumPy's too)."""
        if self._progress is None:
            self._attach()
        if root is None:
            return 0
        try:
            index = operator.index(root)
        except TypeError:
            index = -1
        if not 0 <= index < self.size:
            raise InvalidRank(f"root {root!r} is not in 0..{self.size - 1}")
        return index

    def _sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int) -> None:
        sending = self._coll_send(send, dest)  # (never blocks: a full ring queues it)
        self._coll_take(recv, source)
        self._coll_wait(sending)

    # -- broadcast

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """Broadcast ``buf`` from ``root`` to every rank (``MPI_Bcast``)."""
        root = self._coll_start(root)
        writable = self.rank != root
        last = self._last_bcast
        raw = last.get(buf, writable) if last is not None else None
        if raw is None:
            raw = _message(buf, writable).view(np.uint8)
            if raw.nbytes <= self._eager_limit:  # (where the 2-4 us show)
                self._last_bcast = KeptMessage.of(buf, raw)
        if self.size == 1 or not raw.size:  # (the count is every rank's: nothing to move)
            return
        if self.size == 2 and raw.size < BCAST_PIPELINE_FROM:
            # (the tree of two, not worked out: 0.6-0.9 us of a 64 KiB call, guide section 7)
            if self.rank == root:
                sending = self._coll_send(raw, 1 - root)
                if sending is not None:
                    self._coll_wait(sending)
            else:
                self._coll_take(raw, root)
        elif raw.size >= BCAST_SCATTER_FROM and self.size >= 3:
            if raw.size >= BCAST_FLAT_FROM and raw.size > self._eager_limit:
                self._bcast_flat(raw, root)
            else:
                self._bcast_scatter_allgather(raw, root)
        else:
            self._bcast_binomial(raw, root)

    def _bcast_flat(self, data: np.ndarray, root: int) -> None:
        """XHC's flat shape: the root offers the whole message to every reader at once, and
        each takes it out of the root's memory (or mapping) itself where it can; where it
        cannot (transport="shm"), the root's copies carry it, one reader after another."""
        if self.rank == root:
            self._coll_wait(*[self._coll_send(data, (root + i) % self.size, pull_first=True)
                              for i in range(1, self.size)])
        else:
            self._coll_take(data, root)

    def _bcast_binomial(self, data: np.ndarray, root: int) -> None:
        """Down a binomial tree from the root: a rank forwards each piece (the whole
        message, or BCAST_PIECE's) to its subtree once it has it."""
        size, vr = self.size, (self.rank - root) % self.size
        parent = None
        mask = 1
        while mask < size:
            if vr & mask:
                parent = (vr - mask + root) % size
                break
            mask <<= 1
        children = []
        mask >>= 1
        while mask:
            if vr + mask < size:
                children.append((vr + mask + root) % size)
            mask >>= 1
        n = data.size
        pieces: Sequence[np.ndarray] = (data,)
        if BCAST_PIPELINE_FROM <= n <= BCAST_PIPELINE_UNTIL and BCAST_PIECE <= self._eager_limit:
            pieces = [data[start : start + BCAST_PIECE] for start in range(0, n, BCAST_PIECE)]
        sends = []
        for piece in pieces:
            if parent is not None:
                self._coll_take(piece, parent)
            for child in children:
                sends.append(self._coll_send(piece, child))
        self._coll_wait(*sends)

    def _bcast_scatter_allgather(self, data: np.ndarray, root: int) -> None:
        """van de Geijn: the root sends block i to relative rank i, then the blocks are
        gathered by every rank: by recursive doubling over a power of two of ranks (log2 p
        steps: 1.1-2.3x faster than the chain at 4-16 ranks, docs/guide.md section 7, "Many
        ranks"), else along the chain 0 -> 1 -> ... -> size-1 (p - 1 steps). No block goes
        back to the root."""
        size, vr = self.size, (self.rank - root) % self.size
        cut = _cuts(data.size, size)

        def block(i: int) -> np.ndarray:
            i %= size
            return data[cut[i] : cut[i + 1]]

        if vr == 0:
            self._coll_wait(*[self._coll_send(block(i), (i + root) % size) for i in range(1, size)])
        else:
            self._coll_take(block(vr), root)
        if size & (size - 1) == 0:
            self._allgather_doubling(data, cut, vr, lambda v: (v + root) % size, whole=0)
            return
        right, left = (vr + 1 + root) % size, (vr - 1 + root) % size
        for step in range(size - 1):
            ops: list[SendOp | RecvOp | None] = []
            if vr != 0:
                ops.append(self._coll_recv(block(vr - step - 1), left))
            if vr != size - 1:
                ops.append(self._coll_send(block(vr - step), right))
            self._coll_wait(*ops)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root``; returns it on every rank."""
        root = self._coll_start(root)
        size, vr = self.size, (self.rank - root) % self.size
        mask = 1
        while mask < size:
            if vr & mask:
                obj = self._coll_recv_object((vr - mask + root) % size)
                break
            mask <<= 1
        sends = []
        mask >>= 1
        while mask:
            if vr + mask < size:
                sends.append(self._coll_send(None, (vr + mask + root) % size, obj))
            mask >>= 1
        self._coll_wait(*sends)
        return obj

    # -- reductions

    def _reduce_inputs(self, sendbuf: Any, recvbuf: Any, op: Any, *, result_here: bool
                       ) -> tuple[np.ndarray, np.ndarray | None, Op]:
        """(input, result buffer or None, op); the input is the result buffer for IN_PLACE.

        Kept for the next call given the same arrays and op, as Send keeps the view of the
        last array it sent: working them out took 2.7 us, more than an 8 B Sendrecv's share
        of a small Allreduce (docs/guide.md, "Collectives")."""
        last = self._last_inputs
        if last is not None and last[2] is op and last[3] == result_here:
            found = self._kept_inputs(last, sendbuf, recvbuf)
            if found is not None:
                return found
        found = self._work_out_inputs(sendbuf, recvbuf, op, result_here)
        source, result, ours = found
        if source.nbytes <= self._eager_limit:  # (where the 2-4 us show)
            in_place = _is_in_place(sendbuf)
            send_kept = None if in_place else KeptMessage.of(sendbuf, source)
            recv_kept = None if result is None else KeptMessage.of(recvbuf, result)
            if (send_kept is not None or in_place) and (recv_kept is not None or result is None):
                self._last_inputs = (send_kept, recv_kept, op, result_here, ours)
        return found

    @staticmethod
    def _kept_inputs(last: KeptInputs, sendbuf: Any, recvbuf: Any
                     ) -> tuple[np.ndarray, np.ndarray | None, Op] | None:
        """What ``last`` kept, if ``sendbuf`` and ``recvbuf`` name the same buffers."""
        send_kept, recv_kept, _, _, ours = last
        result = None
        if recv_kept is not None:
            result = recv_kept.get(recvbuf, True)
            if result is None:
                return None
        if send_kept is None:  # (IN_PLACE: the result is the input)
            return (result, result, ours) if result is not None and _is_in_place(sendbuf) else None
        source = send_kept.get(sendbuf, False)
        return None if source is None else (source, result, ours)

    def _work_out_inputs(self, sendbuf: Any, recvbuf: Any, op: Any, result_here: bool
                         ) -> tuple[np.ndarray, np.ndarray | None, Op]:
        ours = _array_op(op)
        result = _message(recvbuf, writable=True) if result_here else None
        if _is_in_place(sendbuf):
            if result is None:
                raise BufferError("IN_PLACE is for the rank that receives the result")
            source = result
        else:
            source = _message(sendbuf, writable=False)
        ours.check(source.dtype)
        return source, result, ours

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> None:
        """Combine every rank's ``sendbuf`` with ``op`` into ``recvbuf`` at ``root``
        (``MPI_Reduce``); ``recvbuf`` is ignored elsewhere. ``IN_PLACE`` as ``sendbuf`` at
        the root takes its input from ``recvbuf``."""
        root = self._coll_start(root)
        source, result, ours = self._reduce_inputs(sendbuf, recvbuf, op,
                                                   result_here=self.rank == root)
        cast: tuple[np.ndarray, np.ndarray] | None = None  # (recvbuf, the result to cast into it)
        if result is not None and result is not source:
            if result.size != source.size:
                raise BufferError(f"recvbuf holds {result.size} elements, sendbuf {source.size}")
            if result.dtype != source.dtype:
                # the other ranks send and combine in sendbuf's type: so does the root, which
                # casts the result into recvbuf at the end (as Allreduce casts its own)
                cast = (result, np.empty_like(source))
                result = cast[1]
        scatter = self.size > 1 and source.size and source.nbytes >= REDUCE_SCATTER_FROM
        # (a reduce-scatter reads its input where it lies)
        read_in_place = scatter and result is not source
        if result is not None and result is not source and not read_in_place:
            np.copyto(result, source)
        if scatter:
            acc = result if result is not None else np.empty_like(source)
            given = source if read_in_place else None
            if self._halves(source.nbytes):
                cut, newrank = self._reduce_scatter_halving(acc, ours, given)
                rem = self.size - (len(cut) - 1)
                owners = [self._paired_rank(i, rem) for i in range(len(cut) - 1)]
                self._gather_blocks(acc, cut, root, owners, newrank)
            else:
                cut = _cuts(acc.size, self.size)
                self._reduce_scatter_ring(acc, ours, cut, given)
                self._gather_blocks(acc, cut, root, range(self.size), self.rank)
        elif self.size > 1 and source.size:
            self._reduce_binomial(source, result, ours, root)
        if cast is not None:
            np.copyto(*cast)

    def _reduce_binomial(self, source: np.ndarray, result: np.ndarray | None, op: Op,
                         root: int) -> None:
        size, vr = self.size, (self.rank - root) % self.size
        acc = result if result is not None else source
        owned = result is not None  # acc may be written (else copy before the first combine)
        tmp: np.ndarray | None = None
        mask = 1
        while mask < size:
            if vr & mask:
                self._coll_wait(self._coll_send(acc, (vr - mask + root) % size))
                return
            if vr + mask < size:
                if tmp is None:
                    tmp = np.empty_like(acc)
                child = (vr + mask + root) % size
                incoming = self._coll_take_view(tmp, child)
                try:
                    if not owned:
                        acc, owned = acc.copy(), True
                    op.combine(acc, incoming)
                finally:
                    self._done_with(incoming, child)
            mask <<= 1

    def _reduce_scatter_ring(self, acc: np.ndarray, op: Op, cut: list[int],
                             source: np.ndarray | None = None, pieces: bool = False) -> None:
        """Ring reduce-scatter: afterwards block ``rank`` of ``acc`` (elements
        cut[rank]:cut[rank+1]) holds the combination of every rank's block. The input is
        ``acc`` itself, or ``source``: then ``acc`` needs no copy of it first, since each
        block of the input is read once, sent or combined into ``acc`` (a copy of 16 MiB
        took about a fifth of a 2-rank Allreduce's time: docs/guide.md section 7); the
        other blocks of ``acc`` are left partial or untouched. ``pieces``: at 2 ranks,
        blocks in RING_PIECE pieces where ``_in_pieces`` (an Allreduce's)."""
        size, rank = self.size, self.rank
        right, left = (rank + 1) % size, (rank - 1) % size
        if pieces and size == 2 and self._in_pieces(acc, cut):
            kept = slice(cut[rank], cut[rank + 1])
            self._exchange_pieces((acc if source is None else source)[cut[left] : cut[left + 1]],
                                  acc[kept], left, op, None if source is None else source[kept])
            return
        tmp = np.empty(max(cut[i + 1] - cut[i] for i in range(size)), acc.dtype)
        for step in range(size - 1):
            out, into = (rank - step - 1) % size, (rank - step - 2) % size
            incoming = tmp[: cut[into + 1] - cut[into]]
            # (block out was combined at the step before; at the first, it is the input's)
            sent = acc if source is None or step else source
            sending = self._coll_send(sent[cut[out] : cut[out + 1]], right)
            incoming = self._coll_take_view(incoming, left)
            try:
                if source is None:
                    op.combine(acc[cut[into] : cut[into + 1]], incoming)
                else:
                    op.combine_into(acc[cut[into] : cut[into + 1]],
                                    source[cut[into] : cut[into + 1]], incoming)
            finally:
                self._done_with(incoming, left)
            self._coll_wait(sending)

    def _reduce_scattered(self, source: np.ndarray, op: Op, cut: list[int]) -> np.ndarray:
        """The reduce-scatter of ``source`` into an array of its own (``source`` itself on
        one rank), whose block ``rank`` holds the result: by recursive halving over a power
        of two of ranks from 4 (log2 p steps, the ring's bytes), else by the ring."""
        size = self.size
        if size == 1:
            return source
        acc = np.empty_like(source)
        if size > 2 and size & (size - 1) == 0:
            self._reduce_scatter_halving(acc, op, source, cut)
        else:
            self._reduce_scatter_ring(acc, op, cut, source)
        return acc

    def _allgather_ring(self, data: np.ndarray, cut: list[int]) -> None:
        """Ring allgather in place (an Allreduce's second half): each rank starts with block
        ``rank`` (cut[rank]:cut[rank+1]) and ends with all; each block received goes
        straight to its place (at 2 ranks in pieces where ``_in_pieces``)."""
        size, rank = self.size, self.rank
        right, left = (rank + 1) % size, (rank - 1) % size
        if size == 2 and self._in_pieces(data, cut):
            self._exchange_pieces(data[cut[rank] : cut[rank + 1]], data[cut[left] : cut[left + 1]], left)
            return
        for step in range(size - 1):
            out, into = (rank - step) % size, (rank - step - 1) % size
            self._sendrecv(data[cut[out] : cut[out + 1]], right, data[cut[into] : cut[into + 1]], left)

    def _in_pieces(self, data: np.ndarray, cut: list[int]) -> bool:
        """Whether a 2-rank Allreduce's ring steps over ``data``'s blocks go by
        ``_exchange_pieces``: a block above the eager limit and at most RING_PIECES_UNTIL,
        pieces within the eager limit (the same on both ranks)."""
        block = max(cut[1] - cut[0], cut[2] - cut[1]) * data.itemsize
        return self._eager_limit < block <= RING_PIECES_UNTIL and RING_PIECE <= self._eager_limit

    def _exchange_pieces(self, out: np.ndarray, into: np.ndarray, peer: int, op: Op | None = None,
                         source: np.ndarray | None = None) -> None:
        """Send ``out`` to ``peer`` and receive its block into ``into`` (combined into it with
        ``op``, from ``source`` if given), each way in RING_PIECE pieces, piece i sent before
        piece i is taken, so that one rank copies out or combines a piece while the other
        copies the next in; except a way whose sender's block ``peer`` maps (xmap): whole,
        as a view. The two ranks first swap which of their blocks go whole (a byte each).
        A rank taking a whole block sends all its pieces first: the FIN of that block would
        otherwise come between them, and its peer's fast takes of the rest would give way
        to the engine (an extra copy each)."""
        direct = self._direct
        whole = direct is not None and direct.xmap is not None and direct.can_map(peer, _bytes(out))
        flags = np.array([whole], np.uint8)
        theirs = np.empty(1, np.uint8)
        self._sendrecv(flags, peer, theirs, peer)
        per = max(1, RING_PIECE // out.itemsize)
        outs = [out] if whole else [out[i : i + per] for i in range(0, out.size, per)]
        intos = [into] if theirs[0] else [into[i : i + per] for i in range(0, into.size, per)]
        tmp = None if op is None else np.empty(max(len(piece) for piece in intos), into.dtype)
        sends = [self._coll_send(piece, peer) for piece in outs] if theirs[0] else []
        for i in range(max(len(outs), len(intos))):
            if i < len(outs) and not theirs[0]:
                sends.append(self._coll_send(outs[i], peer))
            if i >= len(intos):
                continue
            piece = intos[i]
            if op is None:
                self._coll_take(piece, peer)
                continue
            assert tmp is not None
            incoming = self._coll_take_view(tmp[: piece.size], peer)
            try:
                if source is None:
                    op.combine(piece, incoming)
                else:
                    at = i * per  # (a whole block is piece 0)
                    op.combine_into(piece, source[at : at + piece.size], incoming)
            finally:
                self._done_with(incoming, peer)
        self._coll_wait(*sends)

    def _gather_blocks(self, data: np.ndarray, cut: list[int], root: int, owners: Sequence[int],
                       mine: int | None) -> None:
        """Block i of ``data`` (cut[i]:cut[i+1]), held by rank owners[i], to the same place
        in the root's ``data``; ``mine``: the block this rank holds (None: none)."""
        if self.rank == root:
            ops = [self._coll_recv(data[cut[i] : cut[i + 1]], r)
                   for i, r in enumerate(owners) if r != root]
            self._coll_wait(*ops)
        elif mine is not None:
            self._coll_wait(self._coll_send(data[cut[mine] : cut[mine + 1]], root))

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Combine every rank's ``sendbuf`` with ``op`` into every rank's ``recvbuf``
        (``MPI_Allreduce``); ``IN_PLACE`` as ``sendbuf`` takes the input from ``recvbuf``."""
        self._coll_start()
        source, result, ours = self._reduce_inputs(sendbuf, recvbuf, op, result_here=True)
        assert result is not None
        size = self.size
        # (a reduce-scatter and an allgather, by halving and doubling or by the ring)
        scatter = size > 1 and result.nbytes >= ALLREDUCE_SCATTER_FROM and result.size >= size
        halving = scatter and self._halves(result.nbytes)
        # These read the input where it lies (the first step sends it, and combines it with
        # what comes into the result), and so does doubling over a power of two of ranks,
        # unless it must be cast to the result's type.
        read_in_place = result is not source and result.dtype == source.dtype and size > 1 \
            and (scatter or size & (size - 1) == 0)
        if result is not source:
            if result.size != source.size:
                raise BufferError(f"recvbuf holds {result.size} elements, sendbuf {source.size}")
            if not read_in_place:
                np.copyto(result, source)
        if self.size == 1 or not result.size:
            return
        if halving:
            self._allreduce_halving(result, ours, source if read_in_place else None)
        elif scatter:
            cut = _cuts(result.size, size)
            self._reduce_scatter_ring(result, ours, cut, source if read_in_place else None,
                                      pieces=True)
            self._allgather_ring(result, cut)
        else:
            self._allreduce_doubling(result, ours, source if read_in_place else None)

    def _allreduce_doubling(self, acc: np.ndarray, op: Op, source: np.ndarray | None = None
                            ) -> None:
        """Recursive doubling; with a size that is no power of two, the first 2*rem ranks
        pair up first (evens hand their input to odds) and get the result back at the end.
        ``source`` (a power of two of ranks only): the input, where ``acc`` is not a copy of
        it yet; the first step sends it and combines it with what comes into ``acc``, so a
        partner may read it in place (xmap) while ``acc`` is written."""
        size, rank = self.size, self.rank
        pof2 = 1 << (size.bit_length() - 1)
        rem = size - pof2
        tmp = np.empty_like(acc)
        mask = 1
        if source is not None:
            assert rem == 0
            peer = rank ^ 1
            sending = self._coll_send(source, peer)
            incoming = self._coll_take_view(tmp, peer)
            try:
                # (lower rank's first, as combine_from_lower: both partners get the same bits)
                if peer < rank:
                    op.combine_into(acc, incoming, source)
                else:
                    op.combine_into(acc, source, incoming)
            finally:
                self._done_with(incoming, peer)
            self._coll_wait(sending)
            mask = 2
        newrank, _ = self._pair_first(acc, op, tmp, None)
        if newrank is None:
            self._coll_take(acc, rank + 1)
            return
        while mask < pof2:
            partner = newrank ^ mask
            peer = self._paired_rank(partner, rem)
            self._sendrecv(acc, peer, tmp, peer)
            if peer < rank:  # (both partners then combine in the same order: the same bits)
                op.combine_from_lower(acc, tmp)
            else:
                op.combine(acc, tmp)
            mask <<= 1
        if rank < 2 * rem:
            self._coll_wait(self._coll_send(acc, rank - 1))

    def _halves(self, nbytes: int) -> bool:
        """Whether a reduce-scatter of ``nbytes`` over 3 or more ranks goes by recursive
        halving, not by the ring: over a power of two of ranks, always (the same bytes a
        rank in log2 p steps where the ring takes p - 1); over 5 or more other counts below
        HALVING_UNTIL (their first 2 (p - 2^k) ranks pair up first: each odd one moves 2 n more);
        over 3, never (the pairing takes as many steps as the ring saves)."""
        size = self.size
        if size & (size - 1) == 0:
            return size > 2
        return size > 4 and nbytes < HALVING_UNTIL

    def _reduce_scatter_halving(self, acc: np.ndarray, op: Op, source: np.ndarray | None,
                                cut: list[int] | None = None) -> tuple[list[int], int | None]:
        """Rabenseifner's reduce-scatter by recursive halving: at each step a rank keeps one
        half of the blocks it still holds, sends the other half to its partner and combines
        the partner's copy of its own half into ``acc``. Over 2^k ranks of the 2^k + rem,
        the first 2 rem pairing up first (``_pair_first``). Returns (cut, newrank): block
        newrank of ``acc`` (elements cut[newrank]:cut[newrank+1], of 2^k blocks) holds the
        combination of every rank's; newrank is None at an even rank of a pair, which holds
        no block. ``source``: the input, where ``acc`` is not a copy of it yet, read in
        place (by the pair's step, or the first halving step). ``cut``: the blocks' bounds,
        when they are given (only over a power of two of ranks); else 2^k nearly equal
        blocks."""
        size, rank = self.size, self.rank
        pof2 = 1 << (size.bit_length() - 1)
        rem = size - pof2
        if cut is None:
            cut = _cuts(acc.size, pof2)
        if rank < 2 * rem:
            tmp = np.empty_like(acc)
        else:  # (the larger half)
            tmp = np.empty(max(cut[pof2 >> 1] - cut[0], cut[pof2] - cut[pof2 >> 1]), acc.dtype)
        newrank, source = self._pair_first(acc, op, tmp, source)
        if newrank is None:
            return cut, None
        lo, hi = 0, pof2  # the blocks this rank still holds
        mask = pof2 >> 1
        while mask:
            peer = self._paired_rank(newrank ^ mask, rem)
            mid = lo + mask
            if newrank & mask:
                out, lo = (lo, mid), mid
            else:
                out, hi = (mid, hi), mid
            keep = slice(cut[lo], cut[hi])
            sent = acc if source is None else source
            sending = self._coll_send(sent[cut[out[0]] : cut[out[1]]], peer)
            incoming = self._coll_take_view(tmp[: cut[hi] - cut[lo]], peer)
            try:
                # (each block is combined at one rank and copied to the others: no order to
                # agree on, as in the ring)
                if source is None:
                    op.combine(acc[keep], incoming)
                else:
                    op.combine_into(acc[keep], source[keep], incoming)
            finally:
                self._done_with(incoming, peer)
            self._coll_wait(sending)
            source = None
            mask >>= 1
        return cut, newrank

    def _pair_first(self, acc: np.ndarray, op: Op, tmp: np.ndarray, source: np.ndarray | None
                    ) -> tuple[int | None, np.ndarray | None]:
        """Over 2^k + rem ranks, the step before doubling or halving: the first 2 rem pair
        up, each even one handing its input (``source``, else ``acc``) to the odd one above
        it, which combines it into ``acc`` (the lower rank's first) using ``tmp`` (acc's
        size). Returns this rank's index among the 2^k that go on (None at an even rank of
        a pair) and the input still to be read in place (None once combined into ``acc``)."""
        rank = self.rank
        rem = self.size - (1 << (self.size.bit_length() - 1))
        if rank >= 2 * rem:
            return rank - rem, source
        if rank % 2 == 0:
            self._coll_wait(self._coll_send(acc if source is None else source, rank + 1))
            return None, source
        self._coll_take(tmp, rank - 1)
        if source is None:
            op.combine_from_lower(acc, tmp)
        else:
            op.combine_into(acc, tmp, source)
        return rank // 2, None

    @staticmethod
    def _paired_rank(newrank: int, rem: int) -> int:
        """The rank of ``newrank`` among the 2^k ranks left once the first 2 ``rem`` have
        paired up (doubling's and halving's): the odd rank of a pair, or one unpaired."""
        return newrank * 2 + 1 if newrank < rem else newrank + rem

    def _allreduce_halving(self, acc: np.ndarray, op: Op, source: np.ndarray | None) -> None:
        """Rabenseifner's Allreduce: ``_reduce_scatter_halving``, then an allgather by
        recursive doubling (log2 p steps each way, where the ring takes p - 1), then the
        odd rank of each pair hands the result to the even."""
        cut, newrank = self._reduce_scatter_halving(acc, op, source)
        if newrank is None:
            self._coll_take(acc, self.rank + 1)
            return
        rem = self.size - (len(cut) - 1)
        self._allgather_doubling(acc, cut, newrank, lambda r: self._paired_rank(r, rem))
        if self.rank < 2 * rem:
            self._coll_wait(self._coll_send(acc, self.rank - 1))

    def _allgather_doubling(self, data: np.ndarray, cut: list[int], index: int,
                            rank_of: Callable[[int], int], whole: int | None = None) -> None:
        """Recursive-doubling allgather in place over 2^k blocks of ``data`` (elements
        cut[i]:cut[i+1]), one held by each of 2^k ranks: this one holds block ``index``;
        ``rank_of(i)`` is the rank holding block i. At each step a rank swaps all it holds
        with the rank whose index differs in one bit: log2 of the blocks' count steps. The
        rank of index ``whole`` (a Bcast's root) holds every block already: it only sends,
        and its partners only receive, so no block goes back to it."""
        lo, hi = index, index + 1
        mask = 1
        while lo or hi < len(cut) - 1:
            partner = index ^ mask
            peer = rank_of(partner)
            other = (lo - mask, lo) if index & mask else (hi, hi + mask)
            mine, theirs = data[cut[lo] : cut[hi]], data[cut[other[0]] : cut[other[1]]]
            if index == whole:
                self._coll_wait(self._coll_send(mine, peer))
            elif partner == whole:
                self._coll_take(theirs, peer)
            else:
                self._sendrecv(mine, peer, theirs, peer)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Combine every rank's ``sendbuf`` (``size`` blocks of ``recvbuf``'s count) and
        leave block ``rank`` of the result in ``recvbuf`` (``MPI_Reduce_scatter_block``);
        ``IN_PLACE`` as ``sendbuf`` takes the input from ``recvbuf``, which then holds
        ``size`` blocks and gets the result in its first."""
        self._coll_start()
        ours = _array_op(op)
        if _is_in_place(sendbuf):
            data = _message(recvbuf, writable=True, blocks=self.size)
            count = data.size // self.size
            result = data[:count]
            source = data  # (into acc, not recvbuf: MPI leaves the rest of recvbuf as it was)
        else:
            result = _message(recvbuf, writable=True)
            count = result.size
            source = _message(sendbuf, writable=False, blocks=self.size)
            if source.size < count * self.size:
                raise BufferError(f"sendbuf holds {source.size} elements, needs {count * self.size}")
            source = _in_type_of(result, source[: count * self.size])
        ours.check(source.dtype)
        cut = [i * count for i in range(self.size + 1)]
        acc = self._reduce_scattered(source, ours, cut)
        mine = acc[cut[self.rank] : cut[self.rank + 1]]
        if mine.ctypes.data != result.ctypes.data:
            np.copyto(result, mine)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Sequence[int] | None = None,
                       op: Any = SUM) -> None:
        """Combine every rank's ``sendbuf`` (``sum(recvcounts)`` elements) and leave the
        ``rank``-th block of the result, ``recvcounts[rank]`` elements, in ``recvbuf``
        (``MPI_Reduce_scatter``). Without ``recvcounts`` each rank's count is the size of
        its ``recvbuf``, gathered from every rank (as mpi4py does). ``IN_PLACE`` as
        ``sendbuf`` takes the input from ``recvbuf`` and needs ``recvcounts``."""
        self._coll_start()
        ours = _array_op(op)
        in_place = _is_in_place(sendbuf)
        result = _message(recvbuf, writable=True)
        if recvcounts is not None:
            counts = [_count(c) for c in recvcounts]
        elif in_place:
            raise InvalidCount("Reduce_scatter with IN_PLACE needs recvcounts: recvbuf holds "
                               "the whole input, so its size is not this rank's count")
        else:
            counts = self.allgather(result.size)
        if len(counts) != self.size:
            raise InvalidCount(f"recvcounts has {len(counts)} counts for {self.size} ranks")
        total = sum(counts)
        if in_place:
            if result.size < total:
                raise BufferError(f"recvbuf holds {result.size} elements, the input is "
                                  f"sum(recvcounts) = {total}")
            source = result[:total]  # (into acc, not recvbuf: MPI leaves the rest as it was)
        else:
            if result.size != counts[self.rank]:
                raise BufferError(f"recvbuf holds {result.size} elements, recvcounts"
                                  f"[{self.rank}] is {counts[self.rank]}")
            source = _message(sendbuf, writable=False)
            if source.size != total:
                raise BufferError(f"sendbuf holds {source.size} elements, sum(recvcounts) is {total}")
            source = _in_type_of(result, source)
        ours.check(source.dtype)
        cut = [sum(counts[:i]) for i in range(self.size + 1)]
        acc = self._reduce_scattered(source, ours, cut)
        mine = acc[cut[self.rank] : cut[self.rank + 1]]
        np.copyto(result[: mine.size], mine)

    def _scan(self, sendbuf: Any, recvbuf: Any, op: Any, exclusive: bool) -> None:
        """Recursive doubling (MPICH's scan): ``partial`` combines the ranks of this rank's
        current group, ``result`` those of them below (Exscan) or up to (Scan) this rank.
        Nothing needs ``partial`` after the last round, so there the data goes up only
        (MPICH's goes both ways): at 2 ranks, the one round, half the bytes (docs/mpi.md,
        "Which library runs a collective", has the runs)."""
        self._coll_start()
        source, result, ours = self._reduce_inputs(sendbuf, recvbuf, op, result_here=True)
        assert result is not None
        if result.size != source.size:
            raise BufferError(f"recvbuf holds {result.size} elements, sendbuf {source.size}")
        if result.dtype != source.dtype:
            source = _in_type_of(result, source)
            ours.check(source.dtype)
        size, rank = self.size, self.rank
        have_result = not exclusive
        # (Scan's result starts as this rank's input: copied there with the first
        # combination, in one pass, or at the end if none comes)
        uncopied = have_result and result is not source
        partial, tmp = source, None  # (partial: copied before the first combination into it)
        last = 1 << ((size - 1).bit_length() - 1) if size > 1 else 0  # (the last round's mask)
        mask = 1
        while mask < size:
            peer = rank ^ mask
            if peer < size:
                if mask == last and peer > rank:
                    self._coll_wait(self._coll_send(partial, peer))
                    break
                if mask == last and not have_result:  # (Exscan's result is the lower group's)
                    self._coll_take(result, peer)
                    return
                if tmp is None:
                    tmp = np.empty_like(source)
                if mask == last:
                    self._coll_take(tmp, peer)
                else:
                    if partial is source:
                        partial = source.copy()
                    self._sendrecv(partial, peer, tmp, peer)
                    ours.combine(partial, tmp)
                if peer < rank:
                    if uncopied:
                        ours.combine_into(result, source, tmp)
                        uncopied = False
                    elif have_result:
                        ours.combine(result, tmp)
                    else:
                        np.copyto(result, tmp)
                        have_result = True
            mask <<= 1
        if uncopied:
            np.copyto(result, source)

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Inclusive prefix reduction: rank r gets ranks 0..r combined (``MPI_Scan``)."""
        self._scan(sendbuf, recvbuf, op, exclusive=False)

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Exclusive prefix reduction: rank r gets ranks 0..r-1 combined; rank 0's
        ``recvbuf`` is left as it was (``MPI_Exscan``)."""
        self._scan(sendbuf, recvbuf, op, exclusive=True)

    def reduce(self, sendobj: Any, op: Any = SUM, root: int = 0) -> Any:
        """Combine every rank's object with ``op`` (a cma op or any function of two
        objects), in rank order; the result at ``root``, None elsewhere."""
        root = self._coll_start(root)
        combine = _object_op(op)
        size, rank = self.size, self.rank
        acc = sendobj
        # A binomial tree over ranks as they are (rooted at 0), so that the combination
        # keeps rank order for operations that do not commute; then rank 0 -> root.
        mask = 1
        while mask < size:
            if rank & mask:
                self._coll_wait(self._coll_send(None, rank - mask, acc))
                break
            if rank + mask < size:
                acc = combine(acc, self._coll_recv_object(rank + mask))
            mask <<= 1
        if root != 0:
            if rank == 0:
                self._coll_wait(self._coll_send(None, root, acc))
            elif rank == root:
                acc = self._coll_recv_object(0)
        return acc if rank == root else None

    def allreduce(self, sendobj: Any, op: Any = SUM) -> Any:
        """``reduce`` to rank 0, then ``bcast``: every rank gets the combination."""
        return self.bcast(self.reduce(sendobj, op, 0), 0)

    # -- gather, scatter, allgather, alltoall

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Every rank's ``sendbuf`` to block ``rank`` of ``recvbuf`` at ``root``
        (``MPI_Gather``); ``IN_PLACE`` as the root's ``sendbuf``: its block is in place."""
        root = self._coll_start(root)
        if self.rank == root:
            data = _message(recvbuf, writable=True, blocks=self.size)
            count = data.size // self.size
            self._gatherv_root(sendbuf, data, [count] * self.size,
                               [i * count for i in range(self.size)], root)
        else:
            self._coll_wait(self._coll_send(_message(sendbuf, writable=False), root))

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``Gather`` with a count and displacement per rank in the root's v-form
        ``recvbuf`` (``MPI_Gatherv``)."""
        root = self._coll_start(root)
        if self.rank == root:
            data, counts, displs = _vmessage(recvbuf, writable=True, size=self.size)
            self._gatherv_root(sendbuf, data, counts, displs, root)
        else:
            self._coll_wait(self._coll_send(_message(sendbuf, writable=False), root))

    def _gatherv_root(self, sendbuf: Any, data: np.ndarray, counts: list[int],
                      displs: list[int], root: int) -> None:
        ops = [self._coll_recv(data[displs[r] : displs[r] + counts[r]], r)
               for r in range(self.size) if r != root]
        if not _is_in_place(sendbuf):
            _copy_bytes(data[displs[root] : displs[root] + counts[root]],
                        _message(sendbuf, writable=False))
        self._coll_wait(*ops)

    # Scatter(v) mirrors Gather(v) line for line (sends where those receive): kept as two
    # readable definitions rather than one parametrised by direction.
    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Block ``r`` of the root's ``sendbuf`` to rank r's ``recvbuf`` (``MPI_Scatter``);
        ``IN_PLACE`` as the root's ``recvbuf``: its block stays where it is."""
        root = self._coll_start(root)
        if self.rank == root:
            data = _message(sendbuf, writable=False, blocks=self.size)
            count = data.size // self.size
            self._scatterv_root(data, [count] * self.size, [i * count for i in range(self.size)],
                                recvbuf, root)
        else:
            self._coll_wait(self._coll_recv(_message(recvbuf, writable=True), root))

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``Scatter`` with a count and displacement per rank in the root's v-form
        ``sendbuf`` (``MPI_Scatterv``)."""
        root = self._coll_start(root)
        if self.rank == root:
            data, counts, displs = _vmessage(sendbuf, writable=False, size=self.size)
            self._scatterv_root(data, counts, displs, recvbuf, root)
        else:
            self._coll_wait(self._coll_recv(_message(recvbuf, writable=True), root))

    def _scatterv_root(self, data: np.ndarray, counts: list[int], displs: list[int],
                       recvbuf: Any, root: int) -> None:
        ops = [self._coll_send(data[displs[r] : displs[r] + counts[r]], r)
               for r in range(self.size) if r != root]
        if not _is_in_place(recvbuf):
            _copy_bytes(_message(recvbuf, writable=True),
                        data[displs[root] : displs[root] + counts[root]])
        self._coll_wait(*ops)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Every rank's ``sendbuf`` to block ``rank`` of every rank's ``recvbuf``
        (``MPI_Allgather``); ``IN_PLACE`` as ``sendbuf``: each rank's block is in place."""
        self._coll_start()
        data = _message(recvbuf, writable=True, blocks=self.size)
        count = data.size // self.size
        self._allgatherv(sendbuf, data, [count] * self.size, [i * count for i in range(self.size)])

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        """``Allgather`` with a count and displacement per rank in the v-form ``recvbuf``
        (``MPI_Allgatherv``)."""
        self._coll_start()
        data, counts, displs = _vmessage(recvbuf, writable=True, size=self.size)
        self._allgatherv(sendbuf, data, counts, displs)

    def _allgatherv(self, sendbuf: Any, data: np.ndarray, counts: list[int],
                    displs: list[int]) -> None:
        """By recursive doubling when the ranks are a power of two (4 or more: log2 p
        steps, the ring's bytes, docs/guide.md section 7, "Many ranks"), through a scratch
        array where this rank's blocks do not lie end to end in rank order; else along a
        ring (p - 1 steps)."""
        size, rank = self.size, self.rank

        def block(r: int) -> np.ndarray:
            r %= size
            return data[displs[r] : displs[r] + counts[r]]

        if not _is_in_place(sendbuf):
            _copy_bytes(block(rank), _message(sendbuf, writable=False))
        if not any(counts):  # (the counts are every rank's: nothing to move)
            return
        if size > 2 and size & (size - 1) == 0:
            # (chosen by size alone: the counts agree across ranks, each rank's displs not)
            cut = list(itertools.accumulate(counts, initial=0))
            end_to_end = all(displs[r] - displs[0] == cut[r] for r in range(size))
            whole = data[displs[0] : displs[0] + cut[-1]] if end_to_end else np.empty(cut[-1], data.dtype)
            if not end_to_end:
                np.copyto(whole[cut[rank] : cut[rank + 1]], block(rank))
            self._allgather_doubling(whole, cut, rank, lambda r: r)
            if not end_to_end:
                for r in range(size):
                    np.copyto(block(r), whole[cut[r] : cut[r + 1]])
            return
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            self._sendrecv(block(rank - step), right, block(rank - step - 1), left)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block ``d`` of each rank's ``sendbuf`` to block ``rank`` of rank d's ``recvbuf``
        (pairwise exchange; ``MPI_Alltoall``). ``IN_PLACE`` as ``sendbuf`` sends from
        ``recvbuf`` (from a copy of it)."""
        self._coll_start()
        # (counted in bytes: the two specs may name the blocks in different element
        # types, as MPI allows where their type signatures match)
        recv = _message(recvbuf, writable=True, blocks=self.size).view(np.uint8)
        block = recv.size // self.size
        layout = ([block] * self.size, [i * block for i in range(self.size)])
        if _is_in_place(sendbuf):
            send = recv.copy()
        else:
            send = _message(sendbuf, writable=False, blocks=self.size).view(np.uint8)
            if send.size // self.size != block:
                send = send[: block * self.size]
        if block:  # (every rank's: with none, nothing to move)
            self._alltoallv(send, layout, recv, layout)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        """``Alltoall`` with counts and displacements per rank in v-form ``sendbuf`` and
        ``recvbuf`` (``MPI_Alltoallv``; ``IN_PLACE`` as ``sendbuf``: recvbuf's layout)."""
        self._alltoall_specs(sendbuf, recvbuf, _vmessage)

    def Alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:
        """``Alltoallv`` with a datatype per rank and displacements in bytes, in w-form
        ``sendbuf`` and ``recvbuf`` (``MPI_Alltoallw``; ``IN_PLACE`` as ``sendbuf``:
        recvbuf's layout). The blocks move as bytes: as in MPI, what rank s sends to d
        must have the type signature d expects from s."""
        self._alltoall_specs(sendbuf, recvbuf, _wmessage)

    def _alltoall_specs(self, sendbuf: Any, recvbuf: Any,
                        read: Callable[..., tuple[np.ndarray, list[int], list[int]]]) -> None:
        """Alltoallv/w: both specs read by ``read`` (IN_PLACE: recvbuf's, sent from a copy)."""
        self._coll_start()
        recv, rcounts, rdispls = read(recvbuf, writable=True, size=self.size)
        if _is_in_place(sendbuf):
            send, scounts, sdispls = recv.copy(), rcounts, rdispls
        else:
            send, scounts, sdispls = read(sendbuf, writable=False, size=self.size)
        self._alltoallv(send, (scounts, sdispls), recv, (rcounts, rdispls))

    def _alltoallv(self, send: np.ndarray, send_layout: tuple[list[int], list[int]],
                   recv: np.ndarray, recv_layout: tuple[list[int], list[int]]) -> None:
        size, rank = self.size, self.rank
        (scounts, sdispls), (rcounts, rdispls) = send_layout, recv_layout

        def sent(r: int) -> np.ndarray:
            return send[sdispls[r] : sdispls[r] + scounts[r]]

        def received(r: int) -> np.ndarray:
            return recv[rdispls[r] : rdispls[r] + rcounts[r]]

        _copy_bytes(received(rank), sent(rank))
        for step in range(1, size):
            dest, source = (rank + step) % size, (rank - step) % size
            self._sendrecv(sent(dest), dest, received(source), source)

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's object, in rank order, as a list at ``root``; None elsewhere."""
        root = self._coll_start(root)
        if self.rank != root:
            self._coll_wait(self._coll_send(None, root, sendobj))
            return None
        return [sendobj if r == root else self._coll_recv_object(r) for r in range(self.size)]

    def scatter(self, sendobj: Sequence[Any] | None, root: int = 0) -> Any:
        """Item ``r`` of the root's sequence of ``size`` objects to rank r."""
        root = self._coll_start(root)
        if self.rank != root:
            return self._coll_recv_object(root)
        items = list(sendobj) if sendobj is not None else []
        if len(items) != self.size:
            raise CmaError(f"scatter needs a sequence of {self.size} objects at the root, "
                           f"got {len(items)}")
        ops = [self._coll_send(None, r, items[r]) for r in range(self.size) if r != root]
        self._coll_wait(*ops)
        return items[root]

    def allgather(self, sendobj: Any) -> list[Any]:
        """Every rank's object, in rank order, as a list on every rank."""
        return self.bcast(self.gather(sendobj, 0), 0)

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        """Item ``d`` of each rank's sequence to rank d; returns the items sent to this
        rank, in rank order."""
        self._coll_start()
        items = list(sendobj)
        if len(items) != self.size:
            raise CmaError(f"alltoall needs a sequence of {self.size} objects, got {len(items)}")
        out: list[Any] = [None] * self.size
        out[self.rank] = items[self.rank]
        for step in range(1, self.size):
            dest, source = (self.rank + step) % self.size, (self.rank - step) % self.size
            recv = self._coll_recv(None, source)
            self._coll_wait(recv, self._coll_send(None, dest, items[dest]))
            out[source] = self.load_object(recv)
        return out

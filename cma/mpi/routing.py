"""Which library runs a collective of an all-on-node communicator: cma's or the wrapped
MPI communicator's, by collective, rank count and message size, each where it was
measured faster (docs/mpi.md, "Which library runs a collective").

Every rank must choose alike, or one waits in cma for peers that wait in MPI. So the
choice rests only on what every rank knows the same: the rank count, the mode (checked
equal when the communicator is made) and the size a collective's type signatures agree
on (``AGREED_BYTES``). The object forms have no such size: each rank measures the object
it holds, and MPI's own call carries a mark in place of a large one to the ranks that
must follow it into cma (``ObjectWindow``). The v-forms but Allgatherv have no window
(MPI's in auto).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import operator
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias, cast

import numpy as np
from mpi4py import MPI

from ..collectives import IN_PLACE, _dtype, _message, _vmessage, mpi_datatype_constants
from ..comm import PLAIN_PICKLES
from .specs import as_bytes, as_packed_unfilled

ENV_COLLECTIVES = "CMA_MPI_COLLECTIVES"
AUTO = "auto"  # by the measured table below
CMA = "cma"  # every collective cma has through cma (tests, and measuring cma's own)
MPI_ONLY = "mpi"  # every collective through MPI; point-to-point still through cma
MODES = (AUTO, CMA, MPI_ONLY)

# A window: bounds in bytes, from, until[, from, until ...]: cma runs the sizes in each
# [from, until), MPI the others.
EVERY_SIZE = (0, 1 << 62)
NO_SIZE = (0, 0)

KIB, MIB = 1 << 10, 1 << 20

# Where cma's collective beat MPICH's on this machine kind (2 CPUs; from 3 ranks both
# libraries oversubscribed), per collective: rows of (up to this many ranks, window); the
# first row that holds the rank count decides; past the last row, and for a collective
# not listed, MPI runs every size: MPI's unless measured slower. The size is the one
# cma-bench and OSU's benchmarks print: a Bcast's or a reduction's message, a Gather's,
# Allgather's or Alltoall's block per rank. Measured with cma-bench (each size median of
# 3 runs, both orders) and mpi4py's OSU demos; where they disagreed, the later start
# (docs/mpi.md, "Which library runs a collective"; docs/figures/routing-2026-12-04.txt).
WINDOWS: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {
    # (from 1 MiB cma's flat Bcast: cma-bench, 2026-12-05, both orders; at 3 ranks from
    # 16 MiB: mpi4py's osu_bcast demo read cma 0.80-0.97 of MPI's bandwidth at 4-8 MiB, quiet)
    "Bcast": ((2, (32 * KIB, EVERY_SIZE[1])), (3, (16 * MIB, EVERY_SIZE[1])),
              (4, (4 * MIB, EVERY_SIZE[1])),
              (8, (32 * KIB, 256 * KIB, MIB, EVERY_SIZE[1])),
              (16, (64 * KIB, 256 * KIB, MIB, EVERY_SIZE[1]))),
    "Reduce": ((2, (16 * KIB, EVERY_SIZE[1])), (4, (16 * KIB, MIB)), (8, (16 * KIB, 256 * KIB)),
               (16, (32 * KIB, 256 * KIB))),
    "Allreduce": ((2, (16 * KIB, EVERY_SIZE[1])),),
    "Allgather": ((2, (512 * KIB, EVERY_SIZE[1])),),
    "Allgatherv": ((2, (512 * KIB, EVERY_SIZE[1])),),  # (Allgather's algorithm, Allgather's window)
    # (cma's scan sends its last round one way: cma-bench, 2026-12-05, both orders)
    **dict.fromkeys(("Scan", "Exscan"), ((2, (8 * KIB, EVERY_SIZE[1])), (4, (4 * MIB, EVERY_SIZE[1])),
                                         (8, (8 * MIB, EVERY_SIZE[1])))),
    # (mpi4py's osu_scatter demo at 8 ranks: 1.3-2.5x faster from 512 KiB; at 2 ranks
    # 2-5x slower at every size)
    "Scatter": ((4, NO_SIZE), (8, (512 * KIB, EVERY_SIZE[1]))),
    # the object forms, from the size of the object a rank holds (ObjectWindow: open-ended
    # windows, one rank's large object is enough); measured at 2 ranks only (docs/mpi.md,
    # "Which library runs a collective", has the runs)
    "bcast": ((1 << 30, (256 * KIB, EVERY_SIZE[1])),),
    **dict.fromkeys(("reduce", "allreduce", "gather", "scatter", "allgather", "alltoall"),
                    ((1 << 30, (4 * MIB, EVERY_SIZE[1])),)),
}


def mode_of(text: str) -> str:
    """The mode ``CMA_MPI_COLLECTIVES`` names (empty: AUTO)."""
    mode = text.strip().lower() or AUTO
    if mode not in MODES:
        raise ValueError(f"{ENV_COLLECTIVES}={text!r} must be one of {', '.join(MODES)}")
    return mode


def env_mode_text() -> str:
    return os.environ.get(ENV_COLLECTIVES, "")


# whether MPI runs a call (given the communicator and the call's arguments), or an
# ObjectWindow, which runs an object collective itself
Route: TypeAlias = "Callable[[MPI.Intracomm, tuple[Any, ...], dict[str, Any]], bool] | ObjectWindow"


def routes(mode: str, size: int, names: Sequence[str]) -> dict[str, Route]:
    """For each of ``names`` that MPI runs at some size on ``size`` ranks in ``mode``:
    given the communicator and a call's arguments, whether MPI runs it (``always_mpi``, a
    ``Window``, or an ``ObjectWindow``). The others cma runs at every size."""
    chosen: dict[str, Route] = {}
    for name in names:
        if mode == CMA:
            continue
        rows = () if mode == MPI_ONLY else WINDOWS.get(name, ())
        window = next((window for ranks, window in rows if size <= ranks), NO_SIZE)
        if window == EVERY_SIZE:
            continue
        if window == NO_SIZE:
            chosen[name] = always_mpi
            continue
        if name in OBJECT_HELD:
            # (open-ended: one rank's object past the start sends the call to cma)
            assert window[1:] == EVERY_SIZE[1:], f"{name}: an object window has no end"
            chosen[name] = ObjectWindow(name, window[0])
        else:
            chosen[name] = Window(AGREED_BYTES[name], size, window)  # (a size every rank agrees on)
    return chosen


def always_mpi(comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The route of a collective that MPI runs at every size."""
    return True


class Window:
    """The route of a collective that cma runs at the sizes in its ``bounds`` (from,
    until[, from, until ...]), MPI elsewhere."""

    __slots__ = ("agreed", "size", "bounds")

    def __init__(self, agreed: Callable[[tuple[Any, ...], dict[str, Any], int], int], size: int,
                 bounds: tuple[int, ...]) -> None:
        self.agreed, self.size, self.bounds = agreed, size, bounds

    def __call__(self, comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        nbytes = self.agreed(args, kwargs, self.size)
        # (a spec cma refuses: cma's collective raises its error, as it did before routes)
        return nbytes >= 0 and not self.holds(nbytes)

    def holds(self, nbytes: int) -> bool:
        """Whether cma runs a message of ``nbytes``: it lies in one of the [from, until)."""
        return bisect.bisect_right(self.bounds, nbytes) & 1 == 1


class _ThroughCma:
    """What a rank sends through MPI in place of a large object: the ranks that receive
    it run the call again through cma (pickled by name: ``MPI.pickle`` brings back the
    one instance, where it is pickle or a pickler like it, which ``_marks_survive``
    checks)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "THROUGH_CMA"

    def __repr__(self) -> str:
        return "THROUGH_CMA"


THROUGH_CMA = _ThroughCma()


class _LargeAt(int):
    """In a reduce through MPI: the rank whose large object the root takes through cma
    (a class of its own: a user's objects may be ints)."""

    __slots__ = ()


class _Pair(tuple[Any, Any]):
    """In a reduce through MPI: a combination left to the root, one side holding a
    ``_LargeAt``; the root combines the pairs as MPI's reduce paired them, so the
    grouping, and a float's rounding, is mpi4py's."""

    __slots__ = ()


def _marks_survive() -> bool:
    """Whether ``MPI.pickle`` brings the marks back as they went (a JSON or msgpack
    pickler would not; then no rank sends one, every rank having the same pickler, and
    the call is MPI's whatever the size). Checked where a rank is about to mark, again
    only once the pickler, its protocol or its threshold changed (the check took 6 us:
    a tenth of a 256 KiB bcast; installing another pickler with ``MPI.pickle.__init__``
    sets the protocol to None unless given one)."""
    pickler = MPI.pickle
    key = (pickler, pickler.PROTOCOL, pickler.THRESHOLD)
    if _PICKLER_CHECKED[0] != key:
        marks = (THROUGH_CMA, _Pair((_LargeAt(1), 2)))
        try:
            back = pickler.loads(pickler.dumps(marks))
            survive = (back[0] is THROUGH_CMA and back[1].__class__ is _Pair
                       and back[1][0].__class__ is _LargeAt and back[1] == marks[1])
        except Exception:
            survive = False
        _PICKLER_CHECKED[:] = [key, survive]
    return bool(_PICKLER_CHECKED[1])


_PICKLER_CHECKED: list[Any] = [None, False]  # (the pickler last checked, and its answer)


class ObjectWindow:
    """The route of an object collective: cma carries an object of ``start`` bytes or
    more (``pickled_bytes``, as the rank holding it measures it; the root alone for bcast
    and scatter), MPI the rest, with no call to agree first: MPI's own call carries a
    mark in place of each large object, and the ranks that receive one go on through
    cma. bcast, scatter, allgather, alltoall and allreduce mark with ``THROUGH_CMA``,
    whose receivers run the whole call again through cma (allreduce's op passes it on);
    in a gather the mark's place names the rank, in a reduce ``_LargeAt`` does, and only
    those objects go to the root through cma. So a call of small objects costs mpi4py's
    own and a measure (docs/mpi.md, "Which library runs a collective", has the costs)."""

    __slots__ = ("name", "held", "start", "_run", "_lock")

    def __init__(self, name: str, start: int) -> None:
        self.name, self.held, self.start = name, OBJECT_HELD[name], start
        self._run = _OBJECT_RUNS[name]
        self._lock: tuple[MPI.Intracomm, Any] | None = None  # (the last communicator's)

    def is_large(self, held: Any) -> bool:
        """Whether this rank's object (``self.held`` of the call's arguments) goes
        through cma; also where it cannot be pickled whole (a generator, which cma's
        scatter takes item by item; an object that refuses): cma's collective then takes
        it or raises, as before routes (a rank that raised here would leave its peers
        waiting in MPI). Never where the marks would not come back through MPI."""
        try:
            large = pickled_bytes(held) >= self.start
        except Exception:
            large = True
        return large and _marks_survive()

    def run(self, comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any],
            through_mpi: Callable[..., Any], through_cma: Callable[..., Any]) -> Any:
        """The call, routed; MPI's call and cma's under one lock per communicator and
        name, so that threads of a rank calling the same collective at once cannot pair
        one rank's MPI call with another's cma call (as mpi4py's own lock keeps its two
        MPI calls of a gather together)."""
        kept = self._lock  # (looked up again only for another communicator: 0.35 us)
        if kept is None or kept[0] is not comm:
            kept = self._lock = (comm, _route_lock(comm, self.name))
        with kept[1]:
            return self._run(self, comm, args, kwargs, through_mpi, through_cma)


# (gather and reduce move single objects through the communicator, MovesObjects: their
# runs take through_cma for the one signature)
_ObjectRun = Callable[[ObjectWindow, MPI.Intracomm, tuple[Any, ...], dict[str, Any],
                       Callable[..., Any], Callable[..., Any]], Any]


def _root(args: tuple[Any, ...], kwargs: dict[str, Any], at: int) -> int:
    """The call's root, as an int (mpi4py takes any integer, NumPy's too; its default 0)."""
    root = _arg(args, kwargs, at, "root")
    return 0 if root is None else operator.index(root)


def _op(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A reduce's or allreduce's op, mpi4py's default where the call gives none."""
    op = _arg(args, kwargs, 1, "op")
    return MPI.SUM if op is None else op


def _sending(args: tuple[Any, ...], kwargs: dict[str, Any], obj: Any,
             op: Any = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with ``obj`` for its object (and ``op`` for its op, if
    given), the rest as they were, so that mpi4py checks them as it would."""
    if args:
        args = (obj, *args[1:])
    elif "sendobj" in kwargs:
        kwargs = {**kwargs, "sendobj": obj}
    if op is not None:
        if len(args) > 1:
            args = (args[0], op, *args[2:])
        else:
            kwargs = {**kwargs, "op": op}
    return args, kwargs


def _rooted(route: ObjectWindow, comm: MPI.Intracomm, args: tuple[Any, ...],
            kwargs: dict[str, Any], through_mpi: Callable[..., Any],
            through_cma: Callable[..., Any]) -> Any:
    """bcast and scatter: the root alone decides; a large object's place in MPI's call
    goes to THROUGH_CMA (scatter's: one to each rank)."""
    root = _root(args, kwargs, 1)
    if MPI.Comm.Get_rank(comm) == root:
        if not route.is_large(route.held(args, kwargs)):
            return through_mpi(*args, **kwargs)
        mark = THROUGH_CMA if route.name == "bcast" else [THROUGH_CMA] * MPI.Comm.Get_size(comm)
        through_mpi(mark, root)
        return through_cma(*args, **kwargs)
    got = through_mpi(*args, **kwargs)
    return through_cma(*args, **kwargs) if got is THROUGH_CMA else got


def _each_rank(route: ObjectWindow, comm: MPI.Intracomm, args: tuple[Any, ...],
               kwargs: dict[str, Any], through_mpi: Callable[..., Any],
               through_cma: Callable[..., Any]) -> Any:
    """allgather and alltoall: a rank holding a large object sends THROUGH_CMA to every
    rank, so every rank sees one. (Where the ranks' objects straddle the start, the small
    ones cross twice: through MPI, then with the large ones through cma.)"""
    if route.is_large(route.held(args, kwargs)):
        through_mpi(THROUGH_CMA if route.name == "allgather"
                    else [THROUGH_CMA] * MPI.Comm.Get_size(comm))
        return through_cma(*args, **kwargs)
    got = through_mpi(*args, **kwargs)
    for item in got:  # (a loop: 0.2 us less than any() here)
        if item is THROUGH_CMA:
            return through_cma(*args, **kwargs)
    return got


def _allreduced(route: ObjectWindow, comm: MPI.Intracomm, args: tuple[Any, ...],
                kwargs: dict[str, Any], through_mpi: Callable[..., Any],
                through_cma: Callable[..., Any]) -> Any:
    """allreduce: THROUGH_CMA combined with anything is THROUGH_CMA, and every rank
    gets the combination."""
    op = _op(args, kwargs)

    def passing_on(a: Any, b: Any) -> Any:
        return THROUGH_CMA if a is THROUGH_CMA or b is THROUGH_CMA else op(a, b)

    sendobj = route.held(args, kwargs)
    sent_args, sent_kwargs = _sending(args, kwargs, THROUGH_CMA if route.is_large(sendobj)
                                      else sendobj, passing_on)
    got = through_mpi(*sent_args, **sent_kwargs)
    return through_cma(*args, **kwargs) if got is THROUGH_CMA else got


class MovesObjects(Protocol):
    """A communicator that moves single objects to the root of a gather or reduce
    through cma (cma.mpi.Comm)."""

    def _objects_from(self, ranks: Sequence[int], root: int) -> list[Any]: ...

    def _object_to(self, obj: Any, root: int) -> None: ...


def _gathered(route: ObjectWindow, comm: MPI.Intracomm, args: tuple[Any, ...],
              kwargs: dict[str, Any], through_mpi: Callable[..., Any],
              through_cma: Callable[..., Any]) -> Any:
    """gather: a rank holding a large object sends THROUGH_CMA through MPI, then its
    object to the root through cma; the root takes those into their places (its own as
    it is, as cma's gather gives it)."""
    sendobj = route.held(args, kwargs)
    large = route.is_large(sendobj)
    sent_args, sent_kwargs = _sending(args, kwargs, THROUGH_CMA) if large else (args, kwargs)
    got = through_mpi(*sent_args, **sent_kwargs)
    if got is None:  # (a rank other than the root)
        if large:
            cast(MovesObjects, comm)._object_to(sendobj, _root(args, kwargs, 1))
        return got
    root = _root(args, kwargs, 1)
    if large:
        got[root] = sendobj
    for item in got:  # (a loop: the usual list has no mark, and a comprehension costs more)
        if item is THROUGH_CMA:
            marked = [rank for rank, item in enumerate(got) if item is THROUGH_CMA]
            pulled = cast(MovesObjects, comm)._objects_from(marked, root)
            for rank, obj in zip(marked, pulled, strict=True):
                got[rank] = obj
            break
    return got


def _reduced(route: ObjectWindow, comm: MPI.Intracomm, args: tuple[Any, ...],
             kwargs: dict[str, Any], through_mpi: Callable[..., Any],
             through_cma: Callable[..., Any]) -> Any:
    """reduce: a rank holding a large object passes ``_LargeAt(rank)`` through MPI's
    reduce, whose op leaves each combination that holds one as a ``_Pair``; then it
    sends its object to the root through cma, which takes each such object as it comes
    to it and combines the pairs as MPI paired them."""
    op = _op(args, kwargs)

    def pairing(a: Any, b: Any) -> Any:
        if a.__class__ in _HELD_BACK or b.__class__ in _HELD_BACK:
            return _Pair((a, b))
        return op(a, b)

    sendobj = route.held(args, kwargs)
    large = route.is_large(sendobj)
    mine = _LargeAt(MPI.Comm.Get_rank(comm)) if large else sendobj
    sent_args, sent_kwargs = _sending(args, kwargs, mine, pairing)
    got = through_mpi(*sent_args, **sent_kwargs)
    if got.__class__ in _HELD_BACK:  # (the root, some rank's object large)
        return _combined(got, op, sendobj, _root(args, kwargs, 2), cast(MovesObjects, comm))
    if large:  # (a rank other than the root: the root's own would have come back marked)
        cast(MovesObjects, comm)._object_to(sendobj, _root(args, kwargs, 2))
    return got


def _combined(got: Any, op: Any, sendobj: Any, root: int, moves: MovesObjects) -> Any:
    """What a reduce's root makes of the pairs MPI left it: each large object taken
    through cma as the walk comes to it (its own as it is), combined as MPI paired."""
    if got.__class__ is _Pair:
        return op(_combined(got[0], op, sendobj, root, moves),
                  _combined(got[1], op, sendobj, root, moves))
    if got.__class__ is _LargeAt:
        return sendobj if got == root else moves._objects_from([int(got)], root)[0]
    return got


_HELD_BACK = (_LargeAt, _Pair)


_OBJECT_RUNS: dict[str, _ObjectRun] = {
    "bcast": _rooted, "scatter": _rooted, "allgather": _each_rank, "alltoall": _each_rank,
    "allreduce": _allreduced, "gather": _gathered, "reduce": _reduced,
}


# mpi4py serialises each communicator's object collectives per name with a lock from this
# table (threads calling bcast at once); through cma they take the same lock.
LOCK_TABLE: Callable[[MPI.Comm], dict[Any, Any]] | None = getattr(MPI, "_comm_lock_table", None)


def _route_lock(comm: MPI.Intracomm, name: str) -> Any:
    """This communicator's lock for routing ``name`` (a key of its own: the cma path
    takes mpi4py's ``name`` lock inside it, which does not nest)."""
    if LOCK_TABLE is None:
        return contextlib.nullcontext()
    return LOCK_TABLE(comm).setdefault(("cma.mpi.route", name), threading.Lock())


def pickled_bytes(obj: Any) -> int:
    """Bytes of ``obj`` pickled as cma sends it (protocol 5: a buffer such as an array's
    data travels beside the pickle, counted without a copy), or about that: an array's or
    a bytes object's or a str's own size, a number's 0 (pickling a NumPy array only to
    measure it took 5.6 us). Each rank decides by its own measure, so it need only be
    cheap: the type tests come in the order of the usual messages' types."""
    kind = obj.__class__
    if kind in PLAIN_PICKLES:
        return len(obj) if kind is str else 0
    if kind is np.ndarray and not obj.dtype.hasobject:
        return obj.nbytes
    if kind is dict and len(obj) <= _PARTS:
        for value in obj.values():
            if value.__class__ is np.ndarray:
                # (a small dict holding an array, the usual message, by its parts: measured
                # without pickling the array)
                return sum(map(pickled_bytes, obj)) + sum(map(pickled_bytes, obj.values()))
    elif isinstance(obj, np.generic) or isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
        return int(obj.nbytes)
    elif isinstance(obj, (bytes, bytearray)):
        return len(obj)
    buffers: list[pickle.PickleBuffer] = []
    nbytes = len(pickle.dumps(obj, protocol=5, buffer_callback=buffers.append))
    for buffer in buffers:
        nbytes += buffer.raw().nbytes
    return nbytes


_PARTS = 16  # (a larger dict is pickled whole: measuring its parts one by one costs more)


def _object_sent(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("sendobj")


def _object_broadcast(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("obj")


# what each object collective's ObjectWindow measures on a rank (scatter's root: its
# whole sequence, what it sends in all)
OBJECT_HELD: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    "bcast": _object_broadcast,
    **dict.fromkeys(("scatter", "reduce", "allreduce", "gather", "allgather", "alltoall"),
                    _object_sent),
}


def method(route: Route, through_mpi: Callable[..., Any], through_cma: Callable[..., Any],
           comm: MPI.Intracomm) -> Callable[..., Any]:
    """One communicator's collective, routed: ``through_mpi`` itself where MPI runs
    every size, else a call that sizes the message and picks, in one frame (the
    wrapper's frames had cost a routed small Bcast 0.8-1 us more than MPI's own at 2
    ranks: docs/guide.md section 7, "Which library runs a collective under cma.mpi")."""
    if isinstance(route, ObjectWindow):
        def routed_object(*args: Any, **kwargs: Any) -> Any:
            return route.run(comm, args, kwargs, through_mpi, through_cma)
        return routed_object
    if not isinstance(route, Window):
        return through_mpi
    agreed, size, holds = route.agreed, route.size, route.holds
    # (the outer bounds compared inline: a window of one range, most of them, costs no call)
    start, until, gaps = route.bounds[0], route.bounds[-1], len(route.bounds) > 2

    def routed(*args: Any, **kwargs: Any) -> Any:
        nbytes = agreed(args, kwargs, size)
        if nbytes >= 0 and not (start <= nbytes < until and (not gaps or holds(nbytes))):
            return through_mpi(*args, **kwargs)
        return through_cma(*args, **kwargs)
    return routed


# -- the size every rank agrees on

def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str) -> Any:
    return args[at] if len(args) > at else kwargs.get(name)


def _in_place(buf: Any) -> bool:
    """``collectives._is_in_place`` with mpi4py known to be here (0.2 us less a call)."""
    return buf is MPI.IN_PLACE or buf is None or buf is IN_PLACE


# mpi4py's own datatype objects (predefined, all of them), by id: the fast path reads only
# these (a derived one goes the way cma.mpi hands it to cma, specs.as_bytes)
MPI_OWN_DATATYPES = mpi_datatype_constants(MPI)


def spec_bytes(spec: Any, blocks: int = 1) -> int:
    """Bytes of one of ``blocks`` equal blocks of a buffer spec, as cma's collectives
    read it (their element type, their checks); -1 for a spec they refuse (cma's
    collective then raises its error). An array and ``[buf, count, datatype]`` over an
    array, a bytearray or an mmap are read here: the general reader took 2-4 us."""
    kind = spec.__class__
    if kind is np.ndarray:
        if spec.flags.c_contiguous and not spec.dtype.hasobject:
            return spec.size // blocks * spec.itemsize
    elif kind is list and len(spec) == 3 and spec[1].__class__ is int and spec[1] >= 0 \
            and (id(spec[2]) in MPI_OWN_DATATYPES or spec[2].__class__ is str):
        nbytes = _counted_bytes(spec[0], spec[1] * blocks, spec[2])
        if nbytes >= 0:
            return nbytes // blocks
    try:
        read = _as_cma_reads(spec, blocks)
        if read is None:
            return -1  # (MPI's to lay out, on this rank whatever its size)
        return _message(read, writable=False, blocks=blocks).nbytes // blocks
    except Exception:  # (whatever cma's reader refuses, cma's collective reports)
        return -1


def _as_cma_reads(spec: Any, blocks: int) -> Any:
    """A spec as cma.mpi hands it to cma, for its size: a derived datatype without gaps
    as bytes (``as_bytes``), one with gaps over a packed copy of its ``blocks`` blocks,
    left unfilled here (``as_packed_unfilled``); None where the spec stays MPI's to lay out."""
    read = as_bytes(spec)
    if read is None and spec is not None:
        return as_packed_unfilled(spec, blocks)
    return read


def _counted_bytes(buf: Any, count: int, datatype: Any) -> int:
    """``count`` elements of ``datatype`` in ``buf`` as ``_message`` reads them (the
    element is dtlib's NumPy dtype: 16 bytes for MPI.DOUBLE_INT, not MPI's 12), checked
    as it checks them; -1 where this reading does not apply (the general one then does)."""
    kind = buf.__class__
    try:
        if kind is np.ndarray:
            if not buf.flags.c_contiguous or buf.dtype.hasobject:
                return -1
            total = buf.nbytes
        elif kind is bytearray or kind is mmap.mmap:
            total = len(buf)
        else:
            return -1
        itemsize = _dtype(datatype).itemsize
    except Exception:  # (a closed mmap, a datatype cma has no element type for)
        return -1
    if total % itemsize or count * itemsize > total:
        return -1
    return count * itemsize


def _input(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> int:
    """A reduction's message: sendbuf, or recvbuf where sendbuf is IN_PLACE."""
    sendbuf = args[0] if args else kwargs.get("sendbuf")
    return spec_bytes(_arg(args, kwargs, 1, "recvbuf") if _in_place(sendbuf) else sendbuf)


def _block_sent(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> int:
    """Gather's and Allgather's block: sendbuf, or one of recvbuf's where it is IN_PLACE."""
    sendbuf = args[0] if args else kwargs.get("sendbuf")
    if _in_place(sendbuf):
        return spec_bytes(_arg(args, kwargs, 1, "recvbuf"), size)
    return spec_bytes(sendbuf)


def _block_received(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> int:
    """Scatter's block: recvbuf, or one of sendbuf's where it is IN_PLACE (the root's)."""
    recvbuf = _arg(args, kwargs, 1, "recvbuf")
    if _in_place(recvbuf):
        return spec_bytes(_arg(args, kwargs, 0, "sendbuf"), size)
    return spec_bytes(recvbuf)


def _block_exchanged(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> int:
    """Alltoall's block: one of sendbuf's, or of recvbuf's where sendbuf is IN_PLACE."""
    sendbuf = _arg(args, kwargs, 0, "sendbuf")
    return spec_bytes(_arg(args, kwargs, 1, "recvbuf") if _in_place(sendbuf) else sendbuf, size)


def _mean_block_gathered(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> int:
    """Allgatherv's mean block: the counts of recvbuf's v-form are every rank's."""
    recvbuf = _arg(args, kwargs, 1, "recvbuf")
    try:
        read = _as_cma_reads(recvbuf, 1)  # (a v-form: its counts are every rank's)
        if read is None:
            return -1  # (MPI's to lay out)
        data, counts, _ = _vmessage(read, writable=False, size=size)
    except Exception:
        return -1
    return sum(counts) * data.itemsize // size


def _message_bytes(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> int:
    """A Bcast's message (its buffer spec, every rank's: the first argument)."""
    return spec_bytes(args[0] if args else kwargs.get("buf"))


AGREED_BYTES: dict[str, Callable[[tuple[Any, ...], dict[str, Any], int], int]] = {
    "Bcast": _message_bytes,
    "Reduce": _input, "Allreduce": _input, "Scan": _input, "Exscan": _input,
    "Reduce_scatter_block": _input, "Reduce_scatter": _input,
    "Gather": _block_sent, "Allgather": _block_sent, "Scatter": _block_received,
    "Alltoall": _block_exchanged, "Allgatherv": _mean_block_gathered,
}

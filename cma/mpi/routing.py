"""Which library runs a collective of an all-on-node communicator: cma's or the wrapped
MPI communicator's, by collective, rank count and message size, each where it was
measured faster (docs/mpi.md, "Which library runs a collective").

Every rank must choose alike, or one waits in cma for peers that wait in MPI. So the
choice rests only on what every rank knows the same: the rank count, the mode (checked
equal when the communicator is made) and the size a collective's type signatures agree
on (``AGREED_BYTES``). The object forms have no such size: each rank measures the pickle
it holds and one MPI call agrees on the largest (``ObjectWindow``). The v-forms but
Allgatherv choose by rank count alone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..collectives import IN_PLACE, _dtype, _message, _vmessage, mpi_datatype_constants
from ..comm import PLAIN_PICKLES
from .specs import as_bytes

ENV_COLLECTIVES = "CMA_MPI_COLLECTIVES"
AUTO = "auto"  # by the measured table below
CMA = "cma"  # every collective cma has through cma (tests, and measuring cma's own)
MPI_ONLY = "mpi"  # every collective through MPI; point-to-point still through cma
MODES = (AUTO, CMA, MPI_ONLY)

EVERY_SIZE = (0, 1 << 62)  # [from, until) in bytes: cma runs sizes in the window
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
WINDOWS: dict[str, tuple[tuple[int, tuple[int, int]], ...]] = {
    "Bcast": ((2, (32 * KIB, EVERY_SIZE[1])), (4, NO_SIZE), (8, (32 * KIB, 256 * KIB)),
              (16, (64 * KIB, 256 * KIB))),
    "Reduce": ((2, (16 * KIB, EVERY_SIZE[1])), (4, (16 * KIB, MIB)), (8, (16 * KIB, 256 * KIB)),
               (16, (32 * KIB, 256 * KIB))),
    "Allreduce": ((2, (16 * KIB, EVERY_SIZE[1])),),
    "Allgather": ((2, (512 * KIB, EVERY_SIZE[1])),),
    "Allgatherv": ((2, (512 * KIB, EVERY_SIZE[1])),),  # (Allgather's algorithm, Allgather's window)
    # (mpi4py's osu_scatter demo at 8 ranks: 1.3-2.5x faster from 512 KiB; at 2 ranks
    # 2-5x slower at every size)
    "Scatter": ((4, NO_SIZE), (8, (512 * KIB, EVERY_SIZE[1]))),
    # the object forms, by the largest pickle any rank holds (ObjectWindow: one MPI call
    # agrees on it); measured at 2 ranks only (docs/mpi.md, "Which library runs a
    # collective", has the runs)
    "bcast": ((1 << 30, (128 * KIB, EVERY_SIZE[1])),),
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


Route = Callable[[MPI.Intracomm, tuple[Any, ...], dict[str, Any]], bool]


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
            chosen[name] = ObjectWindow(name, *window)
        else:
            chosen[name] = Window(AGREED_BYTES[name], size, *window)  # (a size every rank agrees on)
    return chosen


def always_mpi(comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The route of a collective that MPI runs at every size."""
    return True


class Window:
    """The route of a collective that cma runs at sizes in [start, until), MPI elsewhere."""

    __slots__ = ("agreed", "size", "start", "until")

    def __init__(self, agreed: Callable[[tuple[Any, ...], dict[str, Any], int], int], size: int,
                 start: int, until: int) -> None:
        self.agreed, self.size, self.start, self.until = agreed, size, start, until

    def __call__(self, comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        nbytes = self.agreed(args, kwargs, self.size)
        # (a spec cma refuses: cma's collective raises its error, as it did before routes)
        return nbytes >= 0 and not self.start <= nbytes < self.until


class ObjectWindow:
    """The route of an object collective: cma runs it where the largest pickle a rank
    holds is in [start, until), MPI elsewhere. Each rank measures what it holds (the
    root alone, for bcast and scatter: ``pickled_bytes``), then one MPI call agrees on the
    largest: a Bcast of the root's size, else an Allreduce of the maximum (8 bytes; 1.5-3
    us at 2 ranks, which the object collectives through MPI pay besides their own)."""

    __slots__ = ("name", "held", "rooted", "start", "until")

    def __init__(self, name: str, start: int, until: int) -> None:
        self.name, self.held = name, OBJECT_HELD[name]
        self.rooted = name in ("bcast", "scatter")
        self.start, self.until = start, until

    def __call__(self, comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        size = bytearray(8)  # (a buffer per call: a thread of the rank may route another)
        if self.rooted:
            root = _arg(args, kwargs, 1, "root")
            root = 0 if root is None else root
            if MPI.Comm.Get_rank(comm) == root:
                size[:] = self._measure(args, kwargs).to_bytes(8, "little")
            MPI.Intracomm.Bcast(comm, [size, MPI.INT64_T], root)
        else:
            size[:] = self._measure(args, kwargs).to_bytes(8, "little")
            MPI.Intracomm.Allreduce(comm, MPI.IN_PLACE, [size, MPI.INT64_T], MPI.MAX)
        return not self.start <= int.from_bytes(size, "little") < self.until

    def _measure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """What this rank holds, in bytes; where it cannot be pickled whole (a generator
        cma's scatter takes item by item, an object that refuses), a size that sends the
        call to cma on every rank, whose collective then takes it or raises, as before
        routes: a rank that raised here would leave its peers in the agreement."""
        try:
            return pickled_bytes(self.held(args, kwargs))
        except Exception:
            return self.until - 1

    def run(self, comm: MPI.Intracomm, args: tuple[Any, ...], kwargs: dict[str, Any],
            through_mpi: Callable[..., Any], through_cma: Callable[..., Any]) -> Any:
        """The call, routed; the agreement and the call under one lock per communicator
        and name, so that threads of a rank calling the same collective at once cannot
        pair one rank's agreement with another's call (as mpi4py's own lock keeps its
        two MPI calls of a gather together)."""
        with _route_lock(comm, self.name):
            if self(comm, args, kwargs):
                return through_mpi(*args, **kwargs)
            return through_cma(*args, **kwargs)


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
    a bytes object's or a str's own size, a number's 0 (pickling a NumPy array only to measure it
    took 5.6 us; the ranks agree on what they measured, so the choice is one whatever a
    header adds)."""
    kind = obj.__class__
    if kind in PLAIN_PICKLES:
        return len(obj) if kind is str else 0
    if isinstance(obj, np.generic) or isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
        return int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if kind is dict and len(obj) <= _PARTS and any(
            value.__class__ is np.ndarray for value in obj.values()):
        # (a small dict holding an array, the usual message, by its parts: measured
        # without pickling the array, which took 5.6 us)
        return sum(map(pickled_bytes, obj)) + sum(map(pickled_bytes, obj.values()))
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(buffer.raw().nbytes for buffer in buffers)


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
    agreed, size, start, until = route.agreed, route.size, route.start, route.until

    def routed(*args: Any, **kwargs: Any) -> Any:
        nbytes = agreed(args, kwargs, size)
        if nbytes >= 0 and not start <= nbytes < until:
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
        read = as_bytes(spec)  # (a derived datatype without gaps as cma.mpi hands it to cma)
        if read is None and spec is not None:
            return -1  # (one with gaps: MPI's to lay out, on this rank whatever its size)
        return _message(read, writable=False, blocks=blocks).nbytes // blocks
    except Exception:  # (whatever cma's reader refuses, cma's collective reports)
        return -1


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
        read = as_bytes(recvbuf)
        if read is None and recvbuf is not None:
            return -1  # (a datatype with gaps: MPI's to lay out)
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

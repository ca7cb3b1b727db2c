"""cma.mpi.Comm's choice of library per collective (cma.mpi.routing): every rank makes the
same one, whatever form its buffer spec takes, and the choice is the table's.

Argument: the mode the job's environment sets (CMA_MPI_COLLECTIVES: auto, cma, mpi), or
"mismatch". For each collective the table routes by size at this rank count: a call just
below its window, at its start, and at its end if it has one, with rank 0 passing
IN_PLACE or a spec list where the others pass arrays. Inside the window the node's
ranks count cma messages, outside none; the results are MPI's own. A collective routed
at every size or none: one call, through the library the mode and table name.
"mismatch": ranks that set CMA_MPI_COLLECTIVES differently all raise ValueError. Prints
"OK <rank>".

Second argument (optional): the datatype of rank 0's spec lists where data moves unreduced,
"int64" (predefined, the default) or a derived one without gaps, which every rank must route
as the others' arrays (MPICH refuses a predefined op on a derived datatype):
"dup" (dtlib's ``from_numpy_dtype(np.int64)``, not predefined), "contiguous" (4 int64s)
or "vector" (2 blocks of 2 int64s, stride 2).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

import cma.mpi
from cma.mpi import routing

# (the predefined datatype mpi4py gives an int64 array here, which MPI's type check wants)
INT64 = MPI._typedict[np.dtype(np.int64).char]
# rank 0's datatype in its spec lists, and how many int64s one element of it holds
FORMS: dict[str, Callable[[], tuple[MPI.Datatype, int]]] = {
    "int64": lambda: (INT64, 1),
    "dup": lambda: (dtlib.from_numpy_dtype(np.int64), 1),
    "contiguous": lambda: (INT64.Create_contiguous(4).Commit(), 4),
    "vector": lambda: (INT64.Create_vector(2, 2, 2).Commit(), 4),
}
DATATYPE, PER = FORMS[sys.argv[2] if len(sys.argv) > 2 else "int64"]()
LARGEST = 16 << 20  # (a window's end past this is not tried)
NAMES = ("Bcast", "Reduce", "Allreduce", "Scan", "Exscan", "Reduce_scatter_block",
         "Reduce_scatter", "Gather", "Allgather", "Allgatherv", "Scatter", "Alltoall",
         "bcast", "allreduce", "allgather", "gather", "scatter", "reduce", "alltoall")


def moved(comm: cma.mpi.Comm) -> int:
    assert comm.cma is not None
    return int(sum(counts["messages"] for counts in comm.cma.stats().values()))


def build(name: str, nbytes: int, rank: int, size: int) -> tuple[Callable[[Any], list[np.ndarray]], int]:
    """``run(method)`` calls collective ``name`` with ``method`` on a message of about
    ``nbytes`` (the size every rank agrees on) and returns what to compare; the bytes the
    size really is."""
    count = nbytes // 8
    mine = np.arange(count, dtype=np.int64) * (rank + 1)
    if name == "Bcast":
        def run(method: Any) -> list[np.ndarray]:
            buf = mine.copy() if rank == 0 else np.zeros(count, np.int64)
            method([buf, count // PER, DATATYPE] if rank == 0 else buf, root=0)
            return [buf]
        return run, count * 8
    if name in ("Allreduce", "Scan", "Exscan", "Reduce"):
        # (IN_PLACE where MPI allows it: at Reduce's root, at every rank of Allreduce and
        # Scan; rank 0's result buffer a spec list, the others' arrays)
        def run(method: Any) -> list[np.ndarray]:
            in_place = name in ("Allreduce", "Scan") or name == "Reduce" and rank == 0
            out = mine.copy() if in_place else np.zeros(count, np.int64)
            recv = [out, count, INT64] if rank == 0 else out
            method(MPI.IN_PLACE if in_place else mine, recv, op=MPI.SUM,
                   **({"root": 0} if name == "Reduce" else {}))
            keep = rank == 0 if name == "Reduce" else not (name == "Exscan" and rank == 0)
            return [out] if keep else []
        return run, count * 8
    if name in ("Reduce_scatter_block", "Reduce_scatter"):
        block = count // size
        whole = np.arange(block * size, dtype=np.int64) * (rank + 1)

        def run(method: Any) -> list[np.ndarray]:
            out = np.zeros(block, np.int64)
            if name == "Reduce_scatter":
                method(whole, out, [block] * size, op=MPI.SUM)
            else:
                method(whole, out, op=MPI.SUM)
            return [out]
        return run, block * size * 8
    if name in ("Gather", "Allgather", "Allgatherv"):
        # (IN_PLACE at Gather's root, at every rank of Allgather(v), as MPI allows it)
        def run(method: Any) -> list[np.ndarray]:
            out = np.zeros(count * size, np.int64)
            out[rank * count : (rank + 1) * count] = mine
            if name == "Gather":
                method(MPI.IN_PLACE if rank == 0 else mine,
                       [out, count // PER, DATATYPE] if rank == 0 else None, root=0)
                return [out] if rank == 0 else []
            if name == "Allgatherv":
                recv: Any = ([out, [count // PER] * size, DATATYPE] if rank == 0
                             else [out, [count] * size, INT64])
            else:
                recv = [out, count // PER, DATATYPE] if rank == 0 else out
            method(MPI.IN_PLACE, recv)
            return [out]
        return run, count * 8
    if name == "Scatter":
        whole = np.arange(count * size, dtype=np.int64)

        def run(method: Any) -> list[np.ndarray]:
            out = whole[:count].copy() if rank == 0 else np.zeros(count, np.int64)
            method([whole, count // PER, DATATYPE] if rank == 0 else None,
                   MPI.IN_PLACE if rank == 0 else out, root=0)
            return [out]
        return run, count * 8
    if name == "Alltoall":
        whole = np.arange(count * size, dtype=np.int64) + 1000 * rank

        def run(method: Any) -> list[np.ndarray]:
            out = np.zeros(count * size, np.int64)
            method([whole, count // PER, DATATYPE] if rank == 0 else whole, out)
            return [out]
        return run, count * 8
    if name in routing.OBJECT_HELD:
        # (the window's size held by one rank alone where ranks may differ: the last for
        # allgather and alltoall; the last and the root for gather; the middle one, in a
        # list, for reduce and allreduce, which concatenate the lists (an op that does not
        # commute: rank order in sight) besides summing every rank's floats (whose
        # rounding shows the grouping); the root for bcast and scatter, whose other
        # ranks pass something large that is not theirs to send; root 1 by keyword where
        # there are 3 ranks or more, the middle rank then)
        root = 1 if size >= 3 else 0
        last = rank == size - 1
        mine_or_small = mine if last else np.arange(4) * rank
        middle = [mine if rank == size // 2 else np.arange(4) * rank]
        floats = np.random.default_rng(rank).random(count)  # (sums that round by grouping)
        items = [np.arange(count // size) + i for i in range(size)]

        def run(method: Any) -> list[np.ndarray]:
            if name == "bcast":
                got = method(mine if rank == root else np.zeros(2 * count + 1), root=root)
            elif name == "scatter":
                got = method(items if rank == root else None, root=root)
            elif name == "allreduce":
                got = method(middle, op=concatenated) + [method(floats, op=MPI.SUM)]
            elif name == "reduce":
                joined = method(middle, op=concatenated, root=root)
                summed = method(floats, op=MPI.SUM, root=root)
                got = joined + [summed] if rank == root else None
            elif name == "alltoall":
                got = method(items if last else [np.arange(2) + rank] * size)
            elif name == "gather":
                got = method(mine if rank in (root, size - 1) else np.arange(4) * rank, root=root)
            else:
                got = method(mine_or_small)
            parts = got if isinstance(got, list) else [] if got is None else [got]
            return [np.concatenate([np.ravel(part) for part in parts]) if parts else np.zeros(0)]
        return run, -1
    raise AssertionError(f"no call built for {name}")


def concatenated(a: list[Any], b: list[Any]) -> list[Any]:
    """An op that does not commute: each rank's list in rank order, whatever the grouping."""
    return a + b


def check(comm: cma.mpi.Comm, name: str, nbytes: int, expect_cma: bool) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    run, really = build(name, nbytes, rank, size)
    before = moved(comm)
    ours = run(getattr(comm, name))
    count = MPI.Intracomm.allreduce(comm, moved(comm) - before)
    theirs = run(lambda *a, **k: getattr(MPI.Intracomm, name)(comm, *a, **k))
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b), f"rank {rank} {name} of {really} B: {a} != {b}"
    assert (count > 0) == expect_cma, (
        f"{name} of {really} B moved {count} cma messages: expected "
        f"{'cma' if expect_cma else 'MPI'}")


def kept_past_free(comm: cma.mpi.Comm) -> None:
    """A routed method kept past Free raises as MPI's does on a freed communicator, even
    where a new communicator took the freed handle's value (bound to a copy of the handle,
    it ran on that new communicator)."""
    dup = comm.Dup()
    kept = dup.Alltoall  # (MPI's at every size in every row of the table)
    assert kept.__self__ is dup, kept
    block = np.zeros(comm.Get_size(), np.uint8)
    kept(block, block.copy())
    handle = dup.py2f()
    dup.Free()
    other = MPI.COMM_WORLD.Dup()
    try:
        kept(block, block.copy())
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_COMM, exc
    else:
        raise AssertionError("a kept Alltoall ran after Free" + (
            ", on the communicator that took its handle" if other.py2f() == handle else ""))
    other.Free()


def main() -> None:
    mode = sys.argv[1]
    if mode == "mismatch":
        os.environ[routing.ENV_COLLECTIVES] = "cma" if MPI.COMM_WORLD.Get_rank() == 0 else "mpi"
        try:
            cma.mpi.Comm(MPI.COMM_WORLD)
        except ValueError as exc:
            assert routing.ENV_COLLECTIVES in str(exc), exc
        else:
            raise AssertionError("ranks with different CMA_MPI_COLLECTIVES made a communicator")
        print(f"OK {MPI.COMM_WORLD.Get_rank()}", flush=True)
        return
    assert os.environ.get(routing.ENV_COLLECTIVES, "auto") == mode, mode
    comm = cma.mpi.Comm(MPI.COMM_WORLD)
    size = comm.Get_size()
    assert comm.cma is not None
    rank, tried = comm.Get_rank(), 0
    for name in NAMES:
        rows = routing.WINDOWS.get(name, ())
        window = next((w for ranks, w in rows if size <= ranks), routing.NO_SIZE)
        if mode == routing.CMA:
            window = routing.EVERY_SIZE
        elif mode == routing.MPI_ONLY:
            window = routing.NO_SIZE
        if window in (routing.EVERY_SIZE, routing.NO_SIZE):
            check(comm, name, 4096, window == routing.EVERY_SIZE)
            tried += 1
            continue
        unit = 8 * (size if name.startswith("Reduce_scatter") else PER)
        for start, until in zip(window[::2], window[1::2], strict=True):  # (each range)
            at = max(-(-start // unit) * unit, unit)
            if name in routing.OBJECT_HELD:  # (by the pickle: an array of about that many bytes)
                sizes = [(at, True), (at // 2, False)]
                if until <= LARGEST:
                    sizes.append((until, False))
            else:
                sizes = [(at, True)] + ([(at - unit, False)] if start >= unit else [])
                if until <= LARGEST:
                    sizes.append((-(-until // unit) * unit, False))
            for nbytes, inside in sizes:
                check(comm, name, nbytes, inside)
                tried += 1
    assert tried, "the table routes nothing"
    # an object collective's payload is data, whatever datatypes it holds
    got = comm.allgather(("label", rank, DATATYPE))
    assert [item[:2] for item in got] == [("label", r) for r in range(size)], got
    if mode != routing.CMA:
        kept_past_free(comm)
    print(f"OK {rank} ({tried} calls)", flush=True)


main()

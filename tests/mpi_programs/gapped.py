"""A rank passing a datatype with gaps where its peers pass arrays: cma.mpi.Comm packs it
for cma's collectives and unpacks what they write, so it takes its peers' path.

Argument: the mode the job's environment sets (CMA_MPI_COLLECTIVES: auto or cma). Rank 0's
specs name a vector of int64s (2 of every 3: a gap after each pair) over a buffer laid
out so, its peers' plain int64 arrays of the same type signature. For each collective
that moves data unreduced, at a size below its window and at one inside (auto), or one
size (cma): the results, rank 0's gaps untouched, equal MPI's own with the same specs,
and cma carries the call where the table says (before, rank 0 went to MPI while its
peers waited in cma: a hang). Prints "OK <rank>".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import cma.mpi
from cma.mpi import routing

INT64 = MPI._typedict[np.dtype(np.int64).char]
PAIRS = INT64.Create_vector(2, 1, 2).Commit()  # (ints 0 and 2 of every 3)
GAP = -7  # what rank 0's gaps hold, before and after


def laid_out(values: np.ndarray) -> np.ndarray:
    """``values`` (an even count of int64s) in PAIRS' layout, the gaps holding GAP."""
    out = np.full((len(values) // 2, 3), GAP, np.int64)
    out[:, 0], out[:, 2] = values[0::2], values[1::2]
    return out.ravel()


def values_of(laid: np.ndarray) -> np.ndarray:
    """The values PAIRS reads from a buffer in its layout (its gaps checked)."""
    rows = laid.reshape(-1, 3)
    assert (rows[:, 1] == GAP).all(), f"a gap was written: {rows[:, 1]}"
    return rows[:, [0, 2]].ravel()


def build(name: str, count: int, rank: int, size: int) -> Callable[[Any], np.ndarray]:
    """``run(method)``: collective ``name`` of ``count`` int64s a rank (a block), rank 0
    through PAIRS; returns what this rank ended with, as plain values."""
    mine = np.arange(count, dtype=np.int64) + 1000 * rank
    pairs = count // 2  # (PAIRS elements in a block)
    gapped = rank == 0

    def received(buf: np.ndarray) -> np.ndarray:
        return values_of(buf) if gapped else buf

    if name in ("Bcast", "Bcast from the last rank"):
        root = 0 if name == "Bcast" else size - 1

        def run(method: Any) -> np.ndarray:
            start = mine if rank == root else np.zeros(count, np.int64)
            buf = laid_out(start) if gapped else start.copy()
            method([buf, pairs, PAIRS] if gapped else buf, root=root)
            return received(buf)
        return run
    if name == "Gather to the last rank":
        # (rank 0 sends through PAIRS and passes [None, n, PAIRS] for the buffer mpi4py
        # ignores at a rank other than the root)
        def run(method: Any) -> np.ndarray:
            root = size - 1
            out = np.zeros(count * size, np.int64) if rank == root else None
            method([laid_out(mine), pairs, PAIRS] if gapped else mine,
                   [None, pairs, PAIRS] if gapped else out, root=root)
            return out if out is not None else mine
        return run
    if name in ("Gather", "Allgather", "Allgather in place", "Allgatherv"):
        # (Allgatherv's blocks in reverse rank order, a free element between each)
        def run(method: Any) -> np.ndarray:
            total = np.zeros((count + 2) * size, np.int64)
            if name.endswith("in place"):
                total[rank * count : (rank + 1) * count] = mine
            out = laid_out(total) if gapped else total
            if name == "Allgatherv":
                recv: Any = [out, ([pairs] * size, [(size - 1 - r) * (pairs + 1) for r in range(size)]),
                             PAIRS] if gapped else \
                    [out, ([count] * size, [(size - 1 - r) * (count + 2) for r in range(size)]), INT64]
            else:
                recv = [out, pairs, PAIRS] if gapped else [out, count, INT64]
            if name == "Gather":
                method(mine, recv if rank == 0 else None, root=0)
                return received(out) if rank == 0 else mine
            method(MPI.IN_PLACE if name.endswith("in place") else mine, recv)
            return received(out)
        return run
    if name == "Scatter":
        whole = np.arange(count * size, dtype=np.int64)

        def run(method: Any) -> np.ndarray:
            out = np.zeros(count, np.int64)
            send = [laid_out(whole), pairs, PAIRS] if gapped else None
            method(send, out, root=0)
            return out
        return run
    if name == "Alltoall":
        whole = np.arange(count * size, dtype=np.int64) + 1000 * rank

        def run(method: Any) -> np.ndarray:
            total = np.zeros(count * size, np.int64)
            out = laid_out(total) if gapped else total
            method([laid_out(whole), pairs, PAIRS] if gapped else whole,
                   [out, pairs, PAIRS] if gapped else out)
            return received(out)
        return run
    raise AssertionError(f"no call built for {name}")


def moved(comm: cma.mpi.Comm) -> int:
    assert comm.cma is not None
    return int(sum(counts["messages"] for counts in comm.cma.stats().values()))


def through_cma(mode: str, name: str, size: int, nbytes: int) -> bool:
    """Whether the table (or the mode) sends this call to cma."""
    route = routing.routes(mode, size, [name]).get(name)
    if route is None:
        return True
    if isinstance(route, routing.Window):
        return route.holds(nbytes)
    return False


def main() -> None:
    mode = sys.argv[1]
    assert os.environ.get(routing.ENV_COLLECTIVES, "auto") == mode, mode
    comm = cma.mpi.Comm(MPI.COMM_WORLD)
    rank, size = comm.Get_rank(), comm.Get_size()
    names = ["Bcast", "Bcast from the last rank", "Gather", "Gather to the last rank",
             "Allgather", "Allgather in place", "Scatter", "Alltoall"]
    if mode == routing.CMA:
        # (MPICH 5.0.2's own Allgatherv stops with "Message truncated" where a rank's
        # vector meets its peers' int64s at 256 KiB a rank: the window's sizes)
        names.append("Allgatherv")
    for label in names:
        name = label.split()[0]
        start = routing.routes(routing.AUTO, size, [name]).get(name)
        at = start.bounds[0] if isinstance(start, routing.Window) else 4096
        counts = {max(at // 8, 2), max(at // 16, 2)} if mode == routing.AUTO else {512}
        for count in sorted(counts):
            count += count % 2
            run = build(label, count, rank, size)
            before = moved(comm)
            ours = run(getattr(comm, name))
            went = MPI.Intracomm.allreduce(comm, moved(comm) - before) > 0
            mpi_method = getattr(MPI.Intracomm, name)
            theirs = run(lambda *a, **k: mpi_method(comm, *a, **k))  # noqa: B023 (called here)
            assert np.array_equal(ours, theirs), f"rank {rank} {label} of {count} int64s differs"
            expected = through_cma(mode, name, size, count * 8)
            assert went == expected, f"{label} of {count * 8} B: cma {went}, expected {expected}"
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()

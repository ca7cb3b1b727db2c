"""Object collectives (and prefix reductions) as mpi4py programs write them, plain and
through cma.mpi, in one job.

Each case is a one-line call an mpi4py program makes (``comm.allreduce(x)``,
``comm.gather(rank, root=0)``, a ``bcast`` of a dict holding an array...), timed over a
loop on ``MPI.COMM_WORLD`` ("plain") and on ``cma.mpi.Comm(MPI.COMM_WORLD)`` ("plugin",
auto routing unless ``CMA_MPI_COLLECTIVES`` says otherwise). Rounds alternate the order,
plain first in even rounds and plugin first in odd ones, and glibc's mmap threshold is
raised first on every rank (``settle_allocator``, as cma-bench does): otherwise a 256 KiB
unpickle maps fresh pages each call until one library's large free happens to raise it,
and that state, not the library, decides the comparison (docs/mpi.md, "Which library runs
a collective"). Rank 0 prints, per case and order, each library's median mean-per-call
time over the rounds and the median [min-max] of the per-round speed ratio plain time /
plugin time (> 1: the plugin is faster)::

    mpiexec -n 2 python bench/object_snippets.py --rounds 6 --json snippets.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import mpi4py
import numpy as np
from mpi4py import MPI

import cma.mpi
from cma.bench.collective import settle_allocator

Case = tuple[int, Callable[[Any, int, int], Any]]  # (calls per loop, call(comm, rank, size))

ARRAY_256K, ARRAY_4M = np.ones(32 << 10), np.ones(512 << 10)
PREFIX = {n: (np.ones(n // 8), np.empty(n // 8)) for n in (8, 64 << 10, 1 << 20)}  # (in, out)
CASES: dict[str, Case] = {
    "allreduce float": (3000, lambda c, r, n: c.allreduce(1.5)),
    "bcast small dict": (3000, lambda c, r, n: c.bcast({"a": 1, "b": [1, 2]}, root=0)),
    "gather int": (3000, lambda c, r, n: c.gather(r, root=0)),
    "allgather int": (3000, lambda c, r, n: c.allgather(r)),
    "scatter ints": (3000, lambda c, r, n: c.scatter(list(range(n)) if r == 0 else None, root=0)),
    "alltoall ints": (3000, lambda c, r, n: c.alltoall(list(range(n)))),
    "reduce float": (3000, lambda c, r, n: c.reduce(1.5, root=0)),
    "bcast dict of 256 KiB array": (300, lambda c, r, n: c.bcast({"x": ARRAY_256K, "step": 1}, root=0)),
    "allreduce 4 MiB array": (20, lambda c, r, n: c.allreduce(ARRAY_4M)),
    "gather 4 MiB array from the last rank":
        (20, lambda c, r, n: c.gather(ARRAY_4M if r == n - 1 else r, root=0)),
    "reduce 4 MiB array": (20, lambda c, r, n: c.reduce(ARRAY_4M, root=0)),
    "Scan 8 B": (3000, lambda c, r, n: c.Scan(*PREFIX[8])),
    "Scan 64 KiB": (1000, lambda c, r, n: c.Scan(*PREFIX[64 << 10])),
    "Exscan 64 KiB": (1000, lambda c, r, n: c.Exscan(*PREFIX[64 << 10])),
    "Scan 1 MiB": (200, lambda c, r, n: c.Scan(*PREFIX[1 << 20])),
}


def timed(comm: Any, call: Callable[[Any, int, int], Any], calls: int, rank: int, size: int) -> float:
    """Mean microseconds per call over ``calls``, after one untimed call; rank 0's."""
    call(comm, rank, size)
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call(comm, rank, size)
    MPI.COMM_WORLD.Barrier()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names")
    parser.add_argument("--json", metavar="FILE", help="every round's times")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    settle_allocator()
    plugin = cma.mpi.Comm(world)
    names = [name for name in args.cases.split(",") if name]
    records: list[dict[str, Any]] = []
    for name in names:
        calls, call = CASES[name]
        for round_ in range(args.rounds):
            order = ("plain", "plugin") if round_ % 2 == 0 else ("plugin", "plain")
            times = {label: timed(world if label == "plain" else plugin, call, calls, rank, size)
                     for label in order}
            records.append({"case": name, "round": round_, "first": order[0], **times})
    if rank != 0:
        return
    print(f"{size} ranks, mpi4py {mpi4py.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}; "
          "mean us per call, median over rounds; speed = plain time / plugin time")
    for name in names:
        for first in ("plain", "plugin"):
            rows = [r for r in records if r["case"] == name and r["first"] == first]
            if not rows:
                continue
            speeds = [r["plain"] / r["plugin"] for r in rows]
            print(f"{name:40s} {first:6s} first: plain {statistics.median(r['plain'] for r in rows):9.1f}"
                  f"  plugin {statistics.median(r['plugin'] for r in rows):9.1f}"
                  f"  speed {statistics.median(speeds):5.2f} [{min(speeds):.2f}-{max(speeds):.2f}]")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": size, "records": records}, out, indent=1)


if __name__ == "__main__":
    main()

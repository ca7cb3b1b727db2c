"""One array per node: ``cma.shared_array`` against the mpi4py boilerplate and against
every rank loading its own copy. Memory per node and set-up time.

Run under mpiexec (MPICH), every rank on this machine; not in CI::

    PYTHONPATH=. mpiexec -n 4 python -m mpi4py bench/shared_array.py --size 256M --repeat 3

Three ways to give every rank of a node a table of ``--size`` bytes (float64) that the
node's lowest rank loads (here: writes every byte once, standing in for reading a file):

- ``cma``: ``a = cma.shared_array(comm, shape)`` on a ``cma.mpi.Comm``; the root fills it;
  ``Barrier``.
- ``mpi4py``: ``MPI.Win.Allocate_shared`` (the whole size on the root, 0 elsewhere) on
  the node communicator, ``Shared_query(0)``, ``np.ndarray(buffer=...)``; the root
  fills it; ``Barrier`` (``win.Free()`` after the measurement).
- ``copies``: every rank ``np.empty`` + fills its own.

The communicators (``cma.mpi.Comm``, ``Split_type``) are made once, before any timing.
Times (slowest rank): from a Barrier to every rank holding the (empty) array, and to
every rank holding the loaded table after the Barrier that follows the loading.
Memory per node: the sum over ranks of the growth of each process's proportional set
size (``Pss`` in /proc/self/smaps_rollup), which counts a page shared by k processes
1/k in each, so the sum is what the node holds. Rank 0 prints median [min-max] of
``--repeat`` runs of each way, with the load average.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import cma
import cma.mpi


def pss() -> int:
    """This process's proportional set size in bytes."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def spread(values: list[float], digits: int) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def load(arr: np.ndarray[Any, Any]) -> None:
    arr.fill(1.5)  # every page written once, as reading a file into it would


def with_cma(comm: cma.mpi.Comm, node: MPI.Intracomm, n: int) -> tuple[Any, Callable[[], None]]:
    return cma.shared_array(comm, n), lambda: None


def with_mpi4py(comm: cma.mpi.Comm, node: MPI.Intracomm, n: int) -> tuple[Any, Callable[[], None]]:
    itemsize = MPI.DOUBLE.Get_size()
    nbytes = n * itemsize if node.Get_rank() == 0 else 0
    win = MPI.Win.Allocate_shared(nbytes, itemsize, comm=node)
    buf, _ = win.Shared_query(0)
    return np.ndarray(buffer=buf, dtype="d", shape=(n,)), win.Free


def with_copies(comm: cma.mpi.Comm, node: MPI.Intracomm, n: int) -> tuple[Any, Callable[[], None]]:
    return np.empty(n), lambda: None


WAYS = {"cma": with_cma, "mpi4py": with_mpi4py, "copies": with_copies}
SHARED = {"cma", "mpi4py"}  # only the node's root loads the table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=size_arg, default=256 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = cma.mpi.Comm(world)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    assert node.Get_size() == world.Get_size(), "run every rank on this machine"
    n = args.size // 8
    results: dict[str, tuple[list[float], list[float], list[int]]] = {}
    for name, way in WAYS.items():
        allocs, times, memory = [], [], []
        for _ in range(args.repeat):
            gc.collect()
            before = pss()
            world.Barrier()
            t0 = time.perf_counter()
            arr, free = way(comm, node, n)
            allocated = time.perf_counter() - t0
            if name not in SHARED or node.Get_rank() == 0:
                load(arr)
            node.Barrier()
            elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            allocs.append(world.allreduce(allocated, op=MPI.MAX))
            assert arr[n - 1] == 1.5
            grown = world.allreduce(pss() - before, op=MPI.SUM)
            del arr
            free()
            times.append(elapsed)
            memory.append(grown)
        results[name] = (allocs, times, memory)
    node.Free()
    if world.Get_rank() == 0:
        load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{world.Get_size()} ranks, {args.size >> 20} MiB table, {args.repeat} runs, "
              f"load average {load_avg} on {os.cpu_count()} CPUs")
        print("| way | allocate and map, ms | set-up incl. loading, ms | memory per node, MiB |")
        print("|---|---|---|---|")
        for name, (allocs, times, memory) in results.items():
            print(f"| {name} | {spread([t * 1e3 for t in allocs], 2)} | "
                  f"{spread([t * 1e3 for t in times], 0)} | "
                  f"{spread([m / (1 << 20) for m in memory], 0)} |")


if __name__ == "__main__":
    main()

"""Ping-pong of messages with derived datatypes: cma.mpi against plain mpi4py, same job.

The layouts real mpi4py programs send: a column of a 2-D array (Create_vector), the
faces of a 3-D block (Create_subarray: one contiguous, one in 64 rows, one in 4096
single doubles), an array of records (Create_struct, resized), MINLOC pairs
(MPI.DOUBLE_INT) and a large block of rows (28.8 MB in 40 rows: above the eager limit,
moved as one iovec). Each case runs in rounds, the order of plain and plugin
alternating (round 0 plain first); the table gives the median one-way time over rounds
and the median per-round ratio plain time / plugin time (> 1: the plugin is faster).

    mpiexec -n 2 python bench/datatypes.py [--rounds 6] [--seconds 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import cma.mpi

world = MPI.COMM_WORLD
f8 = MPI.DOUBLE


def cases() -> dict[str, tuple[np.ndarray, MPI.Datatype]]:
    """name -> (buffer, datatype of one element sent from its start)."""
    cube = np.zeros((64, 64, 64))
    record = MPI.Datatype.Create_struct([1, 1], [0, 8], [f8, MPI.INT]).Create_resized(0, 16)
    return {
        "column 100 of 100x100 (100 x 8 B)": (np.zeros((100, 100)), f8.Create_vector(100, 1, 100)),
        "face i of 64^3 (1 x 32 KiB)": (cube, f8.Create_subarray([64] * 3, [1, 64, 64], [5, 0, 0])),
        "face j of 64^3 (64 x 512 B)": (cube, f8.Create_subarray([64] * 3, [64, 1, 64], [0, 5, 0])),
        "face k of 64^3 (4096 x 8 B)": (cube, f8.Create_subarray([64] * 3, [64, 64, 1], [0, 0, 5])),
        "1000 records {f8, i4} (1000 x 12 B)": (np.zeros(2000), record.Create_contiguous(1000)),
        "1000 DOUBLE_INT (1000 x 12 B)": (np.zeros(2000), MPI.DOUBLE_INT.Create_contiguous(1000)),
        "40 rows of 64x100000 (40 x 720 KB)": (np.zeros((64, 100000)),
                                              f8.Create_subarray([64, 100000], [40, 90000], [10, 5000])),
    }


def one_way(comm: MPI.Intracomm, buf: np.ndarray, datatype: MPI.Datatype, seconds: float) -> float:
    """Mean one-way seconds of a ping-pong lasting about ``seconds``."""
    rank = comm.Get_rank()
    spec = [buf, 1, datatype]
    send: Callable[..., None] = comm.Send
    recv: Callable[..., None] = comm.Recv
    iterations, total = 0, 0.0
    batch = 1
    while True:
        comm.Barrier()
        begin = time.perf_counter()
        for _ in range(batch):
            if rank == 0:
                send(spec, 1, 0)
                recv(spec, 1, 0)
            else:
                recv(spec, 0, 0)
                send(spec, 0, 0)
        elapsed = world.bcast(time.perf_counter() - begin, root=0)
        iterations += batch
        total += elapsed
        if total >= seconds:
            return total / iterations / 2
        batch = min(batch * 2, 10000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.2, help="per series and round")
    args = parser.parse_args()
    plugin = cma.mpi.Comm(world)
    comms = {"plain": world, "plugin": plugin}
    found = cases()
    for _, datatype in found.values():
        datatype.Commit()
    times: dict[str, dict[str, list[float]]] = {name: {"plain": [], "plugin": []} for name in found}
    for round_ in range(args.rounds):
        order = ["plain", "plugin"] if round_ % 2 == 0 else ["plugin", "plain"]
        for name, (buf, datatype) in found.items():
            for which in order:
                times[name][which].append(one_way(comms[which], buf, datatype, args.seconds))
    if world.Get_rank() == 0:
        print(f"{'message':40s} {'plain µs':>10s} {'plugin µs':>10s} {'plain/plugin':>14s}")
        for name, series in times.items():
            ratios = [p / q for p, q in zip(series["plain"], series["plugin"], strict=True)]
            print(f"{name:40s} {statistics.median(series['plain']) * 1e6:10.1f} "
                  f"{statistics.median(series['plugin']) * 1e6:10.1f} "
                  f"{statistics.median(ratios):8.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
        print(f"({args.rounds} rounds, orders alternating; medians over rounds; "
              f"{MPI.Get_library_version().splitlines()[0].strip()})")
    for _, datatype in found.values():
        datatype.Free()


if __name__ == "__main__":
    main()

"""Where a window of non-blocking requests spends its time: osu_bibw's pattern, in phases.

osu_bibw (mpi4py's demo) has each rank post a window of ``Irecv``s of ``[buf, n,
MPI.BYTE]`` specs, then a window of ``Isend``s, then ``MPI.Request.Waitall`` on each.
Its bandwidth through cma.mpi sums several costs, and this script times them apart,
over plain ``MPI.COMM_WORLD`` and through ``cma.mpi.Comm``, alternating which goes
first in each round. Per message, in µs (rank 0's figures; the median over rounds):

- ``bibw``: the whole pattern per message, and its parts: the ``Irecv`` loop, the
  ``Isend`` loop, and the ``Waitall`` of the receives (which includes waiting for the
  peer);
- ``posted``: an ``Irecv`` posted before anything was sent (rank 1 sends only after a
  barrier);
- ``deliver``: the ``Waitall`` of those receives once all their messages are in the
  ring (rank 0 sleeps, out of MPI, while they are sent), which hands the messages to
  the posted receives and retires the requests;
- ``arrived``: an ``Irecv`` whose message is already in the ring;
- ``isend``: rank 1's eager ``Isend`` into the ring.

Run (docs/mpi.md, "Windows of requests")::

    mpiexec -n 2 python bench/request_window.py --size 8 --rounds 4
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections import defaultdict
from typing import Any

from mpi4py import MPI

import cma.comm
import cma.mpi

WINDOW = 64  # osu_bibw's window_size
SENT_AFTER = 0.005  # s: rank 1's window of eager Isends takes ~0.1 ms here


def bibw(comm: Any, rank: int, s_msg: list[Any], r_msg: list[Any], loops: int) -> dict[str, float]:
    """osu_bibw's loop; µs per message of the whole and of its phases."""
    other = 1 - rank
    sends = [MPI.REQUEST_NULL] * WINDOW
    recvs = [MPI.REQUEST_NULL] * WINDOW
    spent = dict.fromkeys(("bibw", "bibw irecv", "bibw isend", "bibw wait"), 0.0)
    clock = time.perf_counter
    comm.Barrier()
    for _ in range(loops):
        t0 = clock()
        for j in range(WINDOW):
            recvs[j] = comm.Irecv(r_msg, other, 10 + rank)
        t1 = clock()
        for j in range(WINDOW):
            sends[j] = comm.Isend(s_msg, other, 10 + other)
        t2 = clock()
        MPI.Request.Waitall(sends)
        t3 = clock()
        MPI.Request.Waitall(recvs)
        t4 = clock()
        spent["bibw"] += t4 - t0
        spent["bibw irecv"] += t1 - t0
        spent["bibw isend"] += t2 - t1
        spent["bibw wait"] += t4 - t3
    return {key: value / loops / WINDOW * 1e6 for key, value in spent.items()}


def phases(comm: Any, world: MPI.Intracomm, rank: int, s_msg: list[Any], r_msg: list[Any],
           loops: int) -> dict[str, float]:
    """The same calls one side at a time, barriers between; µs per message."""
    sends = [MPI.REQUEST_NULL] * WINDOW
    recvs = [MPI.REQUEST_NULL] * WINDOW
    spent: dict[str, float] = defaultdict(float)
    clock = time.perf_counter
    for _ in range(loops):
        if rank == 0:  # posted before anything is sent
            t = clock()
            for j in range(WINDOW):
                recvs[j] = comm.Irecv(r_msg, 1, 5)
            spent["posted"] += clock() - t
        world.Barrier()
        if rank == 1:
            t = clock()
            for j in range(WINDOW):
                sends[j] = comm.Isend(s_msg, 0, 5)
            spent["isend"] += clock() - t
            MPI.Request.Waitall(sends)
        else:  # out of MPI (whose waits would run cma's hook) until they are all sent
            time.sleep(SENT_AFTER)
            t = clock()  # every message in the ring: hand them over, retire the requests
            MPI.Request.Waitall(recvs)
            spent["deliver"] += clock() - t
        world.Barrier()
        if rank == 1:
            for j in range(WINDOW):
                sends[j] = comm.Isend(s_msg, 0, 6)
        world.Barrier()
        if rank == 0:  # arrived before its receive
            t = clock()
            for j in range(WINDOW):
                recvs[j] = comm.Irecv(r_msg, 1, 6)
            spent["arrived"] += clock() - t
            MPI.Request.Waitall(recvs)
        else:  # (after the Barrier: a rendezvous send completes once received)
            MPI.Request.Waitall(sends)
        world.Barrier()
    return {key: value / loops / WINDOW * 1e6 for key, value in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8, help="message bytes (default 8)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--queued-copy-limit", type=int, metavar="BYTES",
                        help="cma.comm.QUEUED_COPY_LIMIT for this run (A/B of that choice)")
    args = parser.parse_args()
    if args.queued_copy_limit is not None:
        cma.comm.QUEUED_COPY_LIMIT = args.queued_copy_limit
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit("run with mpiexec -n 2")
    rank = world.Get_rank()
    libraries = {"plain": world, "cma.mpi": cma.mpi.Comm(world)}
    s_buf, r_buf = mmap.mmap(-1, 1 << 22), mmap.mmap(-1, 1 << 22)  # osu_bibw's buffers
    s_msg, r_msg = [s_buf, args.size, MPI.BYTE], [r_buf, args.size, MPI.BYTE]
    figures: dict[tuple[str, str], list[float]] = defaultdict(list)
    for round_number in range(args.rounds):
        order = list(libraries) if round_number % 2 == 0 else list(reversed(libraries))
        for name in order:
            comm = libraries[name]
            bibw(comm, rank, s_msg, r_msg, 5)  # warm-up
            measured = bibw(comm, rank, s_msg, r_msg, args.loops)
            measured.update(phases(comm, world, rank, s_msg, r_msg, args.loops // 4))
            other = world.gather(measured, 0)  # rank 1's isend, everyone's bibw
            if rank == 0:
                assert other is not None
                measured["isend"] = other[1]["isend"]
                for key, value in measured.items():
                    figures[(name, key)].append(value)
    if rank == 0:
        keys = ["bibw", "bibw irecv", "bibw isend", "bibw wait", "posted", "deliver", "arrived", "isend"]
        library = MPI.Get_library_version().splitlines()[0]
        print(f"# osu_bibw's pattern, {args.size} B, window {WINDOW}, {args.rounds} rounds "
              f"(order alternating), µs per message: median [min-max]; {library}; "
              f"QUEUED_COPY_LIMIT {cma.comm.QUEUED_COPY_LIMIT}")
        print(f"{'':12s}" + "".join(f"{name:>22s}" for name in libraries))
        for key in keys:
            cells = []
            for name in libraries:
                values = figures[(name, key)]
                cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
            print(f"{key:12s}" + "".join(f"{cell:>22s}" for cell in cells))


if __name__ == "__main__":
    main()

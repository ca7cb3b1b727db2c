"""One rank of bench/scale.py: the same program under ``cma-run`` (``cma``) and ``mpiexec`` (``mpi``).

It times how long the library takes to be ready, reads its own shared mappings and fds,
then times an 8 B all-to-all (pairwise ``Sendrecv`` rounds, as a code without a
collective library would write it) twice, the second time with every pair connected,
a large one (1 MiB unless told) and a ring exchange, and
then waits through a quiet spell (each rank waits in the library for 2.5 s while
another is late to a barrier) and reads the machine's shared memory again, and
sends its figures to rank 0, which prints them as one JSON line. Run it through
bench/scale.py, which starts it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np

TAG = 5
QUIET_SPELL_S = 2.5  # (cma hands back a ring quiet for 1-2 s: progress.QUIET_SECONDS)


def shared_mappings() -> tuple[int, int]:
    """(mapped, resident) bytes of this process's shared mappings, from /proc/self/smaps."""
    mapped = resident = 0
    shared = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                perms = line.split()[1]
                shared = perms[3] == "s"
            elif shared and first == "Size:":
                mapped += int(line.split()[1]) << 10
            elif shared and first == "Rss:":
                resident += int(line.split()[1]) << 10
    return mapped, resident


def machine_shmem() -> int:
    """Bytes of shared memory (tmpfs, memfd, SysV) resident on the whole machine."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no Shmem line in /proc/meminfo")


def alltoall(comm: Any, send: np.ndarray, recv: np.ndarray, rank: int, size: int) -> None:
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        comm.Sendrecv(send[dst], dst, TAG, recvbuf=recv[src], source=src, recvtag=TAG)


def timed(comm: Any, iters: int, body: Any) -> float:
    """Seconds per iteration of ``body`` on this rank, from a common start (a barrier)."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        body()
    return (time.perf_counter() - start) / iters


def main() -> None:
    lib, big_iters, small_iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    block = int(sys.argv[4])  # bytes per pair in the large all-to-all
    started = time.perf_counter()
    if lib == "cma":
        import cma

        comm = cma.COMM_WORLD
        imported = time.perf_counter()
        comm.attach()
    else:
        imported = time.perf_counter()
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    ready = time.perf_counter() - started
    figures: dict[str, Any] = {"ready_s": ready, "attach_s": time.perf_counter() - imported}
    # before any traffic: cma connects peers on first use, MPICH at init
    figures["mapped_attached"], _ = shared_mappings()
    figures["fds_attached"] = len(os.listdir("/proc/self/fd"))
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    figures["mapped"], figures["resident"] = shared_mappings()
    figures["fds"] = len(os.listdir("/proc/self/fd"))

    small = np.zeros((size, 8), np.uint8), np.zeros((size, 8), np.uint8)
    figures["alltoall_8B_s"] = timed(comm, small_iters, lambda: alltoall(comm, *small, rank, size))
    # again, every pair connected now (cma connects on first use): the steady state, with
    # the CPU time and involuntary context switches this rank spent on it
    before = resource.getrusage(resource.RUSAGE_SELF)
    figures["alltoall_8B_steady_s"] = timed(comm, small_iters,
                                            lambda: alltoall(comm, *small, rank, size))
    after = resource.getrusage(resource.RUSAGE_SELF)
    figures["alltoall_8B_steady_cpu_s"] = (after.ru_utime - before.ru_utime
                                           + after.ru_stime - before.ru_stime) / small_iters
    figures["alltoall_8B_steady_preempted"] = (after.ru_nivcsw - before.ru_nivcsw) / small_iters

    big = np.ones((size, block), np.uint8), np.zeros((size, block), np.uint8)
    comm.Barrier()
    before = machine_shmem() if rank == 0 else 0
    figures["alltoall_big_s"] = timed(comm, big_iters, lambda: alltoall(comm, *big, rank, size))
    comm.Barrier()
    if rank == 0:
        figures["shmem_growth"] = machine_shmem() - before
    if not (big[1][(rank - 1) % size] == 1).all():
        raise RuntimeError("the large all-to-all delivered wrong bytes")

    ring = np.ones(64 << 10, np.uint8), np.zeros(64 << 10, np.uint8)
    right, left = (rank + 1) % size, (rank - 1) % size
    figures["ring_64KiB_s"] = timed(comm, small_iters, lambda: comm.Sendrecv(
        ring[0], right, TAG, recvbuf=ring[1], source=left, recvtag=TAG))
    figures["mapped_after"], figures["resident_after"] = shared_mappings()
    figures["fds_after"] = len(os.listdir("/proc/self/fd"))

    # A quiet spell: every rank waits in the library for QUIET_SPELL_S while another is
    # late to a barrier (cma hands back the pages of rings gone quiet as a rank sleeps)
    for late in sorted({0, 1 % size}):
        if rank == late:
            time.sleep(QUIET_SPELL_S)
        comm.Barrier()
    if rank == 0:
        figures["shmem_growth_quiet"] = machine_shmem() - before
    figures["resident_quiet"] = shared_mappings()[1]

    if rank == 0:
        ranks = [figures] + [comm.recv(source=r, tag=TAG + 1) for r in range(1, size)]
        print(json.dumps({"lib": lib, "ranks": size, "per_rank": ranks}), flush=True)
    else:
        comm.send(figures, dest=0, tag=TAG + 1)
    comm.Barrier()


if __name__ == "__main__":
    main()

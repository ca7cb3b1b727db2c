"""Rank 1 cannot take its node's world (its open-file limit leaves room for too few of
the world's fds): every rank must raise cma's CmaError naming rank 1, at once.

The node's other ranks got their fds; had they gone on to connect, they would wait for
rank 1 until CMA_CONNECT_TIMEOUT, which the test sets beyond its own backstop.
"""

from __future__ import annotations

import os
import resource

from mpi4py import MPI

import cma.errors
import cma.mpi

FREE_SLOTS = 3  # the socket to rank 0's fd server and a few fds: fewer than a world's 4


def limit_leaving(free: int) -> int:
    """The open-file limit under which only ``free`` more fds can be opened now."""
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}  # (and listdir's own, closed now)
    limit = 0
    while free:
        if limit not in used:
            free -= 1
        limit += 1
    return limit


rank = MPI.COMM_WORLD.Get_rank()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if rank == 1:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit_leaving(FREE_SLOTS), hard))
try:
    cma.mpi.Comm(MPI.COMM_WORLD)
    outcome = "connected"
except cma.errors.CmaError as exc:
    outcome = str(exc)
finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
assert "rank 1: could not take the node's world from node rank 0" in outcome, outcome
assert "raise the open-file limit" in outcome, outcome
print(f"OK {rank}: {outcome}", flush=True)

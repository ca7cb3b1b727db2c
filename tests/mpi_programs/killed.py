"""Rank 1 dies once rank 0 is asleep in a cma.mpi call that needs rank 1.

It dies by os._exit: for cma that is a SIGKILL (no clean-up of its runs, nothing marks
its end closed), but hydra answers a rank killed by a signal by killing the others, even
with auto clean-up off, which would race rank 0's own detection.

Arguments: the phase (Recv, Barrier, Probe, Allreduce of a rendezvous size, or Send of a
rendezvous rank 1 never receives), the transport and a file. Run under
``mpiexec -disable-auto-cleanup`` so that nothing but cma.mpi notices the death: rank 0
writes the PeerGoneError it got to the file (hydra may stop forwarding output once a rank
was killed) and exits 0.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import cma.mpi

PHASE, TRANSPORT, REPORT = sys.argv[1:4]
RENDEZVOUS = 8 << 20  # above cma's 2 MiB eager limit
HANG = 60.0


def asleep_in_poll(pid: int) -> bool:
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    with open(f"/proc/{pid}/task/{pid}/wchan") as f:
        return state == "S" and "poll" in f.read()


comm = cma.mpi.Comm(MPI.COMM_WORLD, transport=TRANSPORT)
assert comm.cma is not None, "the ranks must share a node"
pids = comm.allgather(os.getpid())
comm.Barrier()
deadline = time.monotonic() + HANG
if comm.rank == 1:
    MPI.COMM_WORLD.recv(source=0, tag=9)  # rank 0 is out of the Barrier, on its way
    while not asleep_in_poll(pids[0]):  # rank 0 blocked in the call under test
        assert time.monotonic() < deadline, "rank 0 never blocked"
        time.sleep(0.001)  # (a polling interval, not a wait for anything)
    os._exit(9)
if comm.rank == 0:
    MPI.COMM_WORLD.send(None, dest=1, tag=9)
    start = time.monotonic()
    try:
        if PHASE == "Barrier":
            comm.Barrier()
        elif PHASE == "Probe":
            comm.Probe(1, 5)
        elif PHASE == "Allreduce":
            comm.Allreduce(np.ones(RENDEZVOUS // 8), np.empty(RENDEZVOUS // 8))
        elif PHASE == "Send":
            comm.Send(np.ones(RENDEZVOUS, np.uint8), 1, 5)
        else:
            comm.Recv(np.empty(RENDEZVOUS, np.uint8), 1, 5)
    except cma.mpi.PeerGoneError as exc:
        with open(REPORT, "w") as f:
            f.write(f"rank 0: {PHASE}, {TRANSPORT}: {type(exc).__name__} after "
                    f"{(time.monotonic() - start) * 1000:.1f} ms: {exc}")
        os._exit(0)
    os._exit(1)

"""Ctrl-C in the waits of a mixed rank (peers on its node and off it).

Three ranks, CMA_MPI_NODES=0,0,1: ranks 0 and 1 share a pretend node, rank 2 is
elsewhere, so ranks 0 and 1 are mixed. Rank 1 blocks in a Recv from rank 0 (on-node),
then in a Recv from ANY_SOURCE (matched across both engines: ``Progress.wait_until``
with MPI's probe as its outside pass); each time rank 0 waits until rank 1 sleeps on its
doorbell and sends it SIGINT. Each must raise KeyboardInterrupt within BOUND seconds and
leave the communicator usable, the abandoned receive withdrawn: the message rank 0
sends afterwards arrives in a fresh buffer, none in an abandoned one (before, the
ANY_SOURCE receive stayed posted and took it). Last, a Recv from rank 2 (off-node) is
MPI's own blocking receive, which no library can cut short: rank 0 sends SIGINT, then
has rank 2 send; as with plain mpi4py the message is received and KeyboardInterrupt
comes out after (interrupts.py). Rank 0 prints one line per call.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import cma.mpi

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import sigint_when_asleep  # noqa: E402 - the tests' directory, on the path above

SMALL = 1000
TAG = 5
BOUND = 2.0  # seconds; as interrupted.py
SETTLE = 0.3  # seconds for rank 1 to be inside MPI's receive (MPI spins: /proc cannot tell)
HANG = 60.0
CALLS = ("Recv from an on-node rank", "Recv from ANY_SOURCE")

signal.signal(signal.SIGINT, signal.default_int_handler)
world = MPI.COMM_WORLD
pids = world.allgather(os.getpid())
comm = cma.mpi.Comm(world.Dup())

if world.rank == 1:
    abandoned = [np.zeros(SMALL, np.uint8) for _ in CALLS]
    for name, source, buf in zip(CALLS, (0, MPI.ANY_SOURCE), abandoned, strict=True):
        world.send(name, dest=0, tag=1)  # about to block
        try:
            comm.Recv(buf, source, TAG)
        except KeyboardInterrupt:
            world.send(time.monotonic(), dest=0, tag=2)
        else:
            raise AssertionError(f"{name} returned instead of being interrupted")
    fresh = np.zeros(SMALL, np.uint8)
    comm.Recv(fresh, 0, TAG)
    assert (fresh == 7).all(), "the message from rank 0 did not arrive whole"
    assert not any(buf.any() for buf in abandoned), "a message went into an abandoned buffer"
    world.send("off-node", dest=0, tag=1)
    offnode = np.zeros(SMALL, np.uint8)
    try:
        comm.Recv(offnode, 2, TAG)
        returned = time.monotonic()
        while time.monotonic() - returned < BOUND:
            pass  # (Python running after MPI returned: where the interrupt must come out)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("no KeyboardInterrupt after MPI's receive returned: lost")
    assert (offnode == 8).all(), "KeyboardInterrupt came before MPI's receive completed"
    print("mixed rank in an off-node Recv: KeyboardInterrupt after MPI returned", flush=True)
elif world.rank == 0:
    for name in CALLS:
        assert world.recv(source=1, tag=1) == name
        sent = sigint_when_asleep(pids[1], f"rank 1 in {name}", HANG)
        latency = world.recv(source=1, tag=2) - sent
        assert latency < BOUND, f"{name}: KeyboardInterrupt {latency:.3f} s after SIGINT"
        print(f"mixed rank waiting in a {name}: KeyboardInterrupt {latency * 1000:.1f} ms "
              "after SIGINT", flush=True)
    comm.Send(np.full(SMALL, 7, np.uint8), 1, TAG)
    assert world.recv(source=1, tag=1) == "off-node"
    time.sleep(SETTLE)
    os.kill(pids[1], signal.SIGINT)
    time.sleep(SETTLE)
    world.send(None, dest=2, tag=3)  # rank 2 may send now
else:
    world.recv(source=0, tag=3)
    comm.Send(np.full(SMALL, 8, np.uint8), 1, TAG)
comm.Free()
print(f"OK {world.rank}", flush=True)

"""Ctrl-C in a cma.mpi receive whose copy is under way, with each transport named; then
in a Recv and a Barrier that wait for a peer doing nothing.

Two ranks. Per transport: rank 1 receives 136 MiB from rank 0 through a fresh
cma.mpi.Comm, its copy pausing before its second call (or staging fragment) until a
signal comes (tests/_peers.py, pause_copies_for_a_signal); it tells rank 0, which sends
it SIGINT. Rank 1 must raise KeyboardInterrupt within BOUND seconds; then its
communicator is usable (the eager message after arrives) or raises an error naming the
interrupt. Both ranks free the communicator and go on to the next transport; rank 0
prints one line per transport, and each rank "OK <rank>" at the end.

Then, on a fresh communicator of the default transport: rank 1 blocks in a Recv, then
in a Barrier, then in the Wait of a large Isend, then in a Probe, while rank 0 only waits until rank 1
sleeps on its doorbell and sends SIGINT. Each must raise KeyboardInterrupt within BOUND;
then the next Barrier pairs with rank 0's second (the abandoned round completes behind
it), the message rank 0 sends arrives in a fresh buffer, never in the abandoned one, and
the large send, not withdrawn, completes once rank 0 receives it. Rank 0 prints one line
per call.

Last, rank 1 waits for an Irecv inside MPI's own ``MPI.Request.Waitall``, where MPI runs
cma's Python only in its callbacks; rank 0 sends SIGINT, then the message a while later.
As with plain mpi4py, Waitall completes (the message is in the buffer) and the
KeyboardInterrupt comes out once it returns (interrupts.py); before, the interrupt was
raised inside a callback, printed as ignored and lost. Rank 1 prints how long after.
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
from _peers import pause_copies_for_a_signal  # noqa: E402 - the tests' directory, on the path above
from conftest import sigint_when_asleep  # noqa: E402 - the same

SIZE = 136 << 20  # rank 1 copies more than one call of 64 MiB with each transport (SPLIT: half)
SMALL = 1000
LARGE = 8 << 20  # a rendezvous: its sender's Wait lasts until the receiver takes it
TAG = 5
SETTLE = 0.3  # seconds for rank 1 to be inside MPI's wait, and for MPI to call back into cma
BOUND = 2.0  # seconds; as test_interrupts.INTERRUPT_BOUND (measured: ms)
HANG = 60.0

# As an interactive Python has it (a launcher may start ranks with SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
world = MPI.COMM_WORLD
pids = world.allgather(os.getpid())


def receiver(comm: cma.mpi.Comm) -> None:
    buf = np.empty(SIZE, np.uint8)
    node = comm.cma
    assert node is not None, "the ranks must share a node"
    node.attach()
    pause_copies_for_a_signal(node, lambda: world.send(None, dest=0, tag=3))
    world.send(None, dest=0, tag=1)  # about to receive
    try:
        comm.Recv(buf, 0, TAG)
    except KeyboardInterrupt:
        arrived = time.monotonic()
    else:
        raise AssertionError("the receive returned instead of being interrupted")
    try:
        comm.Iprobe(0, TAG + 1)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which judges it
        world.send((arrived, "broken", f"{type(exc).__name__}: {exc}"), dest=0, tag=2)
        return
    world.send((arrived, "usable", ""), dest=0, tag=2)
    small = np.zeros(SMALL, np.uint8)
    comm.Recv(small, 0, TAG + 1)
    assert (small == 7).all() and (buf == 3).all()


def sender(comm: cma.mpi.Comm, transport: str) -> None:
    payload = np.full(SIZE, 3, np.uint8)
    world.recv(source=1, tag=1)
    request = comm.Isend(payload, 1, TAG)
    sent = 0.0
    deadline = time.monotonic() + HANG
    while not world.iprobe(source=1, tag=2):  # (the send may never complete: rank 1 broke)
        assert time.monotonic() < deadline, "rank 1 never reported"
        if not sent and world.iprobe(source=1, tag=3):  # its copy is half done
            world.recv(source=1, tag=3)
            sent = time.monotonic()
            os.kill(pids[1], signal.SIGINT)
        request.Test()
    arrived, state, detail = world.recv(source=1, tag=2)
    assert sent, "rank 1's copy never paused for the signal"
    latency = arrived - sent
    if state == "usable":
        request.Wait()
        comm.Send(np.full(SMALL, 7, np.uint8), 1, TAG + 1)
    else:
        assert "KeyboardInterrupt" in detail, detail
    assert latency < BOUND, f"{transport}: KeyboardInterrupt {latency:.3f} s after SIGINT"
    print(f"{transport}: KeyboardInterrupt {latency * 1000:.1f} ms after SIGINT, then {state}: "
          f"{detail}", flush=True)


def idle_receiver(comm: cma.mpi.Comm) -> None:
    abandoned = np.zeros(SMALL, np.uint8)
    requests = []

    def wait_for_a_large_send() -> None:
        requests.append(comm.Isend(np.full(LARGE, 9, np.uint8), 0, TAG + 1))
        requests[0].Wait()

    for name, call in (("Recv", lambda: comm.Recv(abandoned, 0, TAG)), ("Barrier", comm.Barrier),
                       ("Wait", wait_for_a_large_send), ("Probe", lambda: comm.Probe(0, TAG + 3))):
        world.send(name, dest=0, tag=1)  # about to block
        try:
            call()
        except KeyboardInterrupt:
            world.send(time.monotonic(), dest=0, tag=2)
        else:
            raise AssertionError(f"{name} returned instead of being interrupted")
    comm.Barrier()  # pairs with rank 0's second
    fresh = np.zeros(SMALL, np.uint8)
    comm.Recv(fresh, 0, TAG)
    assert (fresh == 7).all(), "the message after the interrupts did not arrive whole"
    assert not abandoned.any(), "the message went into the abandoned receive's buffer"
    requests[0].Wait()  # the interrupted send was not withdrawn: rank 0 takes it now


def idle_sender(comm: cma.mpi.Comm) -> None:
    for name in ("Recv", "Barrier", "Wait", "Probe"):
        assert world.recv(source=1, tag=1) == name
        sent = sigint_when_asleep(pids[1], f"rank 1 in {name}", HANG)
        latency = world.recv(source=1, tag=2) - sent
        assert latency < BOUND, f"{name}: KeyboardInterrupt {latency:.3f} s after SIGINT"
        print(f"waiting {name}: KeyboardInterrupt {latency * 1000:.1f} ms after SIGINT", flush=True)
    comm.Barrier()  # completes the round rank 1 abandoned
    comm.Barrier()
    comm.Send(np.full(SMALL, 7, np.uint8), 1, TAG)
    large = np.zeros(LARGE, np.uint8)
    comm.Recv(large, 1, TAG + 1)
    assert (large == 9).all(), "the send whose Wait was interrupted did not arrive whole"


for transport in sys.argv[1:]:
    comm = cma.mpi.Comm(world.Dup(), transport=transport)  # (Free frees the duplicate)
    if world.rank == 0:
        sender(comm, transport)
    else:
        receiver(comm)
    comm.Free()
def waitall_receiver(comm: cma.mpi.Comm) -> None:
    buf = np.zeros(SMALL, np.uint8)
    request = comm.Irecv(buf, 0, TAG + 2)
    world.send(None, dest=0, tag=1)  # about to wait inside MPI
    returned = None
    try:
        MPI.Request.Waitall([request])
        returned = time.monotonic()
        while time.monotonic() - returned < BOUND:
            pass  # (Python running after MPI returned: where the interrupt must come out)
    except KeyboardInterrupt:
        arrived = time.monotonic()
    else:
        raise AssertionError("Waitall returned and no KeyboardInterrupt came: the Ctrl-C was lost")
    # (None: it came out as Waitall returned, as with plain mpi4py)
    assert (buf == 7).all(), "KeyboardInterrupt came before Waitall's receive completed"
    late = 0.0 if returned is None else arrived - returned
    print(f"waiting inside MPI.Request.Waitall: KeyboardInterrupt {late * 1000:.1f} ms after "
          "it returned", flush=True)


def waitall_sender(comm: cma.mpi.Comm) -> None:
    world.recv(source=1, tag=1)
    time.sleep(SETTLE)  # (MPI spins in its wait: nothing in /proc says rank 1 is in it)
    os.kill(pids[1], signal.SIGINT)
    time.sleep(SETTLE)  # a Ctrl-C deferred in a callback must survive MPI's next calls
    comm.Send(np.full(SMALL, 7, np.uint8), 1, TAG + 2)


comm = cma.mpi.Comm(world.Dup())
if world.rank == 0:
    idle_sender(comm)
    waitall_sender(comm)
else:
    idle_receiver(comm)
    waitall_receiver(comm)
comm.Free()
print(f"OK {world.rank}", flush=True)

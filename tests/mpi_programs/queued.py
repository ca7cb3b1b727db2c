"""Messages still queued for a full ring when the sender moves on to plain MPI calls.

Rank 0 posts more eager-sized Isends to rank 1 than the ring holds: they complete at once
(copied into packets queued behind the full ring), so MPI.Request.Waitall returns, and
rank 0 goes into a plain MPI.COMM_WORLD.Barrier while rank 1, which started late,
receives them. Only rank 0 can move its queued packets into the ring: MPI's Barrier
must keep doing it (the progress hook stays armed while anything is queued), or rank 1
waits for ever (osu_bibw hung this way). The other ranks only take part in the Barrier.

``objects`` (argv): the same with pickled objects sent by ``comm.send``, which completes
once its packet is queued too (cma-bench's statistics message hung so, 1 run in 12, while
the sender waited in MPI's Barrier of the next step).

``fin`` (argv): the packet queued is the FIN of a direct receive (cma/direct.py). Rank 1
fills its ring to rank 0 with eager Isends, then receives rank 0's blocking 256 KiB Send
by the direct path, whose FIN finds that ring full, and goes into a plain MPI Barrier;
rank 0's Send waits for that FIN (it waited for ever before the direct path armed the
hook).

``idle`` (argv): the other side of it. Once rank 1's requests are done, MPI's progress
hook has nothing of cma's to move, so it must leave the rings alone: a packet it took
out while rank 1 waited in plain MPI would be queued unexpected, and the receive that
follows would go through the engine (under Open MPI, whose Barrier called the hook
again after the last request, 3 runs in 8 of clients.py did). And it must be gone from
MPI's progress loop: under Open MPI it stayed registered, and every plain MPI message
paid a call into Python.

``exit`` (argv): rank 0's Isends queue behind the full ring as above, and rank 0 then
exits with no other cma.mpi call. Its eager sends were complete to MPI, which delivers
them before MPI_Finalize; cma's queue dies with the process, so it is delivered at exit.

``unreceived`` (argv): the same, but rank 1 receives none of them and exits too: rank 0
must not wait at exit for a reader that is gone to MPI_Finalize, which in turn waits
for rank 0 (both waited for ever).

``dropped`` (argv): as ``unreceived``, but rank 1 first drops its wrapper without
``Free`` (its node communicator was garbage collected, and nothing at exit told rank 0
that rank 1 reads no more: both waited for ever).

``bsend-exit`` (argv): rank 0's buffered send, larger than the eager limit (a copy rank 1
pulls), then rank 0 exits at once: the copy must live until rank 1 has pulled it (rank
1's pull found rank 0's memory gone).

Prints "OK <rank>" at the end.
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np
from mpi4py import MPI

import cma.mpi
from cma.mpi.requests import SERVED

comm = cma.mpi.Comm(MPI.COMM_WORLD)
rank = comm.Get_rank()
COUNT, SIZE = 256, 64 << 10  # 16 MiB in all: twice the ring, each below the queued-copy limit
DIRECT_SIZE = 256 << 10  # fin: a blocking Send the direct rendezvous takes (DIRECT_FROM)
objects = sys.argv[1:] == ["objects"]
FILL = (2 << 20) - 32  # four packets of exactly 2 MiB fill an 8 MiB ring

if sys.argv[1:] == ["fin"]:
    if rank == 1:
        fills = [comm.Isend(np.full(FILL, k, np.uint8), 0, 6) for k in range(4)]
        MPI.COMM_WORLD.Barrier()
        got = np.empty(DIRECT_SIZE, np.uint8)
        comm.Recv(got, 0, 5)
        assert got[0] == got[-1] == 7
        MPI.COMM_WORLD.Barrier()  # plain MPI: the queued FIN must still go out
        MPI.Request.Waitall(fills)
    elif rank == 0:
        MPI.COMM_WORLD.Barrier()
        time.sleep(0.05)  # (rank 1 waits in its Recv by now)
        comm.Send(np.full(DIRECT_SIZE, 7, np.uint8), 1, 5)
        got = np.empty(FILL, np.uint8)
        for k in range(4):
            comm.Recv(got, 1, 6)
            assert got[0] == got[-1] == k
        MPI.COMM_WORLD.Barrier()
    else:
        MPI.COMM_WORLD.Barrier()
        MPI.COMM_WORLD.Barrier()
    print(f"OK {rank}", flush=True)
    sys.exit(0)

if sys.argv[1:] == ["idle"]:
    got = np.empty(5, np.int32)
    if rank == 0:
        comm.Send(np.full(5, 1, np.int32), 1, 4)
        comm.Recv(got, 1, 5)  # (cma's ring, which MPI's progress never touches here)
        comm.Send(np.full(5, 2, np.int32), 1, 3)
        MPI.COMM_WORLD.Send(b"x", 1, 9)
    elif rank == 1:
        comm.Irecv(got, 0, 4).Wait()  # a request: the hook serves this rank until it is done
        comm.Send(got, 0, 5)
        time.sleep(0.3)  # (rank 0's tag-3 packet is in the ring before MPI's first progress)
        MPI.COMM_WORLD.Recv(bytearray(1), 0, 9)
        assert not comm.cma._matcher.unexpected, "MPI's wait took a packet no request waited for"
        hook = SERVED._hook
        assert hook is None or not hook._armed, "MPI's progress still calls into cma for nothing"
        comm.Recv(got, 0, 3)
        assert got.tolist() == [2] * 5
    MPI.COMM_WORLD.Barrier()
    print(f"OK {rank}", flush=True)
    sys.exit(0)

if sys.argv[1:] in (["exit"], ["unreceived"], ["dropped"]):
    # Rank 0 makes no cma.mpi call after its Waitall: it exits, and its queue must reach
    # the ring before mpi4py's MPI_Finalize (rank 1 waited for ever before), unless rank 1
    # reads no more.
    if rank == 0:
        out = [np.full(SIZE, k, np.uint8) for k in range(COUNT)]
        MPI.Request.Waitall([comm.Isend(buf, 1, 5) for buf in out])
        assert comm.cma._progress.txq_pending, "nothing was queued: the scenario did not happen"
        MPI.COMM_WORLD.Send(b"q", 1, 9)  # (plain MPI: rank 1 reads cma's ring only after it)
    elif rank == 1:
        MPI.COMM_WORLD.Recv(bytearray(1), 0, 9)
        if sys.argv[1] == "dropped":
            del comm
            gc.collect()
        got = np.empty(SIZE, np.uint8)
        for k in range(COUNT if sys.argv[1] == "exit" else 0):
            comm.Recv(got, 0, 5)
            assert got[0] == k and got[-1] == k, (k, got[0])
    print(f"OK {rank}", flush=True)
    sys.exit(0)

if sys.argv[1:] == ["bsend-exit"]:
    BUFFERED = 4 << 20  # beyond the 2 MiB eager limit of two ranks: the peer pulls a copy
    if rank == 0:
        comm.Bsend(np.full(BUFFERED, 7, np.uint8), 1, 5)
        assert comm.cma._progress.buffered, "no copy waits to be pulled: the scenario did not happen"
    elif rank == 1:
        time.sleep(0.3)  # (rank 0 has reached its exit: the pull must find the copy there)
        got = np.zeros(BUFFERED, np.uint8)
        comm.Recv(got, 0, 5)
        assert (got == 7).all()
    print(f"OK {rank}", flush=True)
    sys.exit(0)

if rank == 0:
    if objects:
        for k in range(COUNT):
            comm.send(bytes([k]) * SIZE, 1, 5)
    else:
        out = [np.full(SIZE, k, np.uint8) for k in range(COUNT)]
        MPI.Request.Waitall([comm.Isend(buf, 1, 5) for buf in out])
elif rank == 1:
    time.sleep(0.5)  # (so that rank 0's sends fill the ring and queue behind it)
    got = np.empty(SIZE, np.uint8)
    for k in range(COUNT):
        if objects:
            data = comm.recv(None, 0, 5)
            assert len(data) == SIZE and data[0] == data[-1] == k, (k, data[0])
        else:
            comm.Recv(got, 0, 5)
            assert got[0] == k and got[-1] == k, (k, got[0])
MPI.COMM_WORLD.Barrier()
print(f"OK {rank}", flush=True)

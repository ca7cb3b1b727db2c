"""``mpi4py.util.pkl5`` over cma.mpi.Comm: every pkl5 call, and its bytes through cma.

``pkl5.Intracomm(cma.mpi.Comm(MPI.COMM_WORLD))`` sends a 4 MiB NumPy array inside an
object by each of pkl5's point-to-point calls (send, ssend, isend, sendrecv, mprobe,
improbe, ANY_SOURCE) and collectives, to every other rank. Each exchange is checked
by value and, where both ranks share a node, by the bytes cma's statistics counted on
the receiver (pkl5 sends an object's out-of-band buffers as messages of their own, so a
4 MiB array is 4 MiB through cma). pkl5 over the raw ``MPI.COMM_WORLD`` in the same
process stays MPI's, and messages sent on it are received on it. With
``CMA_MPI_DISABLE=1`` nothing goes through cma. Prints "OK <rank>" at the end.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI
from mpi4py.util import pkl5

import cma.mpi
from cma.mpi.pkl5 import routed_to

wrapper = cma.mpi.Comm(MPI.COMM_WORLD)
comm = pkl5.Intracomm(wrapper)
rank, size = comm.Get_rank(), comm.Get_size()
disabled = os.environ.get("CMA_MPI_DISABLE") == "1"
on_node = set(wrapper.node_ranks) - {rank}
assert routed_to(comm) is wrapper  # (disabled, or alone on its node: the wrapper forwards to MPI)
assert routed_to(pkl5.Intracomm(comm)) is routed_to(comm)  # a pkl5 comm of a pkl5 comm
assert routed_to(pkl5.Intracomm(MPI.COMM_WORLD)) is None

NBYTES = 4 << 20


def payload(source: int, tag: int) -> dict:
    return {"from": source, "tag": tag, "a": np.full(NBYTES // 8, source * 1000 + tag, dtype=np.float64)}


def check(obj: dict, source: int, tag: int) -> None:
    assert obj["from"] == source and obj["tag"] == tag, obj
    assert obj["a"].shape == (NBYTES // 8,) and (obj["a"] == source * 1000 + tag).all()


def cma_bytes() -> int:
    return 0 if wrapper.cma is None else sum(s["bytes"] for s in wrapper.cma.stats().values())


def counted(what: str, peer: int, before: int) -> None:
    """The bytes this rank's cma moved since ``before`` include the array, if ``peer``
    shares this node (and cma is on); else none of it went through cma."""
    moved = cma_bytes() - before
    if peer in on_node and not disabled:
        assert moved >= NBYTES, f"{what} from rank {peer}: {moved} bytes through cma"


# -- point-to-point, every pair, each call form; the lower rank sends first
for peer in range(size):
    if peer == rank:
        continue
    first = rank < peer
    for tag, form in enumerate(("send", "ssend", "isend", "mprobe", "improbe", "any", "sendrecv")):
        before = cma_bytes()
        if form == "sendrecv":
            got = comm.sendrecv(payload(rank, tag), dest=peer, sendtag=tag, source=peer, recvtag=tag)
            check(got, peer, tag)
            counted(form, peer, before)
            continue
        for turn in ((True, False) if first else (False, True)):
            if turn:  # this rank sends
                if form == "ssend":
                    comm.ssend(payload(rank, tag), dest=peer, tag=tag)
                elif form == "isend":
                    comm.isend(payload(rank, tag), dest=peer, tag=tag).wait()
                else:
                    comm.send(payload(rank, tag), dest=peer, tag=tag)
                continue
            status = MPI.Status()
            if form == "mprobe":
                got = comm.mprobe(source=peer, tag=tag, status=status).recv()
            elif form == "improbe":
                message = None
                while message is None:
                    message = comm.improbe(source=peer, tag=tag, status=status)
                got = message.irecv().wait()
            elif form == "any":
                got = comm.recv(source=MPI.ANY_SOURCE, tag=tag, status=status)
            else:
                got = comm.recv(source=peer, tag=tag, status=status)
            check(got, peer, tag)
            assert status.Get_source() == peer and status.Get_tag() == tag, (status.source, status.tag)
            counted(form, peer, before)

# -- collectives through pkl5: bcast from every root, and the others once
for root in range(size):
    # (a root's 4 MiB goes to a node's other rank in eager pieces, which that rank's cma
    # may take from its ring, and count, while it still waits elsewhere (in MPI's barrier
    # too, through cma's progress hook): so ``before`` is read first, and the barrier, a
    # raw MPI one, keeps the root from sending before every rank has read it)
    before = cma_bytes()
    MPI.COMM_WORLD.Barrier()
    got = comm.bcast(payload(root, 50) if rank == root else None, root=root)
    check(got, root, 50)
    if rank != root:
        counted("bcast", root, before)
for got, source in zip(comm.allgather(payload(rank, 51)), range(size), strict=True):
    check(got, source, 51)
for got, source in zip(comm.alltoall([payload(rank, 52)] * size), range(size), strict=True):
    check(got, source, 52)
gathered = comm.gather(payload(rank, 53), root=0)
if rank == 0:
    for source, got in enumerate(gathered):
        check(got, source, 53)
check(comm.scatter([payload(0, 54)] * size if rank == 0 else None, root=0), 0, 54)

# -- pkl5 over MPI's own handle beside it: MPI's channel, its messages its own
raw = pkl5.Intracomm(MPI.COMM_WORLD)
if size > 1:
    right, left = (rank + 1) % size, (rank - 1) % size
    request = raw.isend(payload(rank, 60), dest=right, tag=60)
    before = cma_bytes()
    check(raw.recv(source=left, tag=60), left, 60)
    request.wait()
    assert cma_bytes() == before, "pkl5 over the raw communicator went through cma"

wrapper.Barrier()
print(f"OK {rank}", flush=True)

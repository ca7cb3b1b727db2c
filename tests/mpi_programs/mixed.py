"""Ranks with peers on their node (cma) and on other nodes (MPI) at once.

Run 4 ranks with pretend nodes of two, e.g. CMA_MPI_NODES=0,0,1,1 or 0,1,1,0; argv[1]
is the transport ("shm" makes cma need the sender's progress, as MPI's rendezvous
does). Checks MPI's matching order across the two channels, ANY_SOURCE, and that a
rank blocked in one engine keeps the other moving. Prints "OK <rank>".
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import cma.mpi

Request = cma.mpi.Request
comm = cma.mpi.Comm(MPI.COMM_WORLD, transport=sys.argv[1] if len(sys.argv) > 1 else "auto")
rank, size = comm.rank, comm.size
assert size == 4 and comm.cma is not None and len(comm.node_ranks) == 2, comm
# Seen from rank 0: "one" shares its node, "two" and "three" are on the other node.
node0 = comm.bcast(comm.node_ranks, root=0)
one = next(r for r in node0 if r != 0)
two, three = sorted(set(range(size)) - set(node0))
BIG = 4 << 20


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# -- fan-in with ANY_SOURCE: per-source order holds, statuses name the right sender
K = 30
if rank == 0:
    seen: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for _ in range(3 * K):
        buf = np.empty(5000, dtype=np.int64)
        st = MPI.Status()
        comm.Recv(buf, MPI.ANY_SOURCE, MPI.ANY_TAG, st)
        assert buf[0] == st.source and st.tag == buf[1] % 4, (buf[:2], st.source, st.tag)
        assert st.Get_count(MPI.INT64_T) == (5000 if buf[1] % 5 == 0 else 2)
        seen[st.source].append(int(buf[1]))
    assert all(seq == list(range(K)) for seq in seen.values()), seen
else:
    for k in range(K):
        n = 5000 if k % 5 == 0 else 2  # eager and rendezvous messages, interleaved
        comm.Send(np.concatenate([ints(rank, k), np.zeros(n - 2, dtype=np.int64)]), 0, k % 4)
comm.Barrier()

# -- receives posted after a pending wildcard keep MPI's posted order
if rank == 0:
    w = comm.Irecv(buf_w := np.empty(2, dtype=np.int64), MPI.ANY_SOURCE, 5)
    r1 = comm.Irecv(buf_1 := np.empty(2, dtype=np.int64), one, 5)
    r2 = comm.Irecv(buf_2 := np.empty(2, dtype=np.int64), two, 5)
    other = comm.Irecv(buf_o := np.empty(2, dtype=np.int64), one, 7)  # overlaps none: no wait
    comm.Barrier()  # now the others send
    other.Wait()
    assert buf_o.tolist() == [one, 99]
    Request.Waitall([w, r1, r2])
    rest = np.empty(2, dtype=np.int64)
    comm.Recv(rest, MPI.ANY_SOURCE, 5)
    got = [buf_w.tolist(), buf_1.tolist(), buf_2.tolist(), rest.tolist()]
    assert buf_1[0] == one and buf_2[0] == two, got
    for src in (one, two):
        assert [k for s, k in got if s == src] == [0, 1], got  # each sender's order kept
    w6 = comm.Irecv(np.empty(1), MPI.ANY_SOURCE, 6)  # nobody sends tag 6 yet
    late = comm.irecv(source=one, tag=8)
    comm.send("go", one, 9)
    assert late.wait() == "tag 8" and not w6.Test()
    comm.Send(np.zeros(1), 0, 6)  # to itself
    w6.Wait()
else:
    comm.Barrier()
    if rank in (one, two):
        comm.Send(ints(rank, 0), 0, 5)
        comm.Send(ints(rank, 1), 0, 5)
    if rank == one:
        comm.Send(ints(rank, 99), 0, 7)
        assert comm.recv(source=0, tag=9) == "go"
        comm.send("tag 8", 0, 8)
comm.Barrier()

# -- probes and objects through ANY_SOURCE, any size from either channel
if rank == 0:
    st = MPI.Status()
    comm.probe(MPI.ANY_SOURCE, 10, st)
    assert st.source == two and comm.recv(None, st.source, 10) == "probe me"
    reqs = [comm.irecv(source=MPI.ANY_SOURCE, tag=11) for _ in range(3)]
    objs = Request.waitall(reqs)
    assert sorted(o["from"] for o in objs) == [1, 2, 3]
    assert all(o["a"].shape == (1 << 20,) and o["a"][-1] == o["from"] for o in objs)
    assert comm.recv(source=MPI.ANY_SOURCE, tag=12)["a"].nbytes == BIG
    assert comm.Iprobe(MPI.ANY_SOURCE, 12) is False
else:
    if rank == two:
        comm.send("probe me", 0, 10)
    comm.send({"from": rank, "a": np.full(1 << 20, rank, dtype=np.int64)}, 0, 11)
    if rank == three:
        comm.send({"a": np.zeros(BIG, dtype=np.uint8)}, 0, 12)
comm.Barrier()

# -- a rank blocked in one engine keeps the other moving (chains through both nodes)
payload = np.full(BIG, 7, dtype=np.uint8)
token = np.empty(1, dtype=np.int64)
for first, second in ((one, two), (two, one)):  # rank 0's big send: on-node, then off-node
    third = three
    if rank == 0:
        send = comm.Isend(payload, first, 20)
        comm.Recv(token, second, 21)  # arrives only after `first` got the payload
        send.Wait()
    elif rank == first:
        landed = np.empty(BIG, dtype=np.uint8)
        comm.Recv(landed, 0, 20)
        assert landed[0] == landed[-1] == 7
        comm.Send(ints(1), third, 21)
    elif rank == third:
        comm.Recv(token, first, 21)
        comm.Send(token, second, 21)
    else:
        comm.Recv(token, third, 21)
        comm.Send(token, 0, 21)
    comm.Barrier()

# -- every rank: requests of both kinds in one Waitall / testall
peers = [r for r in range(size) if r != rank]
recvs = [comm.Irecv(np.empty(3000, dtype=np.int64), r, 30) for r in peers]
sends = [comm.Isend(np.full(3000, rank, dtype=np.int64), r, 30) for r in peers]
statuses: list[MPI.Status] = []
Request.Waitall(recvs + sends, statuses)
assert [s.source for s in statuses[: len(peers)]] == peers
objs = [comm.irecv(source=r, tag=31) for r in peers]
for r in peers:
    comm.isend(r * 10 + rank, r, 31)
done, values = Request.testall(objs)
while not done:
    done, values = Request.testall(objs)
assert values == [rank * 10 + r for r in peers], values
comm.Barrier()
print(f"OK {rank}", flush=True)

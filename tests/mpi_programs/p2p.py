"""Point-to-point through cma.mpi.Comm, written as for mpi4py; valid in every routing mode.

Ranks talk in a ring, so with pretend nodes (CMA_MPI_NODES) some pairs are on-node
and some off-node. Prints "OK <rank> <mode>" at the end; any failure raises, and
``python -m mpi4py`` turns that into MPI_Abort.

Arguments: the transport (default auto), then "subclass" to run everything through a
subclass that overrides the point-to-point methods with calls to the wrapper's: the
wrapper then keeps them (nothing is handed out), which is also what an MPI whose
ANY_SOURCE and PROC_NULL differ from cma's (Open MPI) gets.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import cma.errors
import cma.mpi


class Passthrough(cma.mpi.Comm):
    def Send(self, buf, dest, tag=0):
        super().Send(buf, dest, tag)

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        super().Recv(buf, source, tag, status)

    def Isend(self, buf, dest, tag=0):
        return super().Isend(buf, dest, tag)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        return super().Irecv(buf, source, tag)


subclassed = sys.argv[2:] == ["subclass"]
comm = (Passthrough if subclassed else cma.mpi.Comm)(
    MPI.COMM_WORLD, transport=sys.argv[1] if len(sys.argv) > 1 else "auto")
rank, size = comm.Get_rank(), comm.Get_size()
assert (rank, size) == (comm.rank, comm.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
right, left = (rank + 1) % size, (rank - 1) % size
disabled = os.environ.get("CMA_MPI_DISABLE") == "1"
assert (comm.cma is None) == (disabled or len(comm.node_ranks) < 2), comm
BIG = 3 << 20  # above every eager limit: rendezvous


def status() -> MPI.Status:
    return MPI.Status()


# -- buffer specs, blocking, with Status contents
a = np.arange(16, dtype=np.float64) + rank
specs_out = [
    a, [a, MPI.DOUBLE], [a, 16, MPI.DOUBLE], [a, "d"], [a, 16, "d"], [a, 128, MPI.BYTE],
    [a, (4, 2), MPI.DOUBLE], [a, 4, 2, MPI.DOUBLE], [a, 5], a.tobytes(),
]
for i, spec in enumerate(specs_out):
    out = np.zeros(16)
    st = status()
    req = comm.Isend(spec, right, tag=100 + i)
    comm.Recv([out, MPI.DOUBLE], left, 100 + i, st)
    req.Wait()
    expected = np.arange(16, dtype=np.float64) + left
    if i in (6, 7):
        assert st.Get_count(MPI.DOUBLE) == 4 and np.array_equal(out[:4], expected[2:6]), (i, out)
    elif i == 8:
        assert st.Get_count(MPI.DOUBLE) == 5 and np.array_equal(out[:5], expected[:5]), (i, out)
    else:
        assert np.array_equal(out, expected), (i, out)
        assert st.Get_count(MPI.DOUBLE) == 16 and st.Get_count(MPI.BYTE) == 128
    assert st.Get_source() == st.source == left and st.Get_tag() == st.tag == 100 + i
    assert st.Get_elements(MPI.DOUBLE) == st.Get_count(MPI.DOUBLE)

# receive-side specs, count limits and typechars
for target, spec in [(t, [t, *rest]) for t, *rest in (
        (np.zeros(16), 16, MPI.DOUBLE), (np.zeros(32), "d"), (bytearray(128), MPI.BYTE))]:
    comm.Send(a, right, 7)
    st = status()
    comm.Recv(spec, left, 7, st)
    assert st.Get_count(MPI.BYTE) == 128
    assert np.array_equal(np.frombuffer(target, dtype=np.float64)[:16], np.arange(16.0) + left)

# -- zero bytes and large messages
comm.Send(b"", right, 8)
st = status()
comm.Recv(bytearray(0), left, 8, st)
assert st.Get_count() == 0 and st.source == left
big = np.full(BIG, rank % 251, dtype=np.uint8)
got = np.empty(BIG, dtype=np.uint8)
comm.Sendrecv(big, right, 9, got, left, 9, st)
assert st.Get_count() == BIG and st.source == left and st.tag == 9 and got[0] == got[-1] == left % 251

# -- non-overtaking order, wildcards, mixed tags
for k in range(50):
    comm.Send(np.array([k], dtype=np.int64), right, tag=k % 3)
seen = []
for _ in range(50):
    buf = np.empty(1, dtype=np.int64)
    st = status()
    comm.Recv(buf, MPI.ANY_SOURCE if size == 2 else left, MPI.ANY_TAG, st)
    assert st.tag == buf[0] % 3 and st.source == left
    seen.append(int(buf[0]))
assert seen == list(range(50)), seen
comm.Barrier()

# tag selection skips over other tags but keeps order within a tag
for k in range(6):
    comm.Send(np.array([k], dtype=np.int64), right, tag=20 + k % 2)
ones = []
for _ in range(3):
    buf = np.empty(1, dtype=np.int64)
    comm.Recv(buf, left, 21)
    ones.append(int(buf[0]))
zeros = []
for _ in range(3):
    buf = np.empty(1, dtype=np.int64)
    comm.Recv(buf, left, 20)
    zeros.append(int(buf[0]))
assert ones == [1, 3, 5] and zeros == [0, 2, 4], (ones, zeros)

# -- non-blocking: Wait/Test/Waitall/Testall/waitall/testall/Waitany, mixing sizes
sends = [comm.Isend(np.full(n, k, dtype=np.uint8), right, 30 + k)
         for k, n in enumerate((1, 100, 9000, BIG))]
bufs = [np.empty(n, dtype=np.uint8) for n in (1, 100, 9000, BIG)]
recvs = [comm.Irecv(b, left, 30 + k) for k, b in enumerate(bufs)]
statuses: list[MPI.Status] = []
while not cma.mpi.Request.Testall(recvs, statuses):
    pass
assert [s.Get_count() for s in statuses] == [1, 100, 9000, BIG]
assert [s.tag for s in statuses] == [30, 31, 32, 33] and {s.source for s in statuses} == {left}
assert all(int(b[0]) == k for k, b in enumerate(bufs))
assert cma.mpi.Request.Waitall(sends) is True
assert not any(sends) and not any(recvs)  # inactive, like MPI.REQUEST_NULL
st = status()
assert recvs[0].Wait(st) and st.source == MPI.ANY_SOURCE and st.tag == MPI.ANY_TAG

req = comm.Irecv(np.empty(4), left, 40)
flag = req.Test()
comm.Send(np.ones(4), right, 40)
while not flag:
    flag = req.Test()
reqs = [comm.isend({"k": k, "arr": np.full(10, k)}, right, 41 + k) for k in range(3)]
objs = cma.mpi.Request.waitall([comm.irecv(source=left, tag=41 + k) for k in range(3)])
assert [o["k"] for o in objs] == [0, 1, 2] and objs[2]["arr"].sum() == 20
done, values = cma.mpi.Request.testall(reqs)
while not done:
    done, values = cma.mpi.Request.testall(reqs)
assert values == [None, None, None]

r1 = comm.Irecv(np.empty(1), left, 50)
r2 = comm.Irecv(np.empty(1), left, 51)
comm.Send(np.zeros(1), right, 51)
st = status()
comm.Send(np.zeros(1), right, 50)
idx = cma.mpi.Request.Waitany([r1, r2], st)
assert st.tag == 50 + idx and st.source == left, (idx, st.tag, st.source)
assert cma.mpi.Request.Waitany([r1, r2], st) == 1 - idx and st.tag == 51 - idx
assert cma.mpi.Request.Waitany([r1, r2], st) == MPI.UNDEFINED
mpi_req = MPI.COMM_WORLD.Ibarrier()  # plain MPI requests mix in
assert cma.mpi.Request.Waitall([comm.Isend(b"x", right, 52), mpi_req,
                                comm.Irecv(bytearray(1), left, 52)])

# -- objects: NumPy buffers go out of band; any size on irecv when the peer is on-node
payload = {"rank": rank, "a": np.arange(200_000, dtype=np.float64), "t": (1, "two")}
st = status()
obj = comm.sendrecv(payload, right, 60, None, left, 60, st)
assert obj["rank"] == left and obj["a"][-1] == 199_999.0 and obj["t"] == (1, "two")
assert st.source == left and st.tag == 60 and st.Get_count() > 1_600_000
comm.send([rank] * 3, right, 61)
assert comm.recv(source=left, tag=61) == [left] * 3
if left in comm.node_ranks:
    req = comm.irecv(source=left, tag=62)
else:
    req = comm.irecv(bytearray(1 << 24), source=left, tag=62)  # mpi4py's irecv needs room
comm.send(np.ones(1 << 20), right, 62)
assert req.wait().sum() == 1 << 20
comm.isend("small", right, 63).wait()
assert comm.irecv(source=left, tag=63).wait() == "small"
flag, value = False, None
req = comm.irecv(source=left, tag=64)
comm.send(None, right, 64)
while not flag:
    flag, value = req.test()
assert value is None

# -- probes
comm.Send(np.zeros(3), right, 70)
st = status()
assert comm.Probe(left, 70, st) is True
assert st.source == left and st.tag == 70 and st.Get_count(MPI.DOUBLE) == 3
st2 = status()
assert comm.Iprobe(MPI.ANY_SOURCE if size == 2 else left, MPI.ANY_TAG, st2)
assert st2.Get_count(MPI.DOUBLE) == 3
assert comm.iprobe(left, 70) and comm.probe(left, 70)
comm.Recv(np.empty(3), left, 70)
assert not comm.Iprobe(left, 70)
comm.send("hello", right, 71)
st = status()
comm.probe(left, 71, st)
assert st.source == left and comm.recv(None, st.source, st.tag) == "hello"

# -- PROC_NULL everywhere
st = status()
comm.Send(a, MPI.PROC_NULL)
comm.Recv(np.empty(4), MPI.PROC_NULL, 0, st)
assert st.source == MPI.PROC_NULL and st.tag == MPI.ANY_TAG and st.Get_count() == 0
assert comm.Iprobe(MPI.PROC_NULL, 0, st) and st.source == MPI.PROC_NULL
comm.Probe(MPI.PROC_NULL)
comm.Isend(a, MPI.PROC_NULL).Wait()
comm.Irecv(np.empty(4), MPI.PROC_NULL).Wait(st)
assert st.source == MPI.PROC_NULL
comm.send(1, MPI.PROC_NULL)
assert comm.recv(source=MPI.PROC_NULL) is None
assert comm.isend(1, MPI.PROC_NULL).wait() is None and comm.irecv(source=MPI.PROC_NULL).wait() is None
assert comm.sendrecv(1, MPI.PROC_NULL, source=MPI.PROC_NULL) is None
comm.Sendrecv(a, MPI.PROC_NULL, 0, np.empty(4), MPI.PROC_NULL, 0, st)
assert st.source == MPI.PROC_NULL

# -- messages to self
comm.Send(np.array([5.0]), rank, 80)
out = np.empty(1)
comm.Recv(out, rank, 80)
assert out[0] == 5.0
assert comm.sendrecv("me", rank, 81, None, rank, 81) == "me"

# -- truncation: MPI.Exception(ERR_TRUNCATE), the message consumed, a Status filled
for st in (None, status()):
    comm.Send(np.zeros(8), right, 90)
    comm.Send(np.ones(2), right, 90)
    try:
        comm.Recv(np.empty(4), left, 90, st)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_TRUNCATE, exc
        if comm.cma is not None and left in comm.node_ranks:
            assert isinstance(exc, cma.errors.TruncationError) and exc.source == left, exc
            if st is not None:
                assert (st.source, st.tag, st.Get_error()) == (left, 90, MPI.ERR_TRUNCATE), st
    else:
        raise AssertionError(f"no truncation error (status {st})")
    out = np.empty(2)
    comm.Recv(out, left, 90)  # the truncated message is gone; the next one follows
    assert out.sum() == 2.0
comm.Send(np.zeros(8), right, 91)
req = comm.Irecv(np.empty(2), left, 91)
try:
    req.Wait()
except MPI.Exception as exc:
    assert exc.Get_error_class() == MPI.ERR_TRUNCATE
else:
    raise AssertionError("no truncation error from Wait")

# -- a bad rank or tag: MPI.Exception with MPI's error class, whichever way it would go
for call, error_class in [(lambda: comm.Send(a, size, 0), MPI.ERR_RANK),
                          (lambda: comm.Recv(np.empty(16), size, 0), MPI.ERR_RANK),
                          (lambda: comm.Send(a, right, -5), MPI.ERR_TAG),
                          # (the receive is refused before anything is sent)
                          (lambda: comm.Sendrecv(a, right, 0, np.empty(16), size, 0), MPI.ERR_RANK),
                          (lambda: comm.Sendrecv(a, right, 0, np.empty(16), left, -5), MPI.ERR_TAG),
                          # (a send refused leaves no receive posted: checked below)
                          (lambda: comm.Sendrecv(a, size, 0, np.empty(16), left, 0), MPI.ERR_RANK)]:
    try:
        call()
    except MPI.Exception as exc:
        assert exc.Get_error_class() == error_class, exc
    else:
        raise AssertionError(f"no error class {error_class}")
comm.Send(np.full(2, float(rank)), right, 0)
got = np.zeros(2)
comm.Recv(got, left, 0)
assert (got == left).all(), got
# (ranks and tags as NumPy integers, as mpi4py takes them)
comm.Sendrecv(np.full(2, float(rank)), np.int64(right), np.int32(1), got, np.int64(left),
              np.int64(1))
assert (got == left).all(), got

# -- other pt2pt: ready mode is standard mode; Sendrecv_replace
comm.Rsend(np.ones(2), right, 95)
comm.Recv(np.empty(2), left, 95)
buf = np.full(4, float(rank))
comm.Sendrecv_replace(buf, right, 96, left, 96)
assert buf.sum() == 4 * left

# -- synchronous mode, through whichever channel the pair uses (clients.py checks that it
# completes only once matched)
ssend = comm.Issend(a, right, 97)
comm.Recv(np.empty(16), left, 97)
ssend.Wait()

# -- everything else is the wrapped communicator's
assert isinstance(comm, MPI.Intracomm) and comm == MPI.COMM_WORLD
assert MPI.Comm.Compare(comm, MPI.COMM_WORLD) == MPI.IDENT
assert comm.Get_name() == "MPI_COMM_WORLD"
assert comm.allreduce(rank) == size * (size - 1) // 2
assert comm.bcast("root" if rank == 0 else None, root=0) == "root"
total = np.zeros(1)
comm.Allreduce(np.ones(1), total, op=MPI.SUM)
assert total[0] == size
sub = comm.Split(rank % 2, rank)
assert type(sub) is MPI.Intracomm and sub.Get_size() == (size + 1 - rank % 2) // 2
sub.Free()
tag_ub = comm.Get_attr(MPI.TAG_UB)
assert tag_ub is not None and tag_ub >= 32767
dup = comm.Dup()
assert isinstance(dup, cma.mpi.Comm) and dup != MPI.COMM_WORLD
dup.send(rank, right, 1)
assert dup.recv(source=left, tag=1) == left

# -- with every rank on this node, and MPI's ANY_SOURCE and PROC_NULL numbered as cma's
# (MPICH's), Send, Recv, Isend, Irecv and Sendrecv are the cma communicator's own (no wrapper frame
# per message) until Free; a subclass's override of them stays in charge
every_rank_here = comm.cma is not None and len(comm.node_ranks) == size
mpich_numbering = (MPI.ANY_SOURCE, MPI.PROC_NULL) == (-2, -1)
hand_out = every_rank_here and mpich_numbering and not subclassed
for wrapper in (comm, dup):
    # (Passthrough overrides point-to-point only: the routed collectives are ours there too)
    routed = set(wrapper._routes) if every_rank_here else set()
    handed_out = {name: method.__self__ is wrapper.cma for name, method in vars(wrapper).items()
                  if name not in routed}
    assert handed_out == (dict.fromkeys(("Send", "Recv", "Isend", "Irecv", "Sendrecv"), True) if hand_out
                          else {}), handed_out
    # (and the collectives cma.mpi.routing sends to MPI at some sizes: routed methods of its own)
    assert routed <= set(vars(wrapper)), (routed, set(vars(wrapper)))
dup.Free()
assert not vars(dup)

# -- Sendrecv of specs over fresh rows, a halo exchange's idiom: right in every mode; with
# every rank here the rows themselves go to cma (a spec over each new row, converted and
# remembered, cost ~2 us a call more)
grid = np.zeros((4, 8))
for step in range(3):
    grid[1:3] = rank + step
    top, halo = grid[1], grid[-1]
    comm.Sendrecv([top, 8, MPI.DOUBLE], right, 13, [halo, 8, MPI.DOUBLE], left, 13)
    assert (grid[-1] == left + step).all() and (grid[0] == 0).all(), grid
if every_rank_here:
    assert comm.cma._send_obj is top and comm.cma._recv_obj is halo, "spec, not row, passed"


class CountingSends(cma.mpi.Comm):
    def Send(self, buf, dest, tag=0):
        self.sends = getattr(self, "sends", 0) + 1
        super().Send(buf, dest, tag)


counting = CountingSends(MPI.COMM_WORLD.Dup())
counting.Send(a, right, 5)
out = np.empty(16)
counting.Recv(out, left, 5)
assert counting.sends == 1 and np.array_equal(out, np.arange(16, dtype=np.float64) + left)
assert "Send" not in vars(counting)
assert ("Recv" in vars(counting)) == (every_rank_here and mpich_numbering)
counting.Free()
win = MPI.Win.Allocate(8, comm=comm)  # C-level mpi4py takes the wrapper itself
win.Free()
comm.barrier()
if comm.cma is not None and {left, right} & set(comm.node_ranks):  # cma moved them
    assert comm.cma.stats()["eager"]["messages"] > 0
mode = "disabled" if disabled else ("mpi-only" if comm.cma is None else
                                    "mixed" if len(comm.node_ranks) < size else "cma")
print(f"OK {rank} {mode}", flush=True)

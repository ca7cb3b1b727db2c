"""What code written for mpi4py does, through cma.mpi.Comm: valid at any size and routing.

Each section is a habit of real mpi4py programs that the plugin once broke: mpi4py's
zero-length messages ([None, "B"], None towards PROC_NULL), MPI.Request's class methods
given the plugin's requests (alone or mixed with MPI's), statuses from them, cancelled
receives, synchronous and buffered sends, Isendrecv, matched probes, persistent
requests, DLPack-only buffers, one-rank communicators. Prints "OK <rank>" at the end.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

import cma.mpi

comm = cma.mpi.Comm(MPI.COMM_WORLD)
rank, size = comm.Get_rank(), comm.Get_size()
right, left = (rank + 1) % size, (rank - 1) % size
disabled = os.environ.get("CMA_MPI_DISABLE") == "1"

# -- mpi4py.bench.helloworld: a ring of zero-length receives into [None, "B"]
import mpi4py.bench  # noqa: E402

mpi4py.bench.helloworld(comm, args=["--quiet"])

# -- None is mpi4py's message of nothing, wherever the peer is PROC_NULL
null = MPI.PROC_NULL
st = MPI.Status()
comm.Send(None, null)
comm.Recv(None, null, 0, st)
assert (st.source, st.tag, st.Get_count()) == (null, MPI.ANY_TAG, 0), st
comm.Rsend(None, null)
comm.Isend(None, null).Wait()
comm.Irecv(None, null).Wait(st)
assert st.source == null
comm.Sendrecv(None, null, 0, None, null, 0, st)
comm.Sendrecv_replace(None, null, 0, null, 0, st)
assert st.source == null

# -- a zero-length buffer message read by the object receive is None, as in mpi4py
nothing = comm.irecv(source=left, tag=3)
comm.Isend([None, 0, "B"], right, 3).Wait()
assert nothing.wait() is None
send = comm.Isend([None, "B"], right, 4)  # (a blocking Send to itself may wait forever)
comm.Recv([None, "B"], left, 4, st)
send.Wait()
assert st.Get_count() == 0 and st.source == left

# -- MPI.Request's class methods take the plugin's requests, with MPI's mixed in
out = [np.empty(n, dtype=np.uint8) for n in (1, 5000, 3 << 20)]
recvs = [comm.Irecv(b, left, 10 + k) for k, b in enumerate(out)]
sends = [comm.Isend(np.full(b.size, rank % 256, dtype=np.uint8), right, 10 + k)
         for k, b in enumerate(out)]
barrier = comm.Ibarrier()
assert all(isinstance(r, MPI.Request) for r in recvs + sends), recvs + sends
statuses = [MPI.Status() for _ in range(7)]
MPI.Request.Waitall([*recvs, barrier, *sends], statuses)
assert [(s.source, s.tag, s.Get_count()) for s in statuses[:3]] == [
    (left, 10, 1), (left, 11, 5000), (left, 12, 3 << 20)], statuses[:3]
assert all(b[0] == b[-1] == left % 256 for b in out)
assert not any(recvs) and not any(sends)

reqs = [comm.irecv(source=left, tag=20 + k) for k in range(3)]
for k in range(3):
    comm.isend({"k": k, "a": np.full(1000, k)}, right, 20 + k).wait()  # (MPI's irecv: < 32 KiB)
objs = MPI.Request.waitall(reqs)
assert [o["k"] for o in objs] == [0, 1, 2] and objs[2]["a"][-1] == 2

first = comm.Irecv(np.empty(1), left, 30)
second = comm.Irecv(np.empty(1), left, 31)
comm.Send(np.zeros(1), right, 31)
assert MPI.Request.Waitany([first, second], st) == 1 and st.tag == 31 and st.source == left
assert MPI.Request.Testany([first, second]) == (MPI.UNDEFINED, False)  # tag 30 is not sent yet
comm.Sendrecv([None, "B"], left, 32, [None, "B"], right, 32)  # the left neighbour has its tag 31
comm.Send(np.zeros(1), right, 30)
assert MPI.Request.Waitsome([first, second]) == [0]
assert MPI.Request.Waitany([first, second]) == MPI.UNDEFINED

pending = [comm.irecv(source=left, tag=40 + k) for k in range(4)]
for k in range(4):
    comm.send(k, right, 40 + k)
seen: list[int] = []
while len(seen) < 4:
    found, values = MPI.Request.testsome(pending)
    if found:
        seen.extend(values)
assert sorted(seen) == [0, 1, 2, 3], seen

# -- cma.mpi.Request's class methods over requests of two communicators
other = comm.Dup()
first = comm.Irecv(np.empty(1), left, 45)
second = other.Irecv(np.empty(1), left, 45)
send = other.Isend(np.ones(1), right, 45)  # only on the Dup, until the token below
assert cma.mpi.Request.Waitany([first, second], st) == 1 and st.source == left
send.Wait()
comm.Sendrecv([None, "B"], left, 46, [None, "B"], right, 46)
comm.Send(np.ones(1), right, 45) if size > 1 else comm.Isend(np.ones(1), right, 45).Wait()
cma.mpi.Request.Waitall([first, second])
other.Free()

# -- a posted receive nothing matched is cancelled; the message goes to the next one
req = comm.Irecv(np.empty(4), left, 50)
req.Cancel()
req.Wait(st)
assert st.Is_cancelled()
comm.Barrier()  # every rank has cancelled before anything is sent with tag 50
send = comm.Isend(np.arange(4.0), right, 50)
got = np.empty(4)
comm.Recv(got, left, 50)
send.Wait()
assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


# -- synchronous mode: an Issend is complete only once the receiver matched it
sync = comm.Issend(np.full(4, rank, dtype=np.float64), right, 70)
assert not sync.Test()  # the right neighbour receives only after our token (tag 71)
comm.Sendrecv([None, "B"], right, 71, [None, "B"], left, 71)
got = np.empty(4)
comm.Recv(got, left, 70)
sync.Wait()
assert got[0] == left
pending = comm.irecv(source=left, tag=72)
request = comm.issend({"from": rank}, right, 72)
assert pending.wait() == {"from": left}
request.wait()

# -- buffered mode (MPI needs a buffer attached; cma none): returns at once, copied
MPI.Attach_buffer(bytearray((1 << 20) + MPI.BSEND_OVERHEAD))
message = np.full(1 << 19, rank % 256, dtype=np.uint8)
comm.Bsend(message, right, 73)
message[:] = 255  # the copy was sent, not this
got = np.empty(1 << 19, dtype=np.uint8)
comm.Recv(got, left, 73)
assert got[0] == got[-1] == left % 256
MPI.Detach_buffer()

# -- Isendrecv: one request for both (MPICH's own fills no status for it: none checked)
got = np.empty(3)
comm.Isendrecv(np.full(3, float(rank)), right, 74, got, left, 74).Wait()
assert got.tolist() == [float(left)] * 3
both = np.full(3, float(rank))
comm.Isendrecv_replace(both, right, 75, left, 75).Wait()
assert both.tolist() == [float(left)] * 3

# -- matched probes: the message found is no other receive's
send = comm.Isend(np.arange(5.0), right, 76)
message = comm.Mprobe(left, 76, st)
assert isinstance(message, MPI.Message) and message and st.Get_count(MPI.DOUBLE) == 5
assert comm.Improbe(left, 76) is None
got = np.empty(5)
message.Recv(got, st)
send.Wait()
assert not message and got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and st.source == left
send = comm.isend(("obj", rank), right, 77)
while (message := comm.improbe(left, 77)) is None:
    pass
assert message.irecv().wait() == ("obj", left)
send.wait()
assert comm.Mprobe(MPI.PROC_NULL) == MPI.MESSAGE_NO_PROC

# -- persistent requests: bound once, started again and again, waited for by MPI
MPICH = MPI.Get_library_version().startswith("MPICH")
out, got = np.zeros(4), np.zeros(4)
persistent = [comm.Send_init(out, right, 80), comm.Recv_init(got, left, 80)]
starts = [lambda reqs: [r.Start() for r in reqs], cma.mpi.Prequest.Startall]
if MPICH:  # (only MPICH lets cma see MPI's own Startall: docs/mpi.md)
    starts.append(MPI.Prequest.Startall)
for k, start in enumerate(starts):
    out[:] = rank * 10 + k
    start(persistent)
    MPI.Request.Waitall(persistent)
    assert got.tolist() == [left * 10.0 + k] * 4, (k, got)
    assert all(persistent)  # inactive, not null
persistent[1].Start()
persistent[0].Start()
assert sorted([MPI.Prequest.Waitany(persistent), MPI.Prequest.Waitany(persistent)]) == [0, 1]
assert MPI.Prequest.Waitany(persistent) == MPI.UNDEFINED
# started again while active: refused (MPI_Start's ERR_REQUEST), and the request still works
out[:] = rank * 10 + 9
persistent[1].Start()
for request in persistent[1], persistent[1]:  # (the second: after the first was refused)
    if isinstance(request, cma.mpi.Prequest) or MPICH:
        try:
            request.Start()
            raise AssertionError("Start of an active persistent request was accepted")
        except MPI.Exception as exc:
            assert exc.Get_error_class() == MPI.ERR_REQUEST, exc
            assert not isinstance(request, cma.mpi.Prequest) or "Wait" in str(exc), exc
persistent[0].Start()
MPI.Request.Waitall(persistent)
assert got.tolist() == [left * 10.0 + 9] * 4, got
for request in persistent:
    request.Free()
    assert request == MPI.REQUEST_NULL

# -- a buffer that only speaks DLPack
class DLPackOnly:
    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: object) -> object:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


send = comm.Isend(DLPackOnly(np.full(8, rank, dtype=np.float64)), right, 60)
target = np.zeros(8)
comm.Recv(DLPackOnly(target), left, 60)
send.Wait()
assert target.tolist() == [float(left)] * 8

# -- small objects and a Probe before a Recv, as pkl5 and task farms use them: with every
# rank on this node they move through the ring without a request (one each took 18-19 us
# through the engine, docs/api.md "Objects"), once a first round has connected the pairs
# (a world of more than two ranks connects on first use); elsewhere they only arrive
status = MPI.Status()
on_node = comm.cma is not None and len(comm.node_ranks) == size and size > 1


def no_request(*args: object, **kwargs: object) -> None:
    raise AssertionError("a small object or a probed message went through a request")


for i in range(4) if size > 1 else ():  # a ring: eager sends return at once
    if i == 1:
        # MPI's barrier, which moves nothing of cma's: the next round's packets cannot be
        # taken out of the rings before the receives (they would be queued unexpected, and
        # the receive after them must then go through the engine, as it should)
        MPI.COMM_WORLD.Barrier()
        if on_node:
            comm.cma.make_request, make_request = no_request, comm.cma.make_request  # type: ignore[assignment]
    comm.send({"i": i, "from": rank}, right, 70)
    comm.Send(np.full(5, i, np.int32), right, 71)
    assert comm.recv(source=left, tag=70, status=status) == {"i": i, "from": left}
    assert (status.Get_source(), status.Get_tag()) == (left, 70)
    comm.Probe(left, 71, status)
    got = np.empty(status.Get_count(MPI.INT32_T), np.int32)
    comm.Recv(got, left, 71)
    assert got.tolist() == [i] * 5
if on_node:
    comm.cma.make_request = make_request  # type: ignore[method-assign]
comm.Barrier()

# -- a one-rank communicator: everything goes to itself
alone = cma.mpi.Comm(MPI.COMM_SELF)
alone.Barrier()
mine = np.empty(3)
alone.Sendrecv(np.ones(3), 0, 1, mine, 0, 1)
assert mine.sum() == 3

# -- with cma off, the wrapper hands out mpi4py's own requests
if disabled:
    assert comm.cma is None
    assert type(comm.Isend(None, null)) is MPI.Request and type(comm.Irecv(None, null)) is MPI.Request
comm.Barrier()
print(f"OK {rank}", flush=True)

"""Datatypes with gaps through cma.mpi.Comm, checked against MPI's own delivery.

Every case sends the same message twice around the ring: once through the plugin and once
through plain MPI (``MPI.Intracomm``'s methods on the same communicator), into receive
buffers that start equal; the two must end equal, byte for byte, gaps included. Cases
cover eager sizes (packed into the ring, scattered out of it), rendezvous sizes with few
large blocks (one iovec, no pack copy: checked in the transport's counters) and with many
small ones (packed, unpacked), every call form, and messages shorter than the receive.
Prints "OK <rank>" at the end; argument: the transport (default auto).
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import cma.mpi

transport = sys.argv[1] if len(sys.argv) > 1 else "auto"
comm = cma.mpi.Comm(MPI.COMM_WORLD, transport)
rank, size = comm.Get_rank(), comm.Get_size()
right, left = (rank + 1) % size, (rank - 1) % size
plain = MPI.Intracomm  # its methods on `comm` are MPI's own, the oracle
all_on_node = comm.allreduce(comm._cma is not None and not comm._mixed, op=MPI.LAND)

f8 = MPI.DOUBLE
column = f8.Create_vector(100, 1, 100).Commit()  # a column of a 100x100 array
record = MPI.Datatype.Create_struct([1, 2, 1], [0, 12, 24], [f8, MPI.INT, MPI.SHORT]).Commit()
TYPES = {
    "column": column,
    "hvector": MPI.INT.Create_hvector(7, 3, 20).Commit(),
    "indexed": MPI.INT.Create_indexed([2, 0, 3, 1], [9, 1, 0, 4]).Commit(),  # out of order
    "hindexed": f8.Create_hindexed([1, 2], [40, 0]).Commit(),
    "indexed_block": f8.Create_indexed_block(2, [0, 5, 3]).Commit(),
    "record": record,
    "resized record": record.Create_resized(0, 40).Commit(),
    "subarray C": f8.Create_subarray([6, 7, 8], [2, 3, 4], [1, 2, 3]).Commit(),
    "subarray F": f8.Create_subarray([6, 7, 8], [2, 3, 4], [1, 2, 3], order=MPI.ORDER_F).Commit(),
    "nested": column.Create_contiguous(2).Create_resized(0, 8 * 101).Commit(),
    "DOUBLE_INT": MPI.DOUBLE_INT,
    "SHORT_INT": MPI.SHORT_INT,
    "typechar": "d",  # (no gaps: the control case, through the same checks)
}
# rendezvous sizes (above the 2 MiB eager limit)
LARGE = {
    # 40 rows of 90000 doubles out of a 64 x 100000 array: few large blocks (one iovec)
    "rows": f8.Create_subarray([64, 100000], [40, 90000], [10, 5000]).Commit(),
    # every other double of 8 MiB: 512 Ki blocks of 8 bytes (packed, unpacked)
    "strided": f8.Create_vector(1 << 19, 1, 2).Commit(),
}


def extent_bytes(datatype: MPI.Datatype | str, count: int) -> int:
    if isinstance(datatype, str):
        datatype = MPI.Datatype.fromcode(datatype)
    lb, extent = datatype.Get_extent()
    true_lb, true_extent = datatype.Get_true_extent()
    assert lb >= 0 and true_lb >= 0
    return max((count - 1) * extent + true_lb + true_extent, 0) if count else 0


def filled(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def both_ways(name: str, datatype: MPI.Datatype | str, count: int, recv_count: int | None = None,
              tag: int = 1) -> None:
    """Send ``count`` elements around the ring through the plugin and through MPI; the
    receivers (``recv_count`` elements, more than sent allowed) must end equal."""
    recv_count = count if recv_count is None else recv_count
    source = filled(extent_bytes(datatype, count) + 16, 100 + rank)
    results = []
    for sendrecv in (comm.Sendrecv, lambda *a: plain.Sendrecv(comm, *a)):
        got = filled(extent_bytes(datatype, recv_count) + 16, 7)
        st = MPI.Status()
        sendrecv([source, count, datatype], right, tag, [got, recv_count, datatype], left, tag, st)
        counted = MPI.Datatype.fromcode(datatype) if isinstance(datatype, str) else datatype
        results.append((got, st.Get_count(MPI.BYTE), st.Get_count(counted)))
    (mine, nbytes, elements), (theirs, nbytes_mpi, elements_mpi) = results
    assert (nbytes, elements) == (nbytes_mpi, elements_mpi), (name, nbytes, nbytes_mpi)
    assert np.array_equal(mine, theirs), f"{name}: {np.flatnonzero(mine != theirs)[:10]}"


for name, datatype in TYPES.items():
    for count in (0, 1, 5):
        both_ways(name, datatype, count)
    both_ways(f"{name}, short message", datatype, 2, recv_count=5)
for name, datatype in LARGE.items():
    both_ways(name, datatype, 1, tag=2)

# the same buffers through every call form: each receive must equal MPI's
vector = TYPES["column"]
send_matrix = np.arange(10000, dtype="d").reshape(100, 100) + 1000 * rank
expected = np.zeros((100, 100))
expected[:, 0] = send_matrix[:, 0] - 1000 * rank + 1000 * left


def received() -> np.ndarray:
    return np.zeros((100, 100))


def check(got: np.ndarray, what: str) -> None:
    assert np.array_equal(got, expected), f"{what}: {got[:3, :3]}"


got = received()
comm.Sendrecv([send_matrix, 1, vector], right, 3, [got, 1, vector], left, 3)
check(got, "Sendrecv")
got = received()
r = comm.Irecv([got, 1, vector], left, 4)
comm.Isend([send_matrix, 1, vector], right, 4).Wait()
r.Wait()
check(got, "Isend/Irecv")
got = received()
r = comm.Irecv((got, 1, vector), left, 5)  # a tuple spec
comm.Issend((send_matrix, 1, vector), right, 5).Wait()
r.Wait()
check(got, "tuple specs, Issend")
got = received()
req = comm.Isendrecv([send_matrix, 1, vector], right, 6, [got, 1, vector], left, 6)
req.Wait()
check(got, "Isendrecv")
got = send_matrix.copy()
comm.Sendrecv_replace([got, 1, vector], right, 7, left, 7)
want = send_matrix.copy()
want[:, 0] = expected[:, 0]
assert np.array_equal(got, want), "Sendrecv_replace"
MPI.Attach_buffer(bytearray((1 << 20) + MPI.BSEND_OVERHEAD))
got = received()
r = comm.Irecv([got, 1, vector], left, 8)
comm.Bsend([send_matrix, 1, vector], right, 8)
r.Wait()
check(got, "Bsend")
MPI.Detach_buffer()
# matched probes: 100 contiguous doubles into a column, and a column into 100 doubles
got = received()
send = comm.Isend([send_matrix, 100, MPI.DOUBLE], right, 9)
comm.Mprobe(left, 9).Recv([got, 1, vector])
send.Wait()
assert np.array_equal(got[:, 0], np.arange(100) + 1000 * left) and not got[:, 1:].any()
line = np.zeros(100)
send = comm.Isend([send_matrix, 1, vector], right, 10)
comm.Mprobe(left, 10).Recv([line, 100, MPI.DOUBLE])
send.Wait()
assert np.array_equal(line, expected[:, 0]), line[:3]

# one spec list sent again after its buffer changed: packed anew each time (a packed copy
# must not be remembered as the spec's view, as a contiguous spec's view is)
outgoing = send_matrix.copy()
spec = [outgoing, 1, vector]
for round_, send in enumerate([comm.Send, comm.Isend, comm.Send]):
    outgoing[:, 0] = round_ + rank
    got = received()
    r = comm.Irecv([got, 1, vector], left, 12)
    sent = send(spec, right, 12)
    r.Wait()
    if sent is not None:
        sent.Wait()
    assert (got[:, 0] == round_ + left).all(), (round_, got[:3, 0])

# persistent requests: the send is packed anew at each start
got = received()
outgoing = send_matrix.copy()
persistent = [comm.Send_init([outgoing, 1, vector], right, 11),
              comm.Recv_init([got, 1, vector], left, 11)]
for round_ in range(3):
    outgoing[:, 0] = np.arange(100) + 10 * round_ + rank
    got[:] = 0
    cma.mpi.Prequest.Startall(persistent)  # (MPI's also works, but not on Open MPI)
    MPI.Request.Waitall(persistent)
    assert np.array_equal(got[:, 0], np.arange(100) + 10 * round_ + left), (round_, got[:3, 0])
    assert not got[:, 1:].any()
for p in persistent:
    p.Free()

# the large few-block message moved as one iovec: no staging, at most one copy of it
if all_on_node and size > 1 and transport != "shm":
    comm.Barrier()
    comm._cma.reset_stats()
    rows = LARGE["rows"]
    nbytes = 40 * 90000 * 8
    source = filled(64 * 100000 * 8, rank)
    got = np.zeros(64 * 100000 * 8, np.uint8)
    comm.Sendrecv([source, 1, rows], right, 12, [got, 1, rows], left, 12)
    stats = {name: s for name, s in comm._cma.stats().items() if name != "eager" and s["bytes"]}
    # the receive counts nbytes (the send too, when it copied half: SPLIT), with no copy
    # in user space; cma's copies take one system call each, the 40 blocks as one iovec
    # (vmfd's preadv takes one file offset per call: one call per block)
    assert sum(s["bytes"] for s in stats.values()) in (nbytes, 2 * nbytes), stats
    assert all(s["user_copies"] == 0 for s in stats.values()), stats
    if transport == "cma":
        assert stats["cma"]["syscalls"] <= 2, stats

for datatype in [*TYPES.values(), *LARGE.values()]:
    if isinstance(datatype, MPI.Datatype) and not datatype.is_predefined:
        datatype.Free()
comm.Barrier()
print(f"OK {rank}", flush=True)

"""cma.mpi.Comm's collectives against MPI's own over the same ranks (run with 1-4 ranks).

Every case runs twice: through the wrapper (cma when every rank is on one node) and
through mpi4py's own method on the wrapped MPI handle; the results must agree (exactly
for integers, closely for floats, whose sums MPICH and cma may add in other orders).
Cases are drawn by hypothesis, derandomized, the same on every rank: dtypes for each
predefined op as MPI defines them (the pair types for MINLOC and MAXLOC), counts (0
included), roots, the three spec forms and IN_PLACE where MPI has it. Then: the wrapper
must have moved the bytes through cma (its stats grew; under CMA_MPI_* pretend nodes it
must not have), and a user-defined op must go to MPI. With CMA_XMAP=1 every buffer of
the cases is in the shared heap and every hop from 16 KiB is read out of a mapping of its
sender's pages (the reductions combine from views of them), which must have happened.
Prints "OK <rank>".
"""

from __future__ import annotations

import mmap
import os
import sys
import traceback

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import cma.collectives
import cma.mpi
from cma.mpi.bootstrap import BARRIER_MPI, BARRIER_NONBLOCKING

CASES = 40
HEAP = os.environ.get("CMA_XMAP") == "1"
if HEAP:
    cma.collectives.XMAP_HOP_FROM = 16 << 10  # (2 MiB by default: more than these cases move)
# (NumPy dtype, MPI datatype) by the ops MPI defines on them (MPI 4.1, section 6.9.2)
INTEGERS = [(np.int8, MPI.SIGNED_CHAR), (np.uint8, MPI.UNSIGNED_CHAR), (np.int16, MPI.SHORT),
            (np.uint16, MPI.UNSIGNED_SHORT), (np.int32, MPI.INT), (np.uint32, MPI.UNSIGNED),
            (np.int64, MPI.INT64_T), (np.uint64, MPI.UINT64_T)]
FLOATS = [(np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE)]
COMPLEX = [(np.complex128, MPI.C_DOUBLE_COMPLEX)]
LOGICAL = [(np.bool_, MPI.C_BOOL)]
PAIRS = [(np.dtype([("v", v), ("i", "i4")], align=True), t)
         for v, t in (("f4", MPI.FLOAT_INT), ("f8", MPI.DOUBLE_INT), ("i4", MPI.TWOINT),
                      ("i2", MPI.SHORT_INT), ("i8", MPI.LONG_INT), ("g", MPI.LONG_DOUBLE_INT))]
OPS = [(MPI.SUM, INTEGERS + FLOATS + COMPLEX), (MPI.PROD, INTEGERS + FLOATS + COMPLEX),
       (MPI.MIN, INTEGERS + FLOATS), (MPI.MAX, INTEGERS + FLOATS),
       (MPI.LAND, INTEGERS + LOGICAL), (MPI.LOR, INTEGERS + LOGICAL),
       (MPI.LXOR, INTEGERS + LOGICAL), (MPI.BAND, INTEGERS), (MPI.BOR, INTEGERS),
       (MPI.BXOR, INTEGERS), (MPI.MINLOC, PAIRS), (MPI.MAXLOC, PAIRS)]  # (MPI.Op: unhashable)


@st.composite
def cases(draw: st.DrawFn, size: int) -> dict[str, object]:
    """One case, drawn alike on every rank (hypothesis derandomized, every draw made before
    any rank runs anything)."""
    op, types = draw(st.sampled_from(OPS))
    dtype, mpitype = draw(st.sampled_from(types))
    # (the large counts reach the algorithms from 512 KiB: Bcast's scatter and allgather,
    # Reduce's reduce-scatter; 0 last, so that the first examples are not all empty)
    large = st.integers(600 << 10, 900 << 10).map(lambda n: n // np.dtype(dtype).itemsize)
    return {"op": op, "type": (dtype, mpitype),
            "count": draw(st.one_of(st.integers(1, 50), st.integers(1000, 40_000), large,
                                    st.just(0))),
            "root": draw(st.integers(0, size - 1)),
            "form": draw(st.sampled_from(["bare", "typed", "counted"])),
            "seed": draw(st.integers(0, 2**30))}


def zeros(count: int, dtype: object) -> np.ndarray:
    return cma.zeros(count, dtype) if HEAP else np.zeros(count, dtype)


def copy(array: np.ndarray) -> np.ndarray:
    if not HEAP:
        return array.copy()
    shared = cma.empty_like(array)
    shared[...] = array
    return shared


def values(seed: int, rank: int, dtype: np.dtype, n: int, op: MPI.Op) -> np.ndarray:
    """``n`` elements of rank ``rank``'s input: small, so that products and sums stay
    exact in every integer type; ties in the pairs' values, so MINLOC's rule shows."""
    rng = np.random.default_rng([seed, rank])
    out = np.zeros(n, dtype)
    if dtype.names is not None:
        out["v"] = rng.integers(-2, 3, n)
        out["i"] = rng.integers(0, 1000, n)
    elif op == MPI.PROD and dtype.kind in "fc":
        out[...] = rng.uniform(0.5, 1.5, n)
    elif dtype.kind == "b":
        out[...] = rng.integers(0, 2, n)
    elif dtype.kind == "u":
        out[...] = rng.integers(0, 4, n)
    else:
        out[...] = rng.integers(-3, 4, n)
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal, or for floats close (MPICH and cma may add in other orders): to 1e-9 in
    double precision, 1e-5 in single."""
    if a.dtype.names is None and a.dtype.kind in "fc":
        tolerance = 1e-9 if a.dtype in (np.float64, np.complex128) else 1e-5
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=tolerance, atol=tolerance))
    return bool(np.array_equal(a, b))


def both(comm: cma.mpi.Comm, name: str, make: object, case: dict[str, object]) -> None:
    """``make(call)`` runs the collective with ``call`` and returns the arrays to compare."""
    ours = make(getattr(comm, name))  # type: ignore[operator]
    theirs = make(lambda *a, **k: getattr(MPI.Intracomm, name)(comm, *a, **k))  # type: ignore[operator]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert same(a, b), f"rank {comm.Get_rank()} {name} output {i}: {a!r} != {b!r} in {case}"


def run_case(comm: cma.mpi.Comm, case: dict[str, object]) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype, mpitype = case["type"]  # type: ignore[misc]
    dtype = np.dtype(dtype)
    count, root, op, seed = case["count"], case["root"], case["op"], case["seed"]
    assert isinstance(count, int) and isinstance(root, int) and isinstance(seed, int)
    mine = values(seed, rank, dtype, count * size, op)
    if HEAP:
        mine = copy(mine)

    def spec(buf: np.ndarray | None, blocks: int = 1) -> object:
        """``buf`` as the case's form writes it: bare, [buf, type] or [buf, n, type], where
        n counts one of ``blocks`` blocks (one a rank: mpi4py divides only a count it
        works out itself)."""
        if buf is None or case["form"] == "bare" and dtype.names is None:
            return buf
        if case["form"] == "counted":
            return [buf, buf.size // blocks, mpitype]
        return [buf, mpitype]

    def bcast(call):
        buf = copy(mine[:count]) if rank == root else zeros(count, dtype)
        call(spec(buf), root=root)
        return [buf]

    def allreduce(call):
        out = zeros(count, dtype)
        call(spec(mine[:count]), spec(out), op=op)
        inplace = copy(mine[:count])
        call(MPI.IN_PLACE, spec(inplace), op)
        return [out, inplace]

    def reduce(call):
        out = zeros(count, dtype)
        call(spec(mine[:count]), spec(out), op=op, root=root)
        inplace = copy(mine[:count])
        call(MPI.IN_PLACE if rank == root else spec(inplace), spec(inplace) if rank == root else None,
             op=op, root=root)
        return [out, inplace] if rank == root else []

    def scan(call):
        out = zeros(count, dtype)
        call(spec(mine[:count]), spec(out), op=op)
        inplace = copy(mine[:count])
        call(MPI.IN_PLACE, spec(inplace), op=op)
        return [out, inplace]

    def exscan(call):
        ex = zeros(count, dtype)
        call(spec(mine[:count]), spec(ex), op=op)
        inplace = copy(mine[:count])
        call(MPI.IN_PLACE, spec(inplace), op=op)
        return [ex, inplace] if rank else []  # (rank 0's is undefined)

    def reduce_scatter_block(call):
        out = zeros(count, dtype)
        call(spec(mine, size), spec(out), op=op)
        inplace = copy(mine)
        call(MPI.IN_PLACE, spec(inplace, size), op=op)
        return [out, inplace[:count]]

    def reduce_scatter(call):
        counts = [(r * 5 + count) % (count + 1) for r in range(size)]
        out = zeros(counts[rank], dtype)
        call(spec(mine[: sum(counts)]), spec(out), counts, op)
        inplace = copy(mine[: sum(counts)])
        call(MPI.IN_PLACE, spec(inplace), counts, op)
        given = zeros(counts[rank], dtype)
        call(spec(mine[: sum(counts)]), spec(given), op=op)  # (counts gathered from the recvbufs)
        return [out, inplace[: counts[rank]], given]

    def allgather(call):
        out = zeros(count * size, dtype)
        call(spec(mine[:count]), spec(out, size))
        inplace = zeros(count * size, dtype)
        inplace[rank * count : (rank + 1) * count] = mine[:count]
        call(MPI.IN_PLACE, spec(inplace, size))
        return [out, inplace]

    def gather(call):
        out = zeros(count * size, dtype) if rank == root else None
        call(spec(mine[:count]), spec(out, size), root=root)
        inplace = zeros(count * size, dtype)
        inplace[rank * count : (rank + 1) * count] = mine[:count]
        call(MPI.IN_PLACE if rank == root else spec(mine[:count]),
             spec(inplace, size) if rank == root else None, root=root)
        return [out, inplace] if rank == root else []

    def gatherv(call):
        counts = [(r * 7 + count) % (count + 1) for r in range(size)]
        out = zeros(sum(counts), dtype) if rank == root else None
        call(spec(mine[: counts[rank]]), [out, (counts, None), mpitype] if rank == root else None,
             root=root)
        return [out] if rank == root else []

    def scatter(call):
        out = zeros(count, dtype)
        call(spec(mine, size) if rank == root else None, spec(out), root=root)
        kept = copy(mine) if rank == root else zeros(count, dtype)
        call(spec(kept, size) if rank == root else None,
             MPI.IN_PLACE if rank == root else spec(kept[:count]), root=root)
        return [out, kept]

    def scatterv(call):
        counts = [(r * 3 + count) % (count + 1) for r in range(size)]
        displs = [sum(counts[:r]) + r for r in range(size)]  # (a free element between blocks)
        source = values(seed, size, dtype, displs[-1] + counts[-1], op)
        out = zeros(counts[rank], dtype)
        call([source, (counts, displs), mpitype] if rank == root else None, spec(out), root=root)
        return [out]

    def alltoall(call):
        out = zeros(count * size, dtype)
        call(spec(mine, size), spec(out, size))
        inplace = copy(mine)
        call(MPI.IN_PLACE, spec(inplace, size))
        return [out, inplace]

    def alltoallv(call):
        def pair(s: int, d: int) -> int:  # (elements from rank s to rank d)
            return (s * 3 + d * 5 + count) % (count + 1)
        sends = [pair(rank, d) for d in range(size)]
        receives = [pair(s, rank) for s in range(size)]
        sent = values(seed, rank, dtype, sum(sends), op)
        out = zeros(sum(receives) + size, dtype)  # (its blocks a free element apart)
        displs = [sum(receives[:s]) + s for s in range(size)]
        call([sent, sends, mpitype], [out, (receives, displs), mpitype])
        return [out]

    def alltoallw(call):
        # pair (s, d) moves (s + d) % 3 + count elements of type (s + d) % 2: the same both ways
        kinds = [(np.int32, MPI.INT), (np.float64, MPI.DOUBLE)]
        counts = [(rank + d) % 3 + count % 5 for d in range(size)]
        types = [kinds[(rank + d) % 2] for d in range(size)]
        nbytes = [c * np.dtype(t).itemsize for c, (t, _) in zip(counts, types, strict=True)]
        displs = [sum(nbytes[:d]) + 8 * d for d in range(size)]  # (8-byte gaps)
        send = np.random.default_rng([seed, rank]).integers(0, 256, displs[-1] + nbytes[-1] + 8,
                                                             dtype=np.uint8)
        recv = np.zeros_like(send)
        call([send, (counts, displs), [m for _, m in types]],
             [recv, counts, displs, [m for _, m in types]])
        inplace = copy(send)
        call(MPI.IN_PLACE, [inplace, (counts, displs), [m for _, m in types]])
        return [recv, inplace]

    reductions = (("Allreduce", allreduce), ("Reduce", reduce), ("Scan", scan), ("Exscan", exscan),
                  ("Reduce_scatter_block", reduce_scatter_block),
                  ("Reduce_scatter", reduce_scatter))
    moves = (("Bcast", bcast), ("Allgather", allgather), ("Gather", gather),
             ("Gatherv", gatherv), ("Scatter", scatter), ("Scatterv", scatterv),
             ("Alltoall", alltoall), ("Alltoallv", alltoallv), ("Alltoallw", alltoallw))
    # (not the pair types' Gather(v): MPICH 5.0.2's own Gather of DOUBLE_INT, LONG_INT or
    # SHORT_INT fails from a few thousand elements at 4 ranks, "Invalid datatype")
    for name, make in reductions + moves:
        if dtype.names is None or name not in ("Gather", "Gatherv"):
            both(comm, name, make, case)
    item = {"rank": rank, "array": mine[:count]}
    for name, args in (("bcast", (item,)), ("allreduce", (rank + 1,)), ("gather", (item,)),
                       ("reduce", (rank + 1,)),
                       ("allgather", (rank,)), ("alltoall", ([rank * 10 + d for d in range(size)],)),
                       ("scatter", ([d * 3 for d in range(size)] if rank == root else None,))):
        kwargs = {"root": root} if name in ("bcast", "gather", "scatter", "reduce") else {}
        ours = getattr(comm, name)(*args, **kwargs)
        theirs = getattr(MPI.Intracomm, name)(comm, *args, **kwargs)
        assert repr(ours) == repr(theirs), f"{name}: {ours!r} != {theirs!r}"


def every_case(comm: cma.mpi.Comm, examples: int) -> None:
    """Run ``examples`` cases drawn by hypothesis, derandomized, so that every rank draws
    the same ones. A rank that fails prints why and ends the job: hypothesis would run the
    case again on that rank alone, while its peers wait in the next one."""
    @settings(derandomize=True, database=None, max_examples=examples, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases(comm.Get_size()))
    def check(case: dict[str, object]) -> None:
        try:
            run_case(comm, case)
        except BaseException:
            print(f"rank {comm.Get_rank()} failed in {case}:\n{traceback.format_exc()}",
                  flush=True)
            MPI.COMM_WORLD.Abort(1)

    check()


def messages(comm: cma.mpi.Comm) -> int:
    return comm.cma.stats()["eager"]["messages"] if comm.cma is not None else 0


def inline_specs(comm: cma.mpi.Comm) -> None:
    """Bcasts of ``[mmap, n, MPI.BYTE]`` written inline (a new list each call, as mpi4py's
    osu_bcast does) while n and the root change: each call moves its own n bytes; an
    equal spec is not worked out again; the mmap closes afterwards (no view kept alive).
    A datatype with gaps goes through cma packed, its gaps untouched; copies of a
    predefined one go through cma without growing the dtypes kept by id."""
    rank, size = comm.Get_rank(), comm.Get_size()
    from cma import collectives

    worked_out = [0]
    message = collectives._message

    def counting(*args: object, **kwargs: object) -> np.ndarray:
        worked_out[0] += 1
        return message(*args, **kwargs)  # type: ignore[arg-type]

    collectives._message = counting  # type: ignore[assignment]
    buf = mmap.mmap(-1, 64)
    try:
        last = None
        for step, n in enumerate((8, 8, 8, 24, 24, 8)):
            root = step // 3 % size
            buf[:] = bytes([step if rank == root else 255]) * 64
            before = worked_out[0]
            comm.Bcast([buf, n, MPI.BYTE], root)
            assert buf[:n] == bytes([step]) * n, (step, buf[:n])
            assert buf[n:] == bytes([step if rank == root else 255]) * (64 - n), step
            if comm.cma is not None and (n, root) == last:
                assert worked_out[0] == before, f"step {step}: an equal spec worked out again"
            elif comm.cma is not None:
                assert worked_out[0] == before + 1, f"step {step}: a new spec not worked out"
            last = (n, root)
    finally:
        collectives._message = message  # type: ignore[assignment]
    buf.close()  # (BufferError if a view of it were kept)
    column = MPI.INT.Create_vector(3, 1, 2).Commit()
    grid = np.arange(6, dtype=np.int32) * (1 if rank == 0 else 0)
    before = messages(comm)
    comm.Bcast([grid, 1, column], 0)
    assert grid.tolist() == [0, 0 if rank else 1, 2, 0 if rank else 3, 4, 0 if rank else 5], grid
    # (packed for cma, as its peers' arrays of the same signature go; counted over the
    # ranks: a receiver's engine may count a message before ``before`` was read)
    moved = MPI.Intracomm.allreduce(comm, messages(comm) - before)
    with_peers = MPI.Intracomm.allreduce(comm, int(comm.cma is not None and comm.cma.size > 1))
    assert moved > 0 or not with_peers, "a datatype with gaps did not go through cma"
    column.Free()
    # a predefined datatype's copy is a new object every time: not kept (by id) at all
    total = np.zeros(2, np.float32)
    comm.Allreduce([np.ones(2, np.float32), 2, MPI.FLOAT], [total, 2, MPI.FLOAT])  # (kept)
    kept = len(collectives._MPI_DTYPES)
    for _ in range(20):
        comm.Allreduce([np.ones(2, np.float32), 2, MPI.Datatype(MPI.FLOAT)], [total, 2, MPI.FLOAT])
    assert total.tolist() == [size] * 2, total
    assert len(collectives._MPI_DTYPES) == kept, "copies of MPI.FLOAT kept by id"


def unnamed_dtypes(comm: cma.mpi.Comm) -> None:
    """Arrays of big-endian doubles, a dtype mpi4py cannot name: a Bcast moves them (as
    bytes between nodes); an Allreduce combines them on one node and between nodes
    raises InvalidDatatype on every rank before any node step (none is left waiting)."""
    if comm._barrier == BARRIER_MPI:  # (no cma anywhere: MPI's calls, mpi4py's refusals)
        return
    rank = comm.Get_rank()
    big = np.arange(5, dtype=">f8") if rank == 0 else np.zeros(5, ">f8")
    comm.Bcast(big, root=0)
    assert big.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], big
    out = np.zeros(5, ">f8")
    over_nodes = comm._barrier == BARRIER_NONBLOCKING
    try:
        comm.Allreduce(big, out, op=MPI.SUM)
        raised = False
    except cma.errors.InvalidDatatype:
        raised = True
    assert raised == over_nodes, (raised, over_nodes)
    if not raised:
        assert out.tolist() == [comm.Get_size() * v for v in range(5)], out


def beyond_mpi(comm: cma.mpi.Comm) -> None:
    """What cma takes and mpi4py's own methods do not: a SUM over bools (MPI defines SUM on
    numbers only) combines on one node and, between nodes, raises InvalidDatatype on every
    rank before any node step; a recvbuf of a wider dtype than sendbuf's gives what it
    gives on one node, an Allreduce cast first (int32 maxima sum past 2**31), a Reduce
    cast at the root last, also at a root that does not lead its node; cma's own op
    (``cma.SUM``) is taken as mpi4py's."""
    if comm._barrier == BARRIER_MPI:  # (no cma anywhere: MPI's calls, mpi4py's refusals)
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    over_nodes = comm._barrier == BARRIER_NONBLOCKING
    flags = np.zeros(4, bool)
    try:
        comm.Allreduce(np.full(4, rank == 0), flags, op=MPI.SUM)
        raised = False
    except cma.errors.InvalidDatatype:
        raised = True
    assert raised == over_nodes, (raised, over_nodes)
    assert raised or flags.all(), flags
    wide = np.zeros(3, np.int64)
    comm.Allreduce(np.full(3, 2**31 - 1, np.int32), wide, op=MPI.SUM)
    assert (wide == size * (2**31 - 1)).all(), wide
    # (a Reduce combines in sendbuf's type, int32 maxima wrapping as NumPy's int32 sum
    # does, and the root casts last: at the last rank, which does not lead its node over
    # pretend nodes of two, and at rank 0, which does)
    wrapped = np.full(size, 2**31 - 1, np.int32).sum(dtype=np.int32)
    for root in {size - 1, 0}:
        total = np.full(3, -1, np.int64)
        comm.Reduce(np.full(3, 2**31 - 1, np.int32), total if rank == root else None,
                    op=MPI.SUM, root=root)
        assert rank != root or (total == wrapped).all(), (root, total, wrapped)
    mean = np.zeros(3)
    comm.Allreduce(np.full(3, 1.5), mean, op=cma.SUM)  # (cma's own op, mpi4py's between nodes)
    assert (mean == 1.5 * size).all(), mean


def main() -> None:
    comm = cma.mpi.Comm(MPI.COMM_WORLD)
    rank = comm.Get_rank()
    before = messages(comm)
    every_case(comm, int(sys.argv[1]) if len(sys.argv) > 1 else CASES)
    # on one node every collective moves through cma; on several, Bcast, Reduce,
    # Allreduce, Gather, Scatter and Allgather take a step through cma on each node of two
    # ranks or more
    if comm.cma is not None:
        assert messages(comm) > before
        if HEAP:
            assert comm.cma.stats()["xmap"]["messages"] > 0, "no hop was read through xmap"
    size = comm.Get_size()
    for name, args in (("Allgather", (np.full(5, rank, np.int64), np.zeros(5 * size, np.int64))),
                       ("Gather", (np.full(5, rank, np.int64), np.zeros(5 * size, np.int64))),
                       ("Scatter", (np.arange(5 * size, dtype=np.int64), np.zeros(5, np.int64)))):
        before = messages(comm)
        getattr(comm, name)(*args, **({} if name == "Allgather" else {"root": size - 1}))
        # (summed over the node, whose senders count in the call: a receiver may have taken
        # its packet in the call before, under Open MPI's timing)
        moved = MPI.Intracomm.allgather(comm, messages(comm) - before)
        on_node = sum(moved[r] for r in comm.node_ranks) if comm.cma is not None else 0
        assert (on_node > 0) == (comm.cma is not None), f"{name} missed cma"
    # a user-defined op: applied by cma on the node if it commutes, by MPI if it does not
    add = MPI.Op.Create(lambda a, b, t: np.add(np.frombuffer(a, np.int32), np.frombuffer(b, np.int32),
                                                out=np.frombuffer(b, np.int32)), commute=True)
    first = MPI.Op.Create(lambda a, b, t: np.copyto(np.frombuffer(b, np.int32),
                                                     np.frombuffer(a, np.int32)), commute=False)
    out = np.zeros(3, np.int32)
    before = messages(comm)
    comm.Allreduce(np.ones(3, np.int32), out, op=add)
    assert (out == comm.Get_size()).all(), out
    assert (messages(comm) > before) == (comm.cma is not None)
    before = messages(comm)
    comm.Reduce(np.full(3, rank + 5, np.int32), out, op=first, root=comm.Get_size() - 1)
    if rank == comm.Get_size() - 1:
        assert (out == 5).all(), out  # (rank 0's, as MPI combines ranks in order)
    assert messages(comm) == before
    add.Free()
    first.Free()
    # (MPI's own barrier: a rank whose Reduce returned first must not start sending the
    # Bcasts below while the root is still in MPI's Reduce, whose progress hook, under Open
    # MPI, would take them from the ring and count them above)
    MPI.Intracomm.Barrier(comm)
    inline_specs(comm)
    unnamed_dtypes(comm)
    beyond_mpi(comm)
    comm.Barrier()
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()

"""cma.mpi's datatype decoding against MPI's own packing, over random nested datatypes.

For each datatype hypothesis builds (vectors, hvectors, indexed, indexed blocks, structs,
subarrays in both orders, resized, dup, contiguous, nested up to three deep, over the
predefined types including the gapped pair types), ``Typed.pack`` must give the bytes
MPI gives (a typed send to ourselves received as bytes), and a packet scattered with
``Typed`` must leave the buffer as MPI's typed receive of those bytes does. One rank is
enough; prints "OK 0" at the end. Argument: the number of examples (default 300).
"""

from __future__ import annotations

import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from cma.comm import send_view
from cma.mpi.datatypes import Typed, layout, typed

EXAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 300
SELF = MPI.COMM_SELF
NAMED = [MPI.BYTE, MPI.SHORT, MPI.INT, MPI.DOUBLE, MPI.FLOAT_INT, MPI.DOUBLE_INT, MPI.SHORT_INT,
         MPI.LONG_DOUBLE_INT]
small = st.integers(0, 4)


def derive(draw: st.DrawFn, base: MPI.Datatype) -> MPI.Datatype:
    kind = draw(st.sampled_from(["contiguous", "vector", "hvector", "indexed", "hindexed",
                                 "indexed_block", "struct", "subarray", "resized", "dup"]))
    ext = base.Get_extent()[1]
    if kind == "contiguous":
        return base.Create_contiguous(draw(small))
    if kind == "vector":
        return base.Create_vector(draw(small), draw(small), draw(st.integers(0, 6)))
    if kind == "hvector":
        return base.Create_hvector(draw(small), draw(small), draw(st.integers(0, 6)) * ext + draw(small))
    if kind in ("indexed", "hindexed", "indexed_block"):
        n = draw(small)
        displs = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
        if kind == "indexed_block":
            return base.Create_indexed_block(draw(small), displs)
        lengths = draw(st.lists(small, min_size=n, max_size=n))
        if kind == "indexed":
            return base.Create_indexed(lengths, displs)
        return base.Create_hindexed(lengths, [d * ext + draw(small) for d in displs])
    if kind == "struct":
        n = draw(st.integers(1, 3))
        members = [base, *draw(st.lists(st.sampled_from(NAMED), min_size=n - 1, max_size=n - 1))]
        lengths = draw(st.lists(small, min_size=n, max_size=n))
        displs = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
        return MPI.Datatype.Create_struct(lengths, displs, members)
    if kind == "subarray":
        dims = draw(st.integers(1, 3))
        sizes = draw(st.lists(st.integers(1, 5), min_size=dims, max_size=dims))
        subsizes = [draw(st.integers(1, s)) for s in sizes]
        starts = [draw(st.integers(0, s - sub)) for s, sub in zip(sizes, subsizes, strict=True)]
        order = draw(st.sampled_from([MPI.ORDER_C, MPI.ORDER_FORTRAN]))
        return base.Create_subarray(sizes, subsizes, starts, order=order)
    if kind == "resized":
        return base.Create_resized(0, max(base.Get_true_extent()[1], 0) + draw(st.integers(0, 16)))
    return base.Dup()


@st.composite
def datatypes(draw: st.DrawFn) -> MPI.Datatype:
    datatype = draw(st.sampled_from(NAMED))
    made = []
    for _ in range(draw(st.integers(1, 3))):
        datatype = derive(draw, datatype)
        made.append(datatype)
    datatype.Commit()
    return datatype


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(datatype=datatypes(), count=st.integers(0, 3), seed=st.integers(0, 1000))
def packs_as_mpi_does(datatype: MPI.Datatype, count: int, seed: int) -> None:
    lb, extent = datatype.Get_extent()
    true_lb, true_extent = datatype.Get_true_extent()
    if lb < 0 or true_lb < 0 or extent <= 0 and count > 1:
        return  # (negative offsets reach before the buffer: refused, tested elsewhere)
    # (an empty datatype's true extent is the library's choice: Open MPI's is huge)
    nbytes = max((count - 1) * extent + true_lb + true_extent, 0) \
        if count and datatype.Get_size() else 0
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, nbytes + 8, dtype=np.uint8)
    packed = np.zeros(datatype.Get_size() * count, np.uint8)
    # (Datatype.Pack derives the count from the buffer's length: a send to ourselves
    # received as bytes gives the same packed bytes for any count)
    SELF.Sendrecv([buf, count, datatype], 0, 0, [packed, MPI.BYTE], 0, 0)
    found = layout(datatype)
    mine = None if found.contiguous else typed(buf, count, 0, found, send_view)
    if mine is None:  # no gaps: cma moves the bytes from the start of the buffer
        assert np.array_equal(packed, buf[: packed.nbytes]), datatype.decode()
    elif isinstance(mine, memoryview):  # one block somewhere in the buffer: its bytes
        assert np.array_equal(np.frombuffer(mine, np.uint8), packed), datatype.decode()
    else:
        assert np.array_equal(np.frombuffer(mine.pack(), np.uint8), packed), datatype.decode()
        theirs = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
        ours = theirs.copy()
        SELF.Sendrecv([packed, MPI.BYTE], 0, 0, [theirs, count, datatype], 0, 0)
        into = typed(ours, count, 0, found, send_view)
        assert isinstance(into, Typed)
        into[: packed.nbytes] = packed.data
        assert np.array_equal(ours, theirs), datatype.decode()
    datatype.Free()


packs_as_mpi_does()
print("OK 0", flush=True)

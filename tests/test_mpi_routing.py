"""Which library runs an all-on-node communicator's collective (cma.mpi.routing), without
processes: every rank must reach the same choice from what it was given, whatever form
its buffer spec takes; the table and the modes route as they say."""

from __future__ import annotations

import functools
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'cma-ipc[mpi]')")
from mpi4py import MPI  # noqa: E402
from mpi4py.util import dtlib  # noqa: E402

import cma  # noqa: E402
from cma.mpi import routing  # noqa: E402
from cma.mpi.comm import ON_NODE_COLLECTIVES  # noqa: E402

TYPES = [(np.uint8, MPI.BYTE), (np.int32, MPI.INT), (np.float64, MPI.DOUBLE),
         (np.complex128, MPI.C_DOUBLE_COMPLEX), (np.float32, "f"),
         # (a pair type: MPI's size is 12, cma's element, dtlib's aligned dtype, 16)
         (np.dtype("d,i", align=True), MPI.DOUBLE_INT), (np.dtype("h,i", align=True), MPI.SHORT_INT)]


def forms(array: np.ndarray, mpitype: MPI.Datatype, count: int) -> list[Any]:
    """Specs of one type signature (``count`` elements of ``array``'s type; ``array`` may
    be longer) as programs write them."""
    exact = array[:count]
    return [exact, [exact, mpitype], [array, count, mpitype], (array, count, mpitype),
            [exact.view(np.uint8), count * exact.itemsize, MPI.BYTE], [array, count],
            [array, np.int64(count), mpitype], [bytearray(array.tobytes()), count, mpitype],
            bytearray(exact.tobytes()) if exact.dtype == np.uint8 else exact]


@given(st.sampled_from(TYPES), st.integers(0, 3000), st.integers(0, 40))
def test_every_spec_form_of_one_signature_names_the_same_bytes(kind: Any, count: int,
                                                               spare: int) -> None:
    dtype, mpitype = kind
    array = np.zeros(count + spare, dtype)
    sizes = {routing.spec_bytes(spec) for spec in forms(array, mpitype, count)}
    assert sizes == {count * array.itemsize}


@given(st.sampled_from(TYPES), st.integers(0, 500), st.integers(1, 9), st.data())
def test_a_root_in_place_and_its_peers_agree_on_the_size(kind: Any, count: int, size: int,
                                                         data: st.DataObject) -> None:
    """The root's IN_PLACE call and a peer's call of one collective give one size: the
    block a peer sends or gets, the message a reduction combines."""
    dtype, mpitype = kind
    block, whole = np.zeros(count, dtype), np.zeros(count * size, dtype)
    peer_form = data.draw(st.sampled_from(forms(block, mpitype, count)))
    # (a count in a spec of blocks counts one block, as in mpi4py)
    whole_form = data.draw(st.sampled_from([whole, [whole, mpitype], [whole, count, mpitype]]))
    agreed = routing.AGREED_BYTES
    place = data.draw(st.sampled_from([MPI.IN_PLACE, None]))
    pairs = {
        "Gather": ((place, whole_form), (peer_form, None)),
        "Allgather": ((place, whole_form), (peer_form, whole)),
        "Scatter": ((whole_form, place), (None, peer_form)),
        "Alltoall": ((place, whole_form), (whole_form, whole)),
        "Allreduce": ((place, peer_form), (peer_form, block)),
        "Reduce": ((place, peer_form), (peer_form, None)),
        "Bcast": ((peer_form,), (block,)),
    }
    for name, (root_args, peer_args) in pairs.items():
        root = agreed[name](root_args, {}, size)  # (None reads as IN_PLACE, as in mpi4py)
        peer = agreed[name]((), dict(zip(("sendbuf", "recvbuf"), peer_args, strict=False))
                            if name != "Bcast" else {"buf": block}, size)
        assert root == peer, (name, root, peer)
        assert root == block.nbytes, (name, root)


def test_allgatherv_agrees_on_the_mean_block_from_the_counts() -> None:
    size, counts = 3, [5, 0, 7]
    recv = np.zeros(40, np.int64)
    spec_a = [recv, (counts, [0, 5, 5]), MPI.INT64_T]
    spec_b = [recv, counts, [20, 0, 30], MPI.INT64_T]  # (another rank's own displacements)
    agreed = routing.AGREED_BYTES["Allgatherv"]
    assert agreed((np.zeros(5, np.int64), spec_a), {}, size) == 12 * 8 // 3
    assert agreed((MPI.IN_PLACE, spec_b), {}, size) == 12 * 8 // 3


def _derived() -> list[tuple[MPI.Datatype, int]]:
    """Derived datatypes without gaps, each with the int64s one element of it holds."""
    from mpi4py.util import dtlib

    int64 = MPI._typedict[np.dtype(np.int64).char]
    return [(dtlib.from_numpy_dtype(np.int64), 1), (int64.Create_contiguous(4).Commit(), 4),
            (int64.Create_vector(2, 2, 2).Commit(), 4),
            (MPI.Datatype.Create_struct([1, 1], [0, 8], [int64, MPI.DOUBLE]).Commit(), 2)]


@given(st.integers(0, 200), st.integers(1, 5), st.data())
def test_a_derived_datatype_without_gaps_names_the_bytes_its_peers_arrays_do(
        count: int, size: int, data: st.DataObject) -> None:
    """A rank passing a derived datatype without gaps sizes the collective as a peer
    passing an int64 array of the same type signature does (cma.mpi hands such a spec to
    cma as bytes, specs.as_bytes: the choice of library must be one)."""
    datatype, per = data.draw(st.sampled_from(_derived()))
    block = np.zeros(count * per, np.int64)
    whole = np.zeros(count * per * size, np.int64)
    agreed = routing.AGREED_BYTES
    cases = {
        "Bcast": (([block, count, datatype],), (block,)),
        "Gather": (((block, count, datatype), None), (block, None)),
        "Allgather": ((MPI.IN_PLACE, [whole, count, datatype]), (block, whole)),
        "Scatter": (([whole, count, datatype], MPI.IN_PLACE), (None, block)),
        "Alltoall": (([whole, count, datatype], whole), (whole, whole)),
        "Allgatherv": ((MPI.IN_PLACE, [whole, [count] * size, datatype]),
                       (block, [whole, [count * per] * size, MPI.INT64_T])),
    }
    for name, (derived_args, array_args) in cases.items():
        ours, theirs = agreed[name](derived_args, {}, size), agreed[name](array_args, {}, size)
        assert ours == theirs == block.nbytes, (name, ours, theirs)
    assert routing.spec_bytes([block, datatype]) == block.nbytes


def test_a_derived_datatype_is_found_wherever_a_spec_names_one() -> None:
    """cma.mpi hands a call naming a derived datatype to MPI or to specs (on_node): one
    named by keyword, inside a tuple spec or Alltoallw's list of datatypes is found as one
    named in a positional list; bare arrays, roots, ops and predefined datatypes are not."""
    from cma.mpi.comm import _derived_datatype

    buf = np.zeros(64, np.int64)
    vector = MPI.INT64_T.Create_vector(2, 1, 2).Commit()
    try:
        plain = [((buf, 0), {}), ((buf, buf, MPI.SUM), {}), (([buf, 8, MPI.INT64_T], 0), {}),
                 ((buf,), {"root": 0}), ((), {"buf": [buf, MPI.BYTE]}),
                 (([buf, ([1] * 2, None), [MPI.INT64_T] * 2], buf), {})]
        derived = [(([buf, 2, vector], 0), {}), (((buf, 2, vector), 0), {}),
                   (([buf, vector], 0), {}), (([buf, [1, 1], [0, 2], vector], buf), {}),
                   ((buf,), {"recvbuf": [buf, 2, vector]}),
                   ((), {"sendbuf": buf, "recvbuf": (buf, 2, vector)}),
                   (([buf, ([1] * 2, None), [MPI.INT64_T, vector]], buf), {})]
        for args, kwargs in plain:
            assert not _derived_datatype(args, kwargs), (args, kwargs)
        for args, kwargs in derived:
            assert _derived_datatype(args, kwargs), (args, kwargs)
    finally:
        vector.Free()


def test_specs_read_a_derived_datatype_without_gaps_as_bytes() -> None:
    from cma.mpi.specs import as_bytes

    buf = np.zeros(64, np.int64)
    for datatype, per in _derived():
        size = 8 * per
        assert as_bytes([buf, 3, datatype])[1:] == [3 * size, "B"]
        assert as_bytes((buf, np.int64(3), datatype))[1:] == [3 * size, "B"]
        assert as_bytes([buf, [1, 2], [0, 3], datatype])[1:] == [[size, 2 * size],
                                                                 [0, 3 * size], "B"]
        assert as_bytes([buf, np.array([1, 2]), None, datatype])[1:] == [[size, 2 * size],
                                                                         None, "B"]
        # (a displacement with one count: cma's collectives take none, MPI's run it)
        assert as_bytes((buf, (2, 1), datatype)) is None
        assert as_bytes([buf, 2, 1, datatype]) is None
        assert as_bytes([buf, ([1, 2], None), datatype])[1:] == [([size, 2 * size], None), "B"]
        assert as_bytes([buf, datatype])[1:] == ["B"]
        assert as_bytes([buf.view(np.uint8)[: size + 1], datatype]) is None  # (MPI's to refuse)
    spec = [buf, 3, MPI.DOUBLE]
    assert as_bytes(spec) is spec and as_bytes(buf) is buf and as_bytes(None) is None
    gaps = MPI._typedict["l"].Create_vector(2, 1, 2).Commit()
    assert as_bytes([buf, 3, gaps]) is None
    # (no gaps, but the bytes out of order or one repeated: as bytes, they would move
    # other bytes than MPI moves)
    reordered = MPI.DOUBLE.Create_indexed([1, 1], [1, 0]).Commit()
    repeated = MPI.DOUBLE.Create_indexed([1, 1, 1], [0, 0, 2]).Commit()
    for datatype in (reordered, repeated):
        assert datatype.Get_extent()[1] == datatype.Get_size()  # (what a size test saw)
        assert as_bytes([buf, 2, datatype]) is None
        # (packed for cma, sized as its peers' arrays of the same signature)
        assert routing.spec_bytes([buf, 2, datatype]) == 2 * datatype.Get_size()
    assert routing.spec_bytes([buf, 3, gaps]) == 3 * gaps.Get_size()
    assert as_bytes([buf, ([1, 1], [0, 1]), [MPI.DOUBLE, MPI.DOUBLE]]) is None  # (Alltoallw's)


def test_a_datatype_with_gaps_goes_to_cma_packed_and_comes_back_unpacked() -> None:
    """``as_packed``: the elements the spec names (a count's blocks, the furthest a
    v-form's blocks reach, all of a buffer of whole elements) packed in type-map order
    (as MPI_Pack lays them out), the counts scaled to bytes, and what a collective
    writes into the packed copy unpacked into them, the gaps and the rest untouched."""
    from cma.mpi.specs import as_packed, as_packed_unfilled

    buf = np.arange(12, dtype=np.int64)
    gaps = MPI._typedict["l"].Create_vector(2, 1, 2).Commit()  # (2 of every 3 int64s)
    packed = as_packed([buf, 1, gaps], blocks=3)  # (a block for each of 3 ranks)
    assert packed is not None and packed[1] is not None
    spec, typed_buffer = packed
    assert spec[1:] == [16, "B"]
    assert spec[0].view(np.int64).tolist() == [0, 2, 3, 5, 6, 8]
    spec[0].view(np.int64)[:] = -np.arange(1, 7)
    typed_buffer.scatter(spec[0])
    assert buf.tolist() == [-1, 1, -2, -3, 4, -4, -5, 7, -6, 9, 10, 11]
    # (the last element's trailing gap past the buffer: not rows of the buffer; block by
    # block, the same layout)
    spaced = gaps.Create_resized(0, 32).Commit()  # (an int64 free after each element)
    cut = as_packed([np.arange(15, dtype=np.int64), 4, spaced], blocks=1)
    assert cut is not None and cut[0][0].view(np.int64).tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert type(cut[1]).__name__ == "Typed"
    one = as_packed([np.arange(12, dtype=np.int64), 1, gaps], blocks=1)
    assert one is not None and one[0][0].view(np.int64).tolist() == [0, 2]  # (not the rest)
    # a v-form: as far as its blocks reach, its displacements in elements become bytes
    v_form = as_packed([np.arange(12, dtype=np.int64), ([1, 1], [3, 0]), gaps], blocks=3)
    assert v_form is not None and v_form[0][1:] == [([16, 16], [48, 0]), "B"]
    assert v_form[0][0].view(np.int64).tolist() == [0, 2, 3, 5, 6, 8, 9, 11]
    sized = as_packed_unfilled([buf, [1, 2], [0, 2], gaps], blocks=3)
    assert sized is not None and sized[0].nbytes == 64 and sized[1:] == [[16, 32], [0, 32], "B"]
    reordered = MPI.DOUBLE.Create_indexed([1, 1], [1, 0]).Commit()
    whole = as_packed([np.arange(4.0), reordered], blocks=1)
    assert whole is not None and whole[0][0].view(np.float64).tolist() == [1.0, 0.0, 3.0, 2.0]
    assert whole[0][1:] == ["B"]
    # elements that overlap their neighbours: only the one named is written back
    overlapping = MPI._typedict["l"].Create_contiguous(2).Create_resized(0, 8).Commit()
    values = np.array([0, 10, 20, 30], np.int64)
    first = as_packed([values, 1, overlapping], blocks=1)
    assert first is not None and first[1] is not None
    first[0][0].view(np.int64)[:] = [-1, -2]
    first[1].scatter(first[0][0])
    assert values.tolist() == [-1, -2, 20, 30]
    # a root's peers pass None where mpi4py ignores the buffer: nothing packed, counts kept
    assert as_packed([None, 3, gaps], blocks=2) == ([None, 48, "B"], None)
    # a read-only buffer gives a read-only copy (a receive into it raises, as MPI's)
    frozen = as_packed([np.frombuffer(bytes(48), np.int64), 2, gaps], blocks=1)
    assert frozen is not None and not frozen[0][0].flags.writeable
    # what stays MPI's: a displacement with a single count, absolute addresses, a buffer
    # of no whole number of elements with no count, Alltoallw's lists
    assert as_packed([buf, 2, 1, gaps], 1) is None and as_packed([buf, (2, 1), gaps], 1) is None
    assert as_packed([MPI.BOTTOM, 1, gaps], 1) is None
    assert as_packed([np.zeros(4, np.int64), gaps], 1) is None  # (32 B, elements of 24)
    assert as_packed([buf, ([1, 1], [0, 1]), [gaps, gaps]], 1) is None
    assert as_packed([buf, 3, MPI.DOUBLE], 1) is None  # (nothing to pack)


def test_a_spec_cma_refuses_stays_with_cma_which_raises_its_error() -> None:
    assert routing.spec_bytes([np.zeros(3), 1, 2, 3, 4]) == -1
    # (a count past the buffer, a buffer of no whole number of elements, Fortran order:
    # cma's reader refuses each, so every form of them must, on every rank)
    assert routing.spec_bytes([np.zeros(3, np.uint8), 5, MPI.BYTE]) == -1
    assert routing.spec_bytes([bytearray(81), 10, MPI.DOUBLE]) == -1
    assert routing.spec_bytes((bytearray(81), 10, "d")) == -1
    fortran = np.asfortranarray(np.zeros((16, 16)))
    assert routing.spec_bytes(fortran) == routing.spec_bytes([fortran, MPI.DOUBLE]) == -1
    assert routing.spec_bytes([fortran, 256, MPI.DOUBLE]) == -1
    # ... and so must each collective's size, a bare array as much as a spec list
    agreed = routing.AGREED_BYTES
    for name, args in (("Bcast", (fortran,)), ("Allreduce", (fortran, np.zeros(256))),
                       ("Gather", (fortran, None)), ("Allgather", (fortran, np.zeros(512))),
                       ("Scatter", (None, fortran)), ("Alltoall", (fortran, np.zeros(256)))):
        assert agreed[name](args, {}, 2) == -1, name
    route = routing.Window(routing.AGREED_BYTES["Bcast"], 2, (100, 200))
    assert route(None, ([np.zeros(3), 1, 2, 3, 4],), {}) is False
    assert route(None, (np.zeros(10, np.uint8),), {}) is True
    assert route(None, (np.zeros(150, np.uint8),), {}) is False
    assert route(None, (np.zeros(200, np.uint8),), {}) is True
    gapped = routing.Window(routing.AGREED_BYTES["Bcast"], 8, (100, 200, 300, routing.EVERY_SIZE[1]))
    assert [gapped(None, (np.zeros(n, np.uint8),), {}) for n in (99, 100, 199, 200, 299, 300, 1 << 30)] \
        == [True, False, False, True, True, False, False]


def test_a_routed_method_calls_the_library_its_route_names() -> None:
    """The instance methods Comm.__init__ makes: MPI's own where MPI runs every size; else
    a call that sizes the message (any spec form, keywords too) and calls one library."""
    def through_mpi(*args: Any, **kwargs: Any) -> str:
        return "mpi"

    def through_cma(*args: Any, **kwargs: Any) -> str:
        return "cma"

    assert routing.method(routing.always_mpi, through_mpi, through_cma, MPI.COMM_SELF) \
        is through_mpi
    bcast = routing.method(routing.Window(routing.AGREED_BYTES["Bcast"], 2, (100, 200)),
                           through_mpi, through_cma, MPI.COMM_SELF)
    assert bcast(np.zeros(99, np.uint8), 0) == "mpi"
    assert bcast(np.zeros(100, np.uint8), root=1) == "cma"
    assert bcast(buf=[np.zeros(300, np.uint8), 150, MPI.BYTE]) == "cma"
    assert bcast([np.zeros(300, np.uint8), 200, MPI.BYTE]) == "mpi"
    assert bcast([np.zeros(3), 1, 2, 3, 4]) == "cma"  # (refused: cma raises its error)
    # a window of two ranges (Bcast at 5-16 ranks): MPI in the gap between them
    gapped = routing.method(routing.Window(routing.AGREED_BYTES["Bcast"], 8, (100, 200, 300, 400)),
                            through_mpi, through_cma, MPI.COMM_SELF)
    assert [gapped(np.zeros(n, np.uint8)) for n in (99, 100, 199, 200, 299, 300, 399, 400)] \
        == ["mpi", "cma", "cma", "mpi", "mpi", "cma", "cma", "mpi"]


def test_an_object_collective_routes_by_the_pickle_a_rank_holds() -> None:
    """Each rank measures the pickle it holds (an array's data beside it, uncopied), the
    root alone for bcast and scatter; one rank's object past the window's start is
    enough. The window is the table's at every rank count."""
    small, large = {"a": [1, 2]}, np.zeros(70_000, np.uint8)
    assert routing.pickled_bytes(small) < 100
    assert large.nbytes <= routing.pickled_bytes(large) < large.nbytes + 200
    assert large.nbytes <= routing.pickled_bytes([large]) < large.nbytes + 200
    assert large.nbytes <= routing.pickled_bytes({"data": large, "step": 3}) < large.nbytes + 200
    for name, start in (("bcast", 256 << 10), ("allreduce", 4 << 20)):
        route = routing.routes(routing.AUTO, 2, [name])[name]
        assert isinstance(route, routing.ObjectWindow) and route.start == start
        assert not route.is_large(small)
        big = np.zeros(start, np.uint8)
        assert route.is_large(big)
        assert route.held((), {"obj" if name == "bcast" else "sendobj": big}) is big
        assert route.held((big,), {}) is big
        assert not route.is_large(np.zeros(start - 200, np.uint8))
        # what cannot be pickled whole goes to cma, whose collective takes it or raises
        assert route.is_large(lambda: None)
    scatter = routing.routes(routing.AUTO, 2, ["scatter"])["scatter"]
    assert isinstance(scatter, routing.ObjectWindow)
    assert scatter.is_large([np.zeros(2 << 20, np.uint8) for _ in range(2)])
    assert not scatter.is_large(scatter.held((), {"sendobj": [small, small], "root": 0}))
    assert scatter.is_large(item for item in [small, small])  # (cma's takes it)
    # measured without pickling: arrays (not of objects), bytes, scalars
    assert routing.pickled_bytes(1.5) == routing.pickled_bytes(None) == 0
    assert routing.pickled_bytes(np.zeros(10, object)) > 0
    assert routing.pickled_bytes(np.ma.zeros(1000)) >= 8000  # (a subclass: its own size)


class Peers:
    """MPI's side of an object collective as this rank sees it, peers' objects given:
    records what this rank sent through MPI and answers what its peers' would make
    MPI return (their THROUGH_CMA included)."""

    def __init__(self, name: str, peers: list[Any], root: int = 0) -> None:
        self.name, self.peers, self.root, self.sent = name, peers, root, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.sent.append((args, kwargs))
        mine = args[0] if args else kwargs.get("sendobj", kwargs.get("obj"))
        if self.name in ("bcast", "scatter"):
            return self.peers[self.root] if self.root != 0 else (
                mine if self.name == "bcast" else mine[0])
        if self.name == "allgather":
            return [mine, *self.peers[1:]]
        if self.name == "alltoall":
            return [mine[0], *self.peers[1:]]
        op = args[1] if len(args) > 1 else kwargs["op"]
        result = mine  # allreduce: rank order, with the op it was given
        for peer in self.peers[1:]:
            result = op(result, peer)
        return result


def cma_call(*args: Any, **kwargs: Any) -> Any:
    return ("cma", args, kwargs)


@pytest.mark.parametrize("name", ["bcast", "scatter", "allgather", "alltoall", "allreduce"])
def test_an_object_collective_goes_to_cma_where_any_rank_sends_through_cma(name: str) -> None:
    """Without an agreement call: a rank whose object is large sends THROUGH_CMA
    through MPI in place of it; a rank that gets one back (a root's, a peer's block, a
    combination holding one) runs the call through cma; else MPI's answer stands."""
    route = routing.routes(routing.AUTO, 2, [name])[name]
    assert isinstance(route, routing.ObjectWindow)
    big, mark = np.zeros(route.start, np.uint8), routing.THROUGH_CMA
    small = [1, 2] if name in ("scatter", "alltoall") else 1
    run = route.run
    # small everywhere: MPI's answer, once
    mpi = Peers(name, [None, 1])
    got = run(MPI.COMM_SELF, (small,), {}, mpi, cma_call)
    assert got == {"bcast": 1, "scatter": 1, "allgather": [1, 1], "alltoall": [1, 1],
                   "allreduce": 2}[name] and len(mpi.sent) == 1
    # large here: THROUGH_CMA through MPI, then cma with the call as it was made
    held = [big, big] if name in ("scatter", "alltoall") else big
    mpi = Peers(name, [None, 1])
    assert run(MPI.COMM_SELF, (held,), {}, mpi, cma_call) == ("cma", (held,), {})
    sent = mpi.sent[0][0][0]
    assert sent is mark or sent == [mark], sent
    # large at a peer only (rank 1): the peer's THROUGH_CMA sends this rank to cma
    rooted = name in ("bcast", "scatter")
    mpi = Peers(name, [None, mark], root=1 if rooted else 0)
    kwargs = {"root": 1} if rooted else {}
    assert run(MPI.COMM_SELF, (small,), kwargs, mpi, cma_call) == ("cma", (small,), kwargs)
    if name == "allreduce":  # (the user's op still combines what is small)
        mpi = Peers(name, [None, 5])
        assert run(MPI.COMM_SELF, (3, MPI.PROD), {}, mpi, cma_call) == 15
        assert run(MPI.COMM_SELF, (), {"sendobj": 3, "op": lambda a, b: a - b}, mpi, cma_call) == -2
    # a non-root's own large object does not count: the root's decides
    if rooted:
        mpi = Peers(name, [None, 7], root=1)
        assert run(MPI.COMM_SELF, (held, 1), {}, mpi, cma_call) == 7


def test_the_marks_come_back_through_mpi_or_none_is_sent() -> None:
    """The marks travel through mpi4py's own pickling; under a pickler that would not
    bring them back (JSON here), no rank marks, and every call is MPI's."""
    mark, large_at = routing.THROUGH_CMA, routing._LargeAt(3)
    assert pickle.loads(pickle.dumps(mark)) is mark
    assert MPI.COMM_SELF.bcast(mark) is mark
    pair = MPI.COMM_SELF.reduce(routing._Pair((large_at, 2)), op=lambda a, b: a, root=0)
    assert pair.__class__ is routing._Pair and pair[0].__class__ is routing._LargeAt
    assert pair == (3, 2)
    route = routing.routes(routing.AUTO, 2, ["allreduce"])["allreduce"]
    assert isinstance(route, routing.ObjectWindow)
    big = np.zeros(route.start, np.uint8)
    assert route.is_large(big)
    MPI.pickle.__init__(lambda obj, protocol=None: json.dumps(obj).encode(), json.loads)
    try:
        assert not route.is_large(big)
    finally:
        MPI.pickle.__init__()
    assert route.is_large(big)


class Moving(MPI.Intracomm):
    """COMM_SELF as the root of a gather or reduce (rank 0) or as a peer of it: what
    it would take from ranks through cma, and what it sends."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.pulled: list[int] = []
        self.sent: list[tuple[Any, int]] = []

    def _objects_from(self, ranks: list[int], root: int) -> list[Any]:
        self.pulled += ranks
        return [[f"large {rank}"] for rank in ranks]

    def _object_to(self, obj: Any, root: int) -> None:
        self.sent.append((obj, root))


def test_a_gather_takes_only_the_large_objects_through_cma() -> None:
    """The root gets MPI's list with each large object in its place, taken from its
    rank through cma (its own as it is); a rank other than the root that holds a large
    object sends it after MPI's gather; nothing else moves through cma."""
    route = routing.routes(routing.AUTO, 2, ["gather"])["gather"]
    assert isinstance(route, routing.ObjectWindow)
    big, mark = np.zeros(route.start, np.uint8), routing.THROUGH_CMA

    def gather_with(peers: list[Any], at: int = 0) -> Callable[..., Any]:
        """MPI's gather at this rank, ``at`` in the list, the peers' objects given."""
        def gather(sendobj: Any, root: int = 0) -> Any:
            return [*peers[:at], sendobj, *peers[at:]] if root == at else None
        return gather

    comm = Moving(MPI.COMM_SELF)
    assert route.run(comm, ([1],), {}, gather_with([[2], [3]]), cma_call) == [[1], [2], [3]]
    assert route.run(comm, ([1],), {}, gather_with([mark, [3]]), cma_call) == [[1], ["large 1"], [3]]
    assert comm.pulled == [1] and comm.sent == []
    got = route.run(comm, (big,), {}, gather_with([[2], mark]), cma_call)
    assert got[0] is big and got[1:] == [[2], ["large 2"]] and comm.pulled == [1, 2]
    # the root is rank 1 (a NumPy integer, as mpi4py takes it), its own object large
    got = route.run(comm, (big, np.int64(1)), {}, gather_with([mark, [2]], at=1), cma_call)
    assert got[0] == ["large 0"] and got[1] is big and got[2] == [2] and comm.pulled == [1, 2, 0]
    # at a rank other than the root (1): its large object goes after MPI's call
    sent: list[Any] = []

    def gather_at_peer(sendobj: Any, root: int = 0) -> None:
        sent.append(sendobj)

    assert route.run(comm, (big, 1), {}, gather_at_peer, cma_call) is None
    assert sent == [mark] and comm.sent == [(big, 1)]
    assert route.run(comm, (), {"sendobj": [1], "root": 1}, gather_at_peer, cma_call) is None
    assert sent == [mark, [1]] and comm.sent == [(big, 1)]
    # mpi4py's own checks of the call stand: an object is required
    with pytest.raises(TypeError):
        route.run(comm, (), {"root": 1}, gather_at_peer, cma_call)


def mpi4py_reduce(peers: list[Any], at: int = 0, fast: bool = True) -> Callable[..., Any]:
    """MPI's reduce at rank ``at`` as mpi4py runs it, the other ranks' objects given:
    with ``fast`` (mpi4py.rc.fast_reduce, the default) a binomial tree over ranks (rank r
    combines with r + mask), else a left fold of all of them."""
    def reduce(sendobj: Any, op: Any = MPI.SUM, root: int = 0) -> Any:
        values = [*peers[:at], sendobj, *peers[at:]]
        if not fast:
            return functools.reduce(op, values) if root == at else None
        mask = 1
        while mask < len(values):
            for r in range(0, len(values), 2 * mask):
                if r + mask < len(values):
                    values[r] = op(values[r], values[r + mask])
            mask <<= 1
        return values[0] if root == at else None
    return reduce


def grouped(a: str, b: str) -> str:
    """An op that shows the grouping: ranks in order and every pair's parentheses."""
    return f"({a} {b})"


@pytest.mark.parametrize("fast", [True, False], ids=["tree", "fold"])
def test_a_reduce_combines_the_large_objects_as_mpi_grouped_them(fast: bool) -> None:
    """Through MPI's reduce, a large object is its rank (``_LargeAt``), and each
    combination holding one a ``_Pair``; the root takes the large objects through cma
    and combines the pairs as MPI paired them: the result is mpi4py's own, grouping and
    all (a float sum rounds alike)."""
    route = routing.routes(routing.AUTO, 2, ["reduce"])["reduce"]
    assert isinstance(route, routing.ObjectWindow)
    big = "x" * route.start  # (a large object, measured by its length)

    def pulled(rank: int) -> str:
        return f"large {rank}"

    comm = Moving(MPI.COMM_SELF)
    comm._objects_from = lambda ranks, root: (comm.pulled.extend(ranks), [pulled(r) for r in ranks])[1]
    # this rank is the root (0, a NumPy integer as mpi4py takes it); the large objects
    # are the peers' (then its own too)
    for objects in (["r0", "r1", big, "r3", "r4", big, "r6"], [big, "r1", "r2", big, "r4"]):
        # what MPI sees from the peers (their marks where their objects are large), and
        # what mpi4py would give, each large object as the root takes it
        seen = [routing._LargeAt(r) if obj is big else obj for r, obj in enumerate(objects)]
        taken = [pulled(r) if obj is big and r else obj for r, obj in enumerate(objects)]
        comm.pulled = []
        got = route.run(comm, (objects[0], grouped, np.int64(0)), {},
                        mpi4py_reduce(seen[1:], fast=fast), cma_call)
        assert got == mpi4py_reduce(taken[1:], fast=fast)(taken[0], grouped, 0), got[:200]
        assert comm.pulled == [r for r, obj in enumerate(objects) if obj is big and r]
    assert route.run(comm, (5,), {}, mpi4py_reduce([6, 7], fast=fast), cma_call) == 18  # (SUM)
    # a user's int, tuple or list is a value, not a rank: the op sees it
    assert route.run(comm, ([3],), {"op": lambda a, b: a + b},
                     mpi4py_reduce([[(1,)], [2]], fast=fast), cma_call) == [3, (1,), 2]
    # at a rank other than the root (1): its large object goes after MPI's call
    seen_by_mpi: list[Any] = []

    def reduce_at_peer(sendobj: Any, op: Any = MPI.SUM, root: int = 0) -> None:
        seen_by_mpi.append(sendobj)

    assert route.run(comm, (big, grouped, 1), {}, reduce_at_peer, cma_call) is None
    assert seen_by_mpi == [routing._LargeAt(0)] and seen_by_mpi[0].__class__ is routing._LargeAt
    assert comm.sent == [(big, 1)]


@pytest.mark.skipif(routing.LOCK_TABLE is None, reason="this mpi4py has no lock table")
def test_a_routed_object_collective_runs_under_the_routing_lock() -> None:
    """MPI's call and cma's run under one lock per communicator and name (threads of a
    rank calling one collective at once stay paired across ranks); another
    communicator's call takes that communicator's lock."""
    route = routing.routes(routing.AUTO, 2, ["gather"])["gather"]
    for comm in (Moving(MPI.COMM_SELF), Moving(MPI.COMM_SELF.Dup())):
        lock = routing._route_lock(comm, "gather")
        held: list[bool] = []

        def gather(sendobj: Any, root: int = 0, lock: Any = lock, held: list[bool] = held) -> list[Any]:
            held.append(lock.locked())
            return [sendobj]

        assert route.run(comm, (3,), {}, gather, cma_call) == [3]
        assert held == [True] and not lock.locked()
        other = routing._route_lock(MPI.COMM_WORLD, "gather")
        assert other is not lock and not other.locked()


def test_modes_route_every_collective_alike() -> None:
    names = ON_NODE_COLLECTIVES
    assert routing.routes(routing.CMA, 4, names) == {}
    through_mpi = routing.routes(routing.MPI_ONLY, 4, names)
    assert set(through_mpi) == set(names)
    assert all(route(None, (), {}) for route in through_mpi.values())
    with pytest.raises(ValueError, match="CMA_MPI_COLLECTIVES"):
        routing.mode_of("fast")
    assert routing.mode_of("") == routing.AUTO
    assert routing.mode_of(" MPI ") == routing.MPI_ONLY


def test_the_table_sizes_only_collectives_every_rank_can_size() -> None:
    """A window that is neither every size nor none needs a size every rank agrees on;
    its bounds come in (from, until) pairs that go up; rows go up in ranks; every name is
    a collective the wrapper runs."""
    for name, rows in routing.WINDOWS.items():
        assert name in ON_NODE_COLLECTIVES, name
        ranks = [r for r, _ in rows]
        assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), name
        for _, window in rows:
            assert len(window) % 2 == 0 and 0 <= window[0], name
            assert list(window) == sorted(window), name
            if window not in (routing.EVERY_SIZE, routing.NO_SIZE):
                assert name in routing.AGREED_BYTES or name in routing.OBJECT_HELD, name
            if name in routing.OBJECT_HELD:  # (one rank's large object decides: no end)
                assert window[1:] == routing.EVERY_SIZE[1:], name


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16, 64, 256])
def test_auto_routes_by_the_table_row_that_holds_the_rank_count(size: int) -> None:
    chosen = routing.routes(routing.AUTO, size, ON_NODE_COLLECTIVES)
    for name in ON_NODE_COLLECTIVES:
        rows = routing.WINDOWS.get(name, ())
        window = next((w for ranks, w in rows if size <= ranks), routing.NO_SIZE)
        if window == routing.EVERY_SIZE:
            assert name not in chosen, name
        elif window == routing.NO_SIZE:
            assert chosen[name](None, (), {}), name
        elif name == "Bcast":  # (every range: MPI just below its start and at its end)
            for start, until in zip(window[::2], window[1::2], strict=True):
                assert not chosen[name](None, (np.zeros(start, np.uint8),), {}), name
                if start:
                    assert chosen[name](None, (np.zeros(start - 1, np.uint8),), {}), name
                if until <= 64 << 20:
                    assert chosen[name](None, (np.zeros(until, np.uint8),), {}), name


@pytest.mark.parametrize("name", ["FLOAT_INT", "DOUBLE_INT", "LONG_INT", "TWOINT", "SHORT_INT",
                                  "LONG_DOUBLE_INT"])
def test_a_pair_dtype_names_its_predefined_pair_type(name: str) -> None:
    """The dtype cma's MINLOC and MAXLOC combine, as mpi4py's dtlib gives it for a pair
    type, names that pair type again (the leaders' MPI step of a reduction over nodes
    passes it: mpi4py maps no structured dtype); other dtypes name none."""
    from cma.mpi.datatypes import pair_datatype

    pair = getattr(MPI, name)
    assert pair_datatype(np.dtype(dtlib.to_numpy_dtype(pair))) == pair
    assert pair_datatype(np.dtype([("v", "f8"), ("i", "i4")])) is None  # (packed: no C layout)
    assert pair_datatype(np.dtype([("v", "f8"), ("i", "i8")], align=True)) is None
    assert pair_datatype(np.dtype(np.float64)) is None


def _documented_window(cell: str) -> tuple[int, ...] | None:
    """The bounds (from, until[, from, until]) a cell of docs/mpi.md's routing table
    names: "MPI", "cma from 8 KiB", "cma at 32-255 KiB", "cma at 16 KiB-1023 KiB", "cma
    at 32-255 KiB and from 1 MiB"; None for a cell that refers to the 2-rank one ("same",
    "the 2-rank window, not measured"); any other cell fails."""
    units = {"KiB": routing.KIB, "MiB": routing.MIB}
    if cell == "MPI":
        return routing.NO_SIZE
    found = re.fullmatch(r"cma (?:at (\d+)(?: (KiB|MiB))?-(\d+) (KiB|MiB))?(?: and )?"
                         r"(?:from (\d+) (KiB|MiB))?", cell)
    if found and (found[1] or found[5]):
        bounds: tuple[int, ...] = ()
        if found[1]:
            bounds = (int(found[1]) * units[found[2] or found[4]], (int(found[3]) + 1) * units[found[4]])
        if found[5]:
            bounds += (int(found[5]) * units[found[6]], routing.EVERY_SIZE[1])
        return bounds
    assert cell in ("same", "the 2-rank window, not measured"), f"a cell not understood: {cell!r}"
    return None


def test_the_documented_routing_table_is_the_code_s() -> None:
    """docs/mpi.md's table of which library runs a collective, cell by cell, names the
    window routes() gives at both ends of each column's rank counts (a change to
    routing.WINDOWS that the docs do not follow fails here, and the other way round)."""
    text = (Path(__file__).parent.parent / "docs" / "mpi.md").read_text()
    section = text.split("## Which library runs a collective", 1)[1].split("\n## ", 1)[0]
    header = "| collective | 2 ranks | 3 ranks | 4 ranks | 5-8 ranks | 9-16 ranks | more |"
    table = section.split(header + "\n", 1)[1].split("\n\n", 1)[0]
    rows = table.splitlines()[1:]  # (past the |---| line)
    columns = [(2, 2), (3, 3), (4, 4), (5, 8), (9, 16), (17, 256)]
    objects = set(routing.OBJECT_HELD)
    listed: set[str] = set()
    for row in rows:
        first, *cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if first == "the others":
            names = [n for n in ON_NODE_COLLECTIVES if n not in listed]
        elif first == "other object forms":
            names = sorted(objects - listed)
        else:
            names = [n + v for n, v in re.findall(r"`(\w+)(\(v\))?`", first)]
            names = [n for name in names for n in
                     ((name[:-3], name[:-3] + "v") if name.endswith("(v)") else (name,))]
        assert names and len(cells) == len(columns), row
        listed.update(names)
        two_ranks = _documented_window(cells[0])
        for cell, ranks in zip(cells, columns, strict=True):
            documented = _documented_window(cell)
            if documented is None:  # ("the 2-rank window, not measured", "same")
                documented = two_ranks
            for name in names:
                for size in ranks:
                    route = routing.routes(routing.AUTO, size, [name]).get(name)
                    if route is None:
                        got = routing.EVERY_SIZE
                    elif isinstance(route, routing.ObjectWindow):
                        got = (route.start, routing.EVERY_SIZE[1])
                    elif isinstance(route, routing.Window):
                        got = route.bounds
                    else:
                        got = routing.NO_SIZE
                    assert got == documented, f"{name} at {size} ranks: {got} in the code, " \
                                              f"{documented} in docs/mpi.md ({cell!r})"
    assert listed == set(ON_NODE_COLLECTIVES), set(ON_NODE_COLLECTIVES) ^ listed


REDUCED_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdgFD"] + [
    np.dtype([("value", v), ("index", "i4")], align=True) for v in ("f4", "f8", "i4")]


@pytest.mark.parametrize("name", ["SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND",
                                  "BOR", "BXOR", "MINLOC", "MAXLOC"])
def test_a_reduction_over_nodes_refuses_first_what_mpi_s_step_would(name: str) -> None:
    """Over nodes, every rank checks before any step what the leaders' MPI call would
    refuse (a leader raising there left its node waiting for ever): each predefined op
    with each dtype is refused exactly where this MPI's own Allreduce refuses it; cma's
    own op (``cma.SUM``) goes to MPI as mpi4py's; a user's op on a dtype the node step
    cannot combine is refused too, also for a rank alone on its node, which has no node
    step to raise in."""
    from cma.errors import InvalidDatatype
    from cma.mpi.comm import _node_op
    from cma.mpi.hierarchy import _checked_op, _named, _spec

    op = getattr(MPI, name)
    for dtype in REDUCED_DTYPES:
        try:
            if not _named(dtype):
                raise KeyError(dtype)  # (mpi4py cannot name it at all)
            spec = _spec(np.zeros(2, dtype))
            out = np.zeros(2, dtype) if isinstance(spec, np.ndarray) else [np.zeros(2, dtype), spec[1]]
            MPI.COMM_SELF.Allreduce(spec, out, op)
            refused = False
        except (MPI.Exception, KeyError, ValueError):
            refused = True
        try:
            assert _checked_op(dtype, op, _node_op(op)) == op
            checked = False
        except InvalidDatatype:
            checked = True
        assert checked == refused, (name, dtype, refused)
    defined = REDUCED_DTYPES[-1] if name.endswith("LOC") else np.dtype("i4")
    assert _checked_op(defined, getattr(cma, name), getattr(cma, name)) == op
    user = MPI.Op.Create(lambda a, b, t: None, commute=True)
    try:
        with pytest.raises(InvalidDatatype):
            _checked_op(REDUCED_DTYPES[-1], user, _node_op(user))
    finally:
        user.Free()

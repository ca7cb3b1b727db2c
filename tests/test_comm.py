"""Comm, Request and Status across processes, over every registered transport and "auto".

Most tests talk to the long-lived ``peer`` (see conftest.py): the test process is rank 0,
the peer rank 1 runs the ``op_*`` functions below on request. Tests that need a process
to die or a fresh communicator start their own short-lived child.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import mmap
import multiprocessing as mp
import os
import select
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import (
    JOIN_TIMEOUT,
    PUSH_TRANSPORTS,
    QUEUED_SENDS,
    SMALL_RING,
    Peer,
    mem_available,
    receive_what_was_queued,
    run_pair,
    run_ranks,
    send_more_than_the_ring_holds,
    stop_process,
    wait_asleep_in_poll,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cma
from cma.errors import BufferError as CmaBufferError
from cma.errors import CmaError, CommBroken, InvalidRank, InvalidTag, PeerGone, TruncationError
from cma.transports import REGISTRY
from cma.wire import BARRIER_TAG

EAGER = cma.ChannelConfig().eager_limit  # the default configuration of cma.Pipe
FRAG = cma.ChannelConfig().frag_size
MiB = 1 << 20
FIXTURE_HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def digest(buf) -> str:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    return hashlib.sha256(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)).hexdigest()


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).copy()


def array_of(kind: str, nbytes: int, seed: int) -> np.ndarray:
    """An array of ``kind`` holding about ``nbytes`` random bytes."""
    dtype = np.dtype("float64" if kind == "2d" else kind)
    count = nbytes // dtype.itemsize
    raw = pattern(count * dtype.itemsize, seed)
    arr = raw.view(dtype)
    if kind == "2d":
        cols = 3
        arr = arr[: count - count % cols].reshape(-1, cols)
    assert arr.flags.c_contiguous
    return arr


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).view(np.uint8).tobytes() == \
        np.ascontiguousarray(b).view(np.uint8).tobytes()


# ------------------------------------------------------------------ what the peer runs


def op_echo(comm, shape, dtype, tag, recv_mode, send_mode):
    buf = np.empty(shape, dtype)
    st = cma.Status()
    if recv_mode == "Recv":
        comm.Recv(buf, source=0, tag=tag, status=st)
    else:
        comm.Irecv(buf, source=0, tag=tag).Wait(st)
    got = digest(buf)
    if send_mode == "Send":
        comm.Send(buf, dest=0, tag=tag)
    else:
        comm.Isend(buf, dest=0, tag=tag).Wait()
    return got, (st.Get_source(), st.Get_tag(), st.Get_count())


def op_echo_object(comm, tag):
    st = cma.Status()
    obj = comm.recv(source=0, tag=tag, status=st)
    comm.send(obj, dest=0, tag=tag)
    return _describe(obj), st.Get_count()


def _describe(obj):
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, digest(obj))
    if isinstance(obj, dict):
        return {k: _describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj).__name__, [_describe(v) for v in obj]
    return type(obj).__name__, repr(obj)[:200]


def op_send(comm, arrays, tag):
    for arr in arrays:
        comm.Send(arr, dest=0, tag=tag)


def op_send_object(comm, obj, tag):
    comm.send(obj, dest=0, tag=tag)


def op_send_tags(comm, items):
    """Send ``(tag, nbytes, seed)`` buffers in order, all with Isend, then wait for them."""
    reqs = [comm.Isend(pattern(n, seed), dest=0, tag=tag) for tag, n, seed in items]
    cma.Request.Waitall(reqs)


def op_recv_into(comm, capacity, tag, spec=None):
    """Receive one buffer (TruncationError reported, not raised); return what arrived."""
    buf = np.zeros(capacity, np.uint8)
    st = cma.Status()
    target = buf if spec is None else [buf.view(spec[1]), spec[0], spec[1]]
    try:
        comm.Recv(target, source=0, tag=tag, status=st)
    except TruncationError as exc:
        return ("truncated", exc.source, exc.tag, exc.nbytes, exc.capacity)
    return ("ok", st.Get_count(), st.Get_count(spec[1]) if spec else None, digest(buf),
            digest(buf[: st.Get_count()]))


def op_recv_bytes(comm, capacity, tag):
    buf = bytearray(capacity)
    st = cma.Status()
    comm.Recv(buf, source=0, tag=tag, status=st)
    return bytes(buf[: st.Get_count()])


def op_sendrecv(comm, nbytes, seed, kind):
    out = pattern(nbytes, seed)
    if kind == "buffer":
        buf = np.empty(nbytes + 10, np.uint8)
        st = cma.Status()
        comm.Sendrecv(out, 0, 12, buf, 0, 11, st)
        return digest(buf[: st.Get_count()])
    obj = comm.sendrecv({"from": 1, "data": out}, dest=0, sendtag=12, source=0, recvtag=11)
    return digest(obj["data"])


def op_requests(comm):
    a = pattern(100, 1)
    b = pattern(300_000, 2)
    reqs = [comm.Isend(a, 0, 1), comm.Isend(b, 0, 2), comm.isend({"c": 3}, 0, 3)]
    inbox = np.empty(200_000, np.uint8)
    reqs.append(comm.Irecv(inbox, 0, 4))
    cma.Request.Waitall(reqs)
    return digest(inbox)


def op_recv_after_go(comm, nbytes, tag):
    """Receive only once told to (tag + 1): a synchronous send to us must wait until then."""
    comm.recv(source=0, tag=tag + 1)
    buf = np.empty(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=tag)
    return digest(buf)


def op_isendrecv(comm, nbytes, tag):
    out = pattern(nbytes, 5)
    buf = np.empty(nbytes, np.uint8)
    st = cma.Status()
    comm.Isendrecv(out, 0, tag, buf, 0, tag).Wait(st)
    return digest(buf), (st.source, st.tag, st.count)


def op_waitany_partner(comm):
    comm.Send(pattern(50_000, 7), 0, 22)
    comm.recv(source=0, tag=23)  # the test saw Waitany return
    comm.Send(pattern(10, 8), 0, 21)


def op_barrier(comm, times=1, entered=None, after=None):
    """``times`` Barriers; returns when the first was entered (time.monotonic, which is
    CLOCK_MONOTONIC: comparable across processes).

    ``entered``: a file created just before entering, so that the test knows the peer is
    on its way in (a message would be drained with the barrier packet behind it).
    ``after``: (pid, tid) of the test's thread; enter only once it sleeps in its own Barrier.
    """
    if after is not None:
        wait_asleep_in_poll(*after, what="the test process's Barrier")
    if entered is not None:
        open(entered, "x").close()
    entered_at = time.monotonic()
    for _ in range(times):
        comm.Barrier()
    return entered_at


def op_stats(comm, nbytes, eager_sizes):
    comm.reset_stats()
    # posted before anything is sent, so that no eager message waits in a queue
    reqs = [comm.Irecv(np.empty(n, np.uint8), 0, 2) for n in eager_sizes]
    big = np.empty(nbytes, np.uint8)
    comm.Recv(big, 0, 1)
    cma.Request.Waitall(reqs)
    return comm.stats(), digest(big)


def op_stats_late(comm, eager_sizes):
    """Receive the last message first, so the others wait as unexpected."""
    # the sender starts on "ready": a command recv may drain what follows it in the ring
    comm.send("ready", 0, 5)
    comm.reset_stats()
    comm.Recv(np.empty(eager_sizes[-1], np.uint8), 0, 3)
    for n in eager_sizes[:-1]:
        comm.Recv(np.empty(n, np.uint8), 0, 2)
    return comm.stats()


def op_recv_one(comm, nbytes, tag):
    buf = np.empty(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=tag)
    return digest(buf)


def op_announce_then_recv(comm, nbytes, tag):
    """Say (tag ``tag``) that the receive begins, then receive one buffer."""
    comm.send("receiving", 0, tag)
    return op_recv_one(comm, nbytes, tag)


def op_collect(comm, stop_tag):
    """Receive whatever arrives until a message tagged ``stop_tag``: (tag, nbytes) in
    order, the stop message left out."""
    got = []
    buf = np.empty(4 * EAGER, np.uint8)  # room for the largest message the tests send here
    st = cma.Status()
    while True:
        comm.Recv(buf, 0, cma.ANY_TAG, st)
        if st.tag == stop_tag:
            return got
        got.append((st.tag, st.count))


def op_probe_partner(comm, sizes, tag):
    for i, n in enumerate(sizes):
        comm.Send(pattern(n, i), 0, tag)


def op_huge(comm, nbytes):
    buf = np.empty(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=5)
    ok = check_counting(buf)
    del buf
    return ok


def fill_counting(buf: np.ndarray) -> None:
    """uint64 0, 1, 2, ... then bytes i % 251 in the tail: cheap at any size, and position-aware."""
    words = buf.nbytes // 8
    step = 1 << 23
    w = buf[: words * 8].view(np.uint64)
    for lo in range(0, words, step):
        hi = min(words, lo + step)
        w[lo:hi] = np.arange(lo, hi, dtype=np.uint64)
    tail = buf[words * 8 :]
    tail[:] = np.arange(tail.size) % 251


def check_counting(buf: np.ndarray) -> bool:
    words = buf.nbytes // 8
    step = 1 << 23
    w = buf[: words * 8].view(np.uint64)
    for lo in range(0, words, step):
        hi = min(words, lo + step)
        if not np.array_equal(w[lo:hi], np.arange(lo, hi, dtype=np.uint64)):
            return False
    tail = buf[words * 8 :]
    return bool(np.array_equal(tail, np.arange(tail.size) % 251))


# ------------------------------------------------------------------ the issue's example


def issue_child(comm):
    # The issue has np.empty here; its sum then covers 7 MiB never written, which holds
    # garbage (NaN, say) in a forked child that reuses freed heap. Zeros keep the sum exact.
    buf = np.zeros(1 << 20)
    st = cma.Status()
    comm.Recv(buf, source=0, tag=7, status=st)
    comm.send({"sum": float(buf.sum()), "arr": buf[:10],
               "status": (st.Get_source(), st.Get_tag(), st.Get_count(), st.Get_count("d")),
               "tail_untouched": not buf[1 << 17 :].any()},
              dest=0, tag=8)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_issue_example(transport, context):
    issue_example(transport, context)


def test_issue_example_under_forkserver():
    """Python 3.14's default start method on Linux: the end travels pickled, as with spawn,
    so one transport covers it."""
    issue_example("auto", "forkserver")


def issue_example(transport, context):
    a, b = cma.Pipe(transport=transport)
    p = mp.get_context(context).Process(target=issue_child, args=(b,))
    try:
        p.start()
        b.close()
        a.Send(np.arange(1 << 17, dtype=float), dest=1, tag=7)
        reply = a.recv(source=1, tag=8)
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        stop_process(p)
        a.close()
    n = 1 << 17
    assert reply["sum"] == float(n * (n - 1) // 2)
    assert reply["arr"].dtype == np.float64
    assert np.array_equal(reply["arr"], np.arange(10, dtype=float))
    # Get_count is what was received (1 MiB), not the size of the receive buffer (8 MiB)
    assert reply["status"] == (0, 7, 1 << 20, 1 << 17)
    assert reply["tail_untouched"], "the receive wrote past the message"


# ------------------------------------------------------------------ round trips

EDGE_SIZES = sorted({0, 1, 7, 8, 8191, 8192, 8193, EAGER - 1, EAGER, EAGER + 1, FRAG - 1, FRAG,
                     FRAG + 1, 4 * FRAG + 12345, 20 * MiB})
KINDS = ["uint8", "int32", "float64", "complex128", "2d"]
MODES = ["Send", "Isend"]
RMODES = ["Recv", "Irecv"]


def roundtrip(peer: Peer, kind: str, nbytes: int, tag: int, modes: tuple[str, str, str, str],
              seed: int = 0) -> None:
    send_mode, child_recv, child_send, recv_mode = modes
    comm = peer.comm
    arr = array_of(kind, nbytes, seed)
    peer.start(op_echo, arr.shape, arr.dtype.str, tag, child_recv, child_send)
    back = np.empty(arr.shape, arr.dtype)
    st = cma.Status()
    if send_mode == "Send":
        comm.Send(arr, dest=1, tag=tag)
        req = None
    else:
        req = comm.Isend(arr, dest=1, tag=tag)
    if recv_mode == "Recv":
        comm.Recv(back, source=1, tag=tag, status=st)
    else:
        comm.Irecv(back, source=1, tag=tag).Wait(st)
    if req is not None:
        req.Wait()
    child_digest, child_status = peer.result()
    assert child_digest == digest(arr), "the peer received different bytes"
    assert child_status == (0, tag, arr.nbytes)
    assert (st.source, st.tag, st.Get_count()) == (1, tag, arr.nbytes)
    assert same_bytes(back, arr)


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURE_HC)
@given(
    nbytes=st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 3 * FRAG),
                     st.integers(0, 20 * MiB)),
    kind=st.sampled_from(KINDS),
    tag=st.integers(0, 2**31 - 1),
    modes=st.tuples(st.sampled_from(MODES), st.sampled_from(RMODES), st.sampled_from(MODES),
                    st.sampled_from(RMODES)),
    seed=st.integers(0, 1000),
)
def test_roundtrip_property(peer, nbytes, kind, tag, modes, seed):
    roundtrip(peer, kind, nbytes, tag, modes, seed)


def test_roundtrip_edge_sizes(peer):
    for i, nbytes in enumerate(EDGE_SIZES):
        modes = (MODES[i % 2], RMODES[(i // 2) % 2], MODES[(i + 1) % 2], RMODES[i % 2])
        roundtrip(peer, "uint8", nbytes, i, modes, seed=i)


def test_roundtrip_every_dtype(peer):
    for i, kind in enumerate(KINDS):
        for nbytes in (EAGER - 8, 3 * FRAG + 8):
            roundtrip(peer, kind, nbytes, 100 + i, ("Send", "Recv", "Isend", "Irecv"), seed=i)


@pytest.mark.parametrize("dtype", ["M8[us]", "m8[s]", ">i4", "f2", "?",
                                   "i4,f8"])  # no PEP 3118 code / byte order / structured
def test_roundtrip_other_dtypes(peer, dtype):
    comm = peer.comm
    for nbytes in (1000, 3 * EAGER):
        dt = np.dtype(dtype)
        arr = pattern(nbytes - nbytes % dt.itemsize, nbytes).view(dt)
        if dt == np.bool_:
            arr = arr.view(np.uint8) % 2 == 1
        peer.start(op_echo, arr.shape, dt.str if dt.names is None else dt.descr, 7, "Recv",
                   "Send")
        comm.Send(arr, dest=1, tag=7)
        back = np.empty_like(arr)
        comm.Recv(back, source=1, tag=7)
        child_digest, _ = peer.result()
        assert child_digest == digest(arr)
        assert same_bytes(back, arr)


def object_array_rank0(comm):
    outcome = []
    for call in (lambda: comm.Send(np.array([1, "a"], dtype=object), dest=1, tag=5),
                 lambda: comm.Irecv(np.empty(2, dtype=object), source=1, tag=6)):
        try:
            call()
            outcome.append("accepted")
        except CmaBufferError:
            outcome.append("BufferError")
    comm.send("done", dest=1, tag=7)
    return outcome


def object_array_rank1(comm):
    return comm.recv(source=0, tag=7)


def test_object_dtype_arrays_are_refused():
    """An object array holds pointers into its own process: sending or receiving its raw
    bytes is meaningless (and receiving them would corrupt the receiver's refcounts)."""
    outcome, _ = run_pair("shm", None, object_array_rank0, object_array_rank1, timeout=20)
    assert outcome == ["BufferError", "BufferError"]


def test_many_messages_keep_the_pipeline_counts_in_step(peer):
    """Rendezvous messages of odd sizes back to back: staging counts carry across messages."""
    comm = peer.comm
    sizes = [FRAG + 3, 5, 2 * FRAG - 1, EAGER + 1, 3 * FRAG + 17]
    arrays = [pattern(n, i) for i, n in enumerate(sizes)]
    peer.start(op_send, arrays, 9)
    for arr in arrays:
        back = np.empty(arr.size, np.uint8)
        comm.Recv(back, 1, 9)
        assert same_bytes(back, arr)
    peer.result()


# ------------------------------------------------------------------ object messages

OBJECTS = {
    "small-dict": {"a": np.arange(10, dtype=np.int16), "b": 3.5, "c": "text"},
    "large-dict": {
        "small": np.arange(100, dtype=np.float32),
        "at-limit": pattern(EAGER, 1),
        "above-limit": pattern(EAGER + 1, 2),
        "big": np.random.default_rng(3).standard_normal((700, 900)),
        "complex": (np.arange(50_000) * (1 + 2j)).astype(np.complex64),
        "fortran": np.asfortranarray(np.arange(60_000, dtype=np.int64).reshape(200, 300)),
        "strided": np.arange(40_000, dtype=np.int32)[::2],
        "empty": np.empty((0, 4), dtype=np.float64),
        "scalar": np.array(7, dtype=np.uint16),
    },
    "nested-lists": [[1, 2, [3, [4, [5, None]]]], ["x" * 20_000], [(1, 2), {"k": [b"v"]}]],
    "bytes-small": b"\x00\x01 hello",
    "bytes-large": bytes(range(256)) * 5000,
    "bytearray-large": bytearray(pattern(3 * FRAG, 4).tobytes()),
    "many-arrays": [np.full(EAGER + 8, i % 256, dtype=np.uint8) for i in range(1100)],
    "none": None,
}


def assert_same_object(got, want):
    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)
        if want.flags.f_contiguous and not want.flags.c_contiguous:
            assert got.flags.f_contiguous, "memory order lost"
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same_object(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_object(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("name", list(OBJECTS))
def test_object_round_trip(peer, name):
    if name == "many-arrays" and peer.transport == "shm":
        pytest.skip("the case is for more buffers than a copy call's IOV_MAX iovecs, which "
                    "shm's pipeline (staging fragments) has not; 2.3 GB each way, 25 s (CI's time)")
    obj = OBJECTS[name]
    comm = peer.comm
    peer.start(op_echo_object, 30)
    comm.send(obj, dest=1, tag=30)
    st = cma.Status()
    back = comm.recv(source=1, tag=30, status=st)
    seen, count = peer.result()
    assert seen == _describe(obj), "the peer unpickled something else"
    assert_same_object(back, obj)
    # Get_count of an object message: the pickle stream plus its out-of-band buffers
    assert st.source == 1 and st.tag == 30 and st.Get_count() > 0 and count > 0


def test_object_nonblocking(peer):
    comm = peer.comm
    obj = OBJECTS["large-dict"]
    peer.start(op_echo_object, 31)
    rreq = comm.irecv(source=1, tag=31)
    sreq = comm.isend(obj, dest=1, tag=31)
    results = cma.Request.waitall([sreq, rreq])
    assert results[0] is None
    assert_same_object(results[1], obj)
    peer.result()


# ------------------------------------------------------------------ buffers


def test_buffer_spec_typechar(peer):
    comm = peer.comm
    data = np.random.default_rng(5).standard_normal(3000)
    peer.start(op_echo, data.shape, "d", 40, "Recv", "Send")
    back = np.zeros(3000)
    comm.Send([data, "d"], dest=1, tag=40)
    comm.Recv([back, "d"], source=1, tag=40)
    peer.result()
    assert np.array_equal(back, data)


def test_buffer_spec_count(peer):
    comm = peer.comm
    data = np.arange(100, dtype=np.int32)
    peer.start(op_recv_into, 400, 41, (50, "i"))
    comm.Send([data, 10, "i"], dest=1, tag=41)  # only the first 10 elements go
    status, count, count_i, _, got = peer.result()
    assert (status, count, count_i) == ("ok", 40, 10)
    assert got == digest(data[:10])
    # a [buf, count, typechar] receive spec limits the capacity: 60 ints do not fit 50
    peer.start(op_recv_into, 400, 41, (50, "i"))
    comm.Send([data, 60, "i"], dest=1, tag=41)
    assert peer.result() == ("truncated", 0, 41, 240, 200)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "memoryview-2d"])
@pytest.mark.parametrize("nbytes", [100, 3 * EAGER + 12])
def test_bytes_like_buffers(peer, kind, nbytes):
    comm = peer.comm
    raw = pattern(nbytes, nbytes).tobytes()
    if kind == "bytes":
        buf = raw
    elif kind == "bytearray":
        buf = bytearray(raw)
    elif kind == "memoryview":
        buf = memoryview(bytearray(raw))
    else:
        buf = memoryview(np.frombuffer(raw, np.uint8).reshape(-1, 4).copy())
    peer.start(op_recv_bytes, nbytes + 5, 42)
    comm.Send(buf, dest=1, tag=42)
    assert peer.result() == raw
    # and back, into a bytearray, a memoryview of one and a writable NumPy array
    for target in (bytearray(nbytes), memoryview(bytearray(nbytes)), np.zeros(nbytes, np.uint8)):
        peer.start(op_send, [np.frombuffer(raw, np.uint8)], 43)
        comm.Recv(target, source=1, tag=43)
        peer.result()
        assert bytes(target) == raw


def _spec_base(kind: str, nbytes: int) -> Any:
    if kind == "ndarray":
        return np.zeros(nbytes, np.uint8)
    if kind == "bytearray":
        return bytearray(nbytes)
    mm = mmap.mmap(-1, nbytes)
    return mm


@pytest.mark.parametrize("kind", ["ndarray", "bytearray", "mmap"])
@pytest.mark.parametrize("call", ["Send", "Isend"])
def test_spec_list_rebuilt_each_call(peer, kind, call):
    """[buf, count, typechar] written inline is a new list each call: the view cached from
    an equal one serves it, a different count is honoured, and a bytearray or mmap is not
    left exported (it can be resized or closed after the call)."""
    comm = peer.comm
    base = _spec_base(kind, 64)
    send = getattr(comm, call)
    for count, seed in [(64, 1), (64, 2), (16, 3), (64, 4)]:
        memoryview(base)[:count] = pattern(count, seed).tobytes()
        peer.start(op_recv_bytes, 100, 44)
        request = send([base, count, "B"], 1, 44)
        if call == "Isend":
            request.Wait()
        assert peer.result() == pattern(count, seed).tobytes()
        peer.start(op_send, [pattern(count, seed + 10)], 45)
        target = np.zeros(count, np.uint8) if kind == "ndarray" else base
        comm.Recv([target, count, "B"], source=1, tag=45)
        peer.result()
        assert bytes(memoryview(target)[:count]) == pattern(count, seed + 10).tobytes()
    if kind == "bytearray":
        base.extend(b"more")  # no export of ours is left holding it
        # the same spec over the grown buffer: still its first 64 bytes (the cached whole
        # export must not become the 68-byte buffer)
        peer.start(op_recv_bytes, 100, 44)
        request = send([base, 64, "B"], 1, 44)
        if call == "Isend":
            request.Wait()
        assert peer.result() == bytes(base[:64])
    elif kind == "mmap":
        base.close()


@pytest.mark.parametrize("call", ["Send", "Isend", "Sendrecv", "Recv", "Irecv"])
def test_spec_list_over_a_bytearray_that_shrank_is_refused(peer, call):
    """The cached cut of a bytearray spec names bytes the buffer no longer has: the call
    refuses, as converting the spec afresh does, instead of moving the shorter rest."""
    comm = peer.comm
    base = bytearray(pattern(64, 1).tobytes())
    sending = call in ("Send", "Isend", "Sendrecv")
    if sending:
        peer.start(op_recv_bytes, 100, 44)
        comm.Send([base, 64, "B"], 1, 44)
    else:
        peer.start(op_send, [pattern(64, 2)], 45)
        comm.Recv([base, 64, "B"], source=1, tag=45)
    peer.result()
    del base[32:]
    spec = [base, 64, "B"]
    with pytest.raises(CmaBufferError, match="shrank"):
        if call == "Sendrecv":
            comm.Sendrecv(spec, 1, 44, np.zeros(8, np.uint8), 1, 45)
        else:
            getattr(comm, call)(spec, 1, 44 if sending else 45)
    with pytest.raises(CmaBufferError, match="asks for 64 bytes of a 32-byte buffer"):
        getattr(comm, "Send" if sending else "Recv")([bytearray(32), 64, "B"], 1, 44)


class _CudaArrayInterface:
    """An exporter of __cuda_array_interface__ only (mpi4py's tests fake GPU arrays so)."""

    def __init__(self, address: int, nbytes: int, readonly: bool = False) -> None:
        self.__cuda_array_interface__ = {"version": 0, "data": (address, readonly),
                                         "typestr": "|u1", "shape": (nbytes,)}


def test_cuda_array_interface_in_host_memory_is_taken_device_memory_refused():
    host = np.arange(16, dtype=np.uint8)
    view = cma.comm.send_view(_CudaArrayInterface(host.ctypes.data, 16))
    assert bytes(view) == host.tobytes()
    with pytest.raises(CmaBufferError, match="read-only"):
        cma.comm.recv_view(_CudaArrayInterface(host.ctypes.data, 16, readonly=True))
    with pytest.raises(CmaBufferError, match="device memory"):
        cma.comm.send_view(_CudaArrayInterface(4096, 16))  # mapped nowhere in this process


def test_spec_list_of_an_array_made_read_only_is_refused(peer):
    comm = peer.comm
    peer.start(op_send, [pattern(8, 1), pattern(8, 2)], 46)
    arr = np.zeros(8, np.uint8)
    comm.Recv([arr, 8, "B"], source=1, tag=46)
    arr.flags.writeable = False
    with pytest.raises(CmaBufferError, match="read-only"):
        comm.Recv([arr, 8, "B"], source=1, tag=46)
    comm.Recv(np.zeros(8, np.uint8), source=1, tag=46)
    peer.result()


# ------------------------------------------------------------------ matching and status


@pytest.mark.parametrize("nbytes", [0, 800, EAGER, 2 * EAGER, 2 * FRAG + 8])
def test_any_source_any_tag_status(peer, nbytes):
    comm = peer.comm
    peer.start(op_send_tags, [(77, nbytes, 1), (78, nbytes, 2)])
    buf = np.zeros(nbytes // 8 + 2)
    st = cma.Status()
    comm.Recv(buf, source=cma.ANY_SOURCE, tag=cma.ANY_TAG, status=st)
    assert (st.Get_source(), st.Get_tag(), st.Get_count()) == (1, 77, nbytes)
    assert st.Get_count("d") == nbytes // 8 and st.Get_count(np.float64) == nbytes // 8
    assert st.Get_elements("B") == nbytes
    assert buf.view(np.uint8)[:nbytes].tobytes() == pattern(nbytes, 1).tobytes()
    st2 = cma.Status()
    comm.Irecv(buf, source=cma.ANY_SOURCE, tag=cma.ANY_TAG).Wait(st2)
    assert (st2.source, st2.tag, st2.count) == (1, 78, nbytes)
    peer.result()


def test_non_overtaking_many_messages(peer):
    comm = peer.comm
    sizes = [(i * 7919) % 20_000 if i % 5 else 3 * EAGER + i for i in range(150)]
    peer.start(op_send_tags, [(5, n, i) for i, n in enumerate(sizes)])
    buf = np.empty(4 * EAGER, np.uint8)
    st = cma.Status()
    for i, n in enumerate(sizes):
        comm.Recv(buf, source=1, tag=5, status=st)
        assert st.count == n
        assert buf[:n].tobytes() == pattern(n, i).tobytes(), f"message {i} out of order"
    peer.result()


def test_non_overtaking_preposted_receives(peer):
    comm = peer.comm
    sizes = [10, 20_000, 0, EAGER, EAGER + 1, 5, 3 * EAGER, 3]
    bufs = [np.zeros(4 * EAGER, np.uint8) for _ in sizes]
    reqs = [comm.Irecv(b, source=cma.ANY_SOURCE, tag=cma.ANY_TAG) for b in bufs]
    peer.start(op_send_tags, [(6, n, i) for i, n in enumerate(sizes)])
    statuses = [cma.Status() for _ in sizes]
    cma.Request.Waitall(reqs, statuses)
    for i, n in enumerate(sizes):
        assert statuses[i].count == n
        assert bufs[i][:n].tobytes() == pattern(n, i).tobytes()
    peer.result()


def test_receive_for_later_tag_leaves_earlier_unexpected(peer):
    comm = peer.comm
    peer.start(op_send_tags, [(1, 100, 1), (2, 200_000, 2), (1, 300, 3)])
    buf = np.empty(200_000, np.uint8)
    st = cma.Status()
    comm.Recv(buf, 1, 2, st)
    assert st.count == 200_000 and buf.tobytes() == pattern(200_000, 2).tobytes()
    comm.Recv(buf, 1, cma.ANY_TAG, st)
    assert (st.tag, st.count) == (1, 100)
    comm.Recv(buf, 1, 1, st)
    assert (st.tag, st.count) == (1, 300)
    peer.result()


@pytest.mark.parametrize("nbytes", [100, 3 * FRAG])
def test_probe_then_receive(peer, nbytes):
    comm = peer.comm
    assert not comm.Iprobe(1, 60)
    peer.start(op_probe_partner, [nbytes], 60)
    st = cma.Status()
    assert comm.Probe(source=1, tag=60, status=st) is True
    assert (st.source, st.tag, st.Get_count()) == (1, 60, nbytes)
    st2 = cma.Status()
    assert comm.Iprobe(cma.ANY_SOURCE, cma.ANY_TAG, st2)
    assert (st2.source, st2.tag, st2.count) == (1, 60, nbytes)
    assert not comm.Iprobe(1, 61)
    assert comm.Probe(cma.ANY_SOURCE, cma.ANY_TAG) is True  # still there
    buf = np.empty(nbytes, np.uint8)
    comm.Recv(buf, 1, 60)
    assert buf.tobytes() == pattern(nbytes, 0).tobytes()
    peer.result()
    assert not comm.Iprobe(1, 60)


def test_iprobe_eventually_true(peer):
    comm = peer.comm
    peer.start(op_probe_partner, [10], 62)
    deadline = time.monotonic() + 20
    st = cma.Status()
    while not comm.Iprobe(1, 62, st):
        assert time.monotonic() < deadline, "Iprobe never saw the message"
        time.sleep(0.001)
    assert st.count == 10
    comm.Recv(bytearray(10), 1, 62)
    peer.result()


def op_echo_objects(comm, count, tag):
    for _ in range(count):
        comm.send(comm.recv(source=0, tag=tag), dest=0, tag=tag)


SMALL_OBJECTS = [1, "text", {"a": [1, 2.5, None]}, np.arange(10), b"x" * 1000, (), 10**30, None, True,
                 2.5, 1j]


def test_small_objects_go_through_the_ring_without_the_engine(peer, monkeypatch):
    """send and recv of an object whose pickle fits one eager packet use the ring as Send
    and Recv do, making no request and posting no receive (through the engine a small
    object took 19 us one-way against mpi4py's 2: docs/api.md, "Objects" under "Object messages")."""
    comm = peer.comm
    peer.start(op_echo_objects, len(SMALL_OBJECTS), 70)

    def general(*args, **kwargs):
        raise AssertionError("a small object took the general path")

    st = cma.Status()
    with monkeypatch.context() as patch:
        patch.setattr(comm, "make_request", general)
        for obj in SMALL_OBJECTS:
            comm.send(obj, 1, 70)
            back = comm.recv(source=1, tag=70, status=st)
            assert type(back) is type(obj)
            assert np.array_equal(back, obj) if isinstance(obj, np.ndarray) else back == obj
            assert (st.source, st.tag, st.count) == (1, 70, comm._pickle(obj)[0].nbytes)
    peer.result()


@pytest.mark.parametrize("nbytes", [0, 100, 200 * 1024])
def test_a_probed_message_stays_for_the_receives_fast_path(peer, monkeypatch, nbytes):
    """Probe reports an eager message at the head of the ring from there, so that the Recv
    after it takes it on its fast path (a Probe-then-Recv took 18 us through the engine
    against mpi4py's 2: docs/api.md, "Objects" under "Object messages"). 200 KiB: among
    the largest sizes that go eager with every transport (from 256 KiB a direct
    rendezvous's RTS, which a Probe matches into the engine: test_overlap.py)."""
    comm = peer.comm
    general = []
    real = comm.general_recv
    monkeypatch.setattr(comm, "general_recv", lambda *a: general.append(a) or real(*a))
    peer.start(op_probe_partner, [nbytes], 63)
    st = cma.Status()
    assert comm.Probe(1, 63, st) is True
    assert (st.source, st.tag, st.count) == (1, 63, nbytes)
    buf = np.empty(nbytes, np.uint8)
    comm.Recv(buf, st.source, st.tag)
    peer.result()
    assert buf.tobytes() == pattern(nbytes, 0).tobytes()
    assert not general, "the probed message went through the engine"


# ------------------------------------------------------------------ truncation


@pytest.mark.parametrize("nbytes", [1000, EAGER, 2 * EAGER, 2 * FRAG + 1])
@pytest.mark.parametrize("how", ["Recv", "Irecv"])
def test_truncation_at_receiver(peer, nbytes, how):
    comm = peer.comm
    peer.start(op_send_tags, [(3, nbytes, 1), (3, 16, 2)])
    small = np.zeros(nbytes // 2, np.uint8)
    with pytest.raises(TruncationError) as info:
        if how == "Recv":
            comm.Recv(small, source=1, tag=3)
        else:
            comm.Irecv(small, source=1, tag=3).Wait()
    err = info.value
    assert (err.source, err.tag, err.nbytes, err.capacity) == (1, 3, nbytes, nbytes // 2)
    # consumed: the next receive gets the next message
    buf = np.zeros(100, np.uint8)
    st = cma.Status()
    comm.Recv(buf, source=1, tag=3, status=st)
    assert st.count == 16 and buf[:16].tobytes() == pattern(16, 2).tobytes()
    peer.result()


@pytest.mark.parametrize("nbytes", [1000, 2 * EAGER, 2 * FRAG + 1])
def test_truncation_releases_the_sender(peer, nbytes):
    comm = peer.comm
    data = pattern(nbytes, 4)
    peer.start(op_recv_into, nbytes - 1, 4)
    comm.Send(data, dest=1, tag=4)  # returns although the receiver could not take it
    assert peer.result() == ("truncated", 0, 4, nbytes, nbytes - 1)
    peer.start(op_recv_into, nbytes, 4)
    comm.Send(data, dest=1, tag=4)
    status, count, _, _, got = peer.result()
    assert (status, count, got) == ("ok", nbytes, digest(data))


# ------------------------------------------------------------------ errors

ERROR_CASES = {
    "Send-dest-2": (InvalidRank, lambda c: c.Send(np.zeros(4), dest=2)),
    "Send-dest-negative": (InvalidRank, lambda c: c.Send(np.zeros(4), dest=-5)),
    "Send-dest-large-buffer": (InvalidRank, lambda c: c.Send(np.zeros(EAGER), dest=7)),
    "Isend-dest": (InvalidRank, lambda c: c.Isend(np.zeros(4), dest=2)),
    "send-dest": (InvalidRank, lambda c: c.send({"a": 1}, dest=3)),
    "isend-dest": (InvalidRank, lambda c: c.isend({"a": 1}, dest=-7)),
    "Recv-source": (InvalidRank, lambda c: c.Recv(np.zeros(4), source=2)),
    "Recv-source-negative": (InvalidRank, lambda c: c.Recv(np.zeros(4), source=-9)),
    "Irecv-source": (InvalidRank, lambda c: c.Irecv(np.zeros(4), source=5)),
    "recv-source": (InvalidRank, lambda c: c.recv(source=2)),
    "Probe-source": (InvalidRank, lambda c: c.Probe(source=2)),
    "Iprobe-source": (InvalidRank, lambda c: c.Iprobe(source=2)),
    "Send-tag": (InvalidTag, lambda c: c.Send(np.zeros(4), dest=1, tag=-5)),
    "Send-tag-any": (InvalidTag, lambda c: c.Send(np.zeros(4), dest=1, tag=cma.ANY_TAG)),
    "Send-tag-large-buffer": (InvalidTag, lambda c: c.Send(np.zeros(EAGER), dest=1, tag=-3)),
    "Send-tag-float": (InvalidTag, lambda c: c.Send(np.zeros(4), dest=1, tag=1.5)),
    "Isend-tag": (InvalidTag, lambda c: c.Isend(np.zeros(4), dest=1, tag=-2)),
    "send-tag": (InvalidTag, lambda c: c.send(1, dest=1, tag=-1)),
    "Recv-tag": (InvalidTag, lambda c: c.Recv(np.zeros(4), source=1, tag=-5)),
    "Irecv-tag": (InvalidTag, lambda c: c.Irecv(np.zeros(4), source=1, tag=-5)),
    "recv-tag": (InvalidTag, lambda c: c.recv(source=1, tag=-3)),
    "Probe-tag": (InvalidTag, lambda c: c.Probe(source=1, tag=-4)),
    "Send-noncontiguous": (CmaBufferError, lambda c: c.Send(np.arange(100.0)[::2], dest=1)),
    "Send-noncontiguous-2d": (CmaBufferError,
                              lambda c: c.Send(np.zeros((50, 50))[:, :10], dest=1)),
    "Isend-noncontiguous": (CmaBufferError, lambda c: c.Isend(np.arange(100.0)[::3], dest=1)),
    "Send-not-a-buffer": (CmaBufferError, lambda c: c.Send(12345, dest=1)),
    "Recv-bytes": (CmaBufferError, lambda c: c.Recv(b"0123456789", source=1)),
    "Irecv-bytes": (CmaBufferError, lambda c: c.Irecv(b"0123456789", source=1)),
    "Recv-readonly-array": (CmaBufferError, lambda c: c.Recv(_readonly(), source=1)),
    "Recv-noncontiguous": (CmaBufferError, lambda c: c.Recv(np.zeros(100)[::2], source=1)),
    "Sendrecv-readonly": (CmaBufferError,
                          lambda c: c.Sendrecv(b"", cma.PROC_NULL, 0, b"readonly", 1, 0)),
    # (the receive's arguments are refused before anything is sent: the peer fixture
    # checks that no message reached the peer)
    "Sendrecv-source": (InvalidRank, lambda c: c.Sendrecv(np.zeros(4), 1, 0, np.zeros(4), 2, 0)),
    "Sendrecv-recvtag": (InvalidTag, lambda c: c.Sendrecv(np.zeros(4), 1, 0, np.zeros(4), 1, -5)),
    "Sendrecv-recvtag-float": (InvalidTag,
                               lambda c: c.Sendrecv(b"ab", 1, 0, bytearray(2), 1, 1.0)),
    "Sendrecv-source-float": (InvalidRank,
                              lambda c: c.Sendrecv(b"ab", 1, 0, bytearray(2), 1.0, 0)),
    "spec-too-long": (CmaBufferError, lambda c: c.Send([np.zeros(4), 10, "d"], dest=1)),
    "spec-bad-type": (CmaBufferError, lambda c: c.Send([np.zeros(4), 2, "no-such"], dest=1)),
    "spec-bad-length": (CmaBufferError, lambda c: c.Send([np.zeros(4), 1, "d", 0], dest=1)),
}


def _readonly() -> np.ndarray:
    arr = np.zeros(10)
    arr.flags.writeable = False
    return arr


@pytest.mark.parametrize("call", ["Recv", "Irecv"])
def test_array_made_read_only_after_a_receive_is_refused(peer, call):
    """The view kept from the first receive must not let a later one write into it."""
    comm = peer.comm
    peer.start(op_send, [pattern(8, 1), pattern(8, 2)], 6)
    receive = getattr(comm, call)
    arr = np.zeros(8, np.uint8)
    first = receive(arr, source=1, tag=6)
    if call == "Irecv":
        first.Wait()
    assert arr.tobytes() == pattern(8, 1).tobytes()
    arr.flags.writeable = False
    with pytest.raises(CmaBufferError, match="read-only"):
        receive(arr, source=1, tag=6)
    assert arr.tobytes() == pattern(8, 1).tobytes()
    second = np.zeros(8, np.uint8)
    comm.Recv(second, source=1, tag=6)  # the refused receive left the message alone
    assert second.tobytes() == pattern(8, 2).tobytes()
    peer.result()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_raised_at_once(peer, case):
    exc_type, call = ERROR_CASES[case]
    t0 = time.monotonic()
    with pytest.raises(exc_type):
        call(peer.comm)
    assert time.monotonic() - t0 < 2.0
    assert not peer.comm.Iprobe()


def peer_blocked_in_barrier(peer, entered) -> None:
    """Wait until the peer, running op_barrier(entered=entered), sleeps in its Barrier: its
    barrier packet is in our ring then (nothing here has read the ring meanwhile)."""
    deadline = time.monotonic() + 10
    while not os.path.exists(entered):
        assert time.monotonic() < deadline, "the peer did not start its Barrier within 10 s"
        time.sleep(0.001)  # (a polling interval)
    wait_asleep_in_poll(peer.pid, what="the peer's Barrier")


def test_negative_tag_receive_cannot_take_an_internal_message(peer, tmp_path):
    """A Recv with an invalid (negative) tag must raise, even with a barrier packet waiting
    in the ring, where the Recv's fast path looks first."""
    comm = peer.comm
    entered = tmp_path / "entered"
    peer.start(op_barrier, 1, entered)
    peer_blocked_in_barrier(peer, entered)
    with pytest.raises(InvalidTag):
        comm.Recv(bytearray(8), source=1, tag=BARRIER_TAG)
    comm.Barrier()
    peer.result()


def test_numpy_integer_tag_treated_alike_at_any_size(peer):
    """np.int64 tags: eager and rendezvous sends must agree (mpi4py accepts any __index__)."""
    comm = peer.comm
    peer.start(op_collect, 99)
    outcome = []
    sizes = (16, 2 * EAGER)
    for n in sizes:
        try:
            comm.Send(np.zeros(n, np.uint8), dest=1, tag=np.int64(3))
            outcome.append("sent")
        except InvalidTag:
            outcome.append("InvalidTag")
    comm.Send(b"", dest=1, tag=99)  # all that was sent has arrived before this
    got = peer.result()
    assert got == [(3, n) for n, o in zip(sizes, outcome, strict=True) if o == "sent"]
    assert outcome[0] == outcome[1], f"eager and rendezvous disagree: {outcome}"


# ------------------------------------------------------------------ PROC_NULL


def test_proc_null(peer):
    comm = peer.comm
    null = cma.PROC_NULL
    comm.Send(np.ones(10), dest=null, tag=3)
    comm.Send(np.ones(100_000), dest=null)
    comm.Isend(np.ones(10), dest=null).Wait()
    comm.send({"x": 1}, dest=null)
    assert comm.isend({"x": 1}, dest=null).wait() is None
    buf = np.full(4, 9.0)
    st = cma.Status()
    comm.Recv(buf, source=null, tag=5, status=st)
    assert (st.source, st.tag, st.Get_count()) == (null, cma.ANY_TAG, 0)
    assert np.array_equal(buf, np.full(4, 9.0))
    st = cma.Status()
    comm.Irecv(buf, source=null).Wait(st)
    assert st.source == null and st.count == 0
    st = cma.Status()
    assert comm.Iprobe(source=null, status=st) and st.source == null
    assert comm.Probe(source=null) is True
    comm.Sendrecv(np.ones(3), null, 0, buf, null, 0)
    st = cma.Status()
    comm.recv(source=null, status=st)
    assert (st.source, st.count) == (null, 0)
    # nothing reached the peer (checked after the test by the peer fixture)


def test_object_receive_from_proc_null_is_none(peer):
    """As in mpi4py: ``comm.recv(source=MPI.PROC_NULL)`` returns None."""
    comm = peer.comm
    assert comm.recv(source=cma.PROC_NULL) is None
    assert comm.irecv(source=cma.PROC_NULL).wait() is None
    assert cma.Request.waitall([comm.irecv(source=cma.PROC_NULL)]) == [None]


# ------------------------------------------------------------------ combined calls


@pytest.mark.parametrize("nbytes", [100, 3 * FRAG + 5])
def test_sendrecv(peer, nbytes):
    comm = peer.comm
    peer.start(op_sendrecv, nbytes, 2, "buffer")
    out = pattern(nbytes, 1)
    buf = np.empty(nbytes + 10, np.uint8)
    st = cma.Status()
    comm.Sendrecv(out, 1, 11, buf, 1, 12, st)
    assert (st.source, st.tag, st.count) == (1, 12, nbytes)
    assert buf[:nbytes].tobytes() == pattern(nbytes, 2).tobytes()
    assert peer.result() == digest(out)


def op_sendrecv_many(comm, times, nbytes):
    out, buf = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    for i in range(times):
        out[:] = i % 256
        comm.Sendrecv(out, 0, 13, buf, 0, 14)
        assert (buf == (i + 7) % 256).all(), i


@pytest.mark.parametrize("data", ["array", "bytes", "bytearray", "spec", "bytearray spec"])
def test_an_eager_sendrecv_makes_no_request(peer, monkeypatch, data):
    """A Sendrecv whose message goes into the ring at once has nothing to wait for: it
    makes no request (a request cost ~1.3 us of a ~10 us Sendrecv here, docs/architecture.md
    "The eager fast path"), also given buffer specs written inline, ``[buf, n, "B"]``
    both ways (they made one until 2026-11-28)."""
    comm = peer.comm

    def no_request(*args):
        raise AssertionError("Sendrecv made a request for an eager message")

    peer.start(op_sendrecv_many, 50, 64)
    buf = np.empty(64, np.uint8)
    with monkeypatch.context() as patch:
        patch.setattr(comm, "make_request", no_request)
        for i in range(50):
            fill = np.full(64, (i + 7) % 256, np.uint8)
            out = {"array": fill, "bytes": fill.tobytes(), "bytearray": bytearray(fill.tobytes()),
                   "spec": [fill, 64, "B"], "bytearray spec": [bytearray(fill.tobytes()), 64, "B"]
                   }[data]
            comm.Sendrecv(out, 1, 14, [buf, 64, "B"] if "spec" in data else buf, 1, 13)
            assert (buf == i % 256).all(), i
    peer.result()


def test_a_receive_spec_made_read_only_is_refused_by_sendrecv_before_sending(peer):
    """Sendrecv remembers a receive spec as Recv does; the array made read-only since is
    refused before the message goes out (the peer fixture checks that none did)."""
    comm = peer.comm
    peer.start(op_sendrecv_many, 1, 8)
    buf = np.zeros(8, np.uint8)
    comm.Sendrecv(np.full(8, 7, np.uint8), 1, 14, [buf, 8, "B"], 1, 13)
    peer.result()
    buf.flags.writeable = False
    with pytest.raises(CmaBufferError, match="read-only"):
        comm.Sendrecv(np.full(8, 8, np.uint8), 1, 14, [buf, 8, "B"], 1, 13)


def op_send_late(comm, seconds, nbytes, tag):
    time.sleep(seconds)  # (the scenario: the receiver is waiting by then)
    comm.Send(pattern(nbytes, 3), 0, tag)


def test_a_late_message_is_taken_by_the_fast_path_when_ranks_outnumber_cores(peer, monkeypatch):
    """With more ranks than cores, a Recv that finds its ring empty yields the CPU until
    its peer's packet comes, then takes it as the fast path does: the engine's receive
    cost 16-17 us here against 2.7 (docs/architecture.md, "Late messages")."""
    comm = peer.comm
    progress = comm._progress
    monkeypatch.setattr(progress, "oversubscribed", True)
    monkeypatch.setattr(comm, "_fast_spins", 0)
    yields, general = [], []
    real_yield = os.sched_yield
    real_general = comm.general_recv
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1) or real_yield())
    monkeypatch.setattr(comm, "general_recv", lambda *a: general.append(a) or real_general(*a))
    peer.start(op_send_late, 0.2, 64, 15)
    buf = np.empty(64, np.uint8)
    comm.Recv(buf, 1, 15)
    peer.result()
    assert buf.tobytes() == pattern(64, 3).tobytes()
    assert yields, "the receive did not wait (the message came first): no late message"
    assert not general, "the late message went through the engine"


@pytest.mark.parametrize("nbytes", [100, 3 * FRAG + 5])
def test_sendrecv_objects(peer, nbytes):
    comm = peer.comm
    peer.start(op_sendrecv, nbytes, 2, "object")
    out = pattern(nbytes, 1)
    st = cma.Status()
    obj = comm.sendrecv({"from": 0, "data": out}, dest=1, sendtag=11, source=1, recvtag=12,
                        status=st)
    assert obj["from"] == 1 and obj["data"].tobytes() == pattern(nbytes, 2).tobytes()
    assert (st.source, st.tag) == (1, 12)
    assert peer.result() == digest(out)


def test_waitall_and_waitall_objects(peer):
    comm = peer.comm
    peer.start(op_requests)
    a, b = np.empty(100, np.uint8), np.empty(300_000, np.uint8)
    out = pattern(200_000, 9)
    reqs = [comm.Irecv(a, 1, 1), comm.Irecv(b, 1, 2), comm.Isend(out, 1, 4)]
    statuses = [cma.Status() for _ in reqs]
    assert cma.Request.Waitall(reqs, statuses) is True
    assert [(s.source, s.tag, s.count) for s in statuses[:2]] == [(1, 1, 100), (1, 2, 300_000)]
    assert a.tobytes() == pattern(100, 1).tobytes() and b.tobytes() == pattern(300_000, 2).tobytes()
    assert cma.Request.waitall([comm.irecv(source=1, tag=3)]) == [{"c": 3}]
    assert peer.result() == digest(out)


def test_testall(peer):
    comm = peer.comm
    a, b = np.empty(100, np.uint8), np.empty(300_000, np.uint8)
    reqs = [comm.Irecv(a, 1, 1), comm.Irecv(b, 1, 2), comm.irecv(source=1, tag=3)]
    assert cma.Request.Testall(reqs) is False  # nothing sent yet
    assert cma.Request.testall(reqs) == (False, None)
    peer.start(op_requests)
    sreq = comm.Isend(pattern(200_000, 9), 1, 4)
    deadline = time.monotonic() + 60
    while True:
        flag, results = cma.Request.testall(reqs)
        if flag:
            break
        assert time.monotonic() < deadline, "testall never completed"
    assert results == [None, None, {"c": 3}]
    assert cma.Request.Testall(reqs) is True
    sreq.Wait()
    assert b.tobytes() == pattern(300_000, 2).tobytes()
    peer.result()


def test_waitany(peer):
    comm = peer.comm
    small, big = np.empty(10, np.uint8), np.empty(50_000, np.uint8)
    reqs = [comm.Irecv(small, 1, 21), comm.Irecv(big, 1, 22)]
    peer.start(op_waitany_partner)
    st = cma.Status()
    assert cma.Request.Waitany(reqs, st) == 1
    assert (st.tag, st.count) == (22, 50_000)
    assert big.tobytes() == pattern(50_000, 7).tobytes()
    comm.send("go", dest=1, tag=23)
    reqs[0].Wait()
    assert small.tobytes() == pattern(10, 8).tobytes()
    peer.result()
    # waitany over object receives returns the index and the object
    peer.start(op_echo_object, 24)
    r = [comm.irecv(source=1, tag=25), comm.irecv(source=1, tag=24)]
    comm.send([1, 2, 3], dest=1, tag=24)
    assert cma.Request.waitany(r) == (1, [1, 2, 3])
    peer.result()
    peer.call(op_send_object, "late", 25)
    assert r[0].wait() == "late"


@pytest.mark.parametrize("nbytes", [0, 100, 3 * FRAG + 5])
def test_issend_completes_only_once_received(peer, nbytes):
    comm = peer.comm
    out = pattern(nbytes, 3)
    peer.start(op_recv_after_go, nbytes, 40)
    req = comm.Issend(out, 1, 40)
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        assert not req.Test(), "an Issend completed before its receive was posted"
    comm.send("go", 1, 41)
    req.Wait()
    assert peer.result() == digest(out)
    peer.start(op_recv_after_go, 0, 42)
    comm.send("go", 1, 43)
    comm.Ssend(b"", 1, 42)
    peer.result()


def test_ssend_objects(peer):
    comm = peer.comm
    peer.start(op_echo_object, 44)
    comm.ssend({"x": pattern(50, 1)}, 1, 44)
    assert digest(comm.recv(source=1, tag=44)["x"]) == digest(pattern(50, 1))
    peer.result()
    assert comm.issend("x", cma.PROC_NULL).wait() is None


@pytest.mark.parametrize("nbytes", [100, 3 * MiB])
def test_bsend_returns_at_once_with_a_copy(peer, nbytes):
    comm = peer.comm
    out = pattern(nbytes, 4)
    expected = digest(out)
    comm.Bsend(out, 1, 45)  # returns before the peer even receives
    out[:] = 0
    assert peer.call(op_recv_one, nbytes, 45) == expected
    comm.ibsend({"o": 1}, 1, 46).Wait()
    assert peer.call(op_echo_object, 46)[0] == {"o": ("int", "1")}
    assert comm.recv(source=1, tag=46) == {"o": 1}


@pytest.mark.parametrize("nbytes", [100, 3 * MiB])
def test_isendrecv(peer, nbytes):
    comm = peer.comm
    peer.start(op_isendrecv, nbytes, 47)
    out = pattern(nbytes, 6)
    buf = np.empty(nbytes, np.uint8)
    st = cma.Status()
    assert comm.Isendrecv(out, 1, 47, buf, 1, 47).Wait(st)
    assert digest(buf) == digest(pattern(nbytes, 5)) and (st.source, st.tag, st.count) == (1, 47, nbytes)
    assert peer.result() == (digest(out), (0, 47, nbytes))
    same = pattern(64, 8)
    peer.start(op_isendrecv, 64, 48)
    comm.Isendrecv_replace(same, 1, 48, 1, 48).Wait()
    assert digest(same) == digest(pattern(64, 5))
    peer.result()


@pytest.mark.parametrize("nbytes", [10, 3 * MiB])
def test_matched_probe(peer, nbytes):
    comm = peer.comm
    peer.start(op_send_tags, [(49, nbytes, 1), (49, nbytes, 2)])  # both sent before either is received
    st = cma.Status()
    message = comm.Mprobe(1, 49, st)
    assert message and (st.source, st.tag, st.count) == (1, 49, nbytes)
    second = np.empty(nbytes, np.uint8)
    comm.Recv(second, 1, 49)  # the probed message is no longer for any receive
    assert digest(second) == digest(pattern(nbytes, 2))
    first = np.empty(nbytes, np.uint8)
    message.Recv(first)
    assert not message and digest(first) == digest(pattern(nbytes, 1))
    peer.result()
    with pytest.raises(CmaError, match="received already"):
        message.Recv(first)
    assert comm.Improbe(1, 49) is None
    peer.call(op_send_object, ("hello", 1), 50)
    found = comm.improbe(1, 50)
    assert found is not None and found.recv() == ("hello", 1)
    assert comm.Mprobe(cma.PROC_NULL).recv() is None


@pytest.mark.parametrize("who_is_late", ["peer", "us"])
def test_barrier(peer, who_is_late, tmp_path):
    """The Barrier returns only once the peer has entered its own, whichever comes first."""
    comm = peer.comm
    if who_is_late == "peer":  # it enters once we sleep in ours
        peer.start(op_barrier, 1, None, (os.getpid(), threading.get_native_id()))
        comm.Barrier()
        returned_at = time.monotonic()
        assert returned_at >= peer.result(), "Barrier returned before the peer entered"
    else:  # its barrier packet waits for us
        entered = tmp_path / "entered"
        peer.start(op_barrier, 1, entered)
        peer_blocked_in_barrier(peer, entered)
        # no user message for Iprobe, which moves the packet out of the ring: the Barrier
        # then finds it arrived before its receive was posted
        assert not comm.Iprobe(1, cma.ANY_TAG)
        comm.Barrier()
        peer.result()
    peer.start(op_barrier, 20)
    for _ in range(20):
        comm.barrier()
    peer.result()


# ------------------------------------------------------------------ statistics


def test_stats_count_copies(peer, transport):
    comm = peer.comm
    nbytes = 4 * FRAG + 100
    eager_sizes = [100, 200, EAGER]
    data = pattern(nbytes, 1)
    peer.start(op_stats, nbytes, eager_sizes)
    comm.reset_stats()
    comm.Send(data, 1, 1)
    comm.Send(np.zeros(eager_sizes[0], np.uint8), 1, 2)  # eager fast path
    comm.Isend(np.zeros(eager_sizes[1], np.uint8), 1, 2).Wait()  # straight into the ring too
    # (a blocking Send this large is pulled instead: test_direct.py)
    comm.Isend(bytes(eager_sizes[2]), 1, 2).Wait()
    mine = comm.stats()
    theirs, got = peer.result()
    assert got == digest(data)
    for side in (mine, theirs):
        assert side["eager"]["messages"] == 3
        assert side["eager"]["bytes"] == sum(eager_sizes)
        assert side["eager"]["user_copies"] == 1.0  # nothing waited in a queue
    if transport == "shm":
        for side in (mine, theirs):
            assert side["shm"]["messages"] == 1
            assert side["shm"]["bytes"] == nbytes
            assert side["shm"]["user_copies"] == 1.0
            assert side["shm"]["kernel_copies"] == 0.0
    elif transport != "auto":
        # a single-copy transport: the receiver copied, and counted it
        assert theirs[transport]["messages"] == 1 and theirs[transport]["bytes"] == nbytes
        assert theirs[transport]["user_copies"] == 0.0


def test_stats_count_the_copy_of_a_message_that_waited(peer):
    """An eager message that arrives before its receive is copied out of the ring to
    wait, then again into the buffer: the receiver counts both copies."""
    comm = peer.comm
    eager_sizes = [1000, 3000, 500]
    peer.start(op_stats_late, eager_sizes)
    assert comm.recv(source=1, tag=5) == "ready"
    comm.reset_stats()
    for n in eager_sizes[:-1]:
        comm.Send(np.ones(n, np.uint8), 1, 2)
    comm.Send(np.ones(eager_sizes[-1], np.uint8), 1, 3)
    theirs = peer.result()["eager"]
    waited = sum(eager_sizes[:-1])
    assert theirs["messages"] == 3 and theirs["bytes"] == sum(eager_sizes)
    assert theirs["user_copies"] == pytest.approx((2 * waited + eager_sizes[-1]) / sum(eager_sizes))
    assert comm.stats()["eager"]["user_copies"] == 1.0


@pytest.mark.parametrize("order", ["send-first", "recv-first"])
def test_stats_count_a_message_to_ourselves_once_with_both_copies(peer, order):
    comm = peer.comm
    data = pattern(1000, 3)
    got = np.empty_like(data)
    comm.reset_stats()
    if order == "send-first":
        comm.Send(data, comm.rank, 4)
        comm.Recv(got, comm.rank, 4)
    else:
        req = comm.Irecv(got, comm.rank, 4)
        comm.Send(data, comm.rank, 4)
        req.Wait()
    assert np.array_equal(got, data)
    eager = comm.stats()["eager"]
    assert (eager["messages"], eager["bytes"], eager["user_copies"]) == (1, 1000, 2.0)


# ------------------------------------------------------------------ liveness


def gone_child(comm, mode, exit_now):
    comm.send("ready", dest=0, tag=1)
    if mode == "rendezvous":
        comm.Isend(np.ones(4 * FRAG, np.uint8), dest=0, tag=2)  # its RTS, into rank 0's ring
    else:
        exit_now.wait(JOIN_TIMEOUT)  # set once rank 0 sleeps in the call (or gave up on it)
    os._exit(0)


def wait_exited(pid: int, timeout: float = JOIN_TIMEOUT) -> None:
    """Wait until process ``pid`` has exited (its pidfd is readable), without reaping it."""
    fd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(int(timeout * 1000)), f"process {pid} did not exit within {timeout} s"
    finally:
        os.close(fd)


def set_when_asleep(tid: int, what: str, event: Any, failures: list[BaseException]) -> None:
    """Set ``event`` once thread ``tid`` of this process sleeps in epoll_wait (or failed to)."""
    try:
        wait_asleep_in_poll(os.getpid(), tid, what=what)
    except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
        failures.append(exc)
    finally:
        event.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["Recv", "Recv-any-source", "Irecv-Wait", "recv", "Probe",
                                  "Send-rendezvous", "Recv-rendezvous-in-flight"])
def test_peer_exit_raises_peer_gone(transport, mode):
    """Waiting on a peer that exits (os._exit) raises PeerGone instead of hanging.

    The peer exits once the call sleeps (seen in /proc), so that the exit is what wakes
    it; in the in-flight case it has exited, leaving its RTS in our ring, before the call."""
    a, b = cma.Pipe(transport=transport)
    in_flight = mode.endswith("in-flight")
    exit_now = mp.get_context("fork").Event()
    p = mp.get_context("fork").Process(target=gone_child,
                                       args=(b, "rendezvous" if in_flight else "idle", exit_now))
    watcher = None
    failures: list[BaseException] = []
    try:
        p.start()
        b.close()
        assert a.recv(source=1, tag=1) == "ready"
        if in_flight:
            wait_exited(p.pid)  # (a zombie still: not reaped)
        else:
            watcher = threading.Thread(target=set_when_asleep, args=(
                threading.get_native_id(), f"the {mode} call", exit_now, failures))
            watcher.start()
        t0 = time.monotonic()
        buf = np.empty(8 * FRAG, np.uint8)
        with pytest.raises(PeerGone):
            if mode == "Recv":
                a.Recv(buf, source=1, tag=2)
            elif mode == "Recv-any-source":
                a.Recv(buf, source=cma.ANY_SOURCE, tag=2)
            elif mode == "Irecv-Wait":
                a.Irecv(buf, source=1, tag=2).Wait()
            elif mode == "recv":
                a.recv(source=1, tag=2)
            elif mode == "Probe":
                a.Probe(source=1, tag=2)
            elif mode == "Send-rendezvous":
                a.Send(buf, dest=1, tag=2)  # nobody will ever receive it
            else:
                a.Recv(buf, source=1, tag=2)
        assert not failures, failures[0]  # (the call did not sleep: the peer exited late)
        assert time.monotonic() - t0 < 10
    finally:
        exit_now.set()
        if watcher is not None:
            watcher.join(JOIN_TIMEOUT)
        stop_process(p)
        a.close()


@pytest.mark.timeout(30)
def test_a_wait_for_a_peer_already_buried_raises_peer_gone():
    """A wait for a peer whose exit an earlier wait saw raises PeerGone too. It hung: that
    wait closed the peer's pidfd, so no later sleep could see the exit again."""
    a, b = cma.Pipe(transport="shm")
    exit_now = mp.get_context("fork").Event()
    p = mp.get_context("fork").Process(target=gone_child, args=(b, "idle", exit_now))
    try:
        p.start()
        b.close()
        assert a.recv(source=1, tag=1) == "ready"
        exit_now.set()
        wait_exited(p.pid)
        buf = np.empty(8, np.uint8)
        with pytest.raises(PeerGone, match="every other rank has exited"):
            a.Recv(buf, source=cma.ANY_SOURCE, tag=2)
        with pytest.raises(PeerGone, match=rf"rank 1 \(pid {p.pid}\) exited"):
            a.Recv(buf, source=1, tag=2)
        with pytest.raises(PeerGone, match=rf"rank 1 \(pid {p.pid}\) exited"):
            a.Irecv(buf, source=1, tag=2).Wait()
    finally:
        exit_now.set()
        stop_process(p)
        a.close()


def rput_child(comm):
    buf = np.zeros(5 * FRAG, np.uint8)
    st = cma.Status()
    comm.Recv(buf, 0, 1, st)
    first = digest(buf[: st.count])
    obj = comm.recv(source=0, tag=2)
    try:
        comm.Recv(np.zeros(10, np.uint8), 0, 3)
        truncated = None
    except TruncationError as exc:
        truncated = exc.nbytes
    comm.send((first, st.count, _describe(obj), truncated), 0, 4)


@pytest.mark.parametrize("name", PUSH_TRANSPORTS)
def test_rput_end_to_end(name):
    """push=True makes the receiver answer CTS and the sender write (RPUT)."""
    a, b = cma.Pipe(transport=name, push=True)
    p = mp.get_context("fork").Process(target=rput_child, args=(b,))
    try:
        p.start()
        b.close()
        data = pattern(4 * FRAG + 3, 1)
        obj = [np.full(EAGER + 808, i % 256, np.uint8) for i in range(1100)]
        a.Send(data, 1, 1)
        a.send(obj, 1, 2)
        a.Send(data, 1, 3)  # truncated at the receiver, yet this returns
        mine = a.stats()[name]  # before the (large) reply adds a received message
        first, count, seen, truncated = a.recv(source=1, tag=4)
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
        assert (first, count) == (digest(data), data.nbytes)
        assert seen == _describe(obj)
        assert truncated == data.nbytes
        # the sender wrote (RPUT), with the transport's copies; the truncated one moved nothing
        assert mine["messages"] == 2, "the sender did not write: RPUT was not used"
        assert mine["bytes"] >= data.nbytes + sum(x.nbytes for x in obj)  # + pickle stream
        assert mine["kernel_copies"] == REGISTRY.classes[name].copies.kernel
    finally:
        stop_process(p)
        a.close()


@pytest.mark.parametrize("split", [True, False], ids=["split", "rget"])
def test_cma_split_shares_the_single_copy(split):
    """SPLIT: the receiver copies the first half and the sender the second; still one
    copy per byte in all. With split=False the receiver copies everything (RGET)."""
    if "cma" not in REGISTRY.classes:
        pytest.skip("the cma transport is not registered here")
    nbytes = 4 * FRAG + 4096 * 3 + 7
    cut = cma.protocol.split_point(nbytes)
    try:
        peer = Peer("cma", split=split)
        peer.check_clean()  # both ends attach here
    except cma.errors.TransportUnavailable as exc:
        pytest.skip(f"cma is not permitted on this machine: {exc}")
    try:
        data = pattern(nbytes, 5)
        peer.start(op_stats, nbytes, [])
        peer.comm.reset_stats()
        peer.comm.Send(data, 1, 1)
        mine = peer.comm.stats()["cma"]
        theirs, got = peer.result()
        assert got == digest(data)
        assert theirs["cma"]["messages"] == 1
        assert mine["kernel_copies"] + theirs["cma"]["kernel_copies"] == 1.0
        if split:
            assert mine["messages"] == 1
            assert theirs["cma"]["kernel_copies"] == cut / nbytes
            assert mine["kernel_copies"] == (nbytes - cut) / nbytes
            assert mine["syscalls"] >= 1 and theirs["cma"]["syscalls"] >= 1
        else:  # (an RGET sender is told only FIN, not by what: it counts nothing)
            assert (mine["messages"], mine["kernel_copies"], mine["syscalls"]) == (0, 0.0, 0)
    finally:
        peer.stop()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_blocked_receiver_uses_little_cpu(peer):
    comm = peer.comm
    peer.start(op_announce_then_recv, 100, 90)
    assert comm.recv(source=1, tag=90) == "receiving"
    wait_asleep_in_poll(peer.pid, what="the peer's Recv")  # in the Recv, done spinning
    cpu0, t0 = _cpu_seconds(peer.pid), time.monotonic()
    time.sleep(1.5)  # (the span measured, not a wait for anything)
    cpu1, t1 = _cpu_seconds(peer.pid), time.monotonic()
    data = pattern(100, 3)
    comm.Send(data, 1, 90)
    assert peer.result() == digest(data)
    share = (cpu1 - cpu0) / (t1 - t0)
    assert share < 0.3, f"a receiver blocked for {t1 - t0:.1f} s used {share:.0%} of a core"


# ------------------------------------------------------------------ first use, odd buffers


def first_use_child(comm, kind, call):
    """The peer of a first-use test: sends what rank 0's first receive waits for."""
    if call in ("Recv", "Irecv"):
        comm.Send(b"" if kind == "None" else b"12345678", dest=0, tag=5)
    comm.recv(source=0, tag=1)


@contextlib.contextmanager
def first_use_pair(kind, call):
    """Rank 0 of a fresh pair, untouched, with rank 1 in a child running first_use_child."""
    a, b = cma.Pipe(transport="shm")
    p = mp.get_context("fork").Process(target=first_use_child, args=(b, kind, call))
    try:
        p.start()
        b.close()
        yield a
        a.send("bye", dest=1, tag=1)
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        stop_process(p, 2.0)
        a.close()


@pytest.mark.parametrize("call", ["Send", "Recv"])
def test_none_buffer_on_first_use(call):
    """``None`` as the buffer of the very first call: an empty message or BufferError."""
    with first_use_pair("None", call) as a:
        try:
            if call == "Send":
                a.Send(None, dest=1, tag=0)
            else:
                a.Recv(None, source=1, tag=5)
        except CmaBufferError:
            pass
        except AttributeError as exc:
            pytest.fail(f"{call}(None) as the first call raised AttributeError: {exc}")


@pytest.mark.parametrize("call", ["Recv", "Irecv", "Send", "Isend"])
def test_bytearray_on_first_use(call):
    """A bytearray as the buffer of the very first call (its fast path skips the view
    cache, which is where a communicator attaches): the call attaches and works."""
    with first_use_pair("bytearray", call) as a:
        if call in ("Recv", "Irecv"):
            buf = bytearray(8)
            if call == "Recv":
                a.Recv(buf, source=1, tag=5)
            else:
                a.Irecv(buf, source=1, tag=5).Wait()
            assert bytes(buf) == b"12345678"
        else:
            request = getattr(a, call)(bytearray(b"abc"), 1, 7)
            if request is not None:
                request.Wait()


# ------------------------------------------------------------------ other channel configurations




def small_ring_rank0(comm):
    for i in range(60):  # more eager messages than the 4 KiB ring holds
        comm.Send(np.full(100, i, np.uint8), dest=1, tag=1)
    for n in (1025, 4096, 4097, 50_000):  # rendezvous, through 2 staging slots of 4 KiB
        comm.Send(pattern(n, n), dest=1, tag=2)
    # 100 out-of-band buffers: an RTS of 1.6 KB, 40 % of the ring
    comm.send([np.full(2000, i, np.uint8) for i in range(100)], dest=1, tag=3)
    return comm.recv(source=1, tag=4)


def small_ring_rank1(comm):
    buf = np.empty(50_000, np.uint8)
    st = cma.Status()
    for i in range(60):
        comm.Recv(buf, source=0, tag=1, status=st)
        assert st.count == 100 and (buf[:100] == i).all()
    for n in (1025, 4096, 4097, 50_000):
        comm.Recv(buf, source=0, tag=2, status=st)
        assert st.count == n and buf[:n].tobytes() == pattern(n, n).tobytes()
    obj = comm.recv(source=0, tag=3)
    assert all((a == i).all() for i, a in enumerate(obj))
    comm.send(len(obj), dest=0, tag=4)
    return True


def test_small_ring_configuration(transport):
    """A 4 KiB ring: full rings, wrap-around padding, queued packets, small staging."""
    assert run_pair(transport, SMALL_RING, small_ring_rank0, small_ring_rank1,
                    timeout=10) == [100, True]


def big_packet_rank0(comm):
    for k in range(40):
        for i in range(k):
            comm.Send(np.full(10, i, np.uint8), dest=1, tag=1)
        # 100 out-of-band buffers: an RTS of 1.6 KB
        comm.send([np.full(2000, i, np.uint8) for i in range(100)], dest=1, tag=2)
        assert comm.recv(source=1, tag=3) == k
    return True


def big_packet_rank1(comm):
    buf = np.empty(10, np.uint8)
    for k in range(40):
        for _ in range(k):
            comm.Recv(buf, source=0, tag=1)
        obj = comm.recv(source=0, tag=2)
        assert len(obj) == 100
        comm.send(k, dest=0, tag=3)
    return True


def test_large_control_packet_after_eager_messages(transport):
    """k small eager messages, then a control packet of 40 % of the ring, for k = 0 .. 39.

    The sender must notice that the receiver freed what the eager messages took even
    when the ring never looked full, whatever the position of the wrap-around.
    """
    assert run_pair(transport, SMALL_RING, big_packet_rank0, big_packet_rank1,
                    timeout=10) == [True, True]


def many_buffers_rank0(comm):
    # 700 out-of-band buffers: an RTS of 11 KB, larger than the whole 4 KiB ring
    comm.send([np.full(1500, i % 256, np.uint8) for i in range(700)], dest=1, tag=1)
    return True


def many_buffers_rank1(comm):
    obj = comm.recv(source=0, tag=1)
    return len(obj) == 700 and all((a == i % 256).all() for i, a in enumerate(obj))


def test_object_with_more_buffers_than_the_ring_holds(transport):
    """Any object can be sent, whatever the ring size (DESIGN: any size, > 1024 iovecs)."""
    assert run_pair(transport, SMALL_RING, many_buffers_rank0, many_buffers_rank1,
                    timeout=10) == [True, True]


def queued_then_closed_rank0(comm, sent):
    """Read nothing until rank 1 has ``sent`` (its ring full, the rest queued), then all."""
    comm.attach()  # (rank 1's attach waits for ours)
    assert sent.wait(JOIN_TIMEOUT), "rank 1 did not finish its sends"
    receive_what_was_queued(comm, source=1, tag=1)
    return True


def queued_then_closed_rank1(comm, sent=None):
    """Send more than the ring holds, then close; ``sent`` is set in between."""
    send_more_than_the_ring_holds(comm, dest=0, tag=1)
    if sent is not None:
        sent.set()  # (this rank moves nothing more before close: the queue is still full)
    comm.close()
    return True


def test_isends_that_find_the_ring_full_wait_in_order():
    """Isends go straight into the ring while it has room, then queue (copied once more,
    and counted), and none overtakes another."""
    posted = mp.get_context("fork").Event()

    def rank0(comm):
        comm.attach()
        assert posted.wait(5)  # nothing read from the ring until every Isend was posted
        receive_what_was_queued(comm, source=1, tag=1)
        comm.Barrier()
        return True

    def rank1(comm):
        comm.reset_stats()
        requests = [comm.Isend(np.full(1000, i, np.uint8), dest=0, tag=1)
                    for i in range(QUEUED_SENDS)]
        posted.set()
        cma.Request.Waitall(requests)  # done once queued, as a buffered send
        comm.Barrier()  # rank 0 has every message: the queue went into the ring
        return comm.stats()["eager"]

    _, eager = run_pair("shm", SMALL_RING, rank0, rank1, timeout=10)
    assert eager["bytes"] == QUEUED_SENDS * 1000
    # The 4 KiB ring takes three 1000-byte packets; the other 17 were copied into the
    # queue first (before, every Isend was: 2.0).
    assert eager["user_copies"] == pytest.approx(1 + (QUEUED_SENDS - 3) / QUEUED_SENDS)


def test_a_receiver_that_empties_a_full_ring_wakes_its_sleeping_sender(monkeypatch):
    """A sender whose ring is full sleeps until the receiver makes room. Blocking Recvs take
    the messages straight from the ring (no engine pass, which would ring it) and then wait
    at the empty ring for the next: that wait must ring the sender, or both sleep until the
    timed wake-up (10 ms each time the ring fills). The timed wake-up is set to a minute,
    so a lost wake-up hangs the pair."""
    monkeypatch.setattr(cma.progress, "SLEEP_MS", 60_000)  # inherited by the forks
    ctx = mp.get_context("fork")
    posted = ctx.Event()
    sender_pid = ctx.Value("i", 0)

    def rank0(comm):
        comm.attach()
        assert posted.wait(5)
        wait_asleep_in_poll(sender_pid.value, what="the sender, its ring full")
        receive_what_was_queued(comm, source=1, tag=1)
        comm.Barrier()
        return True

    def rank1(comm):
        requests = [comm.Isend(np.full(1000, i, np.uint8), dest=0, tag=1)
                    for i in range(QUEUED_SENDS)]
        sender_pid.value = os.getpid()
        posted.set()
        comm.Barrier()  # asleep here, its queue waiting for room in the ring
        cma.Request.Waitall(requests)
        return True

    assert run_pair("shm", SMALL_RING, rank0, rank1, timeout=20) == [True, True]


def test_large_isends_that_find_the_ring_full_go_as_rendezvous(monkeypatch):
    """From QUEUED_COPY_LIMIT bytes an Isend that finds the ring full is not copied into the
    queue: it goes as a rendezvous, complete only once received, and keeps its place."""
    monkeypatch.setattr(cma.comm, "QUEUED_COPY_LIMIT", 512)  # inherited by the forks
    posted = mp.get_context("fork").Event()

    def rank0(comm):
        comm.attach()
        assert posted.wait(5)
        receive_what_was_queued(comm, source=1, tag=1)
        comm.Barrier()
        return True

    def rank1(comm):
        comm.reset_stats()
        buffers = [np.full(1000, i, np.uint8) for i in range(QUEUED_SENDS)]
        requests = [comm.Isend(buf, dest=0, tag=1) for buf in buffers]
        waiting = not requests[-1].Test()  # nothing received yet: a rendezvous waits
        posted.set()
        cma.Request.Waitall(requests)
        comm.Barrier()
        stats = comm.stats()
        return waiting, stats["eager"], stats["shm"]

    _, (waiting, eager, shm) = run_pair("shm", SMALL_RING, rank0, rank1, timeout=10)
    assert waiting
    # the 4 KiB ring takes three 1000-byte packets; no payload was copied into the queue
    assert eager["bytes"] == 3 * 1000
    assert eager["user_copies"] == 1.0
    assert shm["messages"] == QUEUED_SENDS - 3


def test_irecv_takes_a_message_waiting_in_the_ring_at_once(monkeypatch):
    """An Irecv whose message is already next in the ring completes without posting a
    receive; one posted earlier first takes what arrived for it, so none is passed over."""
    posts = mp.get_context("fork").Value("i", 0)
    engine_recv, fast_post = cma.protocol.Engine.recv, cma.comm.posted_recv

    def counted(post):
        def posting(*args):
            with posts.get_lock():
                posts.value += 1
            return post(*args)
        return posting

    # (posted either way: the engine's, or Irecv's own for a receive nothing arrived for)
    monkeypatch.setattr(cma.protocol.Engine, "recv", counted(engine_recv))
    monkeypatch.setattr(cma.comm, "posted_recv", counted(fast_post))
    first_posted, sent = (mp.get_context("fork").Event() for _ in range(2))

    def rank0(comm):
        comm.attach()
        bufs = [np.zeros(8, np.int64) for _ in range(4)]
        early = comm.Irecv(bufs[0], source=1, tag=cma.ANY_TAG)  # nothing has arrived
        first_posted.set()
        assert sent.wait(5)
        later = [comm.Irecv(buf, source=1, tag=cma.ANY_TAG) for buf in bufs[1:]]
        statuses = [cma.Status() for _ in bufs]
        cma.Request.Waitall([early, *later], statuses)
        return [int(buf[0]) for buf in bufs], [(st.source, st.tag, st.count) for st in statuses]

    def rank1(comm):
        comm.attach()
        assert first_posted.wait(5)
        for i in range(4):
            comm.Send(np.full(8, i, np.int64), dest=0, tag=10 + i)  # into the ring at once
        sent.set()
        return True

    (values, statuses), _ = run_pair("shm", None, rank0, rank1, timeout=10)
    assert values == [0, 1, 2, 3]
    assert statuses == [(1, 10 + i, 64) for i in range(4)]
    assert posts.value == 1  # only the early Irecv was posted to the engine


def test_a_window_of_posted_receives_takes_its_eager_messages_straight_from_the_ring(monkeypatch):
    """Irecvs posted before their messages (osu_bibw's window) are filled from the ring
    without the engine: no packet of a plain eager message that fits reaches
    Engine.packet. A synchronous one (its sender waits for a FIN), one too large for its
    buffer and one with ANY_TAG among them are still received as MPI says."""
    packets = mp.get_context("fork").Value("i", 0)
    engine_packet = cma.protocol.Engine.packet

    def counted_packet(self, source, kind, *rest):
        if kind == cma.wire.EAGER:
            with packets.get_lock():
                packets.value += 1
        return engine_packet(self, source, kind, *rest)

    monkeypatch.setattr(cma.protocol.Engine, "packet", counted_packet)
    posted = mp.get_context("fork").Event()
    tags = [1, 2, 1, 3, 1, 4]  # 3: synchronous; 4: 64 bytes, one more than its buffer

    def rank0(comm):
        comm.attach()
        bufs = [np.zeros(8, np.int64) for _ in tags]
        bufs[-1] = np.zeros(63, np.uint8)
        requests = [comm.Irecv(buf, source=1, tag=cma.ANY_TAG if tag == 2 else tag)
                    for buf, tag in zip(bufs, tags, strict=True)]
        posted.set()
        statuses = [cma.Status() for _ in tags]
        try:
            cma.Request.Waitall(requests[:-1], statuses)
            requests[-1].Wait()
        except TruncationError as exc:
            truncated = exc.nbytes
        else:
            truncated = None
        seen = [(s.source, s.tag, s.count) for s in statuses[:-1]]
        return [int(buf[0]) for buf in bufs[:-1]], seen, truncated

    def rank1(comm):
        comm.attach()
        assert posted.wait(5)
        for i, tag in enumerate(tags[:-1]):
            message = np.full(8, i, np.int64)
            if tag == 3:
                comm.Ssend(message, dest=0, tag=tag)
            else:
                comm.Send(message, dest=0, tag=tag)
        comm.Send(np.zeros(64, np.uint8), dest=0, tag=4)
        return True

    (values, statuses, truncated), _ = run_pair("shm", None, rank0, rank1, timeout=10)
    assert values == [0, 1, 2, 3, 4]
    assert statuses == [(1, tag, 64) for tag in tags[:-1]]
    assert truncated == 64
    assert packets.value == 1  # the too-large one (a synchronous send is another kind)


def test_a_posted_receive_of_a_broken_communicator_is_not_filled_from_the_ring():
    """Once the communicator broke down (a signal in the middle of a packet's handling),
    the drain refuses the message a posted Irecv waits for, as the engine does, instead
    of copying it in: the ring's state is not to be trusted."""
    posted, sent = (mp.get_context("fork").Event() for _ in range(2))

    def rank0(comm):
        comm.attach()
        buf = np.zeros(8, np.int64)
        request = comm.Irecv(buf, source=1, tag=1)  # posted: nothing arrived yet
        posted.set()
        assert sent.wait(JOIN_TIMEOUT)
        comm._progress.break_down("a test broke it")
        with pytest.raises(CommBroken, match="a test broke it"):
            request.Wait()
        return int(buf[0])

    def rank1(comm):
        comm.attach()
        assert posted.wait(JOIN_TIMEOUT)  # (sent earlier, Irecv itself may take it)
        comm.Send(np.full(8, 5, np.int64), dest=0, tag=1)
        sent.set()
        return True

    assert run_pair("shm", None, rank0, rank1, timeout=10) == [0, True]


def test_irecv_leaves_in_the_ring_what_no_posted_receive_takes(monkeypatch):
    """A posted receive for another tag makes Irecv go the general way, and the messages
    it passes over stay in the ring: none is copied out as an unexpected arrival."""
    arrivals = mp.get_context("fork").Value("i", 0)
    arrival = cma.protocol.Arrival

    def counted_arrival(source, tag, is_object, nbytes, eager, rts, *rest):
        if eager is not None:  # a payload copied out of the ring to wait for its receive
            with arrivals.get_lock():
                arrivals.value += 1
        return arrival(source, tag, is_object, nbytes, eager, rts, *rest)

    monkeypatch.setattr(cma.protocol, "Arrival", counted_arrival)  # inherited by the forks
    first_posted, sent = (mp.get_context("fork").Event() for _ in range(2))

    def rank0(comm):
        comm.attach()
        later = np.zeros(8, np.int64)
        waiting = comm.Irecv(later, source=1, tag=5)  # its message comes last
        first_posted.set()
        assert sent.wait(5)
        bufs = [np.zeros(1000, np.uint8) for _ in range(4)]
        requests = [comm.Irecv(buf, source=1, tag=1) for buf in bufs]
        cma.Request.Waitall([*requests, waiting])
        return [int(buf[0]) for buf in bufs], int(later[0])

    def rank1(comm):
        comm.attach()
        assert first_posted.wait(5)
        for i in range(4):
            comm.Send(np.full(1000, i, np.uint8), dest=0, tag=1)  # into the ring at once
        sent.set()
        comm.Send(np.full(8, 5, np.int64), dest=0, tag=5)
        return True

    (values, later), _ = run_pair("shm", None, rank0, rank1, timeout=10)
    assert values == [0, 1, 2, 3] and later == 5
    assert arrivals.value == 0  # (4 when Irecv drained them while any receive was posted)


def _count_spin_passes(progress) -> list[int]:
    """From now on, the clock readings (one per pass of a wait's spin) between two sleeps
    of ``progress``'s rank: entry i counts those before its i-th sleep. In a forked child."""
    import cma.progress

    readings = [0]
    between: list[int] = []
    clock = time.perf_counter

    def counted_clock() -> float:
        readings[0] += 1
        return clock()

    sleep = progress.world.sleep

    def counted_sleep(timeout_ms):
        between.append(readings[0])
        readings[0] = 0
        return sleep(timeout_ms)

    cma.progress.time = type("CountedTime", (), {"perf_counter": staticmethod(counted_clock)})
    progress.world.sleep = counted_sleep
    return between


@pytest.mark.parametrize("wait", ["Recv", "Irecv-Wait"])
def test_a_long_wait_sleeps_instead_of_spinning(wait):
    """A receive that waits a second for its message spins once, then sleeps: it wakes
    every SLEEP_MS to nothing, and must not spin again each time. (The spin is counted in
    passes, not CPU seconds: a garbage collection or the host's load in the child made
    the CPU figure fail now and then, 0.127 s once in CI.) ``Recv`` waits in its fast
    path's await_head, ``Irecv-Wait`` in the engine's wait loop."""
    receiving = mp.get_context("fork").Event()

    def rank0(comm):
        comm.attach()
        assert receiving.wait(JOIN_TIMEOUT)
        time.sleep(1.0)  # (how long the receive waits: the scenario, not a wait for anything)
        comm.Send(np.zeros(8, np.uint8), dest=1, tag=1)
        return True

    def rank1(comm):
        comm.attach()
        between = _count_spin_passes(comm._progress)
        receiving.set()
        start = time.monotonic()
        if wait == "Recv":
            comm.Recv(np.zeros(8, np.uint8), source=0, tag=1)
        else:
            comm.Irecv(np.zeros(8, np.uint8), source=0, tag=1).Wait()
        return time.monotonic() - start, between

    _, (waited, between) = run_pair("shm", None, rank0, rank1, timeout=10)
    assert waited >= 0.9, f"the receive waited {waited:.3f} s, not the second meant"
    # ~100 sleeps of SLEEP_MS; the first spin takes hundreds of passes (1 ms), each wake-up
    # after it one or two: spinning again after every wake-up took hundreds each
    assert len(between) >= 20, between
    assert between[0] > 0, "the spin before the first sleep was not counted"
    spun_again = [n for n in between[1:] if n > 10]
    assert len(spun_again) <= 2, f"{len(spun_again)} of {len(between) - 1} wake-ups spun again"


def test_close_delivers_sends_still_queued_for_a_full_ring():
    """A Send that found the ring full returned; closing must not lose its message."""
    sent = mp.get_context("fork").Event()
    assert run_pair("shm", SMALL_RING, functools.partial(queued_then_closed_rank0, sent=sent),
                    functools.partial(queued_then_closed_rank1, sent=sent),
                    timeout=10) == [True, True]


def test_close_does_not_wait_for_a_peer_that_closed_without_reading():
    """Nobody will read what is queued for a closed peer, even if its process lives on."""
    sender_done = mp.get_context("fork").Event()

    def rank0(comm):
        comm.Barrier()  # attached
        comm.close()
        return sender_done.wait(5)

    def rank1(comm):
        comm.Barrier()
        queued_then_closed_rank1(comm)
        sender_done.set()
        return True

    assert run_pair("shm", SMALL_RING, rank0, rank1, timeout=10) == [True, True]


def test_close_that_fails_while_draining_still_releases_everything():
    def rank0(comm):
        comm.Barrier()
        return True

    def rank1(comm):
        comm.Barrier()
        fds = len(os.listdir("/proc/self/fd"))

        def interrupted():
            raise KeyboardInterrupt

        comm._progress.deliver_queued = interrupted
        with pytest.raises(KeyboardInterrupt):
            comm.close()
        return fds - len(os.listdir("/proc/self/fd"))  # the memfd, doorbells, pidfds...

    released = run_pair("shm", None, rank0, rank1, timeout=10)[1]
    assert released >= 3


def test_close_in_a_forked_child_leaves_the_parents_queue_alone():
    """Only the process that attached a rank writes its rings, also when closing."""
    sender_done, forked = (mp.get_context("fork").Event() for _ in range(2))

    def rank0(comm):
        queued_then_closed_rank0(comm, forked)  # the child's copy of the queue is full
        assert sender_done.wait(5)
        return comm.Iprobe(source=1, tag=1)  # a packet written twice would show here

    def rank1(comm):
        send_more_than_the_ring_holds(comm, dest=0, tag=1)
        pid = os.fork()
        if pid == 0:
            try:
                comm.close()
            finally:
                os._exit(0)
        forked.set()
        os.waitpid(pid, 0)
        marked_closed = comm._world.has_closed(comm.rank)  # the child must not speak for us
        comm.close()
        sender_done.set()
        return marked_closed

    assert run_pair("shm", SMALL_RING, rank0, rank1, timeout=10) == [False, False]


def test_close_in_a_forked_child_leaves_the_parents_sleep_set_alone(monkeypatch):
    """A child forked from an attached rank shares its epoll set (one open file): the
    child's close must not take the doorbell or the peer's pidfd out of it, or the parent
    sleeps through its peer's exit. The timed wake-up is a minute, so only the pidfd
    ends the parent's wait in time."""
    monkeypatch.setattr(cma.progress, "SLEEP_MS", 60_000)  # inherited by the forks
    child_closed = mp.get_context("fork").Event()

    def rank0(comm):
        comm.attach()
        assert child_closed.wait(JOIN_TIMEOUT)
        return True  # and this process exits

    def rank1(comm):
        comm.attach()
        pid = os.fork()
        if pid == 0:
            try:
                comm.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        child_closed.set()
        start = time.monotonic()
        with pytest.raises(PeerGone):
            comm.Recv(np.empty(8, np.uint8), source=0, tag=1)
        return time.monotonic() - start

    seconds = run_pair("shm", None, rank0, rank1, timeout=15)[1]
    assert seconds < 10, f"rank 0's exit was seen after {seconds:.1f} s"


# ------------------------------------------------------------------ huge messages


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_message_larger_than_2gib(peer):
    if mem_available() < 12 << 30:
        pytest.skip(f"needs 12 GiB of MemAvailable, have {mem_available() / 2**30:.1f} GiB")
    nbytes = 2**31 + 12345
    buf = np.empty(nbytes, np.uint8)
    fill_counting(buf)
    peer.start(op_huge, nbytes)
    peer.comm.Send(buf, dest=1, tag=5)
    del buf
    assert peer.result() is True, "the peer received different bytes"


def doorbell_receiver(comm, ready, go, receiving, woken):
    """Rank 1 of test_eager_sends_wake_a_sleeping_receiver_and_only_it."""
    comm.attach()
    ready.set()
    assert go.wait(JOIN_TIMEOUT)  # blocked here, in no receive, while two messages arrive
    buf = np.zeros(16, np.uint8)
    for _ in range(2):
        comm.Recv(buf, 0, tag=3)
        assert np.array_equal(buf, np.arange(16, dtype=np.uint8))
    for i, (said, told) in enumerate(zip(receiving, woken, strict=True)):
        said.set()
        comm.Recv(buf, 0, tag=4 + i)  # asleep in epoll_wait until woken
        told.set()
    comm.close()


def test_eager_sends_wake_a_sleeping_receiver_and_only_it(monkeypatch):
    """Isend writes its eager packet itself (not through Send): like Send, it must ring the
    doorbell of a receiver asleep in a receive, and only then (a receiver busy elsewhere
    finds the message when it next looks; ringing would cost a system call per message).

    The receiver's timed wake-up (SLEEP_MS, against a lost wake-up) is set to a minute, so
    that only the doorbell wakes it in time; the sender's stats count its doorbell rings."""
    monkeypatch.setattr(cma.progress, "SLEEP_MS", 60_000)  # inherited by the fork
    ctx = mp.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    receiving, woken = [ctx.Event(), ctx.Event()], [ctx.Event(), ctx.Event()]
    a, b = cma.Pipe(transport="shm")
    p = ctx.Process(target=doorbell_receiver, args=(b, ready, go, receiving, woken))
    data = np.arange(16, dtype=np.uint8)
    try:
        p.start()
        b.close()
        a.attach()
        assert ready.wait(JOIN_TIMEOUT)
        a.reset_stats()
        a.Isend(data, 1, tag=3).Wait()
        a.Send(data, 1, tag=3)
        rings = a.stats()["eager"]["syscalls"]
        assert rings == 0, f"{rings} doorbell rings for a receiver that was not waiting"
        go.set()
        for i, call in enumerate(("Isend", "Send")):
            assert receiving[i].wait(JOIN_TIMEOUT)
            wait_asleep_in_poll(p.pid, what="the receiver's Recv")
            a.reset_stats()
            if call == "Isend":
                a.Isend(data, 1, tag=4 + i).Wait()
            else:
                a.Send(data, 1, tag=4 + i)
            assert woken[i].wait(5), f"a receiver asleep in Recv was not woken by {call}"
            assert a.stats()["eager"]["syscalls"] == 1
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        stop_process(p, 2.0)
        a.close()


def sleeping_receiver(comm, receiving, woken):
    comm.attach()
    receiving.set()
    comm.Recv(np.zeros(16, np.uint8), 0, tag=3)  # asleep in epoll_wait until woken
    woken.set()
    comm.close()


@pytest.mark.parametrize("way", ["pidfd_getfd", "fd server"])
def test_a_peers_doorbell_is_taken_by_number_or_fetched_from_its_server(monkeypatch, way):
    """A rank takes its peer's doorbell with pidfd_getfd by the number the peer published
    (no fd-server round trip), or, where that is refused, from the peer's fd server;
    either way it wakes the peer asleep in a receive (whose timed wake-up is a minute)."""
    monkeypatch.setattr(cma.progress, "SLEEP_MS", 60_000)  # (every patch reaches the fork)
    if way == "pidfd_getfd":
        fetch = cma.world.World.fetch_fd

        def no_doorbell_from_the_server(self, rank, name):
            assert name != "doorbell", "the doorbell came from the fd server"
            return fetch(self, rank, name)

        monkeypatch.setattr(cma.world.World, "fetch_fd", no_doorbell_from_the_server)
    else:
        def refused(pidfd, number):
            raise PermissionError(errno.EPERM, "refused by ptrace rules")

        monkeypatch.setattr(cma._linux, "pidfd_getfd", refused)
    ctx = mp.get_context("fork")
    receiving, woken = ctx.Event(), ctx.Event()
    a, b = cma.Pipe(transport="shm")
    p = ctx.Process(target=sleeping_receiver, args=(b, receiving, woken))
    try:
        p.start()
        b.close()
        a.attach()
        assert receiving.wait(JOIN_TIMEOUT)
        wait_asleep_in_poll(p.pid, what="the receiver's Recv")
        a.Send(np.ones(16, np.uint8), 1, tag=3)
        assert woken.wait(5), "the receiver asleep in Recv was not woken"
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        stop_process(p, 2.0)
        a.close()


def test_only_an_eventfd_passes_for_a_doorbell():
    """What a doorbell taken by number is checked to be (a reused number may name any fd)."""
    bell = cma._linux.eventfd()
    r, w = os.pipe()
    try:
        assert cma._linux.is_eventfd(bell)
        assert not cma._linux.is_eventfd(r) and not cma._linux.is_eventfd(w)
        assert not cma._linux.is_eventfd(-1)
    finally:
        for fd in (bell, r, w):
            os.close(fd)


HEADS_PEERS = 3
IDLE_SECONDS = 0.2


def test_an_idle_wait_looks_at_no_ring_until_a_packet_comes():
    """A waiting rank reads its row of the heads matrix (every ring's head at once) and
    drains its rings only when a head moved: a pass with N-1 peers and nothing new once
    called drain N-1 times (the all-to-all's cost at 64 ranks, #24). Rank 0 connects to
    its three peers, then waits 0.2 s for rank 3's message: its passes may drain only
    when that message comes (and in the wait's first pass, which publishes what the fast
    paths took)."""

    def rank0(comm):
        buf = np.zeros(8, np.uint8)
        for peer in range(1, HEADS_PEERS + 1):  # connect every pair, and let them go quiet
            comm.Recv(buf, source=peer, tag=1)
        progress = comm._progress
        drains, passes = [0], [0]
        drain, poll = progress.drain, progress._poll

        def counted_drain(peer, only_expected):
            drains[0] += 1
            return drain(peer, only_expected)

        def counted_poll():
            passes[0] += 1
            return poll()

        progress.drain, progress._poll = counted_drain, counted_poll
        comm.Send(buf, dest=HEADS_PEERS, tag=2)  # go
        comm.Irecv(buf, source=HEADS_PEERS, tag=3).Wait()
        progress.drain, progress._poll = drain, poll
        comm.Barrier()
        return drains[0], passes[0]

    def peer(comm):
        buf = np.zeros(8, np.uint8)
        comm.Send(buf, dest=0, tag=1)
        if comm.rank == HEADS_PEERS:
            comm.Recv(buf, source=0, tag=2)
            time.sleep(IDLE_SECONDS)
            comm.Send(buf, dest=0, tag=3)
        comm.Barrier()
        return None

    drains, passes = run_ranks("shm", SMALL_RING, [rank0] + [peer] * HEADS_PEERS, timeout=30)[0]
    print(f"{passes} passes, {drains} drain calls")
    assert passes >= 10, "the wait did not spin: the test measured nothing"
    assert drains <= 2 * HEADS_PEERS, f"{drains} drain calls in {passes} passes"

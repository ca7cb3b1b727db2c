"""Misuse of a Comm: each is refused with a specific cma error before anything is posted,
and the communicator keeps working (the ``peer`` fixture checks after every test that
nothing was left unreceived on either side)."""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
from conftest import Peer, stop_process

import cma
from cma import _linux
from cma.errors import (
    BufferError,
    CmaError,
    CommBroken,
    CommClosed,
    InvalidConfig,
    InvalidCount,
    InvalidDatatype,
    InvalidRank,
    InvalidTag,
    MessageTooLarge,
    NotTransferable,
    TransportUnavailable,
    TruncationError,
)

TAG = 11
RENDEZVOUS = 4 << 20  # above the 2 MiB eager limit of cma.Pipe's default configuration


def pattern(nbytes: int, seed: int = 3) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).copy()


def digest(buf: np.ndarray) -> str:
    return hashlib.sha256(buf).hexdigest()


# ------------------------------------------------------------------ what the peer runs

def op_send(comm: cma.Comm, nbytes: int) -> None:
    comm.Send(pattern(nbytes), dest=0, tag=TAG)


def op_recv(comm: cma.Comm, nbytes: int) -> str:
    buf = np.zeros(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=TAG)
    return digest(buf)


def round_trip(peer: Peer, nbytes: int = 100) -> None:
    """The communicator still works both ways."""
    peer.start(op_recv, nbytes)
    peer.comm.Send(pattern(nbytes, 5), dest=1, tag=TAG)
    assert peer.result() == digest(pattern(nbytes, 5))


# ------------------------------------------------------------------ buffers

@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [1000, RENDEZVOUS], ids=["eager", "rendezvous"])
def test_strided_receive_refused_before_posting(peer, nbytes):
    strided = np.zeros(2 * nbytes, np.uint8)[::2]  # one-dimensional bytes, but every other one
    peer.start(op_send, nbytes)
    for receive in (lambda: peer.comm.Recv(strided, source=1, tag=TAG),
                    lambda: peer.comm.Irecv(strided, source=1, tag=TAG)):
        with pytest.raises(BufferError, match="not C-contiguous"):
            receive()
    assert not strided.any()
    got = np.zeros(nbytes, np.uint8)
    peer.comm.Recv(got, source=1, tag=TAG)  # the message is still there for this receive
    peer.result()
    assert digest(got) == digest(pattern(nbytes))
    round_trip(peer)


@pytest.mark.parametrize("nbytes", [1000, RENDEZVOUS], ids=["eager", "rendezvous"])
def test_strided_send_refused(peer, nbytes):
    """A rendezvous would expose the bytes from the view's first address on, contiguous:
    half of them outside the view."""
    strided = pattern(2 * nbytes)[::2]
    for send in (lambda: peer.comm.Send(strided, dest=1, tag=TAG),
                 lambda: peer.comm.Isend(strided, dest=1, tag=TAG)):
        with pytest.raises(BufferError, match="not C-contiguous"):
            send()
    round_trip(peer)


@pytest.mark.parametrize("spec", [
    lambda buf: [buf, "Z"],
    lambda buf: [buf, 4, "Z"],
    lambda buf: [buf, 4, None],
    lambda buf: [buf, 4, "O"],
    lambda buf: [buf, 4, "U"],
], ids=["typechar", "count-typechar", "None", "object", "no-size"])
@pytest.mark.parametrize("call", ["Send", "Isend", "Recv", "Irecv"])
def test_unknown_datatype_refused(peer, spec, call):
    buf = np.zeros(64, np.uint8)
    args = (1, TAG)
    with pytest.raises(InvalidDatatype, match="datatype") as caught:
        getattr(peer.comm, call)(spec(buf), *args)
    assert isinstance(caught.value, BufferError) and isinstance(caught.value, CmaError)
    round_trip(peer)


@pytest.mark.parametrize("count", [-1, -64, 2.0, "3", True], ids=repr)
@pytest.mark.parametrize("call", ["Send", "Recv"])
def test_bad_count_refused(peer, count, call):
    buf = np.zeros(64, np.uint8)
    with pytest.raises(InvalidCount, match="non-negative int") as caught:
        getattr(peer.comm, call)([buf, count, "b"], 1, TAG)
    assert isinstance(caught.value, ValueError)
    round_trip(peer)


def test_numpy_count_accepted(peer):
    peer.start(op_recv, 16)
    peer.comm.Send([pattern(64, 5), np.int64(16), "b"], dest=1, tag=TAG)
    assert peer.result() == digest(pattern(64, 5)[:16])


# ------------------------------------------------------------------ ranks

@pytest.mark.parametrize("dest", [1.0, 1.5, "1"], ids=repr)
def test_non_integer_rank_refused_on_the_general_path(peer, dest):
    """A rendezvous-sized send and a receive that cannot take the fast path check the rank."""
    with pytest.raises(InvalidRank, match="destination rank"):
        peer.comm.Isend(pattern(RENDEZVOUS), dest=dest, tag=TAG)
    with pytest.raises(InvalidRank, match="source rank"):
        peer.comm.irecv(source=dest, tag=TAG)
    round_trip(peer)


def test_float_rank_refused_on_the_fast_path(peer):
    """1.0 == 1, so a dict of ring ends by rank found rank 1's ring for dest=1.0 and the
    eager fast paths sent it; mpi4py refuses a float rank (TypeError), so must we."""
    peer.start(op_recv, 100)
    with pytest.raises(InvalidRank):
        peer.comm.Send(pattern(100, 5), dest=1.0, tag=TAG)
    with pytest.raises(InvalidRank):
        peer.comm.Isend(pattern(100, 5), dest=1.0, tag=TAG)
    with pytest.raises(InvalidRank):
        peer.comm.Recv(np.zeros(100, np.uint8), source=1.0, tag=TAG)
    with pytest.raises(InvalidRank):
        peer.comm.Irecv(np.zeros(100, np.uint8), source=1.0, tag=TAG)
    peer.comm.Send(pattern(100, 5), dest=1, tag=TAG)  # (still usable: the peer's message)
    peer.result()


# ------------------------------------------------------------------ pickling

def test_pickling_an_attached_communicator_refused(peer):
    with pytest.raises(NotTransferable, match="attached in process"):
        pickle.dumps(peer.comm)
    round_trip(peer)


def test_pickling_a_closed_communicator_refused():
    a, b = cma.Pipe()
    a.close()
    b.close()
    with pytest.raises(NotTransferable, match="closed"):
        pickle.dumps(a)


# ------------------------------------------------------------------ ranks and tags out of range
#
# Refused before the transport is involved: these run with shm only (ONE_TRANSPORT), every
# call of a kind in one test with one round trip after, to keep the suite's time.

ONE_TRANSPORT = pytest.mark.parametrize("transport", ["shm"], scope="module")


def refused(peer, error, match, calls):
    for call in calls:
        with pytest.raises(error, match=match):
            call()
    round_trip(peer)


@ONE_TRANSPORT
@pytest.mark.parametrize("dest", [2, -3, 2**70, cma.ANY_SOURCE], ids=["size", "negative", "huge",
                                                                      "ANY_SOURCE"])
def test_destination_out_of_range_refused(peer, dest):
    comm = peer.comm
    refused(peer, InvalidRank, "destination rank", [
        lambda: comm.Send(pattern(100), dest, TAG), lambda: comm.Isend(pattern(100), dest, TAG),
        lambda: comm.Ssend(pattern(100), dest, TAG), lambda: comm.Bsend(pattern(100), dest, TAG),
        lambda: comm.send("x", dest, TAG)])


@ONE_TRANSPORT
@pytest.mark.parametrize("source", [2, -3, 2**70], ids=["size", "negative", "huge"])
def test_source_out_of_range_refused(peer, source):
    comm = peer.comm
    refused(peer, InvalidRank, "source rank", [
        lambda: comm.Recv(np.zeros(100, np.uint8), source, TAG),
        lambda: comm.Irecv(np.zeros(100, np.uint8), source, TAG),
        lambda: comm.Probe(source, TAG), lambda: comm.Iprobe(source, TAG),
        lambda: comm.recv(source=source, tag=TAG)])


@ONE_TRANSPORT
@pytest.mark.parametrize("tag", [-5, cma.ANY_TAG, 2**63, 3.0, "3", None],
                         ids=["negative", "ANY_TAG", "above-int64", "float", "str", "None"])
def test_bad_send_tag_refused(peer, tag):
    """2**63: the eager fast path raised struct.error from packing the tag."""
    comm = peer.comm
    refused(peer, InvalidTag, "tag", [
        lambda: comm.Send(pattern(100), 1, tag), lambda: comm.Isend(pattern(100), 1, tag),
        lambda: comm.Bsend(pattern(100), 1, tag), lambda: comm.send("x", 1, tag)])


@ONE_TRANSPORT
@pytest.mark.parametrize("tag", [-5, 2**63, 3.0, "3"], ids=["negative", "above-int64", "float",
                                                             "str"])
def test_bad_receive_tag_refused(peer, tag):
    comm = peer.comm
    refused(peer, InvalidTag, "or ANY_TAG", [
        lambda: comm.Recv(np.zeros(100, np.uint8), 1, tag),
        lambda: comm.Irecv(np.zeros(100, np.uint8), 1, tag),
        lambda: comm.Probe(1, tag), lambda: comm.Iprobe(1, tag)])


# ------------------------------------------------------------------ buffers of the wrong kind

def read_only_array() -> np.ndarray:
    array = np.zeros(100, np.uint8)
    array.setflags(write=False)
    return array


@ONE_TRANSPORT
def test_read_only_receive_buffer_refused(peer):
    peer.start(op_send, 100)
    for buf in (b"x" * 100, read_only_array()):
        for call in (peer.comm.Recv, peer.comm.Irecv):
            with pytest.raises(BufferError, match="read-only"):
                call(buf, 1, TAG)
    got = np.zeros(100, np.uint8)
    peer.comm.Recv(got, source=1, tag=TAG)
    peer.result()
    assert digest(got) == digest(pattern(100))
    round_trip(peer)


@ONE_TRANSPORT
@pytest.mark.parametrize("buf", ["text", 5, {"a": 1}, None], ids=repr)
def test_non_buffer_refused(peer, buf):
    comm = peer.comm
    refused(peer, BufferError, "supports neither the buffer protocol", [
        lambda: comm.Send(buf, 1, TAG), lambda: comm.Isend(buf, 1, TAG),
        lambda: comm.Recv(buf, 1, TAG), lambda: comm.Irecv(buf, 1, TAG)])


@ONE_TRANSPORT
def test_array_of_objects_refused(peer):
    objects = np.array([None, 1], dtype=object)
    refused(peer, BufferError, "Python objects", [
        lambda: peer.comm.Send(objects, 1, TAG), lambda: peer.comm.Recv(objects, 1, TAG)])


@ONE_TRANSPORT
def test_transposed_array_refused(peer):
    refused(peer, BufferError, "not C-contiguous", [
        lambda: peer.comm.Send(np.zeros((8, 8), np.uint8).T, 1, TAG)])


@ONE_TRANSPORT
def test_receive_buffer_too_small_is_truncation(peer):
    """The message is consumed (as MPI does) and the error says so; the next one arrives."""
    peer.start(op_send, 1000)
    small = np.zeros(10, np.uint8)
    with pytest.raises(TruncationError, match="does not fit the 10-byte receive buffer"):
        peer.comm.Recv(small, source=1, tag=TAG)
    peer.result()
    assert not small.any()
    round_trip(peer)


# ------------------------------------------------------------------ larger than memory

def beyond_memory() -> np.ndarray:
    """Bytes more than this machine's RAM plus swap, at no cost: a sparse memfd mapped
    shared, whose pages exist only once written (none is). A file mapping can be as large."""
    nbytes = _linux.memory_bytes() + (1 << 30)
    fd = os.memfd_create("cma-test-beyond-memory")
    try:
        os.ftruncate(fd, nbytes)
        return np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
    finally:
        os.close(fd)


def op_send_beyond_memory(comm: cma.Comm) -> None:
    comm.Send(beyond_memory(), dest=0, tag=TAG)


@ONE_TRANSPORT
def test_an_object_larger_than_memory_refused_before_sending(peer):
    """Its receiver would have to allocate it: refused at the sender, nothing sent. Before,
    the RTS went out and the receiver broke the communicator with a ProtocolError blaming
    the sender (bsend: numpy's MemoryError from copying it)."""
    comm, huge = peer.comm, {"array": beyond_memory()}
    refused(peer, MessageTooLarge, "object's receiver allocates .* more than this machine's "
            "memory and swap", [lambda: comm.isend(huge, 1, TAG), lambda: comm.send(huge, 1, TAG),
                                lambda: comm.issend(huge, 1, TAG), lambda: comm.bsend(huge, 1, TAG)])


@ONE_TRANSPORT
def test_a_buffered_send_larger_than_memory_refused_before_copying(peer):
    """Bsend copies the message, as a blocking Send to oneself does: refused before the
    copy (Python's MemoryError from bytearray before, or the copy itself where it fit)."""
    comm, huge = peer.comm, beyond_memory()
    refused(peer, MessageTooLarge, "copies its message first", [
        lambda: comm.Bsend(huge, 1, TAG), lambda: comm.Ibsend(huge, 1, TAG),
        lambda: comm.Send(huge, 0, TAG)])


@ONE_TRANSPORT
def test_an_object_receive_of_a_message_larger_than_memory_consumes_it(peer):
    """A buffer message may be larger than memory (from a file mapping); an object receive
    (recv) would allocate it: MessageTooLarge, the message consumed as in truncation and
    its sender released. Before, a ProtocolError blamed the sender and broke the pair."""
    peer.start(op_send_beyond_memory)
    with pytest.raises(MessageTooLarge, match="matched an object receive.*it was consumed"):
        peer.comm.recv(source=1, tag=TAG)
    peer.result()
    round_trip(peer)


@ONE_TRANSPORT
def test_sendrecv_with_a_bad_receive_buffer_sends_nothing(peer):
    """Sendrecv sent first and then refused the receive buffer: the message had gone out."""
    with pytest.raises(BufferError, match="read-only"):
        peer.comm.Sendrecv(pattern(100), 1, TAG, b"x" * 100, 1, TAG)
    with pytest.raises(InvalidRank):
        peer.comm.Sendrecv(pattern(100), 1, TAG, np.zeros(100, np.uint8), 7, TAG)
    round_trip(peer)  # (a message sent by the refused call would be received here instead)


# ------------------------------------------------------------------ the communicator itself

def test_use_after_close_refused():
    a, b = cma.Pipe()
    a.close()
    b.close()
    for call in (lambda: a.Send(bytearray(8), 1), lambda: a.Isend(bytearray(8), 1),
                 lambda: a.Recv(np.zeros(8), 1), lambda: a.Barrier(), lambda: a.Iprobe(),
                 lambda: a.send("x", 1)):
        with pytest.raises(CommClosed, match="closed"):
            call()
    a.close()  # closing twice is allowed, as a file's close is


def test_attached_send_and_isend_after_close_refused():
    """An attached end kept its fast lanes after close(): Isend of a bytearray then wrote
    into a released view (ValueError)."""
    a = cma.Comm(cma.world.WorldFds.create(1), 0)
    a.Send(bytearray(8), 0, TAG)
    a.Recv(bytearray(8), 0, TAG)
    a.close()
    for call in (lambda: a.Isend(bytearray(8), 0, TAG), lambda: a.Send(bytearray(8), 0, TAG),
                 lambda: a.Recv(bytearray(8), 0, TAG)):
        with pytest.raises(CommClosed):
            call()


@pytest.mark.timeout(60)
def test_blocking_rendezvous_send_to_oneself_completes():
    """It waited for ever for the receive its own process could only post afterwards."""
    comm = cma.Comm(cma.world.WorldFds.create(1), 0)
    try:
        comm.Send(pattern(RENDEZVOUS), 0, TAG)
        got = np.zeros(RENDEZVOUS, np.uint8)
        comm.Recv(got, 0, TAG)
        assert digest(got) == digest(pattern(RENDEZVOUS))
    finally:
        comm.close()


def _use_in_child(comm: cma.Comm) -> None:
    try:
        comm.Send(pattern(100), 1, TAG)
    except CommBroken as exc:
        ok = "forked from it cannot use" in str(exc)
        comm.close()  # releases the child's copies only
        os._exit(0 if ok else 2)
    os._exit(1)


@ONE_TRANSPORT
def test_attached_communicator_in_a_fork_child_refused(peer):
    """A child forked from a process with an attached end inherits it but not the rank:
    the child's calls raise CommBroken, and the parent's end keeps working."""
    child = mp.get_context("fork").Process(target=_use_in_child, args=(peer.comm,))
    child.start()
    stop_process(child)
    assert child.exitcode == 0
    round_trip(peer)


def test_one_end_attached_by_two_processes_refused():
    a, b = cma.Pipe(transport="shm")
    user = mp.get_context("fork").Process(target=op_recv, args=(b, 100))
    try:
        user.start()
        a.Send(pattern(100, 5), 1, TAG)  # once sent, the child's b is attached
        with pytest.raises(CmaError, match="already attached in another process"):
            b.attach()
    finally:
        stop_process(user)
        a.close()
        b.close()


def test_bad_channel_config_refused():
    for config in (cma.ChannelConfig(ring_bytes=5000), cma.ChannelConfig(eager_limit=8 << 20),
                   cma.ChannelConfig(frag_size=100)):
        with pytest.raises(InvalidConfig):
            cma.Pipe(config=config)


def test_unknown_transport_refused():
    with pytest.raises(TransportUnavailable, match="unknown transport 'nope'"):
        cma.Pipe(transport="nope")


# ------------------------------------------------------------------ requests

@ONE_TRANSPORT
@pytest.mark.parametrize("nbytes", [100, RENDEZVOUS], ids=["eager", "rendezvous"])
def test_a_second_wait_of_a_completed_request_returns_at_once(peer, nbytes):
    """As mpi4py: a completed request is inactive (REQUEST_NULL there); Wait and Test of it
    return at once with an empty status, and wait() gives None: nothing is received twice."""
    peer.start(op_send, nbytes)
    buf = np.zeros(nbytes, np.uint8)
    request = peer.comm.Irecv(buf, source=1, tag=TAG)
    status = cma.Status()
    request.Wait(status)
    assert (status.source, status.tag, status.count) == (1, TAG, nbytes)
    peer.result()
    for again in (request.Wait, request.Test):
        status = cma.Status()
        assert again(status) is True
        assert (status.source, status.tag, status.count) == (cma.ANY_SOURCE, cma.ANY_TAG, 0)
    assert digest(buf) == digest(pattern(nbytes))
    objects = peer.comm.irecv(source=1, tag=TAG)
    peer.start(op_send_object)
    assert objects.wait() == {"x": 1}
    assert objects.wait() is None and objects.test() == (True, None)
    peer.result()
    round_trip(peer)


def op_send_object(comm: cma.Comm) -> None:
    comm.send({"x": 1}, dest=0, tag=TAG)


@ONE_TRANSPORT
def test_waitany_of_no_active_request_is_undefined(peer):
    """mpi4py's Request.Waitany([]) returns MPI.UNDEFINED (was a plain ValueError here);
    so does a list of requests all completed already."""
    status = cma.Status()
    status._fill(1, TAG, 5)
    assert cma.Request.Waitany([], status) == cma.UNDEFINED == -32766
    assert (status.source, status.tag, status.count) == (cma.ANY_SOURCE, cma.ANY_TAG, 0)
    assert cma.Request.waitany([]) == (cma.UNDEFINED, None)
    peer.start(op_send, 100)
    done = [peer.comm.Irecv(np.zeros(100, np.uint8), source=1, tag=TAG)]
    assert cma.Request.Waitany(done) == 0
    peer.result()
    assert cma.Request.Waitany(done) == cma.UNDEFINED
    round_trip(peer)

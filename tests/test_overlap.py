"""overlap=True: the receiver's pull runs on a background thread, so an Irecv of a large
message proceeds while the caller computes and makes no cma call."""

import contextlib
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
from conftest import (
    JOIN_TIMEOUT,
    NO_TWO_WAY_PTRACE,
    SMALL_RING,
    TWO_WAY_PTRACE,
    receive_what_was_queued,
    send_more_than_the_ring_holds,
    stop_process,
)

import cma
from cma.errors import CmaError, TransportUnavailable
from cma.transports import REGISTRY

NBYTES = 24 << 20  # above the eager limit and the SPLIT point, small enough to be quick
SMALL = 3 << 20  # above the eager limit, below auto's cma threshold
PULLERS = [n for n in REGISTRY.practical() if "pull" in REGISTRY.classes[n].styles]


def expected(nbytes: int = NBYTES) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) % 251).astype(np.uint8)


def _send_then_wait(comm, nbytes=NBYTES):
    comm.Send(expected(nbytes), dest=0, tag=1)
    comm.recv(source=0, tag=2)
    comm.close()


def _send_then_exit(comm):
    comm.Send(expected(), dest=0, tag=1)
    comm.close()


@contextlib.contextmanager
def sender(transport: str, nbytes: int = NBYTES):
    """Rank 0 of an overlap Pipe whose rank 1 sends one ``nbytes`` message (tag 1)."""
    a, b = cma.Pipe(transport=transport, overlap=True)
    p = mp.get_context("fork").Process(target=_send_then_wait, args=(b, nbytes))
    try:
        p.start()
        b.close()
        try:
            a.attach()
        except TransportUnavailable as exc:
            pytest.skip(f"{transport} is not usable here: {exc}")
        yield a
        a.send("done", dest=1, tag=2)
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        stop_process(p)
        a.close()


@pytest.mark.parametrize("transport", [*PULLERS, pytest.param("auto", marks=pytest.mark.skipif(
    not TWO_WAY_PTRACE, reason=NO_TWO_WAY_PTRACE))])
def test_overlapped_irecv_delivers_while_the_caller_computes(transport):
    """After Irecv matched the message, the bytes arrive while this process only polls
    its own buffer (no cma call); Wait then completes it. (That the copy is not done
    inside Irecv is what test_irecv_returns_before_the_copy proves.)"""
    with sender(transport) as comm:
        comm.Probe(source=1, tag=1)  # the RTS is here, so Irecv matches at once
        buf = np.zeros(NBYTES, np.uint8)
        req = comm.Irecv(buf, source=1, tag=1)
        want = expected()
        deadline = time.monotonic() + 60
        probes = [0, NBYTES // 3, NBYTES // 2, NBYTES - 1]  # both halves of a SPLIT
        while any(buf[i] != want[i] for i in probes) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(buf[i] == want[i] for i in probes), "nothing arrived without a cma call"
        st = cma.Status()
        req.Wait(st)
        assert st.count == NBYTES and np.array_equal(buf, want)
        mechanism = comm.transports()[1]["uses"] if transport == "auto" else transport
        assert comm.stats()[mechanism]["messages"] == 1


@pytest.fixture
def gate(monkeypatch):
    """Hold every pull of this process until the test opens the gate."""
    opened = threading.Event()
    for cls in (REGISTRY.classes[n] for n in PULLERS):
        original = cls.read

        def held(self, peer, remote, local, _original=original):
            if not opened.wait(30):
                raise AssertionError("the gate was never opened")
            return _original(self, peer, remote, local)

        monkeypatch.setattr(cls, "read", held)
    return opened


@pytest.mark.parametrize("transport", PULLERS)
def test_irecv_returns_before_the_copy(transport, gate):
    """A synchronous pull would block Irecv on the closed gate (and fail after 30 s)."""
    with sender(transport) as comm:
        comm.Probe(source=1, tag=1)
        buf = np.zeros(NBYTES, np.uint8)
        req = comm.Irecv(buf, source=1, tag=1)
        assert not req.Test()
        gate.set()
        req.Wait()
        assert np.array_equal(buf, expected())


@pytest.fixture
def failed_copy(monkeypatch):
    """The vmfd transport's reads fail; yields the receive request of a message whose
    copy has been handed to the copy thread (and fails there)."""

    def broken(self, peer, remote, local):
        raise CmaError("injected copy failure")

    monkeypatch.setattr(REGISTRY.classes["vmfd"], "read", broken)
    with sender("vmfd") as comm:
        comm.Probe(source=1, tag=1)
        yield comm, comm.Irecv(np.zeros(NBYTES, np.uint8), source=1, tag=1)
    # leaving `sender` asserts the peer's Send returned and it exited cleanly


def test_a_failed_background_copy_raises_in_wait(failed_copy):
    """The copy thread's error fails that receive, in its Wait, and FIN still releases
    the sender (as for a truncated message)."""
    _, req = failed_copy
    with pytest.raises(CmaError, match="injected copy failure"):
        req.Wait()


def test_an_unrelated_call_does_not_raise_a_failed_copy(failed_copy):
    comm, req = failed_copy
    for _ in range(200):  # 1 s of progress through other calls (the read fails at once)
        assert not comm.Iprobe(source=1, tag=99)  # must not raise the receive's error
        time.sleep(0.005)
    with pytest.raises(CmaError, match="injected copy failure"):
        req.Wait()


@pytest.mark.skipif(not TWO_WAY_PTRACE, reason=NO_TWO_WAY_PTRACE)
def test_overlap_under_auto_pulls_instead_of_staging():
    """A pipeline needs both processes inside cma calls; with overlap auto takes cma
    from the eager limit up (here a 3 MiB message, which auto otherwise stages)."""
    with sender(cma.AUTO, nbytes=SMALL) as comm:
        buf = np.zeros(SMALL, np.uint8)
        comm.Recv(buf, source=1, tag=1)
        assert np.array_equal(buf, expected(SMALL))
        assert comm.stats()["cma"]["messages"] == 1, "overlap under auto did not pull with cma"


def test_close_with_a_pull_in_flight_releases_the_sender(gate):
    """close() lets the copy finish and sends its FIN, so the sender's Send returns."""
    a, b = cma.Pipe(transport="vmfd", overlap=True)
    p = mp.get_context("fork").Process(target=_send_then_exit, args=(b,))
    try:
        p.start()
        b.close()
        a.Probe(source=1, tag=1)
        a.Irecv(np.zeros(NBYTES, np.uint8), source=1, tag=1)
        gate.set()
        a.close()
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0, "the sender never got its FIN"
    finally:
        stop_process(p)
        a.close()


def _pull_arrives_during_close(comm, closing):
    comm.attach()
    assert closing.wait(JOIN_TIMEOUT)
    comm.Send(expected(), dest=0, tag=1)  # returns on the FIN of a pull made inside close()
    receive_what_was_queued(comm, source=0, tag=2)
    comm.close()


def test_pull_matched_while_close_drains_copies_at_once():
    """Behind the shut-down copy thread, close() must not start another one."""
    a, b = cma.Pipe(transport="vmfd", config=SMALL_RING, overlap=True)
    closing = mp.get_context("fork").Event()
    p = mp.get_context("fork").Process(target=_pull_arrives_during_close, args=(b, closing))
    try:
        p.start()
        b.close()
        buf = np.zeros(NBYTES, np.uint8)
        a.Irecv(buf, source=1, tag=1)
        send_more_than_the_ring_holds(a, dest=1, tag=2)
        closing.set()
        a.close()  # drains the queue, so it takes rank 1's RTS and matches the Irecv
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
        assert np.array_equal(buf, expected())
        assert not [t.name for t in threading.enumerate() if t.name.startswith("cma-pull")]
    finally:
        stop_process(p)
        a.close()

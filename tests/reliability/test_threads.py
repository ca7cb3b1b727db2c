"""Two threads on one communicator at once (#23): the second thread's call raises
``ConcurrentUse`` before it touches anything, and the communicator keeps working.

The test process is rank 0 (the ``peer`` fixture's child is rank 1). Every wait is
bounded: threads are joined with a timeout, and a test that fails marks its peer broken,
which the fixture kills.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import wait_asleep_in_poll

import cma
from cma.comm import _shared_fds
from cma.direct import DIRECT_FROM
from cma.errors import ConcurrentUse
from cma.world import WorldFds

TAG = 11
STOP_TAG = 3
EAGER = 1000
RENDEZVOUS = 4 << 20  # above the 2 MiB eager limit of cma.Pipe's default configuration
RACE_SENDS = 20_000  # per thread
JOIN_TIMEOUT = 60.0
SECOND_CALL_TIMEOUT = 10.0  # a refusal takes microseconds; without the check a Recv blocks

ONE_TRANSPORT = pytest.mark.parametrize("transport", ["shm"], scope="module")


def pattern(nbytes: int, seed: int = 3) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).copy()


def digest(buf: np.ndarray) -> str:
    return hashlib.sha256(buf).hexdigest()


# ------------------------------------------------------------------ what the peer runs

def op_send_when(comm: cma.Comm, path: str, nbytes: int) -> None:
    """Send pattern(nbytes) to rank 0 once ``path`` exists (the test's go-ahead, which
    cannot come through the communicator: rank 0 is blocked in it)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)
    comm.Send(pattern(nbytes), dest=0, tag=TAG)


def op_recv(comm: cma.Comm, nbytes: int) -> str:
    buf = np.zeros(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=TAG)
    return digest(buf)


def op_check_race(comm: cma.Comm, nbytes: int = 16) -> dict[int, int]:
    """Receive the race's messages (at most ``nbytes`` each): on tag k, (k, i) with i the
    next of k's sequence in their first 16 bytes, until STOP_TAG brings the counts sent.
    Raises on the first message out of place."""
    buf = np.zeros(nbytes // 8, np.int64)
    status = cma.Status()
    seen = {1: 0, 2: 0}
    while True:
        comm.Recv(buf, source=0, tag=cma.ANY_TAG, status=status)
        tag = status.tag
        if tag == STOP_TAG:
            sent = {1: int(buf[0]), 2: int(buf[1])}
            assert seen == sent, f"received {seen}, sent {sent}"
            return seen
        assert tag in seen and buf[0] == tag and buf[1] == seen[tag], \
            f"message {buf[:2].tolist()} with tag {tag}; expected ({tag}, {seen.get(tag)})"
        seen[tag] += 1


def round_trip(peer: Any, nbytes: int = 100) -> None:
    """The communicator still works both ways."""
    peer.start(op_recv, nbytes)
    peer.comm.Send(pattern(nbytes, 5), dest=1, tag=TAG)
    assert peer.result() == digest(pattern(nbytes, 5))


# ------------------------------------------------------------------ one thread waits

def _iprobe(comm: cma.Comm) -> None:
    comm.Iprobe(1, TAG + 1)


SECOND_CALLS: dict[str, Callable[[cma.Comm], object]] = {
    "Send": lambda comm: comm.Send(pattern(EAGER), dest=1, tag=TAG + 1),
    "Send-rendezvous": lambda comm: comm.Send(pattern(RENDEZVOUS), dest=1, tag=TAG + 1),
    "Isend": lambda comm: comm.Isend(pattern(EAGER), dest=1, tag=TAG + 1),
    "Recv": lambda comm: comm.Recv(np.zeros(EAGER, np.uint8), source=1, tag=TAG + 1),
    "Irecv": lambda comm: comm.Irecv(np.zeros(EAGER, np.uint8), source=1, tag=TAG + 1),
    "send": lambda comm: comm.send({"x": 1}, dest=1, tag=TAG + 1),
    "Iprobe": _iprobe,
    "Barrier": lambda comm: comm.Barrier(),
    "close": lambda comm: comm.close(),
}


@ONE_TRANSPORT
@pytest.mark.timeout(90)
@pytest.mark.parametrize("nbytes", [EAGER, RENDEZVOUS], ids=["eager", "rendezvous"])
@pytest.mark.parametrize("call", list(SECOND_CALLS))
def test_a_call_from_a_second_thread_is_refused_while_one_waits(peer, tmp_path, nbytes, call):
    go = tmp_path / "go"
    peer.start(op_send_when, str(go), nbytes)
    got = np.zeros(nbytes, np.uint8)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            peer.comm.Recv(got, source=1, tag=TAG)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def second() -> None:
        try:
            SECOND_CALLS[call](peer.comm)
            outcome.append("returned")
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    outcome: list[object] = []
    waiter = threading.Thread(target=receive, daemon=True)
    waiter.start()
    try:
        assert waiter.native_id is not None
        wait_asleep_in_poll(os.getpid(), waiter.native_id, "the receiving thread")
        intruder = threading.Thread(target=second, daemon=True)  # (it may block: bounded)
        intruder.start()
        intruder.join(SECOND_CALL_TIMEOUT)
        assert outcome, f"{call} from a second thread blocked"
        assert isinstance(outcome[0], ConcurrentUse), outcome[0]
        assert "two threads at once" in str(outcome[0])
    finally:
        go.touch()
        waiter.join(JOIN_TIMEOUT)
    assert not waiter.is_alive(), "the first thread's Recv did not finish"
    assert not errors, errors
    assert digest(got) == digest(pattern(nbytes))
    peer.result()
    round_trip(peer)  # usable afterwards, from this thread or any other
    round_trip(peer, RENDEZVOUS)


# ------------------------------------------------------------------ two threads race

@pytest.fixture
def fast_switches() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms, so that the race's threads interleave
    inside calls (a switch inside put_eager corrupted the ring within a few hundred)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def race(peer: Any, nbytes: dict[int, int], counts: dict[int, int]) -> None:
    """Threads 1 and 2 Send counts[k] messages of nbytes[k] bytes each (k, i first) on one
    communicator; each Send that raises ConcurrentUse is retried. The peer checks every
    message: all arrive, in order, intact, and at least one Send was refused (the threads
    did meet)."""
    peer.start(op_check_race, max(nbytes.values()))
    refused = {1: 0, 2: 0}
    done: dict[int, bool] = {}

    def sender(k: int) -> None:
        msg = np.zeros(nbytes[k] // 8, np.int64)
        msg[0] = k
        for i in range(counts[k]):
            msg[1] = i
            while True:
                try:
                    peer.comm.Send(msg, dest=1, tag=k)
                    break
                except ConcurrentUse:
                    refused[k] += 1
        done[k] = True

    threads = [threading.Thread(target=sender, args=(k,), daemon=True) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a sending thread did not finish"
    assert done == {1: True, 2: True}
    peer.comm.Send(np.array([counts[1], counts[2]], np.int64), dest=1, tag=STOP_TAG)
    assert peer.result() == counts
    assert sum(refused.values()) > 0, "the two threads never met inside a call"
    round_trip(peer)


@ONE_TRANSPORT
@pytest.mark.timeout(180)
def test_two_threads_sending_at_once_lose_and_corrupt_nothing(peer, fast_switches):
    """Two threads Send RACE_SENDS eager messages each on one communicator (race)."""
    race(peer, {1: 16, 2: 16}, {1: RACE_SENDS, 2: RACE_SENDS})


@pytest.mark.parametrize("transport", ["auto"], scope="module")
@pytest.mark.timeout(180)
def test_a_thread_in_direct_sends_and_one_in_eager_sends_corrupt_nothing(peer, fast_switches):
    """As above, with thread 1's messages large enough for the direct rendezvous (its RTS
    written into the ring, its FIN taken from the other): a thread switch between the
    test of the busy word and its setting let the other thread write into the same ring
    (found by review on Python 3.11 in runs of 60-120 s; on 3.10 the test above failed)."""
    race(peer, {1: DIRECT_FROM, 2: 16}, {1: RACE_SENDS // 40, 2: RACE_SENDS})


# ------------------------------------------------------------------ one thread, nested

class Hooked(cma.Comm):
    """Calls back into itself from the completion hook, which runs inside a call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: list[tuple[str, str]] = []

    def operation_completed(self, op: Any) -> None:
        """``connect`` (a no-op once connected, but an entry that claims the communicator)
        from this thread, nested in its call, and from another thread at that moment."""
        def attempt() -> str:
            try:
                self.connect(1)
            except ConcurrentUse:
                return "ConcurrentUse"
            return "passed"

        outcome: list[str] = []
        other = threading.Thread(target=lambda: outcome.append(attempt()))
        other.start()
        other.join(JOIN_TIMEOUT)
        self.outcomes.append((attempt(), outcome[0] if outcome else "hung"))


@pytest.mark.timeout(60)
def test_a_call_nested_in_the_same_threads_call_passes():
    """Sendrecv of objects (which the engine completes, running the hook) with a hook that
    calls back into the communicator: the same thread's nested call passes, another
    thread's at that moment is refused; Sendrecv of buffers works as before."""
    fds = WorldFds.create(2)
    a = Hooked(fds, 0, "shm")
    b = cma.Comm(_shared_fds(fds), 1, "shm")
    answers: list[Any] = []

    def rank1() -> None:  # (a communicator of its own: rank 1 in this thread only)
        answers.append(b.sendrecv("from 1", dest=0, source=0))
        got = np.zeros(EAGER, np.uint8)
        b.Sendrecv(pattern(EAGER, 1), dest=0, recvbuf=got, source=0)
        answers.append(digest(got))

    t = threading.Thread(target=rank1, daemon=True)
    try:
        t.start()
        assert a.sendrecv("from 0", dest=1, source=1) == "from 1"
        got = np.zeros(EAGER, np.uint8)
        a.Sendrecv(pattern(EAGER, 0), dest=1, recvbuf=got, source=1)
        t.join(JOIN_TIMEOUT)
        assert not t.is_alive()
        assert answers == ["from 0", digest(pattern(EAGER, 0))]
        assert digest(got) == digest(pattern(EAGER, 1))
        assert a.outcomes and set(a.outcomes) == {("passed", "ConcurrentUse")}, a.outcomes
    finally:
        a.close()
        b.close()

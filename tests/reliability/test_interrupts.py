"""Ctrl-C (SIGINT) in a rank blocked in cma, and what the communicator is like afterwards.

Each test forks rank 1 of a fresh ``cma.Pipe`` (the test process is rank 0), lets it
block, sends it SIGINT with ``os.kill`` and checks that ``KeyboardInterrupt`` came out
of the blocking call soon, that the abandoned operation did not take the message meant
for the next call, and that the child exits. Every wait here is bounded and the child
is killed in teardown, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from _peers import pause_copies_for_a_signal
from conftest import TRANSPORTS, sigint_when_asleep, stop_process

import cma
from cma.errors import Cancelled, CommBroken, PeerGone
from cma.progress import Progress

TAG = 7
EAGER_SIZE = 1000
LARGE_SIZE = 64 << 20  # a rendezvous with every transport (the eager limit is 2 MiB)
QUEUED_SENDS = 12  # of 1 MiB: 8 fill the 8 MiB ring (with headers, 7), the rest queue
COPY_SIZE = 136 << 20  # over one copy call (64 MiB) with every transport (SPLIT: the half)
FILL = 0x5A  # COPY_SIZE bytes of it: cheaper to make and check than a pattern
SETTLE_SECONDS = 0.3  # time for the child to go from "ready" to sleeping in its wait
# Issue #23 asks for 0.1 s; a wait sleeps 10 ms at a time and SIGINT ends the sleep at once,
# so it takes ~1 ms (docs/reliability.md). 0.5 s leaves room for a loaded 2-CPU machine and
# still fails a wait that sleeps through the signal for a second.
INTERRUPT_BOUND = 0.5
REPLY_TIMEOUT = 20.0
IDLE_PASSES_SECONDS = 0.5  # some 50 wake-ups of a waiting rank (every 10 ms)


def pattern(nbytes: int, seed: int = 1) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).copy()


def digest(buf: np.ndarray) -> str:
    return hashlib.sha256(buf).hexdigest()


def until_interrupted(conn: Connection, blocking: Callable[[], Any]) -> float:
    """Tell the test we are about to block, block, and return when SIGINT arrived."""
    conn.send(("ready", 0.0))
    try:
        blocking()
    except KeyboardInterrupt:
        arrived = time.monotonic()
        conn.send(("interrupted", arrived))
        return arrived
    raise AssertionError("the blocking call returned instead of being interrupted")


# ------------------------------------------------------------------ what rank 1 runs

def recv_abandoned(comm: cma.Comm, conn: Connection, nbytes: int, call: str) -> Any:
    """A receive interrupted before any message came; then a fresh one takes the message."""
    abandoned = np.zeros(nbytes, np.uint8)
    if call == "Recv":
        until_interrupted(conn, lambda: comm.Recv(abandoned, source=0, tag=TAG))
        request_error = None
    else:
        request = comm.Irecv(abandoned, source=0, tag=TAG)
        until_interrupted(conn, request.Wait)
        try:
            request.Wait()
            request_error = "none"
        except Cancelled:
            request_error = "Cancelled"
    fresh = np.zeros(nbytes, np.uint8)
    comm.Recv(fresh, source=0, tag=TAG)
    return digest(fresh), bool(abandoned.any()), request_error


def barrier_abandoned(comm: cma.Comm, conn: Connection, nbytes: int, call: str) -> Any:
    """A Barrier interrupted while the peer is elsewhere; the next Barrier pairs with the peer's
    second one (the abandoned round completes in the background), then a message."""
    until_interrupted(conn, comm.Barrier)
    comm.Barrier()
    fresh = np.zeros(nbytes, np.uint8)
    comm.Recv(fresh, source=0, tag=TAG)
    return digest(fresh), False, None


def send_wait_abandoned(comm: cma.Comm, conn: Connection, nbytes: int, call: str) -> Any:
    """The Wait of a large send interrupted before the peer receives: the send is not
    withdrawn (the peer knows of it) and completes while this rank waits for the next message."""
    request = comm.Isend(pattern(nbytes), dest=0, tag=TAG)
    until_interrupted(conn, request.Wait)
    fresh = np.zeros(EAGER_SIZE, np.uint8)
    comm.Recv(fresh, source=0, tag=TAG + 1)
    request.Wait()
    return digest(fresh), False, None


def recv_interrupted_mid_packet(comm: cma.Comm, conn: Connection, nbytes: int, call: str) -> Any:
    """An interrupt raised while the rank handles a packet (as SIGINT can, between any two
    bytecodes): the communicator must refuse further use, clearly, and still close."""
    comm.attach()
    progress = comm._progress
    assert progress is not None
    handle = progress.drain

    def drain_then_interrupt(peer: int, only_expected: bool) -> bool:
        if progress.inboxes[peer].ready():
            raise KeyboardInterrupt  # stands in for a signal arriving at this point
        return handle(peer, only_expected)

    progress.drain = drain_then_interrupt  # type: ignore[method-assign]
    conn.send(("ready", 0.0))
    try:
        # (posted: a blocking Recv takes a late message at the head of its ring itself, as
        # its fast path does, and never hands it to drain)
        comm.Irecv(np.zeros(nbytes, np.uint8), source=0, tag=TAG).Wait()
        return "no interrupt", False, None
    except KeyboardInterrupt:
        conn.send(("interrupted", time.monotonic()))
    try:
        comm.Recv(np.zeros(nbytes, np.uint8), source=0, tag=TAG)
    except CommBroken as exc:
        return str(exc), False, None
    return "usable", False, None


def recv_interrupted_in_an_idle_pass(comm: cma.Comm, conn: Connection, nbytes: int,
                                     call: str) -> Any:
    """As recv_abandoned, but once asleep any pass over the rings that finds nothing to take
    is interrupted: SIGINT lands there about once in 100 runs (the wait wakes every 10 ms).
    Such a pass holds nothing half done, so the communicator must stay usable."""
    comm.attach()
    progress = comm._progress
    assert progress is not None
    handle, sleep = progress.drain, progress.world.sleep
    slept = []

    def drain(peer: int, only_expected: bool) -> bool:
        if slept and not progress.inboxes[peer].ready():
            raise KeyboardInterrupt  # stands in for a signal arriving in an empty pass
        return handle(peer, only_expected)

    def sleep_(timeout_ms: int) -> list[int]:
        slept.append(1)
        return sleep(timeout_ms)

    progress.drain = drain  # type: ignore[method-assign]
    progress.world.sleep = sleep_  # type: ignore[method-assign]
    abandoned = np.zeros(nbytes, np.uint8)
    until_interrupted(conn, lambda: comm.Recv(abandoned, source=0, tag=TAG))
    progress.drain, progress.world.sleep = handle, sleep  # type: ignore[method-assign]
    fresh = np.zeros(nbytes, np.uint8)
    comm.Recv(fresh, source=0, tag=TAG)
    return digest(fresh), bool(abandoned.any()), None


def recv_interrupted_mid_copy(comm: cma.Comm, conn: Connection, nbytes: int, call: str) -> Any:
    """A receive interrupted between two calls of its copy (the copy pauses there until the
    test's SIGINT comes); then whether the communicator is usable (an eager message
    arrives) or refuses use with CommBroken."""
    buf = np.zeros(nbytes, np.uint8)
    comm.attach()
    pause_copies_for_a_signal(comm, lambda: conn.send(("copying", 0.0)))
    until_interrupted(conn, lambda: comm.Recv(buf, source=0, tag=TAG))
    try:
        comm.Iprobe(0, TAG + 1)
    except CommBroken as exc:
        return "broken", str(exc), None
    small = np.zeros(EAGER_SIZE, np.uint8)
    comm.Recv(small, source=0, tag=TAG + 1)
    return "usable", digest(small), bool((buf == FILL).all())


def _cma_resources(world_id: str) -> tuple[set[str], int]:
    """This process's open fds, each as what it points to, and how many mappings of the
    segment of world ``world_id`` (memfd "cma-<id>") it holds. Only that world's: a forked
    child also holds whatever worlds the test process had mapped when it forked (an
    earlier test's, not yet collected), which failed this test in full runs only, as
    unrelated changes moved the collector's timing."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # (the listing's own fd, closed by now)
    name = f"/memfd:cma-{world_id}"
    with open("/proc/self/maps") as maps:
        segments = sum(line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)") == name
                       for line in maps if "/memfd:cma-" in line)
    return fds, segments


def close_interrupted_twice(comm: cma.Comm, conn: Connection, nbytes: int, call: str) -> Any:
    """Ctrl-C twice in what ``with comm: comm.Recv(...)`` does: the first ends the Recv, the
    second the close() that follows, which waits for sends queued behind a full ring to
    reach a peer that is alive but never receives. Returns what close() had released."""
    world_id = comm._fds.world_id
    before, _ = _cma_resources(world_id)  # (the unattached end holds the world's fds already)
    comm.attach()
    payload = pattern(nbytes)
    for _ in range(QUEUED_SENDS):  # (more than the ring holds: the rest stay queued)
        comm.Bsend(payload, dest=0, tag=TAG)
    try:
        until_interrupted(conn, lambda: comm.Recv(np.zeros(EAGER_SIZE, np.uint8), source=0,
                                                  tag=TAG + 1))
        conn.send(("closing", 0.0))
        comm.close()
    except KeyboardInterrupt:
        arrived = time.monotonic()
        conn.send(("interrupted", arrived))
        after, segments = _cma_resources(world_id)
        comm.close()  # (a no-op by now: idempotent, whatever the first call left)
        return sorted(after - before), segments, comm._closed
    raise AssertionError("close() returned: nothing was queued for it to wait for")


def _child(comm: cma.Comm, conn: Connection, scenario: Callable[..., Any], nbytes: int,
           call: str) -> None:
    try:
        comm.attach()
        conn.send(("ok", scenario(comm, conn, nbytes, call)))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
    finally:
        comm.close()
        conn.close()


# ------------------------------------------------------------------ the test side

class Rank1:
    """Rank 1 of a fresh pair, in a forked child, running ``scenario``."""

    def __init__(self, transport: str, scenario: Callable[..., Any], nbytes: int, call: str = ""):
        ctx = mp.get_context("fork")
        self.comm, child_end = cma.Pipe(transport)
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_end, child_conn, scenario, nbytes, call),
                                daemon=True)
        try:
            self.proc.start()
        finally:
            child_end.close()
            child_conn.close()
        self.comm.attach()

    def expect(self, kind: str) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT):
            raise AssertionError(f"rank 1 sent no {kind!r} within {REPLY_TIMEOUT} s (hung?)")
        got, value = self.conn.recv()
        if got == "error":
            raise AssertionError(f"rank 1 raised:\n{value}")
        assert got == kind, (got, value)
        return value

    def interrupt(self) -> float:
        """SIGINT once rank 1 blocks; the seconds until its KeyboardInterrupt."""
        self.expect("ready")
        assert self.proc.pid is not None
        # (asleep in its wait: a fixed pause did not always suffice)
        sent = sigint_when_asleep(self.proc.pid, "rank 1", REPLY_TIMEOUT)
        latency = float(self.expect("interrupted")) - sent
        print(f"KeyboardInterrupt {latency * 1000:.2f} ms after SIGINT")
        return latency

    def close(self) -> None:
        try:
            stop_process(self.proc, 5.0)
        finally:
            self.conn.close()
            self.comm.close()


@pytest.fixture
def rank1() -> Iterator[list[Rank1]]:
    started: list[Rank1] = []
    yield started
    for rank in started:
        rank.close()


def start(started: list[Rank1], *args: Any) -> Rank1:
    rank = Rank1(*args)
    started.append(rank)
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("call", ["Recv", "Irecv"])
@pytest.mark.parametrize("nbytes", [EAGER_SIZE, LARGE_SIZE], ids=["eager", "64MiB"])
def test_interrupted_receive_is_withdrawn(rank1, transport, call, nbytes):
    rank = start(rank1, transport, recv_abandoned, nbytes, call)
    latency = rank.interrupt()
    assert latency < INTERRUPT_BOUND
    sent = pattern(nbytes)
    rank.comm.Send(sent, dest=1, tag=TAG)
    got, abandoned_written, request_error = rank.expect("ok")
    assert got == digest(sent), "the next receive did not get the message"
    assert not abandoned_written, "the message went into the abandoned buffer"
    if call == "Irecv":
        assert request_error == "Cancelled"
    assert rank.proc.join(5) is None and rank.proc.exitcode == 0


@pytest.mark.timeout(60)
def test_an_interrupt_in_an_idle_wait_keeps_the_communicator(rank1):
    rank = start(rank1, "shm", recv_interrupted_in_an_idle_pass, EAGER_SIZE)
    rank.expect("ready")
    # Before the fix the stand-in fires at the first wake-up after 10 ms asleep; after it,
    # no empty pass runs and a real SIGINT ends the wait.
    if not rank.conn.poll(IDLE_PASSES_SECONDS):
        assert rank.proc.pid is not None
        sigint_when_asleep(rank.proc.pid, "rank 1", REPLY_TIMEOUT)
    rank.expect("interrupted")
    sent = pattern(EAGER_SIZE)
    rank.comm.Send(sent, dest=1, tag=TAG)
    got, abandoned_written, _ = rank.expect("ok")
    assert got == digest(sent)
    assert not abandoned_written
    assert rank.proc.join(5) is None and rank.proc.exitcode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_interrupted_barrier(rank1, transport):
    rank = start(rank1, transport, barrier_abandoned, EAGER_SIZE)
    assert rank.interrupt() < INTERRUPT_BOUND
    rank.comm.Barrier()  # pairs with the abandoned one
    rank.comm.Barrier()
    sent = pattern(EAGER_SIZE)
    rank.comm.Send(sent, dest=1, tag=TAG)
    assert rank.expect("ok")[0] == digest(sent)
    rank.proc.join(5)
    assert rank.proc.exitcode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_interrupted_wait_of_a_large_send(rank1, transport):
    rank = start(rank1, transport, send_wait_abandoned, LARGE_SIZE)
    assert rank.interrupt() < INTERRUPT_BOUND
    got = np.zeros(LARGE_SIZE, np.uint8)
    rank.comm.Recv(got, source=1, tag=TAG)
    assert digest(got) == digest(pattern(LARGE_SIZE))
    small = pattern(EAGER_SIZE, 2)
    rank.comm.Send(small, dest=1, tag=TAG + 1)
    assert rank.expect("ok")[0] == digest(small)
    rank.proc.join(5)
    assert rank.proc.exitcode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_second_interrupt_ends_the_close_that_waits_for_queued_sends(rank1, transport):
    rank = start(rank1, transport, close_interrupted_twice, 1 << 20)
    assert rank.interrupt() < INTERRUPT_BOUND  # the Recv
    rank.expect("closing")
    assert rank.proc.pid is not None
    sent = sigint_when_asleep(rank.proc.pid, "rank 1's close()", REPLY_TIMEOUT)
    latency = float(rank.expect("interrupted")) - sent
    print(f"close() interrupted {latency * 1000:.2f} ms after the second SIGINT")
    assert latency < INTERRUPT_BOUND
    left_open, segments_mapped, closed = rank.expect("ok")
    assert closed
    assert left_open == [], f"close() interrupted left these fds open: {left_open}"
    assert segments_mapped == 0, "close() interrupted left the world's segment mapped"
    assert rank.proc.join(5) is None and rank.proc.exitcode == 0


@pytest.mark.timeout(60)
def test_interrupt_while_handling_a_packet_breaks_the_communicator_clearly(rank1):
    rank = start(rank1, "shm", recv_interrupted_mid_packet, EAGER_SIZE)
    rank.expect("ready")
    time.sleep(SETTLE_SECONDS)  # past the receive's fast path, which would take it itself
    rank.comm.Send(pattern(EAGER_SIZE), dest=1, tag=TAG)
    rank.expect("interrupted")
    message, _, _ = rank.expect("ok")
    assert "unusable" in message and "KeyboardInterrupt" in message, message
    rank.proc.join(5)
    assert rank.proc.exitcode == 0  # close() of a broken communicator returned


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_interrupt_during_a_copy_under_way(rank1, transport):
    """SIGINT while rank 1's receive of 136 MiB is partly copied (by itself: cma, vmfd,
    auto's SPLIT; or through shm's staging): KeyboardInterrupt must come out soon; the
    communicator is then usable or refuses use with CommBroken naming the interrupt (a
    copy left half done), and either way this rank's Send ends and rank 1 exits."""
    rank = start(rank1, transport, recv_interrupted_mid_copy, COPY_SIZE)
    rank.expect("ready")
    pid = rank.proc.pid
    assert pid is not None
    sent: list[float] = []

    def interrupt_once_copying() -> None:
        if rank.conn.poll(REPLY_TIMEOUT) and rank.conn.recv()[0] == "copying":
            sent.append(time.monotonic())
            os.kill(pid, signal.SIGINT)

    signaller = threading.Thread(target=interrupt_once_copying, daemon=True)
    signaller.start()
    try:
        rank.comm.Send(np.full(COPY_SIZE, FILL, np.uint8), dest=1, tag=TAG)
        completed = True
    except PeerGone:
        completed = False
    signaller.join(REPLY_TIMEOUT)
    assert sent, "rank 1's copy never paused for the signal"
    latency = float(rank.expect("interrupted")) - sent[0]
    if completed:  # (rank 1 finished the receive it was interrupted in)
        rank.comm.Send(pattern(EAGER_SIZE, 2), dest=1, tag=TAG + 1)
    state, detail, received = rank.expect("ok")
    if state == "broken":
        assert "KeyboardInterrupt" in detail and "unusable" in detail, detail
        assert not completed
    else:
        assert completed and detail == digest(pattern(EAGER_SIZE, 2))
        assert received, "the interrupted receive did not finish into its buffer"
    rank.proc.join(5)
    assert rank.proc.exitcode == 0
    assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency:.3f} s after the signal"
    print(f"{transport}: KeyboardInterrupt {latency * 1000:.1f} ms after SIGINT, then {state}")


@pytest.mark.timeout(120)
def test_the_interrupt_tests_pass_when_started_with_sigint_ignored():
    """A CI script's background job (`cmd &` without job control) starts with SIGINT
    ignored; the interrupt tests' children must still get their KeyboardInterrupt
    (conftest.py restores Python's handler). Before, each such run failed after 20 s."""
    here = os.path.dirname(os.path.abspath(__file__))
    pytest_args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   os.path.join(here, "test_interrupts.py")
                   + "::test_interrupted_receive_is_withdrawn[eager-Recv-shm]"]
    # (a C-level SIG_IGN survives exec, as a shell's `&` hands it on)
    ignore_then_run = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                       "os.execv(sys.executable, sys.argv[1:])")
    result = subprocess.run([sys.executable, "-c", ignore_then_run, *pytest_args],
                            capture_output=True, text=True, timeout=100,
                            cwd=os.path.dirname(os.path.dirname(here)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout, result.stdout[-3000:]


class _Caller:
    _busy = 0  # (the word Progress.wait_until claims: no call under way)


def _raise_a_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # as cma.mpi's deferred SIGINT does, from a frame of its own


def _signal_lands_here() -> None:
    signal.raise_signal(signal.SIGINT)  # (its handler runs on this frame, as it returns)


def _signal_lands_one_call_deeper() -> None:
    _signal_lands_here()


@pytest.mark.parametrize("handler", [signal.default_int_handler, _raise_a_keyboard_interrupt],
                         ids=["Python's handler", "a handler written in Python"])
@pytest.mark.parametrize(("outside", "breaks"), [(_signal_lands_here, False),
                                                 (_signal_lands_one_call_deeper, True)],
                         ids=["in the pass", "in a call the pass makes"])
def test_an_interrupt_in_an_outside_pass_breaks_the_communicator_only_inside_its_calls(
        handler: Any, outside: Callable[[], None], breaks: bool) -> None:
    """A wait's ``outside`` pass (cma.mpi's MPI probe on a mixed rank) is idle in its own
    frame and busy in what it calls, whichever handler raised the KeyboardInterrupt. A
    handler written in Python adds its own frame: that interrupt, landing in the pass's
    frame, broke the communicator (test_interrupts_in_a_mixed_ranks_waits under Open MPI,
    where cma.mpi defers SIGINTs that land in MPI's callbacks, failed 1 run in 20 beside
    two busy loops)."""
    progress = Progress.__new__(Progress)  # (the wait's loop calls ``outside`` first)
    progress.owner = _Caller()  # type: ignore[assignment]
    progress.oversubscribed = False
    progress.rank = 1
    broken: list[str] = []
    progress.break_down = broken.append  # type: ignore[method-assign]
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            progress.wait_until(lambda: False, None, outside=outside)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert bool(broken) == breaks, broken

"""The ptrace teaching transport: against a real child (no Comm), then through a Pipe."""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _peers import NOBODY, PAGE, FakeHost, FakePeer, Target, pattern, run_in_child
from conftest import run_pair

import cma
from cma.errors import BufferError, PeerGone, TransportFault, TransportUnavailable
from cma.transports import REGISTRY
from cma.transports.base import Copies, Region
from cma.transports.ptrace import LOCK_ADDRESS, PtraceTransport, machine_lock, stopped

pytestmark = pytest.mark.timeout(120)

EAGER = cma.ChannelConfig().eager_limit
PTRACE_SEIZE = 0x4206


@pytest.fixture
def target() -> Iterator[Target]:
    with Target() as child:
        yield child


@pytest.fixture
def ptrace() -> PtraceTransport:
    return PtraceTransport(FakeHost())


def tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    raise AssertionError(f"no TracerPid in /proc/{pid}/status")


def test_registered_as_a_pull_only_teaching_transport() -> None:
    assert REGISTRY.classes["ptrace"] is PtraceTransport
    assert PtraceTransport.copies == Copies(user=1, kernel=2)
    assert PtraceTransport.styles == {"pull"}
    assert "ptrace" not in REGISTRY.practical()
    assert REGISTRY.practical() == ["shm", "cma", "vmfd"]


@pytest.mark.parametrize("offset,nbytes", [(0, 8), (0, 4096), (3, 5), (5, 1), (1, 3 * PAGE + 5), (7, 16)])
def test_unaligned_regions_read_exactly_their_bytes(
    target: Target, ptrace: PtraceTransport, offset: int, nbytes: int
) -> None:
    """Each aligned word is peeked once; only the region's bytes land in the buffer."""
    region = target.alloc(offset + nbytes + 8, seed=1)
    received = bytearray(b"\xee" * (nbytes + 2))
    ptrace.read(FakePeer(target), [Region(region.addr + offset, nbytes)],
                [memoryview(received)[1 : 1 + nbytes]])
    assert received[1 : 1 + nbytes] == pattern(offset + nbytes + 8, 1)[offset : offset + nbytes]
    assert received[0] == received[-1] == 0xEE
    words = (offset + nbytes + 7) // 8  # the region starts `offset` bytes into an aligned word
    assert ptrace.stats.syscalls == words + 4  # + seize, interrupt, wait, detach
    assert ptrace.stats.user_copy_bytes == nbytes
    assert ptrace.stats.kernel_copy_bytes == 16 * words


def test_regions_and_buffers_cut_at_different_places(target: Target, ptrace: PtraceTransport) -> None:
    first, second = target.alloc(1001, seed=2), target.alloc(30, seed=3)
    left, right = bytearray(17), bytearray(1014)
    ptrace.read(FakePeer(target), [first, second], [memoryview(left), memoryview(right)])
    assert left + right == pattern(1001, 2) + pattern(30, 3)


def test_the_peer_runs_on_untraced_after_each_read(target: Target, ptrace: PtraceTransport) -> None:
    region = target.alloc(64, seed=4)
    for _ in range(3):
        ptrace.read(FakePeer(target), [region], [memoryview(bytearray(64))])
        assert tracer_of(target.pid) == 0
        assert target.call("dumpable")  # it still answers commands
    assert ptrace.probe(FakePeer(target)) is None
    assert tracer_of(target.pid) == 0


def test_nothing_to_read_does_not_stop_the_peer(target: Target, ptrace: PtraceTransport) -> None:
    ptrace.read(FakePeer(target), [Region(target.alloc(8).addr, 0)], [])
    assert ptrace.stats.syscalls == 0


def test_unmapped_word_is_a_fault_naming_the_address(target: Target, ptrace: PtraceTransport) -> None:
    hole = target.call("hole", 5)
    received = bytearray(2 * PAGE)
    with pytest.raises(TransportFault) as caught:
        ptrace.read(FakePeer(target), [Region(hole, 2 * PAGE)], [memoryview(received)])
    assert caught.value.errno == errno.EFAULT
    assert f"{hole + PAGE:#x}" in str(caught.value)
    assert received[:PAGE] == pattern(PAGE, 5)
    assert tracer_of(target.pid) == 0  # detached on the way out
    assert target.call("dumpable")


def test_a_word_of_all_ones_is_data_not_an_error(target: Target, ptrace: PtraceTransport) -> None:
    region = target.alloc(24)
    target.call("fill", region.addr, 24, 0xFF)
    received = bytearray(24)
    ptrace.read(FakePeer(target), [region], [memoryview(received)])
    assert received == b"\xff" * 24


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_dead_peer_is_peer_gone(target: Target, ptrace: PtraceTransport, reaped: bool) -> None:
    region = target.alloc(PAGE, seed=9)
    peer = FakePeer(target)
    target.exit(reap=reaped)
    assert "exited" in (ptrace.probe(peer) or "")
    with pytest.raises(PeerGone):
        ptrace.read(peer, [region], [memoryview(bytearray(PAGE))])


def test_a_peer_traced_by_someone_else_is_refused_with_the_tracer(
    target: Target, ptrace: PtraceTransport
) -> None:
    region = target.alloc(64, seed=6)

    def other_tracer(ready: threading.Event, done: threading.Event) -> None:
        # the tracer is this thread (a task of its own); its exit detaches the target
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        libc.ptrace.restype = ctypes.c_long
        assert libc.ptrace(PTRACE_SEIZE, target.pid, None, None) == 0
        ready.set()
        done.wait(30)

    ready, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=other_tracer, args=(ready, done))
    thread.start()
    try:
        assert ready.wait(10)
        with pytest.raises(TransportUnavailable, match="already traced by process"):
            ptrace.read(FakePeer(target), [region], [memoryview(bytearray(64))])
    finally:
        done.set()
        thread.join(10)
    assert tracer_of(target.pid) == 0  # the tracer thread's exit detached it


def test_refused_without_ptrace_permission() -> None:
    """A reader that is nobody without capabilities may not trace a root target."""
    with Target() as target:
        region = target.alloc(64, seed=7)

        def reader() -> dict[str, Any]:
            peer = FakePeer(target)
            ptrace = PtraceTransport(FakeHost())
            result: dict[str, Any] = {"probe": ptrace.probe(peer)}
            try:
                ptrace.read(peer, [region], [memoryview(bytearray(64))])
                result["read"] = "read"
            except TransportUnavailable as exc:
                result["read"] = str(exc)
            return result

        result = run_in_child(reader, uid=NOBODY)
        assert tracer_of(target.pid) == 0
    assert "not permitted" in result["probe"] and "PR_SET_DUMPABLE" in result["probe"]
    assert "not permitted" in result["read"]


def test_unusable_buffers_are_refused_before_the_peer_is_stopped(
    target: Target, ptrace: PtraceTransport
) -> None:
    region = target.alloc(64, seed=8)
    peer = FakePeer(target)
    with pytest.raises(BufferError, match="must be equal"):
        ptrace.read(peer, [region], [memoryview(bytearray(63))])
    with pytest.raises(BufferError, match="read-only"):
        ptrace.read(peer, [region], [memoryview(bytes(64))])
    with pytest.raises(TransportFault, match="not valid"):
        ptrace.read(peer, [Region(-1, 64)], [memoryview(bytearray(64))])
    with pytest.raises(NotImplementedError, match="does not pull|does not push"):
        ptrace.write(peer, [memoryview(bytes(64))], [region])
    assert ptrace.stats.syscalls == 0


def test_the_machine_lock_admits_one_holder_and_frees_on_exit() -> None:
    with machine_lock():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises(OSError) as caught:
            probe.bind(LOCK_ADDRESS)
        probe.close()
        assert caught.value.errno == errno.EADDRINUSE
    with machine_lock():  # released: taken again at once
        pass

    def hold_and_die() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(LOCK_ADDRESS)
        os._exit(0)  # no close: the kernel releases the name with the process

    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        hold_and_die()
    os.waitpid(pid, 0)
    with machine_lock():
        pass


def test_a_fork_while_the_lock_is_held_does_not_keep_it() -> None:
    started, tell = os.pipe()
    with machine_lock():
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, after the at-fork hooks
            os.write(tell, b"!")
            time.sleep(5)
            os._exit(0)
    try:
        assert select.select([started], [], [], 10)[0] and os.read(started, 1) == b"!"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.bind(LOCK_ADDRESS)  # EADDRINUSE if the child still held the name
        probe.close()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(started)
        os.close(tell)


def _stop_each_other(other: int, seconds: float) -> int:
    stops, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        with stopped(other, "test"):
            stops += 1
    return stops


def test_two_processes_stopping_each_other_in_a_loop_do_not_deadlock() -> None:
    """Without the machine lock each soon stops the other and both wait for ever."""
    ends = [os.pipe() for _ in range(2)]
    results = os.pipe()
    pids = []
    for k in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                other = int(os.read(ends[k][0], 32))
                os.write(results[1], f"{_stop_each_other(other, 2.0)} ".encode())
                time.sleep(60)  # stay to be stopped by the other until the test kills us
            except BaseException as exc:
                os.write(results[1], f"{type(exc).__name__} ".encode())
            finally:
                os._exit(0)
        pids.append(pid)
    try:
        os.write(ends[0][1], str(pids[1]).encode())
        os.write(ends[1][1], str(pids[0]).encode())
        got = b""
        while got.count(b" ") < 2:
            ready, _, _ = select.select([results[0]], [], [], 30)
            assert ready, f"stuck after {got!r}: {[tracer_of(p) for p in pids]} trace each other"
            got += os.read(results[0], 64)
        assert all(n.isdigit() and int(n) > 0 for n in got.decode().split()), got
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in (*sum(ends, ()), *results):
            os.close(fd)


def _kill_during_read(target: Target, ptrace: PtraceTransport) -> str:
    region = target.alloc(8 << 20)  # ~3 s at a word per system call
    killer = threading.Timer(0.3, os.kill, (target.pid, signal.SIGKILL))
    killer.start()
    try:
        ptrace.read(FakePeer(target), [region], [memoryview(bytearray(region.nbytes))])
    except PeerGone as exc:
        return str(exc)
    finally:
        killer.join()
    return "read completed"


def test_a_peer_killed_mid_copy_is_peer_gone_and_its_parent_keeps_its_status(
    target: Target, ptrace: PtraceTransport
) -> None:
    """We are the target's parent: its exit status stays for our own waitpid."""
    message = _kill_during_read(target, ptrace)
    assert "killed" in message or "exited" in message
    _, status = os.waitpid(target.pid, 0)
    target.pid = -1
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_peer_killed_mid_copy_is_released_to_its_parent() -> None:
    """The reader is not the target's parent: it must let the zombie go at once."""
    with Target() as target:

        def reader() -> tuple[str, int]:
            message = _kill_during_read(target, PtraceTransport(FakeHost()))
            return message, tracer_of(target.pid)  # still readable: we have not reaped it

        message, tracer = run_in_child(reader)
        assert "killed" in message or "exited" in message
        assert tracer == 0
        _, status = os.waitpid(target.pid, 0)
        target.pid = -1
        assert os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.timeout(30)
def test_a_sigchld_handler_that_reaps_does_not_hang_the_copy(target: Target, ptrace: PtraceTransport) -> None:
    """The handler collects the stop report first; /proc still shows the tracing stop."""
    region = target.alloc(64, seed=12)
    stolen: list[int] = []

    def reap(signum: int, frame: object) -> None:
        try:
            while (pid := os.waitpid(-1, os.WNOHANG | 0x40000000)[0]) > 0:  # __WALL
                stolen.append(pid)
        except ChildProcessError:
            pass

    previous = signal.signal(signal.SIGCHLD, reap)
    try:
        for _ in range(5):
            received = bytearray(64)
            ptrace.read(FakePeer(target), [region], [memoryview(received)])
            assert received == pattern(64, 12)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert tracer_of(target.pid) == 0


# ------------------------------------------------------------------ through a Pipe

def _exchange(comm: cma.Comm) -> tuple[bool, dict[str, Any]]:
    """Both ranks send a rendezvous message and receive the other's at the same time."""
    me, other = comm.rank, 1 - comm.rank
    out = np.frombuffer(pattern(EAGER + 13, me), np.uint8)
    back = np.empty(EAGER + 13, np.uint8)
    for _ in range(2):
        comm.Sendrecv(out, dest=other, sendtag=1, recvbuf=back, source=other, recvtag=1)
    ok = back.tobytes() == pattern(EAGER + 13, other)
    stats = comm.stats()["ptrace"]
    comm.close()
    return ok, stats


def test_two_ranks_exchanging_rendezvous_messages_at_once() -> None:
    """Both read at once through Comm (the stop loop above is what catches a missing lock)."""
    results = run_pair("ptrace", None, _exchange, _exchange, timeout=90)
    for ok, stats in results:
        assert ok
        assert stats["messages"] == 2 and stats["kernel_copies"] >= 2.0


def _transports_loaded(comm: cma.Comm) -> tuple[list[str], list[str]]:
    report = comm.transports()[1 - comm.rank]
    loaded = sorted(comm.stats())
    comm.close()
    return report["usable"], loaded


def test_auto_never_loads_it() -> None:
    for usable, loaded in run_pair("auto", None, _transports_loaded, _transports_loaded):
        assert "ptrace" not in usable and "cma" in usable
        assert loaded == ["cma", "eager", "shm", "vmfd"]


def test_a_process_cannot_read_itself_and_is_told_so() -> None:
    """Both ends of a Pipe in one process: every rank refuses at connect time."""
    a, b = cma.Pipe(transport="ptrace")
    refusals: list[str] = []

    def attach(comm: cma.Comm) -> None:
        try:
            comm.attach()
        except TransportUnavailable as exc:
            refusals.append(str(exc))

    threads = [threading.Thread(target=attach, args=(comm,)) for comm in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    a.close()
    b.close()
    assert not any(thread.is_alive() for thread in threads)
    assert len(refusals) == 2
    assert any("cannot trace itself" in refusal for refusal in refusals)

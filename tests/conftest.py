"""Shared fixtures of the multi-process tests.

``peer`` is a long-lived child process (one per transport per module) at rank 1 of a
``cma.Pipe``; the test process is rank 0. The child runs a command loop: it receives
``(function, args)`` as an object message, runs ``function(comm, *args)`` and answers
``("ok", result)`` or ``("error", traceback)``. Functions travel by reference, so they
must be module-level functions of an importable module (the test modules are).

After every test the peer is asked whether anything is left unreceived on either side;
a test that failed gets a fresh peer, so one failure does not cascade.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cma
import cma._linux
from cma.comm import _shared_fds
from cma.errors import FdAlreadyClosed
from cma.transports import REGISTRY
from cma.wire import KIND_MASK
from cma.world import WorldFds

# A shell starts a background job (`cmd &` without job control, as a CI script may) with
# SIGINT ignored, and Python then keeps it ignored: the interrupt tests' children (forked,
# or exec'd, which keeps an ignored signal) would sleep through their SIGINT and fail
# after their timeouts. The tests need Python's own handler, as an interactive run has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The teaching transports (ptrace) make one system call per 8 bytes (~3 MB/s here), so the
# matrix's messages of many MiB would take minutes each; test_transport_ptrace.py covers them.
TRANSPORTS = [*REGISTRY.practical(), "auto"]
# the transports that can also write into the peer (RPUT, push=True)
PUSH_TRANSPORTS = [n for n, cls in REGISTRY.classes.items() if "push" in cls.styles]
CMD_TAG = 1_000_001
RESULT_TAG = 1_000_002
JOIN_TIMEOUT = 10.0
# MPI libraries' own segments (MPICH's, Open MPI's): another job's, not ours to account for
FOREIGN_SHM_PREFIXES = ("mpich_shm_", "sm_segment.")
# A 4 KiB ring: a few 1000-byte messages fill it, and the rest wait in the send queue.
SMALL_RING = cma.ChannelConfig(eager_limit=1024, ring_bytes=4096, frag_size=4096, stage_slots=2)
QUEUED_SENDS = 20


def send_more_than_the_ring_holds(comm, dest, tag):
    """QUEUED_SENDS Sends of 1000 bytes, message i all bytes i: most wait in the queue."""
    for i in range(QUEUED_SENDS):
        comm.Send(np.full(1000, i, np.uint8), dest=dest, tag=tag)


def receive_what_was_queued(comm, source, tag):
    """The messages of send_more_than_the_ring_holds, each checked."""
    buf = np.empty(1000, np.uint8)
    for i in range(QUEUED_SENDS):
        comm.Recv(buf, source=source, tag=tag)
        assert (buf == i).all()


def thread_state(pid: int, tid: int | None = None) -> tuple[str, str]:
    """The scheduler state letter and wait channel of thread ``tid`` of ``pid`` (its main
    thread by default), from /proc: e.g. ("S", "do_epoll_wait"), ("R", "0")."""
    task = f"/proc/{pid}/task/{pid if tid is None else tid}"
    with open(f"{task}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    with open(f"{task}/wchan") as f:
        return state, f.read()


def wait_asleep_in_poll(pid: int, tid: int | None = None, what: str = "the thread",
                        timeout: float = 10.0) -> None:
    """Return once thread ``tid`` of ``pid`` sleeps in epoll_wait(2) (wchan do_epoll_wait) or
    poll(2), which is where cma's blocking calls sleep on their doorbell once done spinning;
    fail the test after ``timeout`` s.

    Call it after a handshake that says the thread is on its way into the blocking call:
    nothing else on that way sleeps in poll (waiting for the GIL or a lock is a futex wait,
    time.sleep a nanosleep), so seeing it there means it is blocked in that call."""
    deadline = time.monotonic() + timeout
    while True:
        state, wchan = thread_state(pid, tid)
        if state == "S" and "poll" in wchan:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not go to sleep in poll within {timeout} s "
                        f"(state {state!r}, wchan {wchan!r})")
        time.sleep(0.001)  # (a polling interval, not a wait for anything)


def sigint_when_asleep(pid: int, what: str, timeout: float) -> float:
    """SIGINT to ``pid`` once its main thread sleeps in poll (``wait_asleep_in_poll``: not
    still spinning through passes over the rings, where a signal breaks the communicator
    by design); the ``time.monotonic()`` at which it was sent."""
    wait_asleep_in_poll(pid, what=what, timeout=timeout)
    sent = time.monotonic()
    os.kill(pid, signal.SIGINT)
    return sent


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except OSError:
        return 0  # no Yama: ptrace rules are the classic ones


def _shmem_huge_pages() -> bool:
    """Whether shared memory (a world's memfd) may get 2 MiB pages without being asked:
    then a first write allocates a whole huge page, and counts of the pages a ring holds
    mean something else."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            setting = f.read()
    except OSError:
        return False
    return any(f"[{mode}]" in setting for mode in ("always", "within_size", "force"))


# Tests that count the pages a ring holds (the memfd's allocated bytes) by 4 KiB.
COUNTS_RING_PAGES = pytest.mark.skipif(
    not cma._linux.can_populate() or _shmem_huge_pages(),
    reason="needs MADV_POPULATE_WRITE (Linux 5.14+) and 4 KiB pages of shared memory "
           "(shmem_enabled without always, within_size or force)")

# SPLIT needs cma both ways between a parent and its child; Yama scope >= 1 lets only
# the parent (an ancestor) in, so auto then stages and tests of auto's SPLIT skip.
TWO_WAY_PTRACE = _yama_scope() == 0
NO_TWO_WAY_PTRACE = "Yama ptrace_scope >= 1: a child may not write into its parent"


class PeerError(AssertionError):
    """The peer's function raised; the message is its traceback."""


def _peer_loop(comm: cma.Comm) -> None:
    while True:
        func, args = comm.recv(source=0, tag=CMD_TAG)
        if func is None:
            break
        try:
            out = ("ok", func(comm, *args))
        except BaseException as exc:  # noqa: BLE001 - reported to the test process
            out = ("error", "".join(traceback.format_exception(exc)))
        comm.send(out, dest=0, tag=RESULT_TAG)
    comm.close()


def _pending(comm: cma.Comm) -> bool:
    """True when a user message (any source, any non-negative tag) waits unreceived."""
    return comm.Iprobe(cma.ANY_SOURCE, cma.ANY_TAG)


def stop_process(proc: mp.process.BaseProcess, timeout: float = JOIN_TIMEOUT) -> None:
    """Join ``proc``; kill it if it is still alive after ``timeout`` seconds."""
    try:
        proc.join(timeout)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class Peer:
    """The test process's handle on the child at rank 1."""

    def __init__(self, transport: str, context: str = "fork", **options: Any) -> None:
        self.transport = transport
        self.broken = False
        self.comm, child_end = cma.Pipe(transport=transport, **options)
        self.proc = mp.get_context(context).Process(
            target=_peer_loop, args=(child_end,), name=f"cma-peer-{transport}", daemon=True)
        try:
            self.proc.start()
        finally:
            child_end.close()  # the child has its own copies of the fds now

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def start(self, func: Callable[..., Any], *args: Any) -> None:
        """Have the peer run ``func(comm, *args)``; collect the outcome with ``result()``."""
        self.comm.send((func, args), dest=1, tag=CMD_TAG)

    def result(self) -> Any:
        status, value = self.comm.recv(source=1, tag=RESULT_TAG)
        if status == "error":
            raise PeerError(f"the peer raised:\n{value}")
        return value

    def call(self, func: Callable[..., Any], *args: Any) -> Any:
        self.start(func, *args)
        return self.result()

    def check_clean(self) -> None:
        child_pending = self.call(_pending)
        assert not child_pending, "the peer has a message left unreceived"
        assert not _pending(self.comm), "the test process has a message left unreceived"

    def stop(self) -> None:
        try:
            if self.broken:
                self.proc.kill()  # it may be stuck in the middle of anything
            elif self.proc.is_alive():
                self.comm.send((None, ()), dest=1, tag=CMD_TAG)
            stop_process(self.proc, JOIN_TIMEOUT)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.comm.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def _peer_slot(transport: str) -> Iterator[dict[str, Peer | None]]:
    slot: dict[str, Peer | None] = {"peer": None}
    try:
        yield slot
    finally:
        if slot["peer"] is not None:
            slot["peer"].stop()


@pytest.fixture
def peer(_peer_slot: dict[str, Peer | None], transport: str,
         request: pytest.FixtureRequest) -> Iterator[Peer]:
    current = _peer_slot["peer"]
    if current is None or current.broken or not current.proc.is_alive():
        if current is not None:
            current.broken = True
            current.stop()
            _peer_slot["peer"] = None
        current = Peer(transport)
        try:
            current.call(_pending)  # both ends attach here
        except cma.errors.TransportUnavailable as exc:
            current.broken = True
            current.stop()
            pytest.skip(f"transport {transport!r} is not usable on this machine: {exc}")
        except BaseException:
            current.broken = True
            current.stop()
            raise
        _peer_slot["peer"] = current
    yield current
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        current.broken = True
        return
    try:
        current.check_clean()
    except BaseException:
        current.broken = True
        raise


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers() -> Iterator[None]:
    """Nothing left in /dev/shm and no child process left running by the whole session."""
    before = set(os.listdir("/dev/shm"))
    yield
    children = mp.active_children()
    for child in children:
        child.kill()
        child.join(5)
    # MPICH (used by concurrently running mpi4py tests on this machine) names its segments
    # mpich_shm_*; cma itself must never leave anything in /dev/shm.
    leaked = {name for name in set(os.listdir("/dev/shm")) - before
              if not name.startswith(FOREIGN_SHM_PREFIXES)}
    assert not children, f"child processes left running: {children}"
    assert not leaked, f"entries left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _no_fd_closed_twice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A close of an fd that was not open (EBADF, ``FdAlreadyClosed``) by cma in the test
    process fails the test, also where it would not reach the test: in a finalizer, a
    thread, or a clean-up path that catches ``CmaError``. (Forked children inherit the
    check but report only through their own exceptions.)"""
    seen: list[str] = []
    close = cma._linux.close_fd

    def checked_close(fd: int) -> None:
        try:
            close(fd)
        except FdAlreadyClosed as exc:
            seen.append(f"{exc}, closed from:\n{''.join(traceback.format_stack(limit=12))}")
            raise

    monkeypatch.setattr(cma._linux, "close_fd", checked_close)
    yield
    if seen:
        pytest.fail("cma closed an fd that was not open:\n" + "\n".join(seen))


def open_fds() -> dict[int, str]:
    """This process's open fds and what each is (its /proc/self/fd link)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the directory fd listdir used
    return found


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank_main(func, comm, conn):
    try:
        conn.send(("ok", func(comm)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_ranks(transport, config, funcs, timeout=30.0, **options):
    """Run ``funcs[r](comm)`` as rank r of a fresh world, each in a child; a hang fails, never
    blocks. Returns what each returned, in rank order; ``options`` go to every ``cma.Comm``."""
    ctx = mp.get_context("fork")
    fds = WorldFds.create(len(funcs), config)
    comms = [cma.Comm(_shared_fds(fds), rank, transport, **options) for rank in range(len(funcs))]
    fds.close()
    procs, conns = [], []
    try:
        for func, comm in zip(funcs, comms, strict=True):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, args=(func, comm, send_end))
            proc.start()
            send_end.close()
            procs.append(proc)
            conns.append(recv_end)
        for comm in comms:
            comm.close()
        results = []
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                for proc in procs:
                    proc.kill()
                pytest.fail(f"rank {rank} did not finish within {timeout} s (deadlock)")
            results.append(conn.recv())
        for status, value in results:
            assert status == "ok", value
        return [value for _, value in results]
    finally:
        for proc in procs:
            stop_process(proc, 5.0)
        for conn in conns:
            conn.close()


def run_pair(transport, config, func0, func1, timeout=30.0):
    """Run rank 0 and rank 1 of a fresh pair in two children; a hang fails, never blocks."""
    return run_ranks(transport, config, [func0, func1], timeout)


def engine_packet_kinds(comm: cma.Comm) -> list[int]:
    """Attach ``comm`` and record the kind of every packet its engine handles from then on:
    the direct rendezvous takes an RTS without the engine, the general path with it."""
    comm.attach()
    assert comm._progress is not None
    engine = comm._progress.engine
    handle = engine.packet
    kinds: list[int] = []

    def packet(source: int, kind: int, *rest: object) -> object:
        kinds.append(kind & KIND_MASK)
        return handle(source, kind, *rest)  # type: ignore[arg-type]
    engine.packet = packet  # type: ignore[method-assign]
    return kinds

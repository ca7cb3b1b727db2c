"""Multi-process helpers for testing transports without the Comm layer.

``Target`` forks a child that owns buffers and answers commands over a SOCK_SEQPACKET
socketpair (one message per command, fds attached with SCM_RIGHTS); it also plays the
child's bootstrap, serving the fds its transports exposed through ``FakeHost``.
``FakePeer`` is what a transport in the test process sees of that child.
``run_in_child`` runs a function in a forked child, optionally as another uid, and
returns its result. Every child is killed and reaped by the time its helper returns
or its context exits, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.random  # noqa: F401 - now: a child that became nobody cannot read /root to import it

from cma import _linux
from cma.transports.base import Region
from cma.transports.vmfd import VmfdTransport

PAGE = _linux.PAGE_SIZE
NOBODY = 65534
REPLY_TIMEOUT = 60.0


def pause_copies_for_a_signal(comm: Any, notify: Callable[[], None]) -> None:
    """Make this process's copies for ``comm`` (attached) stop before their second system
    call (cma, vmfd) or second staging fragment (shm) until a signal handler's exception
    ends the pause: ``notify()`` is called first, so that another process sends the signal
    while a copy is half done. Python raises a signal's exception at the first bytecode
    after the call under way returns, which is where this raises it too."""
    calls = []

    def pausing(copy: Callable[..., Any]) -> Callable[..., Any]:
        def paused(*args: Any, **kwargs: Any) -> Any:
            # Only the main thread's calls: a split copy's pool thread paused here outlived
            # the interrupt, and the child's close() waited for it (a 60 s hang under load)
            if threading.current_thread() is not threading.main_thread():
                return copy(*args, **kwargs)
            calls.append(copy)
            if len(calls) == 2:
                notify()
                # Short sleeps: a signal that lands between notify() and the sleep's system
                # call is raised only once a sleep ends (CI hung 60 s in one 60 s sleep)
                deadline = time.monotonic() + REPLY_TIMEOUT
                while time.monotonic() < deadline:
                    time.sleep(0.01)
                raise AssertionError(f"no signal ended the pause within {REPLY_TIMEOUT} s")
            return copy(*args, **kwargs)
        return paused

    for name in ("process_vm_copy", "mem_copy"):
        setattr(_linux, name, pausing(getattr(_linux, name)))
    staging = comm._progress.transports.get("shm")
    if staging is not None:
        staging.drain = pausing(staging.drain)


def pattern(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(nbytes)


def digest(buffers: Sequence[memoryview | bytes]) -> str:
    h = hashlib.sha256()
    for buf in buffers:
        h.update(buf)
    return h.hexdigest()


def drop_privileges(uid: int) -> None:
    """Become ``uid`` for good: no supplementary groups, no capabilities (so no CAP_SYS_PTRACE)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


class FakeHost:
    """Records what a transport exposes, as the bootstrap would."""

    def __init__(self) -> None:
        self.openers: dict[str, Callable[[], int]] = {}

    def expose_fd(self, name: str, opener: Callable[[], int]) -> None:
        self.openers[name] = opener


class _Memory:
    """The child's side: its buffers, kept alive, and the commands that act on them."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.buffers: list[object] = []

    def alloc(self, nbytes: int, seed: int | None) -> int:
        array = np.zeros(nbytes, np.uint8)
        if seed is not None:
            array[:] = np.frombuffer(pattern(nbytes, seed), np.uint8)
        self.buffers.append(array)
        return int(array.ctypes.data)

    def alloc_counting(self, nbytes: int) -> int:
        """A buffer holding uint64 0, 1, 2, ... (cheap to fill and check at any size)."""
        array = np.arange(nbytes // 8, dtype=np.uint64)
        self.buffers.append(array)
        return int(array.ctypes.data)

    def check_counting(self, addr: int, nbytes: int) -> bool:
        chunk = 32 << 20
        view = np.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(addr))
        return all(
            np.array_equal(
                view[i : i + chunk], np.arange(i, min(i + chunk, view.size), dtype=np.uint64)
            )
            for i in range(0, view.size, chunk)
        )

    def fill(self, addr: int, nbytes: int, value: int) -> None:
        ctypes.memset(addr, value, nbytes)

    def digest(self, regions: list[tuple[int, int]]) -> str:
        return digest(
            [memoryview((ctypes.c_char * n).from_address(a)).cast("B") for a, n in regions]
        )

    def hole(self, seed: int) -> int:
        """Three pages with the middle one unmapped; pages 0 and 2 hold pattern(PAGE, seed)."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        prot = 0x1 | 0x2  # PROT_READ | PROT_WRITE
        flags = 0x02 | 0x20  # MAP_PRIVATE | MAP_ANONYMOUS
        addr = libc.mmap(None, 3 * PAGE, prot, flags, -1, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        ctypes.memmove(addr, pattern(PAGE, seed), PAGE)
        ctypes.memmove(addr + 2 * PAGE, pattern(PAGE, seed), PAGE)
        assert libc.munmap(addr + PAGE, PAGE) == 0
        return int(addr)

    def dumpable(self) -> bool:
        return _linux.is_dumpable()


def _serve(sock: socket.socket, memory: _Memory) -> None:
    while True:
        raw, _, _, _ = socket.recv_fds(sock, 1 << 16, 0)
        if not raw:  # the test process closed its end or died
            return
        command, *args = pickle.loads(raw)
        fds: list[int] = []
        try:
            if command == "exit":
                sock.send(pickle.dumps(("ok", None)))
                return
            if command == "exec":  # replace the address space; the socket is close-on-exec
                sock.send(pickle.dumps(("ok", None)))
                os.execv("/bin/sleep", ["sleep", "60"])
            if command == "fd":
                fds = [memory.host.openers[args[0]]()]
                reply: Any = ("ok", None)
            else:
                reply = ("ok", getattr(memory, command)(*args))
        except Exception:
            reply = ("error", traceback.format_exc())
        socket.send_fds(sock, [pickle.dumps(reply)], fds)
        for fd in fds:
            os.close(fd)


def _reap(pid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``pid`` to exit, then kill it; always reap it."""
    deadline = timeout
    while deadline > 0:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        select.select([], [], [], 0.02)
        deadline -= 0.02
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


class Target:
    """A child process that owns buffers; optionally another uid and not dumpable.

    It creates its vmfd transport (which opens its /proc/self/mem) while still dumpable,
    then drops dumpable if asked: the order a real program would use.
    """

    def __init__(self, *, uid: int | None = None, dumpable: bool = True, writes: bool = False):
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child
            status = 1
            try:
                parent_end.close()
                if uid is not None:
                    drop_privileges(uid)
                    _linux.set_dumpable(True)  # changing uid cleared it
                host = FakeHost()
                VmfdTransport(host, writes=writes)
                if not dumpable:
                    _linux.set_dumpable(False)
                _serve(child_end, _Memory(host))
                status = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        child_end.close()
        self.sock = parent_end
        self.sock.settimeout(REPLY_TIMEOUT)

    def call(self, command: str, *args: object) -> Any:
        self.sock.send(pickle.dumps((command, *args)))
        raw, _, _, _ = socket.recv_fds(self.sock, 1 << 16, 0)
        if not raw:
            raise RuntimeError(f"target {self.pid} closed its socket during {command!r}")
        status, value = pickle.loads(raw)
        if status != "ok":
            raise RuntimeError(f"target {self.pid} failed {command!r}:\n{value}")
        return value

    def fetch_fd(self, name: str) -> int:
        self.sock.send(pickle.dumps(("fd", name)))
        raw, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
        status, value = pickle.loads(raw)
        if status != "ok":
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"target {self.pid} could not serve fd {name!r}:\n{value}")
        return fds[0]

    def alloc(self, nbytes: int, seed: int | None = None) -> Region:
        return Region(self.call("alloc", nbytes, seed), nbytes)

    def digest(self, regions: Sequence[Region]) -> str:
        return str(self.call("digest", [tuple(r) for r in regions]))

    def exit(self, *, reap: bool = True) -> None:
        """Ask the child to exit; with ``reap=False`` it stays a zombie until ``close``."""
        self.call("exit")
        if reap:
            _reap(self.pid, 10.0)
            self.pid = -1
        else:  # wait for the exit, leave the zombie
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)

    def exec_sleep(self) -> None:
        """Make the child exec ``sleep``, and wait until its old address space is gone."""
        self.call("exec")
        for _ in range(500):
            with open(f"/proc/{self.pid}/comm") as comm:  # set after the new mm is in place
                if comm.read().strip() == "sleep":
                    return
            select.select([], [], [], 0.01)
        raise TimeoutError(f"target {self.pid} did not exec within 5 s")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = -1

    def close(self) -> None:
        """Close the socket (the child exits when it sees EOF) and reap the child."""
        self.sock.close()
        if self.pid > 0:
            _reap(self.pid, 2.0)
            self.pid = -1

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakePeer:
    """What a transport in the test process knows about a ``Target``."""

    def __init__(self, target: Target, rank: int = 1) -> None:
        self.target = target
        self.rank = rank
        self.pid = target.pid

    def fetch_fd(self, name: str) -> int:
        return self.target.fetch_fd(name)


def run_in_child(fn: Callable[[], Any], *, uid: int | None = None, timeout: float = 60.0) -> Any:
    """``fn()`` in a forked child (as ``uid`` with no capabilities, if given); its pickled result.

    An exception in the child comes back as a ``RuntimeError`` carrying its traceback.
    """
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(rfd)
            try:
                if uid is not None:
                    drop_privileges(uid)
                data = pickle.dumps(("ok", fn()))
            except BaseException:
                data = pickle.dumps(("error", traceback.format_exc()))
            with os.fdopen(wfd, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(wfd)
    try:
        chunks = list(_read_until_eof(rfd, timeout))
    finally:
        os.close(rfd)
        _reap(pid, 5.0)
    if not chunks:
        raise RuntimeError("child exited without a result (it crashed)")
    status, value = pickle.loads(b"".join(chunks))
    if status != "ok":
        raise RuntimeError(f"child failed:\n{value}")
    return value


def _read_until_eof(fd: int, timeout: float) -> Iterator[bytes]:
    while True:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError(f"child sent no result within {timeout} s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        yield chunk

"""Emulation of the proposed ``vmfd(pid, start, len)`` system call.

The proposal: a file descriptor onto a window of another process's address space,
read and written with ``preadv``/``pwritev`` at offset = address, permission checked
once when the fd is made. ``/proc/self/mem`` opened by the owner and passed over
SCM_RIGHTS is that descriptor for the whole address space: the kernel checks
permission at open only, so a holder needs no ptrace rights of its own (it works
across uids and after the owner dropped dumpable, where ``process_vm_readv`` gets
EPERM). The window is ``VmFd``'s job: the kernel would happily read outside it (and
even read PROT_NONE or write PROT_READ pages, FOLL_FORCE), so every access is checked
against [start, start + length) in user space before any byte moves.

The kernel copies through a bounce page (fs/proc/base.c mem_rw): two kernel copies
per byte, ~60 % of ``process_vm_readv`` bandwidth for large messages, but a cheaper
system call for small ones.

Each process opens its own memory file once, when the transport is created (later it
may lack the right: a non-root process that changed uid or dropped dumpable cannot
open it), read-only always and read-write only with ``writes=True``, and exposes it as
"mem-ro" / "mem-rw". The peer-side fd is checked to be the peer's memory file before use.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from .. import _linux
from ..errors import CmaError, TransportUnavailable, WindowError
from .base import (
    CALL_BYTES,
    BatchLimits,
    Copies,
    Host,
    Peer,
    Region,
    Transfer,
    Transport,
    TransportStats,
)

# one preadv/pwritev: its offset is one remote address, so one region per call, gathered
# from or scattered to up to IOV_MAX local buffers; CALL_BYTES, so that a peer's death
# (the next call reads 0 bytes) is noticed within one call
LIMITS = BatchLimits(local_spans=_linux.IOV_MAX, remote_spans=1, nbytes=CALL_BYTES)


def _copy(transfer: Transfer, fd: int, pid: int, *, write: bool, stats: TransportStats | None) -> None:
    """Run ``transfer`` through the memory fd ``fd`` of process ``pid``, counting into ``stats``."""
    mem_copy = _linux.mem_copy
    what = transfer.what

    def batch(views: list[memoryview], lens: list[int], addrs: list[int],
              remote_lens: list[int]) -> int:
        return mem_copy(fd, views, addrs[0], write=write, pid=pid, what=what)

    outcome = transfer.run(batch, LIMITS)
    if stats is not None:
        # into the bounce page, out of it
        stats.count_copy(kernel=2 * outcome.copied, syscalls=outcome.calls)
    if outcome.error is not None:
        raise outcome.error


class VmFd:
    """An fd onto [start, start + length) of process ``pid``'s memory; what vmfd() would return.

    It borrows ``fd`` (a /proc/PID/mem fd; the transport owns and closes it). ``read``
    and ``write`` refuse, before any byte moves, an access not entirely inside the
    window. Copies and system calls are counted in ``stats`` when given.
    """

    __slots__ = ("fd", "start", "length", "pid", "stats")

    def __init__(
        self, fd: int, start: int, length: int, *, pid: int, stats: TransportStats | None = None
    ) -> None:
        self.fd = fd
        self.start = start
        self.length = length
        self.pid = pid
        self.stats = stats

    def read(self, addr: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` from the window's bytes at ``addr`` onwards."""
        self._move(addr, buffers, write=False)

    def write(self, addr: int, buffers: Sequence[memoryview]) -> None:
        """Copy ``buffers`` into the window at ``addr`` onwards."""
        self._move(addr, buffers, write=True)

    def _move(self, addr: int, buffers: Sequence[memoryview], *, write: bool) -> None:
        nbytes = sum(buf.nbytes for buf in buffers)
        what = f"vmfd window [{self.start:#x}, +{self.length}) of process {self.pid}"
        if nbytes and not (self.start <= addr and addr + nbytes <= self.start + self.length):
            raise WindowError(
                f"{what}: refused to {'write' if write else 'read'} {nbytes} bytes at {addr:#x}, "
                "which is outside the window the owner exposed (a stale or forged descriptor?)"
            )
        # a write reads the local buffers, so only a read needs them writable
        transfer = Transfer(buffers, [Region(addr, nbytes)], writable=not write, what=what)
        _copy(transfer, self.fd, self.pid, write=write, stats=self.stats)


@dataclass
class _PeerMemory:
    pid: int
    readable: int
    writable: int | None


class VmfdTransport(Transport):
    """Pull through the peer's read-only memory fd; push (``write``) only with ``writes=True``.

    ``styles`` names what the mechanism can do; push works only when both processes
    created the transport with ``writes=True``, otherwise ``write`` says so.
    """

    name: ClassVar[str] = "vmfd"
    copies: ClassVar[Copies] = Copies(user=0, kernel=2)
    styles: ClassVar[frozenset[str]] = frozenset({"pull", "push"})

    def __init__(self, host: Host, *, writes: bool | None = None, **options: object) -> None:
        """``writes=True`` also exposes and fetches read-write memory fds (for ``write``).

        Off by default: a read-only fd is all pulling needs, and an O_RDWR one lets its
        holder change this process's memory, so it is handed out only when asked for.
        """
        super().__init__(host, writes=writes, **options)
        self._peers: dict[int, _PeerMemory] = {}
        self._retired: list[_PeerMemory] = []  # replaced while a copy may still use them
        self._reconnect = threading.Lock()  # overlap's copy thread reads while this one writes
        self._own: list[int] = []
        self._expose(host, "mem-ro", writable=False)
        if self.writes:
            self._expose(host, "mem-rw", writable=True)

    def _expose(self, host: Host, name: str, *, writable: bool) -> None:
        try:
            fd = _linux.open_self_mem(writable)
        except TransportUnavailable as exc:
            reason = str(exc)

            def refuse() -> int:
                raise TransportUnavailable(f"vmfd: cannot serve {name!r}: {reason}")

            host.expose_fd(name, refuse)
            return
        self._own.append(fd)
        host.expose_fd(name, lambda: _linux.dup_fd(fd))

    def probe(self, peer: Peer) -> str | None:
        """None once the peer's memory fd is in hand: no ptrace rights are needed beyond that."""
        try:
            self.connect(peer)
        except TransportUnavailable as exc:
            return str(exc)
        return None

    def connect(self, peer: Peer) -> None:
        """Fetch the peer's read-only /proc/PID/mem fd (and its read-write one, with ``writes``)."""
        if peer.rank in self._peers:
            return
        readable = self._fetch(peer, "mem-ro", writable=False)
        try:
            writable = self._fetch(peer, "mem-rw", writable=True) if self.writes else None
        except TransportUnavailable:
            _linux.close_fd(readable)
            raise
        self._peers[peer.rank] = _PeerMemory(peer.pid, readable, writable)

    def disconnect(self, peer: Peer) -> None:
        """Close the fds fetched from ``peer``."""
        memory = self._peers.pop(peer.rank, None)
        if memory is not None:
            self._close_peer(memory)

    def close(self) -> None:
        """Close every fd fetched or exposed."""
        for memory in [*self._peers.values(), *self._retired]:
            self._close_peer(memory)
        self._peers.clear()
        self._retired.clear()
        for fd in self._own:
            _linux.close_fd(fd)
        self._own.clear()

    def read(self, peer: Peer, remote: Sequence[Region], local: Sequence[memoryview]) -> None:
        """Pull with ``preadv`` on the peer's /proc/PID/mem fd (one kernel copy)."""
        memory = self._memory(peer)
        transfer = Transfer(local, remote, writable=True,
                            what=f"vmfd read from rank {peer.rank} (pid {peer.pid})")
        _copy(transfer, memory.readable, memory.pid, write=False, stats=self.stats)

    def write(self, peer: Peer, local: Sequence[memoryview], remote: Sequence[Region]) -> None:
        """Push with ``pwritev`` on the peer's read-write fd; ``TransportUnavailable`` unless ``writes``."""
        memory = self._memory(peer)
        if memory.writable is None:
            raise TransportUnavailable(
                f"vmfd write to rank {peer.rank}: writes are off; create the vmfd transport with "
                "writes=True (cma.Comm, cma.Pipe: push=True) in both processes"
            )
        transfer = Transfer(local, remote, writable=False,
                            what=f"vmfd write to rank {peer.rank} (pid {peer.pid})")
        _copy(transfer, memory.writable, memory.pid, write=True, stats=self.stats)

    def _memory(self, peer: Peer) -> _PeerMemory:
        memory = self._peers.get(peer.rank)
        if memory is not None and memory.pid == peer.pid:
            return memory
        with self._reconnect:  # a rank now held by another process, or not yet connected
            memory = self._peers.get(peer.rank)
            if memory is None or memory.pid != peer.pid:
                if memory is not None:
                    # the other thread may be copying through these fds: close them in close()
                    self._retired.append(self._peers.pop(peer.rank))
                self.connect(peer)
                memory = self._peers[peer.rank]
            return memory

    @staticmethod
    def _fetch(peer: Peer, name: str, *, writable: bool) -> int:
        """The peer's fd ``name``, checked to be the peer's /proc/PID/mem with that access."""
        try:
            fd = peer.fetch_fd(name)
        except (CmaError, OSError) as exc:
            raise TransportUnavailable(
                f"vmfd: rank {peer.rank} did not hand over its memory fd {name!r}: {exc}"
            ) from exc
        try:
            pid, fd_writable = _linux.mem_fd_owner(fd)
        except CmaError as exc:
            _linux.close_fd(fd)
            raise TransportUnavailable(
                f"vmfd: rank {peer.rank} sent a bad {name!r}: {exc}"
            ) from exc
        if pid != peer.pid or (writable and not fd_writable):
            _linux.close_fd(fd)
            raise TransportUnavailable(
                f"vmfd: rank {peer.rank} (pid {peer.pid}) sent as {name!r} the memory of pid {pid} "
                f"({'read-write' if fd_writable else 'read-only'}); refusing to use it"
            )
        return fd

    @staticmethod
    def _close_peer(memory: _PeerMemory) -> None:
        _linux.close_fd(memory.readable)
        if memory.writable is not None:
            _linux.close_fd(memory.writable)

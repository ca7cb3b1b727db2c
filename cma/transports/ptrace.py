"""The teaching transport: the receiver stops the sender and reads it with ``PTRACE_PEEKDATA``.

This is how a debugger reads memory, and how one read another process before
``process_vm_readv`` (Linux 3.2). Each 8-byte word costs a system call, and passes
through two kernel copies (the tracee's page into a kernel word, that word out to the
caller) and one user copy (into the receive buffer), so it shows, next to ``cma``'s one
call per batch of pages, what the single-copy calls save. ``auto`` never picks it, and
``cma-bench``'s ``all`` leaves it out; name it to use it.

Pull only. For each message the reader seizes the sender's main thread, stops it
(``PTRACE_INTERRUPT``), peeks, and detaches, so the sender is stopped for the whole
copy and nothing stays attached between messages. Permission is the same
ptrace-attach check as ``cma``'s, plus: the sender must not be traced by anyone else.

Two processes that read each other at once would each stop the other and wait for
ever, so every ptrace copy on the machine runs under one lock: an abstract Unix
socket name that one process at a time can bind, released by the kernel if its holder
dies. (Abstract names are per network namespace: processes in different containers
that share a pid namespace would not see each other's lock.)
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

from .. import _linux
from ..errors import BufferError, CmaError, TransportFault
from .base import Copies, Peer, Region, Transport, local_byte_views

LOCK_ADDRESS = "\0cma-ptrace-copy"
LOCK_RETRY_SECONDS = 0.0002


@contextmanager
def machine_lock() -> Iterator[None]:
    """Hold the machine-wide ptrace-copy lock for the block."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            try:
                sock.bind(LOCK_ADDRESS)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                time.sleep(LOCK_RETRY_SECONDS)
        yield
    finally:
        sock.close()


@contextmanager
def stopped(pid: int, what: str) -> Iterator[None]:
    """``pid`` attached and stopped for the block, detached and running after it."""
    with machine_lock():
        signal = _linux.ptrace_stop(pid, what)
        try:
            yield
        finally:
            _linux.ptrace_resume(pid, signal, what)


def pieces(remote: Sequence[Region], local: Sequence[memoryview]) -> Iterator[tuple[int, memoryview]]:
    """(remote address, local byte view) pairs covering both equally long sequences."""
    views = iter(local)
    view = memoryview(b"")
    for addr, nbytes in remote:
        while nbytes:
            if not view.nbytes:
                view = next(views)
            n = min(nbytes, view.nbytes)
            yield addr, view[:n]
            view = view[n:]
            addr += n
            nbytes -= n


class PtraceTransport(Transport):
    name: ClassVar[str] = "ptrace"
    copies: ClassVar[Copies] = Copies(user=1, kernel=2)
    styles: ClassVar[frozenset[str]] = frozenset({"pull"})
    teaching: ClassVar[bool] = True

    def probe(self, peer: Peer) -> str | None:
        """Stop and release the peer once, which is the whole permission check."""
        if peer.pid == os.getpid():
            return "a process cannot trace itself: the two ends must be different processes"
        try:
            with stopped(peer.pid, f"ptrace probe of rank {peer.rank}"):
                pass
        except (CmaError, OSError) as exc:
            return str(exc)
        return None

    def read(self, peer: Peer, remote: Sequence[Region], local: Sequence[memoryview]) -> None:
        what = f"ptrace read from rank {peer.rank}"
        views = local_byte_views(local, writable=True, what=what)
        total = 0
        for i, (addr, nbytes) in enumerate(remote):
            if addr < 0 or nbytes < 0 or addr + nbytes > 1 << 64:
                raise TransportFault(
                    errno.EINVAL, f"{what}: region {i} (addr {addr:#x}, {nbytes} bytes) is not valid"
                )
            total += nbytes
        if total != sum(v.nbytes for v in views):
            raise BufferError(
                f"{what}: the remote regions hold {total} bytes but the local buffers "
                f"{sum(v.nbytes for v in views)}; they must be equal"
            )
        if not total:
            return
        calls = 0
        with stopped(peer.pid, what):
            for addr, view in pieces(remote, views):
                calls += _linux.ptrace_peek_into(peer.pid, addr, view, what)
        self.stats.count_copy(user=total, kernel=16 * calls, syscalls=calls + 4)

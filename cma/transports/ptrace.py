"""The teaching transport: the receiver stops the sender and reads it with ``PTRACE_PEEKDATA``.

This is how a debugger reads memory, and how one read another process before
``process_vm_readv`` (Linux 3.2). Each 8-byte word costs a system call, and passes
through two kernel copies (the tracee's page into a kernel word, that word out to the
caller) and one user copy (into the receive buffer), so it shows, next to ``cma``'s one
call per batch of pages, what the single-copy calls save. ``auto`` never picks it, and
``cma-bench``'s ``all`` leaves it out; name it to use it.

Pull only. For each message the reader seizes the sender's main thread, stops it
(``PTRACE_INTERRUPT``), peeks, and detaches, so that thread is stopped for the whole
copy (its others run on) and nothing stays attached between messages. A system call
the stop interrupts may return EINTR, which Python retries and C code might not.
Permission is the same ptrace-attach check as ``cma``'s, plus: the sender must not be
traced by anyone else.

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
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

from .. import _linux
from ..errors import CmaError, TransportUnavailable
from .base import BatchLimits, Copies, Peer, Region, Transfer, Transport

LOCK_ADDRESS = "\0cma-ptrace-copy"
# A waiter for the lock polls this often: short beside a copy (~1.3 s for 4 MiB), long
# enough not to take a core from the holder; chosen, not measured.
LOCK_RETRY_SECONDS = 0.0002
LOCK_PATIENCE_SECONDS = 120.0  # a 4 MiB copy holds it ~1.3 s here

# one ptrace_peek_into: one remote span into one local buffer, peeked word by word
# (aligned words, so a word never reaches into a page the span does not touch)
LIMITS = BatchLimits(local_spans=1, remote_spans=1, nbytes=sys.maxsize)

_held: list[socket.socket] = []  # the lock sockets this process holds right now


def _drop_inherited() -> None:
    # a child forked while a thread held the lock must not keep the name bound
    for sock in _held:
        sock.close()
    _held.clear()


os.register_at_fork(after_in_child=_drop_inherited)


@contextmanager
def machine_lock() -> Iterator[None]:
    """Hold the machine-wide ptrace-copy lock for the block."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + LOCK_PATIENCE_SECONDS
    try:
        while True:
            try:
                sock.bind(LOCK_ADDRESS)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                if time.monotonic() > deadline:
                    raise TransportUnavailable(
                        f"ptrace: the machine-wide copy lock (abstract socket "
                        f"@{LOCK_ADDRESS[1:]}) has been held for over {LOCK_PATIENCE_SECONDS:.0f} s; "
                        "`ss -xlp | grep cma-ptrace` shows the holder"
                    ) from exc
                time.sleep(LOCK_RETRY_SECONDS)
        _held.append(sock)
        yield
    finally:
        if sock in _held:
            _held.remove(sock)
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


class PtraceTransport(Transport):
    name: ClassVar[str] = "ptrace"
    copies: ClassVar[Copies] = Copies(user=1, kernel=2)
    styles: ClassVar[frozenset[str]] = frozenset({"pull"})
    teaching: ClassVar[bool] = True
    by_pid: ClassVar[bool] = True

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
        """Pull word by word with ``PTRACE_PEEKDATA``, the peer stopped meanwhile, under the machine-wide
        lock."""
        what = f"ptrace read from rank {peer.rank} (pid {peer.pid})"
        transfer = Transfer(local, remote, writable=True, what=what)
        if not transfer.total:
            return
        peeks = 0  # a batch is one PEEKDATA call per word

        def batch(views: list[memoryview], lens: list[int], addrs: list[int],
                  remote_lens: list[int]) -> int:
            nonlocal peeks
            peeks += _linux.ptrace_peek_into(peer.pid, addrs[0], views[0], what)
            return lens[0]

        with stopped(peer.pid, what):
            outcome = transfer.run(batch, LIMITS)
        if outcome.error is not None:
            raise outcome.error
        # besides the peeks: seize, interrupt, detach and the wait for the stop
        self.stats.count_copy(user=transfer.total, kernel=2 * _linux.PTRACE_WORD_BYTES * peeks,
                              syscalls=peeks + 4)

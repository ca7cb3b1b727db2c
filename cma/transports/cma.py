"""Cross-memory attach: ``process_vm_readv`` (pull) / ``process_vm_writev`` (push).

The kernel pins the peer's pages and copies straight between the two address spaces:
one copy, in the kernel, no staging. It needs ptrace-attach permission over the peer
(same user, peer dumpable, Yama and container rules permitting); ``probe`` finds out
with the UCX trick of reading 16 bytes from the peer's address 0.

A call moves at most ``MAX_RW_COUNT`` bytes through at most ``IOV_MAX`` iovecs per side,
and stops short inside an iovec when it reaches a remote page it cannot pin. Its
``LIMITS`` for the shared iteration (``base.Transfer``, which advances both sides by what
the kernel returned) are ``IOV_MAX`` and ``CALL_BYTES`` (64 MiB), so that a peer that dies
during a copy is noticed (ESRCH) within one call, not after up to 2 GiB. A large copy
split across threads is one ``Transfer`` whose byte ranges run on different threads
(``base.SplitCopy``, which xmap shares).

``threads`` (default 1) cuts a copy of at least ``SPLIT_THRESHOLD`` (4 MiB) into that
many page-multiple parts copied concurrently (ctypes releases the GIL). It pays off only
with an idle core: under SPLIT the peer's core is busy with its half, so one thread is the
default. There is no huge-page option: what counts is huge pages under the peer's
buffer. docs/transports.md ("cma's options, measured") has the runs behind both.
"""

from __future__ import annotations

import errno
import os
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from typing import ClassVar

from .. import _linux
from ..errors import CmaError, TransportFault
from .base import (
    CALL_BYTES,
    BatchLimits,
    Copies,
    Host,
    Peer,
    Region,
    SplitCopy,
    Transfer,
    Transport,
)

SPLIT_THRESHOLD = 4 << 20  # bytes; below it a thread hand-off costs about what it gains
# one process_vm_readv/writev: IOV_MAX iovecs per side, CALL_BYTES (the kernel takes up
# to MAX_RW_COUNT), so that a peer's death (ESRCH on the next call) is noticed within one call
LIMITS = BatchLimits(local_spans=_linux.IOV_MAX, remote_spans=_linux.IOV_MAX, nbytes=CALL_BYTES)


class CmaTransport(Transport):
    name: ClassVar[str] = "cma"
    copies: ClassVar[Copies] = Copies(user=0, kernel=1)
    styles: ClassVar[frozenset[str]] = frozenset({"pull", "push"})
    writes = True  # the same permission as reading; nothing more to set up
    by_pid: ClassVar[bool] = True

    def __init__(self, host: Host, *, writes: bool | None = None, threads: int | None = None,
                 **options: object) -> None:
        super().__init__(host, writes=writes, **options)
        if threads is None:
            threads = 1
        if threads < 1:
            raise ValueError(f"cma: threads must be at least 1, not {threads}")
        self._split = SplitCopy(threads, SPLIT_THRESHOLD, "cma-copy")

    def probe(self, peer: Peer) -> str | None:
        """None if ``process_vm_readv`` may reach ``peer`` (a read of its address 0), else why not."""
        err = _linux.cma_access_errno(peer.pid)
        if err in (0, errno.EFAULT):
            return None
        if err == errno.EPERM:
            return f"process_vm_readv on process {peer.pid} is not permitted: {_linux.PTRACE_HELP}"
        if err == errno.ESRCH:
            return f"process {peer.pid} has exited"
        if err == errno.ENOSYS:
            return (
                "process_vm_readv is not available: the kernel lacks CONFIG_CROSS_MEMORY_ATTACH "
                "or a seccomp filter blocks it; use the 'vmfd' or 'shm' transport"
            )
        return f"process_vm_readv on process {peer.pid} failed: {os.strerror(err)}"

    def read(self, peer: Peer, remote: Sequence[Region], local: Sequence[memoryview]) -> None:
        """Pull with ``process_vm_readv`` (one kernel copy), cut between threads from 4 MiB when
        ``threads`` > 1."""
        if len(local) == 1 and len(remote) == 1 and self._copy_one(peer.pid, local[0], remote[0],
                                                                   False):
            return
        what = f"cma read from rank {peer.rank} (pid {peer.pid})"
        self._transfer(peer, local, remote, write=False, what=what)

    def write(self, peer: Peer, local: Sequence[memoryview], remote: Sequence[Region]) -> None:
        """Push with ``process_vm_writev`` (one kernel copy), cut between threads as ``read`` is."""
        if len(local) == 1 and len(remote) == 1 and self._copy_one(peer.pid, local[0], remote[0],
                                                                   True):
            return
        what = f"cma write to rank {peer.rank} (pid {peer.pid})"
        self._transfer(peer, local, remote, write=True, what=what)

    def close(self) -> None:
        """Stop the copy threads."""
        self._split.close()

    def _copy_one(self, pid: int, local: memoryview, region: Region, write: bool) -> bool:
        """One buffer to or from one region in one call, without ``Transfer``'s set-up
        (a third of a direct rendezvous's Python: docs/architecture.md, "Direct
        rendezvous"); False when the general path must copy it (or explain a failure)."""
        n = local.nbytes
        if not (0 < n == region.nbytes and n <= CALL_BYTES and 0 <= region.addr < 1 << 63
                and local.c_contiguous
                and (write or not local.readonly)
                and (self._split.threads == 1 or n < SPLIT_THRESHOLD)):
            return False
        try:
            moved = _linux.process_vm_copy(pid, _linux.iovec(_linux.local_address(local), n),
                                           _linux.iovec(region.addr, n), write=write, what="")
        except CmaError:
            self.stats.count_copy(syscalls=1)
            return False  # (the general path meets the error again and says where)
        self.stats.count_copy(kernel=moved, syscalls=1)
        return moved == n  # (short: a page the kernel could not pin; copied again whole)

    def _transfer(
        self, peer: Peer, buffers: Sequence[memoryview], regions: Sequence[Region], *,
        write: bool, what: str
    ) -> None:
        pid = peer.pid
        # a write reads the local buffers, so only a read needs them writable
        transfer = Transfer(buffers, regions, writable=not write, what=what)
        iovec_array, local_address = _linux.iovec_array, _linux.local_address

        def batch(views: list[memoryview], lens: list[int], addrs: list[int],
                  remote_lens: list[int]) -> int:
            local = iovec_array([local_address(view) for view in views], lens)
            return _linux.process_vm_copy(pid, local, iovec_array(addrs, remote_lens),
                                          write=write, what=what)

        ranges = self._split.run(transfer, batch, LIMITS)
        for _, outcome in ranges:
            self.stats.count_copy(kernel=outcome.copied, syscalls=outcome.calls)
        for start, outcome in ranges:
            if outcome.error is not None:
                copied = sum(outcome.copied for _, outcome in ranges)
                raise self._explain(outcome.error, regions, start + outcome.copied, copied, what)

    @staticmethod
    def _explain(
        error: CmaError,
        regions: Sequence[Region],
        position: int,
        copied: int,
        what: str,
    ) -> CmaError:
        """``error`` as raised, or for a fault the region and offset where the copy stopped."""
        if not isinstance(error, TransportFault) or error.errno != errno.EFAULT:
            return error
        ends = list(accumulate(region.nbytes for region in regions))
        index = bisect_right(ends, position)
        region = regions[index]
        offset = position - (ends[index] - region.nbytes)
        fault = TransportFault(
            errno.EFAULT,
            f"{what}: region {index} (addr {region.addr:#x}, {region.nbytes} bytes) is not mapped "
            f"at offset {offset} (address {region.addr + offset:#x}); {copied} of {ends[-1]} "
            "bytes were copied, so the message is incomplete: was the buffer freed or "
            "unmapped before the transfer finished?",
        )
        fault.__cause__ = error
        return fault

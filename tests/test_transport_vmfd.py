"""The vmfd emulation (/proc/PID/mem fds over SCM_RIGHTS) against a real child, without Comm."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _peers import NOBODY, PAGE, FakeHost, FakePeer, Target, digest, pattern, run_in_child

from cma import _linux
from cma.errors import BufferError, PeerGone, TransportFault, TransportUnavailable, WindowError
from cma.transports import REGISTRY
from cma.transports.base import Copies, Region, TransportStats
from cma.transports.cma import CmaTransport
from cma.transports.vmfd import VmFd, VmfdTransport

pytestmark = pytest.mark.timeout(120)

SIZES = [0, 1, 4095, 4096, 4097, 1 << 20, 64 << 20]


@pytest.fixture
def target() -> Iterator[Target]:
    with Target(writes=True) as child:
        yield child


@pytest.fixture
def vmfd() -> Iterator[VmfdTransport]:
    transport = VmfdTransport(FakeHost(), writes=True)
    yield transport
    transport.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_registered_after_cma_with_its_declarations() -> None:
    assert list(REGISTRY.classes)[:3] == ["shm", "cma", "vmfd"]
    assert VmfdTransport.copies == Copies(user=0, kernel=2)
    assert VmfdTransport.styles == {"pull", "push"}


@pytest.mark.parametrize("nbytes", SIZES)
def test_read_then_write_round_trip(target: Target, vmfd: VmfdTransport, nbytes: int) -> None:
    peer = FakePeer(target)
    assert vmfd.probe(peer) is None
    region = target.alloc(nbytes, seed=1)

    received = bytearray(nbytes)
    vmfd.read(peer, [region], [memoryview(received)])
    assert received == pattern(nbytes, 1)
    assert vmfd.stats.kernel_copy_bytes == 2 * nbytes  # through the bounce page

    outgoing = pattern(nbytes, 2)
    vmfd.write(peer, [memoryview(outgoing)], [region])
    assert target.digest([region]) == hashlib.sha256(outgoing).hexdigest()
    assert vmfd.stats.kernel_copy_bytes == 4 * nbytes
    assert vmfd.stats.syscalls == (0 if nbytes == 0 else 2)


def test_scatter_gather_beyond_iov_max(target: Target, vmfd: VmfdTransport) -> None:
    """3000 one-page regions into 1000/3000-byte pieces; then one region from 3000 buffers."""
    count = 3000
    block = target.alloc(2 * count * PAGE, seed=4)
    regions = [Region(block.addr + 2 * i * PAGE, PAGE) for i in range(count)]
    source = pattern(block.nbytes, 4)
    received = np.zeros(count * PAGE, np.uint8)
    cuts = np.cumsum(np.resize([1000, 3000], 6144))
    local = [piece.data for piece in np.split(received, cuts[cuts < received.nbytes])]
    peer = FakePeer(target)
    vmfd.read(peer, regions, local)
    assert received.tobytes() == b"".join(
        source[2 * i * PAGE : (2 * i + 1) * PAGE] for i in range(count)
    )
    assert vmfd.stats.syscalls == count  # one preadv per region: each has its own offset

    calls = vmfd.stats.syscalls
    pieces = [memoryview(bytearray(pattern(PAGE, i)[: 1 + i % 7])) for i in range(count)]
    whole = Region(block.addr, sum(piece.nbytes for piece in pieces))
    vmfd.write(peer, pieces, [whole])
    assert vmfd.stats.syscalls - calls == -(-count // _linux.IOV_MAX)
    assert target.digest([whole]) == digest(pieces)


def test_partial_read_stops_at_a_hole_and_names_the_address(target: Target) -> None:
    hole = target.call("hole", 6)
    vmfd = VmfdTransport(FakeHost())
    received = bytearray(2 * PAGE)
    try:
        with pytest.raises(TransportFault) as caught:
            vmfd.read(FakePeer(target), [Region(hole, 2 * PAGE)], [memoryview(received)])
    finally:
        vmfd.close()
    assert caught.value.errno == errno.EIO
    assert f"vmfd read from rank 1 (pid {target.pid}): reading [{hole + PAGE:#x}," in str(caught.value)
    assert f"{hole + PAGE:#x} is not mapped" in str(caught.value)
    assert received[:PAGE] == pattern(PAGE, 6)
    assert received[PAGE:] == bytes(PAGE)
    assert vmfd.stats.kernel_copy_bytes == 2 * PAGE
    assert vmfd.stats.syscalls == 2


@pytest.mark.parametrize("how", ["exit", "zombie", "exec"])
def test_owner_gone_reads_zero_bytes_and_raises_peer_gone(target: Target, how: str) -> None:
    region = target.alloc(PAGE, seed=9)
    peer = FakePeer(target)
    vmfd = VmfdTransport(FakeHost(), writes=True)
    try:
        vmfd.connect(peer)  # the fds are in hand before the owner goes
        if how == "exec":
            target.exec_sleep()
        else:
            target.exit(reap=how == "exit")
        received = bytearray(PAGE)
        with pytest.raises(PeerGone, match="exited or exec'd"):
            vmfd.read(peer, [region], [memoryview(received)])
        assert received == bytes(PAGE)
        with pytest.raises(PeerGone):
            vmfd.write(peer, [memoryview(bytes(PAGE))], [region])
    finally:
        vmfd.close()
        if how == "exec":
            target.kill()


def test_stats_reset_in_place_so_a_copy_in_flight_counts_after_it(
    target: Target, vmfd: VmfdTransport
) -> None:
    """Comm.reset_stats() may run while overlap's thread copies through a window that holds
    the transport's counters: they are zeroed, not replaced, so that copy is not lost."""
    peer = FakePeer(target)
    region = target.alloc(PAGE, seed=7)
    held = vmfd.stats
    vmfd.read(peer, [region], [memoryview(bytearray(PAGE))])
    held.reset()
    assert vmfd.stats is held and held == TransportStats()
    VmFd(vmfd._peers[1].readable, *region, pid=target.pid, stats=held).read(
        region.addr, [memoryview(bytearray(PAGE))])
    assert vmfd.stats.kernel_copy_bytes == 2 * PAGE and vmfd.stats.syscalls == 1


def test_window_refuses_forged_regions_before_copying(target: Target) -> None:
    """The kernel would serve any address through the fd; the window check must say no."""
    block = target.alloc(4 * PAGE, seed=12)
    fd = target.fetch_fd("mem-rw")
    stats = TransportStats()
    try:
        window = VmFd(fd, block.addr + PAGE, 2 * PAGE, pid=target.pid, stats=stats)
        destination = bytearray(b"\xee" * PAGE)
        for addr in (block.addr, block.addr + PAGE // 2, block.addr + 2 * PAGE + 1, 0):
            with pytest.raises(WindowError, match="outside the window"):
                window.read(addr, [memoryview(destination)])
            with pytest.raises(WindowError):
                window.write(addr, [memoryview(bytes(PAGE))])
        assert destination == b"\xee" * PAGE
        assert stats == TransportStats()
        assert target.digest([block]) == digest([pattern(4 * PAGE, 12)])

        window.read(block.addr + PAGE, [memoryview(destination)])  # inside: allowed
        assert destination == pattern(4 * PAGE, 12)[PAGE : 2 * PAGE]
        window.read(block.addr + 3 * PAGE - 1, [memoryview(bytearray(1))])  # last byte
    finally:
        os.close(fd)


def test_pull_only_by_default(target: Target) -> None:
    host = FakeHost()
    vmfd = VmfdTransport(host)
    try:
        assert set(host.openers) == {"mem-ro"}
        fd = host.openers["mem-ro"]()
        assert _linux.mem_fd_owner(fd) == (os.getpid(), False)
        os.close(fd)

        peer = FakePeer(target)
        region = target.alloc(PAGE, seed=13)
        with pytest.raises(TransportUnavailable, match="writes=True"):
            vmfd.write(peer, [memoryview(bytes(PAGE))], [region])
        assert target.digest([region]) == digest([pattern(PAGE, 13)])
    finally:
        vmfd.close()


class _LyingPeer:
    """A peer that hands over something other than its own memory file."""

    def __init__(self, rank: int, pid: int, path: str) -> None:
        self.rank = rank
        self.pid = pid
        self.path = path

    def fetch_fd(self, name: str) -> int:
        return os.open(self.path, os.O_RDONLY)


@pytest.mark.parametrize("path", ["/dev/null", "/proc/self/mem"], ids=["not-mem", "wrong-pid"])
def test_received_fd_is_checked_against_the_peer(path: str) -> None:
    before = _open_fds()
    vmfd = VmfdTransport(FakeHost())
    try:
        reason = vmfd.probe(_LyingPeer(3, os.getppid(), path))
        assert reason is not None and "rank 3" in reason
        with pytest.raises(TransportUnavailable):
            vmfd.read(_LyingPeer(3, os.getppid(), path), [Region(0, 1)], [memoryview(bytearray(1))])
    finally:
        vmfd.close()
    assert _open_fds() == before


def test_disconnect_and_close_release_every_fd(target: Target) -> None:
    before = _open_fds()
    vmfd = VmfdTransport(FakeHost(), writes=True)
    peer = FakePeer(target)
    vmfd.connect(peer)
    assert len(_open_fds() - before) == 4  # own ro + rw, the peer's ro + rw
    vmfd.disconnect(peer)
    assert len(_open_fds() - before) == 2
    vmfd.connect(peer)
    vmfd.close()
    assert _open_fds() == before


def test_rank_taken_over_by_another_process_keeps_old_fds_open_until_close(target: Target) -> None:
    """A copy on overlap's thread may still use the old process's fds when another thread
    reconnects: they are retired, not closed, and close() releases them."""
    with Target(writes=True) as successor:
        before = _open_fds()
        vmfd = VmfdTransport(FakeHost(), writes=True)
        try:
            region = target.alloc(4096, seed=5)
            received = bytearray(4096)
            vmfd.read(FakePeer(target), [region], [memoryview(received)])
            old = vmfd._peers[1]
            assert received == pattern(4096, 5)

            region = successor.alloc(4096, seed=6)
            vmfd.read(FakePeer(successor), [region], [memoryview(received)])  # same rank 1
            assert received == pattern(4096, 6)
            assert vmfd._peers[1].pid == successor.pid
            for fd in (old.readable, old.writable):
                os.fstat(fd)  # still open: raises EBADF once closed
            assert len(_open_fds() - before) == 6  # own ro + rw, both peers' ro + rw
        finally:
            vmfd.close()
        assert _open_fds() == before


def test_owner_that_cannot_open_its_memory_refuses_to_serve() -> None:
    """Not root and not dumpable (uid changed): /proc/self/mem is root's, so open fails."""

    def owner() -> str:
        host = FakeHost()
        VmfdTransport(host)
        try:
            host.openers["mem-ro"]()
        except TransportUnavailable as exc:
            return str(exc)
        return "served"

    assert "before dropping privileges" in run_in_child(owner, uid=NOBODY)


TARGET_SETUPS: dict[str, dict[str, Any]] = {
    "other-uid": {},  # the target stays root, the reader is nobody
    "non-dumpable": {"uid": NOBODY, "dumpable": False},
    "same-uid-dumpable": {"uid": NOBODY},  # control: cma is allowed here
}


@pytest.mark.parametrize("setup", list(TARGET_SETUPS))
def test_vmfd_works_where_cma_is_refused(setup: str) -> None:
    """The reader, nobody without capabilities, reads the target with both transports."""
    nbytes = 3 * PAGE + 5
    with Target(**TARGET_SETUPS[setup]) as target:
        region = target.alloc(nbytes, seed=11)
        expected = pattern(nbytes, 11)
        assert target.call("dumpable") == (setup != "non-dumpable")

        def reader() -> dict[str, Any]:
            peer = FakePeer(target)
            cma, vmfd = CmaTransport(FakeHost()), VmfdTransport(FakeHost())
            result: dict[str, Any] = {"cma_probe": cma.probe(peer)}
            received = bytearray(nbytes)
            try:
                cma.read(peer, [region], [memoryview(received)])
                result["cma_read"] = received == expected
            except TransportUnavailable as exc:
                result["cma_read"] = str(exc)
            result["vmfd_probe"] = vmfd.probe(peer)
            received = bytearray(nbytes)
            vmfd.read(peer, [region], [memoryview(received)])
            result["vmfd_read"] = received == expected
            cma.close()
            vmfd.close()
            return result

        result = run_in_child(reader, uid=NOBODY)
        target.exit()

    assert result["vmfd_probe"] is None
    assert result["vmfd_read"] is True
    if setup == "same-uid-dumpable":
        assert result["cma_probe"] is None
        assert result["cma_read"] is True
    else:
        assert "not permitted" in result["cma_probe"] and "PR_SET_DUMPABLE" in result["cma_probe"]
        assert "not permitted" in result["cma_read"] and "vmfd" in result["cma_read"]


def test_unusable_local_buffers_are_refused(target: Target, vmfd: VmfdTransport) -> None:
    region = target.alloc(64, seed=14)
    peer = FakePeer(target)
    with pytest.raises(BufferError, match="must be equal"):
        vmfd.read(peer, [region], [memoryview(bytearray(65))])
    with pytest.raises(BufferError, match="read-only"):
        vmfd.read(peer, [region], [memoryview(bytes(64))])
    with pytest.raises(BufferError, match="contiguous"):
        vmfd.write(peer, [np.zeros(128, np.uint8)[::2].data], [region])
    assert vmfd.stats.syscalls == 0

"""The cma transport (process_vm_readv/writev) against a real child process, without Comm."""

from __future__ import annotations

import errno
import hashlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from _peers import PAGE, FakeHost, FakePeer, Target, digest, pattern, run_in_child

from cma import _linux
from cma.errors import BufferError, PeerGone, TransportFault
from cma.transports import REGISTRY
from cma.transports.base import CALL_BYTES, Copies, Region
from cma.transports.cma import SPLIT_THRESHOLD, CmaTransport

pytestmark = pytest.mark.timeout(120)

SIZES = [0, 1, 4095, 4096, 4097, 1 << 20, 64 << 20]


@pytest.fixture
def target() -> Iterator[Target]:
    with Target() as child:
        yield child


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def transport(request: pytest.FixtureRequest) -> Iterator[CmaTransport]:
    cma = CmaTransport(FakeHost(), threads=request.param)
    yield cma
    cma.close()


def test_registered_after_shm_with_its_declarations() -> None:
    assert list(REGISTRY.classes)[:2] == ["shm", "cma"]
    assert REGISTRY.classes["cma"] is CmaTransport
    assert CmaTransport.copies == Copies(user=0, kernel=1)
    assert CmaTransport.styles == {"pull", "push"}


@pytest.mark.parametrize("nbytes", SIZES)
def test_read_then_write_round_trip(target: Target, transport: CmaTransport, nbytes: int) -> None:
    peer = FakePeer(target)
    assert transport.probe(peer) is None
    transport.connect(peer)
    region = target.alloc(nbytes, seed=1)

    received = bytearray(nbytes)
    transport.read(peer, [region], [memoryview(received)])
    assert received == pattern(nbytes, 1)
    assert transport.stats.kernel_copy_bytes == nbytes
    assert (transport.stats.syscalls == 0) == (nbytes == 0)

    outgoing = pattern(nbytes, 2)
    transport.write(peer, [memoryview(outgoing)], [region])
    assert target.digest([region]) == hashlib.sha256(outgoing).hexdigest()
    assert transport.stats.kernel_copy_bytes == 2 * nbytes
    assert transport.stats.user_copy_bytes == 0


def test_large_copies_split_across_threads(target: Target) -> None:
    nbytes = 3 * SPLIT_THRESHOLD + 5
    region = target.alloc(nbytes, seed=3)
    cma = CmaTransport(FakeHost(), threads=3)
    try:
        received = np.zeros(nbytes, np.uint8)
        cma.read(FakePeer(target), [region], [received.data])
        assert received.tobytes() == pattern(nbytes, 3)
        assert cma.stats.syscalls == 3
        assert any(t.name.startswith("cma-copy") for t in threading.enumerate())
    finally:
        cma.close()
    assert not any(t.name.startswith("cma-copy") for t in threading.enumerate())


def test_split_copies_still_work_in_a_forked_child(target: Target) -> None:
    """A thread pool inherited through fork has no threads; the transport must not wait on it."""
    nbytes = 2 * SPLIT_THRESHOLD
    region = target.alloc(nbytes, seed=15)
    cma = CmaTransport(FakeHost(), threads=2)
    received = np.zeros(nbytes, np.uint8)
    try:
        cma.read(FakePeer(target), [region], [received.data])

        def read_again() -> bool:
            received[:] = 0
            cma.read(FakePeer(target), [region], [received.data])
            cma.close()
            return received.tobytes() == pattern(nbytes, 15)

        assert run_in_child(read_again, timeout=30)
    finally:
        cma.close()


@pytest.mark.parametrize("local_pieces", ["one", "many"])
def test_scatter_gather_beyond_iov_max(
    target: Target, transport: CmaTransport, local_pieces: str
) -> None:
    """3000 separate one-page regions, gathered into local buffers cut differently."""
    count = 3000
    block = target.alloc(2 * count * PAGE, seed=4)
    regions = [Region(block.addr + 2 * i * PAGE, PAGE) for i in range(count)]
    source = pattern(block.nbytes, 4)
    expected = b"".join(source[2 * i * PAGE : (2 * i + 1) * PAGE] for i in range(count))

    received = np.zeros(count * PAGE, np.uint8)
    if local_pieces == "one":
        local = [received.data]
    else:  # 1000- and 3000-byte pieces: 6144 local iovecs, none aligned with a region
        cuts = np.cumsum(np.resize([1000, 3000], 6144))
        cuts = cuts[cuts < received.nbytes]
        local = [piece.data for piece in np.split(received, cuts)]
    transport.read(FakePeer(target), regions, local)
    assert received.tobytes() == expected
    assert transport.stats.syscalls >= -(-max(len(regions), len(local)) // _linux.IOV_MAX)

    outgoing = np.frombuffer(pattern(received.nbytes, 5), np.uint8)
    received[:] = outgoing
    transport.write(FakePeer(target), local, regions)
    assert target.digest(regions) == digest([outgoing.data])


def test_partial_transfer_stops_at_a_hole_and_names_the_region(target: Target) -> None:
    """The kernel copies up to the unmapped page; the transport then reports the hole."""
    hole = target.call("hole", 6)
    good = target.alloc(100, seed=7)
    regions = [good, Region(hole, 2 * PAGE)]
    received = bytearray(100 + 2 * PAGE)
    cma = CmaTransport(FakeHost(), threads=1)
    with pytest.raises(TransportFault) as caught:
        cma.read(FakePeer(target), regions, [memoryview(received)])
    assert caught.value.errno == errno.EFAULT
    message = str(caught.value)
    assert "region 1" in message and f"{hole + PAGE:#x}" in message and f"offset {PAGE}" in message
    assert received[:100] == pattern(100, 7)
    assert received[100 : 100 + PAGE] == pattern(PAGE, 6)
    assert received[100 + PAGE :] == bytes(PAGE)
    assert cma.stats.kernel_copy_bytes == 100 + PAGE
    assert cma.stats.syscalls == 2  # the short one, then the one that found the hole

    with pytest.raises(TransportFault, match="region 0"):
        cma.write(FakePeer(target), [memoryview(bytes(2 * PAGE))], [Region(hole, 2 * PAGE)])
    assert target.digest([Region(hole, PAGE)]) == digest([bytes(PAGE)])


def test_unmapped_region_is_a_fault(target: Target, transport: CmaTransport) -> None:
    hole = target.call("hole", 8)
    with pytest.raises(TransportFault) as caught:
        transport.read(FakePeer(target), [Region(hole + PAGE, PAGE)], [memoryview(bytearray(PAGE))])
    assert caught.value.errno == errno.EFAULT
    assert transport.stats.kernel_copy_bytes == 0


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_dead_peer_is_peer_gone(target: Target, reaped: bool) -> None:
    region = target.alloc(PAGE, seed=9)
    peer = FakePeer(target)
    target.exit(reap=reaped)
    cma = CmaTransport(FakeHost())
    assert "exited" in (cma.probe(peer) or "")
    with pytest.raises(PeerGone):
        cma.read(peer, [region], [memoryview(bytearray(PAGE))])
    with pytest.raises(PeerGone):
        cma.write(peer, [memoryview(bytes(PAGE))], [region])


def test_mismatched_or_unusable_buffers_are_refused(target: Target) -> None:
    region = target.alloc(64, seed=10)
    peer = FakePeer(target)
    cma = CmaTransport(FakeHost())
    with pytest.raises(BufferError, match="must be equal"):
        cma.read(peer, [region], [memoryview(bytearray(63))])
    with pytest.raises(BufferError, match="read-only"):
        cma.read(peer, [region], [memoryview(bytes(64))])
    with pytest.raises(BufferError, match="contiguous"):
        cma.read(peer, [region], [np.zeros(128, np.uint8)[::2].data])
    with pytest.raises(TransportFault, match="not valid"):
        cma.read(peer, [Region(-1, 64)], [memoryview(bytearray(64))])
    assert cma.stats.syscalls == 0


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="threads"):
        CmaTransport(FakeHost(), threads=0)
    with pytest.raises(TypeError, match="hugepages"):
        CmaTransport(FakeHost(), hugepages=True)


def _mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_message_beyond_2_gib(target: Target) -> None:
    """2.5 GiB: more than the kernel's 0x7ffff000 bytes per call, copied in calls of
    CALL_BYTES (64 MiB: a peer's death is noticed between them)."""
    nbytes = 5 << 29
    if _mem_available() < 8 << 30:
        pytest.skip("needs 8 GiB of MemAvailable: 2.5 GiB in each of three buffers, plus slack")
    source = Region(target.call("alloc_counting", nbytes), nbytes)
    peer = FakePeer(target)
    cma = CmaTransport(FakeHost(), threads=1)
    received = np.empty(nbytes // 8, np.uint64)
    cma.read(peer, [source], [received.data])
    calls = -(-nbytes // CALL_BYTES)
    assert cma.stats.syscalls == calls
    assert cma.stats.kernel_copy_bytes == nbytes
    chunk = 1 << 25
    for start in range(0, received.size, chunk):
        stop = min(start + chunk, received.size)
        assert np.array_equal(received[start:stop], np.arange(start, stop, dtype=np.uint64))

    destination = target.alloc(nbytes)
    cma.write(peer, [received.data], [destination])
    del received
    assert target.call("check_counting", destination.addr, nbytes)
    assert cma.stats.syscalls == 2 * calls

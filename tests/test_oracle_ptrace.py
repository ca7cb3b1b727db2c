"""python-ptrace as an independent oracle of what cma's transports copy.

python-ptrace is a debugger library nobody here wrote: it attaches to a process and reads
or writes its memory with its own code. For each transport that reaches a peer's memory
(cma: process_vm_readv/writev, vmfd: /proc/PID/mem, ptrace: our word-at-a-time
teaching transport), what the transport reads from a child's buffers must be what
python-ptrace reads there, byte for byte, and what the transport writes must be what
python-ptrace then finds. Nothing in cma/ imports python-ptrace (GPL-2.0): only this test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _peers import FakeHost, FakePeer, Target, pattern

from cma.transports.base import Region, Transport
from cma.transports.cma import CmaTransport
from cma.transports.ptrace import PtraceTransport
from cma.transports.vmfd import VmfdTransport

debugger = pytest.importorskip("ptrace.debugger", reason="python-ptrace is not installed "
                               "(pip install 'cma-ipc[test]')")

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = {"cma": CmaTransport, "vmfd": VmfdTransport, "ptrace": PtraceTransport}
# odd sizes and an odd start: word-at-a-time readers (python-ptrace's and ours) must get
# the unaligned head and tail right
SIZES = [1, 7, 4095, 4097, 65536 + 3]


@pytest.fixture
def target() -> Iterator[Target]:
    with Target(writes=True) as child:  # (writes: it serves vmfd a writable fd too)
        yield child


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    cls = TRANSPORTS[request.param]
    made = cls(FakeHost(), writes="push" in cls.styles)
    yield made
    made.close()


def oracle_read(pid: int, regions: list[Region]) -> bytes:
    """The regions' bytes as python-ptrace reads them (it stops the process meanwhile)."""
    tracer = debugger.PtraceDebugger()
    try:
        process = tracer.addProcess(pid, False)
        try:
            return b"".join(process.readBytes(r.addr, r.nbytes) for r in regions)
        finally:
            process.detach()
    finally:
        tracer.quit()


def oracle_write(pid: int, region: Region, data: bytes) -> None:
    tracer = debugger.PtraceDebugger()
    try:
        process = tracer.addProcess(pid, False)
        try:
            process.writeBytes(region.addr, data)
        finally:
            process.detach()
    finally:
        tracer.quit()


def unaligned(target: Target, nbytes: int, seed: int) -> Region:
    """A region of ``nbytes`` that starts 3 bytes into a fresh buffer of the child."""
    region = target.alloc(nbytes + 3, seed=seed)
    return Region(region.addr + 3, nbytes)


@pytest.mark.parametrize("nbytes", SIZES)
def test_reads_agree_with_python_ptrace(target: Target, transport: Transport, nbytes: int) -> None:
    peer = FakePeer(target)
    assert transport.probe(peer) is None
    transport.connect(peer)
    regions = [unaligned(target, nbytes, seed=5), target.alloc(nbytes // 2 + 1, seed=6)]
    ours = bytearray(sum(r.nbytes for r in regions))
    transport.read(peer, regions, [memoryview(ours)])
    assert bytes(ours) == oracle_read(target.pid, regions)
    head = min(nbytes, 8)  # (the oracle itself read what the child holds)
    assert ours[:head] == pattern(nbytes + 3, 5)[3 : 3 + head]


@pytest.mark.parametrize("nbytes", SIZES)
def test_writes_are_what_python_ptrace_finds(target: Target, transport: Transport, nbytes: int
                                             ) -> None:
    if "push" not in transport.styles:
        pytest.skip(f"{transport.name} only reads (its styles: {sorted(transport.styles)})")
    peer = FakePeer(target)
    transport.connect(peer)
    region = unaligned(target, nbytes, seed=7)
    neighbours = [Region(region.addr - 3, 3), Region(region.addr + nbytes, 0)]
    before = oracle_read(target.pid, neighbours)
    outgoing = os.urandom(nbytes)
    transport.write(peer, [memoryview(outgoing)], [region])
    assert oracle_read(target.pid, [region]) == outgoing
    assert oracle_read(target.pid, neighbours) == before  # nothing written around it


def test_python_ptrace_writes_are_what_the_transports_read(target: Target) -> None:
    region = unaligned(target, 4097, seed=8)
    written = os.urandom(region.nbytes)
    oracle_write(target.pid, region, written)
    peer = FakePeer(target)
    for name, cls in TRANSPORTS.items():
        transport = cls(FakeHost())
        try:
            transport.connect(peer)
            got = bytearray(region.nbytes)
            transport.read(peer, [region], [memoryview(got)])
            assert bytes(got) == written, name
        finally:
            transport.close()

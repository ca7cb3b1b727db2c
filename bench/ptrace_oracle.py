"""A debugger's word-at-a-time read beside cma's transports, on the same buffer of a child.

python-ptrace, a debugger library (GPL-2.0; the test extra installs it, nothing in
``cma/`` imports it), attaches to a child, stops it and reads its buffer one word per
``PTRACE_PEEKTEXT``: its ``PtraceProcess._readBytes``. (Its public ``readBytes`` reads
``/proc/PID/mem`` on Linux, as the vmfd transport does, and falls back to the word loop
only where that file is refused.) cma's ``ptrace``, ``cma`` and ``vmfd`` transports read
the same buffer. Every read is checked byte for byte against what the child wrote, and
timed from the first system call to the last, attaching, stopping and detaching
included. docs/guide.md section 3 has a run.

    PYTHONPATH=. python bench/ptrace_oracle.py --sizes 4K 64K --repeat 5

Not in CI. The child is this process's own (fork), so Yama's ptrace_scope 1 permits
every reader; the vmfd transport is handed the child's ``/proc/PID/mem`` opened here,
where cma's bootstrap would have the child send its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from cma.bench.sizes import format_size, parse_size
from cma.transports.base import Region, Transport
from cma.transports.cma import CmaTransport
from cma.transports.ptrace import PtraceTransport
from cma.transports.vmfd import VmfdTransport

try:
    from ptrace.debugger import PtraceDebugger
except ImportError:  # pragma: no cover - told to the user
    sys.exit("python-ptrace is not installed (pip install 'cma-ipc[test]')")

TRANSPORTS: dict[str, type[Transport]] = {"ptrace": PtraceTransport, "cma": CmaTransport,
                                          "vmfd": VmfdTransport}


class Host:
    """This process's side of the bootstrap, which this example does not need."""

    def expose_fd(self, name: str, opener: Callable[[], int]) -> None:
        pass

    def withdraw_fd(self, name: str) -> None:
        pass


class Child:
    """A forked child holding ``nbytes`` of a known pattern, blocked in a read until closed."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.expected = np.random.default_rng(seed).bytes(nbytes)
        ready_r, ready_w = os.pipe()
        self._hold_r, self._hold_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child
            try:
                os.close(self._hold_w)  # (else its own end would keep the read from ending)
                buffer = np.frombuffer(bytearray(self.expected), np.uint8)
                os.write(ready_w, int(buffer.ctypes.data).to_bytes(8, "little"))
                os.read(self._hold_r, 1)  # until the parent closes its end (or dies)
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(self._hold_r)
        self.addr = int.from_bytes(os.read(ready_r, 8), "little")
        os.close(ready_r)
        self.rank = 1

    def fetch_fd(self, name: str) -> int:
        return os.open(f"/proc/{self.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def take_fd(self, number: int, name: str) -> int:
        return self.fetch_fd(name)

    def close(self) -> None:
        """End the child (its read sees EOF; killed if it has not exited within 5 s) and reap it."""
        os.close(self._hold_w)
        deadline = time.monotonic() + 5
        while not os.waitpid(self.pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)


def python_ptrace_read(pid: int, addr: int, nbytes: int) -> bytes:
    """Attach, stop, read word by word (python-ptrace's own loop), detach."""
    tracer = PtraceDebugger()
    try:
        process = tracer.addProcess(pid, False)
        try:
            return bytes(process._readBytes(addr, nbytes))
        finally:
            process.detach()
    finally:
        tracer.quit()


def time_reads(read: Callable[[], bytes], expected: bytes, repeat: int) -> list[float]:
    """Seconds per read, ``repeat`` reads; each read checked against ``expected``."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = read()
        times.append(time.perf_counter() - t0)
        if got != expected:
            raise SystemExit(f"a read differs from what the child holds ({len(got)} bytes)")
    return times


def transport_reader(transport: Transport, child: Child, nbytes: int) -> Callable[[], bytes]:
    out = bytearray(nbytes)
    regions = [Region(child.addr, nbytes)]
    views = [memoryview(out)]

    def read() -> bytes:
        transport.read(child, regions, views)  # (Child is a Peer)
        return bytes(out)

    return read


def measure(nbytes: int, repeat: int) -> list[tuple[str, list[float], str]]:
    """(reader, seconds per read, system calls per read) for each reader of one child's buffer."""
    child = Child(nbytes, seed=nbytes)
    try:
        peeks = -(-(child.addr % 8 + nbytes) // 8)  # aligned words the buffer touches
        rows = [("python-ptrace word by word", time_reads(
            lambda: python_ptrace_read(child.pid, child.addr, nbytes), child.expected, repeat),
            f"{peeks}+")]
        for name, cls in TRANSPORTS.items():
            transport = cls(Host())
            try:
                transport.connect(child)  # (Child is a Peer)
                transport.stats.reset()
                times = time_reads(transport_reader(transport, child, nbytes), child.expected, repeat)
                rows.append((f"cma's {name} transport", times, f"{transport.stats.syscalls / repeat:.0f}"))
            finally:
                transport.close()
        return rows
    finally:
        child.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K"], type=parse_size)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'size':>6}  {'reader':<28} {'median':>10} {'min':>10} {'MB/s':>8} {'syscalls':>9}")
    for nbytes in args.sizes:
        for reader, times, calls in measure(nbytes, args.repeat):
            median = statistics.median(times)
            print(f"{format_size(nbytes):>6}  {reader:<28} {median * 1e6:>8.0f}us "
                  f"{min(times) * 1e6:>8.0f}us {nbytes / median / 1e6:>8.1f} {calls:>9}")


if __name__ == "__main__":
    main()

"""``cma-bench --guard``: the probe of how fast the two CPUs hand data to each other, and
the wait for a quiet machine before a timed loop."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from .endpoints import TAG_GUARD, Endpoint
from .kernels import Plan
from .results import SizeResult

# --guard. On the project VM the two CPUs sometimes hand data to each other slowly for
# seconds to minutes (a buffer one CPU has just written takes the other ~1.9x as long to
# copy, and a ping-pong of 64 KiB-4 MiB ~4-7x as long), while copies within one CPU keep
# their speed. The probe measures exactly that ratio.
PROBE_BYTES = 1 << 20
PROBE_HANDOFFS = 12
QUIET_RATIO = 1.4  # quiet: 0.9-1.3 measured here; slow spells 1.7-2.1
PROBE_PEER_SLEEP = 0.05  # rank 1 sleeps while rank 0 probes (which takes ~5 ms), so
#                          its CPU is free for the probe's second thread
GUARD_PAUSE = 1.0  # between probes while the machine is slow
GUARD_REDO = 2  # timed loops of one size redone at most, when the probe after them is slow


def _handoff_us(writer_cpu: int, reader_cpu: int) -> float:
    """Median time for ``reader_cpu`` to copy out a buffer ``writer_cpu`` has just filled."""
    shared, source, sink = (np.full(PROBE_BYTES, value, np.uint8) for value in (0, 1, 2))
    written, taken = threading.Event(), threading.Event()
    times: list[int] = []

    def write() -> None:
        os.sched_setaffinity(0, {writer_cpu})  # 0: this thread
        for _ in range(PROBE_HANDOFFS):
            np.copyto(shared, source)
            written.set()
            if not taken.wait(1.0):
                return
            taken.clear()

    def read() -> None:
        os.sched_setaffinity(0, {reader_cpu})
        for _ in range(PROBE_HANDOFFS):
            if not written.wait(1.0):
                return
            written.clear()
            t0 = time.perf_counter_ns()
            np.copyto(sink, shared)
            times.append(time.perf_counter_ns() - t0)
            taken.set()

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(times) < PROBE_HANDOFFS:
        raise RuntimeError(f"the --guard probe between CPUs {writer_cpu} and {reader_cpu} "
                           "did not finish")
    return float(np.median(times)) / 1e3


def handoff_ratio(cpus: Sequence[int]) -> float:
    """How much longer a copy of data the other CPU just wrote takes than of data this
    CPU wrote itself: ~1 on a quiet machine."""
    a, b = cpus
    return _handoff_us(a, b) / _handoff_us(b, b)


def probe_together(ep: Endpoint, plan: Plan, stop_after: float | None) -> tuple[float, bool]:
    """Rank 0 probes while rank 1 sleeps; both get the ratio and rank 0's verdict.

    The verdict (stop waiting) is rank 0's alone, so both ranks take the same turn
    whatever their clocks say: ``stop_after`` is the monotonic time after which rank 0
    gives up waiting (None: the ratio alone decides).
    """
    ep.comm.Barrier()
    if ep.rank == 1:
        time.sleep(PROBE_PEER_SLEEP)
        ratio, stop = ep.comm.recv(source=0, tag=TAG_GUARD)
        return ratio, stop
    ratio = handoff_ratio(plan.guard_cpus)
    stop = ratio <= QUIET_RATIO or (stop_after is not None and time.monotonic() >= stop_after)
    ep.comm.send((ratio, stop), 1, tag=TAG_GUARD)
    return ratio, stop


def await_quiet(ep: Endpoint, plan: Plan, record: SizeResult) -> None:
    """Probe until the machine is quiet or ``plan.guard`` seconds have passed.

    ``record.waited_s`` grows by the time from the first slow probe to the quiet one:
    a size that found the machine quiet waited 0 s, however long its probe took.
    """
    start = time.monotonic()
    slow_since = None
    while True:
        ratio, stop = probe_together(ep, plan, start + plan.guard)
        record.probes.append(ratio)
        if stop:
            break
        if slow_since is None:
            slow_since = time.monotonic()
        time.sleep(GUARD_PAUSE)
    if slow_since is not None:
        record.waited_s += time.monotonic() - slow_since

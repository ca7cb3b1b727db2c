"""``cma-bench``: OSU-style latency and bandwidth of every cma transport beside baselines.

::

    cma-bench                                  # = cma-bench latency --quick: every
                                               #   transport and baseline, 8 B .. 64 MiB
    cma-bench latency --transport shm,cma --min-size 4K --max-size 16M --json out.json
    cma-bench bw --transport all --plot bw.png
    cma-bench bibw --cold                      # fresh receive buffers: page faults included
    cma-bench latency --format mpi4py          # rows like ``python -m mpi4py.bench pingpong``
    mpiexec -n 2 cma-bench latency             # adds plain mpi4py and cma.mpi.Comm(COMM_WORLD)
    cma-bench latency --rounds 5               # every series 5 times in turn; medians of rounds
    cma-bench latency --rounds 5 --interleave  # ... taking those turns at every size
    cma-bench latency --guard 120              # time each size only while the CPUs are quiet
    cma-bench latency --buffer numpy,spec      # one series per buffer form: shm[numpy], shm[spec]...
    mpiexec -n 2 cma-bench bw --waitall mpi    # cma.mpi waits with MPI.Request.Waitall

Without mpiexec every peer is a child process this command starts (spawn) for each
series and ends before the next one (with ``--interleave``, one per series for the
whole run). Under mpiexec, rank 0 prints and runs the local series (with its own child
processes) while the other ranks wait without spinning; the MPI series (``mpi4py``,
``cma.mpi``) run between ranks 0 and 1.

Every number is measured in this run: times with ``time.perf_counter_ns`` per iteration
(latency) or per window (bw, bibw), copies from both processes' ``comm.stats()`` over the
timed loop only. With ``--rounds N`` the series take turns N times and each size reports
the median of its N round means; ``--interleave`` takes those turns at every size.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _benchutil as util
from ._benchutil import Series, SizeResult
from .errors import TransportUnavailable

TAG_DATA = 1
TAG_ACK = 2
TAG_STATS = 3
TAG_CTRL = 4
TAG_GUARD = 5

# A peer that has not exited this long after its last message is stuck: it is killed.
JOIN_TIMEOUT = 10.0

Bytes = npt.NDArray[np.uint8]
Buffer = Bytes | bytearray

# --buffer: what the kernels pass to Send/Recv/Isend/Irecv (memcpy and mp-pipe ignore it).
BUFFER_FORMS = {
    "numpy": "a bare NumPy uint8 array",
    "bytearray": "a bare bytearray",
    "spec": "[array, count, MPI.BYTE] built in every call ([array, count, 'B'] for cma transports)",
    "spec-bytearray": "the same over a bytearray",
}
BUFFER_KINDS = ("latency", "bw")
WAITALL_MODES = ("each", "mpi")


# ---------------------------------------------------------------- the multiprocessing.Pipe baseline


class _Done:
    def Wait(self) -> bool:
        return True


class _DeferredRecv:
    def __init__(self, conn: Connection, buf: Bytes) -> None:
        self.conn = conn
        self.buf = buf

    def Wait(self) -> bool:
        self.conn.recv_bytes_into(self.buf)
        return True


class PipeComm:
    """A ``multiprocessing.Pipe`` end dressed as a size-2 communicator: what a Python user
    without cma would write (``send_bytes`` / ``recv_bytes_into``).

    Tags are ignored because the benchmarks send in a fixed order. ``Isend`` writes at
    once (the kernel buffers the pipe) and ``Irecv`` reads when waited on, which is enough
    for latency and bw; a bidirectional window would fill both pipe buffers and block.
    """

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank

    def Send(self, buf: Bytes, dest: int, tag: int = 0) -> None:
        self.conn.send_bytes(buf.data)

    def Recv(self, buf: Bytes, source: int = -1, tag: int = -1) -> None:
        self.conn.recv_bytes_into(buf)

    def Isend(self, buf: Bytes, dest: int, tag: int = 0) -> _Done:
        self.conn.send_bytes(buf.data)
        return _Done()

    def Irecv(self, buf: Bytes, source: int = -1, tag: int = -1) -> _DeferredRecv:
        return _DeferredRecv(self.conn, buf)

    def Barrier(self) -> None:
        self.conn.send_bytes(b"\0")
        self.conn.recv_bytes()

    def send(self, obj: object, dest: int, tag: int = 0) -> None:
        self.conn.send(obj)

    def recv(self, source: int = -1, tag: int = -1) -> Any:
        return self.conn.recv()

    def close(self) -> None:
        self.conn.close()


def mp_pipe_pair() -> tuple[PipeComm, PipeComm]:
    a, b = multiprocessing.Pipe(duplex=True)
    return PipeComm(a, 0), PipeComm(b, 1)


# ---------------------------------------------------------------- one side of a benchmark


def _wait_each(requests: Sequence[Any]) -> None:
    for request in requests:
        request.Wait()


class Endpoint:
    """A communicator of any flavour plus the few things the kernels need to drive it.

    Flavours: ``cma`` (a ``cma.Pipe`` end), ``mpi`` (an mpi4py Intracomm), ``cma.mpi``
    (``cma.mpi.Comm``) and ``pipe`` (``PipeComm``). ``waitall="mpi"`` makes ``cma.mpi``
    wait for a list of requests with ``MPI.Request.Waitall``; ``mpi`` always does, the
    others cannot (they have no MPI).
    """

    def __init__(self, comm: Any, flavor: str, waitall: str = "each") -> None:
        self.comm = comm
        self.rank = int(comm.rank)
        self.has_stats = callable(getattr(comm, "stats", None)) and callable(
            getattr(comm, "reset_stats", None))
        self.waitall: Callable[[Sequence[Any]], object] = _wait_each
        self.byte: Any = "B"  # the datatype of a --buffer spec list
        if flavor == "cma":
            import cma

            self.waitall = cma.Request.Waitall
        elif flavor in ("mpi", "cma.mpi"):
            from mpi4py import MPI

            self.byte = MPI.BYTE
            if flavor == "mpi" or waitall == "mpi":
                self.waitall = MPI.Request.Waitall

    def stats(self) -> dict[str, dict[str, float]] | None:
        return self.comm.stats() if self.has_stats else None


@dataclass(frozen=True)
class SizePlan:
    size: int
    iterations: int
    warmup: int


@dataclass(frozen=True)
class Plan:
    """Everything both sides must agree on; pickled to the peer process."""

    kind: str  # "latency", "bw", "bibw" or "memcpy"
    sizes: tuple[SizePlan, ...]
    window: int
    cold: bool
    guard: float = 0.0  # --guard: seconds to wait for a quiet machine per timed loop
    guard_cpus: tuple[int, ...] = ()  # the two CPUs the probe copies between
    buffer: str = "numpy"  # --buffer: one of BUFFER_FORMS
    waitall: str = "each"  # --waitall: one of WAITALL_MODES


def build_plan(kind: str, sizes: Sequence[int], *, window: int, cold: bool, quick: bool,
               iterations: int | None, warmup: int | None) -> Plan:
    plans = []
    for size in sizes:
        iters, warm = util.counts_for(kind, size, window=window, quick=quick,
                                      iterations=iterations, warmup=warmup)
        plans.append(SizePlan(size, iters, warm))
    return Plan(kind, tuple(plans), window, cold)


def _touched(size: int, value: int) -> Bytes:
    """A buffer whose every page has been written, so no page fault lands in the timing."""
    return np.full(size, value, dtype=np.uint8)


def _fresh(size: int) -> Bytes:
    """A buffer whose pages were never touched: the first write to each page faults.

    A private anonymous mapping of its own, because malloc would hand back pages an
    earlier iteration already touched.
    """
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8)


@dataclass
class _Buffers:
    send: Buffer
    recv: Buffer
    ack: Bytes


def make_buffers(size: int, form: str) -> _Buffers:
    """The send and receive buffers of one size in a --buffer form, every page written."""
    send: Buffer = _touched(size, 0x5A)
    recv: Buffer = _touched(size, 0)
    if form.endswith("bytearray"):
        send, recv = bytearray(send), bytearray(recv)
    return _Buffers(send, recv, _touched(1, 1))


# Fresh receive buffers are mapped this many bytes at a time, between untimed barriers,
# so that neither mmap nor munmap lands inside a timed sample on either rank.
COLD_POOL_BYTES = 128 * util.MIB
# A bw/bibw iteration needs a window of fresh buffers at once; above this, refuse.
COLD_WINDOW_LIMIT = 1 * util.GIB


def _receive_buffers(ep: Endpoint, bufs: _Buffers, n: int, count: int, per_iteration: int,
                     cold: bool) -> Iterator[list[Buffer]]:
    """Per iteration, ``count`` buffers to receive into: the warm one, or never-touched ones.

    ``per_iteration`` is the most any rank receives per iteration; both ranks derive the
    batch length from it so that they reach the barriers between batches together.
    """
    if not cold:
        warm = [bufs.recv] * count
        for _ in range(n):
            yield warm
        return
    size = len(bufs.recv)
    batch = max(1, COLD_POOL_BYTES // (per_iteration * size))
    mapped: list[list[list[Buffer]]] = []  # batches still mapped, oldest first
    for start in range(0, n, batch):
        # The caller holds the last buffers of the latest batch until it takes the next
        # one, so only the batches before that one are unmapped here.
        del mapped[:-1]
        mapped.append([[_fresh(size) for _ in range(count)]
                       for _ in range(min(batch, n - start))])
        # (a cma communicator counts this barrier's few bytes in the timed loop's stats)
        ep.comm.Barrier()
        yield from mapped[-1]


def _pingpong(ep: Endpoint, bufs: _Buffers, n: int, cold: bool, window: int) -> list[int]:
    send, recv, sbuf = ep.comm.Send, ep.comm.Recv, bufs.send
    peer = 1 - ep.rank
    clock = time.perf_counter_ns
    samples = []
    for (rbuf,) in _receive_buffers(ep, bufs, n, 1, 1, cold):
        if ep.rank == 0:
            t0 = clock()
            send(sbuf, peer, TAG_DATA)
            recv(rbuf, peer, TAG_DATA)
            samples.append(clock() - t0)
        else:
            recv(rbuf, peer, TAG_DATA)
            send(sbuf, peer, TAG_DATA)
    return samples


def _bandwidth(ep: Endpoint, bufs: _Buffers, n: int, cold: bool, window: int) -> list[int]:
    """OSU bw: rank 0 posts ``window`` Isends, rank 1 ``window`` Irecvs, then a 1-byte ack."""
    comm, waitall, sbuf = ep.comm, ep.waitall, bufs.send
    peer = 1 - ep.rank
    clock = time.perf_counter_ns
    samples = []
    receives = 0 if ep.rank == 0 else window
    for targets in _receive_buffers(ep, bufs, n, receives, window, cold):
        if ep.rank == 0:
            t0 = clock()
            waitall([comm.Isend(sbuf, peer, TAG_DATA) for _ in range(window)])
            comm.Recv(bufs.ack, peer, TAG_ACK)
            samples.append(clock() - t0)
        else:
            waitall([comm.Irecv(target, peer, TAG_DATA) for target in targets])
            comm.Send(bufs.ack, peer, TAG_ACK)
    return samples


def _pingpong_spec(ep: Endpoint, bufs: _Buffers, n: int, cold: bool, window: int) -> list[int]:
    """``_pingpong`` with each buffer passed as ``[buf, count, datatype]``, the list built in
    the call as mpi4py code writes it inline, so that its conversion is timed every time."""
    send, recv, sbuf = ep.comm.Send, ep.comm.Recv, bufs.send
    count, byte = len(sbuf), ep.byte
    peer = 1 - ep.rank
    clock = time.perf_counter_ns
    samples = []
    for (rbuf,) in _receive_buffers(ep, bufs, n, 1, 1, cold):
        if ep.rank == 0:
            t0 = clock()
            send([sbuf, count, byte], peer, TAG_DATA)
            recv([rbuf, count, byte], peer, TAG_DATA)
            samples.append(clock() - t0)
        else:
            recv([rbuf, count, byte], peer, TAG_DATA)
            send([sbuf, count, byte], peer, TAG_DATA)
    return samples


def _bandwidth_spec(ep: Endpoint, bufs: _Buffers, n: int, cold: bool, window: int) -> list[int]:
    """``_bandwidth`` with each payload buffer passed as a ``[buf, count, datatype]`` built
    in the call (the 1-byte ack stays a bare array)."""
    comm, waitall, sbuf = ep.comm, ep.waitall, bufs.send
    count, byte = len(sbuf), ep.byte
    peer = 1 - ep.rank
    clock = time.perf_counter_ns
    samples = []
    receives = 0 if ep.rank == 0 else window
    for targets in _receive_buffers(ep, bufs, n, receives, window, cold):
        if ep.rank == 0:
            t0 = clock()
            waitall([comm.Isend([sbuf, count, byte], peer, TAG_DATA) for _ in range(window)])
            comm.Recv(bufs.ack, peer, TAG_ACK)
            samples.append(clock() - t0)
        else:
            waitall([comm.Irecv([target, count, byte], peer, TAG_DATA) for target in targets])
            comm.Send(bufs.ack, peer, TAG_ACK)
    return samples


def _bibandwidth(ep: Endpoint, bufs: _Buffers, n: int, cold: bool, window: int) -> list[int]:
    """OSU bibw: both ranks post ``window`` Irecvs and ``window`` Isends, then wait for all."""
    comm, waitall, sbuf = ep.comm, ep.waitall, bufs.send
    peer = 1 - ep.rank
    clock = time.perf_counter_ns
    samples = []
    for targets in _receive_buffers(ep, bufs, n, window, window, cold):
        t0 = clock()
        requests = [comm.Irecv(target, peer, TAG_DATA) for target in targets]
        requests += [comm.Isend(sbuf, peer, TAG_DATA) for _ in range(window)]
        waitall(requests)
        samples.append(clock() - t0)
    return samples


Kernel = Callable[[Endpoint, _Buffers, int, bool, int], list[int]]
# By kind and whether buffers go as spec lists: a loop of its own for each, so that the
# loop of bare buffers does no work for the other forms. (A bare array and a bare
# bytearray share theirs: only the objects passed differ.)
KERNELS: dict[tuple[str, bool], Kernel] = {
    ("latency", False): _pingpong, ("latency", True): _pingpong_spec,
    ("bw", False): _bandwidth, ("bw", True): _bandwidth_spec,
    ("bibw", False): _bibandwidth,
}


def kernel_for(kind: str, form: str) -> Kernel:
    try:
        return KERNELS[(kind, form.startswith("spec"))]
    except KeyError:
        raise ValueError(f"cma-bench {kind} has no --buffer {form}") from None


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


def _probe_together(ep: Endpoint, plan: Plan, stop_after: float | None) -> tuple[float, bool]:
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


def _await_quiet(ep: Endpoint, plan: Plan, record: SizeResult) -> None:
    """Probe until the machine is quiet or ``plan.guard`` seconds have passed.

    ``record.waited_s`` grows by the time from the first slow probe to the quiet one:
    a size that found the machine quiet waited 0 s, however long its probe took.
    """
    start = time.monotonic()
    slow_since = None
    while True:
        ratio, stop = _probe_together(ep, plan, start + plan.guard)
        record.probes.append(ratio)
        if stop:
            break
        if slow_since is None:
            slow_since = time.monotonic()
        time.sleep(GUARD_PAUSE)
    if slow_since is not None:
        record.waited_s += time.monotonic() - slow_since


def _run_size(ep: Endpoint, plan: Plan, sp: SizePlan) -> SizeResult | None:
    """One size on one rank; rank 0 gets the result, rank 1 sends it its stats, others idle.

    Under ``plan.guard`` (two ranks only) each timed loop waits for a quiet machine and
    is redone, at most GUARD_REDO times, when the probe after it finds the machine slow;
    the result lists every probe and the mean of every loop left out.
    """
    comm = ep.comm
    kernel = kernel_for(plan.kind, plan.buffer)
    active = ep.rank < 2
    result = SizeResult(size=sp.size, iterations=sp.iterations, warmup=sp.warmup,
                        messages_per_sample=util.messages_per_sample(plan.kind, plan.window),
                        samples_ns=[])
    guarded = plan.guard > 0 and active
    redos = 0
    comm.Barrier()
    if active:
        bufs = make_buffers(sp.size, plan.buffer)
    while True:
        if guarded:
            _await_quiet(ep, plan, result)
        if active:
            kernel(ep, bufs, sp.warmup, plan.cold, plan.window)
        # After this barrier no message of the warm-up is left to process, so resetting
        # the counters right away makes them cover exactly the timed loop.
        comm.Barrier()
        if not active:
            return None
        if ep.has_stats:
            comm.reset_stats()
        samples = kernel(ep, bufs, sp.iterations, plan.cold, plan.window)
        own = ep.stats()
        if not guarded:
            break
        ratio, _ = _probe_together(ep, plan, None)
        result.probes.append(ratio)
        if ratio <= QUIET_RATIO or redos == GUARD_REDO:
            break
        redos += 1
        result.samples_ns = samples
        if samples:  # rank 0 times, rank 1 only answers
            result.redone_us.append(result.mean_us)
    if ep.rank == 1:
        comm.send(own, 0, tag=TAG_STATS)
        return None
    peer = comm.recv(source=1, tag=TAG_STATS)
    result.samples_ns = samples
    result.stats = [s for s in (own, peer) if s is not None]
    return result


def run_plan(ep: Endpoint, plan: Plan) -> list[SizeResult]:
    """Run every size of ``plan`` on this rank; only rank 0's list is non-empty."""
    results = []
    for sp in plan.sizes:
        result = _run_size(ep, plan, sp)
        if result is not None:
            results.append(result)
    return results


def memcpy_size(plan: Plan, sp: SizePlan) -> SizeResult:
    """The ceiling: ``np.copyto`` of the same size inside one process."""
    clock = time.perf_counter_ns
    src, dst = _touched(sp.size, 0x5A), _touched(sp.size, 0)
    samples = []
    for i in range(sp.warmup + sp.iterations):
        if plan.cold:
            dst = _fresh(sp.size)
        t0 = clock()
        np.copyto(dst, src)
        if i >= sp.warmup:
            samples.append(clock() - t0)
    return SizeResult(sp.size, sp.iterations, sp.warmup, 1, samples)


# ---------------------------------------------------------------- peer processes


# CPUs for this process and for the peer child when --bind is on (set by main).
_cpus: dict[str, int] = {}


def bind_cpus(rank: int) -> dict[str, int]:
    """Pin this process to one CPU and choose the next for a peer, as OSU runs are bound:
    two spinning processes that share a CPU measure the scheduler, not the transport."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    own = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {own})
    return {"self": own, "peer": cpus[(rank + 1) % len(cpus)]}


def _peer_main(comm: Any, flavor: str, plan: Plan, cpu: int | None = None) -> None:
    # Ctrl-C reaches the whole process group; the parent handles it and ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        run_plan(Endpoint(comm, flavor), plan)
    finally:
        comm.close()


def _close(comm: Any) -> None:
    try:
        comm.close()
    except Exception as exc:  # cleanup must go on; say what failed
        print(f"cma-bench: closing {type(comm).__name__}: {exc}", file=sys.stderr)


class Runner:
    """One series for one session of the schedule: ``open`` with the sizes it will run,
    then ``run_size`` for each in that order, then ``close``."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def open(self, sizes: Sequence[SizePlan]) -> None:
        pass

    def run_size(self, sp: SizePlan) -> SizeResult | None:
        raise NotImplementedError

    def close(self, completed: bool) -> None:
        """``completed``: every size ran, so a peer process ends on its own."""


class MemcpyRunner(Runner):
    def run_size(self, sp: SizePlan) -> SizeResult:
        return memcpy_size(self.plan, sp)


class EndpointRunner(Runner):
    """A series between two endpoints; ``open`` sets ``ep``, this rank's."""

    ep: Endpoint

    def run_size(self, sp: SizePlan) -> SizeResult | None:
        return _run_size(self.ep, self.plan, sp)


class PeerRunner(EndpointRunner):
    """Rank 0 here, rank 1 in a spawned child that runs the session's sizes in turn."""

    def __init__(self, plan: Plan, pair: Callable[[], tuple[Any, Any]], flavor: str) -> None:
        super().__init__(plan)
        self.pair = pair
        self.flavor = flavor
        self.ends: tuple[Any, Any] | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None

    def open(self, sizes: Sequence[SizePlan]) -> None:
        local, remote = self.ends = self.pair()
        self.ep = Endpoint(local, self.flavor)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_peer_main, name="cma-bench-peer", daemon=True,
            args=(remote, self.flavor, replace(self.plan, sizes=tuple(sizes)), _cpus.get("peer")))
        self.proc.start()
        if self.flavor == "pipe":
            # The child holds its own copy now; dropping ours turns the child's death
            # into EOF here instead of a receive that waits forever.
            remote.close()

    def close(self, completed: bool) -> None:
        if self.ends is None:
            return
        local, remote = self.ends
        _close(local)
        proc = self.proc
        if proc is not None:
            if completed:
                proc.join(JOIN_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
            if completed and proc.exitcode:
                print(f"cma-bench: peer process exited with code {proc.exitcode}",
                      file=sys.stderr)
        _close(remote)


class WorldRunner(EndpointRunner):
    """Ranks 0 and 1 of an MPI world (every rank takes part)."""

    def __init__(self, plan: Plan, comm: Callable[[], Any], flavor: str) -> None:
        super().__init__(plan)
        self.make_comm = comm
        self.flavor = flavor

    def open(self, sizes: Sequence[SizePlan]) -> None:
        # (a cma.mpi.Comm over COMM_WORLD is left open: its Free would free COMM_WORLD)
        self.ep = Endpoint(self.make_comm(), self.flavor, self.plan.waitall)


def serve_echo(comm: Any, flavor: str = "cma") -> None:
    """Echo server for round-trip benchmarks (``bench/``), run as rank 1 in a child process.

    Commands come from rank 0 with ``send(obj, tag=TAG_CTRL)``: ``(size, count)`` echoes
    ``count`` messages of ``size`` bytes, then answers with this process's stats over them;
    ``None`` ends the server.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ep = Endpoint(comm, flavor)
    try:
        while (command := comm.recv(source=0, tag=TAG_CTRL)) is not None:
            size, count = command
            buf = _touched(size, 0)
            if ep.has_stats:
                comm.reset_stats()
            for _ in range(count):
                comm.Recv(buf, 0, TAG_DATA)
                comm.Send(buf, 0, TAG_DATA)
            comm.send(ep.stats(), 0, tag=TAG_STATS)
    finally:
        comm.close()


# ---------------------------------------------------------------- MPI


# Set by mpiexec/mpirun (MPICH hydra, Open MPI, PMIx); checked first so that a plain run
# never initialises MPI just to learn that it is alone.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def mpi_world() -> Any | None:
    """MPI.COMM_WORLD when started by mpiexec with at least 2 ranks and mpi4py installed."""
    if not any(name in os.environ for name in _LAUNCHER_VARS):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    return world if world.Get_size() >= 2 else None


def _wait_for_rank0(world: Any) -> None:
    """Ranks other than 0 wait here while rank 0 runs local series: a sleeping poll,
    because MPI_Barrier spins and would take a core from the measurement."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


# ---------------------------------------------------------------- series selection


@dataclass
class SeriesSpec:
    """How to run one series: ``local`` ones run on rank 0 (with a child peer where needed),
    ``world`` ones between MPI ranks 0 and 1 with every rank taking part."""

    name: str
    family: str
    where: str
    runner: Callable[[Plan], Runner]
    skip: str = ""
    buffer: str | None = None  # the --buffer form it sends; None: it ignores --buffer


BASELINES = ("memcpy", "mp-pipe", "mpi4py")


def _split(text: str) -> list[str]:
    return [] if text.strip() == "none" else [t.strip() for t in text.split(",") if t.strip()]


def _forms(name: str, buffers: Sequence[str]) -> list[tuple[str, str]]:
    """(series name, buffer form) for each --buffer form of a series that sends buffers;
    the name says the form unless it is only the default one."""
    if list(buffers) == ["numpy"]:
        return [(name, "numpy")]
    return [(f"{name}[{form}]", form) for form in buffers]


def select_series(kind: str, transports: str, baselines: str, world: Any | None,
                  buffers: Sequence[str] = ("numpy",)) -> tuple[list[SeriesSpec], list[Series]]:
    """The series to run in order, and the ones reported as not run (with the reason);
    a series that sends buffers comes once per form in ``buffers``."""
    specs: list[SeriesSpec] = []
    not_run: list[Series] = []
    wanted_baselines = _split(baselines)
    unknown = sorted(set(wanted_baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline {', '.join(unknown)}: choose from "
                         f"{', '.join(BASELINES)} or none")
    for name in BASELINES:
        if name not in wanted_baselines:
            continue
        if name == "memcpy":
            specs.append(SeriesSpec(name, "baseline", "local", MemcpyRunner))
        elif name == "mp-pipe":
            specs.append(SeriesSpec(
                name, "baseline", "local", lambda plan: PeerRunner(plan, mp_pipe_pair, "pipe"),
                skip="bibw needs sends that do not block; multiprocessing.Pipe has none"
                if kind == "bibw" else ""))
        elif world is not None:
            specs += [SeriesSpec(named, "baseline", "world",
                                 lambda plan: WorldRunner(plan, lambda: world, "mpi"), buffer=form)
                      for named, form in _forms(name, buffers)]
        else:
            not_run += [Series(named, "baseline", "skipped", _mpi_hint(), buffer=form)
                        for named, form in _forms(name, buffers)]
    for name in _transport_names(transports, world):
        runner = _cma_mpi_runner(world) if name == "cma.mpi" else _cma_pipe_runner(name)
        where = "world" if name == "cma.mpi" else "local"
        specs += [SeriesSpec(named, "transport", where, runner, buffer=form)
                  for named, form in _forms(name, buffers)]
    return specs, not_run


def _mpi_hint() -> str:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'cma-ipc[mpi]')"
    return "not under mpiexec with 2 or more ranks (try: mpiexec -n 2 cma-bench ...)"


def _transport_names(text: str, world: Any | None) -> list[str]:
    wanted = _split(text)
    if not wanted:
        return []
    import cma
    from cma.transports import REGISTRY

    plugin = ["cma.mpi"] if world is not None else []
    if wanted == ["all"]:  # the teaching transports only when named
        return [*REGISTRY.practical(), "auto", *plugin]
    available = [*cma.transport_names(), "auto", *plugin]
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise ValueError(f"transport {', '.join(unknown)} not available here: choose from "
                         f"{', '.join(available)}, all or none")
    return wanted


def _cma_pipe_runner(name: str) -> Callable[[Plan], Runner]:
    def pair() -> tuple[Any, Any]:
        import cma

        return cma.Pipe(transport=name)

    return lambda plan: PeerRunner(plan, pair, "cma")


def _cma_mpi_runner(world: Any) -> Callable[[Plan], Runner]:
    def comm() -> Any:
        from cma import mpi as cma_mpi

        return cma_mpi.Comm(world)

    return lambda plan: WorldRunner(plan, comm, "cma.mpi")


def _meet_rank0(world: Any) -> None:
    """Every rank of ``world`` meets rank 0 here; the others wait without spinning."""
    if world.Get_rank() == 0:
        world.Ibarrier().Wait()
    else:
        _wait_for_rank0(world)


def _report_broken(series: Series, exc: Exception, world: Any | None) -> None:
    """Mark ``series`` unavailable or failed by ``exc``; a ``world`` series that failed
    other than on import aborts the job, since the other ranks would wait for it forever."""
    if isinstance(exc, ImportError):  # (on every rank alike)
        series.status, series.reason = "unavailable", f"cannot import: {exc}"
        return
    if world is not None:
        traceback.print_exc()
        world.Abort(1)
    series.status = "unavailable" if isinstance(exc, TransportUnavailable) else "failed"
    series.reason = f"{type(exc).__name__}: {exc}"


def run_schedule(specs: Sequence[SeriesSpec], plans: Mapping[str, Plan],
                 sessions: Sequence[Sequence[util.Step]], world: Any | None,
                 progress: util.Progress | None, settle: float = 0.0) -> list[list[Series]]:
    """Run every step of ``sessions`` that involves this rank; per series, one Series per
    round (filled on rank 0). A series that cannot run is reported, not fatal: its
    remaining steps are skipped."""
    rank = world.Get_rank() if world is not None else 0
    rounds = 1 + max((r for session in sessions for _, r, _ in session), default=0)
    runs = [[Series(spec.name, spec.family, buffer=spec.buffer) for _ in range(rounds)]
            for spec in specs]
    for spec, series_runs in zip(specs, runs, strict=True):
        if spec.skip:
            for series in series_runs:
                series.status, series.reason = "skipped", spec.skip
    total = sum(len(session) for session in sessions)
    done = 0
    previous = -1
    for session in sessions:
        runners: dict[int, Runner] = {}
        completed = False
        try:
            for index, round_index, size_index in session:
                done += 1
                spec, series = specs[index], runs[index][round_index]
                if spec.where == "local" and rank != 0 or any(
                        s.status != "ok" for s in runs[index]):
                    continue
                plan = plans["memcpy" if spec.name == "memcpy" else "messages"]
                sp = plan.sizes[size_index]
                if settle > 0 and previous not in (-1, index):
                    time.sleep(settle)
                previous = index
                if spec.where == "world" and world is not None:
                    _meet_rank0(world)  # rank 0 may come from a local step
                if progress is not None:
                    where = f"round {round_index + 1}/{rounds} " if rounds > 1 else ""
                    progress.update(f"[{done}/{total}] {where}{spec.name}: {plan.kind} "
                                    f"{util.format_size(sp.size)}")
                start = time.perf_counter()
                try:
                    runner = runners.get(index)
                    if runner is None:
                        own = plan if spec.buffer is None else replace(plan, buffer=spec.buffer)
                        runner = runners[index] = spec.runner(own)
                        runner.open([plan.sizes[k] for i, _, k in session if i == index])
                    result = runner.run_size(sp)
                except Exception as exc:
                    # One broken series must not cost the others: report it and go on.
                    _report_broken(series, exc, world if spec.where == "world" else None)
                    broken = runners.pop(index, None)
                    if broken is not None:
                        broken.close(False)
                else:
                    if result is not None:
                        series.results.append(result)
                series.seconds += time.perf_counter() - start
            completed = True
        finally:
            for runner in runners.values():
                runner.close(completed)
    if world is not None:
        _meet_rank0(world)  # the others must not finalize MPI while rank 0 still runs
    return runs


# ---------------------------------------------------------------- command line


def _size_arg(text: str) -> int:
    try:
        return util.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_arg(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def _forms_arg(text: str) -> list[str]:
    forms = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [form for form in forms if form not in BUFFER_FORMS]
    if unknown or not forms:
        raise argparse.ArgumentTypeError(
            f"unknown buffer form {', '.join(map(repr, unknown)) or repr(text)}: choose one or "
            f"more, comma-separated, of {', '.join(BUFFER_FORMS)}")
    return forms


DEFAULT_MAX_SIZE = {"latency": 64 * util.MIB, "bw": 4 * util.MIB, "bibw": 4 * util.MIB}
KIND_HELP = {
    "latency": "blocking ping-pong; one-way time = round trip / 2 (osu_latency)",
    "bw": "a window of Isends then a 1-byte ack; the receiver posts Irecvs (osu_bw)",
    "bibw": "both ranks post a window of Irecvs and Isends at once (osu_bibw)",
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--transport", default="all", metavar="LIST",
        help="comma-separated cma transports (shm,cma,vmfd,auto; cma.mpi under mpiexec), "
             "'all' (every transport registered here, plus auto) or 'none' (default: all)")
    common.add_argument(
        "--baseline", default=",".join(BASELINES), metavar="LIST",
        help="comma-separated baselines: memcpy (np.copyto in one process), mp-pipe "
             "(multiprocessing.Pipe), mpi4py (only under mpiexec), or 'none' "
             f"(default: {','.join(BASELINES)})")
    common.add_argument("--min-size", type=_size_arg, default=8, metavar="SIZE",
                        help="smallest message, e.g. 8, 4K, 64KiB, 1M (units binary; default 8)")
    common.add_argument("--max-size", type=_size_arg, default=None, metavar="SIZE",
                        help="largest message (default 64MiB for latency, 4MiB for bw/bibw)")
    common.add_argument("--iterations", type=_count_arg(1), metavar="N",
                        help="timed iterations at every size, in each round (default: by size class, "
                             "OSU style)")
    common.add_argument("--warmup", type=_count_arg(0), metavar="N",
                        help="untimed warm-up iterations at every size, in each round")
    common.add_argument("--quick", action="store_true",
                        help="about 5-10x fewer iterations: a short but noisier run")
    common.add_argument("--cold", action="store_true",
                        help="a never-touched receive buffer every iteration, so first-touch "
                             "page faults are measured (default: warm, reused buffers)")
    common.add_argument("--window", type=_count_arg(1), default=64, metavar="N",
                        help="messages in flight per iteration for bw and bibw (default 64)")
    common.add_argument("--json", metavar="FILE",
                        help="write every sample, the parameters and the machine to FILE")
    common.add_argument("--plot", metavar="FILE.png",
                        help="draw time and bandwidth against size (needs matplotlib)")
    common.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each process to its own CPU, as OSU runs are bound "
                             "(default: on when there are 2 or more CPUs)")
    common.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="pause between series (default 0; --guard is the better "
                             "defence against a machine's slow spells)")
    common.add_argument("--guard", type=float, default=0.0, metavar="SECONDS",
                        help="before every timed loop, wait up to SECONDS until a probe "
                             "finds the two CPUs handing data to each other at their usual "
                             "speed, and redo a loop (at most twice) when the probe after "
                             "it does not; every wait and redone loop is reported (default "
                             "0: off; needs 2 CPUs and, under mpiexec, 2 ranks)")
    common.add_argument("--rounds", type=_count_arg(1), default=1, metavar="N",
                        help="run every series N times, in turn, each round in another "
                             "order (no series always first or always after the same "
                             "one); each size then reports the median of its N "
                             "round means, so a slow spell of the machine that hits one "
                             "round does not decide a ratio (default 1; the run takes N "
                             "times as long)")
    common.add_argument("--interleave", action="store_true",
                        help="measure every series at one size (in every round) before "
                             "the next size, all their peer processes alive at once, "
                             "instead of one series over all sizes after another: series "
                             "compared at a size then share the machine's slow spells "
                             "(default off)")
    common.add_argument("--format", choices=("table", "mpi4py"), default="table",
                        help="'mpi4py' prints rows like python -m mpi4py.bench pingpong")
    buffer_option = argparse.ArgumentParser(add_help=False)
    buffer_option.add_argument(
        "--buffer", type=_forms_arg, default=["numpy"], metavar="FORMS",
        help="what is passed to Send/Recv/Isend/Irecv: "
             + "; ".join(f"{form}: {meaning}" for form, meaning in BUFFER_FORMS.items())
             + ". Comma-separated: one series per form, named like cma.mpi[spec] (numpy "
             "alone keeps the plain names). Used by the cma transports, cma.mpi and "
             "mpi4py; memcpy and mp-pipe ignore it (default: numpy)")
    waitall_option = argparse.ArgumentParser(add_help=False)
    waitall_option.add_argument(
        "--waitall", choices=WAITALL_MODES, default="each",
        help="how cma.mpi waits for a window: each (Wait on every request in turn) or mpi "
             "(MPI.Request.Waitall on the list, in C, as mpi4py programs do). Ignored by "
             "the series without MPI: cma transports and mp-pipe wait on each request; "
             "the mpi4py baseline always uses MPI.Request.Waitall (default: each)")
    parser = argparse.ArgumentParser(
        prog="cma-bench",
        description="Latency and bandwidth of cma's transports beside memcpy, "
                    "multiprocessing.Pipe and (under mpiexec) mpi4py. Without a subcommand: "
                    "latency --quick over every transport, 8 B to 64 MiB.")
    sub = parser.add_subparsers(dest="kind", metavar="{latency,bw,bibw}")
    for kind in util.KINDS:
        parents = [common]
        if kind in BUFFER_KINDS:
            parents.append(buffer_option)
        if kind == "bw":
            parents.append(waitall_option)
        kind_parser = sub.add_parser(kind, parents=parents, help=KIND_HELP[kind],
                                     description=KIND_HELP[kind])
        kind_parser.set_defaults(buffer=["numpy"], waitall="each")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["latency", "--quick", *args]
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.max_size is None:
        ns.max_size = DEFAULT_MAX_SIZE[ns.kind]
    try:
        ns.sizes = util.size_range(ns.min_size, ns.max_size)
    except ValueError as exc:
        parser.error(str(exc))
    if ns.cold and ns.kind != "latency" and ns.window * ns.sizes[-1] > COLD_WINDOW_LIMIT:
        parser.error(f"--cold maps a fresh buffer for each of the {ns.window} messages of a "
                     f"window: over {util.format_size(COLD_WINDOW_LIMIT)} at "
                     f"{util.format_size(ns.sizes[-1])}; lower --max-size or --window")
    if ns.cold and any(form.endswith("bytearray") for form in ns.buffer):
        parser.error("--cold receives into pages no one has touched, but a bytearray is "
                     "written when it is made: use --buffer numpy or spec with --cold")
    if ns.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'cma-ipc[plot]'")
    return ns


WAITALL_NOTE = ("--waitall mpi: cma.mpi and mpi4py waited for each window with "
                "MPI.Request.Waitall; the series without MPI waited on each request in turn")


def report(kind: str, series: Sequence[Series], fmt: str, waitall: str = "each") -> str:
    if fmt == "mpi4py":
        return util.format_mpi4py(series)
    parts = [util.format_results(kind, series), util.format_copies(series)]
    if waitall == "mpi":
        parts.insert(1, WAITALL_NOTE)
    crossing = util.format_crossovers(util.crossovers(*util.compared_series(series)))
    if crossing:
        parts.append("crossovers: time per message, differences within 2 standard errors "
                     "count as ties\n" + crossing)
    guard = util.format_guard(series)
    if guard:
        parts.append("--guard: CPU-to-CPU copy probed before and after every timed loop "
                     f"(quiet up to {QUIET_RATIO}x)\n" + guard)
    notes = util.format_notes(series)
    if notes:
        parts.append("not measured\n" + notes)
    return "\n\n".join(p for p in parts if p)


def write_json(path: str, args: argparse.Namespace, plans: dict[str, Plan],
               series: Sequence[Series], started: float, argv: Sequence[str]) -> None:
    doc = {
        "tool": "cma-bench",
        "argv": list(argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "parameters": {
            "kind": args.kind, "sizes": args.sizes, "window": args.window, "cold": args.cold,
            "quick": args.quick, "iterations": args.iterations, "warmup": args.warmup,
            "rounds": args.rounds, "interleave": args.interleave, "guard": args.guard,
            "settle": args.settle, "buffer": args.buffer, "waitall": args.waitall,
            "transport": args.transport, "baseline": args.baseline, "cpus": dict(_cpus),
            "samples_ns": "nanoseconds per timed sample: a round trip (latency), a window "
                          "(bw, bibw) or one copy (memcpy); time per message = sample / "
                          "messages_per_sample",
            "plans": {name: asdict(plan) for name, plan in plans.items()},
        },
        "machine": util.machine_info(),
        "series": [util.series_json(s) for s in series],
        "crossovers": [asdict(c) for c in util.crossovers(*util.compared_series(series))],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world = mpi_world()
    rank = world.Get_rank() if world is not None else 0
    _cpus.clear()
    if args.bind:
        _cpus.update(bind_cpus(rank))
    try:
        specs, not_run = select_series(args.kind, args.transport, args.baseline, world,
                                       args.buffer)
    except (ValueError, ImportError, AttributeError) as exc:
        print(f"cma-bench: {exc}", file=sys.stderr)
        return 2
    if args.waitall == "mpi" and not any(spec.where == "world" for spec in specs):
        print("cma-bench: --waitall mpi changes only how the MPI series (cma.mpi, mpi4py) "
              "wait: run under mpiexec -n 2 with one of them", file=sys.stderr)
        return 2
    knobs = dict(window=args.window, cold=args.cold, quick=args.quick,
                 iterations=args.iterations, warmup=args.warmup)
    plans = {"messages": replace(build_plan(args.kind, args.sizes, **knobs), waitall=args.waitall),
             "memcpy": build_plan("memcpy", args.sizes, **knobs)}
    if args.guard > 0:
        # the in-process memcpy has no second CPU to wait for
        cpus = (_cpus["self"], _cpus["peer"]) if _cpus else tuple(sorted(os.sched_getaffinity(0)))
        if len(cpus) < 2 or (world is not None and world.Get_size() > 2):
            print("cma-bench: --guard needs two CPUs and, under mpiexec, exactly 2 ranks",
                  file=sys.stderr)
            return 2
        plans["messages"] = replace(plans["messages"], guard=args.guard, guard_cpus=cpus[:2])
    progress = util.Progress() if rank == 0 else None
    started = time.time()
    sessions = util.schedule(len(specs), len(args.sizes), args.rounds, args.interleave)
    try:
        runs = run_schedule(specs, plans, sessions, world, progress, args.settle)
    except KeyboardInterrupt:
        if progress is not None:
            progress.clear()
        print("cma-bench: interrupted", file=sys.stderr)
        return 130
    if progress is not None:
        progress.clear()
    if rank != 0:
        return 0
    results = [util.merge_series(series_runs) for series_runs in runs] + not_run
    text = report(args.kind, results, args.format, args.waitall)
    print(text, flush=True)
    if args.format == "mpi4py" and util.format_notes(results):
        print(util.format_notes(results), file=sys.stderr)
    if args.json:
        write_json(args.json, args, plans, results, started,
                   sys.argv[1:] if argv is None else argv)
    if args.plot:
        util.plot(args.kind, results, args.plot)
    return 1 if any(s.status == "failed" for s in results) else 0


if __name__ == "__main__":
    sys.exit(main())

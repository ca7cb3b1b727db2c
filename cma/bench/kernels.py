"""The timed loops of ``cma-bench`` (ping-pong, bw, bibw and memcpy), the buffers of each
``--buffer`` form they pass, and the ``Plan`` both sides of a run agree on."""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .endpoints import TAG_ACK, TAG_DATA, Bytes, Endpoint
from .results import SizeResult
from .sizes import GIB, MIB, counts_for

Buffer = Bytes | bytearray

# --buffer: what the kernels pass to Send/Recv/Isend/Irecv (memcpy and mp-pipe ignore it).
BUFFER_FORMS = {
    "numpy": "a bare NumPy uint8 array",
    "bytearray": "a bare bytearray",
    "spec": "[array, count, MPI.BYTE] built in every call ([array, count, 'B'] for cma transports)",
    "spec-bytearray": "the same over a bytearray",
    "heap": "a NumPy uint8 array from the shared heap (cma.empty), as xmap maps it",
}
BUFFER_KINDS = ("latency", "bw")


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
    view: bool = False  # --recv-view: receive with recv_view (released at once), not Recv


def build_plan(kind: str, sizes: Sequence[int], *, window: int, cold: bool, quick: bool,
               iterations: int | None, warmup: int | None) -> Plan:
    plans = []
    for size in sizes:
        iters, warm = counts_for(kind, size, window=window, quick=quick,
                                      iterations=iterations, warmup=warmup)
        plans.append(SizePlan(size, iters, warm))
    return Plan(kind, tuple(plans), window, cold)


def touched(size: int, value: int) -> Bytes:
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
    send: Buffer = touched(size, 0x5A)
    recv: Buffer = touched(size, 0)
    if form == "heap":
        import cma

        send = cma.empty(size, np.uint8)
        send.fill(0x5A)
    if form.endswith("bytearray"):
        send, recv = bytearray(send), bytearray(recv)
    return _Buffers(send, recv, touched(1, 1))


# Fresh receive buffers are mapped this many bytes at a time, between untimed barriers,
# so that neither mmap nor munmap lands inside a timed sample on either rank; 128 MiB holds
# two 64 MiB messages yet stays small beside the machine's memory (chosen).
COLD_POOL_BYTES = 128 * MIB
# A bw/bibw iteration needs a window of fresh buffers at once; above this, refuse (what
# two ranks may map on a shared machine without pushing others out; chosen).
COLD_WINDOW_LIMIT = 1 * GIB


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
    drop = _mapping_dropper(ep)
    if drop is not None:  # xmap: cold means every message maps the sender's segment anew
        warm = [bufs.recv] * count
        for _ in range(n):
            drop()
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


def _mapping_dropper(ep: Endpoint) -> Callable[[], object] | None:
    """The flush of a cma communicator's xmap mappings, if it has any (its cache is the
    communicator's own: reached through its progress, as nothing else needs it)."""
    xmap = getattr(getattr(ep.comm, "_progress", None), "xmap", None)
    return None if xmap is None else xmap.cache.flush


def _pingpong_view(ep: Endpoint, bufs: _Buffers, n: int, cold: bool, window: int) -> list[int]:
    """``_pingpong`` receiving each message with ``recv_view``, released at once: the
    sender's Send returns only after that release (a view of its heap memory)."""
    send, view, sbuf = ep.comm.Send, ep.comm.recv_view, bufs.send
    peer = 1 - ep.rank
    clock = time.perf_counter_ns
    samples = []
    for _ in _receive_buffers(ep, bufs, n, 1, 1, cold):
        if ep.rank == 0:
            t0 = clock()
            send(sbuf, peer, TAG_DATA)
            view(peer, TAG_DATA).release()
            samples.append(clock() - t0)
        else:
            view(peer, TAG_DATA).release()
            send(sbuf, peer, TAG_DATA)
    return samples


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


def kernel_for(kind: str, form: str, view: bool = False) -> Kernel:
    if view:
        if kind != "latency" or form.startswith("spec"):
            raise ValueError("--recv-view times cma-bench latency with bare buffers only")
        return _pingpong_view
    try:
        return KERNELS[(kind, form.startswith("spec"))]
    except KeyError:
        raise ValueError(f"cma-bench {kind} has no --buffer {form}") from None


def memcpy_size(plan: Plan, sp: SizePlan, threads: int = 1) -> SizeResult:
    """The ceiling: ``np.copyto`` of the same size inside one process; with ``threads=2``
    the two halves at once (NumPy lets go of the GIL), as xmap copies large messages."""
    clock = time.perf_counter_ns
    src, dst = touched(sp.size, 0x5A), touched(sp.size, 0)
    samples = []
    half = sp.size // 2 & ~4095
    pool = ThreadPoolExecutor(1) if threads > 1 else None
    for i in range(sp.warmup + sp.iterations):
        if plan.cold:
            dst = _fresh(sp.size)
        t0 = clock()
        if pool is not None and half:
            future = pool.submit(np.copyto, dst[:half], src[:half])
            np.copyto(dst[half:], src[half:])
            future.result()
        else:
            np.copyto(dst, src)
        if i >= sp.warmup:
            samples.append(clock() - t0)
    if pool is not None:
        pool.shutdown()
    return SizeResult(sp.size, sp.iterations, sp.warmup, 1, samples)

"""``cma-bench bcast|allreduce|reduce|allgather|alltoall|scan|exscan|reduce_scatter``: the
latency of cma.Comm's collectives in a world of N ranks, timed as OSU's osu_bcast,
osu_allreduce ... time them.

Each iteration is a barrier (not timed) and one collective (timed on every rank); the
figure of a size is the mean over iterations of each rank, averaged over ranks, with the
smallest and largest rank's mean beside it. Rank 0 is this process, the others are
spawned children that get their end of the world by pickling; under ``mpiexec -n N``
the series are mpi4py's collective and ``cma.mpi.Comm``'s over the same ranks instead. Copies are counted with
``comm.stats()`` on every rank and summed: bytes copied per collective over the message
size, in user space and in the kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import cma
from cma.comm import _shared_fds
from cma.world import WorldFds

from .report import format_number, render_table
from .results import machine_info
from .runners import mpi_world
from .sizes import MIB, counts_for, format_size, parse_size, size_range

COLLECTIVES = {
    "bcast": "Bcast of SIZE bytes from rank 0 (osu_bcast)",
    "allreduce": "Allreduce of SIZE bytes of float32 with SUM (osu_allreduce)",
    "reduce": "Reduce of SIZE bytes of float32 with SUM to rank 0 (osu_reduce)",
    "allgather": "Allgather of SIZE bytes from every rank (osu_allgather)",
    "alltoall": "Alltoall of SIZE bytes to every rank (osu_alltoall)",
    "scan": "Scan of SIZE bytes of float32 with SUM",
    "exscan": "Exscan of SIZE bytes of float32 with SUM",
    "reduce_scatter": "Reduce_scatter_block of SIZE bytes of float32 a rank with SUM",
}
# glibc serves an allocation with a fresh mmap (every page faulted in, ~6 us a page in this
# VM) until it has freed an mmapped chunk at least as large, which raises its threshold (to
# 32 MiB at most). Sizes run upwards, so whichever series ran first paid that at every size
# and the second reused the heap: an object allreduce of 1 MiB took 3.7 ms first and 0.4
# second, either library (docs/guide.md section 7). Freeing this much once before timing
# leaves every series the same allocator.
SETTLE_BYTES = 31 << 20


def settle_allocator() -> None:
    """Allocate and free SETTLE_BYTES, so that allocations up to that size reuse the heap."""
    block = np.empty(SETTLE_BYTES, np.uint8)
    del block


# A rank that has not exited this long after the last collective is stuck: it is killed
# (generous beside runners.JOIN_TIMEOUT: several ranks may share each core; chosen).
JOIN_TIMEOUT = 30.0


@dataclass
class CollectiveResult:
    """One size of one series: per-rank mean microseconds and summed copy counts."""

    size: int
    iterations: int
    rank_means_us: list[float]
    user_copied: float = 0.0  # bytes copied in user space per collective, all ranks
    kernel_copied: float = 0.0
    messages: float = 0.0  # point-to-point messages per collective, all ranks, both ends
    moved: float = 0.0  # bytes cma moved per collective, all ranks, both ends (0: MPI ran it)
    started: float = 0.0  # (time.time() on rank 0 when this size began: series' turns)

    @property
    def mean_us(self) -> float:
        """The mean time per collective, averaged over ranks (OSU's figure)."""
        return float(np.mean(self.rank_means_us))


@dataclass
class CollectiveSeries:
    name: str
    ranks: int
    results: list[CollectiveResult] = field(default_factory=list)
    error: str = ""


def _filled(count: int, dtype: Any, value: int, heap: bool) -> np.ndarray:
    """An array of ``count`` items of ``value``, from the shared heap if ``heap``."""
    array = cma.empty(count, dtype) if heap else np.empty(count, dtype)
    array.fill(value)
    return array


def operation(comm: Any, kind: str, nbytes: int, objects: bool = False,
              heap: bool = False, write: bool = False) -> Callable[[], None]:
    """The collective to time, with its buffers made (every page written) beforehand;
    ``objects``: the object form (``bcast`` of a dict holding an array of ``nbytes``,
    ``allreduce`` of the array itself, as Python objects are reduced, with ``+``);
    ``heap``: every array from the shared heap (``cma.empty``), which xmap maps;
    ``write``: each rank that sends data of its own (a Bcast's root, every rank elsewhere)
    writes new values into it before each call, timed with the call, as a program does."""
    size = comm.Get_size()
    root = comm.Get_rank() == 0
    if objects:
        array = _filled(nbytes, np.uint8, 1, heap)
        if kind == "bcast":
            message = {"step": 1, "name": "weights", "array": array}
            return _writing(lambda: comm.bcast(message if root else None, 0), array, write and root)
        if kind == "allreduce":
            return _writing(lambda: comm.allreduce(array), array, write)
        raise ValueError(f"{kind} has no object form here (bcast and allreduce do)")
    if kind == "bcast":
        buf = _filled(nbytes, np.uint8, 1, heap)
        return _writing(lambda: comm.Bcast(buf, 0), buf, write and root)
    if kind in ("allreduce", "reduce", "scan", "exscan"):
        count = max(1, nbytes // 4)
        send, recv = _filled(count, np.float32, 1, heap), _filled(count, np.float32, 0, heap)
        if kind == "reduce":
            return _writing(lambda: comm.Reduce(send, recv, root=0), send, write)
        if kind == "scan":
            return _writing(lambda: comm.Scan(send, recv), send, write)
        if kind == "exscan":
            return _writing(lambda: comm.Exscan(send, recv), send, write)
        return _writing(lambda: comm.Allreduce(send, recv), send, write)
    if kind == "reduce_scatter":
        count = max(1, nbytes // 4)
        send = _filled(count * size, np.float32, 1, heap)
        recv = _filled(count, np.float32, 0, heap)
        return _writing(lambda: comm.Reduce_scatter_block(send, recv), send, write)
    if kind == "allgather":
        send, recv = _filled(nbytes, np.uint8, 1, heap), _filled(nbytes * size, np.uint8, 0, heap)
        return _writing(lambda: comm.Allgather(send, recv), send, write)
    if kind == "alltoall":
        send = _filled(nbytes * size, np.uint8, 1, heap)
        recv = _filled(nbytes * size, np.uint8, 0, heap)
        return _writing(lambda: comm.Alltoall(send, recv), send, write)
    raise ValueError(f"unknown collective {kind!r}")


def _writing(call: Callable[[], None], data: np.ndarray, write: bool) -> Callable[[], None]:
    """``call``, after writing new values into ``data`` each time if ``write``."""
    if not write:
        return call
    values = itertools.count(2)

    def written() -> None:
        data.fill(next(values) & 0x7F)
        call()
    return written


def measure(comm: Any, run: Callable[[], None], iterations: int, warmup: int) -> list[int]:
    """This rank's timed samples (ns): barrier, then the collective, per iteration."""
    clock = time.perf_counter_ns
    samples = []
    for i in range(warmup + iterations):
        comm.Barrier()
        t0 = clock()
        run()
        elapsed = clock() - t0
        if i >= warmup:
            samples.append(elapsed)
    return samples


def _copied(stats: dict[str, dict[str, float]] | None) -> tuple[float, float, float, float]:
    """Bytes copied in user space and in the kernel, messages, bytes moved."""
    if not stats:
        return 0.0, 0.0, 0.0, 0.0
    user = sum(s["user_copies"] * s["bytes"] for s in stats.values())
    kernel = sum(s["kernel_copies"] * s["bytes"] for s in stats.values())
    return (user, kernel, sum(s["messages"] for s in stats.values()),
            sum(s["bytes"] for s in stats.values()))


def run_sizes(comm: Any, kind: str, plan: Sequence[tuple[int, int, int]],
              counter: Any = None, objects: bool = False, heap: bool = False,
              write: bool = False) -> list[CollectiveResult]:
    """Every size of ``plan`` ((size, iterations, warmup), ...) on this rank; rank 0
    returns the results gathered from all ranks, the others an empty list. ``counter``
    has the ``stats()`` to read (default: ``comm``'s, if it has any)."""
    out = []
    counter = comm if counter is None else counter
    has_stats = callable(getattr(counter, "reset_stats", None))
    for nbytes, iterations, warmup in plan:
        started = time.time()
        run = operation(comm, kind, nbytes, objects, heap, write)
        measure(comm, run, 0, warmup + 1)
        if has_stats:
            counter.reset_stats()  # (no message of the warm-up is left: its last barrier came after)
        samples = measure(comm, run, iterations, 0)
        copied = _copied(counter.stats() if has_stats else None)
        comm.Barrier()
        mine = (float(np.mean(samples)) / 1e3, copied)
        gathered = comm.gather(mine, root=0)
        if gathered is not None:
            # the barriers' messages are counted too: they carry no bytes
            per = [c for _, c in gathered]
            out.append(CollectiveResult(
                nbytes, iterations, [m for m, _ in gathered],
                user_copied=sum(c[0] for c in per) / iterations,
                kernel_copied=sum(c[1] for c in per) / iterations,
                messages=sum(c[2] for c in per) / iterations,
                moved=sum(c[3] for c in per) / iterations, started=started))
    return out


def _child(comm: cma.Comm, kind: str, plan: Sequence[tuple[int, int, int]], cpu: int | None,
           objects: bool, heap: bool, write: bool) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    settle_allocator()
    try:
        run_sizes(comm, kind, plan, objects=objects, heap=heap, write=write)
    finally:
        comm.close()


def run_world(kind: str, transport: str, ranks: int, plan: Sequence[tuple[int, int, int]],
              bind: bool, objects: bool = False, heap: bool = False, write: bool = False
              ) -> CollectiveSeries:
    """One series: a cma world of ``ranks`` ranks with ``transport``, this process rank 0;
    ``heap``: xmap on, every array from the shared heap."""
    series = CollectiveSeries(f"cma {transport}{' heap' if heap else ''}", ranks)
    settle_allocator()
    cpus = sorted(os.sched_getaffinity(0))
    pin = bind and ranks <= len(cpus)  # (oversubscribed: the scheduler places them)
    fds = WorldFds.create(ranks, cma.ChannelConfig())
    comms = [cma.Comm(_shared_fds(fds), r, transport, xmap=heap) for r in range(ranks)]
    fds.close()
    ctx = multiprocessing.get_context("spawn")
    procs = []
    original = os.sched_getaffinity(0)
    try:
        for r in range(1, ranks):
            proc = ctx.Process(target=_child, name=f"cma-bench-rank{r}", daemon=True,
                               args=(comms[r], kind, plan, cpus[r] if pin else None, objects,
                                     heap, write))
            proc.start()
            procs.append(proc)
        for comm in comms[1:]:
            comm.close()
        if pin:
            os.sched_setaffinity(0, {cpus[0]})
        series.results = run_sizes(comms[0], kind, plan, objects=objects, heap=heap, write=write)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the other series go on
        series.error = f"{type(exc).__name__}: {exc}"
    finally:
        os.sched_setaffinity(0, original)
        comms[0].close()
        for proc in procs:
            proc.join(JOIN_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return series


def run_mpi(kind: str, plan: Sequence[tuple[int, int, int]], bind: bool,
            objects: bool = False, cma_first: bool = False, heap: bool = False,
            write: bool = False, interleave: bool = False) -> list[CollectiveSeries]:
    """Under mpiexec: mpi4py's collective on COMM_WORLD, then cma.mpi.Comm's (cma's
    collectives when every rank is on this node), over the same processes; ``cma_first``:
    the other way round, so that a run in each order shows what one leaves the other;
    ``heap``: cma.mpi's series with xmap on and its arrays from the shared heap (mpi4py's
    from NumPy's, as its users have them); ``interleave``: the two take turns size by
    size, so that a slow spell of the host (guide.md section 7) falls on both series."""
    from mpi4py import MPI

    import cma.mpi

    world = MPI.COMM_WORLD
    cpus = sorted(os.sched_getaffinity(0))
    if bind and world.Get_size() <= len(cpus):
        os.sched_setaffinity(0, {cpus[world.Get_rank()]})
    settle_allocator()

    size = world.Get_size()
    name = "cma.mpi heap" if heap else "cma.mpi"

    def plain(steps: Sequence[tuple[int, int, int]]) -> list[CollectiveResult]:
        return run_sizes(world, kind, steps, objects=objects, write=write)

    def ours(wrapped: Any, steps: Sequence[tuple[int, int, int]]) -> list[CollectiveResult]:
        return run_sizes(wrapped, kind, steps, counter=wrapped.cma, objects=objects, heap=heap,
                         write=write)

    theirs = None if cma_first or interleave else plain(plan)
    wrapped = cma.mpi.Comm(world, xmap=True) if heap else cma.mpi.Comm(world)
    try:
        if interleave:
            theirs, mine = [], []
            for step in plan:
                if cma_first:
                    mine += ours(wrapped, [step])
                theirs += plain([step])
                if not cma_first:
                    mine += ours(wrapped, [step])
        else:
            mine = ours(wrapped, plan)
    finally:
        if wrapped.cma is not None:
            wrapped.cma.close()  # (not Free: that would free COMM_WORLD)
    # (mpi4py first in the report either way: the ratios' baseline)
    return [CollectiveSeries("mpi4py", size, plain(plan) if theirs is None else theirs),
            CollectiveSeries(name, size, mine)]


def format_report(kind: str, series: Sequence[CollectiveSeries], objects: bool = False,
                  write: bool = False, collectives: str | None = None) -> str:
    """The time table, the copies table, the spread of ranks; ``collectives``: the
    mode cma.mpi's collectives ran in (under mpiexec)."""
    ok = [s for s in series if s.results]
    if not ok:
        return "\n".join(f"{s.name}: {s.error}" for s in series)
    sizes = [r.size for r in ok[0].results]
    headers = ["size"] + [f"{s.name} us" for s in ok]
    if len(ok) > 1:  # time ratios: above 1, slower than the first series
        headers += [f"{s.name} / {ok[0].name}" for s in ok[1:]]
    rows = []
    for i, nbytes in enumerate(sizes):
        means = [s.results[i].mean_us for s in ok]
        row = [format_size(nbytes)] + [format_number(m) for m in means]
        row += [f"{m / means[0]:.2f}x" for m in means[1:]]
        rows.append(row)
    form = (" (objects)" if objects else "") + (" (new data written each call)" if write else "")
    parts = [f"{kind}{form}, {ok[0].ranks} ranks: time per collective, mean over iterations "
             "averaged over ranks (barrier between iterations not timed); a / b: a's time "
             "over b's",
             render_table(headers, rows)]
    # (where a series that moved bytes moved none, MPI's collective ran: cma.mpi hands a
    # collective to MPI where MPI was measured faster, cma.mpi.routing; the barriers
    # between iterations move messages of no bytes; xmap's reads in place copy none)
    counted = [s for s in ok if any(r.moved for r in s.results)]
    copies = [[format_size(nbytes)] + [
        f"{s.results[i].user_copied / nbytes:.2f} / {s.results[i].kernel_copied / nbytes:.2f}"
        if s.results[i].moved or s.ranks == 1 else "via MPI" for s in counted]
        for i, nbytes in enumerate(sizes)]
    if counted:
        parts.append("bytes copied per collective / size, all ranks (user / kernel), "
                     "from comm.stats(); via MPI: cma moved nothing, MPI's collective ran")
        parts.append(render_table(["size"] + [s.name for s in counted], copies))
    if collectives is not None:
        parts.append(f"cma.mpi's collectives: CMA_MPI_COLLECTIVES={collectives} (auto: through MPI "
                     "where cma.mpi.routing's table says MPI is faster; cma: all through cma)")
    spread = [f"{s.name} at {format_size(r.size)}: ranks {min(r.rank_means_us):.1f}-"
              f"{max(r.rank_means_us):.1f} us" for s in ok for r in s.results[-1:]]
    parts.append("slowest and fastest rank at the largest size: " + "; ".join(spread))
    parts += [f"{s.name}: {s.error}" for s in series if s.error]
    return "\n\n".join(parts)


def build_parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"cma-bench {kind}", description=COLLECTIVES[kind])
    parser.add_argument("-n", "--ranks", type=int, default=2,
                        help="ranks of the cma world (default 2; under mpiexec: mpiexec's)")
    parser.add_argument("--transport", default="auto", metavar="LIST",
                        help="comma-separated cma transports, one series each (default auto); "
                             "under mpiexec the series are mpi4py and cma.mpi")
    parser.add_argument("--min-size", type=parse_size, default=8, metavar="SIZE")
    parser.add_argument("--max-size", type=parse_size, default=16 * MIB, metavar="SIZE")
    parser.add_argument("--iterations", type=int, metavar="N",
                        help="timed iterations per size (default: by size, OSU style)")
    parser.add_argument("--warmup", type=int, metavar="N")
    parser.add_argument("--quick", action="store_true", help="about 5-10x fewer iterations")
    parser.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                        help="pin rank r to CPU r when there are as many CPUs as ranks")
    parser.add_argument("--json", metavar="FILE", help="write the results to FILE")
    parser.add_argument("--cma-first", action="store_true",
                        help="under mpiexec: time cma.mpi's series before mpi4py's (default after)")
    parser.add_argument("--interleave", action="store_true",
                        help="under mpiexec: time the two libraries size by size, in turns "
                             "(default: one library's whole series, then the other's), so that "
                             "a slow spell of the host falls on both")
    parser.add_argument("--write", action="store_true",
                        help="each rank that sends data of its own (a Bcast's root) writes new "
                             "values into it before each call, timed with the call, as a "
                             "program does (the OSU pattern, the default, sends one buffer "
                             "unchanged)")
    parser.add_argument("--heap", action="store_true",
                        help="cma's series with xmap on and every array from the shared heap "
                             "(cma.empty); under mpiexec mpi4py's arrays stay NumPy's")
    if kind in ("bcast", "allreduce"):
        parser.add_argument("--objects", action="store_true",
                            help="the object form: bcast of a dict holding an array of SIZE "
                                 "bytes, allreduce of the array (summed with +)")
    return parser


def main(kind: str, argv: Sequence[str]) -> int:
    args = build_parser(kind).parse_args(argv)
    if args.ranks < 1:
        print("cma-bench: -n must be at least 1", file=sys.stderr)
        return 2
    sizes = size_range(args.min_size, args.max_size)
    objects = bool(getattr(args, "objects", False))
    plan = []
    for nbytes in sizes:
        iterations, warmup = counts_for("latency", nbytes, window=1, quick=args.quick,
                                        iterations=args.iterations, warmup=args.warmup)
        plan.append((nbytes, iterations, warmup))
    world = mpi_world()
    if world is not None:
        series = run_mpi(kind, plan, args.bind, objects, args.cma_first, args.heap, args.write,
                         args.interleave)
        if world.Get_rank() != 0:
            return 0
    else:
        series = [run_world(kind, t.strip(), args.ranks, plan, args.bind, objects, args.heap,
                            args.write)
                  for t in args.transport.split(",") if t.strip()]
    collectives = None
    if world is not None:
        from cma.mpi import routing
        collectives = routing.mode_of(routing.env_mode_text())
    print(format_report(kind, series, objects, args.write, collectives), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "cma-bench", "kind": kind, "objects": objects, "heap": args.heap,
                       "write": args.write, "interleave": args.interleave,
                       "collectives": collectives,
                       "cma_first": bool(world is not None and args.cma_first), "argv": list(argv),
                       "machine": machine_info(), "plan": plan,
                       "series": [asdict(s) for s in series]}, f, indent=1)
            f.write("\n")
    return 1 if any(s.error for s in series) else 0

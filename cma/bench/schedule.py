"""The order of a ``cma-bench`` run: which series run (``select_series``), in what order
over rounds and sizes (``round_order``, ``schedule``), and the loop that runs them
(``run_schedule``)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import TransportUnavailable
from .endpoints import mp_pipe_pair
from .kernels import Plan
from .report import Progress
from .results import Series
from .runners import Memcpy2Runner, MemcpyRunner, PeerRunner, Runner, WorldRunner
from .sizes import format_size

# ---------------------------------------------------------------- order


def round_order(count: int, round_index: int) -> list[int]:
    """The order in which ``count`` series run in round ``round_index`` of ``--rounds``.

    Round 0 zigzags (0, 1, n-1, 2, n-2, ...: a row of a Williams design) and each later
    round adds one to every index. So every round starts with another series, and over
    up to ``count`` rounds a series follows a different one each time (the same one at
    most twice when ``count`` is odd). With a plain rotation every series follows the
    same one in every round, so whatever that one leaves behind, or a slow spell that
    tends to start at the same point of the run, always lands on the same victim.
    """
    zigzag, low, high = [0], 1, count - 1
    while low <= high:
        zigzag.append(low)
        low += 1
        if low <= high:
            zigzag.append(high)
            high -= 1
    return [(index + round_index) % count for index in zigzag]


Step = tuple[int, int, int]  # (series, round, size): indices of one timed loop


def schedule(series: int, sizes: int, rounds: int, interleave: bool) -> list[list[Step]]:
    """Every timed loop of a run in order, grouped in sessions (a series' peer process
    lives for one session).

    Normally a session is one series in one round: rounds in turn, the series of a round
    in ``round_order``, each over every size. With ``interleave`` the run is one session
    that measures every series at a size, in every round, before the next size: a slow
    spell of the machine then lands on the series compared at one size alike, not on
    one series' stretch of sizes.
    """
    if not interleave:
        return [[(index, r, k) for k in range(sizes)]
                for r in range(rounds) for index in round_order(series, r)]
    return [[(index, r, k) for k in range(sizes)
             for r in range(rounds) for index in round_order(series, r)]]


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


BASELINES = ("memcpy", "mp-pipe", "mpi4py", "memcpy2")
DEFAULT_BASELINES = BASELINES[:3]  # memcpy2 (two threads of np.copyto) only when named
COPY_BASELINES = ("memcpy", "memcpy2")  # one process: the memcpy plan


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
        elif name == "memcpy2":
            specs.append(SeriesSpec(name, "baseline", "local", Memcpy2Runner))
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
        if name == "xmap":  # auto with xmap beside it, sending from the shared heap
            specs.append(SeriesSpec(name, "transport", "local",
                                    _cma_pipe_runner("auto", xmap=True), buffer="heap"))
            continue
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
    available = [*cma.transport_names(), "auto", "xmap", *plugin]
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise ValueError(f"transport {', '.join(unknown)} not available here: choose from "
                         f"{', '.join(available)}, all or none")
    return wanted


def _cma_pipe_runner(name: str, **options: Any) -> Callable[[Plan], Runner]:
    def pair() -> tuple[Any, Any]:
        import cma

        return cma.Pipe(transport=name, **options)

    return lambda plan: PeerRunner(plan, pair, "cma")


def _cma_mpi_runner(world: Any) -> Callable[[Plan], Runner]:
    def comm() -> Any:
        from cma import mpi as cma_mpi

        return cma_mpi.Comm(world)

    return lambda plan: WorldRunner(plan, comm, "cma.mpi")


# ---------------------------------------------------------------- the run


def _wait_for_rank0(world: Any) -> None:
    """Ranks other than 0 wait here while rank 0 runs local series: a sleeping poll,
    because MPI_Barrier spins and would take a core from the measurement."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


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
                 sessions: Sequence[Sequence[Step]], world: Any | None,
                 progress: Progress | None, settle: float = 0.0) -> list[list[Series]]:
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
                plan = plans["memcpy" if spec.name in COPY_BASELINES else "messages"]
                sp = plan.sizes[size_index]
                if settle > 0 and previous not in (-1, index):
                    time.sleep(settle)
                previous = index
                if spec.where == "world" and world is not None:
                    _meet_rank0(world)  # rank 0 may come from a local step
                if progress is not None:
                    where = f"round {round_index + 1}/{rounds} " if rounds > 1 else ""
                    progress.update(f"[{done}/{total}] {where}{spec.name}: {plan.kind} "
                                    f"{format_size(sp.size)}")
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

"""cma.mpi under clients nobody here wrote: mpi4py's own benchmark and the OSU demos of its sdist.

What it measures, in one ``mpiexec -n 2`` job, each program once over plain mpi4py
("plain") and once with only the one-line change ``comm = cma.mpi.Comm(MPI.COMM_WORLD)``
("plugin"):

- ``mpi4py.bench.pingpong`` (shipped with mpi4py): its own mean one-way time per size,
  with NumPy buffers (``-a numpy``) and bytearrays (``-a none``), 1 B .. 64 MiB; and
  its object modes over NumPy arrays, pickled (``-p``: ``comm.send``/``comm.recv``) and
  out of band (``-o``: the same calls on ``mpi4py.util.pkl5.Intracomm(comm)``). The
  plugin series uses one ``cma.mpi.Comm(MPI.COMM_WORLD)`` made at the start. pkl5's
  plain series runs pkl5 as mpi4py ships it: importing cma.mpi gives pkl5 its routed
  view of ``MPI`` (cma/mpi/pkl5.py), which this bench takes back for that series.
- ``demo/osu_latency.py``, ``osu_bw.py`` and ``osu_bibw.py`` from the sdist of the installed
  mpi4py, downloaded with pip at run time into ``$CMA_IPC_CACHE`` (default
  ``~/.cache/cma-ipc``) and reused from there: the plain series runs the source as it is,
  the plugin series the source with its line ``comm = MPI.COMM_WORLD`` replaced.
  ``--demos`` may also name the sdist's collective demos (COLLECTIVE_DEMOS: osu_bcast,
  osu_allgather...), which rank 0 times; with only those (``--no-pingpong``), the job
  may have any number of ranks from 2.

Every round runs plain and plugin back to back for every case: round 0 plain first,
round 1 plugin first, and so on, so that what one library leaves behind in the process
(allocator state, page tables, MPI's caches) shows as a difference between the orders
rather than deciding the comparison. The tables give, per order, each series' median over
rounds with [min-max], and the median [min-max] of the per-round ratio plugin bandwidth /
plain bandwidth (> 1: the plugin is faster); ``--json`` keeps every round. Under each
table, per round: the CPU share of the ranks (other work on the machine) and
cma-bench's hand-off probe before and after each series (the host's slow spells,
docs/guide.md), since either decides a comparison more than the order does.

A series that raises (or exceeds ``--timeout``) on any rank is reported as failed with
each rank's first line of the exception, and is not run again; the other series go on.

Run (from the repository root; about 4 minutes with the defaults on a 2-CPU machine)::

    mpiexec -n 2 python bench/external_clients.py --json external-clients.json
    mpiexec -n 2 python bench/external_clients.py --max-size 2M --no-demos --rounds 8 --each-round
    mpiexec -n 16 python bench/external_clients.py --no-pingpong --demos osu_bcast,osu_allgather --rounds 2
    mpiexec -n 2 python bench/external_clients.py --no-pingpong --demos osu_bcast --demo-max-size 16M
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import math
import os
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, SimpleNamespace
from typing import Any

import mpi4py
import mpi4py.bench
from mpi4py import MPI
from mpi4py.util import pkl5

import cma.mpi
from cma.bench.guard import QUIET_RATIO, handoff_ratio
from cma.bench.report import format_number, render_table
from cma.bench.results import machine_info
from cma.bench.sizes import format_size, parse_size

SERIES = ("plain", "plugin")
DEMOS = ("osu_latency", "osu_bw", "osu_bibw")
# what --demos may name besides DEMOS: collectives over [mmap, n, MPI.BYTE] specs, back to back,
# on any number of ranks
COLLECTIVE_DEMOS = ("osu_bcast", "osu_allgather", "osu_alltoall", "osu_alltoallv", "osu_gather",
                    "osu_scatter")
# the demos that print MB/s; the others print microseconds: one way, or per collective
BANDWIDTH_DEMOS = ("osu_bw", "osu_bibw")
ARRAYS = ("numpy", "none")
# pingpong's object modes, each over NumPy arrays: pickled, and pkl5's out-of-band
OBJECTS = {"pickle": ["-a", "numpy", "-p"], "pkl5": ["-a", "numpy", "-o"]}
# pingpong's own options: its defaults (10000 loops, 1000 above 16 KiB, 10 above 1 MiB)
# take minutes per series; these keep a round near 30 s with stable means
PINGPONG_ARGS = "--skip 100 --loop 2000 --skip-large 10 --loop-large 200 --skip-huge 2 --loop-huge 20"
# the one line the plugin series changes, and what it becomes (indentation kept)
PLAIN_LINE = re.compile(r"^(?P<indent>[ \t]*)comm = MPI\.COMM_WORLD[ \t]*$", re.MULTILINE)
PLUGIN_LINE = r"\g<indent>comm = cma.mpi.Comm(MPI.COMM_WORLD)"
ENV_CACHE = "CMA_IPC_CACHE"
# after --timeout, a rank has this long to reach the agreement before the job is aborted,
# and as long again before a rank stuck inside MPI's C code exits on its own (faulthandler)
GRACE = 20.0
FETCH_TIMEOUT = 600.0
# below this share of two CPUs, something else ran beside the series (cpu_share)
BUSY_SHARE = 0.9


class SeriesTimeout(Exception):
    """Raised by SIGALRM in a series that ran past --timeout."""


def _on_alarm(signum: int, frame: object) -> None:
    # SIGALRM interrupts a wait in Python code (cma's): the series raises and the ranks
    # can leave it; a wait inside MPI's C code is not interrupted (see run_series)
    raise SeriesTimeout("no result within --timeout")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------- running one series, bounded


@dataclass
class Outcome:
    value: Any
    errors: list[str]  # per rank, "" where the series finished
    usage: list[dict[str, float]]  # per rank, getrusage over the series

    @property
    def failed(self) -> bool:
        return any(self.errors)


def sleep_until(request: MPI.Request, deadline: float) -> bool:
    """Wait for ``request`` without spinning (a spinning rank takes a CPU from the other
    on a 2-CPU machine); False if ``deadline`` (time.monotonic) passed first."""
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def usage_delta(before: resource.struct_rusage, after: resource.struct_rusage) -> dict[str, float]:
    return {"minflt": after.ru_minflt - before.ru_minflt, "majflt": after.ru_majflt - before.ru_majflt,
            "nvcsw": after.ru_nvcsw - before.ru_nvcsw, "nivcsw": after.ru_nivcsw - before.ru_nivcsw,
            "utime": round(after.ru_utime - before.ru_utime, 4),
            "stime": round(after.ru_stime - before.ru_stime, 4)}


def agree(ctl: MPI.Intracomm, report: object, deadline: float, on_stuck: Callable[[], None]) -> list[Any]:
    """Every rank's ``report`` once all ranks have left the series. A rank that has not
    arrived by ``deadline`` is stuck where neither its peer nor SIGALRM reaches it: inside
    MPI's C code (``MPI_Recv``, or ``MPI_Waitall`` over the plugin's requests), waiting for
    a message the failed rank will never send. No later collective could complete, so
    this rank calls ``on_stuck`` (which reports what was measured) and aborts the job."""
    if not sleep_until(ctl.Ibarrier(), deadline):
        print(f"external_clients: rank {ctl.Get_rank()}: another rank is stuck in a series; "
              "aborting the job", file=sys.stderr, flush=True)
        on_stuck()
        ctl.Abort(3)
    return ctl.allgather(report)


def run_series(ctl: MPI.Intracomm, call: Callable[[], Any], limit: float,
               on_stuck: Callable[[], None]) -> Outcome:
    """Run ``call`` on every rank, bounded. Both ranks leave a series that raised on only
    one of them: the other is waiting for a peer that left, and its SIGALRM at ``limit``
    makes it raise too; then they agree (``agree``) on which rank failed and why."""
    ctl.Barrier()  # both start here: the deadlines below hold on both ranks alike
    start = time.monotonic()
    faulthandler.dump_traceback_later(limit + 2 * GRACE, exit=True)  # stuck in C: exit, hydra ends the job
    before = resource.getrusage(resource.RUSAGE_SELF)
    value, error = None, ""
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        try:
            value = call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Exception as exc:  # any failure of the client is a result
        error = first_line(exc)
    usage = usage_delta(before, resource.getrusage(resource.RUSAGE_SELF))
    reports = agree(ctl, (error, usage), start + limit + GRACE, on_stuck)
    faulthandler.cancel_dump_traceback_later()
    return Outcome(value, [e for e, _ in reports], [u for _, u in reports])


def handoff_probe(ctl: MPI.Intracomm) -> float:
    """cma-bench's --guard probe: how much longer one CPU takes to copy 1 MiB that the other
    CPU has just written than 1 MiB it wrote itself. ~1 on a quiet machine; 1.7-2.1 in the
    spells docs/guide.md describes, when the host hands cache lines between our two vCPUs
    slowly (invisible from inside the VM otherwise). Rank 0 probes with two threads while
    the others sleep, leaving a CPU to the probe; nan with fewer than two CPUs."""
    ratio = math.nan
    if ctl.Get_rank() == 0:
        cpus = sorted(os.sched_getaffinity(0))[:2]
        if len(cpus) == 2:
            try:
                ratio = handoff_ratio(cpus)
            except RuntimeError:  # a probe thread did not finish in time: no verdict
                pass
        ctl.Ibarrier().Wait()
    else:
        sleep_until(ctl.Ibarrier(), math.inf)
    shared: float = ctl.bcast(ratio, root=0)
    return shared


# ---------------------------------------------------------------- the OSU demos of the sdist


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get(ENV_CACHE) or os.path.join(base, "cma-ipc"))


def fetch_demos(version: str, names: Sequence[str]) -> dict[str, Path]:
    """The demo files of mpi4py's sdist ``version``, downloaded and unpacked once into the cache."""
    root = cache_dir() / f"mpi4py-{version}"
    paths = {name: root / "demo" / f"{name}.py" for name in names}
    if all(path.is_file() for path in paths.values()):
        return paths
    sdists = root / "sdist"
    # (only mpi4py from source: tests/mpi4py_suite/run_matrix.py says why)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "mpi4py",
                    "--quiet", f"mpi4py=={version}", "-d", str(sdists)],
                   check=True, capture_output=True, text=True, timeout=FETCH_TIMEOUT)
    (root / "demo").mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdists / f"mpi4py-{version}.tar.gz") as tar:
        for name, path in paths.items():
            member = tar.extractfile(f"mpi4py-{version}/demo/{name}.py")
            if member is None:
                raise FileNotFoundError(f"demo/{name}.py is not a file in the mpi4py {version} sdist")
            partial = path.with_suffix(".part")  # renamed when complete: a concurrent run never
            partial.write_bytes(member.read())   # sees half a file
            partial.replace(path)
    return paths


def demo_sources(ctl: MPI.Intracomm, names: Sequence[str]) -> tuple[dict[str, tuple[str, str]], str]:
    """{name: (path, source)} on every rank, fetched by rank 0, or ({}, why not)."""
    found: tuple[dict[str, tuple[str, str]], str] = ({}, "")
    if ctl.Get_rank() == 0:
        try:
            paths = fetch_demos(mpi4py.__version__, names)
            found = ({name: (str(path), path.read_text()) for name, path in paths.items()}, "")
        except (OSError, subprocess.SubprocessError, tarfile.TarError) as exc:
            stderr = getattr(exc, "stderr", "") or ""
            found = ({}, f"cannot fetch the mpi4py {mpi4py.__version__} sdist: {first_line(exc)} "
                         f"{stderr.strip()[-300:]}".strip())
        ctl.Ibarrier().Wait()
    elif not sleep_until(ctl.Ibarrier(), time.monotonic() + FETCH_TIMEOUT + GRACE):
        ctl.Abort(3)
    shared: tuple[dict[str, tuple[str, str]], str] = ctl.bcast(found, root=0)
    return shared


def one_line_change(source: str) -> str:
    """``source`` with its one line ``comm = MPI.COMM_WORLD`` made ``comm = cma.mpi.Comm(...)``."""
    patched, count = PLAIN_LINE.subn(PLUGIN_LINE, source)
    if count != 1:
        raise ValueError(f"expected exactly one line 'comm = MPI.COMM_WORLD', found {count}")
    return patched


class PluginStandIn:
    """What the name ``cma`` means to a patched demo, whose source has no ``import cma.mpi``.

    Its ``cma.mpi.Comm(MPI.COMM_WORLD)`` returns a genuine ``cma.mpi.Comm``, but over a
    ``Dup()`` of COMM_WORLD, and keeps it so that ``free()`` can release it after the
    series: ``Free()`` of a wrapper frees the communicator it wraps, which COMM_WORLD must
    never be, and a wrapper left open per call would keep its shared world (and, after a
    failed series, requests and messages still in its rings) for the rest of the job.
    A fresh wrapper per call is what a fresh run of the program would get.
    """

    def __init__(self) -> None:
        self.mpi = SimpleNamespace(Comm=self._wrap)
        self.made: list[cma.mpi.Comm] = []

    def _wrap(self, comm: MPI.Intracomm, *args: Any, **options: Any) -> cma.mpi.Comm:
        if comm != MPI.COMM_WORLD:
            raise ValueError("the patched demo wraps something other than MPI.COMM_WORLD")
        dup = comm.Dup()
        try:
            wrapper = cma.mpi.Comm(dup, *args, **options)
        except BaseException:
            dup.Free()
            raise
        self.made.append(wrapper)
        return wrapper

    def free(self) -> None:
        while self.made:
            self.made.pop().Free()


def parse_demo_output(text: str) -> dict[int, float]:
    """{size: value} from an OSU demo's table (rank 0 prints it; '#' lines are headers)."""
    table = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            size, value = line.split()
            table[int(size)] = float(value)
    return table


def run_demo(name: str, code: CodeType, stand_in: PluginStandIn | None,
             max_size: int | None) -> dict[int, float]:
    """Execute the demo's module code in a fresh namespace and call its function
    (the module's ``if __name__ == "__main__"`` does not fire), with its own parameter
    ``MAX_MSG_SIZE`` set to ``max_size`` if given."""
    namespace: dict[str, Any] = {"__name__": f"mpi4py_demo_{name}"}
    if stand_in is not None:
        namespace["cma"] = stand_in
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
        namespace[name](**({} if max_size is None else {"MAX_MSG_SIZE": max_size}))
    return parse_demo_output(out.getvalue())


# ---------------------------------------------------------------- cases and rounds


@dataclass
class Case:
    bench: str  # "pingpong" or "demo"
    name: str  # "numpy", "none" (pingpong's -a), "pickle", "pkl5" (OBJECTS) or the demo's name
    metric: str  # "us" (smaller is better) or "MB/s"
    # series -> (the call run on every rank, what to do after the agreement)
    prepare: Callable[[str], tuple[Callable[[], dict[int, float]], Callable[[], None]]]

    @property
    def title(self) -> str:
        if self.bench == "demo":
            return f"demo/{self.name}.py"
        options = OBJECTS.get(self.name, ["-a", self.name])
        return f"pingpong {' '.join(options)}"


@dataclass
class Record:
    bench: str
    case: str
    series: str
    round: int
    first: str  # the series that ran first in this round
    status: str  # "ok", "failed" or "skipped"
    values: dict[int, float] = field(default_factory=dict)  # size -> us or MB/s (rank 0's)
    errors: list[str] = field(default_factory=list)
    usage: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the series
    load: float = 0.0  # 1-minute load average as the series ended
    probe: list[float] = field(default_factory=list)  # hand-off probe before and after the series


def pingpong_case(kind: str, comms: dict[str, MPI.Intracomm], args: list[str]) -> Case:
    options = OBJECTS.get(kind, ["-a", kind])  # (as Case.title says)
    shipped = kind == "pkl5"  # the plain series runs pkl5 without cma's view of MPI

    def prepare(series: str) -> tuple[Callable[[], dict[int, float]], Callable[[], None]]:
        def call() -> dict[int, float]:
            with pkl5_as_shipped(shipped and series == "plain"):
                result = mpi4py.bench.pingpong(comms[series], [*args, *options], verbose=False)
            return {nbytes: mean * 1e6 for nbytes, mean, _ in result}

        return call, lambda: None

    return Case("pingpong", kind, "us", prepare)


@contextlib.contextmanager
def pkl5_as_shipped(wanted: bool) -> Iterator[None]:
    """Give mpi4py.util.pkl5 mpi4py's own MPI module for the block, if ``wanted``."""
    routed = pkl5.MPI
    if wanted:
        pkl5.MPI = MPI
    try:
        yield
    finally:
        pkl5.MPI = routed


def demo_case(name: str, path: str, source: str, max_size: int | None) -> Case:
    # compiled once with the real path, so a traceback points into the cached demo
    codes = {"plain": compile(source, path, "exec"),
             "plugin": compile(one_line_change(source), path, "exec")}

    def prepare(series: str) -> tuple[Callable[[], dict[int, float]], Callable[[], None]]:
        stand_in = PluginStandIn() if series == "plugin" else None
        cleanup = stand_in.free if stand_in is not None else (lambda: None)
        return (lambda: run_demo(name, codes[series], stand_in, max_size)), cleanup

    return Case("demo", name, "MB/s" if name in BANDWIDTH_DEMOS else "us", prepare)


class Run:
    """Every series of every case, round after round. Both ranks keep the records (the
    values are rank 0's), so whichever rank must abort the job can report them first."""

    def __init__(self, ctl: MPI.Intracomm, args: argparse.Namespace, meta: dict[str, Any]) -> None:
        self.ctl = ctl
        self.args = args
        self.meta = meta
        self.cases: list[Case] = []
        self.records: list[Record] = []
        self.broken: dict[tuple[str, str], str] = {}  # (case, series) -> why it runs no more
        self.notes: list[str] = []
        self.current = "making the plugin's communicator"  # the series under way, for on_stuck

    def bounded(self, call: Callable[[], Any]) -> Outcome:
        return run_series(self.ctl, call, self.args.timeout, self.on_stuck)

    def run_one(self, case: Case, series: str, rnd: int, first: str) -> None:
        key = (case.name, series)
        record = Record(case.bench, case.name, series, rnd, first, "skipped")
        if key in self.broken:
            record.errors = [self.broken[key]]
        else:
            call, cleanup = case.prepare(series)
            self.current = f"round {rnd} {case.title} {series}"
            before = handoff_probe(self.ctl) if self.args.probe else math.nan
            started = time.monotonic()
            outcome = self.bounded(call)
            elapsed = time.monotonic() - started
            self.cleanup(cleanup, f"{case.title} {series}")
            record.usage, record.seconds, record.load = outcome.usage, elapsed, os.getloadavg()[0]
            if self.args.probe:
                record.probe = [before, handoff_probe(self.ctl)]
            if outcome.failed:
                record.status, record.errors = "failed", outcome.errors
                # a failed series may have left messages or requests on its communicator
                self.broken[key] = f"not run again after failing in round {rnd}"
            else:
                record.status, record.values = "ok", self.ctl.bcast(outcome.value, root=0)
            self.progress(f"round {rnd} {case.title} {series}: {record.status} ({elapsed:.1f} s)")
        self.records.append(record)
        if self.ctl.Get_rank() == 0:
            self.save()

    def cleanup(self, cleanup: Callable[[], None], what: str) -> None:
        try:
            cleanup()
        except Exception as exc:  # reported; the run goes on
            note = f"rank {self.ctl.Get_rank()}: {what}: freeing its wrapper raised {first_line(exc)}"
            print(f"external_clients: {note}", file=sys.stderr, flush=True)
            self.notes.append(note)

    def progress(self, text: str) -> None:
        if self.ctl.Get_rank() == 0:
            print(f"external_clients: {text}", file=sys.stderr, flush=True)

    def save(self) -> None:
        """Rewrite the JSON after every series, so that an aborted job leaves what it measured."""
        if self.args.json is not None:
            data = {"meta": self.meta, "notes": self.notes, "records": [asdict(r) for r in self.records]}
            Path(self.args.json).write_text(json.dumps(data, indent=1) + "\n")

    def print_report(self) -> None:
        args = self.args
        print(f"# external clients of cma.mpi: {args.rounds} rounds, {self.meta['date']}, "
              f"mpi4py {mpi4py.__version__}, {self.meta['machine']['mpi_library']}, "
              f"{self.meta['machine']['cpus_allowed']} CPUs")
        if args.arrays:
            print(f"# pingpong options: {args.pingpong_args} -m {args.min_size} -n {args.max_size}")
        if args.probe:
            print(f"# hand-off probe: time for one CPU to copy 1 MiB the other CPU just wrote / 1 MiB it "
                  f"wrote itself; ~1 quiet, > {QUIET_RATIO} a slow spell of the host (docs/guide.md)")
        print(f"# cpu: CPU time of the ranks / (min(ranks, CPUs) x wall time); < {BUSY_SHARE}: other "
              "work took CPUs from them (and the probe means nothing then)")
        print(report(self.cases, self.records, args.each_round))
        for note in self.notes:
            print(f"note: {note}")
        sys.stdout.flush()

    def on_stuck(self) -> None:
        self.notes.append(f"job aborted by rank {self.ctl.Get_rank()}: another rank was stuck in "
                          f"{self.current} (past --timeout, inside MPI's C code)")
        self.save()
        self.print_report()


# ---------------------------------------------------------------- tables


def stat(values: Sequence[float]) -> str:
    if not values:
        return "-"
    spread = f" [{format_number(min(values))}-{format_number(max(values))}]" \
        if len(values) > 1 else ""
    return format_number(statistics.median(values)) + spread


def bandwidth_ratio(metric: str, plain: float, plugin: float) -> float:
    return plain / plugin if metric == "us" else plugin / plain


def order_table(case: Case, records: Sequence[Record], first: str, each_round: bool) -> list[str]:
    """One case's table over the rounds in which ``first`` ran first."""
    mine = [r for r in records if r.case == case.name and r.first == first]
    ok = {s: {r.round: r.values for r in mine if r.series == s and r.status == "ok"} for s in SERIES}
    rounds = sorted({r.round for r in mine})
    paired = sorted(set(ok["plain"]) & set(ok["plugin"]))
    sizes = sorted({size for values in ok["plain"].values() for size in values}
                   | {size for values in ok["plugin"].values() for size in values})
    lines = [f"{first} first (rounds {', '.join(map(str, rounds)) or 'none'}):"]
    if not sizes:
        return [*lines, "  no series finished"]
    headers = ["size", f"plain {case.metric}", f"plugin {case.metric}", "plugin/plain bw"]
    if each_round:
        headers += [f"r{rnd} plain/plugin" for rnd in paired]
    rows = []
    for size in sizes:
        column = {s: [v[size] for v in ok[s].values() if size in v] for s in SERIES}
        pairs = [(ok["plain"][rnd].get(size), ok["plugin"][rnd].get(size)) for rnd in paired]
        ratios = [bandwidth_ratio(case.metric, a, b) for a, b in pairs if a and b]
        row = [format_size(size), stat(column["plain"]), stat(column["plugin"]), stat(ratios)]
        if each_round:
            row += [f"{format_number(a or float('nan'))}/{format_number(b or float('nan'))}"
                    for a, b in pairs]
        rows.append(row)
    return [*lines, *("  " + line for line in render_table(headers, rows).splitlines()),
            *usage_lines(mine), *round_lines(mine)]


def usage_lines(records: Sequence[Record]) -> list[str]:
    """Median page faults and context switches per series (the ranks summed)."""
    parts = []
    for series in SERIES:
        usage = [r.usage for r in records if r.series == series and r.status == "ok"]
        if usage:
            def median(key: str, usage: list[list[dict[str, float]]] = usage) -> float:
                return statistics.median(sum(rank[key] for rank in u) for u in usage)

            parts.append(f"{series} {median('minflt'):.0f} minor faults, {median('nvcsw'):.0f}"
                         f"/{median('nivcsw'):.0f} vol/invol switches")
    return ["  per series, the ranks summed: " + "; ".join(parts)] if parts else []


def cpu_share(record: Record) -> float:
    """CPU time of the ranks over the wall time of as many CPUs as they can use at once:
    ~1 while each spins on a CPU of its own, or while more ranks than CPUs share them all
    (MPICH and cma both spin while waiting); less when other work took CPUs from them."""
    used = sum(rank["utime"] + rank["stime"] for rank in record.usage)
    cpus = min(len(record.usage), len(os.sched_getaffinity(0)))
    return used / (cpus * record.seconds) if record.usage and record.seconds else math.nan


def round_lines(records: Sequence[Record]) -> list[str]:
    """Per round, what the machine was doing: our ranks' CPU share and the hand-off probes;
    a round that a slow spell or other work touched is marked."""
    lines = []
    for rnd in sorted({r.round for r in records if r.status == "ok"}):
        mine = [r for r in records if r.round == rnd and r.status == "ok"]
        parts = [f"{r.series} cpu {cpu_share(r):.2f}"
                 + (f" probe {r.probe[0]:.2f}/{r.probe[1]:.2f}" if r.probe else "") for r in mine]
        marks = [label for label, hit in (
            ("SLOW SPELL", any(p > QUIET_RATIO for r in mine for p in r.probe)),
            ("OTHER WORK", any(cpu_share(r) < BUSY_SHARE for r in mine))) if hit]
        lines.append(f"  r{rnd}: {', '.join(parts)}{'  ' + ' + '.join(marks) if marks else ''}")
    return lines


def failures(case: Case, records: Sequence[Record]) -> list[str]:
    lines = []
    for r in records:
        if r.case == case.name and r.status == "failed":
            who = "; ".join(f"rank {rank}: {e}" for rank, e in enumerate(r.errors) if e)
            lines.append(f"{r.series} FAILED in round {r.round} ({r.first} first): {who}")
    for series in SERIES:
        skipped = [r for r in records
                   if r.case == case.name and r.series == series and r.status == "skipped"]
        if skipped:
            rounds = ", ".join(str(r.round) for r in skipped)
            lines.append(f"{series} not run in round(s) {rounds}: {skipped[0].errors[0]}")
    return lines


def report(cases: Sequence[Case], records: Sequence[Record], each_round: bool) -> str:
    out = []
    for case in cases:
        what = ("mean time (one way; a collective's per call)" if case.metric == "us"
                else "bandwidth (MB/s = 1e6 B/s)")
        out += ["", f"== {case.title}: {what}; median [min-max] over rounds; "
                    "plugin/plain bw > 1: the plugin is faster"]
        for first in SERIES:
            out += order_table(case, records, first, each_round)
        out += failures(case, records)
    return "\n".join(out)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mpiexec -n N python bench/external_clients.py",
        description="mpi4py.bench pingpong and mpi4py's OSU demos, plain and with cma.mpi.Comm, "
                    "both orders in one job.")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds; even ones run plain first, odd ones the plugin (default 6)")
    parser.add_argument("--arrays", default=",".join(ARRAYS),
                        help="pingpong buffer kinds, comma-separated: numpy, none (default both)")
    parser.add_argument("--objects", default=",".join(OBJECTS),
                        help="pingpong's object modes over NumPy arrays, comma-separated: pickle (-p), "
                             "pkl5 (-o) (default both; '' for none)")
    parser.add_argument("--min-size", type=parse_size, default=1, help="pingpong (default 1)")
    parser.add_argument("--max-size", type=parse_size, default=64 << 20,
                        help="pingpong (default 64M)")
    parser.add_argument("--pingpong-args", default=PINGPONG_ARGS,
                        help=f"further options of mpi4py.bench pingpong (default: {PINGPONG_ARGS!r})")
    parser.add_argument("--no-pingpong", action="store_true")
    parser.add_argument("--demos", default=",".join(DEMOS),
                        help="demos of the mpi4py sdist, comma-separated (default the three "
                             f"point-to-point ones; also {', '.join(COLLECTIVE_DEMOS)})")
    parser.add_argument("--no-demos", action="store_true")
    parser.add_argument("--demo-max-size", type=parse_size, default=None,
                        help="the demos' own MAX_MSG_SIZE parameter (default theirs: 1 MiB for "
                             "the collectives, 4 MiB for the point-to-point ones)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a series may take before it is stopped as failed (default 120)")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="skip the hand-off probe before and after each series (~50 ms each)")
    parser.add_argument("--each-round", action="store_true",
                        help="add every round's plain/plugin values to the tables")
    parser.add_argument("--json", metavar="FILE", help="every record, rewritten after each series")
    args = parser.parse_args(argv)
    args.arrays = [] if args.no_pingpong else [a for a in args.arrays.split(",") if a]
    args.objects = [] if args.no_pingpong else [o for o in args.objects.split(",") if o]
    args.demos = [] if args.no_demos else [d for d in args.demos.split(",") if d]
    unknown = sorted(set(args.arrays) - set(ARRAYS)) + sorted(set(args.objects) - set(OBJECTS)) + \
        sorted(set(args.demos) - set(DEMOS) - set(COLLECTIVE_DEMOS))
    if unknown:
        parser.error(f"unknown array kind, object mode or demo: {', '.join(unknown)}")
    return args


def make_cases(run: Run) -> list[Case]:
    args, cases = run.args, []
    kinds = args.arrays + args.objects
    if kinds:
        # made once, before any series, so that every series of every round runs in a
        # process holding the same state; failing to make it is the plugin series' failure
        outcome = run.bounded(lambda: cma.mpi.Comm(MPI.COMM_WORLD))
        if outcome.failed:
            reason = "cma.mpi.Comm(MPI.COMM_WORLD) failed: " + next(e for e in outcome.errors if e)
            for kind in kinds:
                run.broken[(kind, "plugin")] = reason
        pingpong_args = [*shlex.split(args.pingpong_args), "-m", str(args.min_size), "-n", str(args.max_size)]
        comms = {"plain": MPI.COMM_WORLD, "plugin": outcome.value}
        cases += [pingpong_case(kind, comms, pingpong_args) for kind in kinds]
    if args.demos:
        sources, why_not = demo_sources(run.ctl, args.demos)
        if why_not:
            run.notes.append(f"demos not run: {why_not}")
        cases += [demo_case(name, *sources[name], args.demo_max_size)
                  for name in args.demos if name in sources]
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    collectives_only = not args.arrays and not args.objects and set(args.demos) <= set(COLLECTIVE_DEMOS)
    if world.Get_size() < 2 or (world.Get_size() > 2 and not collectives_only):
        if world.Get_rank() == 0:
            print("external_clients: run with exactly two ranks (mpiexec -n 2), or with 2 or more "
                  "for collective demos alone (--no-pingpong --demos osu_bcast,...)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGALRM, _on_alarm)
    ctl = world.Dup()  # agreement and barriers, apart from anything a series sends
    meta = {"args": vars(args), "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    run = Run(ctl, args, meta)
    run.cases = make_cases(run)
    for rnd in range(args.rounds):
        order = SERIES if rnd % 2 == 0 else SERIES[::-1]
        for case in run.cases:
            for series in order:
                run.run_one(case, series, rnd, order[0])
    if ctl.Get_rank() == 0:
        run.print_report()
    ctl.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

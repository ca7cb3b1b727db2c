"""mpi4py's own test suite, plain and with cma.mpi swapped in, per module and number of ranks.

Usage (the ranks run this Python, so its mpi4py must be built for the MPI of ``--mpiexec``)::

    python tests/mpi4py_suite/run_matrix.py [--np 1,2,3] [--modules test_p2p_buf ...]
        [--mpiexec PATH] [--json OUT] [--work-dir DIR] [--stall-timeout S] [--max-hangs N]

Under Open MPI, run it with the Python of the environment that has Open MPI's mpiexec and
an mpi4py for it; --oversubscribe --allow-run-as-root are added for it.

The tests come from the ``test/`` directory of the sdist of the installed mpi4py, which
``pip download`` fetches into ``$CMA_IPC_CACHE/mpi4py-<version>/`` (default
``$XDG_CACHE_HOME/cma-ipc``, else ``~/.cache/cma-ipc``) on first use; nothing of mpi4py
is kept in this repository. Each (module, N, mode) runs as ``mpiexec -n N python -m mpi4py
driver.py ...``: "plain" is mpi4py as installed, "plugin" the same tests after
``MPI.COMM_WORLD = cma.mpi.Comm(MPI.COMM_WORLD)`` (and COMM_SELF), see driver.py.

A job whose ranks log nothing new for ``--stall-timeout`` seconds is killed, mpiexec and
every rank, once each rank has written its stacks (driver.py's DUMP_SIGNAL). The test that
the earliest rank was in is recorded as ``hang`` (``crash`` if the job died in it instead),
with where each stuck rank waited, and the module runs again
without it and without the tests that already finished on every rank, until every test
has an outcome (or ``--max-hangs`` hangs). Tests listed in ``not_applicable.txt`` beside
this file (``test_id  reason`` a line) are reported apart and are not counted as the
plugin's failures.

The report gives, per module and N, the counts of each outcome plain and with the plugin,
and in "on cma" how many of the tests that have a ``self.COMM`` sent through cma (on a
cma.mpi.Comm with on-node peers: a one-rank wrapper, COMM_SELF's, sends through MPI);
then every test that passes plain but not with the plugin, with a one-line reason. Exit
status: 0 if there is no such test and every job ran its module, else 1. The ranks run
without the caller's CMA_MPI_* settings, as tests/test_mpi.py's do. ``--work-dir`` keeps
each job's files: ``<module>-n<N>-<mode>-<job>.json.<rank>`` (driver.py's log),
``.stacks.<rank>`` (faulthandler's), ``.log`` (mpiexec's output) and ``.exclude``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: mpijobs sits in tests/
    sys.path.insert(0, str(HERE.parent))
import mpijobs  # noqa: E402

from mpi4py_suite.driver import DUMP_SIGNAL  # noqa: E402

DRIVER = HERE / "driver.py"
NOT_APPLICABLE = HERE / "not_applicable.txt"
OPEN_MPI_ONLY = "[Open MPI] "
ENV_CACHE = "CMA_IPC_CACHE"  # also where bench/external_clients.py keeps the sdist
MODULES = ["test_p2p_buf", "test_p2p_obj", "test_p2p_buf_matched", "test_p2p_obj_matched", "test_request",
           "test_status", "test_msgspec", "test_msgzero", "test_util_pkl5"]
MODES = ("plain", "plugin")
OUTCOMES = ("passed", "failed", "error", "skipped", "hang", "crash")
# the outcome of a test over the ranks is the worst of the ranks' (driver.py's SEVERITY, then ours)
SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 3, "crash": 4, "hang": 5}
STALL_TIMEOUT = 30.0  # the slowest test of the default modules takes < 1 s plain, on 2 cores
JOB_TIMEOUT = 900.0  # a backstop: stalls end jobs well before
FETCH_TIMEOUT = 300  # pip builds the sdist's metadata too: ~10-15 s here
POLL = 0.2
DUMP_GRACE = 10.0  # seconds for the ranks of a stalled job to write their stacks
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*$", re.MULTILINE)
# faulthandler's output: each thread starts with "Thread 0x..."; the dump of a fatal error
# with this line (a stacks file holds the dump asked of a stalled rank, or that one)
FATAL_ERROR = "Fatal Python error"
THREAD_START = re.compile(r"^(Current thread|Thread) 0x", re.MULTILINE)
FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)


# ------------------------------------------------------------------ mpi4py's test/ directory


class FetchError(RuntimeError):
    """The sdist of mpi4py could not be downloaded or unpacked."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get(ENV_CACHE) or Path(base) / "cma-ipc")


def fetch_testdir(version: str) -> Path:
    """The ``test/`` directory of mpi4py's sdist ``version``, downloaded and unpacked once."""
    testdir = cache_root() / f"mpi4py-{version}" / "test"
    if not testdir.is_dir():
        unpack_tests(download_sdist(version, testdir.parent / "sdist"), version, testdir)
    return testdir


def download_sdist(version: str, dest: Path) -> Path:
    sdist = dest / f"mpi4py-{version}.tar.gz"
    if sdist.is_file():
        return sdist
    # (--no-binary mpi4py, not :all:, which makes pip build setuptools & co from source too
    # to read the sdist's metadata: > 300 s on a fresh machine, 12 s this way)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "mpi4py", "--quiet",
               f"mpi4py=={version}", "-d", str(dest)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=FETCH_TIMEOUT)
    except subprocess.CalledProcessError as exc:
        last = " | ".join(exc.stderr.strip().splitlines()[-3:])
        raise FetchError(f"{' '.join(command)} failed: {last}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"{' '.join(command)}: {exc}") from exc
    if not sdist.is_file():
        raise FetchError(f"pip downloaded no {sdist.name} into {dest}")
    return sdist


def unpack_tests(sdist: Path, version: str, testdir: Path) -> None:
    """Unpack the sdist's flat test/ into ``testdir``: into a fresh directory first, renamed
    when complete, so that a concurrent run sees all of it or nothing."""
    prefix = f"mpi4py-{version}/test/"
    partial = Path(tempfile.mkdtemp(prefix="test.partial-", dir=testdir.parent))
    try:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix(prefix)
                if member.isfile() and member.name.startswith(prefix) and "/" not in name:
                    content = tar.extractfile(member)
                    (partial / name).write_bytes(content.read() if content else b"")
        if not (partial / "mpiunittest.py").is_file():
            raise FetchError(f"{sdist} has no {prefix}mpiunittest.py")
        try:
            partial.rename(testdir)
        except OSError:
            if not testdir.is_dir():  # else another run unpacked it meanwhile
                raise
    except (OSError, tarfile.TarError) as exc:
        raise FetchError(f"cannot unpack {sdist}: {exc}") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def read_not_applicable(path: Path = NOT_APPLICABLE, open_mpi: bool = False) -> dict[str, str]:
    """{test id: why it cannot apply to the plugin}, from lines ``test_id  reason``; a
    line ``[Open MPI] test_id  reason`` applies under Open MPI only."""
    entries = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith(OPEN_MPI_ONLY):
            if not open_mpi:
                continue
            line = line[len(OPEN_MPI_ONLY):]
        fields = line.split(maxsplit=1)
        if len(fields) < 2:
            raise ValueError(f"{path}:{number}: expected 'test_id  reason', got {line!r}")
        entries[fields[0]] = fields[1].strip()
    return entries


# ------------------------------------------------------------------ one mpiexec job


@dataclass
class Config:
    mpiexec: str
    testdir: Path
    workdir: Path
    flags: list[str] = field(default_factory=list)
    stall_timeout: float = STALL_TIMEOUT
    job_timeout: float = JOB_TIMEOUT
    max_hangs: int | None = None  # per module and mode; then the rest of the module is not run
    env: dict[str, str] = field(default_factory=mpijobs.job_env)


@dataclass
class JobRecord:
    """One mpiexec job of a module: how it ended and which test it left unfinished."""

    end: str  # "exited", "stalled" (no rank logged anything for stall_timeout) or "timed out"
    returncode: int | None  # None when killed
    seconds: float
    excluded: int  # tests left out of it (already done, or hung in an earlier job)
    stuck: str | None = None


def progress(out: Path) -> int:
    """How much the ranks have logged: it grows with every test started or finished."""
    return sum(path.stat().st_size for path in out.parent.glob(f"{out.name}.*"))


def watch(proc: mpijobs.Job, out: Path, config: Config) -> str:
    begin = last_change = time.monotonic()
    last = progress(out)
    while proc.poll() is None:
        time.sleep(POLL)
        now, current = time.monotonic(), progress(out)
        if current != last:
            last, last_change = current, now
        elif now - last_change > config.stall_timeout:
            ask_for_stacks(proc, out)
            return "stalled"
        if now - begin > config.job_timeout:
            ask_for_stacks(proc, out)
            return "timed out"
    return "exited"


def ask_for_stacks(proc: mpijobs.Job, out: Path) -> None:
    """Have each rank of a job about to be killed write where it is (driver.py's stacks
    file), and wait until every rank that has not finished its tests has, for up to
    DUMP_GRACE seconds (one that has is in MPI's finalization, and writes nothing)."""
    waiting = {path: path.stat().st_size for path in out.parent.glob(f"{out.stem}.stacks.*")
               if not read_rank_log(out.with_name(f"{out.name}.{path.suffix[1:]}")).ended}
    mpijobs.signal_processes(proc, DUMP_SIGNAL, str(DRIVER))
    deadline = time.monotonic() + DUMP_GRACE
    while waiting and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(POLL)  # (also lets the last one finish writing)
        waiting = {path: size for path, size in waiting.items() if path.stat().st_size == size}


def run_job(command: list[str], out: Path, config: Config) -> tuple[str, int | None, float]:
    """(how it ended, exit code, seconds) of ``command``; its output goes to ``out``.log."""
    begin = time.monotonic()
    with out.with_suffix(".log").open("w") as output, mpijobs.segments_removed():
        proc = mpijobs.start(command, config.env, stdout=output)
        try:
            end = watch(proc, out, config)
        finally:
            mpijobs.kill(proc)  # a no-op for a job that exited, but for stragglers
    return end, proc.returncode if end == "exited" else None, time.monotonic() - begin


# ------------------------------------------------------------------ what the ranks logged


@dataclass
class RankLog:
    order: list[str] = field(default_factory=list)
    comms: dict[str, str] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # driver.py's result events
    begun: bool = False
    ended: bool = False

    def position(self, order: list[str]) -> int:
        """Index in the module's ``order`` of the first test this rank has no result for."""
        return next((i for i, test in enumerate(order) if test not in self.results), len(order))


def read_rank_log(path: Path) -> RankLog:
    log = RankLog()
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            break  # the last line, cut short by a kill
        if event["event"] == "begin":
            log.order, log.comms, log.begun = event["order"], event["comms"], True
        elif event["event"] == "result":
            log.results[event["test"]] = event
        elif event["event"] == "end":
            log.ended = True
    return log


@dataclass
class Outcome:
    outcome: str
    reason: str = ""
    traceback: list[str] = field(default_factory=list)
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> its outcome, where it has one
    seconds: float = 0.0
    comm: str | None = None  # the type of the test's self.COMM (driver.py), if it has one
    cma: bool = False  # whether that communicator sent through cma (driver.py's through_cma)


def combine(test: str, logs: list[RankLog]) -> Outcome:
    """The test's outcome over the ranks that have a result for it: the worst one's, with its reason."""
    results = {rank: log.results[test] for rank, log in enumerate(logs) if test in log.results}
    worst = max(results, key=lambda rank: SEVERITY[results[rank]["outcome"]])
    result = results[worst]
    reason = result["reason"]
    if len(logs) > 1 and result["outcome"] in ("failed", "error"):
        reason = f"rank {worst}: {reason}"
    return Outcome(result["outcome"], reason, result["traceback"],
                   {rank: r["outcome"] for rank, r in results.items()},
                   max(r["seconds"] for r in results.values()), result["comm"], result["cma"])


def frame_text(frame: re.Match[str]) -> str:
    path = Path(frame["path"])
    shown = path.relative_to(mpijobs.ROOT) if path.is_relative_to(mpijobs.ROOT) else path.name
    return f"{frame['func']} ({shown}:{frame['line']})"


def where(stacks: Path, testdir: Path) -> str:
    """Where the rank was at its last faulthandler dump (``stacks``, written by driver.py), as
    "[fatal error] at test line -> call the test made -> innermost call", of the thread
    that runs the test."""
    text = stacks.read_text(errors="replace") if stacks.exists() else ""
    dump = text[max(text.rfind(FATAL_ERROR), 0):]
    fatal = dump.splitlines()[0] if dump.startswith(FATAL_ERROR) else ""
    for thread in THREAD_START.split(dump):
        frames = list(FRAME.finditer(thread))  # innermost first
        index = next((i for i, frame in enumerate(frames) if is_test_file(frame["path"], testdir)), None)
        if index is not None:
            steps = [f"at {Path(frames[index]['path']).name}:{frames[index]['line']}"]
            if index > 0:
                steps.append(frame_text(frames[index - 1]))  # the call the test made
            if index > 1:
                steps.append(("... -> " if index > 2 else "") + frame_text(frames[0]))
            return " ".join(filter(None, [fatal, " -> ".join(steps)]))
    return fatal


def is_test_file(name: str, testdir: Path) -> bool:
    path = Path(name)
    return path.parent == testdir and path.name.startswith("test_")


def last_exception(log: Path) -> str:
    """The last line of a job's output that names an exception (from a rank's traceback)."""
    lines = [m.group(0).strip() for m in EXCEPTION_LINE.finditer(log.read_text(errors="replace"))]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------ a module, over as many jobs as it takes


@dataclass
class ModuleRun:
    module: str
    np: int
    mode: str
    tests: dict[str, Outcome] = field(default_factory=dict)
    jobs: list[JobRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what went wrong outside any test
    comms: dict[str, str] = field(default_factory=dict)  # driver.py's: what the classes talk on

    def counts(self) -> dict[str, int]:
        return {outcome: sum(t.outcome == outcome for t in self.tests.values()) for outcome in OUTCOMES}

    def seconds(self) -> float:
        return sum(job.seconds for job in self.jobs)

    def on_cma(self) -> str:
        """"k/n": of the n tests with a ``self.COMM``, k sent through cma ("-" if none has one).

        The others ran on a one-rank wrapper (which sends through MPI) or on a plain
        communicator: mpi4py's pkl5 tests, for one, make ``self.COMM = MPI.Intracomm(self.COMM)``
        on the wrapper's handle, which never reaches the plugin."""
        tests = [t for t in self.tests.values() if t.comm is not None]
        return f"{sum(t.cma for t in tests)}/{len(tests)}" if tests else "-"


def command(config: Config, module: str, n: int, mode: str, out: Path, exclude: Path) -> list[str]:
    return [config.mpiexec, *config.flags, "-n", str(n), sys.executable, "-m", "mpi4py", str(DRIVER),
            "--mode", mode, "--testdir", str(config.testdir), "--module", module, "--out", str(out),
            "--exclude-file", str(exclude)]


def describe(job: JobRecord, config: Config) -> str:
    if job.end == "stalled":
        return f"logged nothing for {config.stall_timeout:.0f} s (killed)"
    if job.end == "timed out":
        return f"ran past the job timeout of {config.job_timeout:.0f} s (killed)"
    return f"exited with code {job.returncode}"


def stacks_file(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.stacks.{rank}")  # driver.py's name for it


def stuck_outcome(test: str, stuck_ranks: list[int], logs: list[RankLog], job: JobRecord, config: Config,
                  out: Path) -> Outcome:
    """``test`` as the test the job hung (or died) in: "hang" or "crash" on the ranks that
    never finished it. The reason starts with what the other ranks reported for it, then
    says where the stuck ranks waited (or where the one that died was)."""
    kind = "crash" if job.end == "exited" else "hang"
    ranks = {rank: log.results[test]["outcome"] for rank, log in enumerate(logs) if test in log.results}
    ranks.update({rank: kind for rank in stuck_ranks})
    reported = [(rank, log.results[test]) for rank, log in enumerate(logs)
                if test in log.results and log.results[test]["outcome"] in ("failed", "error")]
    places = {rank: where(stacks_file(out, rank), config.testdir) for rank in range(len(logs))}
    if kind == "hang":
        cause = f"the job {describe(job, config)}"
        shown = [f"rank {rank} {places[rank] or 'never finished it'}" for rank in stuck_ranks]
    else:  # the rank that died left its fatal error's stacks
        cause = f"the job died ({describe(job, config)})"
        shown = [f"rank {rank} {place}" for rank, place in places.items() if place.startswith(FATAL_ERROR)]
        shown = shown or [last_exception(out.with_suffix(".log"))]
    reasons = [f"rank {rank}: {result['reason']}" for rank, result in reported]
    traceback = reported[0][1]["traceback"] if reported else []
    return Outcome(kind, "; ".join(filter(None, [*reasons, cause, *shown])), traceback, ranks)


def settle(run: ModuleRun, job: JobRecord, out: Path, config: Config) -> list[str]:
    """Record in ``run`` what the job's ranks logged into ``out``.<rank>; return the tests
    that got an outcome.

    A test has an outcome when every rank finished it. If some rank never reached the
    end of the module, the first test (in the module's order) that a rank left unfinished
    is the one the job hung or died in: it becomes ``job.stuck``, with outcome hang or
    crash; the tests after it are left without an outcome, to be run again.
    """
    logs = [read_rank_log(out.with_name(f"{out.name}.{rank}")) for rank in range(run.np)]
    begun = [log for log in logs if log.begun]
    if not begun:
        exception = last_exception(out.with_suffix(".log"))
        run.problems.append(f"the job {describe(job, config)} before any test started"
                            + (f": {exception}" if exception else ""))
        return []
    order, run.comms = begun[0].order, begun[0].comms
    finished = [test for test in order if all(test in log.results for log in logs)]
    outside = {test for log in logs for test in log.results if test not in order}  # setUpClass errors
    for test in [*finished, *sorted(outside)]:
        run.tests[test] = combine(test, logs)
    pending = {rank: log.position(order) for rank, log in enumerate(logs) if not log.ended}
    first = min(pending.values(), default=len(order))
    if first == len(order):
        if pending or job.end != "exited" or job.returncode:
            run.problems.append(f"every rank finished its tests, then the job {describe(job, config)}")
        return finished
    job.stuck = order[first]
    stuck_ranks = sorted(rank for rank, position in pending.items() if position == first)
    run.tests[job.stuck] = stuck_outcome(job.stuck, stuck_ranks, logs, job, config, out)
    return [*finished, job.stuck]


def check_plugin(run: ModuleRun) -> None:
    """A plugin run whose test classes do not talk on cma.mpi communicators tests nothing of ours."""
    if run.mode == "plugin":
        run.problems += [f"{name} is a {kind}, not a cma.mpi.Comm: the plugin is not in effect"
                         for name, kind in run.comms.items() if not kind.startswith("cma.mpi.")]


def run_module(module: str, n: int, mode: str, config: Config,
               say: Callable[[str], None] = lambda _: None, leave_out: Iterable[str] = ()) -> ModuleRun:
    """Every test of ``module`` on ``n`` ranks (but ``leave_out``'s), each job leaving out
    the tests already settled."""
    run = ModuleRun(module, n, mode)
    settled: list[str] = list(leave_out)
    while True:
        out = config.workdir / f"{module}-n{n}-{mode}-{len(run.jobs)}.json"
        exclude = out.with_suffix(".exclude")
        exclude.write_text("".join(f"{test}\n" for test in settled), encoding="utf-8")
        end, returncode, seconds = run_job(command(config, module, n, mode, out, exclude), out, config)
        job = JobRecord(end, returncode, seconds, len(settled))
        run.jobs.append(job)
        settled += settle(run, job, out, config)
        if job.stuck is None:
            break
        hangs = sum(j.end != "exited" for j in run.jobs)
        if hangs == config.max_hangs:
            run.problems.append(f"gave up after {hangs} hangs: the tests after {job.stuck} did not run")
            break
        say(f"  {module} -n {n} {mode}: {run.tests[job.stuck].outcome} in {job.stuck} "
            f"after {seconds:.0f} s; running the rest again")
    check_plugin(run)
    return run


# ------------------------------------------------------------------ the matrix and its report


@dataclass
class Difference:
    """A test that passes plain but not with the plugin."""

    module: str
    np: int
    test: str
    outcome: str  # with the plugin
    reason: str
    not_applicable: str = ""  # why it cannot apply, if not_applicable.txt lists it


@dataclass
class Matrix:
    mpiexec: str
    flags: list[str]
    mpi4py: str
    testdir: str
    runs: list[ModuleRun] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    def regressions(self) -> list[Difference]:
        return [d for d in self.differences if not d.not_applicable]

    def clean(self) -> bool:
        return not self.regressions() and not any(run.problems for run in self.runs)


def differences(plain: ModuleRun, plugin: ModuleRun, not_applicable: dict[str, str]) -> list[Difference]:
    """The tests that pass in ``plain`` and do not in ``plugin``."""
    missing = Outcome("not run", "; ".join(plugin.problems) or "no job of the plugin's reached it")
    found = []
    for test, result in plain.tests.items():
        other = plugin.tests.get(test, missing)
        if result.outcome == "passed" and other.outcome != "passed":
            found.append(Difference(plain.module, plain.np, test, other.outcome, other.reason,
                                    not_applicable.get(test, "")))
    return found


def run_matrix(modules: Iterable[str], nps: Iterable[int], config: Config, not_applicable: dict[str, str],
               version: str, say: Callable[[str], None] = lambda _: None) -> Matrix:
    matrix = Matrix(config.mpiexec, config.flags, version, str(config.testdir))
    for n in nps:
        for module in modules:
            plain, plugin = (run_module(module, n, mode, config, say) for mode in MODES)
            matrix.runs += [plain, plugin]
            matrix.differences += differences(plain, plugin, not_applicable)
            say(f"{module} -n {n}: " + "; ".join(
                f"{run.mode} {counts_text(run)} ({run.seconds():.1f} s)" for run in (plain, plugin)))
    return matrix


def counts_text(run: ModuleRun) -> str:
    return " ".join(f"{count} {outcome}" for outcome, count in run.counts().items() if count)


def one_line(text: str, width: int = 320) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def report(matrix: Matrix) -> str:
    launcher = " ".join([matrix.mpiexec, *matrix.flags])
    lines = [f"mpi4py {matrix.mpi4py}'s tests ({matrix.testdir}) under {launcher}", "",
             f"{'module':<22} {'np':>2} {'mode':<6} " + " ".join(f"{o:>7}" for o in OUTCOMES)
             + f" {'jobs':>4} {'seconds':>7} {'on cma':>7}"]
    for run in matrix.runs:
        lines.append(f"{run.module:<22} {run.np:>2} {run.mode:<6} "
                     + " ".join(f"{count:>7}" for count in run.counts().values())
                     + f" {len(run.jobs):>4} {run.seconds():>7.1f} {run.on_cma():>7}")
    regressions = matrix.regressions()
    lines += ["", f"Passes plain, not with the plugin: {len(regressions)} test(s)"]
    for key in dict.fromkeys((d.module, d.np) for d in regressions):
        group = [d for d in regressions if (d.module, d.np) == key]
        lines.append(f"{key[0]} -n {key[1]} ({len(group)}):")
        lines += [one_line(f"  {d.outcome:<7} {d.test}: {d.reason}") for d in group]
    listed = [d for d in matrix.differences if d.not_applicable]
    if listed:
        lines += ["", f"Listed as not applicable, not counted: {len(listed)}"]
        lines += [one_line(f"  {d.outcome:<7} -n {d.np} {d.test}: {d.not_applicable}") for d in listed]
    problems = [(run, problem) for run in matrix.runs for problem in run.problems]
    if problems:
        lines += ["", "Problems outside the tests:"]
        lines += [one_line(f"  {run.module} -n {run.np} {run.mode}: {problem}") for run, problem in problems]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", default="2", type=lambda s: [int(n) for n in s.split(",")],
                        help="numbers of ranks, comma-separated (default 2)")
    parser.add_argument("--modules", nargs="+", default=MODULES,
                        help="mpi4py test modules (default: %(default)s)")
    parser.add_argument("--mpiexec", default=mpijobs.find_mpiexec(),
                        help="the launcher (default: beside this Python, else on PATH: %(default)s); "
                             "the ranks run this Python, so its mpi4py must be built for that MPI")
    parser.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT,
                        help="seconds without progress of any rank before a job counts as hung (%(default)s)")
    parser.add_argument("--job-timeout", type=float, default=JOB_TIMEOUT,
                        help="backstop per job (%(default)s)")
    parser.add_argument("--max-hangs", type=int,
                        help="per module and mode, leave the rest of the module unrun after this many hangs "
                             "(default: run every test)")
    parser.add_argument("--not-applicable", type=Path, default=NOT_APPLICABLE, help="default: %(default)s")
    parser.add_argument("--json", type=Path, help="write everything (each test's outcome per rank...) here")
    parser.add_argument("--work-dir", type=Path,
                        help="keep the ranks' logs and mpiexec's output here (default: a temporary "
                             "directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mpiexec is None:
        sys.exit("no mpiexec found (pip install mpich, or pass --mpiexec)")
    import mpi4py  # only its version: MPI is initialized in the ranks, not here

    try:
        testdir = fetch_testdir(mpi4py.__version__)
    except FetchError as exc:
        sys.exit(f"cannot get mpi4py's tests: {exc}")
    with tempfile.TemporaryDirectory(prefix="mpi4py-suite-") as scratch:
        workdir = args.work_dir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        config = Config(args.mpiexec, testdir, workdir, mpijobs.launcher_flags(args.mpiexec),
                        args.stall_timeout, args.job_timeout, args.max_hangs)
        not_applicable = read_not_applicable(args.not_applicable, open_mpi=bool(config.flags))
        matrix = run_matrix(args.modules, args.np, config, not_applicable,
                            mpi4py.__version__, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(report(matrix))
    if args.json:
        args.json.write_text(json.dumps(asdict(matrix), indent=1) + "\n", encoding="utf-8")
    return 0 if matrix.clean() else 1


if __name__ == "__main__":
    sys.exit(main())

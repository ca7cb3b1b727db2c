"""One module of mpi4py's own test suite, on every rank of an mpiexec job, with or without cma.mpi.

Run by run_matrix.py as::

    mpiexec -n N python -m mpi4py driver.py --mode plain|plugin --testdir DIR \\
        --module test_p2p_buf --out result.json [--exclude-file IDS]

``DIR`` is the ``test/`` directory of mpi4py's sdist (its ``mpiunittest``, ``arrayimpl``...
are imported from there). In ``plugin`` mode ``MPI.COMM_WORLD`` and ``MPI.COMM_SELF`` are
replaced by ``cma.mpi.Comm`` wrappers before the test module is imported, so the classes
that take ``COMM = MPI.COMM_WORLD`` at definition time, and the ``MPI.COMM_WORLD.Dup()`` of
their ``setUp``, get the plugin; ``plain`` changes nothing.

Each rank appends JSON Lines to ``<out>.<rank>``, flushed line by line, so that what a rank
did is still there after its job hung and was killed:

- ``{"event": "begin", "rank", "size", "mode", "module", "order": [ids], "comms": {...}}``
  (``comms``: the type of ``MPI.COMM_WORLD``, ``MPI.COMM_SELF`` and of each test class's
  ``COMM`` as the module sees them);
- ``{"event": "start", "test": id}`` before a test runs;
- ``{"event": "result", "test": id, "outcome", "reason", "traceback", "seconds", "comm",
  "cma"}`` after it, ``outcome`` one of passed, failed, error, skipped (``reason``: the skip
  reason or the first line of the exception; ``comm``: the type of the test's ``self.COMM``
  after its ``setUp``, e.g. what ``MPI.COMM_WORLD.Dup()`` returned, if it has one; ``cma``:
  whether that communicator sent through cma, see through_cma). An error outside any test
  (``setUpClass``) is a result of its own, under unittest's id for it;
- ``{"event": "end"}`` once the module has run.

Each rank also writes ``<out without suffix>.stacks.<rank>``: faulthandler's Python stacks
of the rank when it gets ``DUMP_SIGNAL`` (run_matrix.py sends it to a job it found stalled,
so that a hang shows where each rank waited) and when the process dies of a fatal signal.
Not on a timer: faulthandler's timer dumps from a watchdog thread that reads the main
thread's frames while that thread runs, and at 8 ranks that crashed ranks of slow tests
(docs/figures/many-ranks-2026-12-04.txt, section 5).

The tests are loaded as mpi4py's test/main.py loads them (unittest's loader over the module,
an fnmatch pattern on ``module.Class.method`` to exclude a test, no CuPy or Numba arrays),
and run by unittest's suite with a result class of ours instead of a text runner.
"""

from __future__ import annotations

import argparse
import faulthandler
import fnmatch
import importlib
import json
import signal
import sys
import time
import unittest
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

# a test's outcome is the worst of its parts' (subtests, setUp, tearDown)
SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
DUMP_SIGNAL = signal.SIGUSR1  # run_matrix.py's request for the stacks of a stalled rank
TRACEBACK_LINES = 20

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--mode", choices=["plain", "plugin"], required=True)
    parser.add_argument("--testdir", type=Path, required=True, help="the test/ directory of mpi4py's sdist")
    parser.add_argument("--module", required=True, help="a test module of it, e.g. test_p2p_buf")
    parser.add_argument("--out", type=Path, required=True, help="each rank writes OUT.<rank>")
    parser.add_argument("--exclude-file", type=Path,
                        help="test ids (module.Class.method) or fnmatch patterns not to run, one a line")
    return parser.parse_args(argv)


class Log:
    """A rank's JSON Lines file: one line per event, flushed at once so a killed job leaves it."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("w", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self._file.flush()


def first_line(exc: BaseException) -> str:
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def write_stacks_to(path: Path) -> None:
    """faulthandler's stacks of this rank into ``path`` (faulthandler keeps the file open):
    on a fatal signal, and on DUMP_SIGNAL. The kernel hands a signal sent to the process to
    its main thread unless that thread blocks it, so the dump is made by the thread it
    interrupts instead of being read by another thread while the main thread runs."""
    file = path.open("w", encoding="utf-8")
    faulthandler.enable(file, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file, all_threads=True)


class Recorder(unittest.TestResult):
    """Logs each test's start, then its outcome with the reason of its worst part."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self._log = log
        self._current: dict[str, Any] | None = None  # None between tests
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._current = {"outcome": "passed", "reason": "", "traceback": []}
        self._started = time.monotonic()
        self._log.write("start", test=test.id())

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        seconds = round(time.monotonic() - self._started, 3)
        comm = getattr(test, "COMM", None)  # not ``comm and ...``: MPI.COMM_NULL is false
        self._log.write("result", test=test.id(), seconds=seconds, **(self._current or {}),
                        comm=None if comm is None else type_name(comm), cma=through_cma(test))
        self._current = None

    def addError(self, test: unittest.TestCase, err: ExcInfo) -> None:  # type: ignore[override]
        super().addError(test, err)
        self._exception(test, "error", err)

    def addFailure(self, test: unittest.TestCase, err: ExcInfo) -> None:  # type: ignore[override]
        super().addFailure(test, err)
        self._exception(test, "failed", err)

    def addSubTest(self, test: unittest.TestCase, subtest: unittest.TestCase,
                   err: ExcInfo | None) -> None:  # type: ignore[override]
        super().addSubTest(test, subtest, err)
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._exception(test, "failed" if failed else "error", err)

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._note(test, "skipped", reason, [])

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._note(test, "failed", "unexpected success of a test marked expectedFailure", [])

    def _exception(self, test: unittest.TestCase, outcome: str, err: ExcInfo) -> None:
        # unittest's own formatting (as its text runner's): it leaves out unittest's frames
        lines = self._exc_info_to_string(err, test).splitlines()  # type: ignore[attr-defined]
        self._note(test, outcome, first_line(err[1]), lines[:TRACEBACK_LINES])

    def _note(self, test: unittest.TestCase, outcome: str, reason: str, traceback: list[str]) -> None:
        part = {"outcome": outcome, "reason": reason, "traceback": traceback}
        if self._current is None:  # setUpClass or setUpModule failed: no test is running
            self._log.write("result", test=test.id(), seconds=0.0, **part)
        elif SEVERITY[outcome] > SEVERITY[self._current["outcome"]]:
            self._current = part


class ExcludingLoader(unittest.TestLoader):
    """unittest's loader, leaving out the tests whose ``module.Class.method`` matches a pattern."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self._patterns = patterns

    def getTestCaseNames(self, testCaseClass: type[unittest.TestCase]) -> list[str]:
        prefix = f"{testCaseClass.__module__}.{testCaseClass.__qualname__}."
        return [name for name in super().getTestCaseNames(testCaseClass)
                if not any(fnmatch.fnmatchcase(prefix + name, p) for p in self._patterns)]


def read_patterns(path: Path | None) -> list[str]:
    if path is None:
        return []
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def install_plugin() -> None:
    """The one change under test: mpi4py's predefined communicators become cma.mpi wrappers."""
    from mpi4py import MPI

    import cma.mpi

    # mpi4py's stubs call these Final, but the module's attributes can be assigned
    MPI.COMM_WORLD = cma.mpi.Comm(MPI.COMM_WORLD)  # type: ignore[misc]  # collective
    MPI.COMM_SELF = cma.mpi.Comm(MPI.COMM_SELF)  # type: ignore[misc]


def flatten(suite: unittest.TestSuite) -> Iterator[unittest.TestCase]:
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from flatten(item)
        else:
            yield item


def type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def through_cma(test: unittest.TestCase) -> bool:
    """Whether the test's ``self.COMM`` sent through cma: a cma.mpi.Comm with a cma world,
    i.e. with peers on this node (a one-rank wrapper, COMM_SELF, or COMM_WORLD under
    ``-n 1``, sends everything through MPI), or a pkl5 communicator made over one.
    Asked of the class's COMM, of which setUp's ``Dup()`` or ``pkl5.Intracomm(...)`` is a
    copy (a Dup itself has been freed by tearDown)."""
    comm = getattr(test, "COMM", None)
    if type_name(comm).startswith("mpi4py.util.pkl5."):
        pkl5 = sys.modules.get("cma.mpi.pkl5")  # (not imported in plain mode)
        comm = None if pkl5 is None else pkl5.routed_to(comm)
        if comm is None:
            return False
        return getattr(comm, "cma", None) is not None
    on_plugin = type_name(comm).startswith("cma.mpi.")
    return on_plugin and getattr(getattr(type(test), "COMM", None), "cma", None) is not None


def comms_seen(tests: list[unittest.TestCase]) -> dict[str, str]:
    """What the module's classes will communicate on, to confirm the plugin is in effect."""
    from mpi4py import MPI

    seen = {"MPI.COMM_WORLD": type_name(MPI.COMM_WORLD), "MPI.COMM_SELF": type_name(MPI.COMM_SELF)}
    for test in tests:
        comm = getattr(type(test), "COMM", None)  # the classes of a p2p module; None elsewhere
        if comm is not None:
            seen[f"{type(test).__qualname__}.COMM"] = type_name(comm)
    return seen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.dont_write_bytecode = True  # leave the unpacked sdist as it was
    sys.path.insert(0, str(args.testdir.resolve()))
    # as mpi4py's runner does by default: no GPU array backends even where installed
    sys.modules["cupy"] = None  # type: ignore[assignment]
    sys.modules["numba"] = None  # type: ignore[assignment]
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    write_stacks_to(args.out.with_name(f"{args.out.stem}.stacks.{rank}"))
    if args.mode == "plugin":
        install_plugin()  # collective: a stall in it has stacks too
    world = MPI.COMM_WORLD
    log = Log(args.out.with_name(f"{args.out.name}.{rank}"))
    module = importlib.import_module(args.module)
    suite = ExcludingLoader(read_patterns(args.exclude_file)).loadTestsFromModule(module)
    tests = list(flatten(suite))
    log.write("begin", rank=rank, size=world.Get_size(), mode=args.mode, module=args.module,
              order=[t.id() for t in tests], comms=comms_seen(tests))
    suite.run(Recorder(log))
    log.write("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""mpi4py's own test suite, with cma.mpi swapped in: what passes plain must pass with the plugin.

For each module of mpi4py_suite/run_matrix.py's MODULES (point-to-point, requests,
statuses, message specs, pkl5), the tests of the installed mpi4py's sdist run under
``mpiexec -n 2``, once plain and once with ``MPI.COMM_WORLD`` and ``MPI.COMM_SELF`` replaced
by ``cma.mpi.Comm`` wrappers (mpi4py_suite/driver.py); hung tests are recorded and the rest
of the module run again (run_matrix.run_module). A module's test fails listing each test
that passes plain but not with the plugin, except those of mpi4py_suite/not_applicable.txt.

It skips, with a warning in pytest's summary that says why, only when mpi4py or mpiexec is
missing or the sdist cannot be downloaded, and fails then under CI. ``-m "not mpi4py_suite"`` leaves it out.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import NoReturn

import pytest
from mpi4py_suite import run_matrix
from mpijobs import find_mpiexec, job_env, launcher_flags

NP = 2
# A job with no progress for this long counts as hung: the slowest of these tests takes
# < 1 s plain on 2 cores, and every hang costs this much time; after MAX_HANGS hangs the
# rest of the module is not run (and fails the test), which bounds the time a badly broken
# plugin takes in CI to about MAX_HANGS * STALL_TIMEOUT per module.
STALL_TIMEOUT = 15.0
MAX_HANGS = 4
MODULE_TIMEOUT = 600  # the backstop

pytestmark = [pytest.mark.mpi4py_suite, pytest.mark.timeout(MODULE_TIMEOUT)]


def skip_loudly(why: str) -> NoReturn:
    """Skip, and say so in the warnings summary, which pytest prints by default; fail
    under CI (CI=true), which installs mpi4py and MPICH and reaches PyPI: a skip there
    hid for a whole session that the sdist's download timed out on a fresh machine."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"mpi4py's own test suite cannot run in CI: {why}", pytrace=False)
    warnings.warn(f"mpi4py's own test suite NOT run: {why}", stacklevel=2)
    pytest.skip(why, allow_module_level=True)


try:
    import mpi4py
except ImportError:
    skip_loudly("mpi4py is not installed (pip install 'cma-ipc[mpi]')")
_mpiexec = find_mpiexec()
if _mpiexec is None:
    skip_loudly("no mpiexec found (pip install mpich)")
MPIEXEC: str = _mpiexec


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> run_matrix.Config:
    try:
        testdir = run_matrix.fetch_testdir(mpi4py.__version__)
    except run_matrix.FetchError as exc:
        skip_loudly(f"cannot get the sdist of mpi4py {mpi4py.__version__}: {exc}")
    return run_matrix.Config(MPIEXEC, testdir, tmp_path_factory.mktemp("mpi4py-suite"),
                             launcher_flags(MPIEXEC), stall_timeout=STALL_TIMEOUT, max_hangs=MAX_HANGS,
                             env=job_env())


@pytest.fixture(scope="module")
def not_applicable() -> dict[str, str]:
    return run_matrix.read_not_applicable(open_mpi=bool(launcher_flags(MPIEXEC)))


# Every module with every collective through cma (CMA_MPI_COLLECTIVES=cma: mpi4py's
# specs are the test of cma's); test_msgspec and mpi4py's collective tests also as users
# run them (auto: each collective through cma or MPI by cma.mpi.routing, which every rank
# must choose alike, whatever spec form each passes); the collective tests through cma
# too (at 2 ranks: 1.6 s, 0.6 s and 1.4 s in auto against 0.8, 0.2 and 0.8 plain).
COLLECTIVE_MODULES = ["test_cco_buf", "test_cco_obj", "test_cco_vec"]


@pytest.mark.parametrize(("module", "collectives"),
                         [(module, "cma") for module in run_matrix.MODULES + COLLECTIVE_MODULES]
                         + [(module, "auto") for module in ["test_msgspec", *COLLECTIVE_MODULES]])
def test_plugin_passes_what_plain_passes(module: str, collectives: str, config: run_matrix.Config,
                                         not_applicable: dict[str, str]) -> None:
    # (the tests that cannot apply wait for ever with the plugin: run_matrix.py's full
    # matrix shows that; here they would cost STALL_TIMEOUT each)
    config = dataclasses.replace(config, env={**config.env, "CMA_MPI_COLLECTIVES": collectives})
    plain = run_matrix.run_module(module, NP, "plain", config)
    plugin = run_matrix.run_module(module, NP, "plugin", config, leave_out=not_applicable)
    failing = [d for d in run_matrix.differences(plain, plugin, not_applicable) if not d.not_applicable]
    problems = [f"{run.mode}: {problem}" for run in (plain, plugin) for problem in run.problems]
    summary = "; ".join(f"{run.mode} {run_matrix.counts_text(run)}" for run in (plain, plugin))
    assert plain.counts()["passed"], f"no test of {module} passed even plain ({summary}): {problems}"
    if failing or problems:
        headline = (f"{module} -n {NP} ({summary}): {len(failing)} test(s) pass plain, not with cma.mpi "
                    f"(the jobs' files: {config.workdir})")
        lines = [f"  {d.outcome} {d.test}: {d.reason}" for d in failing]
        pytest.fail("\n".join([headline, *lines, *problems]), pytrace=False)


# The runner itself, on modules of its own (no sdist needed). The stall timeout exceeds
# SLOW_TEST by 2.5 s, which a slow test needs to stay clear of a stall even on a loaded machine.
SLOW_TEST = 3.5
RUNNER_STALL_TIMEOUT = 6.0
RUNNER_MODULES = {
    "test_stall": f"""
import time
import unittest

from mpi4py import MPI


class TestStall(unittest.TestCase):
    def test_a_slow_one(self):
        time.sleep({SLOW_TEST})

    def test_b_waits_for_ever(self):
        if MPI.COMM_WORLD.Get_rank() == 1:
            MPI.COMM_WORLD.recv(source=0, tag=77)  # rank 0 sends nothing
""",
    "test_crash": """
import ctypes
import unittest

from mpi4py import MPI


class TestCrash(unittest.TestCase):
    def test_dies(self):
        if MPI.COMM_WORLD.Get_rank() == 1:
            ctypes.string_at(0)
        MPI.COMM_WORLD.barrier()
""",
}


@pytest.fixture
def runner_config(tmp_path: pytest.TempPathFactory) -> run_matrix.Config:
    testdir = tmp_path / "test"
    testdir.mkdir()
    for name, text in RUNNER_MODULES.items():
        (testdir / f"{name}.py").write_text(text, encoding="utf-8")
    return run_matrix.Config(MPIEXEC, testdir, tmp_path, launcher_flags(MPIEXEC),
                             stall_timeout=RUNNER_STALL_TIMEOUT, max_hangs=1, env=job_env())


def line_of(text: str, code: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if code in line)


def test_a_stalled_job_reports_where_each_rank_waited_and_only_then(runner_config: run_matrix.Config) -> None:
    """The ranks write their stacks when the runner finds the job stalled, not while a test
    is merely slow: a dump on a timer read the main thread's frames from faulthandler's
    watchdog thread while that thread ran, and crashed ranks at 8 ranks
    (docs/figures/many-ranks-2026-12-04.txt, section 5)."""
    run = run_matrix.run_module("test_stall", NP, "plain", runner_config)
    assert run.tests["test_stall.TestStall.test_a_slow_one"].outcome == "passed"
    stuck = run.tests["test_stall.TestStall.test_b_waits_for_ever"]
    recv_line = line_of(RUNNER_MODULES["test_stall"], "COMM_WORLD.recv")
    assert stuck.outcome == "hang", stuck
    assert re.search(rf"rank 1 at test_stall.py:{recv_line}\b", stuck.reason), stuck.reason
    for stacks in runner_config.workdir.glob("test_stall-*.stacks.*"):
        assert "test_a_slow_one" not in stacks.read_text(), f"{stacks.name} has stacks of the slow test"


def test_a_rank_that_dies_is_reported_with_its_fatal_error(runner_config: run_matrix.Config) -> None:
    run = run_matrix.run_module("test_crash", NP, "plain", runner_config)
    died = run.tests["test_crash.TestCrash.test_dies"]
    line = line_of(RUNNER_MODULES["test_crash"], "string_at")
    assert died.outcome == "crash", died
    fatal = f"rank 1 Fatal Python error: Segmentation fault at test_crash.py:{line}"
    assert fatal in died.reason, died.reason

"""mpiexec jobs for the tests: finding mpiexec, starting a job whose processes can all be
found again, ending every one of them, and removing the shared-memory files MPI leaves
behind.

Used by test_mpi.py and by mpi4py_suite/ (mpi4py's own test suite with cma.mpi).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
# shared-memory files of MPICH and of Open MPI's btl/sm, which killed jobs leave in /dev/shm
SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.")
KILL_GRACE = 5.0  # seconds for SIGKILLed processes to disappear, and for ranks to unmap
TAG_VARIABLE = "MPIJOBS_TAG"  # in the environment of every process of a job: see Job


def find_mpiexec() -> str | None:
    beside_python = Path(sys.executable).parent / "mpiexec"  # the mpich wheel puts it there
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


def launcher_flags(mpiexec: str) -> list[str]:
    """Open MPI needs these for more ranks than cores and for root; MPICH needs nothing."""
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout:
        return ["--oversubscribe", "--allow-run-as-root"]
    return []


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without the CMA_MPI_* settings (pretend nodes, disabling), with this
    checkout first on PYTHONPATH, and ``extra`` on top."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CMA_MPI_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    environ.update(extra or {})
    return environ


class Job(subprocess.Popen[str]):
    """An mpiexec job: a Popen whose processes (mpiexec, its daemons, every rank) carry
    ``TAG_VARIABLE=tag`` in their environment, so that kill() finds them all. Hydra's
    proxy and ranks each start a session of their own, and outlive a killed mpiexec by
    a moment (the proxy kills them when it loses mpiexec), so neither a process group
    nor a session holds the whole job."""

    tag: str


def start(command: list[str], env: Mapping[str, str], stdout: int | IO[str]) -> Job:
    """``command`` (an mpiexec), stderr merged into ``stdout``, in a session of its own: its
    process group is mpiexec's (and whatever of the job does not leave it), for kill()."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    job = Job(command, env={**env, TAG_VARIABLE: tag}, stdout=stdout, stderr=subprocess.STDOUT, text=True,
              start_new_session=True)
    job.tag = tag
    return job


def _tagged(tag: str) -> list[int]:
    """The live processes whose environment carries ``tag`` (a zombie's reads as empty)."""
    needle = f"\0{TAG_VARIABLE}={tag}\0".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in b"\0" + environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue  # the process exited meanwhile, or is not ours to read
    return found


def signal_processes(job: Job, signum: int, marker: str) -> None:
    """Send ``signum`` to the processes of ``job`` whose command line holds ``marker`` (its
    ranks, say, not mpiexec or its daemons)."""
    for pid in _tagged(job.tag):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signum)
        except OSError:
            continue  # it exited meanwhile


def kill(job: Job) -> None:
    """End every process of ``job`` that is still running, mpiexec first; raise if one
    survives SIGKILL for KILL_GRACE seconds."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + KILL_GRACE
    while members := _tagged(job.tag):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {members} of the job {job.args!r} survive SIGKILL")
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended meanwhile
        time.sleep(0.05)


def _mapped_segments() -> set[str]:
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split("/dev/shm/")[1].split()[0]
                          for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue  # the process exited meanwhile
    return mapped


def _remove_orphan_segments(names: set[str]) -> None:
    """Unlink the MPI shared-memory files that a job left and nobody maps any more.

    Ranks may still be exiting when mpiexec returns, so a segment still mapped gets a
    few seconds to be released before it is left alone.
    """
    deadline = time.monotonic() + KILL_GRACE
    while names:
        for name in names - _mapped_segments():
            (SHM / name).unlink(missing_ok=True)
        names = {name for name in names if (SHM / name).exists()}
        if not names or time.monotonic() > deadline:
            return
        time.sleep(0.1)


@contextmanager
def segments_removed() -> Iterator[None]:
    """Remove the MPI segments that appear during the block and no process maps at its end.

    A job that did not end cleanly (aborted, killed) leaves them in /dev/shm, and so, in
    runs on this machine, did some MPICH jobs that exited 0. Segments of other jobs running
    meanwhile are still mapped by their ranks, and are left alone.
    """
    before = set(os.listdir(SHM))
    try:
        yield
    finally:
        _remove_orphan_segments({name for name in set(os.listdir(SHM)) - before
                                 if name.startswith(SEGMENT_PREFIXES)})

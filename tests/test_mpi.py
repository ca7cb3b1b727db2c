"""cma.mpi under a real mpiexec: each test runs a program of tests/mpi_programs.

The programs are written as mpi4py programs and check themselves (assert); each rank
prints "OK <rank> [<mode>]" at the end. They run under ``python -m mpi4py`` so that an
uncaught exception in one rank aborts the whole job instead of leaving it hanging.
Pretend nodes (CMA_MPI_NODES, CMA_MPI_RANKS_PER_NODE) give one machine on-node and
off-node peers at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mpijobs import find_mpiexec, job_env, kill, launcher_flags, segments_removed, start

pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'cma-ipc[mpi]')")

_mpiexec = find_mpiexec()
if _mpiexec is None:
    pytest.skip("no mpiexec found (pip install mpich)", allow_module_level=True)
MPIEXEC: str = _mpiexec

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "mpi_programs"
RUN_TIMEOUT = 120  # the backstop; a healthy run takes a few seconds
MODES = "cma|mixed|mpi-only|disabled"

pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 30)

FLAGS = launcher_flags(MPIEXEC)
IS_HYDRA = not FLAGS


def mpirun(n: int, program: str, *args: str, env: dict[str, str] | None = None,
           flags: tuple[str, ...] = ()) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, seconds) of ``mpiexec -n N python -m mpi4py program``.

    The job runs without the caller's CMA_MPI_* settings (``env`` adds its own); the MPI
    segments it leaves in /dev/shm are removed (mpijobs.segments_removed).
    """
    command = [MPIEXEC, *FLAGS, *flags, "-n", str(n), sys.executable, "-m", "mpi4py",
               str(PROGRAMS / program), *args]
    begin = time.monotonic()
    with segments_removed():
        proc = start(command, job_env(env), stdout=subprocess.PIPE)
        try:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            kill(proc)  # mpiexec and every rank it started
            out, _ = proc.communicate()
            pytest.fail(f"mpiexec -n {n} {program} {' '.join(args)} hung:\n{out}")
        finally:
            kill(proc)
    return proc.returncode, out, time.monotonic() - begin


def modes(out: str) -> dict[int, str]:
    return {int(r): m for r, m in re.findall(rf"OK (\d+) ({MODES})", out)}


def expect_ok(n: int, program: str, *args: str, env: dict[str, str] | None = None
              ) -> dict[int, str]:
    code, out, _ = mpirun(n, program, *args, env=env)
    assert code == 0, out
    found = modes(out) if program == "p2p.py" else {
        int(r): "" for r in re.findall(r"OK (\d+)", out)}
    assert sorted(found) == list(range(n)), out
    return found


@pytest.mark.parametrize("n", [2, 3, 4])
def test_one_node(n: int) -> None:
    assert set(expect_ok(n, "p2p.py").values()) == {"cma"}


@pytest.mark.parametrize("transport", ["shm", "vmfd"])
def test_one_node_transport(transport: str) -> None:
    assert set(expect_ok(3, "p2p.py", transport).values()) == {"cma"}


def test_one_node_through_the_wrapper() -> None:
    """Nothing handed out (a subclass overrides Send, Recv, Isend, Irecv; or Open MPI)."""
    assert set(expect_ok(3, "p2p.py", "auto", "subclass").values()) == {"cma"}


def test_disabled() -> None:
    found = expect_ok(3, "p2p.py", env={"CMA_MPI_DISABLE": "1"})
    assert set(found.values()) == {"disabled"}


@pytest.mark.parametrize(("env", "n", "expected"), [
    ({"CMA_MPI_RANKS_PER_NODE": "1"}, 2, ["mpi-only"] * 2),
    ({"CMA_MPI_RANKS_PER_NODE": "2"}, 3, ["mixed", "mixed", "mpi-only"]),
    ({"CMA_MPI_NODES": "0,1,1,0"}, 4, ["mixed"] * 4),
    ({"CMA_MPI_NODES": "0,1,2,1"}, 4, ["mpi-only", "mixed", "mpi-only", "mixed"]),
])
def test_pretend_nodes(env: dict[str, str], n: int, expected: list[str]) -> None:
    found = expect_ok(n, "p2p.py", env=env)
    assert [found[r] for r in range(n)] == expected


@pytest.mark.parametrize("nodes", ["0,0,1,1", "0,1,1,0"])
@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_mixed_traffic(nodes: str, transport: str) -> None:
    expect_ok(4, "mixed.py", transport, env={"CMA_MPI_NODES": nodes})


@pytest.mark.parametrize("env", [{}, {"CMA_MPI_NODES": "0,0,1,1"}], ids=["one-node", "mixed"])
@pytest.mark.parametrize("cleanup", [True, False], ids=["mpiexec-cleans-up", "no-cleanup"])
@pytest.mark.parametrize("wait", ["Recv", "Irecv", "Waitall"])
def test_rank_dies(env: dict[str, str], cleanup: bool, wait: str) -> None:
    """Rank 1 exits while rank 0 waits in Recv (an Irecv's Wait, MPI's Waitall) from it:
    the job fails, well before the backstop.

    Without mpiexec's clean-up only cma.mpi can notice; rank 0 must raise PeerGoneError
    naming the rank and its pid, as cma.Comm's does (a mixed rank's named no pid; MPI's
    Waitall showed only "Other MPI error").
    """
    if not cleanup and not IS_HYDRA:
        pytest.skip("-disable-auto-cleanup is an option of MPICH's hydra")
    flags = () if cleanup else ("-disable-auto-cleanup",)
    code, out, seconds = mpirun(4, "dies.py", wait, env=env, flags=flags)
    assert code != 0, out
    assert seconds < RUN_TIMEOUT / 2, out
    if not cleanup:
        error = "PeerGone" if wait == "Waitall" else "PeerGoneError"
        assert re.search(rf"{error}: rank 1 \(pid \d+\) exited before completing", out), out


def test_a_rank_that_cannot_take_the_world_fails_every_rank_at_once() -> None:
    """Every rank raises CmaError naming rank 1, which could not take the node's world
    (no_world.py). The others used to connect and wait for it until CMA_CONNECT_TIMEOUT,
    set here beyond the backstop."""
    expect_ok(3, "no_world.py", env={"CMA_CONNECT_TIMEOUT": str(RUN_TIMEOUT * 3)})


@pytest.mark.parametrize(("n", "env", "mode"), [
    (1, {}, "one rank"), (2, {}, "one node"), (3, {}, "one node"),
    (3, {"CMA_MPI_NODES": "0,0,1"}, "mixed"), (4, {"CMA_MPI_NODES": "0,1,1,0"}, "mixed"),
    (2, {"CMA_MPI_DISABLE": "1"}, "disabled"),
])
def test_mpi4py_habits(n: int, env: dict[str, str], mode: str) -> None:
    """Zero-length and None messages, MPI.Request's class methods on the plugin's requests,
    cancelled receives, DLPack-only buffers, one-rank communicators (clients.py)."""
    expect_ok(n, "clients.py", env=env)


@pytest.mark.parametrize(("n", "env"), [(2, {}), (4, {}), (3, {"CMA_MPI_DISABLE": "1"})])
def test_library_code(n: int, env: dict[str, str]) -> None:
    """A task farm, a halo exchange and a wildcard fan-in written against MPI.Comm,
    handed the plugin (library.py)."""
    expect_ok(n, "library.py", env=env)


@pytest.mark.parametrize(("n", "env"), [
    (1, {}), (2, {}), (3, {}), (3, {"CMA_MPI_NODES": "0,0,1"}), (4, {"CMA_MPI_NODES": "0,1,1,0"}),
    (2, {"CMA_MPI_DISABLE": "1"}),
])
def test_pkl5_over_the_plugin(n: int, env: dict[str, str]) -> None:
    """mpi4py.util.pkl5 over the wrapper: every call, its arrays through cma (pickled.py;
    pkl5's bcast sends its pickle with Bcast, which cma runs at every size here)."""
    expect_ok(n, "pickled.py", env={"CMA_MPI_COLLECTIVES": "cma", **env})


@pytest.mark.parametrize(("n", "env", "transport"), [
    (1, {}, "auto"), (2, {}, "cma"), (2, {}, "shm"), (2, {}, "vmfd"), (3, {}, "auto"),
    (3, {"CMA_MPI_NODES": "0,0,1"}, "auto"), (2, {"CMA_MPI_DISABLE": "1"}, "auto"),
])
def test_datatypes_with_gaps(n: int, env: dict[str, str], transport: str) -> None:
    """Vector, indexed, struct, subarray, resized and pair types, eager and rendezvous,
    through every call form, delivered as MPI delivers them (datatypes.py)."""
    expect_ok(n, "datatypes.py", transport, env=env)


def test_datatype_layouts() -> None:
    """Random nested datatypes packed and scattered as MPI packs and unpacks them
    (layouts.py, hypothesis)."""
    expect_ok(1, "layouts.py", "300")


@pytest.mark.parametrize(("n", "kind"), [(2, "buffers"), (3, "buffers"), (2, "objects"),
                                         (2, "fin"), (2, "idle"), (2, "exit"), (3, "exit"),
                                         (2, "unreceived"), (2, "dropped"), (2, "bsend-exit")])
def test_queued_messages_move_while_mpi_waits(n: int, kind: str) -> None:
    """Eager sends queued behind a full ring reach the peer while the sender waits in a
    plain MPI call (queued.py; it hung in MPI's Barrier before the hook stayed armed, and
    for objects before ``send`` armed it); so does a direct receive's FIN. With nothing
    left to move, MPI's wait leaves the rings to the receives ("idle"). A sender that
    exits right after its Waitall delivers its queue first ("exit": the receiver hung),
    but not to a receiver that exits without reading ("unreceived": both hung; "dropped",
    whose wrapper was garbage collected before), and a
    buffered send's copy lives until it is pulled ("bsend-exit": the pull failed)."""
    expect_ok(n, "queued.py", kind)


@pytest.mark.parametrize("mode", ["one-cpu", "own-cpu"])
def test_ranks_outnumber_the_cpus_they_may_run_on(mode: str) -> None:
    """Two ranks confined to one CPU yield while they wait; two bound to a CPU each do not."""
    if mode == "own-cpu" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("binding two ranks to CPUs of their own needs two CPUs")
    expect_ok(2, "cpus.py", mode)


def test_bad_pretend_nodes() -> None:
    code, out, _ = mpirun(3, "p2p.py", env={"CMA_MPI_NODES": "0,1"})
    assert code != 0 and "CMA_MPI_NODES='0,1' must list a node number" in out, out


@pytest.mark.skipif(not IS_HYDRA, reason="-disable-auto-cleanup is an option of MPICH's hydra")
@pytest.mark.parametrize(("phase", "transport"), [
    ("Recv", "shm"), ("Barrier", "cma"), ("Probe", "vmfd"), ("Send", "auto"), ("Allreduce", "auto")])
def test_rank_sigkilled_while_blocked(phase: str, transport: str, tmp_path: Path) -> None:
    """Rank 1 dies (os._exit: no clean-up) once rank 0 sleeps in a call that needs it
    (killed.py); with mpiexec's clean-up off only cma.mpi can notice: rank 0 gets
    PeerGoneError naming rank 1.
    One phase per transport: each run costs an mpiexec start (test_faults has the matrix)."""
    report = tmp_path / "rank0.txt"
    code, out, _ = mpirun(2, "killed.py", phase, transport, str(report),
                          flags=("-disable-auto-cleanup",),
                          env={"CMA_MPI_COLLECTIVES": "cma"})  # (Allreduce: cma's, at any size)
    assert report.exists(), out
    got = report.read_text()
    print(got)
    assert got.startswith(f"rank 0: {phase}, {transport}: PeerGoneError"), got
    assert re.search(r"rank 1 \(pid \d+\) exited", got.split("PeerGoneError", 1)[1]), got


def test_interrupt_during_a_copy_under_way() -> None:
    """Ctrl-C in a cma.mpi Recv of 136 MiB whose copy is under way, with shm, cma, vmfd and
    auto in turn in one job (interrupted.py): KeyboardInterrupt within 2 s, then the
    communicator usable or refusing use naming the interrupt, and the next one works.
    Then in a Recv, a Barrier, the Wait of a large Isend and a Probe that wait asleep for a peer
    doing nothing: interrupted within 2 s each, and the communicator still usable. Then
    inside MPI's own Waitall: the KeyboardInterrupt once it returns, nothing printed as
    ignored."""
    code, out, _ = mpirun(2, "interrupted.py", "shm", "cma", "vmfd", "auto")
    print(out)
    assert code == 0, out
    assert "Exception ignored" not in out, out
    assert "inside MPI.Request.Waitall: KeyboardInterrupt" in out, out
    assert sorted(re.findall(r"OK (\d+)", out)) == ["0", "1"], out
    assert len(re.findall(r"KeyboardInterrupt [\d.]+ ms after SIGINT", out)) == 8, out
    assert len(re.findall(r"waiting (Recv|Barrier|Wait|Probe): KeyboardInterrupt", out)) == 4, out


def test_interrupts_in_a_mixed_ranks_waits() -> None:
    """Ctrl-C in a mixed rank's Recv from an on-node rank and from ANY_SOURCE
    (interrupted_mixed.py, CMA_MPI_NODES=0,0,1): KeyboardInterrupt within 2 s each, the
    abandoned receives withdrawn; in MPI's own off-node Recv: after it returns."""
    code, out, _ = mpirun(3, "interrupted_mixed.py", env={"CMA_MPI_NODES": "0,0,1"})
    print(out)
    assert code == 0, out
    assert sorted(re.findall(r"OK (\d+)", out)) == ["0", "1", "2"], out
    assert len(re.findall(r"mixed rank waiting in a .*: KeyboardInterrupt", out)) == 2, out
    assert "off-node Recv: KeyboardInterrupt after MPI returned" in out, out


@pytest.mark.parametrize(("n", "env"), [(1, {}), (2, {}), (3, {}), (4, {}),
                                        (3, {"CMA_MPI_RANKS_PER_NODE": "2"}),
                                        (4, {"CMA_MPI_RANKS_PER_NODE": "2"}),
                                        (4, {"CMA_MPI_NODES": "0,1,0,1"}),
                                        (2, {"CMA_XMAP": "1"}), (4, {"CMA_XMAP": "1"}),
                                        (3, {"CMA_XMAP": "1", "CMA_MPI_RANKS_PER_NODE": "2"}),
                                        (6, {})])
def test_collectives_agree_with_mpi(n: int, env: dict[str, str]) -> None:
    """cma.mpi.Comm's collectives give MPI's own results, over cases hypothesis draws alike on
    every rank (each predefined op over the dtypes MPI defines it on, the pair types of
    MINLOC and MAXLOC included; counts from 0; roots; the three spec forms; IN_PLACE
    wherever MPI has it): through cma when every rank is on one node (at 4 and 6 ranks the
    larger reductions by halving, at 6 with two pairs first); on pretend nodes (one of one
    rank at 3; at 4, also nodes whose ranks interleave), Bcast, Reduce, Allreduce, Gather,
    Scatter and Allgather through cma on each node and MPI between (the program checks that
    cma moved bytes); a user-defined op that commutes through cma, one that does not through
    MPI. With CMA_XMAP=1 every buffer is in the shared heap and hops are read out of
    mappings of their senders' pages (the program checks that xmap moved some). Every
    collective through cma (CMA_MPI_COLLECTIVES=cma): cma's are what is tested; routing.py
    has which library runs what by default."""
    expect_ok(n, "collectives.py", env={"CMA_MPI_COLLECTIVES": "cma", **env})


@pytest.mark.parametrize(("n", "mode"), [(2, "auto"), (3, "cma"), (4, "auto")])
def test_a_rank_passing_a_datatype_with_gaps_takes_its_peers_path(n: int, mode: str) -> None:
    """Rank 0 names a vector of int64s with gaps where its peers pass arrays: packed for
    cma's collectives and unpacked after, it goes where they go, with MPI's results and
    its gaps untouched (gapped.py; before, it went to MPI while its peers waited in cma
    inside a window of the table, or in every call with CMA_MPI_COLLECTIVES=cma: a hang)."""
    expect_ok(n, "gapped.py", mode, env={} if mode == "auto" else {"CMA_MPI_COLLECTIVES": mode})


def test_the_gapped_bcast_bench_reports_each_size() -> None:
    """bench/gapped_bcast.py (docs/figures/gapped-collectives-2026-12-05.txt) runs and
    prints both libraries' times for each size."""
    code, out, _ = mpirun(2, str(ROOT / "bench" / "gapped_bcast.py"), "--sizes", "4K,64K",
                          "--turns", "2")
    assert code == 0, out
    lines = [line for line in out.splitlines() if "vector on the root" in line]
    assert [line.split()[0:2] for line in lines] == [["4", "KiB"], ["64", "KiB"]], out
    assert all(float(number) > 0 for line in lines for number in re.findall(r"\d+\.\d+", line))


def test_the_object_snippets_bench_times_both_libraries_in_both_orders(tmp_path: Path) -> None:
    """bench/object_snippets.py (docs/mpi.md's object-collective figures): every case
    timed for both libraries each round, plain first in even rounds, the plugin in odd."""
    out_file = tmp_path / "snippets.json"
    code, out, _ = mpirun(2, str(ROOT / "bench" / "object_snippets.py"), "--rounds", "2",
                          "--cases", "gather int,reduce 4 MiB array", "--json", str(out_file))
    assert code == 0, out
    records = json.loads(out_file.read_text())["records"]
    assert [(r["case"], r["round"], r["first"]) for r in records] == [
        (case, 0, "plain") if i % 2 == 0 else (case, 1, "plugin")
        for case in ("gather int", "reduce 4 MiB array") for i in range(2)]
    assert all(r["plain"] > 0 and r["plugin"] > 0 for r in records)
    assert len(re.findall(r"speed +\d", out)) == 4, out


def test_the_barrier_bench_times_both_barriers_and_the_call_after_each() -> None:
    """bench/barrier.py (docs/guide.md's "Barrier"): each round times both barriers and
    an Alltoall after each, in alternating order."""
    code, out, _ = mpirun(2, str(ROOT / "bench" / "barrier.py"), "--rounds", "2", "--calls", "200")
    assert code == 0, out
    rounds = re.findall(r"^round (\d): (.*)$", out, re.M)
    assert [r[0] for r in rounds] == ["0", "1"], out
    for _, line in rounds:
        times = re.findall(r"(MPI Barrier|cma.mpi Barrier|Alltoall after MPI's|"
                           r"Alltoall after cma.mpi's) ([\d.]+)", line)
        assert len(times) == 4 and all(float(t) > 0 for _, t in times), line


def test_the_switch_points_bench_times_both_settings_in_turns() -> None:
    """bench/switch_points.py (docs/guide.md's "The switch points"): each size timed with
    the algorithm forced on and off, two turns each, and their ratios printed."""
    code, out, _ = mpirun(2, str(ROOT / "bench" / "switch_points.py"), "allreduce",
                          "ALLREDUCE_SCATTER_FROM", "--sizes", "4K,64K",
                          env={"CMA_MPI_COLLECTIVES": "cma"})
    assert code == 0, out
    rows = re.findall(r"^ *(\d+ \w+)  on (.*)  off (.*)  on/off mean ([\d.]+)-([\d.]+) ", out, re.M)
    assert [r[0] for r in rows] == ["4 KiB", "64 KiB"], out
    for _, on, off, low, high in rows:
        assert on.count("/") == off.count("/") == 2 and 0 < float(low) <= float(high), out


@pytest.mark.parametrize(("n", "mode", "datatype"), [
    (2, "auto", "int64"), (3, "auto", "int64"), (4, "auto", "int64"), (8, "auto", "int64"),
    (2, "cma", "int64"), (3, "mpi", "int64"), (3, "mismatch", "int64"),
    (2, "auto", "dup"), (3, "auto", "contiguous"), (3, "cma", "vector")])
def test_each_collective_runs_where_the_table_says_alike_on_every_rank(
        n: int, mode: str, datatype: str) -> None:
    """By default (auto) an all-on-node collective runs through MPI outside the window
    where cma was measured faster, through cma inside it, on every rank alike whether a
    rank passes an array, a spec list or IN_PLACE, with MPI's own results (routed.py);
    CMA_MPI_COLLECTIVES=cma and =mpi send every one through one library; ranks that set
    it differently all raise ValueError. ``datatype``: rank 0's spec lists name a derived
    datatype without gaps where data moves unreduced (cma reads it as bytes; before,
    such a rank went to MPI while its peers waited in cma: a hang)."""
    expect_ok(n, "routed.py", mode, datatype, env={} if mode in ("auto", "mismatch")
              else {"CMA_MPI_COLLECTIVES": mode})


@pytest.mark.parametrize("env", [{}, {"CMA_MPI_RANKS_PER_NODE": "2"}, {"CMA_MPI_DISABLE": "1"}])
def test_shared_array_per_node(env: dict[str, str]) -> None:
    """cma.shared_array gives one array per node (pretend nodes: one of them a single
    rank), read-only off the node's root; with cma disabled every rank gets CmaError
    (shared.py)."""
    expect_ok(3, "shared.py", env=env)


def _slow_spells_module() -> Any:
    spec = importlib.util.spec_from_file_location("slow_spells", ROOT / "bench" / "slow_spells.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (no MPI: main() imports mpi4py)
    return module


def test_the_slow_spells_bench_sorts_rounds_by_the_quiet_level() -> None:
    """bench/slow_spells.py's rule: a round is in a spell when cma.mpi's same-buffer time
    is over 3 times the level a tenth of the rounds are faster than; the summary's ratios
    are mpi4py's time over cma.mpi's, per kind of round."""
    bench = _slow_spells_module()
    quiet = [(100.0, 40.0 + i, 150.0, 60.0, 60.0, 15.0) for i in range(7)]
    spells = [(100.0, 400.0, 600.0, 450.0, 550.0, 30.0) for _ in range(3)]
    inside, outside, level = bench.sort_rounds(quiet + spells)
    assert (inside, outside, level) == (spells, quiet, 41.0)
    lines = bench.summary(quiet + spells)
    assert lines[0].startswith("3 rounds in spells: mpi4py/cma.mpi same buffer 0.25-0.25x"), lines
    assert "written each call 1.33-1.33x" in lines[0] and "mpi4py 550.0, cma.mpi 30.0" in lines[0]
    assert lines[1].startswith("7 rounds outside them: mpi4py/cma.mpi same buffer 2.17-2.50x"), lines


def test_the_slow_spells_bench_times_both_libraries_and_sorts_its_rounds() -> None:
    """bench/slow_spells.py (guide section 7's slow-spell figures) runs for a second and
    prints rounds of four times and the root's fills, then its summary, which must be the
    summary of the rounds it printed."""
    bench = _slow_spells_module()
    code, out, _ = mpirun(2, str(ROOT / "bench" / "slow_spells.py"), "1", "--size", "65536")
    assert code == 0, out
    rows = [tuple(map(float, row)) for row in re.findall(
        r"same buffer: mpi +([\d.]+) cma +([\d.]+) \| written each call: mpi +([\d.]+) "
        r"cma +([\d.]+) \(fill +([\d.]+) +([\d.]+)\)", out)]
    assert rows and all(t > 0 for row in rows for t in row), out
    printed = re.findall(r"^\d+ rounds (?:in spells|outside them).*$", out, re.MULTILINE)
    # (the rows are printed to 0.1 us: the ratios agree to their 2 decimals but for rounding)
    assert [line.split(":")[0] for line in printed] == \
        [line.split(":")[0] for line in bench.summary(rows)], out


def test_the_untouched_buffers_bench_times_each_buffer_through_both_libraries() -> None:
    """bench/untouched_buffers.py (mpi.md's zero-page figures) runs, and prints a row per
    send buffer with a time for plain mpi4py and for cma.mpi."""
    code, out, _ = mpirun(2, str(ROOT / "bench" / "untouched_buffers.py"), "--sizes", "65536",
                          "--rounds", "2", "--loops", "20")
    assert code == 0, out
    rows = re.findall(r"^\s+65536\s+(\w+)\s+([\d.]+) \(.*?\)\s+([\d.]+) \(", out, re.MULTILINE)
    assert [kind for kind, _, _ in rows] == ["empty", "written", "bytearray"], out
    assert all(float(plain) > 0 and float(plugin) > 0 for _, plain, plugin in rows), out

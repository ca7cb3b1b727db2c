"""cma-bench: the pure helpers with fake results, the kernels over an in-process pipe, and
short end-to-end runs of ``python -m cma.bench``."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import threading
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Peer
from mpijobs import find_mpiexec, job_env, kill, launcher_flags, segments_removed, start

import cma
import cma.bench.cli
import cma.bench.guard
from cma.bench.cli import WAITALL_NOTE, main, parse_args, report
from cma.bench.endpoints import WAITALL_MODES, Endpoint, _wait_each, mp_pipe_pair
from cma.bench.guard import GUARD_REDO, handoff_ratio
from cma.bench.kernels import (
    BUFFER_FORMS,
    Plan,
    SizePlan,
    _Buffers,
    build_plan,
    kernel_for,
    make_buffers,
    memcpy_size,
)
from cma.bench.report import (
    format_copies,
    format_crossovers,
    format_guard,
    format_mpi4py,
    format_results,
    mpi4py_row,
    reference_baseline,
)
from cma.bench.results import (
    Series,
    SizeResult,
    compared_series,
    copy_summary,
    crossovers,
    machine_info,
    merge_rounds,
    merge_series,
    result_copies,
    series_json,
)
from cma.bench.runners import PeerRunner, Runner, WorldRunner, run_plan
from cma.bench.schedule import SeriesSpec, _transport_names, round_order, schedule, select_series
from cma.bench.sizes import (
    GIB,
    KIB,
    KINDS,
    MIB,
    POLICIES,
    counts_for,
    format_size,
    messages_per_sample,
    parse_size,
    size_range,
)

# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(("text", "expected"), [
    ("8", 8), ("8B", 8), ("4K", 4096), ("4k", 4096), ("64KiB", 65536), ("1M", MIB),
    ("64MiB", 64 * MIB), ("2G", 2 * GIB), (" 16 kib ", 16 * KIB),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "4KB", "1MB", "1.5M", "-8", "4X", "0x10"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


@pytest.mark.parametrize(("nbytes", "text"), [
    (8, "8 B"), (4096, "4 KiB"), (64 * MIB, "64 MiB"), (GIB, "1 GiB"), (1536, "1536 B"),
])
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


def test_size_range() -> None:
    assert size_range(8, 64 * KIB) == [1 << i for i in range(3, 17)]
    assert size_range(5, 20) == [8, 16]
    assert size_range(1, 1) == [1]
    with pytest.raises(ValueError):
        size_range(0, 8)
    with pytest.raises(ValueError):
        size_range(64, 8)
    with pytest.raises(ValueError, match="no power of two"):
        size_range(9, 15)


# ---------------------------------------------------------------- counts


def test_counts_follow_osu_size_classes() -> None:
    assert counts_for("latency", 8, window=64, quick=False) == (10_000, 1_000)
    assert counts_for("latency", 64 * KIB, window=64, quick=False) == (1_000, 100)
    assert counts_for("bw", 8, window=64, quick=False) == (100, 10)
    quick = counts_for("latency", 8, window=64, quick=True)
    assert quick[0] < 10_000 and quick[1] < 1_000


def test_counts_cap_the_bytes_of_large_sizes() -> None:
    iters, warm = counts_for("latency", 64 * MIB, window=64, quick=False)
    assert iters * 2 * 64 * MIB <= POLICIES[("latency", False)].byte_budget
    assert iters >= POLICIES[("latency", False)].min_iterations
    assert 1 <= warm <= iters
    # a window moves 64x the bytes of a message: fewer windows, never below the minimum
    iters_bw, _ = counts_for("bw", 64 * MIB, window=64, quick=True)
    assert iters_bw == POLICIES[("window", True)].min_iterations


def test_counts_overrides_win() -> None:
    assert counts_for("latency", 64 * MIB, window=64, quick=True,
                           iterations=7, warmup=0) == (7, 0)


# ---------------------------------------------------------------- results and copies


def fake_result(size: int, one_way_us: float, iterations: int = 4,
                stats: list[dict[str, dict[str, float]]] | None = None) -> SizeResult:
    rtt_ns = int(one_way_us * 2e3)
    return SizeResult(size, iterations, 1, 2, [rtt_ns] * iterations, stats or [])


def test_size_result_is_per_message() -> None:
    r = SizeResult(1000, 2, 0, 2, [4000, 6000])  # round trips of 4 and 6 us
    assert r.mean_us == pytest.approx(2.5)
    assert r.bandwidth_mbps == pytest.approx(400.0)
    assert r.summary()["time_us_min"] == pytest.approx(2.0)


def counters(nbytes: float, user: float = 0.0, kernel: float = 0.0, syscalls: int = 0,
             messages: int = 1) -> dict[str, float]:
    return {"messages": messages, "bytes": nbytes, "user_copies": user,
            "kernel_copies": kernel, "syscalls": syscalls}


def test_copy_summary_adds_both_sides() -> None:
    size, messages = 4096, 10
    sender = {"shm": counters(size * messages, user=1.0, syscalls=5)}
    receiver = {"shm": counters(size * messages, user=1.0, syscalls=15)}
    c = copy_summary([sender, receiver], messages, size)
    assert c is not None
    assert (c.user, c.kernel, c.syscalls) == (2.0, 0.0, 2.0)
    assert c.copied_bytes == 2 * size
    assert c.via == ("shm",)


def test_copy_summary_single_copy_counted_on_one_side() -> None:
    size, messages = MIB, 4
    sender = {"cma": counters(size * messages), "eager": counters(64, user=2.0)}
    receiver = {"cma": counters(size * messages, kernel=1.0, syscalls=4)}
    c = copy_summary([sender, receiver], messages, size)
    assert c is not None
    assert c.kernel == 1.0
    assert c.user == pytest.approx(128 / (size * messages))
    assert c.syscalls == 1.0
    assert c.via == ("cma", "eager")


def test_copy_summary_without_stats() -> None:
    assert copy_summary([], 10, 8) is None


# ---------------------------------------------------------------- crossovers


def test_crossover_found_once() -> None:
    times = {"shm": {8: 1.0, 4096: 2.0, 65536: 30.0, MIB: 400.0},
             "cma": {8: 1.5, 4096: 3.0, 65536: 20.0, MIB: 200.0}}
    (c,) = crossovers(times)
    assert (c.leader, c.since, c.overtaker, c.at, c.changes) == ("shm", 8, "cma", 65536, 1)
    assert format_crossovers([c]) == (
        "shm vs cma: shm faster from 8 B, cma overtakes at 64 KiB")


def test_crossover_never() -> None:
    (c,) = crossovers({"a": {8: 1.0, 16: 1.0}, "b": {8: 2.0, 16: 3.0}})
    assert c.overtaker is None and c.at is None
    assert format_crossovers([c]) == "a vs b: a faster from 8 B, b never overtakes"


def test_crossover_back_and_forth_and_ties() -> None:
    times = {"a": {1: 1.0, 2: 5.0, 4: 5.0, 8: 1.0, 16: 9.0},
             "b": {1: 2.0, 2: 5.0, 4: 1.0, 8: 2.0, 16: 1.0}}
    (c,) = crossovers(times)
    # the tie at 2 is no change; b leads at 4, a at 8, b at 16
    assert (c.leader, c.overtaker, c.at, c.changes) == ("a", "b", 4, 3)
    assert "the lead changes 3 times" in format_crossovers([c])


def test_crossover_ignores_differences_within_noise() -> None:
    times = {"a": {8: 1.0, 16: 1.25, 32: 1.0, 64: 9.0},
             "b": {8: 1.2, 16: 1.0, 32: 1.2, 64: 3.0}}
    errors = {"a": {8: 0.1, 16: 0.1, 32: 0.1, 64: 0.1}, "b": {8: 0.1, 16: 0.1, 32: 0.1, 64: 0.1}}
    assert crossovers(times)[0].changes == 3  # taken at face value: noise flips the lead
    (c,) = crossovers(times, errors)  # 0.2-0.25 apart is within 2 x 0.14: ties
    assert (c.leader, c.since, c.overtaker, c.at) == ("b", 64, None, None)
    same = {"a": {8: 1.0}, "b": {8: 1.1}}
    assert crossovers(same, {"a": {8: 0.1}, "b": {8: 0.1}}) == []


def test_crossovers_every_pair_and_only_common_sizes() -> None:
    times = {"a": {8: 1.0}, "b": {8: 2.0}, "c": {16: 1.0}}
    found = crossovers(times)
    assert [(c.first, c.second) for c in found] == [("a", "b")]


def test_compared_series_leaves_out_memcpy_and_failures() -> None:
    means, errors = compared_series(fake_series())
    assert list(means) == ["mp-pipe", "shm"] == list(errors)
    assert means["shm"][MIB] == pytest.approx(250.0)
    assert errors["shm"][MIB] == 0.0  # identical fake samples


def test_rounds_report_the_median_of_their_means() -> None:
    # one size measured in three rounds; the second ran in a slow spell
    rounds = [fake_result(MIB, 100.0), fake_result(MIB, 400.0, iterations=2),
              fake_result(MIB, 110.0)]
    merged = merge_rounds(rounds)
    assert merged.samples_per_round == [4, 2, 4]
    assert merged.iterations == 10
    assert merged.round_means_us() == pytest.approx([100.0, 400.0, 110.0])
    assert merged.time_us == pytest.approx(110.0)
    assert merged.mean_us == pytest.approx((400 + 800 + 440) / 10)
    assert merged.bandwidth_mbps == pytest.approx(MIB / 110.0)
    assert merged.time_sem_us == pytest.approx(statistics.stdev([100, 400, 110]) / 3 ** 0.5)
    summary = merged.summary()
    assert summary["time_us_round_means"] == pytest.approx([100.0, 400.0, 110.0])
    assert summary["time_us_median_of_rounds"] == pytest.approx(110.0)
    single = fake_result(MIB, 100.0)
    assert single.time_us == single.mean_us and single.time_sem_us == single.sem_us
    assert "time_us_round_means" not in single.summary()
    with pytest.raises(ValueError):
        merge_rounds([fake_result(MIB, 1.0), fake_result(2 * MIB, 1.0)])


def test_rounds_add_up_copy_counts() -> None:
    side = {"shm": counters(8 * MIB, user=1.0, syscalls=8)}
    merged = merge_rounds([fake_result(MIB, 1.0, stats=[side, side]),
                                fake_result(MIB, 1.0, stats=[side, side])])
    copies = result_copies(merged)
    assert copies is not None  # 16 messages of 1 MiB, 2 user copies each, as in one round
    assert (copies.user, copies.syscalls) == (2.0, 2.0)


def test_merge_series_keeps_order_of_sizes_and_refuses_partial_runs() -> None:
    runs = [Series("shm", "transport", results=[fake_result(8, t), fake_result(MIB, 10 * t)],
                   seconds=1.0) for t in (1.0, 3.0, 2.0)]
    merged = merge_series(runs)
    assert [r.size for r in merged.results] == [8, MIB]
    assert [r.time_us for r in merged.results] == pytest.approx([2.0, 20.0])
    assert merged.seconds == 3.0
    runs[2] = Series("shm", "transport", "failed", "PeerGone: gone")
    broken = merge_series(runs)
    assert (broken.status, broken.reason, broken.results) == (
        "failed", "round 3: PeerGone: gone", [])
    assert merge_series([runs[2]]).reason == "PeerGone: gone"


# ---------------------------------------------------------------- tables


def fake_series() -> list[Series]:
    return [
        Series("memcpy", "baseline", results=[fake_result(8, 0.5), fake_result(MIB, 100.0)]),
        Series("mp-pipe", "baseline", results=[fake_result(8, 20.0), fake_result(MIB, 1000.0)]),
        Series("shm", "transport", results=[fake_result(8, 2.0), fake_result(
            MIB, 250.0, stats=[{"shm": counters(8 * MIB, user=1.0, syscalls=8)},
                               {"shm": counters(8 * MIB, user=1.0, syscalls=8)}])]),
        Series("vmfd", "transport", "unavailable", "no /proc/self/mem"),
    ]


def test_results_table_ratios() -> None:
    text = format_results("latency", fake_series())
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("size"))
    assert header.split() == ["size", "series", "time", "us", "MB/s", "bw/memcpy",
                              "bw/mp-pipe", "+/-", "us", "iters"]
    shm_1m = next(line for line in lines if line.split()[:1] == ["shm"]
                  and "250.0" in line)
    # bandwidth 1 MiB / 250 us; memcpy took 100 us (0.40), mp-pipe 1000 us (4.00)
    assert shm_1m.split() == ["shm", "250.0", "4194", "0.40", "4.00", "0.00", "4"]
    assert "vmfd" not in text  # not measured: reported under "not measured", not here


def test_results_table_with_rounds() -> None:
    shm = merge_series([Series("shm", "transport", results=[fake_result(MIB, t)])
                             for t in (250.0, 900.0, 240.0)])
    memcpy = merge_series([Series("memcpy", "baseline", results=[fake_result(MIB, t)])
                                for t in (100.0, 100.0, 100.0)])
    text = format_results("latency", [memcpy, shm])
    assert "median over 3 rounds" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["shm"]).split()
    # the median round (250 us) decides time and ratio; every round's mean is shown
    assert row[1:4] == ["250.0", "4194", "0.40"]
    assert row[-3:] == ["250.0", "900.0", "240.0"]
    assert "round means" not in format_results("latency", fake_series())


def test_reference_baseline_prefers_mpi4py() -> None:
    series = fake_series()
    assert reference_baseline(series) is series[1]
    mpi = Series("mpi4py", "baseline", results=[fake_result(8, 3.0)])
    assert reference_baseline([*series, mpi]) is mpi
    assert "bw/mpi4py" in format_results("latency", [*series, mpi])


def test_reference_baseline_of_several_buffer_forms_is_the_first_listed() -> None:
    forms = [Series(f"mpi4py[{form}]", "baseline", results=[fake_result(8, t)], buffer=form)
             for form, t in (("spec", 4.0), ("numpy", 3.0))]
    cma_mpi = Series("cma.mpi[spec]", "transport", results=[fake_result(8, 2.0)], buffer="spec")
    assert reference_baseline([*fake_series(), *forms, cma_mpi]) is forms[0]
    text = format_results("latency", [*forms, cma_mpi])
    row = next(line for line in text.splitlines() if "cma.mpi[spec]" in line).split()
    assert "bw/mpi4py[spec]" in text and row[-3] == "2.00"  # 4 us against 2 us


def test_copies_table() -> None:
    text = format_copies(fake_series())
    row = text.splitlines()[-1].split()
    # 1 MiB x 4 round trips = 8 messages: 2 user copies each, 16 syscalls / 8 = 2 per message
    assert row == ["shm", "1", "MiB", "shm", "2.00", "0.00", "2.00", "2.00", str(2 * MIB)]
    assert format_copies([Series("mp-pipe", "baseline")]) == ""


def test_mpi4py_row_format() -> None:
    assert mpi4py_row(8, 2.5e-6, 1e-7, 1000) == (
        "         8              3.20 | 2.5000000e-06 \u00b1 1.0000e-07     1000")
    assert mpi4py_row(1 << 30, 0.25, 0.0, 10) == (
        "1073741824           4294.97 | 2.5000000e-01 \u00b1 0.0000e+00       10")


def test_mpi4py_blocks() -> None:
    text = format_mpi4py(fake_series())
    lines = text.splitlines()
    assert lines[:3] == ["# cma-bench series: memcpy", "# MPI PingPong Test",
                         "# Size [B]  Bandwidth [MB/s] | Time Mean [s] \u00b1 StdDev [s]  Samples"]
    assert lines.count("# MPI PingPong Test") == 3  # the unavailable series has no block
    assert lines[3] == mpi4py_row(8, 0.5e-6, 0.0, 4)


def test_series_json_keeps_every_sample() -> None:
    doc = series_json(fake_series()[2])
    assert doc["buffer"] is None
    assert series_json(Series("shm[spec]", "transport", buffer="spec"))["buffer"] == "spec"
    big: Any = doc["results"][1]  # type: ignore[index]
    assert big["samples_ns"] == [500_000] * 4
    assert big["samples_per_round"] == [4]
    assert big["copies"]["user"] == 2.0
    json.dumps(machine_info())


# ---------------------------------------------------------------- command line


def test_default_is_quick_latency() -> None:
    ns = parse_args([])
    assert (ns.kind, ns.quick, ns.transport) == ("latency", True, "all")
    assert ns.sizes[0] == 8 and ns.sizes[-1] == 64 * MIB
    ns = parse_args(["--json", "x.json"])
    assert (ns.kind, ns.quick, ns.json) == ("latency", True, "x.json")
    ns = parse_args(["bw", "--min-size", "4K", "--max-size", "1MiB"])
    assert (ns.kind, ns.quick, ns.sizes[0], ns.sizes[-1]) == ("bw", False, 4096, MIB)


def test_all_leaves_out_the_teaching_transport_until_named() -> None:
    assert _transport_names("all", None) == ["shm", "cma", "vmfd", "auto"]
    assert _transport_names("cma,ptrace", None) == ["cma", "ptrace"]
    with pytest.raises(ValueError, match="cma.mpi"):
        _transport_names("cma.mpi", None)


@pytest.mark.parametrize("argv", [
    ["latency", "--min-size", "4KB"],
    ["latency", "--iterations", "0"],
    ["bw", "--cold", "--max-size", "64M"],
    ["latency", "--format", "csv"],
])
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What argparse says when it refuses ``argv`` (exit code 2)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_buffer_and_waitall_options(capsys: pytest.CaptureFixture[str]) -> None:
    for kind in KINDS:  # the defaults: today's behaviour, whatever the kind
        ns = parse_args([kind])
        assert (ns.buffer, ns.waitall) == (["numpy"], "each")
    ns = parse_args(["latency", "--buffer", "spec, numpy,spec,spec-bytearray"])
    assert ns.buffer == ["spec", "numpy", "spec-bytearray"]  # in order, each once
    assert parse_args(["bw", "--waitall", "mpi", "--buffer", "bytearray"]).waitall == "mpi"
    assert "unknown buffer form 'arrays': choose one or more, comma-separated, of numpy, " \
        "bytearray, spec, spec-bytearray" in bad_arguments(["latency", "--buffer", "numpy,arrays"],
                                                           capsys)
    assert "unknown buffer form" in bad_arguments(["bw", "--buffer", ","], capsys)
    assert "argument --waitall: invalid choice: 'all'" in bad_arguments(
        ["bw", "--waitall", "all"], capsys)
    # --buffer is for latency and bw, --waitall for bw only
    assert "unrecognized arguments: --buffer spec" in bad_arguments(
        ["bibw", "--buffer", "spec"], capsys)
    assert "unrecognized arguments: --waitall mpi" in bad_arguments(
        ["latency", "--waitall", "mpi"], capsys)
    assert "a bytearray is written when it is made" in bad_arguments(
        ["latency", "--cold", "--buffer", "numpy,spec-bytearray"], capsys)
    assert parse_args(["latency", "--cold", "--buffer", "spec"]).cold


def test_buffer_forms_make_one_series_each() -> None:
    plain, _ = select_series("latency", "shm", "memcpy,mp-pipe", None)
    assert [(s.name, s.buffer) for s in plain] == [
        ("memcpy", None), ("mp-pipe", None), ("shm", "numpy")]
    specs, not_run = select_series("bw", "shm,cma", "memcpy,mp-pipe,mpi4py", None,
                                         ["numpy", "spec"])
    assert [(s.name, s.buffer) for s in specs] == [
        ("memcpy", None), ("mp-pipe", None), ("shm[numpy]", "numpy"), ("shm[spec]", "spec"),
        ("cma[numpy]", "numpy"), ("cma[spec]", "spec")]
    assert [(s.name, s.buffer, s.status) for s in not_run] == [
        ("mpi4py[numpy]", "numpy", "skipped"), ("mpi4py[spec]", "spec", "skipped")]
    (one,), _ = select_series("latency", "shm", "none", None, ["bytearray"])
    assert (one.name, one.buffer) == ("shm[bytearray]", "bytearray")


def test_unknown_baseline() -> None:
    with pytest.raises(ValueError, match="unknown baseline"):
        select_series("latency", "none", "memcpy,nccl", None)


def test_mpi4py_baseline_needs_mpiexec() -> None:
    specs, not_run = select_series("bibw", "none", "memcpy,mp-pipe,mpi4py", None)
    assert [s.name for s in specs] == ["memcpy", "mp-pipe"]
    assert specs[1].skip  # no non-blocking send on a multiprocessing.Pipe
    assert [(s.name, s.status) for s in not_run] == [("mpi4py", "skipped")]


# ---------------------------------------------------------------- kernels over an in-process pipe


def run_over_threads(plan: Plan) -> list[SizeResult]:
    """Both ranks of ``plan`` as two threads on a multiprocessing.Pipe; rank 0's results."""
    a, b = mp_pipe_pair()
    peer = threading.Thread(target=run_plan, args=(Endpoint(b, "pipe"), plan))
    peer.start()
    results = run_plan(Endpoint(a, "pipe"), plan)
    peer.join(timeout=30)
    a.close()
    b.close()
    assert not peer.is_alive()
    return results


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cold", [False, True])
def test_kernels_over_threads(kind: str, cold: bool) -> None:
    """Both ranks of every kernel, as two threads on a multiprocessing.Pipe."""
    plan = build_plan(kind, [8, 64], window=4, cold=cold, quick=True,
                            iterations=5, warmup=2)
    results = run_over_threads(plan)
    assert [(r.size, r.iterations, len(r.samples_ns)) for r in results] == [(8, 5, 5), (64, 5, 5)]
    assert results[0].messages_per_sample == messages_per_sample(kind, 4)
    assert all(ns > 0 for r in results for ns in r.samples_ns)
    assert results[0].stats == []


# ---------------------------------------------------------------- buffer forms and --waitall

FORM_SIZES = [8, 64 * KIB, 3 * MIB]  # eager, and above the eager limit of 2 MiB (rendezvous)
FORM_ITERATIONS = 3
FORM_WINDOW = 4
FORM_KINDS = ["latency", "bw"]


def pattern(size: int, rank: int) -> bytes:
    """What rank ``rank`` sends: bytes that differ between the ranks and along the message."""
    return np.random.default_rng(rank).bytes(size)


class Recording:
    """A communicator that keeps every buffer argument of its point-to-point calls, alive,
    so that two lists built by two calls cannot share an id."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.rank = comm, comm.rank
        self.buffers: list[Any] = []

    def Send(self, buf: Any, dest: int, tag: int) -> None:
        self.buffers.append(buf)
        self.comm.Send(buf, dest, tag)

    def Recv(self, buf: Any, source: int, tag: int) -> None:
        self.buffers.append(buf)
        self.comm.Recv(buf, source, tag)

    def Isend(self, buf: Any, dest: int, tag: int) -> Any:
        self.buffers.append(buf)
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf: Any, source: int, tag: int) -> Any:
        self.buffers.append(buf)
        return self.comm.Irecv(buf, source, tag)


def run_form(comm: Any, flavor: str, kind: str, form: str, size: int,
             waitall: str = "each") -> _Buffers:
    """One rank of ``kind`` passing ``form`` buffers, sending ``pattern(size, rank)``; checks
    what every payload call was given and returns the buffers."""
    recording = Recording(comm)
    ep = Endpoint(recording, flavor, waitall)
    bufs = make_buffers(size, form)
    memoryview(bufs.send)[:] = pattern(size, ep.rank)
    kernel_for(kind, form)(ep, bufs, FORM_ITERATIONS, False, FORM_WINDOW)
    payload = [buf for buf in recording.buffers if buf is not bufs.ack]
    assert len(payload) == FORM_ITERATIONS * (2 if kind == "latency" else FORM_WINDOW)
    if form.startswith("spec"):
        assert all(type(spec) is list and spec[1:] == [size, ep.byte] for spec in payload)
        assert len({id(spec) for spec in payload}) == len(payload), "a spec list was reused"
        payload = [spec[0] for spec in payload]
    assert all(buf is bufs.send or buf is bufs.recv for buf in payload)
    assert type(bufs.send) is type(bufs.recv) is (
        bytearray if form.endswith("bytearray") else np.ndarray)
    return bufs


def expected(kind: str, rank: int, size: int) -> bytes:
    """What rank ``rank`` holds in its receive buffer after ``run_form``: the other rank's
    bytes, or (rank 0 of bw, which receives only the ack) the zeros it started with."""
    return bytes(size) if kind == "bw" and rank == 0 else pattern(size, 1 - rank)


def run_form_rank1(comm: cma.Comm, kind: str, form: str) -> list[bytes]:
    return [bytes(run_form(comm, "cma", kind, form, size).recv) for size in FORM_SIZES]


@pytest.mark.timeout(60)  # a healthy run takes well under a second
@pytest.mark.parametrize("form", list(BUFFER_FORMS))
@pytest.mark.parametrize("kind", FORM_KINDS)
def test_buffer_forms_deliver_the_senders_bytes(peer: Peer, kind: str, form: str) -> None:
    """Every --buffer form through every transport: each call gets the form (a spec list
    built anew by each call), and each receiver ends with the other rank's bytes."""
    peer.start(run_form_rank1, kind, form)
    mine = [bytes(run_form(peer.comm, "cma", kind, form, size).recv) for size in FORM_SIZES]
    theirs = peer.result()
    for size, got0, got1 in zip(FORM_SIZES, mine, theirs, strict=True):
        assert got0 == expected(kind, 0, size), f"rank 0, {size} bytes"
        assert got1 == expected(kind, 1, size), f"rank 1, {size} bytes"


def fake_mpi(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """An ``mpi4py.MPI`` with only what Endpoint takes from it (the real one would start MPI)."""
    mpi = types.SimpleNamespace(BYTE=object(), Request=types.SimpleNamespace(Waitall=print))
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=mpi))
    return mpi


def test_waitall_mpi_is_mpis_waitall_for_cma_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    mpi = fake_mpi(monkeypatch)
    rank0 = types.SimpleNamespace(rank=0)
    assert Endpoint(rank0, "cma.mpi").waitall is _wait_each
    assert Endpoint(rank0, "cma.mpi", "mpi").waitall is mpi.Request.Waitall
    assert Endpoint(rank0, "mpi", "each").waitall is mpi.Request.Waitall
    assert Endpoint(rank0, "cma.mpi").byte is mpi.BYTE
    cma_ep = Endpoint(rank0, "cma", "mpi")  # no MPI there: --waitall mpi is ignored
    assert (cma_ep.waitall, cma_ep.byte) == (cma.Request.Waitall, "B")
    plan = build_plan("bw", [8], window=4, cold=False, quick=True, iterations=1, warmup=0)
    runner = WorldRunner(replace(plan, waitall="mpi"), lambda: rank0, "cma.mpi")
    runner.open(plan.sizes)
    assert runner.ep.waitall is mpi.Request.Waitall


def test_each_series_runs_with_its_buffer_form_and_the_waitall_asked(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    plans: dict[str, Plan] = {}

    class PlanRunner(Runner):
        def __init__(self, plan: Plan, name: str) -> None:
            super().__init__(plan)
            plans[name] = plan

        def run_size(self, sp: SizePlan) -> SizeResult:
            return fake_result(sp.size, 1.0)

    def spec(name: str, form: str | None) -> SeriesSpec:
        return SeriesSpec(name, "transport", "world", lambda plan: PlanRunner(plan, name),
                                buffer=form)

    specs = [spec("mp-pipe", None), spec("cma.mpi[numpy]", "numpy"),
             spec("cma.mpi[spec-bytearray]", "spec-bytearray")]
    monkeypatch.setattr(cma.bench.cli, "select_series", lambda *args: (specs, []))
    argv = ["bw", "--max-size", "8", "--no-bind", "--waitall", "mpi", "--json", os.devnull]
    assert main(argv) == 0
    assert {name: (plan.buffer, plan.waitall) for name, plan in plans.items()} == {
        "mp-pipe": ("numpy", "mpi"), "cma.mpi[numpy]": ("numpy", "mpi"),
        "cma.mpi[spec-bytearray]": ("spec-bytearray", "mpi")}
    assert WAITALL_NOTE in capsys.readouterr().out


def test_waitall_mpi_needs_an_mpi_series(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bw", "--transport", "shm", "--baseline", "memcpy", "--waitall", "mpi", "--no-bind"]
    assert main(argv) == 2
    assert "--waitall mpi changes only how the MPI series" in capsys.readouterr().err
    assert WAITALL_NOTE not in report("bw", fake_series(), "table")
    assert WAITALL_NOTE in report("bw", fake_series(), "table", "mpi")


def test_memcpy_baseline() -> None:
    plan = build_plan("memcpy", [8, MIB], window=64, cold=True, quick=True,
                            iterations=3, warmup=1)
    results = [memcpy_size(plan, sp) for sp in plan.sizes]
    assert [(r.size, len(r.samples_ns), r.messages_per_sample) for r in results] == [
        (8, 3, 1), (MIB, 3, 1)]


@pytest.mark.parametrize("completed", [True, False])
def test_peer_process_is_ended(completed: bool) -> None:
    """A session that ran every size lets the child finish; one cut short kills it."""
    plan = build_plan("latency", [8, 16], window=64, cold=False, quick=True,
                            iterations=10, warmup=1)
    before = set(multiprocessing.active_children())
    runner = PeerRunner(plan, mp_pipe_pair, "pipe")
    try:
        runner.open(plan.sizes)
        result = runner.run_size(plan.sizes[0])
        if completed:
            runner.run_size(plan.sizes[1])
    finally:
        runner.close(completed)
    assert result is not None and len(result.samples_ns) == 10
    assert set(multiprocessing.active_children()) == before
    assert runner.proc is not None and runner.proc.exitcode == (0 if completed else -9)


class FakeRunner(Runner):
    """Every size of series ``name`` takes ``one_way_us``; ``ran`` records each step."""

    def __init__(self, plan: Plan, name: str, one_way_us: float,
                 ran: list[tuple[str, int]]) -> None:
        super().__init__(plan)
        self.name, self.one_way_us, self.ran = name, one_way_us, ran

    def run_size(self, sp: SizePlan) -> SizeResult:
        self.ran.append((self.name, sp.size))
        return fake_result(sp.size, self.one_way_us)


def fake_specs(ran: list[tuple[str, int]]) -> list[SeriesSpec]:
    def spec(name: str, one_way_us: float) -> SeriesSpec:
        return SeriesSpec(name, "transport", "local",
                                lambda plan: FakeRunner(plan, name, one_way_us, ran))

    return [spec("a", 1.0), spec("b", 2.0), spec("c", 3.0), spec("d", 4.0)]


def test_rounds_vary_the_order_and_merge_them(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[tuple[str, int]] = []
    monkeypatch.setattr(cma.bench.cli, "select_series", lambda *args: (fake_specs(ran), []))
    assert main(["latency", "--rounds", "3", "--max-size", "16", "--no-bind"]) == 0
    # each series over every size (8, 16) before the next
    assert [name for name, size in ran if size == 16] == [name for name, _ in ran[::2]]
    assert [name for name, _ in ran[::2]] == [
        "a", "b", "d", "c", "b", "c", "a", "d", "c", "d", "b", "a"]
    out = capsys.readouterr().out
    assert "median over 3 rounds" in out
    rows = [line.split() for line in out.splitlines()]
    # the table keeps the order of the series, not that of the last round
    assert [row[2] for row in rows if row[:2] == ["8", "B"]] == ["a"]
    assert [row[0] for row in rows if row[:1] in (["b"], ["c"])][:2] == ["b", "c"]


def test_schedule_holds_every_step_once_in_either_order() -> None:
    plain = schedule(3, 4, 2, interleave=False)
    mixed = schedule(3, 4, 2, interleave=True)
    steps = [step for session in plain for step in session]
    assert sorted(steps) == sorted(mixed[0]) == sorted(
        (i, r, k) for i in range(3) for r in range(2) for k in range(4))
    assert len(steps) == len(set(steps))
    # plain: a session per series and round, sizes ascending; interleaved: one session,
    # every series and round at a size before the next size, rounds in round_order
    assert [[k for _, _, k in session] for session in plain] == [[0, 1, 2, 3]] * 6
    assert len(mixed) == 1
    assert [k for _, _, k in mixed[0]] == sorted(k for _, _, k in mixed[0])
    assert [(i, r) for i, r, k in mixed[0] if k == 0] == [
        (i, r) for r in range(2) for i in round_order(3, r)]


def test_interleave_runs_every_series_at_a_size_before_the_next(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[tuple[str, int]] = []
    opened: list[list[int]] = []
    monkeypatch.setattr(cma.bench.cli, "select_series", lambda *args: (fake_specs(ran), []))
    monkeypatch.setattr(FakeRunner, "open",
                        lambda self, sizes: opened.append([sp.size for sp in sizes]))
    argv = ["latency", "--rounds", "2", "--max-size", "16", "--no-bind", "--interleave"]
    assert main(argv) == 0
    assert [size for _, size in ran] == [8] * 8 + [16] * 8
    assert [name for name, _ in ran[:8]] == ["a", "b", "d", "c", "b", "c", "a", "d"]
    assert opened == [[8, 8, 16, 16]] * 4  # one peer per series for the whole run
    out = capsys.readouterr().out
    assert "median over 2 rounds" in out


def test_a_series_that_fails_midway_is_reported_and_the_others_go_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[tuple[str, int]] = []
    closed: list[tuple[str, bool]] = []

    def run_size(self: FakeRunner, sp: SizePlan) -> SizeResult:
        if (self.name, sp.size) == ("b", 16):
            raise RuntimeError("peer lost")
        self.ran.append((self.name, sp.size))
        return fake_result(sp.size, self.one_way_us)

    monkeypatch.setattr(FakeRunner, "run_size", run_size)
    monkeypatch.setattr(FakeRunner, "close",
                        lambda self, completed: closed.append((self.name, completed)))
    monkeypatch.setattr(cma.bench.cli, "select_series", lambda *args: (fake_specs(ran), []))
    argv = ["latency", "--rounds", "2", "--max-size", "16", "--no-bind", "--interleave",
            "--json", os.devnull]
    assert main(argv) == 1  # a failed series fails the run
    assert [name for name, size in ran if size == 16] == ["a", "d", "c", "c", "a", "d"]
    assert ("b", False) in closed and sorted(closed) == [
        ("a", True), ("b", False), ("c", True), ("d", True)]
    out = capsys.readouterr().out
    assert "RuntimeError: peer lost" in out


def run_guarded(monkeypatch: pytest.MonkeyPatch, ratios: list[float], guard: float,
                sizes: list[int]) -> list[SizeResult]:
    """A latency plan under --guard over two threads, the probe replaced by ``ratios``."""
    probe = iter(ratios)
    monkeypatch.setattr(cma.bench.guard, "handoff_ratio", lambda cpus: next(probe))
    monkeypatch.setattr(cma.bench.guard, "GUARD_PAUSE", 0.01)
    monkeypatch.setattr(cma.bench.guard, "PROBE_PEER_SLEEP", 0.0)
    plan = build_plan("latency", sizes, window=4, cold=False, quick=True,
                            iterations=5, warmup=1)
    results = run_over_threads(replace(plan, guard=guard, guard_cpus=(0, 1)))
    assert next(probe, None) is None, "fewer probes than scripted"
    return results


def test_guard_waits_for_a_quiet_machine_and_redoes_a_loop_that_ended_slow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slow, quiet = 2.0, 1.0
    first, second = run_guarded(
        monkeypatch, [slow, slow, quiet, slow, quiet, quiet, quiet, quiet], 60.0, [8, 64])
    assert first.probes == [slow, slow, quiet, slow, quiet, quiet]
    assert len(first.redone_us) == 1 and first.redone_us[0] > 0
    assert first.waited_s >= 2 * cma.bench.guard.GUARD_PAUSE
    assert len(first.samples_ns) == 5  # the kept loop only
    assert (second.probes, second.redone_us, second.waited_s) == ([quiet, quiet], [], 0.0)


def test_guard_gives_up_waiting_and_redoing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that stays slow: one probe past the time limit, GUARD_REDO redos, no more."""
    (result,) = run_guarded(monkeypatch, [2.0] * (2 + 2 * GUARD_REDO), 1e-9, [8])
    assert len(result.redone_us) == GUARD_REDO
    assert len(result.probes) == 2 + 2 * GUARD_REDO
    assert len(result.samples_ns) == 5


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probe needs two CPUs")
def test_handoff_probe_measures_a_ratio() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert 0.2 < handoff_ratio(cpus) < 20


def test_guard_report_and_merged_rounds() -> None:
    waited = fake_result(8, 1.0)
    waited.waited_s, waited.probes, waited.redone_us = 3.0, [2.0, 1.0, 1.9, 1.1], [9.5]
    quiet = fake_result(8, 1.0)
    quiet.probes = [1.0, 1.0]
    merged = merge_rounds([waited, quiet])
    assert (merged.waited_s, merged.probes, merged.redone_us) == (
        3.0, [2.0, 1.0, 1.9, 1.1, 1.0, 1.0], [9.5])
    text = format_guard([Series("shm", "transport", results=[merged])])
    assert "waited 3 s in all for a quiet machine before 1 of them; slowest probe 2.00x" in text
    assert "shm 8 B: 9.50 -> 1.00 us" in text
    assert format_guard([Series("shm", "transport", results=[fake_result(8, 1.0)])]) == ""


def predecessors(orders: list[list[int]]) -> dict[int, list[int]]:
    """For each series, the series that ran just before it, round by round."""
    before: dict[int, list[int]] = {}
    for order in orders:
        for previous, series in zip(order[:-1], order[1:], strict=True):
            before.setdefault(series, []).append(previous)
    return before


@pytest.mark.parametrize("count", range(1, 10))
def test_round_order_varies_what_runs_first_and_what_runs_before(count: int) -> None:
    rounds = [round_order(count, r) for r in range(count)]
    assert all(sorted(order) == list(range(count)) for order in rounds)
    assert len({order[0] for order in rounds}) == count
    repeats = max((max(map(ran.count, ran)) for ran in predecessors(rounds).values()), default=1)
    assert repeats <= (1 if count % 2 == 0 else 2)


def test_round_order_of_the_usual_run_never_repeats_a_predecessor() -> None:
    """cma-bench under mpiexec: 7 series (memcpy, mpi4py, 4 transports, cma.mpi), 3 rounds."""
    before = predecessors([round_order(7, r) for r in range(3)])
    assert all(len(set(ran)) == len(ran) for ran in before.values())


def test_rounds_must_be_positive() -> None:
    assert parse_args(["latency"]).rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["latency", "--rounds", "0"])


# ---------------------------------------------------------------- end to end


def run_cli(args: list[str], tmp_path: Path) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "cma.bench", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_cli_baselines_only(tmp_path: Path) -> None:
    stdout, doc = run_cli(["latency", "--transport", "none", "--baseline", "memcpy,mp-pipe",
                           "--max-size", "4K", "--quick"], tmp_path)
    assert [s["name"] for s in doc["series"]] == ["memcpy", "mp-pipe"]
    assert "bw/mp-pipe" in stdout and "mp-pipe" in stdout


def test_cli_shm_latency(tmp_path: Path) -> None:
    stdout, doc = run_cli(["latency", "--transport", "shm", "--min-size", "8",
                           "--max-size", "64K", "--quick"], tmp_path)
    assert doc["parameters"]["kind"] == "latency"
    assert doc["parameters"]["sizes"] == [1 << i for i in range(3, 17)]
    assert {"kernel", "cpu_model", "nproc", "python", "numpy", "cma"} <= set(doc["machine"])
    shm = next(s for s in doc["series"] if s["name"] == "shm")
    assert shm["status"] == "ok", shm["reason"]
    assert [r["size"] for r in shm["results"]] == doc["parameters"]["sizes"]
    for r in shm["results"]:
        assert len(r["samples_ns"]) == r["iterations"]
        assert len(r["stats"]) == 2  # sender's and receiver's
        assert r["copies"]["user"] + r["copies"]["kernel"] > 0
    assert "copies per payload byte" in stdout
    assert "crossovers" in stdout


@pytest.mark.parametrize("interleave", [[], ["--interleave"]])
def test_cli_rounds(tmp_path: Path, interleave: list[str]) -> None:
    stdout, doc = run_cli(["latency", "--transport", "shm", "--baseline", "mp-pipe",
                           "--max-size", "1K", "--iterations", "5", "--warmup", "1",
                           "--rounds", "2", *interleave], tmp_path)
    assert doc["parameters"]["rounds"] == 2
    assert doc["parameters"]["interleave"] == bool(interleave)
    assert [s["name"] for s in doc["series"]] == ["mp-pipe", "shm"]
    for series in doc["series"]:
        assert series["status"] == "ok", series["reason"]
        for r in series["results"]:
            assert r["samples_per_round"] == [5, 5] and len(r["samples_ns"]) == 10
            assert len(r["time_us_round_means"]) == 2
    shm_stats = [r["stats"] for r in doc["series"][1]["results"]]
    assert all(len(stats) == 4 for stats in shm_stats)  # both sides, both rounds
    assert "median over 2 rounds" in stdout


@pytest.mark.parametrize(("kind", "forms", "cold"), [
    ("latency", "numpy,spec-bytearray", []), ("bw", "bytearray", []), ("bw", "spec", ["--cold"])])
def test_cli_buffer_forms(tmp_path: Path, kind: str, forms: str, cold: list[str]) -> None:
    stdout, doc = run_cli([kind, "--transport", "shm", "--baseline", "mp-pipe", "--buffer", forms,
                           "--max-size", "1K", "--iterations", "5", "--warmup", "1", *cold],
                          tmp_path)
    wanted = forms.split(",")
    assert (doc["parameters"]["buffer"], doc["parameters"]["waitall"]) == (wanted, "each")
    assert [(s["name"], s["buffer"]) for s in doc["series"]] == [
        ("mp-pipe", None), *((f"shm[{form}]", form) for form in wanted)]
    for series in doc["series"]:
        assert series["status"] == "ok", series["reason"]
        assert len(series["results"]) == 8  # 8 B .. 1 KiB
    table = stdout.split("\n\n")[0]
    assert all(f"shm[{form}]" in table for form in wanted)


# ---------------------------------------------------------------- under mpiexec

MPIEXEC = find_mpiexec()
needs_mpiexec = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpi4py and mpiexec (pip install 'cma-ipc[mpi]')")
MPI_TIMEOUT = 90  # the backstop; a healthy job takes a few seconds


def mpi_job(args: list[str]) -> str:
    """Output of ``mpiexec -n 2 python -m mpi4py ARGS`` (an exception in a rank aborts the job),
    which must succeed; the job is ended whole and its MPI segments removed whatever happens."""
    assert MPIEXEC is not None
    command = [MPIEXEC, *launcher_flags(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", *args]
    with segments_removed():
        job = start(command, job_env(), stdout=subprocess.PIPE)
        try:
            out, _ = job.communicate(timeout=MPI_TIMEOUT)
        except subprocess.TimeoutExpired:
            kill(job)
            out, _ = job.communicate()
            pytest.fail(f"mpiexec -n 2 {' '.join(args)} hung:\n{out}")
        finally:
            kill(job)
    assert job.returncode == 0, out
    return out


def mpi_forms_job() -> None:
    """Both ranks of every buffer form, kind and --waitall through mpi4py and cma.mpi,
    every received message checked (run by test_buffer_forms_under_mpiexec)."""
    from mpi4py import MPI

    from cma import mpi as cma_mpi

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    for flavor, comm in (("mpi", world), ("cma.mpi", cma_mpi.Comm(world))):
        for waitall in WAITALL_MODES:
            for kind in FORM_KINDS:
                for form in BUFFER_FORMS:
                    for size in FORM_SIZES:
                        got = bytes(run_form(comm, flavor, kind, form, size, waitall).recv)
                        assert got == expected(kind, rank, size), (flavor, waitall, kind, form, size)
                        world.Barrier()
    print(f"OK {rank}", flush=True)


@needs_mpiexec
def test_buffer_forms_under_mpiexec() -> None:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_bench; test_bench.mpi_forms_job()")
    out = mpi_job(["-c", code])
    assert "OK 0" in out and "OK 1" in out, out


@needs_mpiexec
def test_cli_mpi_series_with_buffer_forms_and_waitall(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    stdout = mpi_job(["-m", "cma.bench", "bw", "--transport", "cma.mpi", "--baseline", "mpi4py",
                      "--buffer", "numpy,spec", "--waitall", "mpi", "--max-size", "64",
                      "--iterations", "3", "--warmup", "1", "--window", "4", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert (doc["parameters"]["buffer"], doc["parameters"]["waitall"]) == (["numpy", "spec"], "mpi")
    assert [(s["name"], s["status"]) for s in doc["series"]] == [
        ("mpi4py[numpy]", "ok"), ("mpi4py[spec]", "ok"), ("cma.mpi[numpy]", "ok"),
        ("cma.mpi[spec]", "ok")]
    assert WAITALL_NOTE in stdout and "bw/mpi4py[numpy]" in stdout


@needs_mpiexec
@pytest.mark.parametrize("kind", ["bcast", "allreduce"])
def test_cli_mpi_object_collectives_in_either_order(tmp_path: Path, kind: str) -> None:
    """cma-bench bcast|allreduce --objects under mpiexec, cma.mpi's series timed first: both
    series come out, mpi4py's first in the report (the ratios' baseline)."""
    out = tmp_path / "out.json"
    stdout = mpi_job(["-m", "cma.bench", kind, "--objects", "--cma-first", "--min-size", "1K",
                      "--max-size", "64K", "--iterations", "3", "--warmup", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["objects"] and doc["cma_first"]
    assert [(s["name"], len(s["results"]), s["error"]) for s in doc["series"]] == [
        ("mpi4py", 7, ""), ("cma.mpi", 7, "")]
    assert f"{kind} (objects), 2 ranks" in stdout


@needs_mpiexec
@pytest.mark.parametrize("cma_first", [False, True])
def test_cli_mpi_collectives_interleaved_take_turns_size_by_size(tmp_path: Path,
                                                                 cma_first: bool) -> None:
    """cma-bench bcast --interleave --write under mpiexec: each size is timed through one
    library, then the other (cma.mpi first with --cma-first), before the next size; without
    --interleave one library's whole series comes first."""
    for interleave in (True, False):
        out = tmp_path / "out.json"
        mpi_job(["-m", "cma.bench", "bcast", "--write", "--min-size", "1K", "--max-size", "4K",
                 "--iterations", "3", "--warmup", "1", "--json", str(out)]
                + (["--interleave"] if interleave else []) + (["--cma-first"] if cma_first else []))
        doc = json.loads(out.read_text())
        assert doc["interleave"] == interleave and doc["write"]
        plain, ours = ([r["started"] for r in s["results"]] for s in doc["series"])
        first, second = (ours, plain) if cma_first else (plain, ours)
        turns = sorted([(t, 0) for t in first] + [(t, 1) for t in second])
        want = [0, 1] * 3 if interleave else [0] * 3 + [1] * 3
        assert [who for _, who in turns] == want, (interleave, doc["series"])


@needs_mpiexec
def test_cli_mpi_collectives_say_which_sizes_mpi_ran(tmp_path: Path) -> None:
    """cma-bench bcast under mpiexec, as users run cma.mpi (CMA_MPI_COLLECTIVES unset: by
    cma.mpi.routing's table): the report names the mode, and the copies table marks the
    sizes where cma moved nothing (MPI's collective ran) as such, by what was counted."""
    from cma.mpi import routing

    out = tmp_path / "out.json"
    stdout = mpi_job(["-m", "cma.bench", "bcast", "--min-size", "1K", "--max-size", "64K",
                      "--iterations", "3", "--warmup", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["collectives"] == "auto"
    assert "CMA_MPI_COLLECTIVES=auto" in stdout
    start, until = next(w for ranks, w in routing.WINDOWS["Bcast"] if ranks >= 2)
    ours = doc["series"][1]
    for result in ours["results"]:
        through_cma = start <= result["size"] < until
        assert (result["moved"] > 0) == through_cma, result
        row = next(line for line in stdout.splitlines()[stdout.splitlines().index(
            next(x for x in stdout.splitlines() if x.startswith("bytes copied"))):]
            if line.split()[:2] == format_size(result["size"]).split())
        assert ("via MPI" in row) != through_cma, row


def test_help_lists_every_pattern(capsys: pytest.CaptureFixture[str]) -> None:
    """``cma-bench --help`` names the collectives too (they are parsed apart, in collective.py)."""
    from cma.bench.cli import KINDS, main
    from cma.bench.collective import COLLECTIVES

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    for kind in (*KINDS, *COLLECTIVES):
        assert f"\n    {kind} " in shown, kind


FRESH_PAGES = """
import resource, sys
import numpy as np
from cma.bench.collective import settle_allocator
if sys.argv[1] == "settled":
    settle_allocator()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
for shift in range(18, 23):  # 256 KiB to 4 MiB, upwards as a benchmark's sizes go
    for _ in range(5):  # (two at once, as a received array and a sum of it)
        a = np.ones(1 << shift, np.uint8)
        b = a + a
        del a, b
print(faults() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc is what is settled")
def test_a_settled_allocator_reuses_the_heap_for_every_size_of_a_run() -> None:
    """Allocations of rising sizes, in a fresh interpreter with glibc's default malloc
    settings (MALLOC_* and GLIBC_TUNABLES fix the threshold, or add huge pages): glibc
    maps each one afresh (every page faulted in) unless a larger chunk was freed before,
    which is what settle_allocator does before a collective series is timed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    faults = {}
    for how in ("fresh", "settled"):
        proc = subprocess.run([sys.executable, "-c", FRESH_PAGES, how], capture_output=True,
                              text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        faults[how] = int(proc.stdout)
    pages = sum(2 * 5 * (1 << shift) // 4096 for shift in range(18, 23))
    assert faults["fresh"] > pages // 2  # (each array's pages, written as it is made)
    assert faults["settled"] < pages // 10

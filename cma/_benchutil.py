"""Pure helpers of ``cma-bench``: sizes, iteration counts, results, tables, crossovers, plots.

Nothing here starts a process or sends a message, so all of it is testable with fake
results; the measuring lives in ``cma.bench``.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import re
import shutil
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

KINDS = ("latency", "bw", "bibw")
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

# ---------------------------------------------------------------- sizes

_UNITS = {"": 1, "b": 1, "k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``8``, ``8B``, ``4K``, ``64KiB``, ``1M``, ``64MiB``, ``1G`` (units are binary)."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        # "KB"/"MB" are refused rather than guessed: decimal or binary is exactly what a
        # reader of the results would need to know.
        raise ValueError(
            f"bad size {text!r}: use a number with an optional binary unit "
            "K, KiB, M, MiB, G or GiB (4K = 4096)"
        )
    return int(match.group(1)) * _UNITS[unit]


def format_size(nbytes: int) -> str:
    """``8 B``, ``4 KiB``, ``64 MiB``; sizes that are not whole units keep bytes."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_range(min_size: int, max_size: int) -> list[int]:
    """The powers of two in ``[min_size, max_size]``."""
    if min_size < 1:
        raise ValueError("--min-size must be at least 1 byte")
    if max_size < min_size:
        raise ValueError(f"--max-size {max_size} is below --min-size {min_size}")
    size = 1 << (min_size - 1).bit_length()
    sizes = []
    while size <= max_size:
        sizes.append(size)
        size <<= 1
    if not sizes:
        raise ValueError(f"no power of two between {min_size} and {max_size}")
    return sizes


# ---------------------------------------------------------------- iteration counts


@dataclass(frozen=True)
class CountPolicy:
    """OSU-style iteration counts: many for small messages, few for large ones.

    ``byte_budget`` caps how many bytes one size may move (warm-up excluded), so large
    messages take about as long as small ones instead of dominating the run.
    """

    small_iterations: int
    small_warmup: int
    large_iterations: int
    large_warmup: int
    byte_budget: int
    min_iterations: int


# OSU switches to its "large" counts above 8 KiB.
LARGE_MESSAGE = 8 * KIB
POLICIES: dict[tuple[str, bool], CountPolicy] = {
    ("latency", False): CountPolicy(10_000, 1_000, 1_000, 100, 4 * GIB, 5),
    ("latency", True): CountPolicy(2_000, 200, 200, 20, 256 * MIB, 3),
    ("window", False): CountPolicy(100, 10, 20, 2, 16 * GIB, 3),
    ("window", True): CountPolicy(20, 2, 5, 1, 1 * GIB, 2),
}


def messages_per_sample(kind: str, window: int) -> int:
    """Payload messages in one timed sample: a round trip, a window, or a window each way."""
    if kind == "latency":
        return 2
    if kind == "bw":
        return window
    if kind == "bibw":
        return 2 * window
    if kind == "memcpy":
        return 1
    raise ValueError(f"unknown benchmark kind {kind!r}")


def counts_for(
    kind: str,
    size: int,
    *,
    window: int,
    quick: bool,
    iterations: int | None = None,
    warmup: int | None = None,
) -> tuple[int, int]:
    """(timed iterations, warm-up iterations) for one message size."""
    policy = POLICIES[("window" if kind in ("bw", "bibw") else "latency", quick)]
    if size <= LARGE_MESSAGE:
        iters, warm = policy.small_iterations, policy.small_warmup
    else:
        iters, warm = policy.large_iterations, policy.large_warmup
    per_iteration = size * messages_per_sample(kind, window)
    iters = min(iters, max(policy.min_iterations, policy.byte_budget // per_iteration))
    warm = min(warm, max(1, iters // 10))
    return (iterations if iterations is not None else iters,
            warmup if warmup is not None else warm)


# ---------------------------------------------------------------- results


@dataclass
class SizeResult:
    """Every timed sample of one message size, plus both processes' ``comm.stats()`` deltas.

    A run of several rounds (``cma-bench --rounds``) keeps every round's samples one after
    the other in ``samples_ns``, with ``samples_per_round`` saying where each round ends.
    """

    size: int
    iterations: int
    warmup: int
    messages_per_sample: int
    samples_ns: list[int]
    stats: list[dict[str, dict[str, float]]] = field(default_factory=list)
    samples_per_round: list[int] = field(default_factory=list)
    # cma-bench --guard: seconds spent waiting for a quiet machine, every probe's ratio
    # (cma.bench.handoff_ratio) and the mean time per message of every timed loop redone
    waited_s: float = 0.0
    probes: list[float] = field(default_factory=list)
    redone_us: list[float] = field(default_factory=list)

    def per_message_us(self) -> list[float]:
        return [ns / self.messages_per_sample / 1e3 for ns in self.samples_ns]

    @property
    def mean_us(self) -> float:
        return statistics.fmean(self.per_message_us())

    @property
    def stdev_us(self) -> float:
        values = self.per_message_us()
        return statistics.stdev(values) if len(values) > 1 else 0.0

    @property
    def sem_us(self) -> float:
        """Standard error of ``mean_us``."""
        return self.stdev_us / math.sqrt(len(self.samples_ns))

    def round_means_us(self) -> list[float]:
        """Each round's mean time per message, in the order the rounds ran."""
        values = self.per_message_us()
        means, start = [], 0
        for count in self.samples_per_round or [len(values)]:
            means.append(statistics.fmean(values[start:start + count]))
            start += count
        return means

    @property
    def time_us(self) -> float:
        """The reported time per message: the mean, or over rounds the median of their means.

        A slow spell of the machine lasts seconds to a minute and slows every sample in
        it, so it shifts whole rounds; the median of the rounds' means leaves a minority
        of slowed rounds out where the mean of all samples would take them in.
        """
        means = self.round_means_us()
        return statistics.median(means) if len(means) > 1 else self.mean_us

    @property
    def time_sem_us(self) -> float:
        """The uncertainty of ``time_us``: from the spread of the round means when there
        are several rounds, as rounds differ far more than samples inside one round."""
        means = self.round_means_us()
        if len(means) > 1:
            return statistics.stdev(means) / math.sqrt(len(means))
        return self.sem_us

    @property
    def bandwidth_mbps(self) -> float:
        """Payload bytes per second of one message at ``time_us``, in MB/s (10^6 B/s)."""
        return self.size / self.time_us

    def summary(self) -> dict[str, float | int | list[float]]:
        values = self.per_message_us()
        summary: dict[str, float | int | list[float]] = {
            "time_us_mean": self.mean_us,
            "time_us_median": statistics.median(values),
            "time_us_min": min(values),
            "time_us_stdev": self.stdev_us,
            "bandwidth_MBps": self.bandwidth_mbps,
        }
        if len(self.samples_per_round) > 1:
            summary["time_us_round_means"] = self.round_means_us()
            summary["time_us_median_of_rounds"] = self.time_us
        return summary


def merge_rounds(rounds: Sequence[SizeResult]) -> SizeResult:
    """One size's results from several rounds as one result that remembers its rounds."""
    first = rounds[0]
    if any(r.size != first.size or r.messages_per_sample != first.messages_per_sample
           for r in rounds):
        raise ValueError("rounds of different sizes or kinds cannot be merged")
    return SizeResult(
        size=first.size,
        iterations=sum(r.iterations for r in rounds),
        warmup=first.warmup,
        messages_per_sample=first.messages_per_sample,
        samples_ns=[ns for r in rounds for ns in r.samples_ns],
        # copy_summary adds every process's counters, so the rounds' lists simply join
        stats=[side for r in rounds for side in r.stats],
        samples_per_round=[len(r.samples_ns) for r in rounds],
        waited_s=sum(r.waited_s for r in rounds),
        probes=[ratio for r in rounds for ratio in r.probes],
        redone_us=[mean for r in rounds for mean in r.redone_us],
    )


@dataclass
class Series:
    """One line of the comparison: a transport or a baseline, over all sizes of a run."""

    name: str
    family: str  # "baseline" or "transport"
    status: str = "ok"  # "ok", "unavailable", "skipped" or "failed"
    reason: str = ""
    results: list[SizeResult] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole series, peer start-up included
    buffer: str | None = None  # the --buffer form it sent; None: a series that ignores it


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


def merge_series(runs: Sequence[Series]) -> Series:
    """One series measured in several rounds, as one series.

    A round that did not end ``ok`` decides the status, and then no results are kept:
    the median of a subset of rounds would look as solid as one over all of them.
    """
    first = runs[0]
    merged = Series(first.name, first.family, seconds=sum(r.seconds for r in runs),
                    buffer=first.buffer)
    broken = next((r for r in runs if r.status != "ok"), None)
    if broken is not None:
        merged.status = broken.status
        merged.reason = (broken.reason if len(runs) == 1
                         else f"round {runs.index(broken) + 1}: {broken.reason}")
        return merged
    by_size: dict[int, list[SizeResult]] = {}
    for run in runs:
        for result in run.results:
            by_size.setdefault(result.size, []).append(result)
    merged.results = [merge_rounds(rounds) for rounds in by_size.values()]
    return merged


# ---------------------------------------------------------------- copy counts


@dataclass(frozen=True)
class CopySummary:
    """Copies per payload message from measured counters, both processes added together."""

    via: tuple[str, ...]
    user: float
    kernel: float
    syscalls: float
    copied_bytes: float


def copy_summary(
    sides: Sequence[Mapping[str, Mapping[str, float]]], messages: int, size: int
) -> CopySummary | None:
    """Sum both processes' stats deltas and divide by the payload the benchmark sent.

    ``user_copies``/``kernel_copies`` are copy-bytes over payload-bytes *of that process*,
    so each side's copy-bytes are rebuilt as ratio × its bytes before adding: that stays
    right whether a message is counted by its sender, its receiver or both. Control
    traffic of the timed loop (a bw run's acks, rendezvous handshakes) is included, as
    it is part of what the transport costs.
    """
    if not sides or messages == 0 or size == 0:
        return None
    user = kernel = syscalls = 0.0
    carried: dict[str, float] = {}
    for side in sides:
        for mechanism, counters in side.items():
            nbytes = float(counters.get("bytes", 0))
            user += float(counters.get("user_copies", 0.0)) * nbytes
            kernel += float(counters.get("kernel_copies", 0.0)) * nbytes
            syscalls += float(counters.get("syscalls", 0))
            if nbytes or counters.get("messages", 0):
                carried[mechanism] = carried.get(mechanism, 0.0) + nbytes
    payload = float(messages) * size
    return CopySummary(
        via=tuple(sorted(carried, key=lambda m: -carried[m])),
        user=user / payload,
        kernel=kernel / payload,
        syscalls=syscalls / messages,
        copied_bytes=(user + kernel) / messages,
    )


def result_copies(result: SizeResult) -> CopySummary | None:
    return copy_summary(result.stats, result.iterations * result.messages_per_sample, result.size)


# ---------------------------------------------------------------- crossovers


@dataclass(frozen=True)
class Crossover:
    """Who is faster first (from size ``since``), and where (if ever) the other one overtakes."""

    first: str
    second: str
    leader: str
    since: int
    overtaker: str | None
    at: int | None
    changes: int


def crossovers(
    times: Mapping[str, Mapping[int, float]],
    errors: Mapping[str, Mapping[int, float]] | None = None,
) -> list[Crossover]:
    """For each pair of series (time per message by size, lower is better) the first overtaking.

    With ``errors`` (standard error of each mean), a difference within two combined
    standard errors is a tie: transports sharing one code path at a size (every eager
    message) then do not "overtake" each other back and forth on noise. ``changes``
    counts every change of leader that remains. A pair never apart is not reported.
    """
    names = list(times)
    found = []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            leader: str | None = None
            current: str | None = None
            since = 0
            overtaker: str | None = None
            at: int | None = None
            changes = 0
            for size in sorted(set(times[first]) & set(times[second])):
                a, b = times[first][size], times[second][size]
                margin = 0.0
                if errors is not None:
                    margin = 2 * math.hypot(errors[first][size], errors[second][size])
                if abs(a - b) <= margin:
                    continue
                faster = first if a < b else second
                if leader is None:
                    leader, since = faster, size
                elif faster != current:
                    changes += 1
                    if overtaker is None:
                        overtaker, at = faster, size
                current = faster
            if leader is not None:
                found.append(Crossover(first, second, leader, since, overtaker, at, changes))
    return found


def format_crossovers(found: Iterable[Crossover]) -> str:
    lines = []
    for c in found:
        other = c.second if c.leader == c.first else c.first
        head = f"{c.first} vs {c.second}: {c.leader} faster from {format_size(c.since)}"
        if c.at is None:
            lines.append(f"{head}, {other} never overtakes")
            continue
        line = f"{head}, {c.overtaker} overtakes at {format_size(c.at)}"
        if c.changes > 1:
            line += f" (the lead changes {c.changes} times)"
        lines.append(line)
    return "\n".join(lines)


def compared_series(series: Sequence[Series]) -> tuple[dict[str, dict[int, float]],
                                                         dict[str, dict[int, float]]]:
    """Reported times and their standard errors for the series a crossover report compares
    (not memcpy)."""
    chosen = [s for s in series if s.status == "ok" and s.results and s.name != "memcpy"]
    return ({s.name: {r.size: r.time_us for r in s.results} for s in chosen},
            {s.name: {r.size: r.time_sem_us for r in s.results} for s in chosen})


# ---------------------------------------------------------------- tables


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 0) -> str:
    """Plain aligned columns; the first ``left`` columns are left-aligned, numbers right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def format_number(value: float) -> str:
    """Three or more significant digits without scientific notation."""
    if value != value:  # NaN
        return "-"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def base_name(name: str) -> str:
    """A series' name without the ``[form]`` of ``cma-bench --buffer``: ``mpi4py[spec]`` -> ``mpi4py``."""
    return name.partition("[")[0]


def reference_baseline(series: Sequence[Series]) -> Series | None:
    """The baseline a user would otherwise pick: mpi4py when measured, else multiprocessing.Pipe;
    of several buffer forms, the first one listed."""
    ok = [s for s in series if s.status == "ok" and s.results]
    for wanted in ("mpi4py", "mp-pipe"):
        found = next((s for s in ok if base_name(s.name) == wanted), None)
        if found is not None:
            return found
    return None


def _ok(series: Sequence[Series], name: str) -> Series | None:
    return next((s for s in series if s.name == name and s.status == "ok"), None)


TIME_MEANING = {
    "latency": "one-way time per message = round trip / 2",
    "bw": "time per message = window time / window (64 Isends then a 1-byte ack)",
    "bibw": "time per message = window time / (2 x window), both directions at once",
}


def rounds_of(series: Sequence[Series]) -> int:
    """How many rounds the results hold (1 for a run without ``--rounds``)."""
    return max((len(r.samples_per_round) for s in series for r in s.results), default=1) or 1


def format_results(kind: str, series: Sequence[Series]) -> str:
    """The main table: time, bandwidth and ratios for every series at every size."""
    memcpy = _ok(series, "memcpy")
    ref = reference_baseline(series)
    mem_bw = {r.size: r.bandwidth_mbps for r in memcpy.results} if memcpy else {}
    ref_bw = {r.size: r.bandwidth_mbps for r in ref.results} if ref else {}
    ref_col = f"bw/{ref.name}" if ref else "bw/baseline"
    rounds = rounds_of(series)
    headers = ["size", "series", "time us", "MB/s", "bw/memcpy", ref_col, "+/- us", "iters"]
    if rounds > 1:
        headers.append("round means us")
    rows: list[list[str]] = []
    sizes = sorted({r.size for s in series for r in s.results})
    for size in sizes:
        first = True
        for s in series:
            result = next((r for r in s.results if r.size == size), None)
            if result is None:
                continue
            bw = result.bandwidth_mbps
            row = [
                format_size(size) if first else "",
                s.name,
                format_number(result.time_us),
                format_number(bw),
                format_number(bw / mem_bw[size]) if size in mem_bw else "-",
                format_number(bw / ref_bw[size]) if size in ref_bw else "-",
                format_number(result.stdev_us),
                str(result.iterations),
            ]
            if rounds > 1:
                row.append(" ".join(format_number(m) for m in result.round_means_us()))
            rows.append(row)
            first = False
    if rounds > 1:
        statistic = (f"median over {rounds} rounds of each round's mean (rounds in the order "
                     "they ran; +/- is the standard deviation of all samples)")
    else:
        statistic = "mean over the timed iterations"
    title = (
        f"cma-bench {kind}: {TIME_MEANING[kind]}; {statistic}\n"
        "MB/s = size / time (10^6 bytes/s); bw/X = bandwidth / X's bandwidth\n"
        "memcpy = np.copyto inside one process (the ceiling)"
    )
    return title + "\n" + render_table(headers, rows, left=2)


def format_copies(series: Sequence[Series]) -> str:
    """Measured copies per message, from both processes' ``comm.stats()`` over the timed loop."""
    rows = []
    for s in series:
        for r in s.results:
            c = result_copies(r)
            if c is None:
                continue
            rows.append([
                s.name, format_size(r.size), "+".join(c.via) or "-",
                f"{c.user:.2f}", f"{c.kernel:.2f}", f"{c.user + c.kernel:.2f}",
                f"{c.syscalls:.2f}", f"{c.copied_bytes:.0f}",
            ])
    if not rows:
        return ""
    title = ("copies per payload byte (user, kernel) and syscalls per message, measured:\n"
             "sender's + receiver's comm.stats() over the timed loop")
    headers = ["series", "size", "via", "user", "kernel", "total", "syscalls/msg",
               "bytes copied/msg"]
    return title + "\n" + render_table(headers, rows, left=3)


def mpi4py_header() -> str:
    """The two header lines of ``python -m mpi4py.bench pingpong`` (mpi4py 4.x)."""
    return ("# MPI PingPong Test\n"
            "# Size [B]  Bandwidth [MB/s] | Time Mean [s] \u00b1 StdDev [s]  Samples")


def mpi4py_row(nbytes: int, mean_s: float, stdev_s: float, samples: int) -> str:
    """One row in ``python -m mpi4py.bench pingpong``'s column format."""
    bandwidth = nbytes / mean_s
    return f"{nbytes:10d}{bandwidth / 1e6:18.2f} | {mean_s:.7e} \u00b1 {stdev_s:.4e} {samples:8d}"


def format_mpi4py(series: Sequence[Series]) -> str:
    """One mpi4py-style block per series, each preceded by a comment line naming it."""
    blocks = []
    for s in series:
        if s.status != "ok" or not s.results:
            continue
        rows = [mpi4py_row(r.size, r.time_us / 1e6, r.stdev_us / 1e6, r.iterations)
                for r in s.results]
        blocks.append("\n".join([f"# cma-bench series: {s.name}", mpi4py_header(), *rows]))
    return "\n".join(blocks)


def format_guard(series: Sequence[Series], shown: int = 12) -> str:
    """What ``--guard`` did: the waits for a quiet machine and the timed loops it redid."""
    loops = [r for s in series for r in s.results if r.probes]
    if not loops:
        return ""
    waits = [r for r in loops if r.waited_s > 0]
    lines = [f"{len(loops)} sizes probed (each series' own, rounds together); waited "
             f"{sum(r.waited_s for r in loops):.0f} s in all for a quiet machine before "
             f"{len(waits)} of them; slowest probe "
             f"{max(ratio for r in loops for ratio in r.probes):.2f}x"]
    redone = [(s.name, r) for s in series for r in s.results if r.redone_us]
    if redone:
        count = sum(len(r.redone_us) for _, r in redone)
        lines.append(f"redone after a slow probe: {count} timed loop{'s' if count > 1 else ''} "
                     "(the means left out, then the time kept):")
        for name, r in redone[:shown]:
            dropped = ", ".join(f"{us:.2f}" for us in r.redone_us)
            lines.append(f"  {name} {format_size(r.size)}: {dropped} -> {r.time_us:.2f} us")
        if len(redone) > shown:
            lines.append(f"  ... and {len(redone) - shown} more sizes (all in the JSON)")
    return "\n".join(lines)


def format_notes(series: Sequence[Series]) -> str:
    return "\n".join(f"{s.name}: {s.status}: {s.reason}" for s in series if s.status != "ok")


# ---------------------------------------------------------------- JSON


def series_json(series: Series) -> dict[str, object]:
    results = []
    for r in series.results:
        copies = result_copies(r)
        results.append({
            "size": r.size,
            "iterations": r.iterations,
            "warmup": r.warmup,
            "messages_per_sample": r.messages_per_sample,
            **r.summary(),
            "copies": None if copies is None else {
                "via": list(copies.via), "user": copies.user, "kernel": copies.kernel,
                "syscalls_per_message": copies.syscalls,
                "bytes_copied_per_message": copies.copied_bytes,
            },
            "stats": r.stats,
            "samples_ns": r.samples_ns,
            "samples_per_round": r.samples_per_round or [len(r.samples_ns)],
            "guard": {"waited_s": r.waited_s, "probes": r.probes, "redone_us": r.redone_us},
        })
    return {"name": series.name, "family": series.family, "buffer": series.buffer,
            "status": series.status, "reason": series.reason, "seconds": series.seconds,
            "results": results}


def _read_first(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model() -> str:
    for line in (_read_first("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Processor", "cpu model"):
            return value.strip()
    return platform.processor() or "unknown"


def machine_info() -> dict[str, object]:
    """What a reader needs to compare two result files; MPI is described only if already in use."""
    import numpy

    try:
        cma_version = importlib.metadata.version("cma-ipc")
    except importlib.metadata.PackageNotFoundError:
        cma_version = "unknown"
    info: dict[str, object] = {
        "platform": platform.platform(),
        "kernel": os.uname().release,
        "machine": os.uname().machine,
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": numpy.__version__,
        "cma": cma_version,
        "transparent_hugepage": _read_first("/sys/kernel/mm/transparent_hugepage/enabled"),
        "yama_ptrace_scope": _read_first("/proc/sys/kernel/yama/ptrace_scope"),
    }
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        import mpi4py

        info["mpi4py"] = mpi4py.__version__
        info["mpi_library"] = mpi.Get_library_version().splitlines()[0].strip()
        info["mpi_version"] = "{}.{}".format(*mpi.Get_version())
    return info


# ---------------------------------------------------------------- progress and plots


class Progress:
    """A one-line ``\\r`` status on a terminal, shown only once the run has taken ``delay`` s."""

    def __init__(self, stream: TextIO = sys.stderr, delay: float = 2.0) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.delay = delay
        self.start = time.monotonic()
        self.shown = 0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        if elapsed < self.delay:
            return
        width = shutil.get_terminal_size().columns - 1
        line = f"{text}  [{elapsed:.0f} s]"[:width]
        self.stream.write("\r" + line.ljust(self.shown))
        self.stream.flush()
        self.shown = len(line)

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0


def plot(kind: str, series: Sequence[Series], path: str) -> None:
    """Time and bandwidth against size on log axes, one line per series, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in series:
        if s.status != "ok" or not s.results:
            continue
        sizes = [r.size for r in s.results]
        style = "--" if s.family == "baseline" else "-"
        ax_time.plot(sizes, [r.time_us for r in s.results], style, marker=".", label=s.name)
        ax_bw.plot(sizes, [r.bandwidth_mbps for r in s.results], style, marker=".",
                   label=s.name)
    ax_time.set_ylabel("time per message (us)")
    ax_bw.set_ylabel("bandwidth (MB/s)")
    for ax in (ax_time, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"cma-bench {kind}: {TIME_MEANING[kind]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

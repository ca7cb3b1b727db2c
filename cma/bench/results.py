"""What ``cma-bench`` measured: every sample of a size (``SizeResult``), a series over all
sizes (``Series``), rounds and series merged, copies per message from the counters, who
overtakes whom (crossovers), and the JSON of a series with the machine it ran on.

Nothing here starts a process or sends a message, so all of it is testable with fake
results.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
    # (cma.bench.guard.handoff_ratio) and the mean time per message of every timed loop redone
    waited_s: float = 0.0
    probes: list[float] = field(default_factory=list)
    redone_us: list[float] = field(default_factory=list)

    def per_message_us(self) -> list[float]:
        """Each sample's time per message, in microseconds."""
        return [ns / self.messages_per_sample / 1e3 for ns in self.samples_ns]

    @property
    def mean_us(self) -> float:
        """The mean of ``per_message_us``."""
        return statistics.fmean(self.per_message_us())

    @property
    def stdev_us(self) -> float:
        """The standard deviation of ``per_message_us`` (0 for one sample)."""
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
        """The figures the JSON report keeps for this size."""
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


def compared_series(series: Sequence[Series]) -> tuple[dict[str, dict[int, float]],
                                                         dict[str, dict[int, float]]]:
    """Reported times and their standard errors for the series a crossover report compares
    (not memcpy)."""
    chosen = [s for s in series if s.status == "ok" and s.results
              and s.name not in ("memcpy", "memcpy2")]
    return ({s.name: {r.size: r.time_us for r in s.results} for s in chosen},
            {s.name: {r.size: r.time_sem_us for r in s.results} for s in chosen})


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

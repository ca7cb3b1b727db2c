"""``cma-bench``'s output: the tables (time, bandwidth, copies), the mpi4py-style rows,
crossovers, what ``--guard`` did, the progress line and the plot."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TextIO

from .results import Crossover, Series, result_copies
from .sizes import format_size

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
        """Show ``text`` (and the time so far) in place of the last status, once ``delay`` has passed."""
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
        """Erase the status line, if one is shown."""
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

"""cma against mpi4py + MPICH as the ranks grow: memory, fds, start-up and all-to-all times.

For each N it starts bench/scale_rank.py as N ranks twice, under ``cma-run -n N`` and under
``mpiexec -n N`` (plain mpi4py), alternating which goes first from one N to the next so that
what one job leaves on the machine does not always favour the same library. Per N and
library it reports:

- ready: seconds until the library can send (``cma.COMM_WORLD.attach()``; ``from mpi4py
  import MPI``, which runs MPI_Init), the slowest rank, and "attach" the same without
  importing cma (numpy is imported before either);
- fds and shared memory mapped per rank right after that, before any message (cma
  connects a peer on first use), mean over ranks;
- shared memory per rank, mapped and resident (shared mappings in /proc/self/smaps),
  mean over ranks, after a first barrier and after the traffic below;
- fds per rank after the traffic, mean over ranks;
- an 8 B and a large all-to-all (pairwise Sendrecv rounds; ``--alltoall-bytes`` per pair,
  1 MiB by default: each rank holds two buffers of N times that, 32 GiB in all at 128
  ranks) and a 64 KiB ring exchange:
  seconds per iteration, the slowest rank;
- shm growth: the machine's Shmem (/proc/meminfo) after the large all-to-all minus before;
- the same growth, and shared memory resident per rank, after a quiet spell that follows
  (every rank waits 2.5 s in the library: cma hands back its quiet rings' pages).

Run (from the repository root, with cma-ipc, mpi4py and an ``mpiexec`` installed)::

    python3 bench/scale.py --ranks 2 4 8 16 32 64 --json docs/figures/scale.json \
        --plot docs/figures/scale.png > docs/figures/scale.txt

Each job has ``--timeout`` seconds (default 900); one that fails or times out is
reported as such and the others go on.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import cma
from cma.bench.sizes import parse_size

RANK_PROGRAM = Path(__file__).with_name("scale_rank.py")
MiB = 1 << 20


def iterations(ranks: int) -> tuple[int, int]:
    """(large all-to-all, small patterns) iterations: fewer as N grows, so a run stays minutes."""
    return max(1, 8 // ranks), max(2, 256 // ranks)


def command(lib: str, ranks: int, block: int) -> list[str]:
    big, small = iterations(ranks)
    program = [sys.executable, str(RANK_PROGRAM), lib, str(big), str(small), str(block)]
    if lib == "cma":
        return [sys.executable, "-m", "cma.run", "-n", str(ranks), *program]
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("no mpiexec on PATH (pip install mpi4py mpich)")
    return [mpiexec, "-n", str(ranks), *program]


def run(lib: str, ranks: int, timeout: float, block: int) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        done = subprocess.run(command(lib, ranks, block), capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"lib": lib, "ranks": ranks, "failed": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"lib": lib, "ranks": ranks, "failed": f"exit {done.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["wall_s"] = wall
    result["alltoall_bytes"] = block
    return result


def summary(result: dict[str, Any]) -> dict[str, float]:
    per_rank = result["per_rank"]

    def mean(key: str) -> float:
        return sum(r[key] for r in per_rank) / len(per_rank)

    def slowest(key: str) -> float:
        return max(r[key] for r in per_rank)

    return {
        "ready_s": slowest("ready_s"),
        "attach_s": slowest("attach_s"),
        "fds_attached": mean("fds_attached"),
        "mapped_attached_MiB": mean("mapped_attached") / MiB,
        "mapped_MiB": mean("mapped") / MiB,
        "resident_MiB": mean("resident") / MiB,
        "mapped_after_MiB": mean("mapped_after") / MiB,
        "resident_after_MiB": mean("resident_after") / MiB,
        "fds": mean("fds_after"),
        "alltoall_8B_ms": slowest("alltoall_8B_s") * 1e3,
        "alltoall_8B_steady_ms": slowest("alltoall_8B_steady_s") * 1e3,
        "alltoall_8B_steady_cpu_ms": mean("alltoall_8B_steady_cpu_s") * 1e3,
        "alltoall_8B_steady_preempted": mean("alltoall_8B_steady_preempted"),
        "alltoall_big_ms": slowest("alltoall_big_s") * 1e3,
        "ring_64KiB_ms": slowest("ring_64KiB_s") * 1e3,
        "shm_growth_MiB": per_rank[0]["shmem_growth"] / MiB,
        "shm_growth_quiet_MiB": per_rank[0]["shmem_growth_quiet"] / MiB,
        "resident_quiet_MiB": mean("resident_quiet") / MiB,
    }


COLUMNS = [("ready_s", "ready s", "{:.2f}"), ("attach_s", "attach s", "{:.3f}"),
           ("fds_attached", "fds attached", "{:.0f}"),
           ("mapped_attached_MiB", "mapped attached", "{:.1f}"), ("mapped_MiB", "mapped MiB", "{:.0f}"),
           ("resident_MiB", "resident MiB", "{:.1f}"), ("mapped_after_MiB", "mapped after", "{:.0f}"),
           ("resident_after_MiB", "resident after", "{:.1f}"), ("fds", "fds", "{:.0f}"),
           ("alltoall_8B_ms", "a2a 8B ms", "{:.2f}"),
           ("alltoall_8B_steady_ms", "a2a 8B again ms", "{:.2f}"),
           ("alltoall_8B_steady_cpu_ms", "its CPU ms/rank", "{:.2f}"),
           ("alltoall_8B_steady_preempted", "preempted/rank", "{:.0f}"),
           ("alltoall_big_ms", "a2a big ms", "{:.1f}"),
           ("shm_growth_MiB", "shm growth MiB", "{:.0f}"), ("ring_64KiB_ms", "ring 64KiB ms", "{:.3f}"),
           ("shm_growth_quiet_MiB", "growth after quiet", "{:.0f}"),
           ("resident_quiet_MiB", "resident after quiet", "{:.1f}")]


def table(results: list[dict[str, Any]]) -> str:
    head = ["N", "library", *[title for _, title, _ in COLUMNS]]
    rows = [head]
    for result in results:
        row = [str(result["ranks"]), result["lib"]]
        if "failed" in result:
            row.append("FAILED: " + result["failed"])
        else:
            figures = summary(result)
            row += [fmt.format(figures[key]) for key, _, fmt in COLUMNS]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)) for r in rows)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for lib, style in (("cma", "o-"), ("mpi", "s--")):
        done = [r for r in results if r["lib"] == lib and "failed" not in r]
        ns = [r["ranks"] for r in done]
        figs = [summary(r) for r in done]
        label = "cma" if lib == "cma" else "mpi4py + MPICH"
        # (after the traffic, which connects every pair: cma's largest figure)
        axes[0].plot(ns, [f["mapped_after_MiB"] for f in figs], style,
                     label=f"{label}, mapped after traffic")
        axes[0].plot(ns, [f["resident_after_MiB"] for f in figs], style, alpha=0.5,
                     label=f"{label}, resident after traffic")
        axes[1].plot(ns, [f["ready_s"] for f in figs], style, label=label)
        axes[2].plot(ns, [f["alltoall_8B_steady_ms"] for f in figs], style, label=label)
        axes[3].plot(ns, [f["alltoall_big_ms"] for f in figs], style, label=label)
    titles = ["shared memory per rank (MiB)", "ready (s)", "8 B all-to-all, again (ms)",
              "large all-to-all (ms)"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--libs", nargs="+", default=["cma", "mpi"], choices=["cma", "mpi"])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write every rank's figures here")
    parser.add_argument("--alltoall-bytes", type=parse_size, default=MiB,
                        help="bytes per pair in the large all-to-all (default 1 MiB; 'a2a big' "
                             "in the table)")
    parser.add_argument("--plot", help="write a PNG of memory, ready time and large all-to-all")
    args = parser.parse_args()
    # Ranks import cma from bytecode, as from an installed package (pip compiles it): where
    # PYTHONDONTWRITEBYTECODE is set and cma is a checkout, every rank would compile its
    # sources again (~130 ms of CPU each here, 4 s of a 64-rank start on 2 CPUs).
    compileall.compile_dir(str(Path(cma.__file__).parent), quiet=1)
    results = []
    for index, ranks in enumerate(args.ranks):
        order = args.libs if index % 2 == 0 else args.libs[::-1]
        for lib in order:
            results.append(run(lib, ranks, args.timeout, args.alltoall_bytes))
            print(f"# N={ranks} {lib}: " + ("FAILED " + results[-1]["failed"] if "failed" in results[-1]
                  else f"{results[-1]['wall_s']:.1f} s"), file=sys.stderr, flush=True)
    results.sort(key=lambda r: (r["ranks"], r["lib"]))
    print(f"# {' '.join(sys.argv)}  (a2a big: {args.alltoall_bytes} bytes per pair; "
          f"load average at the end: {os.getloadavg()[0]:.2f})")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

"""The ``cma-bench`` command: its arguments, the report it prints, its JSON, and ``main``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

from .collective import COLLECTIVES
from .collective import main as collective_main
from .endpoints import WAITALL_MODES
from .guard import QUIET_RATIO
from .kernels import BUFFER_FORMS, BUFFER_KINDS, COLD_WINDOW_LIMIT, Plan, build_plan
from .report import (
    Progress,
    format_copies,
    format_crossovers,
    format_guard,
    format_mpi4py,
    format_notes,
    format_results,
    plot,
)
from .results import Series, compared_series, crossovers, machine_info, merge_series, series_json
from .runners import bind_cpus, bound_cpus, mpi_world
from .schedule import BASELINES, DEFAULT_BASELINES, run_schedule, schedule, select_series
from .sizes import KINDS, MIB, format_size, parse_size, size_range

# ---------------------------------------------------------------- command line


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_arg(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def _forms_arg(text: str) -> list[str]:
    forms = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [form for form in forms if form not in BUFFER_FORMS]
    if unknown or not forms:
        raise argparse.ArgumentTypeError(
            f"unknown buffer form {', '.join(map(repr, unknown)) or repr(text)}: choose one or "
            f"more, comma-separated, of {', '.join(BUFFER_FORMS)}")
    return forms


DEFAULT_MAX_SIZE = {"latency": 64 * MIB, "bw": 4 * MIB, "bibw": 4 * MIB}
KIND_HELP = {
    "latency": "blocking ping-pong; one-way time = round trip / 2 (osu_latency)",
    "bw": "a window of Isends then a 1-byte ack; the receiver posts Irecvs (osu_bw)",
    "bibw": "both ranks post a window of Irecvs and Isends at once (osu_bibw)",
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--transport", default="all", metavar="LIST",
        help="comma-separated cma transports (shm,cma,vmfd,auto; cma.mpi under mpiexec), "
             "'all' (every transport registered here, plus auto) or 'none' (default: all)")
    common.add_argument(
        "--baseline", default=",".join(DEFAULT_BASELINES), metavar="LIST",
        help="comma-separated baselines: memcpy (np.copyto in one process), mp-pipe "
             "(multiprocessing.Pipe), mpi4py (only under mpiexec), memcpy2 (np.copyto "
             f"by two threads, the copy ceiling of xmap), or 'none' (default: "
             f"{','.join(DEFAULT_BASELINES)}; choices: {','.join(BASELINES)})")
    common.add_argument("--min-size", type=_size_arg, default=8, metavar="SIZE",
                        help="smallest message, e.g. 8, 4K, 64KiB, 1M (units binary; default 8)")
    common.add_argument("--max-size", type=_size_arg, default=None, metavar="SIZE",
                        help="largest message (default 64MiB for latency, 4MiB for bw/bibw)")
    common.add_argument("--iterations", type=_count_arg(1), metavar="N",
                        help="timed iterations at every size, in each round (default: by size class, "
                             "OSU style)")
    common.add_argument("--warmup", type=_count_arg(0), metavar="N",
                        help="untimed warm-up iterations at every size, in each round")
    common.add_argument("--quick", action="store_true",
                        help="about 5-10x fewer iterations: a short but noisier run")
    common.add_argument("--cold", action="store_true",
                        help="a never-touched receive buffer every iteration, so first-touch "
                             "page faults are measured (default: warm, reused buffers)")
    common.add_argument("--recv-view", action="store_true",
                        help="latency only: receive with recv_view, released at once (the "
                             "xmap series: no copy, the sender's Send returns after the "
                             "release; other series: the view of a fresh copy)")
    common.add_argument("--window", type=_count_arg(1), default=64, metavar="N",
                        help="messages in flight per iteration for bw and bibw (default 64)")
    common.add_argument("--json", metavar="FILE",
                        help="write every sample, the parameters and the machine to FILE")
    common.add_argument("--plot", metavar="FILE.png",
                        help="draw time and bandwidth against size (needs matplotlib)")
    common.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each process to its own CPU, as OSU runs are bound "
                             "(default: on when there are 2 or more CPUs)")
    common.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="pause between series (default 0; --guard is the better "
                             "defence against a machine's slow spells)")
    common.add_argument("--guard", type=float, default=0.0, metavar="SECONDS",
                        help="before every timed loop, wait up to SECONDS until a probe "
                             "finds the two CPUs handing data to each other at their usual "
                             "speed, and redo a loop (at most twice) when the probe after "
                             "it does not; every wait and redone loop is reported (default "
                             "0: off; needs 2 CPUs and, under mpiexec, 2 ranks)")
    common.add_argument("--rounds", type=_count_arg(1), default=1, metavar="N",
                        help="run every series N times, in turn, each round in another "
                             "order (no series always first or always after the same "
                             "one); each size then reports the median of its N "
                             "round means, so a slow spell of the machine that hits one "
                             "round does not decide a ratio (default 1; the run takes N "
                             "times as long)")
    common.add_argument("--interleave", action="store_true",
                        help="measure every series at one size (in every round) before "
                             "the next size, all their peer processes alive at once, "
                             "instead of one series over all sizes after another: series "
                             "compared at a size then share the machine's slow spells "
                             "(default off)")
    common.add_argument("--format", choices=("table", "mpi4py"), default="table",
                        help="'mpi4py' prints rows like python -m mpi4py.bench pingpong")
    buffer_option = argparse.ArgumentParser(add_help=False)
    buffer_option.add_argument(
        "--buffer", type=_forms_arg, default=["numpy"], metavar="FORMS",
        help="what is passed to Send/Recv/Isend/Irecv: "
             + "; ".join(f"{form}: {meaning}" for form, meaning in BUFFER_FORMS.items())
             + ". Comma-separated: one series per form, named like cma.mpi[spec] (numpy "
             "alone keeps the plain names). Used by the cma transports, cma.mpi and "
             "mpi4py; memcpy and mp-pipe ignore it (default: numpy)")
    waitall_option = argparse.ArgumentParser(add_help=False)
    waitall_option.add_argument(
        "--waitall", choices=WAITALL_MODES, default="each",
        help="how cma.mpi waits for a window: each (Wait on every request in turn) or mpi "
             "(MPI.Request.Waitall on the list, in C, as mpi4py programs do). Ignored by "
             "the series without MPI: cma transports and mp-pipe wait on each request; "
             "the mpi4py baseline always uses MPI.Request.Waitall (default: each)")
    parser = argparse.ArgumentParser(
        prog="cma-bench",
        description="Latency and bandwidth of cma's transports beside memcpy, "
                    "multiprocessing.Pipe and (under mpiexec) mpi4py. Without a subcommand: "
                    "latency --quick over every transport, 8 B to 64 MiB.")
    sub = parser.add_subparsers(dest="kind", metavar="{" + ",".join([*KINDS, *COLLECTIVES]) + "}")
    for kind in KINDS:
        parents = [common]
        if kind in BUFFER_KINDS:
            parents.append(buffer_option)
        if kind == "bw":
            parents.append(waitall_option)
        kind_parser = sub.add_parser(kind, parents=parents, help=KIND_HELP[kind],
                                     description=KIND_HELP[kind])
        kind_parser.set_defaults(buffer=["numpy"], waitall="each")
    for kind, what in COLLECTIVES.items():  # (listed for --help: main() hands them to collective.py)
        sub.add_parser(kind, help=what, add_help=False)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["latency", "--quick", *args]
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.max_size is None:
        ns.max_size = DEFAULT_MAX_SIZE[ns.kind]
    try:
        ns.sizes = size_range(ns.min_size, ns.max_size)
    except ValueError as exc:
        parser.error(str(exc))
    if ns.cold and ns.kind != "latency" and ns.window * ns.sizes[-1] > COLD_WINDOW_LIMIT:
        parser.error(f"--cold maps a fresh buffer for each of the {ns.window} messages of a "
                     f"window: over {format_size(COLD_WINDOW_LIMIT)} at "
                     f"{format_size(ns.sizes[-1])}; lower --max-size or --window")
    if ns.cold and any(form.endswith("bytearray") for form in ns.buffer):
        parser.error("--cold receives into pages no one has touched, but a bytearray is "
                     "written when it is made: use --buffer numpy or spec with --cold")
    if ns.recv_view and (ns.kind != "latency" or any(f.startswith("spec") for f in ns.buffer)):
        parser.error("--recv-view times latency with bare buffers only")
    if ns.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'cma-ipc[plot]'")
    return ns


WAITALL_NOTE = ("--waitall mpi: cma.mpi and mpi4py waited for each window with "
                "MPI.Request.Waitall; the series without MPI waited on each request in turn")


def report(kind: str, series: Sequence[Series], fmt: str, waitall: str = "each") -> str:
    if fmt == "mpi4py":
        return format_mpi4py(series)
    parts = [format_results(kind, series), format_copies(series)]
    if waitall == "mpi":
        parts.insert(1, WAITALL_NOTE)
    crossing = format_crossovers(crossovers(*compared_series(series)))
    if crossing:
        parts.append("crossovers: time per message, differences within 2 standard errors "
                     "count as ties\n" + crossing)
    guard = format_guard(series)
    if guard:
        parts.append("--guard: CPU-to-CPU copy probed before and after every timed loop "
                     f"(quiet up to {QUIET_RATIO}x)\n" + guard)
    notes = format_notes(series)
    if notes:
        parts.append("not measured\n" + notes)
    return "\n\n".join(p for p in parts if p)


def write_json(path: str, args: argparse.Namespace, plans: dict[str, Plan],
               series: Sequence[Series], started: float, argv: Sequence[str]) -> None:
    doc = {
        "tool": "cma-bench",
        "argv": list(argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "parameters": {
            "kind": args.kind, "sizes": args.sizes, "window": args.window, "cold": args.cold,
            "quick": args.quick, "iterations": args.iterations, "warmup": args.warmup,
            "rounds": args.rounds, "interleave": args.interleave, "guard": args.guard,
            "settle": args.settle, "buffer": args.buffer, "waitall": args.waitall,
            "recv_view": args.recv_view,
            "transport": args.transport, "baseline": args.baseline, "cpus": dict(bound_cpus),
            "samples_ns": "nanoseconds per timed sample: a round trip (latency), a window "
                          "(bw, bibw) or one copy (memcpy); time per message = sample / "
                          "messages_per_sample",
            "plans": {name: asdict(plan) for name, plan in plans.items()},
        },
        "machine": machine_info(),
        "series": [series_json(s) for s in series],
        "crossovers": [asdict(c) for c in crossovers(*compared_series(series))],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in COLLECTIVES:
        return collective_main(given[0], given[1:])
    args = parse_args(argv)
    world = mpi_world()
    rank = world.Get_rank() if world is not None else 0
    bound_cpus.clear()
    if args.bind:
        bound_cpus.update(bind_cpus(rank))
    try:
        specs, not_run = select_series(args.kind, args.transport, args.baseline, world,
                                       args.buffer)
    except (ValueError, ImportError, AttributeError) as exc:
        print(f"cma-bench: {exc}", file=sys.stderr)
        return 2
    if args.waitall == "mpi" and not any(spec.where == "world" for spec in specs):
        print("cma-bench: --waitall mpi changes only how the MPI series (cma.mpi, mpi4py) "
              "wait: run under mpiexec -n 2 with one of them", file=sys.stderr)
        return 2
    knobs = dict(window=args.window, cold=args.cold, quick=args.quick,
                 iterations=args.iterations, warmup=args.warmup)
    plans = {"messages": replace(build_plan(args.kind, args.sizes, **knobs), waitall=args.waitall,
                                 view=args.recv_view),
             "memcpy": build_plan("memcpy", args.sizes, **knobs)}
    if args.guard > 0:
        # the in-process memcpy has no second CPU to wait for
        cpus = ((bound_cpus["self"], bound_cpus["peer"]) if bound_cpus
                else tuple(sorted(os.sched_getaffinity(0))))
        if len(cpus) < 2 or (world is not None and world.Get_size() > 2):
            print("cma-bench: --guard needs two CPUs and, under mpiexec, exactly 2 ranks",
                  file=sys.stderr)
            return 2
        plans["messages"] = replace(plans["messages"], guard=args.guard, guard_cpus=cpus[:2])
    progress = Progress() if rank == 0 else None
    started = time.time()
    sessions = schedule(len(specs), len(args.sizes), args.rounds, args.interleave)
    try:
        runs = run_schedule(specs, plans, sessions, world, progress, args.settle)
    except KeyboardInterrupt:
        if progress is not None:
            progress.clear()
        print("cma-bench: interrupted", file=sys.stderr)
        return 130
    if progress is not None:
        progress.clear()
    if rank != 0:
        return 0
    results = [merge_series(series_runs) for series_runs in runs] + not_run
    text = report(args.kind, results, args.format, args.waitall)
    print(text, flush=True)
    if args.format == "mpi4py" and format_notes(results):
        print(format_notes(results), file=sys.stderr)
    if args.json:
        write_json(args.json, args, plans, results, started,
                   sys.argv[1:] if argv is None else argv)
    if args.plot:
        plot(args.kind, results, args.plot)
    return 1 if any(s.status == "failed" for s in results) else 0

"""Where one of cma's collectives should switch algorithms: each size timed with the
algorithm above the switch forced on (its threshold 0; or ``--on``'s size, for a constant
that sizes pieces, such as RING_PIECE) and off (2**40), in turns (on, off, then off, on)
in one job, every collective through cma, OSU's pattern (a barrier, untimed,
before each call; each rank's mean, averaged over ranks, and the slowest rank's)::

    CMA_MPI_COLLECTIVES=cma mpiexec -n 4 python bench/switch_points.py allreduce ALLREDUCE_SCATTER_FROM

Rank 0 prints, per size, both settings' times in each turn and the ranges of on/off
(< 1: the algorithm above the switch is faster). docs/guide.md section 7, "The switch
points", has the runs.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import cma.collectives
import cma.mpi
from cma.bench.collective import measure, operation, settle_allocator
from cma.bench.sizes import format_size, parse_size

OFF = 1 << 40
SIZES = "16K,64K,256K,512K,1M,2M,4M,8M,16M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["bcast", "allreduce", "reduce", "reduce_scatter"])
    parser.add_argument("threshold", help="the constant of cma.collectives, e.g. BCAST_SCATTER_FROM")
    parser.add_argument("--sizes", default=SIZES, help=f"comma-separated (default {SIZES})")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=BYTES",
                        help="hold another constant of cma.collectives at a size (repeatable)")
    parser.add_argument("--heap", action="store_true",
                        help="arrays from the shared heap (with CMA_XMAP=1, hops of them mapped)")
    parser.add_argument("--on", type=parse_size, default=0, metavar="BYTES",
                        help="the constant's value for 'on' (default 0; 'off' is 2**40)")
    parser.add_argument("--transport", default="auto", help="cma.mpi.Comm's transport (default auto)")
    parser.add_argument("--write", action="store_true",
                        help="a rank that sends data of its own writes new values before each call")
    args = parser.parse_args()
    for name in [args.threshold] + [held.partition("=")[0] for held in args.set]:
        if not hasattr(cma.collectives, name):
            parser.error(f"cma.collectives has no {name}")
    for held in args.set:
        name, _, value = held.partition("=")
        setattr(cma.collectives, name, parse_size(value))
    settle_allocator()
    world = MPI.COMM_WORLD
    comm = cma.mpi.Comm(world, args.transport)
    rank, size = world.Get_rank(), world.Get_size()
    if rank == 0:
        print(f"# {args.kind} at {size} ranks, {args.threshold} forced on ({args.on}) and off (2**40)"
              f"{''.join(', ' + held for held in args.set)}{', heap arrays' if args.heap else ''}"
              f"{', transport ' + args.transport if args.transport != 'auto' else ''}"
              f"{', written before each call' if args.write else ''}; "
              "cma.mpi's time, us (mean over ranks / slowest rank), two turns each; on/off < 1: "
              "the algorithm above the switch is faster", flush=True)
    for nbytes in map(parse_size, args.sizes.split(",")):
        iterations = 100 if nbytes <= 256 << 10 else 30 if nbytes <= 2 << 20 else 10
        got: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
        for turn in range(2):
            for name in ("on", "off") if turn == 0 else ("off", "on"):
                setattr(cma.collectives, args.threshold, args.on if name == "on" else OFF)
                run = operation(comm, args.kind, nbytes, heap=args.heap, write=args.write)
                measure(comm, run, 0, 3)
                means = world.allgather(float(np.mean(measure(comm, run, iterations, 0))) / 1e3)
                got[name].append((sum(means) / size, max(means)))
        if rank == 0:
            on, off = got["on"], got["off"]
            by_mean = [a[0] / b[0] for a in on for b in off]
            by_slowest = [a[1] / b[1] for a in on for b in off]
            print(f"{format_size(nbytes):>8}  on {' '.join(f'{m:9.1f}/{s:9.1f}' for m, s in on)}  "
                  f"off {' '.join(f'{m:9.1f}/{s:9.1f}' for m, s in off)}  on/off mean "
                  f"{min(by_mean):.2f}-{max(by_mean):.2f} slowest "
                  f"{min(by_slowest):.2f}-{max(by_slowest):.2f}", flush=True)
    if comm.cma is not None:
        comm.cma.close()  # (not Free: that would free COMM_WORLD)


if __name__ == "__main__":
    main()

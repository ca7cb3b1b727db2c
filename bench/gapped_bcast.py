"""A Bcast whose root names a datatype with gaps while its peers pass plain arrays:
cma.mpi (which packs the root's elements for cma) against mpi4py with the same specs,
and both with plain arrays on every rank, for scale.

Rank 0 is the root; its buffer holds int64s in the layout of ``MPI.INT64_T
.Create_vector(2, 1, 2)`` (two of every three), its spec ``[buf, n // 2, vector]``. Each
size: 200 calls a turn (40 from 1 MiB), an MPI barrier between calls, the mean averaged
over the ranks; four turns taking the two orders in turn; glibc's allocator settled
first. Rank 0 prints the median of the turns (microseconds)::

    mpiexec -n 2 python bench/gapped_bcast.py --sizes 64K,1M,8M
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import cma.mpi
from cma.bench.collective import settle_allocator
from cma.bench.sizes import format_size, parse_size

INT64 = MPI._typedict[np.dtype(np.int64).char]


def laid_out(values: np.ndarray) -> np.ndarray:
    """``values`` (an even count) two of every three int64s, the third left as zero."""
    out = np.zeros((len(values) // 2, 3), np.int64)
    out[:, 0], out[:, 2] = values[0::2], values[1::2]
    return out.ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M,8M", help="comma-separated message sizes")
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    settle_allocator()
    world = MPI.COMM_WORLD
    comm = cma.mpi.Comm(world)
    rank, ranks = world.Get_rank(), world.Get_size()
    pairs = INT64.Create_vector(2, 1, 2).Commit()
    for nbytes in map(parse_size, args.sizes.split(",")):
        count = max(nbytes // 8 // 2 * 2, 2)
        values = np.arange(count, dtype=np.int64)
        gapped = [laid_out(values), count // 2, pairs] if rank == 0 else np.zeros(count, np.int64)
        plain = values.copy() if rank == 0 else np.zeros(count, np.int64)
        calls = 200 if nbytes < (1 << 20) else 40
        times: dict[tuple[str, str], list[float]] = {}
        for turn in range(args.turns):
            libraries = [("mpi4py", world), ("cma.mpi", comm)]
            for library, c in libraries if turn % 2 == 0 else libraries[::-1]:
                for form, spec in (("vector", gapped), ("plain", plain)):
                    c.Bcast(spec, 0)
                    spent = 0.0
                    for _ in range(calls):
                        world.Barrier()
                        start = time.perf_counter()
                        c.Bcast(spec, 0)
                        spent += time.perf_counter() - start
                    mean = world.allreduce(spent / calls * 1e6) / ranks
                    times.setdefault((library, form), []).append(mean)
        if rank == 0:
            median = {key: statistics.median(values) for key, values in times.items()}
            print(f"{format_size(count * 8):>8}  vector on the root: mpi4py "
                  f"{median['mpi4py', 'vector']:8.1f}  cma.mpi {median['cma.mpi', 'vector']:8.1f}"
                  f"  | plain arrays: mpi4py {median['mpi4py', 'plain']:8.1f}  cma.mpi "
                  f"{median['cma.mpi', 'plain']:8.1f}", flush=True)
    pairs.Free()


if __name__ == "__main__":
    main()

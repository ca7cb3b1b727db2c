"""Sum a peer's array: through a view of its memory (recv_view, no copy) against
receiving it first (Recv into our buffer, one copy) and summing that.

    PYTHONPATH=. python bench/xmap_reduce.py --size 64M --repeat 7

The peer (a forked child on a cma.Pipe with xmap on) keeps one array in its shared heap
(cma.empty) and sends it on request; this process sums it both ways, alternating, and
prints the median [min-max] per way, the load average, and checks both sums agree.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

import cma
from cma.bench.sizes import parse_size

TAG = 1


def peer(comm: cma.Comm, nbytes: int, repeat: int) -> None:
    data = cma.empty(nbytes // 8, np.float64)
    data[:] = np.arange(data.size) % 1000
    for _ in range(2 * (repeat + 1)):
        comm.recv(source=0, tag=2)  # the next request
        comm.Send(data, 0, TAG)  # returns once the copy is made, or the view released
    comm.Barrier()
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=64 << 20)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    comm, child = cma.Pipe(xmap=True)
    proc = mp.get_context("fork").Process(target=peer, args=(child, args.size, args.repeat))
    proc.start()
    child.close()
    buf = np.empty(args.size // 8, np.float64)
    buf.fill(0)  # touched: the copy is timed, not first-touch faults
    times: dict[str, list[float]] = {"view then sum": [], "Recv then sum": []}
    sums = set()
    try:
        for i in range(args.repeat + 1):  # the first of each way is a warm-up (maps)
            for way in times:
                comm.send(None, 1, 2)
                t0 = time.perf_counter()
                if way == "view then sum":
                    with comm.recv_view(1, TAG) as view:
                        total = float(view.view(np.float64).sum())
                else:
                    comm.Recv(buf, 1, TAG)
                    total = float(buf.sum())
                elapsed = time.perf_counter() - t0
                sums.add(total)
                if i:
                    times[way].append(elapsed * 1e3)
        comm.Barrier()
        stats = comm.stats()["xmap"]
    finally:
        proc.join(30)
        comm.close()
    load = os.getloadavg()[0]
    print(f"sum of a peer's {args.size >> 20} MiB float64 array, {args.repeat} runs, "
          f"load average {load:.1f}")
    for way, ms in times.items():
        print(f"  {way:14s} {statistics.median(ms):8.2f} ms [{min(ms):.2f}-{max(ms):.2f}]")
    print(f"  sums agree: {len(sums) == 1}; xmap messages {stats['messages']}, "
          f"user copies per byte {stats['user_copies']:.2f}, mappings {stats['mappings']}")


if __name__ == "__main__":
    main()

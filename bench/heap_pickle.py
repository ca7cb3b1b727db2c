"""Passing an array to a pool worker: a cma heap array (by handle) against the same bytes
pickled by value, and against ``multiprocessing.shared_memory`` used by hand.

Each case is one ``pool.apply(worker, (what,))`` round trip to a single warm worker
(fork context) that reads one element of the array it gets, so the time is what it
costs to hand the array over (and, by value, to copy it into the worker and free it
again):

- ``heap``: ``cma.empty`` array; the reducer sends the segment's fd (through
  multiprocessing's resource sharer) and the worker maps the pages;
- ``value``: a plain NumPy array of the same size, pickled into the pipe;
- ``shm``: the bytes already in a ``SharedMemory`` block; the worker gets its name,
  shape and dtype, attaches, builds the ndarray, reads, detaches (what users write by
  hand today).

Not in CI. Run from the repository root (a few minutes on a 2-CPU machine)::

    PYTHONPATH=. python bench/heap_pickle.py --max-size 256M --repeat 7

The table gives the median and [min-max] of ``--repeat`` round trips per case and size,
and the ratios value/heap and shm/heap of the medians (> 1: the heap is faster). Quote
it with the load average it prints.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

import cma
from cma import _linux


def read_one(arr: np.ndarray) -> int:
    return int(arr[-1])


def read_one_shm(name: str, shape: tuple[int, ...], dtype: str) -> int:
    block = shared_memory.SharedMemory(name=name)
    # Python < 3.13 registers an attached block for unlinking at exit (bpo-38119): undo that
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        arr = np.ndarray(shape, dtype, buffer=block.buf)
        value = int(arr[-1])
        del arr
    finally:
        block.close()
    return value


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def timed(pool: Any, func: Any, args: tuple[Any, ...], repeat: int, expect: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        got = pool.apply(func, args)
        times.append(time.perf_counter() - start)
        assert got == expect
    return times


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:9.3f} [{min(times) * 1e3:.3f}-{max(times) * 1e3:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-size", type=size_arg, default=1 << 20)
    parser.add_argument("--max-size", type=size_arg, default=256 << 20)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}, {os.cpu_count()} CPUs, "
          f"shmem THP {_linux.shmem_huge_pages()!r}; ms per pool.apply round trip, "
          f"median [min-max] of {args.repeat}")
    print(f"{'size':>6} | {'heap':>24} | {'value':>26} | {'shm by hand':>24} | value/heap | shm/heap")
    pool = mp.get_context("fork").Pool(1)
    try:
        pool.apply(read_one, (cma.alloc(8),))  # starts the worker and the resource sharer
        size = args.min_size
        while size <= args.max_size:
            heap_arr = cma.alloc(size)
            heap_arr[:] = 1
            plain = np.ones(size, np.uint8)
            block = shared_memory.SharedMemory(create=True, size=size)
            try:
                np.ndarray(size, np.uint8, buffer=block.buf)[:] = 1
                heap_t = timed(pool, read_one, (heap_arr,), args.repeat, 1)
                value_t = timed(pool, read_one, (plain,), args.repeat, 1)
                shm_t = timed(pool, read_one_shm, (block.name, (size,), "uint8"), args.repeat, 1)
            finally:
                block.close()
                block.unlink()
            h, v, s = (statistics.median(t) for t in (heap_t, value_t, shm_t))
            label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
            print(f"{label:>6} | {fmt(heap_t):>24} | {fmt(value_t):>26} | {fmt(shm_t):>24} | "
                  f"{v / h:10.1f} | {s / h:8.2f}", flush=True)
            del heap_arr, plain
            size *= 4
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

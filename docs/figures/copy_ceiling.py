"""How fast this machine copies inside one process: the ceiling above any transport.

Prints, for 16 and 64 MiB and three rounds, the median time of ``np.copyto`` with one
and two threads, copying either the same pair of buffers every time (what the memcpy
baseline of cma-bench does) or two pairs in turn (the four buffers of a ping-pong).

    python docs/figures/copy_ceiling.py
"""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

pool = ThreadPoolExecutor(1)


def copy_two_threads(dst: np.ndarray, src: np.ndarray) -> None:
    half = dst.nbytes // 2
    other = pool.submit(np.copyto, dst[half:], src[half:])
    np.copyto(dst[:half], src[:half])
    other.result()


def median_us(nbytes: int, threads: int, pairs: int, copies: int) -> float:
    buffers = [np.full(nbytes, i + 1, np.uint8) for i in range(2 * pairs)]
    copy = copy_two_threads if threads == 2 else np.copyto
    times = []
    for i in range(copies + 5):  # the first five warm up
        dst, src = buffers[2 * (i % pairs)], buffers[2 * (i % pairs) + 1]
        t0 = time.perf_counter_ns()
        copy(dst, src)
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times[5:])) / 1e3


for mib, copies in ((16, 40), (64, 15)):
    for round_index in range(3):
        for threads in (1, 2):
            for pairs in (1, 2):
                us = median_us(mib << 20, threads, pairs, copies)
                print(f"{mib} MiB round {round_index + 1}: {threads} thread(s), {pairs} pair(s): "
                      f"{us:8.1f} us {(mib << 20) / us / 1e3:5.1f} GB/s", flush=True)

"""Pipe create/use/close cycles in one process: what they leave behind.

Each cycle makes ``a, b = cma.Pipe()`` (transport ``auto`` unless told: every practical
transport sets up with the peer), starts a child with ``b`` (``--context`` fork, spawn
or forkserver), sends an eager and a rendezvous message each way, closes both ends and
joins the child. After one warm-up cycle (imports, numpy's allocator: kept for good),
this process's fds, mapping lines, threads (Python's and the kernel's), resident memory
and zombie children are read before and after the cycles::

    python bench/pipe_cycles.py --cycles 1000                  # the figures of #23
    python bench/pipe_cycles.py --cycles 20 --context spawn

One JSON line: the readings before and after, their growth, the seconds per cycle.
``tests/reliability/test_resources.py`` runs fewer cycles and holds the growth to its
bounds; docs/reliability.md ("Resources") has the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

import cma

TAG = 9
EAGER_BYTES = 1000
RENDEZVOUS_BYTES = 3 << 20  # above the default 2 MiB eager limit: a transport copies it
JOIN_TIMEOUT = 10.0


@dataclass(frozen=True)
class Usage:
    fds: int
    maps: int  # lines of /proc/self/maps
    threads: int  # Python's
    tasks: int  # the kernel's: threads started outside Python's threading too
    rss_kib: int
    zombies: int  # children exited and not waited for

    @classmethod
    def now(cls) -> Usage:
        gc.collect()  # (cyclic garbage is not a leak; what stays after a collection is)
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return cls(len(os.listdir("/proc/self/fd")), maps, threading.active_count(),
                   len(os.listdir("/proc/self/task")), rss, len(zombie_children()))


def zombie_children() -> list[int]:
    """Pids of this process's children in state Z."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited and reaped meanwhile
        if fields[0] == "Z" and int(fields[1]) == me:
            found.append(int(name))
    return found


def child(comm: cma.Comm) -> None:
    """Rank 1: take both messages, send them back."""
    small = np.empty(EAGER_BYTES, np.uint8)
    large = np.empty(RENDEZVOUS_BYTES, np.uint8)
    comm.Recv(small, source=0, tag=TAG)
    comm.Recv(large, source=0, tag=TAG)
    comm.Send(small, dest=0, tag=TAG)
    comm.Send(large, dest=0, tag=TAG)
    comm.close()


def cycles(count: int, context: str, transport: str) -> None:
    ctx = mp.get_context(context)
    small = np.arange(EAGER_BYTES, dtype=np.uint8)
    large = np.full(RENDEZVOUS_BYTES, 0x3C, np.uint8)
    got_small, got_large = np.empty_like(small), np.empty_like(large)
    for _ in range(count):
        a, b = cma.Pipe(transport)
        proc = ctx.Process(target=child, args=(b,))
        proc.start()
        try:
            a.Send(small, dest=1, tag=TAG)
            a.Send(large, dest=1, tag=TAG)
            a.Recv(got_small, source=1, tag=TAG)
            a.Recv(got_large, source=1, tag=TAG)
            if not (np.array_equal(got_small, small) and np.array_equal(got_large, large)):
                raise AssertionError("a message came back changed")
        finally:
            a.close()
            b.close()
            proc.join(JOIN_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if proc.exitcode != 0:
            raise AssertionError(f"the child exited with {proc.exitcode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--context", choices=["fork", "spawn", "forkserver"], default="fork")
    parser.add_argument("--transport", default="auto")
    args = parser.parse_args()
    cycles(1, args.context, args.transport)
    before = Usage.now()
    began = time.monotonic()
    cycles(args.cycles, args.context, args.transport)
    seconds = time.monotonic() - began
    after = Usage.now()
    print(json.dumps({
        "cycles": args.cycles, "context": args.context, "transport": args.transport,
        "seconds_per_cycle": round(seconds / args.cycles, 4),
        "before": asdict(before), "after": asdict(after),
        "growth": {k: v - asdict(before)[k] for k, v in asdict(after).items()},
        "load": round(os.getloadavg()[0], 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }))


if __name__ == "__main__":
    main()

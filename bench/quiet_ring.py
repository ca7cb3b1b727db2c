"""What a pair pays to talk again after its ring's pages went back to the kernel.

A rank about to sleep in cma hands back the pages of the rings it writes that have been
quiet for ``QUIET_SECONDS`` (docs/architecture.md, "Memory per rank"). The next eager
messages through such a ring fault its pages in again, on the writer's side (a fresh
zeroed page) and the reader's (mapping it). Two ranks of a ``cma.Pipe`` ping-pong bursts
of eager messages; after a burst each rank in turn waits in cma while the other pauses,
for no time (the ring stays warm) or ``--quiet`` seconds, with the rings' pages handed
back or (the control: a quiet pause alone, which also lets the CPUs go idle) kept. The
three kinds take turns, so the host's drift hits them alike::

    python bench/quiet_ring.py --size 128K --rounds 32 --bursts 20

Prints one JSON line: per kind of pause, the median and range over the bursts after it of
a burst's mean round trip (microseconds), and the bytes the world's memfd held before it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

import cma
import cma.progress
from cma.bench.sizes import parse_size

TAG, GO = 3, 4
QUIET_SECONDS = cma.progress.QUIET_SECONDS
JOIN_TIMEOUT = 120.0


def held(comm: cma.Comm) -> int:
    """Bytes the world's memfd holds (its pages in memory)."""
    progress = comm._progress
    assert progress is not None
    return os.fstat(progress.world.fds.memfd).st_blocks * 512


KINDS = ["warm", "quiet, pages handed back", "quiet, pages kept"]


def kind_after(burst: int) -> str:
    """What follows ``burst``: no pause, or a quiet pause with or without handing back."""
    return KINDS[burst % len(KINDS)]


def pause(comm: cma.Comm, kind: str, quiet: float) -> float:
    """Set up the pause of ``kind`` on this rank: its length, and whether a sleep in cma
    hands back quiet rings (for "pages kept", never: the control, whose next look for
    quiet rings is put off for good)."""
    progress = comm._progress
    assert progress is not None
    keep = kind == "quiet, pages kept"
    progress.quiet_look = float("inf") if keep else time.perf_counter() + QUIET_SECONDS
    return 0.0 if kind == "warm" else quiet


def echo(comm: cma.Comm, size: int, rounds: int, bursts: int, quiet: float) -> None:
    comm.attach()
    buf = np.empty(size, np.uint8)
    for burst in range(bursts):
        for _ in range(rounds):
            comm.Recv(buf, 0, TAG)
            comm.Send(buf, 0, TAG)
        time.sleep(pause(comm, kind_after(burst), quiet))  # rank 0 waits in cma meanwhile
        comm.Send(np.zeros(1, np.uint8), 0, GO)
        # then this rank waits in cma for the next burst while rank 0 pauses
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=128 << 10,
                        help="message size: eager, and below the direct rendezvous (256 KiB)")
    parser.add_argument("--rounds", type=int, default=32, help="round trips in a burst")
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--quiet", type=float, default=0.3, help="seconds of a quiet pause")
    args = parser.parse_args()
    a, b = cma.Pipe()
    child = mp.get_context("fork").Process(
        target=echo, args=(b, args.size, args.rounds, args.bursts, args.quiet))
    child.start()
    b.close()
    try:
        a.attach()
        send, back = np.ones(args.size, np.uint8), np.empty(args.size, np.uint8)
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        before: dict[str, list[int]] = {kind: [] for kind in KINDS}
        for burst in range(args.bursts):
            kind = kind_after(burst - 1)
            before[kind].append(held(a))
            start = time.perf_counter()
            for _ in range(args.rounds):
                a.Send(send, 1, TAG)
                a.Recv(back, 1, TAG)
            if burst:  # (the first burst touches the ring for the first time)
                times[kind].append((time.perf_counter() - start) / args.rounds * 1e6)
            seconds = pause(a, kind_after(burst), args.quiet)
            a.Recv(np.zeros(1, np.uint8), 1, GO)  # in cma, while rank 1 pauses
            time.sleep(seconds)  # rank 1 waits in cma meanwhile
        print(json.dumps({
            "size": args.size, "rounds": args.rounds, "quiet_s": args.quiet,
            **{kind: {"median_us": statistics.median(t), "min_us": min(t), "max_us": max(t),
                      "memfd_bytes_before": statistics.median(before[kind])}
               for kind, t in times.items() if t}}))
    finally:
        child.join(JOIN_TIMEOUT)
        if child.is_alive():
            child.kill()
        a.close()


if __name__ == "__main__":
    main()

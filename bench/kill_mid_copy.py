"""How long a survivor takes to notice a peer SIGKILLed in the middle of a large copy.

For each transport and each victim (the sender or the receiver of one large message),
rank 0 (this process) and rank 1 (a forked child) of a ``cma.Pipe`` exchange a small
message, then rank 1's side of the large message starts and rank 0 calls its own side;
``--after`` seconds later a timer thread SIGKILLs rank 1. Rank 0's call must raise
``PeerGone``; printed is the time from the kill to the exception, and the copy bandwidth
of an undisturbed run of the same message (so a change to per-call copy sizes shows its
cost too)::

    python bench/kill_mid_copy.py                        # 1 GiB, every transport, 3 runs
    python bench/kill_mid_copy.py --size-mib 64 --runs 5 --transports cma vmfd

Figures: docs/reliability.md ("Large copies").
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time

import numpy as np

import cma
from cma.errors import PeerGone

TAG = 3


def unforked(nbytes: int, value: int) -> np.ndarray:
    """Rank 0's buffers: every page written, and not mapped into the forked rank 1, whose
    exit would otherwise tear down rank 0's gigabytes too (the survivor waits for that)."""
    area = mmap.mmap(-1, nbytes)
    area.madvise(mmap.MADV_DONTFORK)
    array = np.frombuffer(area, np.uint8)
    array.fill(value)
    return array


def rank1(comm: cma.Comm, role: str, nbytes: int) -> None:
    """The child: its own buffer, every page written; say it is ready; send or receive."""
    buf = np.full(nbytes, 7, np.uint8)
    comm.Send(np.zeros(1, np.uint8), dest=0, tag=TAG)
    if role == "sender":
        comm.Send(buf, dest=0, tag=TAG)
    else:
        comm.Recv(buf, source=0, tag=TAG)
    comm.close()


def one_run(transport: str, victim: str, payload: np.ndarray, scratch: np.ndarray,
            after: float | None) -> tuple[float, bool]:
    """(seconds from the kill to the end of rank 0's call, whether it raised PeerGone);
    with ``after`` None, (the undisturbed copy's seconds, False). A call may complete
    after the kill: the copy read all of the dead sender's memory, which the kernel keeps
    while a copy from it runs."""
    a, b = cma.Pipe(transport=transport)
    role = "sender" if victim == "sender" else "receiver"  # rank 1's role
    child = mp.get_context("fork").Process(target=rank1, args=(b, role, payload.nbytes),
                                           daemon=True)
    child.start()
    b.close()
    killed: list[float] = []
    try:
        a.Recv(np.empty(1, np.uint8), source=1, tag=TAG)
        if after is not None:
            pid = child.pid
            assert pid is not None

            def kill() -> None:
                killed.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)

            threading.Timer(after, kill).start()
        began = time.monotonic()
        try:
            if role == "sender":
                a.Recv(scratch, source=1, tag=TAG)
            else:
                a.Send(payload, dest=1, tag=TAG)
        except PeerGone:
            return time.monotonic() - killed[0], True
        if after is None:
            return time.monotonic() - began, False
        if not killed:
            raise RuntimeError(f"{transport}, {victim} killed: the copy finished before the kill "
                               f"({time.monotonic() - began:.3f} s); lower --after")
        return time.monotonic() - killed[0], False
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
        a.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--after", type=float, default=0.1, help="seconds into the copy")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["shm", "cma", "vmfd", "auto"])
    args = parser.parse_args()
    nbytes = args.size_mib << 20
    payload, scratch = unforked(nbytes, 7), unforked(nbytes, 1)
    print(f"{args.size_mib} MiB, kill after {args.after} s, {args.runs} runs, "
          f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'transport':<10} {'victim':<9} {'kill to PeerGone (s)':<36} undisturbed GB/s")
    for transport in args.transports:
        for victim in ("sender", "receiver"):
            copies = [one_run(transport, victim, payload, scratch, None)[0]
                      for _ in range(args.runs)]
            ends = [one_run(transport, victim, payload, scratch, args.after)
                    for _ in range(args.runs)]
            times = [t for t, _ in ends]
            missed = sum(1 for _, raised in ends if not raised)
            note = f", {missed} completed instead" if missed else ""
            rates = ", ".join(f"{nbytes / t / 1e9:.2f}" for t in copies)
            found = f"median {statistics.median(times):.3f} max {max(times):.3f}{note}"
            print(f"{transport:<10} {victim:<9} {found:<36} {rates}", flush=True)


if __name__ == "__main__":
    main()

"""How long Ctrl-C takes to stop a rank whose receive of a large message is copying.

For each transport, rank 1 (a forked child) receives one large message from rank 0 (this
process); ``--after`` seconds into rank 0's send, rank 0 sends rank 1 SIGINT. Rank 1
reports the time from the signal to its KeyboardInterrupt and what its next call did
(``CommBroken``: the copy was left half done); then it exits, and rank 0's send ends::

    python bench/interrupt_mid_copy.py                 # 1 GiB, every transport, 3 runs

Python runs a signal's handler between two bytecodes, so a copy system call under way
finishes first: the delay is up to one call of ``CALL_BYTES``. Figures:
docs/reliability.md ("Interrupts and abandoned operations").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
from kill_mid_copy import unforked

import cma
from cma.errors import CmaError, PeerGone

TAG = 3


def rank1(comm: cma.Comm, nbytes: int, report: Connection) -> None:
    buf = np.full(nbytes, 7, np.uint8)  # every page written before the copy
    comm.Send(np.zeros(1, np.uint8), dest=0, tag=TAG)
    try:
        comm.Recv(buf, source=0, tag=TAG)
        report.send((time.monotonic(), "not interrupted: the receive completed"))
        return
    except KeyboardInterrupt:
        caught = time.monotonic()
    try:
        comm.Iprobe(0, TAG)
        after = "usable"
    except CmaError as exc:
        after = type(exc).__name__
    report.send((caught, after))
    comm.close()


def one_run(transport: str, payload: np.ndarray, after: float) -> tuple[float, str]:
    """(seconds from SIGINT to rank 1's KeyboardInterrupt, what its next call did)."""
    a, b = cma.Pipe(transport=transport)
    results, report = mp.Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=rank1, args=(b, payload.nbytes, report),
                                           daemon=True)
    child.start()
    b.close()
    report.close()
    sent: list[float] = []
    try:
        a.Recv(np.empty(1, np.uint8), source=1, tag=TAG)
        pid = child.pid
        assert pid is not None

        def interrupt() -> None:
            sent.append(time.monotonic())
            os.kill(pid, signal.SIGINT)

        threading.Timer(after, interrupt).start()
        try:
            a.Send(payload, dest=1, tag=TAG)
        except PeerGone:
            pass  # rank 1 left the message half received and exited
        caught, next_call = results.recv()
        return caught - sent[0], next_call
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
        a.close()
        results.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--after", type=float, default=0.1, help="seconds into the send")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["shm", "cma", "vmfd", "auto"])
    args = parser.parse_args()
    payload = unforked(args.size_mib << 20, 3)
    print(f"{args.size_mib} MiB, SIGINT after {args.after} s, {args.runs} runs, "
          f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for transport in args.transports:
        runs = [one_run(transport, payload, args.after) for _ in range(args.runs)]
        delays = [delay for delay, _ in runs]
        nexts = sorted({next_call for _, next_call in runs})
        print(f"{transport:<6} SIGINT to KeyboardInterrupt: median {statistics.median(delays):.4f} s, "
              f"max {max(delays):.4f} s; next call: {', '.join(nexts)}", flush=True)


if __name__ == "__main__":
    main()

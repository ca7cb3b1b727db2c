"""Where a ``recv_view`` round trip spends its time, phase by phase.

Two ranks of a ``cma.Pipe(xmap=True)``: rank 0 sends a heap array (``cma.empty``) with a
blocking ``Send``, which returns once rank 1 has released its view; rank 1 takes a view
of it and releases it, then sends a 1-byte ack that rank 0 receives before the next
``Send``. Rank 1 times, per round: the wait for the RTS after its ack (rank 0's ack
receive and its ``Send`` up to the RTS), ``recv_view`` with the RTS already in the ring
(matching, the mapping's lookup, the view), the release (the FIN), and the ack's send;
rank 0 times its ``Send`` and its ack receive::

    python bench/recv_view_phases.py --size 4M --rounds 200

Prints one JSON line of medians in microseconds (docs/guide.md section 5 quotes it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

import cma
from cma.bench.sizes import parse_size

DATA, ACK = 5, 6
WARM_UP = 20
JOIN_TIMEOUT = 60.0


def median_us(seconds: list[float]) -> float:
    return statistics.median(seconds[WARM_UP:]) * 1e6


def sender(comm: cma.Comm, size: int, rounds: int, out: Connection) -> None:
    comm.attach()
    data = cma.empty(size, np.uint8)
    data[:] = 1
    ack = np.zeros(1, np.uint8)
    send, receive = [], []
    for _ in range(WARM_UP + rounds):
        start = time.perf_counter()
        comm.Send(data, 1, DATA)
        sent = time.perf_counter()
        comm.Recv(ack, 1, ACK)
        send.append(sent - start)
        receive.append(time.perf_counter() - sent)
    out.send({"Send (to the release's FIN)": median_us(send), "ack Recv": median_us(receive)})
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    a, b = cma.Pipe(xmap=True)
    results, out = mp.get_context("fork").Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=sender, args=(a, args.size, args.rounds, out))
    child.start()
    a.close()
    out.close()
    try:
        b.attach()
        progress = b._progress
        assert progress is not None
        inbox = progress.inboxes[0]
        ack = np.zeros(1, np.uint8)
        phases: dict[str, list[float]] = {"wait for the RTS": [], "recv_view, RTS there": [],
                                          "release": [], "ack Send": []}
        for _ in range(WARM_UP + args.rounds):
            times = [time.perf_counter()]
            while not inbox.ready():  # (the RTS: spinning here keeps recv_view's own wait out)
                pass
            times.append(time.perf_counter())
            view = b.recv_view(0, DATA)
            times.append(time.perf_counter())
            view.release()
            times.append(time.perf_counter())
            b.Send(ack, 0, ACK)
            times.append(time.perf_counter())
            for spent, start, end in zip(phases.values(), times, times[1:], strict=False):
                spent.append(end - start)
        sender_side = results.recv() if results.poll(JOIN_TIMEOUT) else {}
        print(json.dumps({"size": args.size, "rounds": args.rounds,
                          **{name: median_us(spent) for name, spent in phases.items()},
                          **sender_side}))
    finally:
        child.join(JOIN_TIMEOUT)
        if child.is_alive():
            child.kill()
        b.close()


if __name__ == "__main__":
    main()

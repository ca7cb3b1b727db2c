"""The direct rendezvous against the eager ring, interleaved in one pair of processes.

A blocking ping-pong (OSU's pattern: each side sends one buffer and receives into
another) over one ``cma.Pipe``, its two processes pinned to their own CPUs. Blocks of
``--block`` round trips alternate between the two paths, both processes switching at
the same round trip: ``direct`` (a Send of any size is offered by region and pulled
with one copy, cma/direct.py) and ``eager`` (a Send up to the eager limit is copied
into the ring and out again). So the two share the machine's slow spells, which decide
a comparison on this VM more than anything (docs/guide.md, section 6). Per size it
prints each path's median and minimum over blocks of the one-way time, and how the
receiver's last block moved its messages (from ``comm.stats()``)::

    python bench/direct_ab.py --sizes 64K,256K,1M --block 200 --blocks 10

docs/architecture.md ("Direct rendezvous") quotes a run; DIRECT_FROM is where the
direct path stopped losing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

import cma
from cma.bench.sizes import parse_size
from cma.connect import NEVER

PATHS = ("direct", "eager")


def _use(comm: cma.Comm, path: str) -> None:
    # (the communicator's own switch, set at attach: every blocking Send from this size
    # takes the direct rendezvous)
    comm._direct_from = 0 if path == "direct" else NEVER


def _ranked_stats(comm: cma.Comm) -> dict[str, int]:
    return {name: int(s["messages"]) for name, s in comm.stats().items() if s["messages"]}


def _echo(comm: cma.Comm, nbytes: int, block: int, blocks: int, out: Any, ready: Any) -> None:
    """Rank 1: receive and answer, switching paths as rank 0 does; ``ready`` tells rank 0
    when this rank's counts for a block start."""
    try:
        if os.cpu_count() and os.cpu_count() > 1:
            os.sched_setaffinity(0, {1})
        comm.attach()
        buf = np.zeros(nbytes, np.uint8)
        reply = np.full(nbytes, 2, np.uint8)
        moved = {}
        for _ in range(blocks):
            for path in PATHS:
                _use(comm, path)
                comm.reset_stats()
                # (else the block's first message could come while the last Send of the
                # block before waits for its FIN, and be counted there: it was, once in CI)
                ready.send(None)
                for _ in range(block + 1):  # (one untimed round trip: the switch)
                    comm.Recv(buf, source=0, tag=1)
                    comm.Send(reply, dest=0, tag=2)
                moved[path] = _ranked_stats(comm)
        if buf[0] != 1 or buf[-1] != 1:
            raise AssertionError("the messages from rank 0 did not arrive")
        out.send(("ok", moved))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0
        out.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        comm.close()


def pingpong(nbytes: int, block: int, blocks: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Per path, the one-way microseconds of every block; and what moved rank 1's messages."""
    a, b = cma.Pipe()
    ctx = mp.get_context("fork")
    result_r, result_w = ctx.Pipe(duplex=False)
    ready_r, ready_w = ctx.Pipe(duplex=False)
    peer = ctx.Process(target=_echo, args=(b, nbytes, block, blocks, result_w, ready_w),
                       daemon=True)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        peer.start()
        b.close()
        result_w.close()
        ready_w.close()
        os.sched_setaffinity(0, {0})
        a.attach()
        send = np.ones(nbytes, np.uint8)
        recv = np.zeros(nbytes, np.uint8)
        for _ in range(blocks):
            for path in PATHS:
                _use(a, path)
                if not ready_r.poll(60):
                    raise RuntimeError("rank 1 did not start its block")
                ready_r.recv()
                a.Send(send, dest=1, tag=1)
                a.Recv(recv, source=1, tag=2)
                start = time.perf_counter()
                for _ in range(block):
                    a.Send(send, dest=1, tag=1)
                    a.Recv(recv, source=1, tag=2)
                times[path].append((time.perf_counter() - start) / block / 2 * 1e6)
        if not result_r.poll(60):
            raise RuntimeError("rank 1 did not report")
        status, moved = result_r.recv()
        if status != "ok":
            raise RuntimeError(f"rank 1 failed: {moved}")
        return times, moved
    finally:
        a.close()
        peer.join(10)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
        result_r.close()
        ready_r.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64K,128K,256K,384K,512K,1M,2M",
                        help="comma-separated message sizes, each within the eager limit "
                             "(default: %(default)s)")
    parser.add_argument("--block", type=int, default=200, help="round trips per block")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per path")
    args = parser.parse_args(argv)
    print(f"one-way us over {args.blocks} blocks of {args.block} round trips per path, "
          "alternating; median [min]; receiver's messages by mechanism in its last block")
    print(f"{'size':>8}  {'direct':>16}  {'eager':>16}  eager/direct  moved")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        times, moved = pingpong(nbytes, args.block, args.blocks)
        direct, eager = (statistics.median(times[p]) for p in PATHS)
        cells = "  ".join(f"{statistics.median(times[p]):7.1f} [{min(times[p]):6.1f}]"
                          for p in PATHS)
        print(f"{nbytes:>8}  {cells}  {eager / direct:12.2f}  {moved}")


if __name__ == "__main__":
    main()

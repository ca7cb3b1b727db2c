"""The floors of a blocking ping-pong from Python: what cma's paths could reach at best.

Two forked processes, each pinned to its own CPU, hand a message back and forth with
as little Python as possible between the copies, in three ways:

- ``double``: copied into shared memory by the sender and out by the receiver, whole,
  one message after another through a 4 MiB window (cma's eager ring, without packets);
- ``double/K``: the same in pieces of K bytes, the receiver copying each piece out as
  soon as it is published (the two copies overlap, as MPICH's shared-memory cells do);
- ``single``: the receiver reads the sender's buffer with one ``process_vm_readv``
  (MPICH's path from 8-16 KiB on this machine, and cma's RGET without its handshake).

Buffers are reused and the sender's data is not rewritten between messages, as in
cma-bench, OSU and ``mpi4py.bench``. A one-word flag in shared memory, polled in a tight
loop, says "sent" and "read"; the receiver clears the first and last byte of its buffer
before each copy and checks them after. One-way time is half the round trip::

    python bench/copy_floor.py --sizes 64K,1M --iterations 2000

prints a table (microseconds one-way, median of ``--rounds`` rounds). docs/figures/
copy-floor-2026-11-28.txt has a run beside cma-bench's and MPICH's times; docs/mpi.md
("Measured with clients nobody here wrote") says what it showed.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import statistics
import time
import traceback
from collections.abc import Callable

import numpy as np

from cma import _linux
from cma.bench.sizes import parse_size

WINDOW = 4 << 20  # bytes a direction's double copies cycle through (the eager ring's window)
# control words, each on its own 128-byte block: per rank, messages sent and messages read,
# its buffer's address; whether a process failed (the other then stops waiting)
SENT, READ, ADDRESS, FAILED = 0, 32, 64, 96


def pingpong(nbytes: int, iterations: int, way: str, piece: int) -> float:
    """One-way microseconds of ``iterations`` round trips of ``nbytes`` (after a tenth as warm-up)."""
    words = mmap.mmap(-1, mmap.PAGESIZE)
    ctl = memoryview(words).cast("q")
    shared = mmap.mmap(-1, 2 * WINDOW) if way == "double" else None
    parent = os.getpid()
    pid = os.fork()
    me = 1 if pid == 0 else 0
    try:
        os.sched_setaffinity(0, {me % (os.cpu_count() or 1)})
        move = _mover(ctl, shared, me, nbytes, way, piece, pid or parent)
        for _ in range(max(1, iterations // 10)):
            move()
        start = time.perf_counter()
        for _ in range(iterations):
            move()
        elapsed = time.perf_counter() - start
    except BaseException:
        ctl[FAILED] = 1
        if pid == 0:
            traceback.print_exc()
            os._exit(1)
        os.kill(pid, signal.SIGKILL)  # (it may be spinning for a flag that never comes)
        os.waitpid(pid, 0)
        raise
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError(f"the peer process failed (wait status {status})")
    return elapsed / iterations / 2 * 1e6


def _mover(ctl: memoryview, shared: mmap.mmap | None, me: int, nbytes: int, way: str,
           piece: int, peer_pid: int) -> Callable[[], None]:
    """One round trip as rank ``me``: rank 0 sends first."""
    src = np.full(nbytes, me + 1, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    peer = 1 - me
    marks = dst.data  # (through a memoryview, clearing both bytes takes ~70 ns, half NumPy's time)
    count = [0, 0]  # messages sent, messages received

    def wait_for(word: int, value: int) -> None:
        while ctl[word] < value:
            if ctl[FAILED]:
                raise RuntimeError(f"rank {peer} failed")

    ctl[ADDRESS + me] = _linux.local_address(src.data)
    wait_for(ADDRESS + peer, 1)  # (an address is never below 1)

    if way == "single":
        remote = _linux.iovec_array([ctl[ADDRESS + peer]], [nbytes])
        local = _linux.iovec_array([_linux.local_address(dst.data)], [nbytes])

        def send() -> None:
            count[0] += 1
            ctl[SENT + me] = count[0]
            wait_for(READ + peer, count[0])

        def recv() -> None:
            count[1] += 1
            wait_for(SENT + peer, count[1])
            marks[0] = marks[-1] = 0
            _linux.process_vm_copy(peer_pid, local, remote, write=False, what="copy floor")
            _check(dst, peer)
            ctl[READ + me] = count[1]
    else:
        assert shared is not None
        out = np.frombuffer(shared, np.uint8, WINDOW, me * WINDOW)
        inn = np.frombuffer(shared, np.uint8, WINDOW, peer * WINDOW)
        # published bytes (running counts) instead of message counts: pieces are published
        written = [0, 0]

        def send() -> None:
            at = written[0] % WINDOW if written[0] % WINDOW + nbytes <= WINDOW else 0
            for lo in range(0, nbytes, piece):
                hi = min(nbytes, lo + piece)
                out[at + lo : at + hi] = src[lo:hi]
                ctl[SENT + me] = written[0] + hi
            written[0] += nbytes
            count[0] += 1
            wait_for(READ + peer, count[0])

        def recv() -> None:
            at = written[1] % WINDOW if written[1] % WINDOW + nbytes <= WINDOW else 0
            marks[0] = marks[-1] = 0
            lo = 0
            while lo < nbytes:
                hi = min(nbytes, ctl[SENT + peer] - written[1])
                if hi > lo:
                    dst[lo:hi] = inn[at + lo : at + hi]
                    lo = hi
            written[1] += nbytes
            count[1] += 1
            _check(dst, peer)
            ctl[READ + me] = count[1]

    def round_trip(buffers: tuple[np.ndarray, ...] = (src, dst)) -> None:
        # (``buffers`` keeps src alive: with ``single`` only the peer reads it)
        if me == 0:
            send()
            recv()
        else:
            recv()
            send()
    return round_trip


def _check(dst: np.ndarray, peer: int) -> None:
    # (the receiver cleared both bytes before this message's copy)
    if dst[0] != peer + 1 or dst[-1] != peer + 1:
        raise AssertionError(f"the message from rank {peer} did not arrive")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16K,64K,256K,1M,2M",
                        help="comma-separated message sizes (default: %(default)s)")
    parser.add_argument("--pieces", default="64K",
                        help="piece sizes for the overlapped double copy (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every series runs, in turn; the median is printed")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    pieces = [parse_size(s) for s in args.pieces.split(",")]
    series = [("single", "single", 0), ("double", "double", 0)]
    series += [(f"double/{p >> 10}K", "double", p) for p in pieces]
    print("one-way us, median of", args.rounds, "rounds;", args.iterations, "round trips each")
    print(f"{'size':>8}  " + "  ".join(f"{name:>12}" for name, _, _ in series))
    for nbytes in sizes:
        times: dict[str, list[float]] = {name: [] for name, _, _ in series}
        for _ in range(args.rounds):
            for name, way, piece in series:
                times[name].append(pingpong(nbytes, args.iterations, way, piece or nbytes))
        print(f"{nbytes:>8}  " + "  ".join(f"{statistics.median(times[name]):12.1f}"
                                           for name, _, _ in series))


if __name__ == "__main__":
    main()

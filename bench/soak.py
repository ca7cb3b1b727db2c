"""Soak: many mixed messages between every pair of a cma-run world, every payload checked.

Run as every rank of a world::

    cma-run -n 16 python bench/soak.py --messages 100000          # the #24 soak, ~minutes
    cma-run -n 4 --transport shm python bench/soak.py --messages 2000

Every rank draws the same schedule from ``--seed``: rounds in which each ordered pair
exchanges 0-3 messages of mixed sizes (empty, a few bytes, KiB, up to a few MiB, so
both the eager and the rendezvous paths run), as buffers or as pickled objects, sent
with Send, Isend, Ssend or Bsend, received by Irecv from the named source or from
ANY_SOURCE. The receiver checks every byte against what the sender must have written,
and the status's source, tag and count. Each rank reads its open fds after the first round
and its resident memory after ``--warmup-messages`` (by default a tenth of the run, at
most 2,000: glibc's allocator keeps what the largest buffers took early on; see
docs/reliability.md, "Soak"), and both again at the end: a growth beyond ``--fd-slack`` fds or
``--rss-slack-mib`` raises. Rank 0 prints one JSON line with the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np

import cma

SIZES = [(0, 0), (1, 64), (65, 4096), (4097, 65536), (65537, 1 << 20), ((1 << 20) + 1, 3 << 20)]
# the range goes to 8 MiB (--max-size 8M): the top band then reaches it
SIZE_WEIGHTS = [2, 30, 30, 20, 12, 2]


def payload(src: int, dst: int, seq: int, nbytes: int) -> np.ndarray:
    """The bytes message ``seq`` from ``src`` to ``dst`` carries: distinct per message."""
    start = (src * 131 + dst * 17 + seq * 7) % 251
    return ((np.arange(nbytes, dtype=np.uint32) + start) % 251).astype(np.uint8)


Message = tuple[int, int, int, int, str, str, int, bool]  # src, dst, seq, nbytes, form, mode, tag, wild


def schedule(rng: random.Random, size: int, seq: list[int], sizes: list[tuple[int, int]] = SIZES
             ) -> list[Message]:
    """One round's messages, in sending order; every rank draws the same."""
    messages = []
    for src in range(size):
        for dst in range(size):
            if src == dst:
                continue
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                low, high = rng.choices(sizes, SIZE_WEIGHTS)[0]
                form = "object" if rng.random() < 0.15 else "buffer"
                mode = rng.choice(["Send", "Isend", "Isend", "Ssend", "Bsend"])
                number = seq[src * size + dst]
                seq[src * size + dst] += 1
                # an ANY_SOURCE receive still tells senders apart by a tag of each sender's own
                wild = rng.random() < 0.2
                tag = 1000 + src if wild else number % 7
                messages.append((src, dst, number, rng.randint(low, high), form, mode, tag, wild))
    return messages


def resources() -> tuple[int, int]:
    """(open fds, resident bytes) of this process."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))
    return len(os.listdir("/proc/self/fd")), rss


def run_round(comm: cma.Comm, messages: list[Message]) -> tuple[int, int]:
    """Post this rank's receives, send its messages, check what arrived: (messages, bytes)."""
    rank = comm.Get_rank()
    expected = []
    for src, dst, number, nbytes, form, _, tag, wild in messages:
        if dst == rank:
            source = cma.ANY_SOURCE if wild else src
            buf = None if form == "object" else np.empty(nbytes, np.uint8)
            request = comm.irecv(source=source, tag=tag) if buf is None else \
                comm.Irecv(buf, source=source, tag=tag)
            expected.append((request, src, number, nbytes, buf))
    sends = []
    for src, dst, number, nbytes, form, mode, tag, _ in messages:
        if src == rank:
            data = payload(src, dst, number, nbytes)
            if form == "object":
                sends.append(comm.isend({"src": src, "seq": number, "data": data}, dest=dst, tag=tag))
            elif mode == "Isend":
                sends.append(comm.Isend(data, dest=dst, tag=tag))
            else:
                getattr(comm, mode)(data, dest=dst, tag=tag)
    cma.Request.Waitall(sends)
    checked = 0
    for request, src, number, nbytes, buf in expected:
        status = cma.Status()
        if buf is None:
            obj = request.wait(status)
            if (obj["src"], obj["seq"]) != (src, number):
                raise AssertionError(f"rank {rank}: object {obj['src']} #{obj['seq']}, "
                                     f"expected {src} #{number}")
            data = obj["data"]
        else:
            request.Wait(status)
            data = buf
            if status.Get_count() != nbytes:
                raise AssertionError(f"rank {rank}: {status.Get_count()} bytes from {src}, expected {nbytes}")
        if status.Get_source() != src:
            raise AssertionError(f"rank {rank}: message from {status.Get_source()}, expected {src}")
        if not np.array_equal(data, payload(src, rank, number, nbytes)):
            raise AssertionError(f"rank {rank}: payload of {src} #{number} ({nbytes} B) differs")
        checked += nbytes
    return len(expected), checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages in the whole world")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--fd-slack", type=int, default=0)
    parser.add_argument("--rss-slack-mib", type=float, default=64.0)
    parser.add_argument("--warmup-messages", type=int, default=None,
                        help="messages before resident memory's baseline is read (default: "
                             "a tenth of --messages, at most 2000; at least one round)")
    parser.add_argument("--max-size", type=int, default=SIZES[-1][1],
                        help="largest message in bytes (the top size band's end; default 3 MiB)")
    args = parser.parse_args()
    sizes = [*SIZES[:-1], (SIZES[-1][0], max(args.max_size, SIZES[-1][0]))]
    comm = cma.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = random.Random(args.seed)
    seq = [0] * (size * size)
    received = verified = rounds = 0
    warmup = min(2000, args.messages // 10) if args.warmup_messages is None else args.warmup_messages
    first = warm = None  # (fds, rss) after the first round; rss once warmed up
    started = time.perf_counter()
    while sum(seq) < args.messages:
        count, nbytes = run_round(comm, schedule(rng, size, seq, sizes))
        received += count
        verified += nbytes
        rounds += 1
        comm.Barrier()
        if first is None:
            first = resources()  # after the first round: buffers and connections exist
        if warm is None and sum(seq) >= warmup:
            warm = resources()[1]
    fds, rss = resources()
    assert first is not None
    warm = first[1] if warm is None else warm
    if fds > first[0] + args.fd_slack:
        raise AssertionError(f"rank {rank}: fds grew from {first[0]} to {fds}")
    if rss > warm + args.rss_slack_mib * (1 << 20):
        raise AssertionError(f"rank {rank}: resident memory grew from {warm >> 20} MiB "
                             f"(after {warmup} messages) to {rss >> 20} MiB")
    mine = {"received": received, "bytes": verified, "fds": fds, "rss_mib": rss / (1 << 20),
            "rss_growth_mib": (rss - warm) / (1 << 20),
            "rss_growth_since_first_round_mib": (rss - first[1]) / (1 << 20)}
    if rank == 0:
        others = [comm.recv(source=r, tag=99) for r in range(1, size)]
        everyone = [mine, *others]
        print(json.dumps({
            "ranks": size, "rounds": rounds, "messages": sum(r["received"] for r in everyone),
            "bytes": sum(r["bytes"] for r in everyone), "seconds": time.perf_counter() - started,
            "fds_max": max(r["fds"] for r in everyone),
            "rss_mib_max": max(r["rss_mib"] for r in everyone),
            "rss_growth_mib_max": max(r["rss_growth_mib"] for r in everyone),
            "rss_growth_since_first_round_mib_max":
                max(r["rss_growth_since_first_round_mib"] for r in everyone),
            "transport": comm.transport,
        }), flush=True)
    else:
        comm.send(mine, dest=0, tag=99)
    comm.Barrier()
    comm.close()


if __name__ == "__main__":
    main()

"""A 3-rank world loses one rank: the two survivors still talk to each other (issue #23).

Every rank runs in a fork child of the test process, which only watches: each survivor
reports through a pipe, rank 2 SIGKILLs itself once both survivors are asleep in a
receive from it. Every wait is bounded and every child is killed in teardown.
The ``cma-run`` side (it stops the job and names the rank and the signal) is in
tests/test_run.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from conftest import SMALL_RING, TRANSPORTS, stop_process, wait_asleep_in_poll

import cma
from cma.errors import PeerGone

HANG = 30.0  # seconds: only a hang takes this long
TAG = 3
SIZES = [100, 64 << 10]  # eager and a rendezvous (16 fragments of SMALL_RING's slots)


def pidfds_open() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            pass  # (the listing's own fd)
    return count


def survivor(comm: cma.Comm, conn: Connection) -> None:
    """Rank 0 or 1: a receive from rank 2 that its death ends, then a round with the other
    survivor, both ways, at each size."""
    try:
        rank, other = comm.Get_rank(), 1 - comm.Get_rank()
        comm.Barrier()
        conn.send(("asleep next", os.getpid()))
        start = time.monotonic()
        try:
            comm.Recv(np.empty(10, np.uint8), source=2, tag=TAG)
            raise AssertionError("the receive from rank 2 returned")
        except PeerGone as exc:
            detected = time.monotonic() - start
            gone = str(exc)
        for n in SIZES:
            out = np.full(n, rank + 1, np.uint8)
            got = np.zeros(n, np.uint8)
            comm.Sendrecv(out, other, TAG, got, other, TAG)
            assert (got == other + 1).all(), f"rank {rank} got wrong bytes at {n}"
        conn.send(("ok", (gone, detected, pidfds_open())))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
    finally:
        comm.close()
        conn.close()


def victim(comm: cma.Comm, conn: Connection) -> None:
    """Rank 2: waits until both survivors sleep in their receive from it, then dies."""
    comm.Barrier()
    pids = [conn.recv(), conn.recv()]
    for pid in pids:
        wait_asleep_in_poll(pid, what=f"survivor {pid}", timeout=HANG)
    os.kill(os.getpid(), signal.SIGKILL)


def run_world(transport: str) -> list[Any]:
    ctx = mp.get_context("fork")
    fds = cma.world.WorldFds.create(3, SMALL_RING)
    comms = [cma.Comm(cma.comm._shared_fds(fds), rank, transport) for rank in range(3)]
    fds.close()
    procs, conns = [], []
    try:
        for rank, comm in enumerate(comms):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=victim if rank == 2 else survivor, args=(comm, theirs),
                               daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        for comm in comms:
            comm.close()
        for rank in (0, 1):  # the survivors' pids, to the victim
            assert conns[rank].poll(HANG), f"rank {rank} never got past its Barrier"
            kind, pid = conns[rank].recv()
            assert kind == "asleep next", pid
            conns[2].send(pid)
        results = []
        for rank in (0, 1):
            assert conns[rank].poll(HANG), f"rank {rank} hung after rank 2 died"
            kind, value = conns[rank].recv()
            assert kind == "ok", f"rank {rank} raised:\n{value}"
            results.append(value)
        procs[2].join(HANG)
        assert procs[2].exitcode == -signal.SIGKILL
        for proc in procs[:2]:
            proc.join(HANG)
            assert proc.exitcode == 0
        return results
    finally:
        for proc in procs:
            stop_process(proc, 5.0)
        for conn in conns:
            conn.close()


@pytest.mark.timeout(3 * HANG)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_survivors_of_three_still_talk(transport: str) -> None:
    results = run_world(transport)
    for rank, (gone, detected, pidfds) in enumerate(results):
        print(f"{transport}: rank {rank} PeerGone after {detected * 1000:.1f} ms: {gone}")
        assert "rank 2" in gone
        assert pidfds == 1, f"rank {rank} holds {pidfds} pidfds, not its one live peer's"

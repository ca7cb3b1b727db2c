"""A peer that exits before its first call (it never attached its end of the world).

Regression tests of issue #23: the survivor's first operation waited the whole
CMA_CONNECT_TIMEOUT (60 s) and then raised a generic ``CmaError``. Where the peer's
pid is known before it attaches (a child that unpickled its end: spawn, forkserver;
a rank started by ``cma-run``), its exit is now ``PeerGone`` naming the rank and pid
at once; where it cannot be known (a ``fork`` child), the timeout says that rank never
connected.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest
from conftest import stop_process
from test_run import cma_run

import cma
import cma.world
from cma.channel import LAUNCHED
from cma.errors import CmaError, PeerGone

# Issue #23 asks for 1 s where the pid is known; a waiting rank looks at the announced
# pid's pidfd every 5 ms at most, so it takes milliseconds (docs/reliability.md). Measured
# from the later of the exit and the call, 0.5 s leaves room for a loaded 2-CPU machine.
BOUND_SECONDS = 0.5


def exit_at_once(comm: cma.Comm) -> None:
    os._exit(3)


def note_the_time_and_exit(comm: cma.Comm, note: Connection) -> None:
    note.send(time.monotonic())  # (CLOCK_MONOTONIC is the same in every process)
    os._exit(3)


@pytest.mark.parametrize("transport", ["shm", "vmfd", "auto"])
def test_a_spawned_peer_that_exits_before_connecting_is_peer_gone(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma.world, "CONNECT_TIMEOUT", 20.0)  # the old code's wait, bounded
    a, b = cma.Pipe(transport=transport)
    ctx = mp.get_context("spawn")
    exits, note = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=note_the_time_and_exit, args=(b, note))
    try:
        proc.start()
        b.close()
        note.close()
        start = time.monotonic()
        with pytest.raises(PeerGone) as caught:
            a.Recv(np.empty(4), source=1)
        raised = time.monotonic()
        assert exits.poll(5), "the child did not note when it exited"
        exited = exits.recv()
        print(f"{transport}: PeerGone {(raised - exited) * 1000:.1f} ms after the child's exit, "
              f"{(raised - start) * 1000:.0f} ms after the first Recv (the child's start included)")
        assert f"rank 1 (pid {proc.pid})" in str(caught.value)
        assert "before connecting" in str(caught.value)
        assert raised - max(exited, start) < BOUND_SECONDS
    finally:
        a.close()
        stop_process(proc)
        exits.close()


def test_a_forked_peer_that_exits_before_connecting_is_named_at_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma.world, "CONNECT_TIMEOUT", 1.0)
    a, b = cma.Pipe(transport="shm")
    proc = mp.get_context("fork").Process(target=exit_at_once, args=(b,))
    try:
        proc.start()
        b.close()
        proc.join(10)
        with pytest.raises(CmaError) as caught:
            a.Recv(np.empty(4), source=1)
        assert "rank 1 never connected" in str(caught.value)
        assert "CMA_CONNECT_TIMEOUT" in str(caught.value)
    finally:
        a.close()
        stop_process(proc)


def announced_pid(comm: cma.Comm, rank: int) -> int:
    world = cma.world.World(comm._fds, comm.rank)
    try:
        return world.header[world._word(rank, LAUNCHED)]
    finally:
        world.close()


def test_an_end_passed_on_through_fork_is_announced_no_more() -> None:
    """An end unpickled here (as in a spawned child) names this process; after a fork
    either process may use it, so the name is withdrawn and nobody's exit is taken for
    the rank's."""
    a, b = cma.Pipe(transport="shm")
    mine = pickle.loads(pickle.dumps(b))
    b.close()
    try:
        assert announced_pid(a, 1) == os.getpid()
        proc = mp.get_context("fork").Process(target=os._exit, args=(0,))
        proc.start()
        stop_process(proc)
        assert announced_pid(a, 1) == 0
    finally:
        mine.close()
        a.close()


RANK_1_NEVER_USES_CMA = """
import os, sys, time
import numpy as np
if os.environ["CMA_WORLD"].split(":")[1] == "1":
    with open(os.path.join(sys.argv[1], "exited"), "w") as f:
        f.write(repr(time.monotonic()))
    sys.exit(0)  # exits cleanly without ever touching COMM_WORLD
import cma
start = time.monotonic()
try:
    cma.COMM_WORLD.Recv(np.empty(1), source=1)
except cma.errors.PeerGone as exc:
    print(f"{start!r} {time.monotonic()!r} {exc}")
    sys.exit(0)
sys.exit(5)
"""


def test_a_cma_run_rank_that_exits_without_connecting_is_peer_gone(tmp_path) -> None:
    code, out, err, _ = cma_run(["-n", "2", "--timeout", "30"], RANK_1_NEVER_USES_CMA, tmp_path,
                                env={"CMA_CONNECT_TIMEOUT": "20"})
    assert code == 0, err
    start, raised, message = out.split(" ", 2)
    exited = float((tmp_path / "exited").read_text())  # (a little before the exit itself)
    took = float(raised) - max(exited, float(start))
    print(f"cma-run: PeerGone {took * 1000:.1f} ms after the later of rank 1's exit and the "
          "first Recv")
    assert "rank 1 (pid" in message and "before connecting" in message
    assert took < BOUND_SECONDS

"""The fd server (a rank's abstract Unix socket that hands its /proc/self/mem fd to peers).

Regression tests of issue #23: a client that connected and sent nothing stalled the
server (it read each request with no timeout, one client at a time), so a vmfd peer's
connect waited; a request of invalid UTF-8 killed the server thread with a traceback.
Kept as well: a process of another uid is handed no fd.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np
import pytest
from _peers import NOBODY, run_in_child
from conftest import Peer, stop_process

import cma
import cma.world
from cma import _linux

TAG = 3


def server_address(comm: cma.Comm, rank: int) -> str:
    return f"\0cma-{comm._fds.world_id}-{rank}"


def ask(address: str, request: bytes) -> tuple[bytes, list[int]]:
    """Connect to an fd server, send ``request``; its answer and the fds that came with it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(address)
        try:
            sock.sendall(request)
        except BrokenPipeError:
            pass  # refused at accept: the refusal is already waiting to be read
        return _linux.recv_fds(sock, 256, 1)


def timed_connect(comm: cma.Comm, go: mp.synchronize.Event, conn: mp.connection.Connection) -> None:
    """Rank 1: once told to, connect (fetching rank 0's fd) and report how long it took."""
    try:
        assert go.wait(30)
        start = time.monotonic()
        comm.attach()
        elapsed = time.monotonic() - start
        comm.Send(np.arange(4), dest=0, tag=TAG)
        conn.send(("ok", elapsed))
        comm.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", repr(exc)))


def hold_silently(address: str, held: list[socket.socket], ready: threading.Event) -> None:
    """Connect to ``address`` as soon as it listens, then send nothing."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            time.sleep(0.001)
            continue
        held.append(sock)
        ready.set()
        return


def test_a_silent_client_does_not_delay_a_peers_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    # bounds the old code's stall (its fetch waits this long, then vmfd is refused)
    monkeypatch.setattr(cma.world, "CONNECT_TIMEOUT", 5.0)
    ctx = mp.get_context("fork")
    a, b = cma.Pipe(transport="vmfd")
    go = ctx.Event()
    results, report = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=timed_connect, args=(b, go, report))
    held: list[socket.socket] = []
    ready = threading.Event()
    hog = threading.Thread(target=hold_silently, args=(server_address(a, 0), held, ready))
    try:
        proc.start()
        report.close()
        b.close()
        hog.start()
        # rank 1 starts connecting only once the silent client holds rank 0's server
        threading.Thread(target=lambda: ready.wait(30) and go.set(), daemon=True).start()
        a.Recv(got := np.empty(4, np.int64), source=1, tag=TAG)
        assert got.tolist() == [0, 1, 2, 3]
        assert held, "the silent client never connected"
        assert results.poll(30)
        status, elapsed = results.recv()
        assert status == "ok", elapsed
        print(f"rank 1 connected in {elapsed * 1000:.1f} ms with a silent client on rank 0's server")
        assert elapsed < 1.5
    finally:
        hog.join(30)
        for sock in held:
            sock.close()
        a.close()
        stop_process(proc)
        results.close()



def send_malformed(comm: cma.Comm) -> tuple[bytes, int]:
    """In the peer: an invalid UTF-8 request to rank 0, then a good one; (reply, fds got)."""
    reply, fds = ask(server_address(comm, 0), b"\xff\xfe-not-utf-8")
    assert not fds
    _, good = ask(server_address(comm, 0), b"mem-ro")
    for fd in good:
        os.close(fd)
    return reply, len(good)


def test_a_malformed_request_is_refused_quietly(capfd: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    peer = Peer("vmfd")
    try:
        reply, good_fds = peer.call(send_malformed)
    finally:
        peer.stop()
    assert reply.startswith(b"refused: malformed request")
    assert good_fds == 1, "the server stopped answering after the malformed request"
    assert died == [], "the fd server thread raised"
    assert capfd.readouterr().err == ""


def request_as_nobody(address: str) -> tuple[bytes, int]:
    return_fds = ask(address, b"mem-ro")
    for fd in return_fds[1]:
        os.close(fd)
    return return_fds[0], len(return_fds[1])


def test_another_uid_is_handed_no_fd() -> None:
    peer = Peer("vmfd")
    try:
        peer.call(_attached)
        address = server_address(peer.comm, 0)
        reply, count = run_in_child(lambda: request_as_nobody(address), uid=NOBODY, timeout=30)
        assert count == 0
        assert reply.startswith(b"refused: not a process of this world")
        # nor does a process of our uid outside the world get one
        reply, count = run_in_child(lambda: request_as_nobody(address), timeout=30)
        assert count == 0
        assert reply.startswith(b"refused: not a process of this world")
    finally:
        peer.stop()


def _attached(comm: cma.Comm) -> None:
    comm.attach()

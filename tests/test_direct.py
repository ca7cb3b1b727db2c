"""The direct rendezvous (cma/direct.py): a blocking Send from DIRECT_FROM bytes offers its
buffer by region, and a blocking Recv that finds that offer at the head of its ring pulls
it with one copy, neither through the engine. Every way off that path (a posted receive,
a buffer too small, a transport that does not pull, a dead peer, an interrupt) must end
as the engine's rendezvous would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import JOIN_TIMEOUT, TRANSPORTS, engine_packet_kinds, run_pair, run_ranks, stop_process

import cma
from cma import direct
from cma.channel import Inbox
from cma.connect import NEVER
from cma.errors import CommBroken, ConcurrentUse, InvalidTag, PeerGone, TruncationError
from cma.transports import REGISTRY
from cma.wire import RTS

SIZES = [direct.DIRECT_FROM, 1 << 20, cma.ChannelConfig().eager_limit]
TAG = 7
SETTLE = 0.2  # seconds for the other rank to leave a call before a packet comes
# the transports whose receiver pulls with one copy (the direct path): not shm, which only
# stages, nor vmfd, whose /proc/PID/mem reads copy twice (through a kernel page)
PULLING = [name for name in TRANSPORTS if name == "auto" or "pull" in REGISTRY.classes[name].styles
           and REGISTRY.classes[name].copies.total == 1]


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def counting_direct_receives(comm: cma.Comm, patch: pytest.MonkeyPatch | None = None
                             ) -> list[int]:
    """Count, in this process, the receives the direct path completed (their sizes); with
    ``patch``, until the test's end (a child's count lasts as long as the child)."""
    taken: list[int] = []
    original = direct.DirectRendezvous.recv

    def recv(self: direct.DirectRendezvous, inbox: Inbox, mv: memoryview, tag: int) -> int:
        n = original(self, inbox, mv, tag)
        if n >= 0:
            taken.append(n)
        return n

    if patch is None:
        direct.DirectRendezvous.recv = recv  # type: ignore[method-assign]
    else:
        patch.setattr(direct.DirectRendezvous, "recv", recv)
    return taken


def op_recv_direct(comm: cma.Comm, nbytes: int, seed: int, tag: int) -> dict[str, Any]:
    """Say "ready", then Recv one message and report what came and how. (The sender waits
    for "ready": otherwise the command's own receive could take its offer into the
    engine's unexpected queue, which Recv then takes through the engine.)"""
    taken = counting_direct_receives(comm)
    comm.send("ready", dest=0, tag=TAG + 2)
    comm.reset_stats()
    buf = np.zeros(nbytes, np.uint8)
    status = cma.Status()
    comm.Recv(buf, source=0, tag=tag, status=status)
    return {"same": bool((buf == pattern(nbytes, seed)).all()), "direct": list(taken),
            "source": status.source, "tag": status.tag, "count": status.count,
            "stats": comm.stats()}


@pytest.mark.parametrize("nbytes", SIZES)
def test_a_blocking_send_is_pulled_with_one_copy(peer, transport, nbytes):
    """From DIRECT_FROM up to the eager limit a blocking Send to a receiver in Recv is
    pulled by a transport (cma: one kernel copy), not copied through the ring twice; the
    status is right."""
    peer.start(op_recv_direct, nbytes, 1, cma.ANY_TAG)
    assert peer.comm.recv(source=1, tag=TAG + 2) == "ready"
    outbox = peer.comm._progress.outboxes[1]
    eager_sent = outbox.eager_count
    peer.comm.Send(pattern(nbytes, 1), dest=1, tag=TAG)
    eager_sent = outbox.eager_count - eager_sent
    got = peer.result()
    assert got["same"]
    assert (got["source"], got["tag"], got["count"]) == (0, TAG, nbytes)
    if transport not in PULLING:
        assert got["direct"] == [] and got["stats"]["eager"]["messages"] == 1
        return
    assert got["direct"] == [nbytes], "the receive did not take the direct path"
    pulled = {name: s for name, s in got["stats"].items() if name != "eager" and s["messages"]}
    assert len(pulled) == 1, pulled
    (name, stats), = pulled.items()
    copies = REGISTRY.classes[name].copies
    assert stats["bytes"] == nbytes
    assert (stats["user_copies"], stats["kernel_copies"]) == (copies.user, copies.kernel)
    assert got["stats"]["eager"]["messages"] == 0
    assert eager_sent == 0


def _recv_while_a_split_packet_is_joined(comm: cma.Comm) -> list:
    kinds = engine_packet_kinds(comm)
    progress = comm._progress
    # as if rank 1 had sent the first, empty, piece of a split packet: its next packet is
    # that packet's next piece, which the engine joins, whatever it looks like alone
    progress.joiner.partial[1] = bytearray()
    buf = np.zeros(1 << 20, np.uint8)
    comm.Recv(buf, 1, TAG)
    out = [bool((buf == pattern(1 << 20, 5)).all()), RTS in kinds, 1 in progress.joiner]
    comm.Barrier()
    return out


def _send_direct(comm: cma.Comm) -> None:
    comm.Send(pattern(1 << 20, 5), 0, TAG)
    comm.Barrier()


def test_the_direct_path_leaves_the_ring_to_the_engine_while_a_split_packet_is_joined():
    """While a peer's control packet split in pieces is half joined, the packet at the head
    of its ring is a piece (an RTS kind and size alone do not make it an offer): the
    receive takes the general path, whose engine joins it."""
    got = run_ranks("cma", cma.ChannelConfig(), [_recv_while_a_split_packet_is_joined, _send_direct],
                    timeout=60)
    assert got == [[True, True, False], None]


def op_post_then_recv(comm: cma.Comm, nbytes: int, seed: int) -> bool:
    """An Irecv posted before the message comes, then waited on: the engine takes it."""
    buf = np.zeros(nbytes, np.uint8)
    req = comm.Irecv(buf, source=0, tag=TAG)
    comm.send("posted", dest=0, tag=TAG + 1)
    req.Wait()
    return bool((buf == pattern(nbytes, seed)).all())


def test_a_posted_receive_takes_the_offer_through_the_engine(peer):
    nbytes = direct.DIRECT_FROM
    peer.start(op_post_then_recv, nbytes, 2)
    assert peer.comm.recv(source=1, tag=TAG + 1) == "posted"
    peer.comm.Send(pattern(nbytes, 2), dest=1, tag=TAG)
    assert peer.result()


def op_recv_too_small(comm: cma.Comm, nbytes: int) -> str:
    try:
        comm.Recv(np.zeros(nbytes // 2, np.uint8), source=0, tag=TAG)
    except TruncationError as exc:
        return f"{exc.nbytes} {exc.capacity}"
    return "no error"


def test_an_offer_larger_than_the_buffer_truncates_and_frees_the_sender(peer):
    nbytes = direct.DIRECT_FROM
    peer.start(op_recv_too_small, nbytes)
    peer.comm.Send(pattern(nbytes, 3), dest=1, tag=TAG)  # returns: the message was consumed
    assert peer.result() == f"{nbytes} {nbytes // 2}"


def op_recv_other_tag_first(comm: cma.Comm, nbytes: int) -> bool:
    """The offer (tag TAG) waits at the head of the ring while a Recv for TAG + 1 runs."""
    big = np.zeros(nbytes, np.uint8)
    small = np.zeros(8, np.uint8)
    req = comm.Irecv(big, source=0, tag=TAG)  # (so the sender's later eager one can come)
    comm.Recv(small, source=0, tag=TAG + 1)
    req.Wait()
    return bool((big == pattern(nbytes, 4)).all()) and bool((small == 9).all())


def test_an_offer_for_another_tag_is_left_to_the_engine(peer):
    nbytes = direct.DIRECT_FROM
    peer.start(op_recv_other_tag_first, nbytes)
    peer.comm.Isend(np.full(8, 9, np.uint8), dest=1, tag=TAG + 1).Wait()
    peer.comm.Send(pattern(nbytes, 4), dest=1, tag=TAG)
    assert peer.result()


def test_below_direct_from_a_send_stays_eager(peer, transport):
    """A message just under DIRECT_FROM still goes through the ring (Send returns at once)."""
    nbytes = direct.DIRECT_FROM - 1
    peer.start(op_recv_direct, nbytes, 5, TAG)
    assert peer.comm.recv(source=1, tag=TAG + 2) == "ready"
    peer.comm.Send(pattern(nbytes, 5), dest=1, tag=TAG)
    got = peer.result()
    assert got["same"] and got["direct"] == []
    assert got["stats"]["eager"]["messages"] == 1


def op_exchange(comm: cma.Comm, nbytes: int, how: str) -> dict[str, Any]:
    """Exchange messages of ``nbytes`` with rank 0 (``how``: a Sendrecv, or an Irecv
    posted before a blocking Send, which the engine matches), after saying "ready"."""
    taken = counting_direct_receives(comm)
    out, buf = pattern(nbytes, 2), np.zeros(nbytes, np.uint8)
    comm.send("ready", dest=0, tag=TAG + 2)
    # (rank 0's receive of "ready" must have returned first: a pass of its engine there
    # would take this rank's offer as unexpected, and its Recv then through the engine)
    time.sleep(SETTLE)
    if how == "Sendrecv":
        comm.Sendrecv(out, 0, TAG, buf, 0, TAG)
    else:
        req = comm.Irecv(buf, source=0, tag=TAG)
        comm.Send(out, dest=0, tag=TAG)
        req.Wait()
    return {"same": bool((buf == pattern(nbytes, 1)).all()), "direct": list(taken)}


@pytest.mark.parametrize("how", ["Sendrecv", "Irecv then Send"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_a_sendrecv_offers_its_message_as_a_blocking_send_does(peer, transport, nbytes, how,
                                                               monkeypatch):
    """A Sendrecv of DIRECT_FROM bytes or more makes no request: it offers its message
    as a blocking Send does, receives (pulling the peer's offer if it is one), then waits
    for the peer's copy, whether the peer pulled it on its fast path or in its engine.
    (It was Isend + Recv + Wait: the eager ring's two copies each way, or the engine's
    rendezvous; 2 ranks, 1 MiB each way, 0.25 ms against 0.12, docs/architecture.md.)"""
    comm = peer.comm
    peer.start(op_exchange, nbytes, how)
    assert comm.recv(source=1, tag=TAG + 2) == "ready"
    mine = counting_direct_receives(comm, monkeypatch)

    def no_request(*args: Any) -> None:
        raise AssertionError("Sendrecv made a request")

    pulling = transport in PULLING
    if pulling:
        monkeypatch.setattr(comm, "make_request", no_request)
    buf = np.zeros(nbytes, np.uint8)
    comm.Sendrecv(pattern(nbytes, 1), 1, TAG, buf, 1, TAG)
    monkeypatch.undo()
    got = peer.result()
    assert got["same"] and (buf == pattern(nbytes, 2)).all()
    if pulling:
        assert got["direct"] == ([nbytes] if how == "Sendrecv" else [])
        assert mine == [nbytes], "the receive did not pull the peer's offer"
    else:
        assert got["direct"] == mine == []


def _exchange_with_everyone(comm: cma.Comm) -> None:
    """Connect every pair (a peer connecting is work that ends a receive's wait), then
    line up."""
    for peer in range(comm.size):
        if peer != comm.rank:
            comm.sendrecv(None, peer, TAG + 3, source=peer, recvtag=TAG + 3)
    comm.Barrier()


def _engine_calls(comm: cma.Comm) -> list[str]:
    """From now on, record each time ``comm`` takes its general (engine) paths."""
    calls: list[str] = []

    def counting(name: str, call: Any) -> Any:
        def counted(*args: Any) -> Any:
            calls.append(name)
            return call(*args)
        return counted

    for name in ("general_recv", "general_send"):
        setattr(comm, name, counting(name, getattr(comm, name)))
    return calls


def _sendrecv_to_1_from_last(comm: cma.Comm, nbytes: int) -> dict[str, Any]:
    _exchange_with_everyone(comm)
    calls = _engine_calls(comm)
    buf = np.zeros(nbytes, np.uint8)
    comm.Sendrecv(pattern(nbytes, 0), 1, TAG, buf, comm.size - 1, TAG)
    engine = list(calls)
    comm.Barrier()  # (a peer that exits meanwhile also ends a wait)
    return {"same": bool((buf == pattern(nbytes, 2)).all()), "engine": engine}


def _pull_from_rank_0(comm: cma.Comm, nbytes: int) -> bool:
    _exchange_with_everyone(comm)
    buf = np.zeros(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=TAG)
    if comm.rank == comm.size - 1:  # (two ranks: this one also sends the late message)
        _send_late_to_rank_0(comm, nbytes)
    else:
        comm.Barrier()
    return bool((buf == pattern(nbytes, 0)).all())


def _send_late_to_rank_0(comm: cma.Comm, nbytes: int) -> None:
    time.sleep(SETTLE)  # (rank 1's FIN reaches rank 0 first, while its receive waits)
    comm.Send(pattern(nbytes, 2), dest=0, tag=TAG)
    comm.Barrier()


def _connect_then_send_late(comm: cma.Comm, nbytes: int) -> bool:
    _exchange_with_everyone(comm)
    _send_late_to_rank_0(comm, nbytes)
    return True


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("transport", PULLING)
def test_a_sendrecv_takes_the_fin_of_its_offer_while_its_receive_waits(transport, ranks):
    """Rank 0 Sendrecvs to rank 1 and from the last rank, which sends late: rank 1's FIN
    comes while rank 0's receive waits, from another rank or (2 ranks) ahead of the
    message in the same ring. The receive takes that FIN and goes on waiting, so it still
    pulls the late offer on the fast path and the send needs no engine. (The FIN ended
    the wait before, and that receive went through the engine, ~130 us of Python;
    docs/architecture.md, "Direct rendezvous".)"""
    nbytes = direct.DIRECT_FROM
    funcs = [lambda c: _sendrecv_to_1_from_last(c, nbytes), lambda c: _pull_from_rank_0(c, nbytes),
             lambda c: _connect_then_send_late(c, nbytes)][:ranks]
    got, pulled, *_ = run_ranks(transport, cma.ChannelConfig(), funcs, timeout=60)
    assert got["same"] and pulled
    assert got["engine"] == [], "rank 0's Sendrecv went through the engine"


# ------------------------------------------------------------------ faults


def _sender_dies_while_offering(comm: cma.Comm, go: int) -> None:
    comm.attach()
    comm.Barrier()
    # (only once the test process has left its Barrier: a pass of its progress there
    # would take the offer into its engine, off the head of the ring the test watches)
    assert os.read(go, 1) == b"x"
    comm.Send(pattern(direct.DIRECT_FROM, 6), dest=0, tag=TAG)  # killed while waiting here


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", PULLING)
def test_a_sender_killed_while_its_offer_waits_leaves_peergone(transport):
    """The receiver finds the offer of a process that was killed and reaped: PeerGone, and
    nothing copied into its buffer."""
    a, b = cma.Pipe(transport)
    go_r, go_w = os.pipe()
    proc = mp.get_context("fork").Process(target=_sender_dies_while_offering,
                                          args=(b, go_r), daemon=True)
    try:
        proc.start()
        b.close()
        a.Barrier()
        os.write(go_w, b"x")
        inbox = a._progress.inboxes[1]
        deadline = time.monotonic() + JOIN_TIMEOUT
        while inbox.head_of(RTS, direct.ONE_REGION_RTS.size) < 0:
            assert time.monotonic() < deadline, "the offer never came"
            time.sleep(0.001)
        proc.kill()
        proc.join(JOIN_TIMEOUT)
        buf = np.zeros(direct.DIRECT_FROM, np.uint8)
        with pytest.raises(PeerGone, match="rank 1"):
            a.Recv(buf, source=1, tag=TAG)
        assert not buf.any()
    finally:
        stop_process(proc)
        a.close()
        os.close(go_r)
        os.close(go_w)


def _receiver_exits_without_receiving(comm: cma.Comm) -> str:
    comm.Barrier()
    while not comm.Iprobe(source=0, tag=TAG):  # the offer is here: leave without taking it
        time.sleep(0.001)
    os._exit(0)


def _send_to_a_receiver_that_exits(comm: cma.Comm) -> str:
    comm.Barrier()
    try:
        comm.Send(pattern(direct.DIRECT_FROM, 7), dest=1, tag=TAG)
    except PeerGone as exc:
        return f"PeerGone: {exc}"
    return "returned"


@pytest.mark.timeout(60)
def test_a_receiver_that_exits_ends_the_senders_wait_with_peergone():
    ctx = mp.get_context("fork")
    a, b = cma.Pipe("auto")
    out_r, out_w = ctx.Pipe(duplex=False)

    def rank0() -> None:
        out_w.send(_send_to_a_receiver_that_exits(a))

    sender = ctx.Process(target=rank0, daemon=True)
    receiver = ctx.Process(target=_receiver_exits_without_receiving, args=(b,), daemon=True)
    try:
        sender.start()
        receiver.start()
        a.close()
        b.close()
        assert out_r.poll(JOIN_TIMEOUT), "the sender still waits for a receiver that exited"
        assert out_r.recv().startswith("PeerGone: ")
    finally:
        stop_process(sender)
        stop_process(receiver)


def _interrupted_in_the_senders_spin(comm: cma.Comm) -> str:
    """The first wait for the FIN raises KeyboardInterrupt (as a Ctrl-C there would): the
    engine knew the send before its RTS went out, so the FIN that comes later is no
    protocol error and the communicator stays usable."""
    comm.attach()
    original = Inbox.take_if

    def interrupted(self: Inbox, kind: int, aux: int) -> int:
        Inbox.take_if = original  # type: ignore[method-assign]
        raise KeyboardInterrupt

    Inbox.take_if = interrupted  # type: ignore[method-assign]
    try:
        comm.Send(pattern(direct.DIRECT_FROM, 8), dest=1, tag=TAG)
    except KeyboardInterrupt:
        pass
    else:
        return "no interrupt"
    comm.Send(np.full(16, 1, np.uint8), dest=1, tag=TAG + 1)  # (the general path drains the FIN)
    comm.Barrier()
    return "usable"


def _receive_both(comm: cma.Comm) -> bool:
    big = np.zeros(direct.DIRECT_FROM, np.uint8)
    small = np.zeros(16, np.uint8)
    comm.Recv(big, source=0, tag=TAG)
    comm.Recv(small, source=0, tag=TAG + 1)
    comm.Barrier()
    return bool((big == pattern(direct.DIRECT_FROM, 8)).all()) and bool((small == 1).all())


@pytest.mark.timeout(60)
def test_an_interrupt_in_the_senders_wait_hands_the_send_to_the_engine():
    assert run_pair("auto", None, _interrupted_in_the_senders_spin, _receive_both) == [
        "usable", True]


def _interrupted_in_the_receivers_copy(comm: cma.Comm) -> str:
    comm.attach()
    transport = comm._progress.transports["cma"]

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    transport.read = interrupted
    try:
        comm.Recv(np.zeros(direct.DIRECT_FROM, np.uint8), source=0, tag=TAG)
    except KeyboardInterrupt:
        pass
    else:
        return "no interrupt"
    try:
        comm.Iprobe(source=0, tag=TAG)
    except CommBroken as exc:
        return str(exc)
    return "usable"


def _send_to_an_interrupted_receiver(comm: cma.Comm) -> str:
    try:
        comm.Send(pattern(direct.DIRECT_FROM, 9), dest=1, tag=TAG)
    except PeerGone:
        return "PeerGone"  # (the receiver closed its broken communicator and exited)
    return "returned"


@pytest.mark.timeout(60)
def test_an_interrupt_in_the_receivers_copy_breaks_the_communicator():
    """A copy cut short leaves a message half received that its sender waits for: the
    communicator refuses further use, naming the interrupt, as the engine's pull does."""
    sent, broken = run_pair("cma", None, _send_to_an_interrupted_receiver,
                            _interrupted_in_the_receivers_copy)
    assert "KeyboardInterrupt" in broken and "unusable" in broken, broken
    assert sent == "PeerGone"


def op_recv_once_released(comm: cma.Comm, nbytes: int, seed: int, path: str) -> bool:
    """Recv once ``path`` exists (the test's other thread has done its check by then)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.001)
    buf = np.zeros(nbytes, np.uint8)
    comm.Recv(buf, source=0, tag=TAG)
    return bool((buf == pattern(nbytes, seed)).all())


def test_a_second_thread_during_the_senders_wait_gets_concurrentuse(peer, transport, tmp_path):
    if transport not in PULLING:
        pytest.skip("shm sends eagerly: its Send does not wait for the receiver")
    nbytes = direct.DIRECT_FROM
    release = tmp_path / "release"
    peer.start(op_recv_once_released, nbytes, 10, str(release))
    entered = threading.Event()
    outcome: list[BaseException | None] = []
    original = Inbox.take_if

    def take_if(self: Inbox, kind: int, aux: int) -> int:
        entered.set()
        return original(self, kind, aux)

    def send() -> None:
        try:
            peer.comm.Send(pattern(nbytes, 10), dest=1, tag=TAG)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    Inbox.take_if = take_if  # type: ignore[method-assign]
    sender = threading.Thread(target=send)
    try:
        sender.start()
        assert entered.wait(JOIN_TIMEOUT)
        with pytest.raises(ConcurrentUse):
            peer.comm.Iprobe(source=1, tag=TAG)
    finally:
        Inbox.take_if = original  # type: ignore[method-assign]
        release.touch()
        sender.join(JOIN_TIMEOUT)
    assert outcome == [None]
    assert peer.result()


@pytest.mark.timeout(120)
def test_the_ab_bench_compares_the_two_paths_it_names() -> None:
    """bench/direct_ab.py, whose run docs/architecture.md quotes: each path's blocks moved
    the receiver's messages the way the path says (pulled, or through the ring)."""
    script = Path(__file__).resolve().parents[1] / "bench" / "direct_ab.py"
    result = subprocess.run([sys.executable, str(script), "--sizes", "64K,512K", "--block", "20",
                             "--blocks", "2"], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = result.stdout.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["65536", "524288"], result.stdout
    for row in rows:
        assert "'direct': {'cma': 21}" in row and "'eager': {'eager': 42}" in row, row


@pytest.mark.parametrize("setting, expected", [("", 256 << 10), ("off", NEVER), ("1048576", 1 << 20),
                                               ("0", 1)])
def test_the_setting_names_the_smallest_direct_message(setting, expected):
    assert direct.direct_from(setting) == expected


@pytest.mark.parametrize("setting", ["-1", "256K", "on"])
def test_a_setting_that_is_no_size_is_refused(setting):
    with pytest.raises(ValueError, match="CMA_DIRECT_FROM"):
        direct.direct_from(setting)


def op_direct_from(comm: cma.Comm) -> int:
    return comm._direct_from


@pytest.mark.timeout(60)
def test_cma_direct_from_off_keeps_blocking_sends_in_the_ring():
    """Where the ring's copies are the faster (a host whose caches keep them warm), the
    setting turns the direct rendezvous off: a blocking Send within the eager limit is
    eager again, and returns at once."""
    code = (
        "import numpy as np, cma, multiprocessing as mp\n"
        "a, b = cma.Pipe()\n"
        "def child(b):\n"
        "    b.Recv(np.zeros(1 << 20, np.uint8), source=0, tag=1)\n"
        "    b.send(b.stats()['eager']['messages'], dest=0, tag=2)\n"
        "    b.close()\n"
        "p = mp.get_context('fork').Process(target=child, args=(b,)); p.start(); b.close()\n"
        "a.Send(np.ones(1 << 20, np.uint8), dest=1, tag=1)\n"
        "print(a.recv(source=1, tag=2)); a.close(); p.join(10)\n")
    env = {**os.environ, direct.ENV_DIRECT_FROM: "off"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=50, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"]  # (the child's one eager message: the 1 MiB one)


def test_a_tag_out_of_range_is_refused_before_anything_is_offered(peer):
    """2**63 does not fit the packet's tag word: InvalidTag, as for an eager message, not
    a ValueError from the ring."""
    with pytest.raises(InvalidTag):
        peer.comm.Send(pattern(direct.DIRECT_FROM, 11), dest=1, tag=2**63)

"""A corrupted or hostile peer: bytes it shares that make no sense (issue #23).

Whatever a peer writes into its ring, its packets or the world header, the receiver
raises a ``cma.errors`` exception (``ProtocolError`` naming the peer where the bytes
are decoded; ``CommBroken`` on every later call) or receives a message: never another
exception, never a write outside the receive buffer, never a hang.

Two layers: the decoders fed directly with hypothesis (sans-IO, many cheap examples),
and processes, where a peer scribbles over its shared mappings after sending and the
receiver (itself a child, so that a hang fails the test instead of blocking it) then
receives. ``CMA_FUZZ_CASES`` sets how many process-level cases run (a handful in CI).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import select
import time

import numpy as np
import pytest
from conftest import run_ranks, stop_process
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cma
import cma.world
from cma.channel import HEAD, PAD, PID, TAIL, ChannelConfig, Inbox, packet_bytes
from cma.errors import CmaError, CommBroken, ProtocolError
from cma.protocol import (
    ADDRESS_LIMIT,
    PIPELINE,
    PULL,
    PUSH,
    Deliver,
    Engine,
    Joiner,
    Policy,
    Pull,
    Push,
    decode_cts,
    decode_rts,
    encode_cts,
    encode_rts,
    split_packet,
)
from cma.wire import CTS, EAGER, FIN, MORE, OBJECT, RTS, SYNC, Region

PEER = 1
CONFIG = ChannelConfig(eager_limit=1024, ring_bytes=4096, frag_size=4096, stage_slots=2)
FUZZ_CASES = int(os.environ.get("CMA_FUZZ_CASES", "4"))
GUARD = 64  # bytes either side of a receive buffer that must stay untouched
GUARD_BYTE = 0xA5

int64 = st.integers(-(2**63), 2**63 - 1)
# lengths and words a forger would try first, then anything
words = st.one_of(st.sampled_from([0, 1, -1, 8, 4095, 4096, 2**31, 2**62, -(2**63), 2**63 - 1]),
                  int64)
kinds = st.one_of(st.sampled_from([EAGER, RTS, CTS, FIN, PAD, EAGER | OBJECT, EAGER | SYNC,
                                   RTS | OBJECT, CTS | OBJECT, FIN | SYNC, 0x5C43, 0]), int64)


def make_engine() -> Engine:
    policy = Policy(order=["self", "cma", "shm"], pullable={PEER: {"cma"}},
                    pushable={PEER: {"cma"}}, staged={"shm"})
    return Engine(0, CONFIG.eager_limit, policy, PULL | PUSH | PIPELINE,
                  allocate=lambda n: np.empty(n, np.uint8).data,  # (as Progress: untouched)
                  region_of=lambda mv: Region(0x10000, mv.nbytes),
                  max_object_bytes=1 << 30)  # (Progress: the machine's memory; here what a test may take)


def engine_with_state() -> tuple[Engine, memoryview]:
    """An engine with a receive posted, a rendezvous send awaiting its CTS and one awaiting
    its sender's push: some forged CTS and FIN packets name something that exists."""
    engine = make_engine()
    buffer = memoryview(bytearray(256))
    engine.recv(PEER, 5, buffer)
    engine.send(PEER, 6, [memoryview(bytearray(5000))], eager=False)
    engine.recv(PEER, 7, memoryview(bytearray(8192)))
    engine.packet(PEER, RTS, 7, 8192, encode_rts(1, PUSH, [8192], None))
    return engine, buffer


def check_actions(actions: list, buffer: memoryview) -> None:
    """What the engine asks the I/O layer to do stays within the buffers involved."""
    for action in actions:
        if isinstance(action, Deliver) and action.op.buffer is not None:
            assert len(action.payload) <= action.op.buffer.nbytes
        if isinstance(action, Pull | Push):
            remote = sum(r.nbytes for r in action.remote)
            local = sum(v.nbytes for v in action.local)
            assert remote == local
            assert all(0 <= r.addr and r.addr + r.nbytes <= ADDRESS_LIMIT for r in action.remote)


# ------------------------------------------------------------------ the decoders, sans-IO

rts_payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda msgid, offers, sizes, addrs: encode_rts(
        msgid, offers, sizes, [Region(a, n) for a, n in zip(addrs, sizes, strict=False)]
        if len(addrs) >= len(sizes) else None),
        words, words, st.lists(words, max_size=4), st.lists(words, max_size=4)),
)
cts_payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda msgid, recvid, mode, name, spans: encode_cts(
        msgid, recvid, mode, name, [Region(a, n) for a, n in spans]),
        st.sampled_from([0, 1, 2, 99]), words, words,
        st.sampled_from(["cma", "shm", "self", "nope", "x y"]),
        st.lists(st.tuples(words, words), max_size=3)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds, words, words, st.one_of(rts_payloads, cts_payloads))
@example(0x5C43, 0, 0, b"").via("the issue's unknown packet kind")
@example(CTS, 0, 0, encode_cts(12345, 1, PUSH, "cma", [])).via("a CTS for no message")
@example(FIN, 0, 777, b"").via("a FIN for no message")
@example(RTS, 7, 100, encode_rts(3, PULL, [100], [Region(2**63 - 50, 100)])).via("wrapping region")
@example(RTS, 7, 100, encode_rts(3, PULL, [-5, 105], None)).via("a negative size")
@example(RTS, 7, 99, encode_rts(3, PULL, [100], None)).via("sizes that do not add up")
def test_engine_refuses_any_forged_packet_with_protocol_error(kind, tag, aux, payload):
    engine, buffer = engine_with_state()
    try:
        actions = engine.packet(PEER, kind, tag, aux, payload)
    except ProtocolError as exc:
        assert exc.peer == PEER
        assert f"rank {PEER} broke the protocol" in str(exc)
        return
    check_actions(actions, buffer)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_decoders_return_or_raise_protocol_error(payload):
    for decode in (decode_rts, decode_cts):
        try:
            decode(payload, PEER)
        except ProtocolError as exc:
            assert exc.peer == PEER


def forged_ring(head: int, tail: int, at: list[int]) -> tuple[Inbox, memoryview]:
    """An inbox over a ring whose control words and first packet's words are ``at``'s."""
    pair = memoryview(bytearray(CONFIG.pair_bytes))
    inbox = Inbox(pair, CONFIG, PEER)
    inbox.ctl[HEAD] = head
    inbox.ctl[TAIL] = tail
    inbox.tail = inbox.tail_published = tail
    pos = (tail & inbox.mask) >> 3
    for i, word in enumerate(at):
        inbox.words[(pos + i) % len(inbox.words)] = word
    return inbox, pair


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.sampled_from([0, 64, 4096 - 64, 4096, 2**40]), words),
       st.sampled_from([0, 64, 2048, 4096 - 64, 8192 + 128]),
       st.lists(words, min_size=4, max_size=6), st.integers(0, 300))
@example(64, 0, [EAGER, 0, -200, 0], 100).via("a negative length (read a huge one now)")
@example(4096, 4096 - 64, [EAGER, 0, 100, 0], 100).via("a packet past the end of the ring")
@example(4096, 0, [PAD, 0, 0, 0], 100).via("a skip-to-start at the start")
@example(2**62, 0, [0x5C43, 0, 0, 0], 100).via("garbage kind, absurd head")
def test_inbox_never_writes_outside_the_receive_buffer(head, tail, at, capacity):
    inbox, _ = forged_ring(head, tail, at)
    guarded = np.full(capacity + 2 * GUARD, GUARD_BYTE, np.uint8)
    buf = memoryview(guarded)[GUARD : GUARD + capacity]
    n = inbox.take_eager(buf, cma.ANY_TAG)
    assert n in (-2, -1) or 0 <= n <= capacity
    assert (guarded[:GUARD] == GUARD_BYTE).all() and (guarded[GUARD + capacity :] == GUARD_BYTE).all()
    if n == -1:  # the general path's turn: a packet it can hand on, or ProtocolError
        try:
            kind, _, length, _, payload = inbox.take()
        except ProtocolError as exc:
            assert exc.peer == PEER
            return
        assert 0 <= length <= CONFIG.max_packet and len(payload) == length
        assert packet_bytes(length) <= inbox.ctl[HEAD] - inbox.tail <= CONFIG.ring_bytes


def test_negative_length_no_longer_completes_a_receive():
    """The old fast path copied nothing and returned the negative length as the count."""
    inbox, _ = forged_ring(64, 0, [EAGER, 0, -4000, 0])
    buf = memoryview(bytearray(4000))
    assert inbox.take_eager(buf, cma.ANY_TAG) == -1
    with pytest.raises(ProtocolError, match="length of -4000 bytes"):
        inbox.take()


# pieces of a split control packet as a forger sends them: any kind, MORE or not, any bytes
forged_pieces = st.lists(st.tuples(st.sampled_from([RTS, CTS, EAGER, FIN, 0x5C43]), st.booleans(),
                                   st.binary(max_size=48)), max_size=12)
# an honest split of an RTS or CTS payload (pieces of 8 to 64 bytes)
honest_pieces = st.builds(
    lambda kind, payload, limit: [(k & ~MORE, bool(k & MORE), p)
                                  for k, p in split_packet(kind, payload, limit)],
    st.sampled_from([RTS, CTS]), st.one_of(rts_payloads, cts_payloads).filter(len),
    st.integers(8, 64))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(honest_pieces, forged_pieces), min_size=1, max_size=4))
def test_joined_pieces_end_in_a_packet_or_protocol_error(runs):
    """Pieces handed on as the receiver's drain does (to the Joiner while MORE is set or
    a packet is open, whole payloads to the engine): each payload handed on is exactly
    the pieces since the last one, a packet never outgrows the limit, and the engine
    refuses what the joined bytes do not make."""
    engine, buffer = engine_with_state()
    joiner = Joiner(limit=256)
    opened = b""
    for kind, more, payload in [piece for run in runs for piece in run]:
        kind |= MORE if more else 0
        if not (more or PEER in joiner):
            whole = payload
        else:
            try:
                whole = joiner.join(PEER, kind, payload)
            except ProtocolError as exc:
                assert exc.peer == PEER and len(opened) + len(payload) > 256
                assert PEER not in joiner
                return  # (the communicator is broken now)
            opened += payload
            assert len(opened) <= 256
            if whole is None:
                assert more and PEER in joiner
                continue
            assert whole == opened and PEER not in joiner
            opened = b""
        try:
            actions = engine.packet(PEER, kind, 5, len(whole), whole)
        except ProtocolError as exc:
            assert exc.peer == PEER
            return
        check_actions(actions, buffer)


@given(st.sampled_from([RTS, CTS]), st.binary(min_size=1, max_size=2000), st.integers(1, 300))
def test_split_packet_pieces_join_back(kind, payload, limit):
    pieces = split_packet(kind, payload, limit)
    assert all(0 < len(piece) <= limit for _, piece in pieces)
    assert [k for k, _ in pieces] == [kind | MORE] * (len(pieces) - 1) + [kind]
    joiner = Joiner(limit=len(payload))
    assert [joiner.join(PEER, k, piece) for k, piece in pieces][-1] == payload
    assert PEER not in joiner


def test_joiner_keeps_each_peers_pieces_apart():
    joiner = Joiner()
    assert joiner.join(1, RTS | MORE, b"a" * 8) is None
    assert joiner.join(2, CTS | MORE, b"b" * 8) is None
    assert joiner.join(1, RTS, b"c" * 8) == b"a" * 8 + b"c" * 8
    assert 2 in joiner and 1 not in joiner
    assert joiner.join(2, CTS, b"d" * 8) == b"b" * 8 + b"d" * 8


# ------------------------------------------------------------------ processes

TARGETS = ["packet", "ring", "control", "rts", "header", "staging"]


def scribble(view: memoryview, rng: np.random.Generator) -> None:
    view[:] = rng.bytes(view.nbytes)


def hostile(comm: cma.Comm, what: str, nbytes: int, target: str, seed: int,
            pipes: dict[str, int]) -> str:
    """Rank 1: once rank 0 is out of its Barrier, send, write random bytes over ``target``
    in what it shares with rank 0, say so, and keep its own side moving until rank 0 is
    through (or 5 s)."""
    rng = np.random.default_rng(seed)
    comm.Barrier()
    select.select([pipes["ready_r"]], [], [], 30)
    box = comm._progress.outboxes[0]
    at = box.head & box.mask
    payload = np.frombuffer(rng.bytes(nbytes), np.uint8)
    request = comm.isend({"x": payload}, dest=0, tag=3) if what == "object" else \
        comm.Isend(payload, dest=0, tag=3)
    if target == "packet":  # the four header words of the packet just sent
        for i, word in enumerate(np.frombuffer(rng.bytes(32), np.int64).tolist()):
            box.words[(at >> 3) + i] = word
    elif target == "rts":  # the words after the header (an RTS's buffer list)
        scribble(box.data[at + 32 : at + 32 + 64], rng)
    elif target == "ring":
        scribble(box.data, rng)
    elif target == "control":
        scribble(box.ctl[:64].cast("B"), rng)
    elif target == "staging":
        scribble(box.staging, rng)
    else:  # the world header: every rank block and the reach matrix
        world = comm._world
        scribble(world.header[16:].cast("B"), rng)
    os.write(pipes["scribbled_w"], b"x")
    for _ in range(5000):
        if select.select([pipes["done_r"]], [], [], 0.001)[0]:
            break
        try:
            comm.progress()
            request.Test()
        except CmaError:
            break
    return "hostile done"


def receiver(comm: cma.Comm, what: str, nbytes: int, pipes: dict[str, int]) -> str:
    """Rank 0: receive what the hostile peer sent, after it scribbled; report the outcome."""
    comm.Barrier()
    os.write(pipes["ready_w"], b"x")
    select.select([pipes["scribbled_r"]], [], [], 30)
    guarded = np.full(nbytes + 2 * GUARD, GUARD_BYTE, np.uint8)
    try:
        if what == "object":
            comm.recv(source=1, tag=3)
        else:
            comm.Recv(guarded[GUARD : GUARD + nbytes], source=1, tag=3)
        outcome = "received"
    except CmaError as exc:
        outcome = type(exc).__name__
        if isinstance(exc, ProtocolError) and "does not unpickle" in str(exc):
            # an object whose stream does not load is lost alone (the rings are whole)
            assert exc.peer == 1 and str(exc).startswith("rank 1's object message")
        elif isinstance(exc, ProtocolError):
            assert exc.peer == 1 and "rank 1 broke the protocol" in str(exc)
            try:
                comm.Recv(bytearray(8), source=1, tag=4)
                raise AssertionError("a communicator broken by a ProtocolError took a Recv")
            except CommBroken as later:
                assert "rank 1 broke the protocol" in str(later)
    finally:
        os.write(pipes["done_w"], b"x")
    assert (guarded[:GUARD] == GUARD_BYTE).all(), "written before the receive buffer"
    assert (guarded[GUARD + nbytes :] == GUARD_BYTE).all(), "written after the receive buffer"
    comm.close()
    return outcome


@settings(max_examples=FUZZ_CASES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["shm", "cma", "vmfd", "auto"]),
       st.sampled_from(["eager", "rendezvous", "object"]),
       st.sampled_from(TARGETS), st.integers(0, 2**32))
@example("shm", "eager", "packet", 1).via("forged packet words")
@example("cma", "rendezvous", "rts", 2).via("forged regions")
@example("shm", "rendezvous", "control", 3).via("forged head and tail")
@example("shm", "eager", "header", 4).via("forged world header")
@example("vmfd", "rendezvous", "rts", 5).via("forged regions, read through /proc/PID/mem")
@example("auto", "object", "packet", 6).via("a forged object packet, transport auto")
def test_a_peer_scribbling_over_its_mappings_gets_a_cma_error_or_its_message(
        transport, what, target, seed):
    nbytes = 100 if what == "eager" else 20000
    pipes = {}
    for name in ("ready", "scribbled", "done"):
        pipes[f"{name}_r"], pipes[f"{name}_w"] = os.pipe()
    try:
        outcome, _ = run_ranks(transport, CONFIG, [
            functools.partial(receiver, what=what, nbytes=nbytes, pipes=pipes),
            functools.partial(hostile, what=what, nbytes=nbytes, target=target, seed=seed,
                              pipes=pipes),
        ], timeout=60)
    finally:
        for fd in pipes.values():
            os.close(fd)
    print(f"{transport} {what} {target} seed {seed}: {outcome}")
    assert outcome in ("received", "ProtocolError", "CommBroken", "PeerGone", "TruncationError",
                       "TransportFault", "WindowError")


def send_an_object_that_does_not_load(comm: cma.Comm, stream: bytes) -> None:
    """An object message of ``stream`` instead of a pickle, then an honest one."""
    pickle_honestly = comm._pickle
    comm._pickle = lambda obj: [memoryview(stream)]  # type: ignore[method-assign]
    comm.send(None, dest=0, tag=5)
    comm._pickle = pickle_honestly  # type: ignore[method-assign]
    comm.send("after", dest=0, tag=6)
    comm.close()


UNLOADABLE = {
    "not a pickle": b"not a pickle",
    "a class not importable here": b"cno_such_module_of_cma\nThing\n.",
    "4 MiB, a rendezvous": b"\x80\x05" + b"\xff" * (4 << 20),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(UNLOADABLE))
def test_an_object_message_that_does_not_unpickle_is_a_protocol_error(case):
    """Before: pickle's own UnpicklingError (or ModuleNotFoundError) came out of recv.
    Now ProtocolError naming rank 1; the message is consumed and the communicator,
    whose rings nothing forged, takes the next message from that peer."""
    a, b = cma.Pipe(transport="shm")
    child = mp.get_context("fork").Process(target=send_an_object_that_does_not_load,
                                           args=(b, UNLOADABLE[case]), daemon=True)
    try:
        child.start()
        b.close()
        with pytest.raises(ProtocolError, match="does not unpickle here") as caught:
            a.recv(source=1, tag=5)
        assert caught.value.peer == 1
        assert str(caught.value).startswith("rank 1's object message (tag 5")
        assert a.recv(source=1, tag=6) == "after"
    finally:
        a.close()
        stop_process(child)


def attach_and_close(comm: cma.Comm) -> None:
    comm.Barrier()
    comm.close()


def test_close_stops_the_fd_server_whatever_the_header_says():
    """close() decided from the header's pid word whether this process runs the fd server;
    a peer that overwrote that word left the server thread running (and close() waiting
    out its 5 s join)."""
    a, b = cma.Pipe(transport="shm")
    child = mp.get_context("fork").Process(target=attach_and_close, args=(b,))
    try:
        child.start()
        b.close()
        a.Barrier()
        world = a._world
        server = world._server_thread
        world.header[world._word(0, PID)] = 12345  # as a peer could write it
        a.close()
        assert not server.is_alive()
    finally:
        a.close()
        stop_process(child)


# ------------------------------------------------------------------ claims of huge sizes

HUGE = 1 << 46  # 64 TiB: inside the address space, beyond any machine this runs on


def test_an_object_claiming_more_than_the_machine_holds_is_refused_unallocated():
    allocated = []
    engine = make_engine()
    engine.allocate = lambda n: allocated.append(n) or memoryview(bytearray(0))
    engine.max_object_bytes = 1 << 30
    rts = encode_rts(1, PULL, [HUGE], [Region(0x10000, HUGE)])
    with pytest.raises(ProtocolError, match=f"an object message of {HUGE} bytes"):
        engine.packet(PEER, RTS | OBJECT, 5, HUGE, rts)
    engine.recv(PEER, 5, None)
    assert not allocated


def test_more_pieces_without_end_are_refused_past_the_limit():
    joiner = Joiner(limit=1000)
    for _ in range(9):
        assert joiner.join(PEER, RTS | MORE, b"x" * 100) is None
    with pytest.raises(ProtocolError, match="grew past 1000 bytes"):
        joiner.join(PEER, RTS | MORE, b"x" * 101)
    assert PEER not in joiner


def forge(comm: cma.Comm, what: str, go: int) -> None:
    """Send what an honest peer never does: an object RTS for HUGE bytes, 4 MiB of pieces
    of a control packet that never ends, or an RTS of 20 bytes (no whole number of words)
    in two pieces."""
    comm.attach()
    progress = comm._progress
    if what == "object":
        progress.transmit(0, RTS | OBJECT, 5, HUGE, encode_rts(1, PULL, [HUGE],
                                                              [Region(0x10000, HUGE)]))
    elif what == "pieces":
        piece = b"\0" * progress.config.max_packet
        for _ in range(-(-(4 << 20) // len(piece))):
            progress.transmit(0, RTS | MORE, 5, 0, piece)
        progress.wait_until(lambda: not progress.txq_pending, 0)
    else:
        progress.transmit(0, RTS | MORE, 5, 20, b"\x01" * 8)
        progress.transmit(0, RTS, 5, 20, b"\x02" * 12)
    select.select([go], [], [], 30)


def protocol_error_from_forger(what: str) -> ProtocolError:
    """Rank 0's object receive from a child forging ``what``: its ProtocolError, after
    checking that the communicator is broken (CommBroken) and rank 1 named."""
    go_r, go_w = os.pipe()
    a, b = cma.Pipe(transport="shm")
    child = mp.get_context("fork").Process(target=forge, args=(b, what, go_r), daemon=True)
    try:
        child.start()
        b.close()
        a.attach()
        a._progress.joiner.limit = 1 << 20  # (the default, 256 MiB, is slow to reach in a test)
        request = a.irecv(source=1, tag=5)
        deadline = time.monotonic() + 20
        with pytest.raises(ProtocolError, match="rank 1 broke the protocol") as caught:
            while not request.Test():
                assert time.monotonic() < deadline, "no error: the forgery was accepted"
        assert caught.value.peer == 1
        with pytest.raises(CommBroken):
            a.recv(source=1, tag=5)
        return caught.value
    finally:
        os.write(go_w, b"x")
        a.close()
        stop_process(child)
        os.close(go_r)
        os.close(go_w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["object", "pieces"])
def test_a_peer_claiming_huge_sizes_gets_protocol_error(what):
    """Before: the object's claimed 64 TiB went to numpy (MemoryError, or ValueError), and
    the pieces were joined without end. Now ProtocolError naming rank 1, then CommBroken."""
    protocol_error_from_forger(what)


@pytest.mark.timeout(60)
def test_forged_more_pieces_end_in_protocol_error():
    """A split packet's pieces travel through the ring, are joined by the receiver and
    decoded as one packet: 8 + 12 bytes make an RTS of 20, no whole number of words."""
    assert "an RTS of 20 bytes" in str(protocol_error_from_forger("split"))

"""Unit tests of the sans-IO protocol engine (cma.protocol): no processes, no syscalls.

Two (or three) ``Engine``s talk through a hand-cranked ``Net``: ``Transmit`` actions are
queued per ordered pair and fed to the destination's ``packet()`` when the test pumps;
``Pull``/``Push`` are executed as plain memory copies between fake address spaces
(``FakeMemory`` hands out made-up addresses for bytearray-backed buffers);
``StreamOut``/``StreamIn`` are carried through a fake staging area with ``Pipeline``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import fields
from typing import NamedTuple

import matching_model
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cma.errors import ProtocolError, TruncationError
from cma.protocol import (
    ANY_SOURCE,
    ANY_TAG,
    CTS,
    EAGER,
    FIN,
    KIND_MASK,
    OBJECT,
    PIPELINE,
    PULL,
    PULL_FIRST,
    PUSH,
    RTS,
    SPLIT,
    SYNC,
    XMAP,
    Arrival,
    Complete,
    Deliver,
    Engine,
    Joiner,
    Matcher,
    Pipeline,
    Policy,
    Pull,
    Push,
    RecvOp,
    SendOp,
    Stream,
    StreamIn,
    StreamOut,
    Transmit,
    completed_recv,
    decode_cts,
    decode_one_heap_rts,
    decode_one_region_rts,
    decode_rts,
    encode_cts,
    encode_one_heap_rts,
    encode_one_region_rts,
    encode_rts,
    slice_regions,
    slice_views,
    source_matches,
    split_packet,
    split_point,
    tag_matches,
)
from cma.transports.base import Region
from cma.wire import BARRIER_TAG, MORE, HeapRef

ALL = PULL | PUSH | PIPELINE
LIMIT = 64  # eager limit used by most tests: small, so rendezvous sizes are cheap


# ------------------------------------------------------------------ fakes


class FakeMemory:
    """Buffers with made-up addresses: one address space per rank would be no different."""

    STRIDE = 1 << 40

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[int, bytearray]] = {}  # id(obj) -> (base, obj)
        self._next = 1 << 44

    def buffer(self, data: bytes | int) -> memoryview:
        obj = bytearray(data)
        self.buffers[id(obj)] = (self._next, obj)
        self._next += self.STRIDE
        return memoryview(obj)

    def allocate(self, nbytes: int) -> memoryview:
        return self.buffer(nbytes)

    def region_of(self, mv: memoryview) -> Region:
        obj = mv.obj
        base, owner = self.buffers[id(obj)]
        assert owner is obj, "region_of called on a buffer FakeMemory did not hand out"
        offset = 0
        if mv.nbytes:
            offset = (np.frombuffer(mv, np.uint8).__array_interface__["data"][0]
                      - np.frombuffer(owner, np.uint8).__array_interface__["data"][0])
        return Region(base + offset, mv.nbytes)

    def resolve(self, region: Region) -> memoryview:
        for base, obj in self.buffers.values():
            if base <= region.addr and region.addr + region.nbytes <= base + len(obj):
                return memoryview(obj)[region.addr - base : region.addr - base + region.nbytes]
        if region.nbytes == 0:
            return memoryview(b"")
        raise AssertionError(f"region {region} is not inside any known buffer")


def concat(views: list[memoryview]) -> bytes:
    return b"".join(bytes(v) for v in views)


def scatter(data: bytes, views: list[memoryview]) -> None:
    at = 0
    for v in views:
        v[:] = data[at : at + v.nbytes]
        at += v.nbytes
    assert at == len(data)


class PairStream:
    """Staging area and running counts of one ordered pair, as in the shared segment, and
    each side's protocol Stream over them."""

    def __init__(self, staging: bytearray, frag: int, slots: int) -> None:
        self.staging = staging
        self.filled = 0
        self.drained = 0
        self.out = Stream(True, lambda nbytes, first: Pipeline(nbytes, frag, slots, first))
        self.into = Stream(False, lambda nbytes, first: Pipeline(nbytes, frag, slots, first))


class Net:
    """N engines and the wires between them, pumped by hand."""

    def __init__(self, n: int = 2, eager_limit: int = LIMIT, policies: list[Policy] | None = None,
                 offers: int = ALL, frag: int = 16, slots: int = 3) -> None:
        self.mem = FakeMemory()
        self.engines = [
            Engine(r, eager_limit, (policies or [Policy() for _ in range(n)])[r], offers,
                   self.mem.allocate, self.mem.region_of)
            for r in range(n)
        ]
        self.wire: dict[tuple[int, int], deque[Transmit]] = {
            (s, d): deque() for s in range(n) for d in range(n) if s != d}
        self.frag, self.slots = frag, slots
        self.streams = {pair: PairStream(bytearray(frag * slots), frag, slots) for pair in self.wire}
        self.actions: list[list[object]] = [[] for _ in range(n)]
        self.completed: list[list[SendOp | RecvOp]] = [[] for _ in range(n)]
        self.arrivals: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (source, tag)

    # -- user calls

    def send(self, rank: int, dest: int, tag: int, data: bytes | list[bytes],
             is_object: bool = False, regions: bool = True, eager: bool = True,
             sync: bool = False) -> SendOp:
        parts = [data] if isinstance(data, (bytes, bytearray)) else list(data)
        segments = [self.mem.buffer(p) for p in parts]
        op, actions = self.engines[rank].send(dest, tag, segments, is_object, expose=regions,
                                              eager=eager, sync=sync)
        self.act(rank, actions)
        return op

    def recv(self, rank: int, source: int, tag: int, capacity: int | None) -> RecvOp:
        buf = None if capacity is None else self.mem.buffer(capacity)
        op, actions = self.engines[rank].recv(source, tag, buf)
        self.act(rank, actions)
        return op

    # -- the I/O layer, by hand

    def act(self, rank: int, actions: list) -> None:
        engine = self.engines[rank]
        for action in actions:
            self.actions[rank].append(action)
            if isinstance(action, Transmit):
                assert action.dest != rank
                self.wire[(rank, action.dest)].append(action)
            elif isinstance(action, Deliver):
                op = action.op
                payload = bytes(action.payload)
                if op.buffer is None:
                    op.segments = [memoryview(payload)]
                else:
                    op.buffer[: len(payload)] = payload
            elif isinstance(action, Pull):
                data = concat([self.mem.resolve(r) for r in action.remote])
                scatter(data, action.local)
                self.act(rank, engine.pulled(action.op, action.msgid))
            elif isinstance(action, Push):
                data = concat(action.local)
                scatter(data, [self.mem.resolve(r) for r in action.remote])
                self.act(rank, engine.pushed(action.op, action.recvid))
            elif isinstance(action, StreamOut):
                self.streams[(rank, action.op.dest)].out.add(action.op)
            elif isinstance(action, StreamIn):
                self.streams[(action.op.matched_source, rank)].into.add(action.op)
            elif isinstance(action, Complete):
                assert action.op.done
                self.completed[rank].append(action.op)
            else:  # pragma: no cover
                raise AssertionError(f"unknown action {action!r}")

    def step_packet(self, src: int, dst: int) -> bool:
        queue = self.wire[(src, dst)]
        if not queue:
            return False
        t = queue.popleft()
        if t.kind & KIND_MASK in (EAGER, RTS):
            self.arrivals[dst].append((src, t.tag))
        self.act(dst, self.engines[dst].packet(src, t.kind, t.tag, t.aux, memoryview(t.payload)))
        return True

    def step_stream(self, src: int, dst: int) -> bool:
        """Move what the protocol's Streams of the pair say may move: the sender's fills,
        then the receiver's drains (plain copies through the fake staging area)."""
        ps = self.streams[(src, dst)]
        frag = self.frag

        def fill(op: SendOp, slot: int, start: int, stop: int) -> None:
            ps.staging[slot * frag : slot * frag + stop - start] = concat(op.segments)[start:stop]

        def drain(op: RecvOp, slot: int, start: int, stop: int) -> None:
            scatter(bytes(ps.staging[slot * frag : slot * frag + stop - start]),
                    slice_views(op.segments, start, stop))

        filled = self._move(ps, ps.out, "filled", "drained", fill,
                            lambda op: self.act(src, self.engines[src].streamed_out(op)))
        drained = self._move(ps, ps.into, "drained", "filled", drain,
                             lambda op: self.act(dst, self.engines[dst].streamed_in(op)))
        return filled or drained

    @staticmethod
    def _move(ps: PairStream, stream: Stream, own: str, peer: str, copy, through) -> bool:
        """Copy what ``stream`` allows, publishing our count (attribute ``own`` of the pair)."""
        moved = False
        while True:
            step = stream.next(getattr(ps, peer), getattr(ps, own))
            if step is None:
                op = stream.through()
                if op is None:
                    return moved
                through(op)
            else:
                copy(*step)
                setattr(ps, own, stream.copied())
            moved = True

    def pump(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            moved = False
            for src, dst in self.wire:
                moved = self.step_packet(src, dst) or moved
                moved = self.step_stream(src, dst) or moved
            if not moved:
                return
        raise AssertionError("the net did not settle")

    def kinds(self, rank: int, cls: type) -> list:
        return [a for a in self.actions[rank] if isinstance(a, cls)]


def received(op: RecvOp) -> bytes:
    """What a completed receive holds."""
    assert op.done and op.error is None
    if op.buffer is not None and not op.segments:  # eager into a buffer
        return bytes(op.buffer[: op.nbytes])
    return concat(op.segments)


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def pull_policy(peer: int, name: str = "cma", push: bool = False, split: bool = False) -> Policy:
    return Policy(order=[name, "shm"], pullable={peer: {name}}, pushable={peer: {name}}, push=push,
                  split=split)


# ------------------------------------------------------------------ matching


def test_tag_and_source_predicates():
    assert tag_matches(3, 3) and not tag_matches(3, 4)
    assert tag_matches(ANY_TAG, 0) and tag_matches(ANY_TAG, 12345)
    assert not tag_matches(ANY_TAG, BARRIER_TAG)
    assert tag_matches(BARRIER_TAG, BARRIER_TAG)
    assert source_matches(ANY_SOURCE, 0) and source_matches(1, 1) and not source_matches(1, 0)


def test_eager_send_completes_at_once_and_delivers_unexpected():
    net = Net()
    data = payload(40)
    sop = net.send(0, 1, 5, data)
    assert sop.done and sop.mechanism == "eager"
    (t,) = net.kinds(0, Transmit)
    assert (t.dest, t.kind, t.tag, t.payload) == (1, EAGER, 5, data)
    assert net.completed[0] == [sop]
    net.pump()
    assert len(net.engines[1].matcher.unexpected) == 1
    rop = net.recv(1, 0, 5, 100)
    assert rop.done and received(rop) == data
    assert (rop.matched_source, rop.matched_tag, rop.nbytes) == (0, 5, 40)
    assert not net.engines[1].matcher.unexpected


def test_unexpected_eager_payload_is_copied_out_of_the_ring():
    engine = Net().engines[1]
    ring = bytearray(b"original")
    assert engine.packet(0, EAGER, 1, 0, memoryview(ring)) == []
    ring[:] = b"XXXXXXXX"  # the ring slot is reused
    op, actions = engine.recv(0, 1, memoryview(bytearray(8)))
    assert isinstance(actions[0], Deliver) and bytes(actions[0].payload) == b"original"
    assert engine.held_bytes == len(ring)


def test_a_receive_from_one_source_looks_at_that_sources_arrivals_alone(monkeypatch):
    """A Gather's root whose senders ran thousands of calls ahead: each of its receives
    examined every arrival of every peer (O(queue) a receive); now only the first of
    its own source's."""
    matcher = Matcher()
    for i in range(3000):
        matcher.unexpected.append(Arrival(1 + i % 7, -5, False, 1, b"x", None))
    matcher.unexpected.append(Arrival(9, -5, False, 1, b"y", None))
    looked = [0]

    def counting(original):
        def count(*args):
            looked[0] += 1
            return original(*args)
        return count

    import cma.protocol
    monkeypatch.setattr(cma.protocol, "source_matches", counting(source_matches))
    monkeypatch.setattr(cma.protocol, "tag_matches", counting(tag_matches))
    assert matcher.take_unexpected(9, -5).eager == b"y"
    assert looked[0] <= 2, f"{looked[0]} arrivals examined"
    assert len(matcher.unexpected) == 3000


def test_any_source_takes_the_earliest_arrival_over_every_source():
    matcher = Matcher()
    order = [(2, 7), (1, 8), (3, 7), (1, 7), (2, 8)]
    for n, (source, tag) in enumerate(order):
        matcher.unexpected.append(Arrival(source, tag, False, 1, bytes([n]), None))
    assert [a.eager[0] for a in matcher.unexpected] == [0, 1, 2, 3, 4]
    assert matcher.find_unexpected(ANY_SOURCE, 8).eager == bytes([1])
    assert matcher.take_unexpected(ANY_SOURCE, 7).eager == bytes([0])
    assert matcher.take_unexpected(ANY_SOURCE, ANY_TAG).eager == bytes([1])
    assert matcher.take_unexpected(1, 7).eager == bytes([3])
    assert matcher.take_unexpected(ANY_SOURCE, 7).eager == bytes([2])
    assert [a.eager[0] for a in matcher.unexpected] == [4] and len(matcher.unexpected) == 1
    assert matcher.take_unexpected(3, ANY_TAG) is None


def test_a_wildcard_walks_only_the_sources_with_arrivals_waiting(monkeypatch):
    """Each drained source's queue goes: a wildcard probe after messages from 256 sources
    were all received looks at nothing (it had walked 256 empty queues: 21.8 us a probe);
    ANY_TAG skips cma's own negative tags."""
    matcher = Matcher()
    for source in range(256):
        matcher.unexpected.append(Arrival(source, 1, False, 1, b"x", None))
    for source in range(256):
        assert matcher.take_unexpected(source, 1) is not None
    matcher.unexpected.append(Arrival(7, -3, False, 1, b"own", None))  # (a collective's tag)
    assert list(matcher.unexpected._by_source) == [7]  # (the queues a wildcard walks)
    looked = [0]
    import cma.protocol

    def counting(*args):
        looked[0] += 1
        return tag_matches(*args)

    monkeypatch.setattr(cma.protocol, "tag_matches", counting)
    assert matcher.find_unexpected(ANY_SOURCE, ANY_TAG) is None
    assert looked[0] == 1, f"{looked[0]} arrivals examined"
    assert matcher.take_unexpected(ANY_SOURCE, -3).eager == b"own"
    looked[0] = 0
    assert matcher.find_unexpected(ANY_SOURCE, ANY_TAG) is None and looked[0] == 0
    assert not matcher.unexpected._by_source


def test_an_owned_unexpected_payload_is_kept_without_a_copy():
    engine = Net().engines[1]
    looped = b"to myself"
    engine.packet(1, EAGER, 1, 0, looped)
    assert next(iter(engine.matcher.unexpected)).eager is looped
    assert engine.held_bytes == 0
    engine.packet(1, EAGER, 2, 0, memoryview(bytearray(3)))
    assert engine.held_bytes == 3


@pytest.mark.parametrize("size", [0, 1, LIMIT, LIMIT + 1, 5000])
def test_receive_posted_before_arrival(size):
    net = Net()
    rop = net.recv(1, 0, 9, 5000)
    assert not rop.done and net.engines[1].matcher.posted == [rop]
    data = payload(size, size)
    sop = net.send(0, 1, 9, data)
    net.pump()
    assert rop.done and sop.done
    assert received(rop) == data
    assert not net.engines[1].matcher.posted


@pytest.mark.parametrize("size", [10, 500])
@pytest.mark.parametrize(
    ("source", "tag", "expect"),
    [
        (0, 1, (0, 1)),
        (2, 1, (2, 1)),
        (ANY_SOURCE, 2, (0, 2)),
        (0, ANY_TAG, (0, 1)),
        (2, ANY_TAG, (2, 1)),
        (ANY_SOURCE, ANY_TAG, (0, 1)),
    ],
)
def test_match_on_source_and_tag_with_wildcards(size, source, tag, expect):
    net = Net(3)
    sent = {}
    for src, t in [(0, 1), (0, 2), (2, 1), (2, 2)]:
        sent[(src, t)] = payload(size, src * 10 + t)
        net.send(src, 1, t, sent[(src, t)])
        net.pump()  # arrival order: (0,1) (0,2) (2,1) (2,2)
    rop = net.recv(1, source, tag, size)
    net.pump()
    assert (rop.matched_source, rop.matched_tag) == expect
    assert received(rop) == sent[expect]
    assert len(net.engines[1].matcher.unexpected) == 3


def test_any_tag_never_matches_internal_tags():
    net = Net()
    net.send(0, 1, BARRIER_TAG, b"")
    net.pump()
    engine = net.engines[1]
    assert engine.probe(ANY_SOURCE, ANY_TAG) is None
    assert engine.probe(0, ANY_TAG) is None
    rop = net.recv(1, ANY_SOURCE, ANY_TAG, 10)
    assert not rop.done  # posted, the barrier message stays unexpected
    barrier = net.recv(1, 0, BARRIER_TAG, 0)
    assert barrier.done and barrier.matched_tag == BARRIER_TAG
    # a posted ANY_TAG receive is not taken by an internal message either
    net.send(0, 1, BARRIER_TAG, b"")
    net.pump()
    assert not rop.done and engine.probe(0, BARRIER_TAG) is not None
    net.send(0, 1, 3, b"user")
    net.pump()
    assert rop.done and rop.matched_tag == 3 and received(rop) == b"user"


@pytest.mark.parametrize("sizes", [(10, 20), (500, 20), (10, 500), (500, 600)])
def test_non_overtaking_same_source_and_tag(sizes):
    net = Net()
    first, second = payload(sizes[0], 1), payload(sizes[1], 2)
    net.send(0, 1, 4, first)
    net.send(0, 1, 4, second)
    net.pump()
    a = net.recv(1, 0, 4, 1000)
    b = net.recv(1, 0, 4, 1000)
    net.pump()
    assert received(a) == first and received(b) == second


@pytest.mark.parametrize("sizes", [(10, 20), (500, 600)])
def test_receive_for_later_tag_takes_later_message(sizes):
    net = Net()
    early, late = payload(sizes[0], 1), payload(sizes[1], 2)
    net.send(0, 1, 1, early)
    net.send(0, 1, 2, late)
    net.pump()
    r2 = net.recv(1, 0, 2, 1000)
    net.pump()
    assert received(r2) == late
    (left,) = net.engines[1].matcher.unexpected
    assert left.tag == 1
    r1 = net.recv(1, 0, ANY_TAG, 1000)
    net.pump()
    assert received(r1) == early and r1.matched_tag == 1


def test_posted_receives_matched_in_posting_order():
    net = Net()
    r_any = net.recv(1, ANY_SOURCE, ANY_TAG, 100)
    r_five = net.recv(1, 0, 5, 100)
    r_any2 = net.recv(1, 0, ANY_TAG, 100)
    net.send(0, 1, 5, b"first")
    net.pump()
    assert r_any.done and received(r_any) == b"first"
    assert not r_five.done and not r_any2.done
    net.send(0, 1, 5, b"second")
    net.pump()
    assert received(r_five) == b"second" and not r_any2.done
    net.send(0, 1, 7, b"third")
    net.pump()
    assert received(r_any2) == b"third"


def test_probe_does_not_consume():
    net = Net()
    net.send(0, 1, 3, b"abc")
    net.send(0, 1, 4, payload(300))
    net.pump()
    engine = net.engines[1]
    arrival = engine.probe(0, 4)
    assert arrival is not None and (arrival.source, arrival.tag, arrival.nbytes) == (0, 4, 300)
    assert engine.probe(0, ANY_TAG).tag == 3
    assert engine.probe(1, ANY_TAG) is None
    assert len(engine.matcher.unexpected) == 2


def test_matcher_take_posted_first_match():
    m = Matcher()
    ops = [RecvOp(0, 1, None), RecvOp(ANY_SOURCE, ANY_TAG, None), RecvOp(0, 2, None)]
    m.posted.extend(ops)
    assert m.take_posted(0, 2) is ops[1]
    assert m.take_posted(0, 2) is ops[2]
    assert m.take_posted(0, 2) is None
    assert m.take_posted(0, BARRIER_TAG) is None
    assert m.posted == [ops[0]]


def test_completed_recv_is_the_recv_op_the_dataclass_would_build():
    buf = memoryview(bytearray(8))
    fast = completed_recv(ANY_SOURCE, ANY_TAG, buf, 3, 7, 8)
    slow = RecvOp(ANY_SOURCE, ANY_TAG, buf, matched_source=3, matched_tag=7, nbytes=8, done=True)
    assert type(fast) is RecvOp
    # every field, so one added to RecvOp without a class default fails here
    assert {f.name: getattr(fast, f.name) for f in fields(RecvOp)} == \
        {f.name: getattr(slow, f.name) for f in fields(RecvOp)}
    fast.segments.append(buf)
    assert completed_recv(0, 0, buf, 0, 0, 0).segments == []  # a list of its own each time


class Wanted(NamedTuple):
    """A receive as the reference model sees it: what it asks for, and which it is."""

    source: int
    tag: int
    index: int


class Sent(NamedTuple):
    source: int
    tag: int
    data: bytes


# The reference model of MPI matching (tests/matching_model.py) at rank 1 (senders 0 and
# 2), checked against the engine through whole eager and rendezvous flows, with receives
# and arrivals interleaved at random.
messages = st.tuples(st.sampled_from([0, 2]), st.sampled_from([0, 1, 2, BARRIER_TAG]),
                     st.sampled_from([0, 1, LIMIT, LIMIT + 1, 200]))
receives = st.tuples(st.sampled_from([0, 2, ANY_SOURCE]),
                     st.sampled_from([0, 1, 2, ANY_TAG, BARRIER_TAG]))
steps = st.lists(st.one_of(st.tuples(st.just("send"), messages),
                           st.tuples(st.just("recv"), receives),
                           st.tuples(st.just("pump"), st.just(None))), max_size=30)


@settings(max_examples=150, deadline=None)
@given(steps, st.sampled_from(["pipeline", "pull", "push"]))
def test_matching_model(script, mode):
    if mode == "pipeline":
        policies = [Policy() for _ in range(3)]
    else:
        policies = [pull_policy(p, push=(mode == "push")) for p in (1, 0, 1)]
        policies[1] = Policy(order=["cma", "shm"], pullable={0: {"cma"}, 2: {"cma"}},
                             pushable={0: {"cma"}, 2: {"cma"}}, push=(mode == "push"))
    net = Net(3, policies=policies)
    sent: dict[int, deque] = {0: deque(), 2: deque()}  # per source, payloads in send order
    recvs: list[tuple[int, int, RecvOp]] = []
    events: list[tuple] = []  # what rank 1 saw, in order: ("post", i) / ("arrive", src, tag, data)
    seen = 0
    counter = 0

    def note_arrivals() -> None:
        nonlocal seen
        for src, tag in net.arrivals[1][seen:]:
            events.append(("arrive", src, tag, sent[src].popleft()))
        seen = len(net.arrivals[1])

    for kind, arg in [*script, ("pump", None)]:
        if kind == "send":
            src, tag, size = arg
            counter += 1
            data = payload(size, counter)
            net.send(src, 1, tag, data)
            sent[src].append(data)
        elif kind == "recv":
            source, tag = arg
            # arrivals so far must be noted before the receive is posted
            note_arrivals()
            events.append(("post", len(recvs)))
            recvs.append((source, tag, net.recv(1, source, tag, 1000)))
            note_arrivals()  # (recv itself never causes an arrival)
        else:
            # deliver packets one at a time so arrivals and posts interleave exactly
            for _ in range(10_000):
                moved = False
                for pair in net.wire:
                    if net.step_packet(*pair):
                        note_arrivals()
                        moved = True
                    moved = net.step_stream(*pair) or moved
                if not moved:
                    break
    note_arrivals()

    # the reference model, fed what rank 1 saw in the order it saw it
    model: matching_model.Engine[Wanted, Sent] = matching_model.Engine()
    expect: dict[int, Sent] = {}
    for event in events:
        if event[0] == "post":
            i = event[1]
            source, tag, _ = recvs[i]
            message = model.post(Wanted(source, tag, i))
            if message is not None:
                expect[i] = message
        else:
            message = Sent(*event[1:])
            taker = model.arrive(message)
            if taker is not None:
                expect[taker.index] = message
    unexpected = model.unexpected

    for i, (_, _, op) in enumerate(recvs):
        if i in expect:
            s, t, d = expect[i]
            assert op.done, f"receive {i} should have matched {s, t}"
            assert (op.matched_source, op.matched_tag) == (s, t)
            assert received(op) == d
        else:
            assert not op.done
    assert [(a.source, a.tag) for a in net.engines[1].matcher.unexpected] == \
        [(s, t) for s, t, _ in unexpected]
    # every send whose message was matched has completed; no transfer is left half done
    assert not net.engines[1].recvs
    matched_rdv = sum(1 for s, t, d in expect.values() if len(d) > LIMIT)
    pending_rdv = sum(1 for s, t, d in unexpected if len(d) > LIMIT)
    assert len(net.engines[0].sends) + len(net.engines[2].sends) == pending_rdv
    assert matched_rdv + pending_rdv == sum(
        1 for k, a in script if k == "send" and a[2] > LIMIT)


# ------------------------------------------------------------------ eager or rendezvous


@pytest.mark.parametrize(
    ("sizes", "kind"),
    [
        ([0], EAGER),
        ([1], EAGER),
        ([LIMIT - 1], EAGER),
        ([LIMIT], EAGER),
        ([LIMIT + 1], RTS),
        ([10, 10], RTS),  # several segments never go eager, however small
        ([0, 0], RTS),
        ([5000], RTS),
    ],
)
def test_eager_or_rts_by_limit_and_segment_count(sizes, kind):
    net = Net()
    op = net.send(0, 1, 0, [payload(n) for n in sizes])
    (t,) = net.kinds(0, Transmit)
    assert t.kind == kind
    assert op.nbytes == sum(sizes)
    if kind == EAGER:
        assert op.done and net.completed[0] == [op]
    else:
        assert not op.done and t.aux == sum(sizes)
        rts = decode_rts(t.payload)
        assert rts.sizes == sizes and rts.msgid == op.msgid
        assert rts.offers == ALL
        assert [r.nbytes for r in rts.regions] == sizes


def test_rts_without_regions_does_not_offer_pull():
    net = Net()
    net.send(0, 1, 0, payload(500), regions=False)
    (t,) = net.kinds(0, Transmit)
    rts = decode_rts(t.payload)
    assert rts.offers == PUSH | PIPELINE and rts.regions is None


def test_eager_limit_zero_sends_everything_but_empty_by_rendezvous():
    net = Net(eager_limit=0)
    net.send(0, 1, 0, b"")
    net.send(0, 1, 0, b"x")
    assert [t.kind for t in net.kinds(0, Transmit)] == [EAGER, RTS]


# ------------------------------------------------------------------ the direct rendezvous's RTS


def test_a_one_region_rts_is_the_rts_encode_rts_writes():
    """The direct rendezvous writes the engine's own packet, so either side may take the
    general path."""
    addr, n = 0x7F00_1234_5000, 300_000
    assert encode_one_region_rts(9, ALL, addr, n) == encode_rts(9, ALL, [n], [Region(addr, n)])
    rts = decode_rts(encode_one_region_rts(9, ALL, addr, n))
    assert (rts.msgid, rts.offers, rts.sizes, rts.regions) == (9, ALL, [n], [Region(addr, n)])


def words_of(packet: bytes) -> memoryview:
    return memoryview(packet).cast("q")


def test_a_one_region_rts_decodes_to_its_msgid_offers_and_region():
    packet = encode_one_region_rts(9, ALL, 0x1000, 4096)
    assert decode_one_region_rts(words_of(packet), 4096) == (9, ALL, Region(0x1000, 4096))


@pytest.mark.parametrize("words, nbytes", [
    ((9, ALL, 2, 4096, 0x1000), 4096),  # two buffers claimed
    ((9, ALL, 1, 4096, 0x1000), 4095),  # not the size the header says
    ((9, PUSH | PIPELINE, 1, 4096, 0x1000), 4096),  # no pull offered
    ((9, ALL | 0x40, 1, 4096, 0x1000), 4096),  # an offer this rank does not know (XMAP's bit too)
    ((9, ALL, 1, -1, 0x1000), -1),  # a negative size
    ((9, ALL, 1, 4096, -4096), 4096),  # below address 0
    ((9, ALL, 1, 4096, (1 << 56) - 4095), 4096),  # past the end of any address space
])
def test_anything_but_a_pullable_one_region_rts_is_left_to_decode_rts(words, nbytes):
    assert decode_one_region_rts(words, nbytes) is None


HEAP = HeapRef(segment=3, generation=2, offset=8192, extent=1 << 20, fd=17, inode=4242)


def test_a_one_heap_rts_is_the_rts_encode_rts_writes_for_one_heap_buffer():
    """The direct rendezvous of a heap buffer writes the engine's own packet too."""
    addr, n = 0x7F00_1234_5000, 300_000
    packet = encode_one_heap_rts(9, ALL, addr, n, HEAP)
    assert packet == encode_rts(9, ALL | XMAP, [n], [Region(addr, n)], [HEAP])
    rts = decode_rts(packet)
    assert (rts.msgid, rts.offers, rts.regions, rts.heap) == (9, ALL | XMAP, [Region(addr, n)], [HEAP])
    assert decode_one_heap_rts(words_of(packet), n) == (9, ALL | XMAP, Region(addr, n), HEAP)
    assert decode_one_region_rts(words_of(packet)[:5], n) is None  # (XMAP: not a region's RTS)


@pytest.mark.parametrize("change, nbytes", [
    ({2: 2}, 4096),  # two buffers claimed
    ({}, 4095),  # not the size the header says
    ({1: ALL & ~PULL | XMAP}, 4096),  # no pull offered
    ({1: ALL}, 4096),  # no XMAP offered
    ({1: ALL | XMAP | 0x40}, 4096),  # an offer this rank does not know
    ({4: (1 << 56) - 4095}, 4096),  # past the end of any address space
    ({6: 0}, 4096),  # generation 0: never a segment's
    ({7: -1}, 4096),  # a negative offset
    ({8: 8192 + 4095}, 4096),  # the buffer runs past the segment's extent
    ({9: -1}, 4096),  # a negative fd
    ({10: -1}, 4096),  # a negative inode
])
def test_anything_but_a_mappable_one_heap_rts_is_left_to_decode_rts(change, nbytes):
    words = list(words_of(encode_one_heap_rts(9, ALL, 0x1000, 4096, HEAP)))
    for at, value in change.items():
        words[at] = value
    assert decode_one_heap_rts(words, nbytes) is None


def direct_rts(net: Net, data: bytes, tag: int = 2) -> SendOp:
    """What DirectRendezvous.send does: register the send, then write its RTS itself."""
    segment = net.mem.buffer(data)
    op = net.engines[0].direct_send(1, tag, segment)
    region = net.mem.region_of(segment)
    net.wire[(0, 1)].append(Transmit(1, RTS, tag, len(data),
                                     encode_one_region_rts(op.msgid, ALL, region.addr, len(data))))
    return op


@pytest.mark.parametrize("push", [False, True])
def test_a_direct_send_left_to_the_engine_completes_there(push):
    """A direct send whose sender stopped waiting completes on the receiver's FIN (RGET) or
    pushes on its CTS (RPUT), as the engine's own sends do."""
    net = Net(policies=[pull_policy(1), pull_policy(0, push=push)])
    data = payload(5000, 4)
    op = direct_rts(net, data)
    assert net.engines[0].sends == {op.msgid: op}
    rop = net.recv(1, 0, 2, 8000)
    net.pump()
    assert received(rop) == data and rop.mechanism == "cma"
    assert op.done and net.completed[0] == [op] and not net.engines[0].sends
    assert bool(net.kinds(0, Push)) == push


def test_a_direct_send_whose_fin_the_io_layer_took_is_done_and_forgotten():
    net = Net(policies=[pull_policy(1), pull_policy(0)])
    op = direct_rts(net, payload(5000, 5))
    net.recv(1, 0, 2, 8000)
    net.step_packet(0, 1)  # the RTS: the receiver pulls and answers FIN
    fin = net.wire[(1, 0)].popleft()  # taken by the sender's I/O layer, not its engine
    assert (fin.kind, fin.aux) == (FIN, op.msgid)
    net.engines[0].direct_done(op)
    assert op.done and not net.engines[0].sends and net.completed[0] == []


def test_a_fin_for_a_send_the_engine_does_not_know_is_a_protocol_error():
    """Why a direct send is registered before its RTS goes out: a FIN the engine meets for
    a message it does not know is refused as a forgery."""
    net = Net(policies=[pull_policy(1), pull_policy(0)])
    op = direct_rts(net, payload(5000, 6))
    del net.engines[0].sends[op.msgid]
    net.recv(1, 0, 2, 8000)
    with pytest.raises(ProtocolError, match="a FIN for message"):
        net.pump()


# ------------------------------------------------------------------ rendezvous flows


def test_rget_flow():
    net = Net(policies=[pull_policy(1), pull_policy(0)])
    data = payload(5000, 3)
    sop = net.send(0, 1, 2, data)
    rop = net.recv(1, 0, 2, 8000)
    assert net.kinds(1, Pull) == []
    net.step_packet(0, 1)  # RTS
    (pull,) = net.kinds(1, Pull)
    assert pull.transport == "cma" and pull.peer == 0 and pull.msgid == sop.msgid
    assert [r.nbytes for r in pull.remote] == [5000]
    assert rop.done and received(rop) == data and rop.mechanism == "cma"
    fin = net.kinds(1, Transmit)[-1]
    assert (fin.dest, fin.kind, fin.aux) == (0, FIN, sop.msgid)
    assert not sop.done
    net.pump()
    assert sop.done and net.completed[0] == [sop]
    assert not net.engines[0].sends and not net.engines[1].recvs
    assert net.kinds(1, StreamIn) == [] and net.kinds(0, Push) == []


@pytest.mark.parametrize("pushable_only", [False, True])
def test_rput_flow(pushable_only):
    if pushable_only:
        receiver = Policy(order=["cma", "shm"], pushable={0: {"cma"}})
    else:
        receiver = pull_policy(0, push=True)
    net = Net(policies=[pull_policy(1), receiver])
    data = payload(3000, 4)
    sop = net.send(0, 1, 2, data)
    net.pump()
    rop = net.recv(1, 0, 2, 4000)
    (cts,) = [t for t in net.kinds(1, Transmit) if t.kind == CTS]
    info = decode_cts(cts.payload)
    assert info.mode == PUSH and info.transport == "cma" and info.msgid == sop.msgid
    assert [r.nbytes for r in info.regions] == [3000]
    assert net.mem.resolve(info.regions[0]).obj is rop.buffer.obj  # the receiver's own buffer
    assert not rop.done
    net.step_packet(1, 0)  # CTS -> Push -> FIN
    (push,) = net.kinds(0, Push)
    assert push.recvid == info.recvid == rop.recvid
    assert sop.done and sop.mechanism == "cma"
    assert not rop.done
    net.pump()
    assert rop.done and received(rop) == data and net.completed[1] == [rop]
    assert not net.engines[0].sends and not net.engines[1].recvs
    assert net.kinds(1, Pull) == []


@pytest.mark.parametrize("size", [LIMIT + 1, 16, 48, 49, 100, 1000])
def test_pipeline_flow(size):
    net = Net(eager_limit=8, frag=16, slots=3)
    data = payload(size, size)
    sop = net.send(0, 1, 6, data)
    rop = net.recv(1, 0, 6, 2000)
    net.step_packet(0, 1)
    (stream_in,) = net.kinds(1, StreamIn)
    assert stream_in.op is rop
    (cts,) = [t for t in net.kinds(1, Transmit) if t.kind == CTS]
    info = decode_cts(cts.payload)
    assert info.mode == PIPELINE and info.transport == "shm" and info.regions == []
    net.step_packet(1, 0)
    (stream_out,) = net.kinds(0, StreamOut)
    assert stream_out.op is sop and sop.mechanism == "shm"
    net.pump()
    assert sop.done and rop.done and received(rop) == data
    assert not net.engines[0].sends and not net.engines[1].recvs
    assert not any(t.kind == FIN for t in net.kinds(0, Transmit) + net.kinds(1, Transmit))


def test_pipeline_messages_back_to_back_share_the_counts():
    net = Net(eager_limit=8, frag=16, slots=2)
    datas = [payload(n, n) for n in (100, 17, 32, 300)]
    sops = [net.send(0, 1, 1, d) for d in datas]
    rops = [net.recv(1, 0, 1, 400) for _ in datas]
    net.pump()
    assert all(op.done for op in sops + rops)
    assert [received(op) for op in rops] == datas
    ps = net.streams[(0, 1)]
    assert ps.filled == ps.drained == sum(-(-len(d) // 16) for d in datas)


def test_pipeline_without_regions_when_only_pull_is_possible():
    net = Net(policies=[pull_policy(1), Policy(order=["cma", "shm"], pullable={0: {"cma"}})])
    data = payload(500, 9)
    net.send(0, 1, 0, data, regions=False)  # RTS offers no PULL
    rop = net.recv(1, 0, 0, 500)
    net.pump()
    assert received(rop) == data and rop.mechanism == "shm"
    assert net.kinds(1, Pull) == [] and len(net.kinds(1, StreamIn)) == 1


def split_net(**kwargs) -> Net:
    return Net(policies=[pull_policy(1, split=True), pull_policy(0, split=True)], **kwargs)


@pytest.mark.parametrize("size", [2 * 4096, 3 * 4096 + 5, 100_000])
def test_split_flow(size):
    """Receiver pulls the first half, sender pushes the second; each FINs its half."""
    net = split_net()
    data = payload(size, 11)
    sop = net.send(0, 1, 2, data)
    rop = net.recv(1, 0, 2, size + 10)
    net.step_packet(0, 1)  # RTS -> CTS + Pull of the first half
    cut = split_point(size)
    assert 0 < cut < size and cut % 4096 == 0
    (pull,) = net.kinds(1, Pull)
    assert sum(r.nbytes for r in pull.remote) == sum(v.nbytes for v in pull.local) == cut
    (cts,) = [t for t in net.kinds(1, Transmit) if t.kind == CTS]
    info = decode_cts(cts.payload)
    assert info.mode == SPLIT and sum(r.nbytes for r in info.regions) == size - cut
    assert not rop.done  # its own half is in; the sender's is not
    net.step_packet(1, 0)  # CTS -> Push of the second half -> FIN to the receiver
    (push,) = net.kinds(0, Push)
    assert not sop.done  # the receiver's FIN for the first half is not in yet
    net.step_packet(1, 0)  # FIN for the first half (the sender's buffer part is free)
    assert sum(v.nbytes for v in push.local) == size - cut and push.recvid == rop.recvid
    assert sop.done and sop.mechanism == "cma"
    net.pump()
    assert rop.done and received(rop) == data and rop.mechanism == "cma"
    assert net.completed == [[sop], [rop]]
    assert not net.engines[0].sends and not net.engines[1].recvs


@pytest.mark.parametrize("order", ["both-copies-first", "sender-first", "receiver-first"])
def test_split_halves_complete_in_any_order(order):
    """Each side completes once its own copy is done and the peer's FIN is in, whichever
    comes first (sender-first: its FIN reaches the receiver while that still copies)."""
    mem = FakeMemory()
    sender = Engine(0, LIMIT, pull_policy(1, split=True), ALL, mem.allocate, mem.region_of)
    receiver = Engine(1, LIMIT, pull_policy(0, split=True), ALL, mem.allocate, mem.region_of)
    sop, (rts,) = sender.send(1, 0, [mem.buffer(payload(20_000))])
    rop, _ = receiver.recv(0, 0, mem.buffer(20_000))
    cts, pull = receiver.packet(0, rts.kind, rts.tag, rts.aux, rts.payload)
    (push,) = sender.packet(1, cts.kind, cts.tag, cts.aux, cts.payload)
    if order == "both-copies-first":
        (receiver_fin,) = receiver.pulled(rop, pull.msgid)
        (sender_fin,) = sender.pushed(sop, push.recvid)
        assert not rop.done and not sop.done
        assert sender.packet(1, FIN, 0, receiver_fin.aux, b"") == [Complete(sop)]
        assert receiver.packet(0, FIN, 0, sender_fin.aux, b"") == [Complete(rop)]
    elif order == "sender-first":
        (sender_fin,) = sender.pushed(sop, push.recvid)
        assert receiver.packet(0, FIN, 0, sender_fin.aux, b"") == []
        assert not rop.done
        receiver_fin, receiver_done = receiver.pulled(rop, pull.msgid)
        assert receiver_done == Complete(rop)
        assert sender.packet(1, FIN, 0, receiver_fin.aux, b"") == [Complete(sop)]
    else:
        (receiver_fin,) = receiver.pulled(rop, pull.msgid)
        assert sender.packet(1, FIN, 0, receiver_fin.aux, b"") == []
        assert not sop.done
        sender_fin, sender_done = sender.pushed(sop, push.recvid)
        assert sender_done == Complete(sop)
        assert receiver.packet(0, FIN, 0, sender_fin.aux, b"") == [Complete(rop)]
    assert sop.done and rop.done
    assert not sender.sends and not receiver.recvs


@pytest.mark.parametrize("sizes", [[9000, 1, 30_000], [4096, 4096], [3, 20_000, 7, 0, 6000]])
def test_split_with_many_segments(sizes):
    """Object messages: several buffers on both sides, the cut falling inside one."""
    net = split_net()
    parts = [payload(n, i) for i, n in enumerate(sizes)]
    sop = net.send(0, 1, 5, parts, is_object=True)
    rop = net.recv(1, 0, 5, None)
    net.pump()
    assert sop.done and rop.done
    assert [bytes(v) for v in rop.segments] == parts
    assert [type(a) for a in net.kinds(1, Pull)] == [Pull] and len(net.kinds(0, Push)) == 1


class Blocks:
    """A receive buffer in several places (protocol.Scattered), as cma.mpi's datatypes
    with gaps give: every other 8 bytes of one bytearray."""

    readonly = False

    def __init__(self, mem: FakeMemory, nbytes: int) -> None:
        self.whole = mem.buffer(2 * nbytes)
        self.views = [self.whole[i : i + 8] for i in range(0, 2 * nbytes, 16)]
        self.nbytes = nbytes
        self.asked: list[int] = []

    def __setitem__(self, cut: slice, payload: bytes) -> None:
        scatter(bytes(payload), slice_views(self.views, 0, len(payload)))

    def segments(self, nbytes: int) -> list[memoryview]:
        self.asked.append(nbytes)
        return slice_views(self.views, 0, nbytes)

    def data(self, nbytes: int) -> bytes:
        return concat(slice_views(self.views, 0, nbytes))


@pytest.mark.parametrize("mode", ["eager", "rget", "rput", "pipeline", "split"])
def test_a_scattered_receive_buffer_gets_every_protocol(mode):
    """A receive whose buffer is in blocks: eager payloads go in through ``buf[:n] = ``,
    a rendezvous copies into the views ``segments(n)`` gives, whatever the mode."""
    policies = {"eager": None, "rget": [pull_policy(1), pull_policy(0)],
                "rput": [pull_policy(1), pull_policy(0, push=True)],
                "pipeline": None, "split": None}[mode]
    net = split_net() if mode == "split" else Net(policies=policies)
    size = 48 if mode == "eager" else 3000
    blocks = Blocks(net.mem, 4000)
    op, actions = net.engines[1].recv(0, 7, blocks)
    net.act(1, actions)
    data = payload(size, 11)
    sop = net.send(0, 1, 7, data)
    net.pump()
    assert sop.done and op.done and op.nbytes == size
    assert blocks.data(size) == data
    assert bytes(blocks.whole[8:16]) == bytes(8), "a gap was written"
    assert blocks.asked == ([] if mode == "eager" else [size])
    if mode != "eager":
        assert op.mechanism != "eager"


def test_split_needs_both_directions_and_size():
    both = Policy(order=["cma", "shm"], pullable={1: {"cma"}}, pushable={1: {"cma"}}, split=True)
    assert both.choose(1, 8192, ALL) == (SPLIT, "cma")
    assert both.choose(1, 8191, ALL) == (PULL, "cma")  # no whole page for each side
    assert both.choose(1, 1 << 30, PULL | PIPELINE) == (PULL, "cma")  # sender cannot push
    assert both.choose(1, 1 << 30, PUSH | PIPELINE) == (PUSH, "cma")  # no regions offered
    both.push = True  # an explicit preference for RPUT wins
    assert both.choose(1, 1 << 30, ALL) == (PUSH, "cma")
    pull_only = Policy(order=["cma", "shm"], pullable={1: {"cma"}}, split=True)
    assert pull_only.choose(1, 1 << 30, ALL) == (PULL, "cma")


def test_ranks_that_outnumber_the_cpus_pull_where_they_would_split():
    """A SPLIT's second copier, the sender, has no CPU to itself when ranks outnumber CPUs
    and must be in cma to push its half: the receiver pulls all of it (an all-to-all of
    1 MiB at 4 ranks on 2 CPUs: 3.8-4.9 ms before, 2.3-3.5 after, docs/transports.md)."""
    crowded = Policy(order=["cma", "shm"], pullable={1: {"cma"}}, pushable={1: {"cma"}},
                     split=True, split_only={"cma"}, crowded=True)
    assert crowded.choose(1, 1 << 20, ALL) == (PULL, "cma")
    crowded.crowded = False
    assert crowded.choose(1, 1 << 20, ALL) == (SPLIT, "cma")


def test_split_only_transports_are_skipped_where_split_cannot_work():
    p = Policy(order=["cma", "vmfd", "shm"], pullable={1: {"cma", "vmfd"}, 2: {"cma"}},
               pushable={1: {"cma"}}, split=True, split_only={"cma"})
    assert p.choose(1, 1 << 30, ALL) == (SPLIT, "cma")
    assert p.choose(2, 1 << 30, ALL) == (PIPELINE, "shm")  # rank 2 cannot write to us
    assert p.choose(1, 1 << 30, PULL | PIPELINE) == (PULL, "vmfd")
    p.forced = "cma"  # a named transport is used one-sided all the same
    assert p.choose(2, 1 << 30, ALL) == (PULL, "cma")


def test_a_message_offered_pull_first_is_pulled_wherever_a_transport_can():
    """A flat Bcast's root offers its buffer to every reader at once, PULL_FIRST: a reader
    pulls it where it would split it with the root (auto, CPUs to spare: cma split-only)
    or have the root push it (push=True, cma named), and only where no transport can
    pull does the usual choice stand (shm's pipeline)."""
    p = Policy(order=["cma", "vmfd", "shm"], pullable={1: {"cma"}, 2: set()},
               pushable={1: {"cma"}, 2: set()}, staged={"shm"}, split=True,
               split_only={"cma"}, crowded=False)
    assert p.choose(1, 1 << 30, ALL) == (SPLIT, "cma")
    assert p.choose(1, 1 << 30, ALL | PULL_FIRST) == (PULL, "cma")
    assert p.choose(2, 1 << 30, ALL | PULL_FIRST) == (PIPELINE, "shm")
    p.order, p.push = ["self", "cma"], True  # (connect.py's policy of transport="cma", push=True)
    assert p.choose(1, 1 << 30, ALL) == (PUSH, "cma")
    assert p.choose(1, 1 << 30, ALL | PULL_FIRST) == (PULL, "cma")
    p.pullable[1], p.forced = {"cma", "vmfd"}, "vmfd"  # (a policy that names its transport)
    assert p.choose(1, 1 << 30, ALL | PULL_FIRST) == (PULL, "vmfd")


def test_pull_first_comes_with_pull_or_not_at_all():
    """An RTS may offer PULL_FIRST only with PULL (the regions to pull from), a heap RTS
    (XMAP) too; both fast decoders take it."""
    good = encode_rts(7, PULL | PUSH | PULL_FIRST, [4096], [Region(4096, 4096)])
    assert decode_rts(good, 1).offers & PULL_FIRST
    for offers in (PUSH | PULL_FIRST, XMAP | PULL_FIRST):
        with pytest.raises(ProtocolError):
            decode_rts(encode_rts(7, offers, [4096], [Region(4096, 4096)]), 1)
    assert decode_one_region_rts([7, PULL | PULL_FIRST, 1, 4096, 4096], 4096) is not None
    heap = encode_one_heap_rts(7, PULL | PULL_FIRST, 0x1000, 4096, HEAP)
    assert decode_one_heap_rts(words_of(heap), 4096) == (7, PULL | PULL_FIRST | XMAP,
                                                         Region(0x1000, 4096), HEAP)
    assert decode_rts(heap, 1).offers & (XMAP | PULL_FIRST) == XMAP | PULL_FIRST


def test_the_engine_pulls_what_is_offered_pull_first():
    """A sender's engine offers PULL_FIRST when asked; the receiver's engine, whose policy
    would SPLIT the message with it, pulls all of it instead: no CTS, one Pull."""
    mem = FakeMemory()
    sender = Engine(0, LIMIT, pull_policy(1, split=True), ALL, mem.allocate, mem.region_of)
    receiver = Engine(1, LIMIT, pull_policy(0, split=True), ALL, mem.allocate, mem.region_of)
    for pull_first, kinds in ((False, {CTS}), (True, set())):
        sop, (rts,) = sender.send(1, 0, [mem.buffer(payload(20_000))], pull_first=pull_first)
        assert bool(decode_rts(rts.payload, 0).offers & PULL_FIRST) == pull_first
        rop, _ = receiver.recv(0, 0, mem.buffer(20_000))
        actions = receiver.packet(0, rts.kind, rts.tag, rts.aux, rts.payload)
        assert {a.kind for a in actions if isinstance(a, Transmit)} == kinds
        (pull,) = [a for a in actions if isinstance(a, Pull)]
        assert sum(r.nbytes for r in pull.remote) == (20_000 if pull_first else split_point(20_000))
    # an engine that offers no PULL offers no PULL_FIRST either (its RTS would be refused)
    pushing = Engine(0, LIMIT, pull_policy(1), PUSH | PIPELINE, mem.allocate, mem.region_of)
    _, (rts,) = pushing.send(1, 0, [mem.buffer(payload(20_000))], pull_first=True)
    assert not decode_rts(rts.payload, 0).offers & PULL_FIRST


@given(st.lists(st.integers(0, 50), max_size=6), st.integers(0, 300), st.integers(0, 300))
def test_slicing_views_and_regions_agree(sizes, a, b):
    start, stop = min(a, b), max(a, b)
    mem = FakeMemory()
    views = [mem.buffer(payload(n, i)) for i, n in enumerate(sizes)]
    whole = concat(views)
    part = slice_views(views, start, stop)
    assert concat(part) == whole[start:stop]
    assert all(v.nbytes for v in part)
    regions = slice_regions([mem.region_of(v) for v in views], start, stop)
    assert b"".join(bytes(mem.resolve(r)) for r in regions) == whole[start:stop]


# ------------------------------------------------------------------ truncation


@pytest.mark.parametrize("posted_first", [False, True])
def test_truncation_eager(posted_first):
    net = Net()
    if posted_first:
        rop = net.recv(1, 0, 3, 10)
    sop = net.send(0, 1, 3, payload(40))
    net.pump()
    if not posted_first:
        rop = net.recv(1, 0, 3, 10)
    assert rop.done and isinstance(rop.error, TruncationError)
    err = rop.error
    assert (err.source, err.tag, err.nbytes, err.capacity) == (0, 3, 40, 10)
    assert net.kinds(1, Deliver) == []
    assert bytes(rop.buffer) == bytes(10)  # nothing written past or into the buffer
    assert sop.done
    # consumed: nothing left to match
    assert net.engines[1].probe(ANY_SOURCE, ANY_TAG) is None
    again = net.recv(1, 0, 3, 100)
    assert not again.done
    net.send(0, 1, 3, b"next")
    net.pump()
    assert received(again) == b"next"


@pytest.mark.parametrize("posted_first", [False, True])
@pytest.mark.parametrize("mode", ["pipeline", "pull", "push"])
def test_truncation_rendezvous(posted_first, mode):
    if mode == "pipeline":
        policies = [Policy(), Policy()]
    else:
        policies = [pull_policy(1), pull_policy(0, push=(mode == "push"))]
    net = Net(policies=policies)
    if posted_first:
        rop = net.recv(1, 0, 3, 100)
    sop = net.send(0, 1, 3, payload(1000))
    net.pump()
    if not posted_first:
        rop = net.recv(1, 0, 3, 100)
        net.pump()
    assert rop.done and isinstance(rop.error, TruncationError)
    assert (rop.error.nbytes, rop.error.capacity) == (1000, 100)
    assert sop.done and net.completed[0] == [sop]  # the sender is released by a FIN
    assert not net.engines[0].sends and not net.engines[1].recvs
    for cls in (Pull, Push, StreamIn, StreamOut, Deliver):
        assert net.kinds(0, cls) == [] and net.kinds(1, cls) == []
    assert not any(t.kind == CTS for t in net.kinds(1, Transmit))
    assert net.engines[1].probe(ANY_SOURCE, ANY_TAG) is None
    again = net.recv(1, 0, 3, 2000)
    data = payload(1500, 5)
    net.send(0, 1, 3, data)
    net.pump()
    assert received(again) == data


def test_exact_fit_is_not_truncation():
    net = Net()
    for n in (LIMIT, 500):
        data = payload(n, n)
        net.send(0, 1, 0, data)
        rop = net.recv(1, 0, 0, n)
        net.pump()
        assert received(rop) == data


# ------------------------------------------------------------------ object messages


@pytest.mark.parametrize("mode", ["pipeline", "pull", "push"])
def test_object_flag_and_segments(mode):
    if mode == "pipeline":
        policies = [Policy(), Policy()]
    else:
        policies = [pull_policy(1), pull_policy(0, push=(mode == "push"))]
    net = Net(policies=policies)
    small = net.send(0, 1, 1, b"pickle-stream", is_object=True)
    (t,) = net.kinds(0, Transmit)
    assert t.kind == EAGER | OBJECT and small.is_object
    parts = [payload(30, 1), payload(200, 2), payload(0, 3), payload(70, 4)]
    big = net.send(0, 1, 2, parts, is_object=True)
    assert net.kinds(0, Transmit)[-1].kind == RTS | OBJECT
    plain = net.send(0, 1, 3, payload(300, 5))
    net.pump()
    r_small = net.recv(1, 0, 1, None)
    r_big = net.recv(1, 0, 2, None)
    r_plain = net.recv(1, 0, 3, 400)
    net.pump()
    assert r_small.is_object and received(r_small) == b"pickle-stream"
    assert r_big.is_object and [bytes(s) for s in r_big.segments] == parts
    assert not r_plain.is_object
    assert all(op.done for op in (small, big, plain))


def test_object_receive_matches_plain_eager_message_too():
    net = Net()
    net.send(0, 1, 1, b"raw")
    rop = net.recv(1, 0, 1, None)
    net.pump()
    assert not rop.is_object and received(rop) == b"raw"


# ------------------------------------------------------------------ wire formats

# (regions within a user address space: the decoders refuse any other, see test_hostile_peer)
regions_st = st.lists(st.tuples(st.integers(0, 2**55), st.integers(0, 2**40)), min_size=1,
                      max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**62), st.integers(0, 7), regions_st, st.booleans())
def test_rts_round_trip(msgid, offers, spans, with_regions):
    sizes = [n for _, n in spans]
    regions = [Region(a, n) for a, n in spans] if with_regions else None
    info = decode_rts(encode_rts(msgid, offers, sizes, regions))
    assert (info.msgid, info.offers, info.sizes) == (msgid, offers, sizes)
    assert info.regions == regions


def test_rts_round_trip_decodes_from_memoryview():
    blob = encode_rts(7, PULL, [3, 4], [Region(100, 3), Region(200, 4)])
    info = decode_rts(memoryview(bytearray(blob)))
    assert info.regions == [Region(100, 3), Region(200, 4)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**62), st.integers(0, 2**62), st.sampled_from([PUSH, SPLIT, PIPELINE]),
       st.from_regex(r"[a-z0-9]{1,20}", fullmatch=True),
       st.lists(st.tuples(st.integers(0, 2**55), st.integers(0, 2**55)), max_size=40))
def test_cts_round_trip(msgid, recvid, mode, transport, spans):
    regions = [Region(a, n) for a, n in spans]
    blob = encode_cts(msgid, recvid, mode, transport, regions)
    info = decode_cts(memoryview(blob))
    assert (info.msgid, info.recvid, info.mode, info.transport) == (msgid, recvid, mode, transport)
    assert info.regions == regions


# ------------------------------------------------------------------ Pipeline schedule


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=6), slots=st.integers(1, 4),
       frag=st.sampled_from([8, 16, 64]), turns=st.lists(st.booleans(), max_size=400))
def test_streams_move_messages_through_the_slots_in_order(sizes, slots, frag, turns):
    """A sender's and a receiver's Stream over one staging area, turns taken in any order:
    every message arrives whole and in order, zero-byte ones included, and the sender
    never fills a slot the receiver has not drained."""
    staging = bytearray(frag * slots)
    counts = {"filled": 0, "drained": 0}
    make = lambda nbytes, first: Pipeline(nbytes, frag, slots, first)  # noqa: E731
    out, into = Stream(True, make), Stream(False, make)
    sent = [SendOp(1, 0, [memoryview(payload(n, i))], n, False) for i, n in enumerate(sizes)]
    got = [RecvOp(0, 0, None) for _ in sizes]
    for sop, rop in zip(sent, got, strict=True):
        rop.nbytes, rop.segments = sop.nbytes, [memoryview(bytearray(sop.nbytes))]
        out.add(sop)
        into.add(rop)
    through_out, through_in = [], []

    def turn(sending: bool) -> None:
        stream = out if sending else into
        peer = counts["drained"] if sending else counts["filled"]
        own = counts["filled"] if sending else counts["drained"]
        step = stream.next(peer, own)
        if step is None:
            op = stream.through()
            if op is not None:
                (through_out if sending else through_in).append(op)
            return
        op, slot, start, stop = step
        window = memoryview(staging)[slot * frag : slot * frag + stop - start]
        if sending:
            assert own - counts["drained"] < slots  # the slot is free
            window[:] = concat(op.segments)[start:stop]
            counts["filled"] = stream.copied()
        else:
            scatter(bytes(window), slice_views(op.segments, start, stop))
            counts["drained"] = stream.copied()

    for sending in turns:
        turn(sending)
    for _ in range(10 * (sum(sizes) // frag + len(sizes) + 2)):  # then alternate to the end
        turn(True)
        turn(False)
    assert through_out == sent and through_in == got and not out and not into
    assert [bytes(r.segments[0]) for r in got] == [payload(n, i) for i, n in enumerate(sizes)]


@given(parts=st.lists(st.tuples(st.integers(0, 1), st.binary(max_size=50)), max_size=12),
       limit=st.integers(1, 16))
def test_split_control_packets_join_per_peer(parts, limit):
    """split_packet's pieces, from two peers interleaved piece by piece, join back into
    each peer's packets in order (MORE set on all but the last piece of each)."""
    queues: dict[int, deque] = {0: deque(), 1: deque()}
    for peer, data in parts:
        pieces = split_packet(RTS, data, limit) if data else [(RTS, data)]
        assert all(k & MORE for k, _ in pieces[:-1]) and not pieces[-1][0] & MORE
        assert all(len(p) <= limit for _, p in pieces)
        queues[peer].append(pieces)
    joiner, joined = Joiner(), {0: [], 1: []}
    while any(queues.values()):
        for peer in (0, 1):
            if queues[peer]:
                kind, piece = queues[peer][0].pop(0)
                if not queues[peer][0]:
                    queues[peer].popleft()
                whole = joiner.join(peer, kind, piece)
                if whole is not None:
                    joined[peer].append(whole)
    assert joined == {p: [d for q, d in parts if q == p] for p in (0, 1)}
    assert 0 not in joiner and 1 not in joiner


def test_pipeline_zero_bytes():
    p = Pipeline(0, 16, 4, first=7)
    assert p.count == 0 and p.finished and p.end == 7
    assert p.fill(0) is None and p.drain(100) is None


@pytest.mark.parametrize("k", [1, 2, 5])
def test_pipeline_exact_multiple(k):
    p = Pipeline(16 * k, 16, 2, first=0)
    spans = []
    drained = 0
    while not p.finished:
        step = p.fill(drained)
        assert step is not None
        spans.append(step[1:])
        drained = p.finish_fragment()  # drained at once
    assert p.count == k and spans == [(16 * i, 16 * i + 16) for i in range(k)]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), st.integers(1, 64), st.integers(1, 6), st.integers(0, 1000))
def test_pipeline_fragments(nbytes, frag, slots, first):
    p = Pipeline(nbytes, frag, slots, first)
    assert p.count == -(-nbytes // frag) and p.end == first + p.count
    got = []
    while True:
        step = p.fill(first + p.next)  # receiver keeps up
        if step is None:
            break
        got.append(step)
        assert p.finish_fragment() == first + len(got)
    assert p.finished and len(got) == p.count
    for i, (slot, start, stop) in enumerate(got):
        assert slot == (first + i) % slots
        assert start == i * frag
        assert stop == min(nbytes, start + frag)
        assert stop > start  # no empty fragments
    if got:
        assert got[-1][2] == nbytes


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.integers(1, 64), st.integers(1, 6), st.integers(0, 1000),
       st.integers(0, 10))
def test_pipeline_fill_blocked_by_slots_ahead(nbytes, frag, slots, first, drained_ahead):
    p = Pipeline(nbytes, frag, slots, first)
    drained = first + min(drained_ahead, p.count)
    filled = 0
    while p.fill(drained) is not None:
        p.finish_fragment()
        filled += 1
    # the sender may run at most `slots` fragments ahead of what was drained
    assert filled == min(p.count, drained - first + slots)
    assert not p.finished or filled == p.count
    if not p.finished:
        assert p.first + p.next - drained == slots


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.integers(1, 64), st.integers(1, 6), st.integers(0, 1000),
       st.integers(0, 10))
def test_pipeline_drain_blocked_until_filled(nbytes, frag, slots, first, filled_ahead):
    p = Pipeline(nbytes, frag, slots, first)
    filled = first + filled_ahead
    drained = 0
    while p.drain(filled) is not None:
        p.finish_fragment()
        drained += 1
    assert drained == min(p.count, filled_ahead)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=5), st.integers(1, 48),
       st.integers(1, 4), st.integers(0, 50), st.integers(0, 2**32))
def test_pipeline_random_interleaving_moves_every_byte(sizes, frag, slots, start, seed):
    """Several messages through shared counts; the two sides take turns at random."""
    staging = [None] * slots  # what each slot holds: (message, fragment) or None when free
    memory = bytearray(frag * slots)
    filled = drained = start
    messages = [payload(n, i) for i, n in enumerate(sizes)]
    out = [bytearray(n) for n in sizes]
    send_i = recv_i = 0
    sp = Pipeline(sizes[0], frag, slots, filled)
    rp = Pipeline(sizes[0], frag, slots, drained)
    rnd = random.Random(seed)
    bias = 0.1 + 0.8 * rnd.random()  # how often the sender gets the turn
    for _ in range(100_000):
        if send_i == len(sizes) and recv_i == len(sizes):
            break
        side = "send" if rnd.random() < bias else "recv"
        if side == "send" and send_i < len(sizes):
            if sp.finished:
                send_i += 1
                if send_i < len(sizes):
                    sp = Pipeline(sizes[send_i], frag, slots, filled)
                continue
            step = sp.fill(drained)
            if step is None:
                # blocked only when every slot holds an undrained fragment
                assert filled - drained == slots
                continue
            slot, lo, hi = step
            assert staging[slot] is None, "sender overwrote a fragment not yet drained"
            memory[slot * frag : slot * frag + hi - lo] = messages[send_i][lo:hi]
            staging[slot] = (send_i, lo)
            filled = sp.finish_fragment()
        elif side == "recv" and recv_i < len(sizes):
            if rp.finished:
                recv_i += 1
                if recv_i < len(sizes):
                    rp = Pipeline(sizes[recv_i], frag, slots, drained)
                continue
            step = rp.drain(filled)
            if step is None:
                assert filled == drained
                continue
            slot, lo, hi = step
            assert staging[slot] == (recv_i, lo), "receiver drained the wrong fragment"
            out[recv_i][lo:hi] = memory[slot * frag : slot * frag + hi - lo]
            staging[slot] = None
            drained = rp.finish_fragment()
    assert send_i == recv_i == len(sizes)
    assert [bytes(o) for o in out] == messages
    assert filled == drained == start + sum(-(-n // frag) for n in sizes)


# ------------------------------------------------------------------ Policy


def test_policy_default_is_staged_shm():
    assert Policy().choose(1, 10**9, ALL) == (PIPELINE, "shm")


def test_policy_prefers_pull_then_push_then_staged():
    p = Policy(order=["cma", "vmfd", "shm"], pullable={1: {"cma"}}, pushable={1: {"vmfd"}})
    assert p.choose(1, 100, ALL) == (PULL, "cma")
    assert p.choose(1, 100, PUSH | PIPELINE) == (PUSH, "vmfd")  # no regions offered
    assert p.choose(1, 100, PIPELINE) == (PIPELINE, "shm")
    assert p.choose(2, 100, ALL) == (PIPELINE, "shm")  # nothing known about rank 2


def test_policy_push_preference():
    p = Policy(order=["cma", "shm"], pullable={1: {"cma"}}, pushable={1: {"cma"}}, push=True)
    assert p.choose(1, 100, ALL) == (PUSH, "cma")
    assert p.choose(1, 100, PULL | PIPELINE) == (PULL, "cma")  # push not offered
    p.push = False
    assert p.choose(1, 100, ALL) == (PULL, "cma")


def test_policy_pushable_only():
    p = Policy(order=["cma", "shm"], pushable={1: {"cma"}})
    assert p.choose(1, 100, ALL) == (PUSH, "cma")
    assert p.choose(1, 100, PULL | PIPELINE) == (PIPELINE, "shm")


def test_policy_thresholds():
    p = Policy(order=["cma", "vmfd", "shm"], pullable={1: {"cma", "vmfd"}},
               thresholds={"cma": 1 << 20, "vmfd": 1 << 16})
    assert p.choose(1, 1000, ALL) == (PIPELINE, "shm")
    assert p.choose(1, (1 << 16) - 1, ALL) == (PIPELINE, "shm")
    assert p.choose(1, 1 << 16, ALL) == (PULL, "vmfd")
    assert p.choose(1, 1 << 20, ALL) == (PULL, "cma")
    assert p.choose(1, 1 << 30, ALL) == (PULL, "cma")


def test_policy_ring_full_pulls_whatever_the_threshold():
    # auto's set-up: cma only from 4 MiB and only where SPLIT works, else the pipeline
    p = Policy(order=["cma", "vmfd", "shm"], pullable={1: {"cma"}, 2: {"vmfd"}},
               pushable={1: {"cma"}, 3: {"cma"}}, thresholds={"cma": 4 << 20, "vmfd": 1 << 40},
               split_only={"cma"})
    assert p.choose(1, 1 << 20, ALL) == (PIPELINE, "shm")
    assert p.choose(1, 1 << 20, ALL, ring_full=True) == (PULL, "cma")
    assert p.choose(2, 1 << 20, ALL, ring_full=True) == (PULL, "vmfd")
    # nothing to pull with: as usual (a push would wait for the busy sender too)
    assert p.choose(1, 1 << 20, PUSH | PIPELINE, ring_full=True) == (PIPELINE, "shm")
    assert p.choose(3, 1 << 20, ALL, ring_full=True) == (PIPELINE, "shm")
    p.forced = "shm"
    assert p.choose(1, 1 << 20, ALL, ring_full=True) == (PIPELINE, "shm")


def test_a_rendezvous_within_the_eager_limit_is_pulled():
    """The sender's ring was full (eager=False): the receiver pulls it, not the pipeline."""
    p = Policy(order=["cma", "shm"], pullable={0: {"cma"}}, thresholds={"cma": 4 << 20},
               split_only={"cma"})
    net = Net(policies=[Policy(), p])
    for nbytes, expected in ((LIMIT, "cma"), (LIMIT + 1, "shm")):
        data = payload(nbytes)
        rop = net.recv(1, 0, 5, nbytes)
        sop = net.send(0, 1, 5, data, eager=False)
        net.pump()
        assert sop.done and received(rop) == data and rop.mechanism == expected


def test_policy_staged_threshold_falls_back_to_shm():
    p = Policy(order=["shm"], thresholds={"shm": 1 << 20})
    assert p.choose(1, 10, ALL) == (PIPELINE, "shm")


def test_policy_forced_ignores_order_and_thresholds():
    p = Policy(order=["cma", "vmfd", "shm"], pullable={1: {"cma", "vmfd"}},
               thresholds={"vmfd": 1 << 30}, forced="vmfd")
    assert p.choose(1, 10, ALL) == (PULL, "vmfd")
    p = Policy(order=["cma", "shm"], pushable={1: {"cma"}}, forced="cma")
    assert p.choose(1, 10, ALL) == (PUSH, "cma")
    p = Policy(order=["cma", "shm"], pullable={1: {"cma"}}, forced="shm")
    assert p.choose(1, 10, ALL) == (PIPELINE, "shm")


def test_policy_staged_transport_by_name():
    p = Policy(order=["fancy", "shm"], staged={"shm", "fancy"})
    assert p.choose(1, 10, ALL) == (PIPELINE, "fancy")
    assert p.choose(1, 10, PULL | PUSH) == (PIPELINE, "shm")  # fallback, whatever is offered


def test_engine_uses_policy_per_source():
    policy = Policy(order=["cma", "shm"], pullable={0: {"cma"}})
    net = Net(3, policies=[pull_policy(1), policy, pull_policy(1)])
    d0, d2 = payload(500, 0), payload(500, 2)
    net.send(0, 1, 0, d0)
    net.send(2, 1, 0, d2)
    r0 = net.recv(1, 0, 0, 500)
    r2 = net.recv(1, 2, 0, 500)
    net.pump()
    assert (received(r0), received(r2)) == (d0, d2)
    assert (r0.mechanism, r2.mechanism) == ("cma", "shm")


# ------------------------------------------------------------------ synchronous mode, matched probes


@pytest.mark.parametrize("posted_first", [True, False])
@pytest.mark.parametrize("nbytes", [0, 40, LIMIT + 1])
def test_synchronous_send_completes_only_once_matched(posted_first, nbytes):
    net = Net()
    data = payload(nbytes)
    rop = net.recv(1, 0, 7, LIMIT + 10) if posted_first else None
    sop = net.send(0, 1, 7, data, sync=True) if nbytes else None
    if sop is None:  # an empty synchronous send still waits for its receive
        sop, actions = net.engines[0].send(1, 7, [memoryview(b"")], sync=True)
        net.act(0, actions)
    if nbytes <= LIMIT:
        (t,) = net.kinds(0, Transmit)
        assert t.kind == EAGER | SYNC and t.aux == sop.msgid
    net.pump()
    assert sop.done == posted_first
    if not posted_first:
        rop = net.recv(1, 0, 7, LIMIT + 10)
        net.pump()
    assert sop.done and rop.done and received(rop) == data
    assert net.completed[0] == [sop]
    assert not net.engines[0].sends


def test_truncated_synchronous_send_is_released():
    net = Net()
    sop = net.send(0, 1, 2, payload(50), sync=True)
    rop = net.recv(1, 0, 2, 10)
    net.pump()
    assert rop.done and isinstance(rop.error, TruncationError) and sop.done


def test_probe_does_not_release_a_synchronous_send():
    net = Net()
    sop = net.send(0, 1, 3, payload(8), sync=True)
    net.pump()
    assert net.engines[1].probe(0, 3) is not None
    net.pump()
    assert not sop.done


@pytest.mark.parametrize("nbytes", [8, LIMIT + 1])
def test_matched_probe_takes_the_message_out_of_matching(nbytes):
    net = Net()
    first, second = payload(nbytes, 1), payload(nbytes, 2)
    net.send(0, 1, 4, first)
    net.send(0, 1, 4, second)
    net.pump()
    engine = net.engines[1]
    arrival = engine.mprobe(0, 4)
    assert arrival is not None and arrival.nbytes == nbytes
    other = net.recv(1, 0, 4, nbytes)  # a receive takes the next message, not the probed one
    net.pump()
    assert received(other) == second
    op, actions = engine.mrecv(arrival, net.mem.buffer(nbytes))
    net.act(1, actions)
    net.pump()
    assert received(op) == first and (op.matched_source, op.matched_tag) == (0, 4)
    assert engine.mprobe(0, 4) is None

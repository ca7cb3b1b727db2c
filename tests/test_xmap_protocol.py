"""Sans-IO tests of xmap's part of the protocol: the RTS's XMAP offer and HeapRefs, the
receiver's choice of xmap (Pull with heap refs, or MapView for recv_view), the view's
late FIN, and UNMAP. No processes, no mappings: two Engines and hand-carried packets."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cma.errors import ProtocolError
from cma.protocol import (
    EAGER,
    FIN,
    PIPELINE,
    PULL,
    PUSH,
    RTS,
    XMAP,
    Complete,
    Deliver,
    Engine,
    MapView,
    Policy,
    Pull,
    Transmit,
    Unmap,
    decode_rts,
    decode_unmap,
    encode_rts,
    encode_unmap,
)
from cma.wire import UNMAP, HeapRef, Region

LIMIT = 64
BIG = 1000


def ref(offset: int = 4096, extent: int = 1 << 20, segment: int = 3, generation: int = 7) -> HeapRef:
    return HeapRef(segment, generation, offset, extent, 11, 12345)


def region_of(mv: memoryview) -> Region:
    return Region(0x10000 + id(mv) % 4096 * 4096, mv.nbytes)


# Progress bounds object messages by the machine's memory; these engines, by what a test
# may allocate (a forged 23.5 GiB object raised MemoryError from numpy in CI).
OBJECT_LIMIT = 1 << 30


def _untouched(nbytes: int) -> memoryview:
    """Memory as Progress allocates it: not written until a copy does (a forged size of
    some GiB zero-filled by bytearray took the whole machine's memory: an OOM kill in CI)."""
    return np.empty(nbytes, np.uint8).data


def engine(rank: int, mappable: set[int], heap: dict[int, HeapRef] | None = None) -> Engine:
    """An engine whose heap holds the buffers of the sizes in ``heap`` (size -> ref)."""
    policy = Policy(order=["self", "cma", "shm"], pullable={1 - rank: {"cma"}},
                    pushable={1 - rank: set()}, mappable=mappable)
    heap_of = None if heap is None else (lambda dest, mv: heap.get(mv.nbytes))
    return Engine(rank, LIMIT, policy, PULL | PUSH | PIPELINE,
                  allocate=_untouched, region_of=region_of,
                  heap_of=heap_of, max_object_bytes=OBJECT_LIMIT)


def deliver(actions: list, to: Engine, source: int) -> list:
    out = []
    for action in actions:
        if isinstance(action, Transmit):
            out += to.packet(source, action.kind, action.tag, action.aux, action.payload)
    return out


# ------------------------------------------------------------------ wire format

def test_rts_carries_heap_refs_and_decodes_them():
    refs = [ref(0), ref(8192, segment=4, generation=9)]
    payload = encode_rts(5, PULL | XMAP, [100, 200], [Region(0x1000, 100), Region(0x2000, 200)], refs)
    info = decode_rts(payload, peer=1)
    assert info.heap == refs
    assert info.regions == [Region(0x1000, 100), Region(0x2000, 200)]
    assert decode_rts(encode_rts(5, PULL, [100], [Region(0x1000, 100)]), 1).heap is None


@pytest.mark.parametrize("bad", [
    "xmap-without-pull", "missing-refs", "past-extent", "generation-0", "negative-fd",
])
def test_rts_with_a_forged_heap_ref_is_a_protocol_error(bad):
    offers = PULL | XMAP
    refs: list[HeapRef] | None = [ref()]
    if bad == "xmap-without-pull":
        offers = PIPELINE | XMAP
    elif bad == "missing-refs":
        refs = None
    elif bad == "past-extent":
        refs = [ref(offset=(1 << 20) - 50)]
    elif bad == "generation-0":
        refs = [ref(generation=0)]
    elif bad == "negative-fd":
        refs = [ref()._replace(fd=-1)]
    payload = encode_rts(5, offers, [100], [Region(0x1000, 100)], refs)
    with pytest.raises(ProtocolError, match="rank 1"):
        decode_rts(payload, peer=1)


def test_unmap_round_trip_and_forgeries():
    segments = [(3, 7), (4, 9)]
    assert decode_unmap(encode_unmap(segments), 2, 1) == segments
    with pytest.raises(ProtocolError):
        decode_unmap(encode_unmap(segments), 3, 1)
    with pytest.raises(ProtocolError):
        decode_unmap(b"\0" * 12, 1, 1)
    receiver = engine(0, {1})
    assert receiver.packet(1, UNMAP, 0, 2, encode_unmap(segments)) == [Unmap(1, segments)]
    with pytest.raises(ProtocolError, match="unknown packet kind"):
        receiver.packet(1, UNMAP | 0x100, 0, 2, encode_unmap(segments))


# ------------------------------------------------------------------ the sender's offer

def test_sender_offers_xmap_only_when_every_buffer_is_in_its_heap():
    sender = engine(1, set(), heap={BIG: ref()})
    _, actions = sender.send(0, 1, [memoryview(bytearray(BIG))])
    info = decode_rts(actions[0].payload)
    assert info.offers & XMAP and info.heap == [ref()]
    # one buffer of two is not in the heap: plain RGET
    _, actions = sender.send(0, 1, [memoryview(bytearray(BIG)), memoryview(bytearray(BIG + 1))])
    assert not decode_rts(actions[0].payload).offers & XMAP
    # not exposed (a buffered send's copies, say): nothing to map either
    _, actions = sender.send(0, 1, [memoryview(bytearray(BIG))], expose=False)
    assert not decode_rts(actions[0].payload).offers & XMAP
    # a rank without xmap never offers it
    _, actions = engine(1, set()).send(0, 1, [memoryview(bytearray(BIG))])
    assert not decode_rts(actions[0].payload).offers & XMAP


# ------------------------------------------------------------------ the receiver's choice

@pytest.mark.parametrize("mappable", [True, False])
def test_receiver_pulls_through_xmap_only_from_a_mappable_peer(mappable):
    sender = engine(1, set(), heap={BIG: ref()})
    receiver = engine(0, {1} if mappable else set())
    _, rts = sender.send(0, 1, [memoryview(bytearray(BIG))])
    op, _ = receiver.recv(1, 1, memoryview(bytearray(BIG)))
    [pull] = deliver(rts, receiver, 1)
    assert isinstance(pull, Pull)
    if mappable:
        assert (pull.transport, pull.heap, op.mechanism) == ("xmap", [ref()], "xmap")
    else:
        assert pull.transport == "cma" and pull.heap is None


def test_a_view_maps_in_place_and_its_fin_waits_for_the_release():
    sender = engine(1, set(), heap={BIG: ref()})
    receiver = engine(0, {1})
    send, rts = sender.send(0, 1, [memoryview(bytearray(BIG))])
    op, _ = receiver.recv(1, 1, None, view=True)
    [mapview] = deliver(rts, receiver, 1)
    assert isinstance(mapview, MapView) and mapview.refs == [ref()] and mapview.op is op
    assert mapview.sizes == [BIG]
    assert op.segments == [] and op.mechanism == "xmap"  # nothing allocated
    assert receiver.view_mapped(op) == [Complete(op)] and op.done
    assert not send.done  # the sender's buffer is still the receiver's view
    fin = receiver.view_released(1, mapview.msgid)
    assert [(t.kind, t.aux) for t in fin] == [(FIN, send.msgid)]
    assert deliver(fin, sender, 0) == [Complete(send)] and send.done


def test_a_view_of_a_message_not_in_the_heap_is_a_fresh_copy():
    receiver = engine(0, {1})
    # eager
    op, _ = receiver.recv(1, 1, None, view=True)
    actions = receiver.packet(1, EAGER, 1, 0, b"abc")
    assert isinstance(actions[0], Deliver) and op.done
    # rendezvous from a buffer outside the sender's heap: pulled into a new buffer
    sender = engine(1, set(), heap={})
    _, rts = sender.send(0, 2, [memoryview(bytearray(BIG))])
    op, _ = receiver.recv(1, 2, None, view=True)
    [pull] = deliver(rts, receiver, 1)
    assert isinstance(pull, Pull) and pull.heap is None and pull.transport == "cma"
    assert [s.nbytes for s in op.segments] == [BIG]


@pytest.mark.parametrize("view", [True, False])
def test_a_refused_mapping_is_answered_as_a_copy(view):
    """Where the receiver cannot map (its registration cache is full of mappings in use),
    Progress hands the RTS back (map_refused): pulled by the policy's transport into a new
    buffer or the receive's own, and the sender's FIN follows that pull, as for any RGET."""
    sender = engine(1, set(), heap={BIG: ref()})
    receiver = engine(0, {1})
    send, rts = sender.send(0, 1, [memoryview(bytearray(BIG))])
    op, _ = receiver.recv(1, 1, None if view else memoryview(bytearray(BIG)), view=view)
    [first] = deliver(rts, receiver, 1)
    assert isinstance(first, MapView if view else Pull) and first.rts is not None
    [pull] = receiver.map_refused(op, 1, first.rts)
    assert isinstance(pull, Pull) and pull.transport == "cma" and pull.heap is None
    assert op.mechanism == "cma" and [s.nbytes for s in op.segments] == [BIG]
    done = receiver.pulled(op, pull.msgid)
    assert op.done and [(t.kind, t.aux) for t in done if isinstance(t, Transmit)] == [(FIN, send.msgid)]
    assert Complete(send) in deliver(done, sender, 0) and send.done


def test_an_object_of_several_heap_buffers_is_mapped_whole_for_views():
    sender = engine(1, set(), heap={BIG: ref(), BIG + 8: ref(8192)})
    receiver = engine(0, {1})
    _, rts = sender.send(0, 1, [memoryview(bytearray(BIG)), memoryview(bytearray(BIG + 8))], True)
    op, _ = receiver.recv(1, 1, None, view=True)
    [mapview] = deliver(rts, receiver, 1)
    assert isinstance(mapview, MapView) and mapview.refs == [ref(), ref(8192)]
    assert mapview.sizes == [BIG, BIG + 8] and op.is_object and op.segments == []
    # without views the same message is pulled through xmap
    _, rts = sender.send(0, 2, [memoryview(bytearray(BIG)), memoryview(bytearray(BIG + 8))], True)
    op, _ = receiver.recv(1, 2, None)
    [pull] = deliver(rts, receiver, 1)
    assert isinstance(pull, Pull) and pull.transport == "xmap" and len(pull.heap) == 2
    assert [s.nbytes for s in op.segments] == [BIG, BIG + 8]


def test_an_rts_offering_xmap_is_checked_before_matching():
    receiver = engine(0, {1})
    words = array("q", [1, PULL | XMAP, 1, BIG, 0x1000])  # the refs are missing
    with pytest.raises(ProtocolError):
        receiver.packet(1, RTS, 1, BIG, words.tobytes())


# ------------------------------------------------------------------ forged packets

words = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from([0, 1, 7, 4096, 1 << 20]))


small = st.integers(-5, 1 << 21)
structured = st.builds(
    lambda size, addr, fields: encode_rts(1, PULL | XMAP, [size], [Region(addr, size)],
                                          [HeapRef(*fields)]),
    small, words, st.tuples(small, small, small, small, small, small))
payloads = st.one_of(st.lists(words, min_size=3, max_size=20).map(lambda w: array("q", w).tobytes()),
                     structured)


@settings(max_examples=300, deadline=None)
@given(payloads, st.booleans())
@example(encode_rts(1, PULL | XMAP, [BIG], [Region(0x1000, BIG)], [ref()]), True).via("a view")
@example(encode_rts(1, PULL | XMAP, [BIG], [Region(0x1000, BIG)], [ref()]), False).via("a pull")
@example(array("q", [0, 0, 7, 0, 0, 0, 0, 0, 0, 25276514009]).tobytes(), False).via("23.5 GiB")
def test_a_forged_xmap_rts_or_unmap_is_refused_or_stays_within_the_segment(payload, view):
    """Whatever words a peer writes, an RTS offering XMAP either raises ProtocolError or
    leads to copies that stay inside the segment it names; an UNMAP likewise."""
    for kind in (RTS, UNMAP):
        receiver = engine(0, {1})
        receiver.recv(1, 1, None, view=view)
        size = decode_rts(payload).sizes if kind == RTS and _decodes(payload) else [0]
        aux = sum(size) if kind == RTS else len(payload) // 16
        try:
            actions = receiver.packet(1, kind, 1, aux, payload)
        except ProtocolError as exc:
            assert exc.peer == 1
            continue
        for action in actions:
            if isinstance(action, Pull) and action.heap is not None:
                for region, ref_ in zip(action.remote, action.heap, strict=True):
                    assert 0 <= ref_.offset and ref_.offset + region.nbytes <= ref_.extent
            if isinstance(action, MapView):
                assert all(ref_ok(r, n) for r, n in zip(action.refs, action.sizes, strict=True))


def _decodes(payload: bytes) -> bool:
    try:
        decode_rts(payload)
    except ProtocolError:
        return False
    return True


def ref_ok(ref_: HeapRef, nbytes: int) -> bool:
    return 0 <= ref_.offset and ref_.offset + nbytes <= ref_.extent and ref_.generation >= 1

"""cma.mpi's wildcard matching on mixed ranks (cma.mpi.mixed.Wildcards), without MPI.

A rank with peers on its node (ranks 1, 2: their messages come through cma) and
elsewhere (ranks 3, 4: through MPI). Each channel is modelled as an MPI engine of its own
(posted receives take arriving messages; the rest wait as unexpected, in arrival order),
as cma's engine and MPI are. Receives are posted as cma.mpi.Comm posts them: one that
``Wildcards.must_wait`` says must wait joins the queue, the others go straight to their
channel; passes of ``Wildcards.matches`` (with the hook's cma-only passes too) probe the
channels and take what they find, as ``Comm._match_wildcards`` does; messages may also arrive
between the probes of one pass, as they do in a real process. Whatever hypothesis makes of
the order of sends, posts and passes, the outcome must obey MPI's matching rules:

- a receive gets only a message it matches, every message is received at most once;
- non-overtaking: a receive never gets a message while an earlier message from the same
  sender that it also matches is still unreceived, and never takes a message that a
  receive posted before it, still waiting, also matches;
- progress: once no more messages come, passes leave no waiting receive with a message
  it matches still unreceived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cma.mpi.mixed import Found, Wildcards
from cma.mpi.mpiapi import ANY_SOURCE, ANY_TAG

LOCAL = (1, 2)
REMOTE = (3, 4)


def matches(source: int, tag: int, message: Message) -> bool:
    return source in (ANY_SOURCE, message.source) and tag in (ANY_TAG, message.tag)


@dataclass(eq=False)
class Message:
    source: int
    tag: int
    seq: int  # per sender, in send order


@dataclass(eq=False)
class Receive:
    source: int
    tag: int
    posted: int  # post order
    got: Message | None = None
    when: int = -1  # the clock when it got its message


@dataclass
class Channel:
    """One engine's matching: posted receives first, then unexpected messages in order."""

    posted: list[Receive] = field(default_factory=list)
    unexpected: list[Message] = field(default_factory=list)


class Rank:
    def __init__(self) -> None:
        self.cma, self.mpi = Channel(), Channel()
        self.wildcards: Wildcards[Receive] = Wildcards(lambda source: source in LOCAL)
        self.receives: list[Receive] = []
        self.messages: list[Message] = []
        self.sent = dict.fromkeys(LOCAL + REMOTE, 0)
        self.clock = 0
        self.arriving: list[tuple[int, int]] = []  # messages that come in during a pass

    def channel(self, source: int) -> Channel:
        return self.cma if source in LOCAL else self.mpi

    def complete(self, recv: Receive, message: Message) -> None:
        assert recv.got is None and matches(recv.source, recv.tag, message)
        self.clock += 1
        recv.got, recv.when = message, self.clock

    def send(self, source: int, tag: int) -> None:
        self.sent[source] += 1
        message = Message(source, tag, self.sent[source])
        self.messages.append(message)
        channel = self.channel(source)
        for recv in channel.posted:
            if matches(recv.source, recv.tag, message):
                channel.posted.remove(recv)
                self.complete(recv, message)
                return
        channel.unexpected.append(message)

    def post(self, source: int, tag: int) -> None:
        recv = Receive(source, tag, len(self.receives))
        self.receives.append(recv)
        if self.wildcards.must_wait(source, tag):
            self.wildcards.add(recv, source, tag)
            self.advance(True)
            return
        channel = self.channel(source)
        for message in channel.unexpected:
            if matches(source, tag, message):
                channel.unexpected.remove(message)
                self.complete(recv, message)
                return
        channel.posted.append(recv)

    def probe(self, on_cma: bool, source: int, tag: int) -> Found:
        found = next(((m.source, m.tag) for m in (self.cma if on_cma else self.mpi).unexpected
                      if matches(source, tag, m)), None)
        if self.arriving:  # (a message may arrive between one probe and the next)
            self.send(*self.arriving.pop(0))
        return found

    def advance(self, probe_mpi: bool, arriving: list[tuple[int, int]] | None = None) -> None:
        self.arriving = list(arriving or [])
        for recv, on_cma, source, tag in self.wildcards.matches(self.probe, probe_mpi):
            channel = self.cma if on_cma else self.mpi
            # what cma's bind (a receive for exactly that source and tag) or MPI's
            # matched probe takes: the first such message
            message = next(m for m in channel.unexpected if matches(source, tag, m))
            channel.unexpected.remove(message)
            self.complete(recv, message)
        for source, tag in self.arriving:  # (the pass ended before they came)
            self.send(source, tag)
        self.arriving = []


SOURCES = st.sampled_from([*LOCAL, *REMOTE])
TAGS = st.integers(0, 2)
STEPS = st.one_of(
    st.tuples(st.just("send"), SOURCES, TAGS),
    st.tuples(st.just("recv"), st.sampled_from([ANY_SOURCE, ANY_SOURCE, *LOCAL, *REMOTE]),
              st.sampled_from([ANY_TAG, 0, 1, 2])),
    st.tuples(st.just("pass"), st.booleans(), st.lists(st.tuples(SOURCES, TAGS), max_size=3)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(STEPS, max_size=40))
def test_wildcards_obey_mpi_matching(script: list[tuple[str, Any, Any]]) -> None:
    rank = Rank()
    for kind, a, b in script:
        if kind == "send":
            rank.send(a, b)
        elif kind == "recv":
            rank.post(a, b)
        else:
            rank.advance(bool(a), b)
    for _ in range(len(script) + 1):  # no more messages: passes until nothing changes
        rank.advance(True)

    got = [r for r in rank.receives if r.got is not None]
    assert len({id(r.got) for r in got}) == len(got), "a message was received twice"
    received = {id(r.got): r for r in got}
    for recv in got:
        message = recv.got
        assert message is not None
        # an earlier message from the same sender that this receive matches was received
        # before this one, by an earlier-completed receive
        for earlier in rank.messages:
            if earlier.source == message.source and earlier.seq < message.seq and \
                    matches(recv.source, recv.tag, earlier):
                taker = received.get(id(earlier))
                assert taker is not None and taker.when < recv.when, (recv, earlier)
        # no receive posted before this one that matches its message was still waiting
        for before in rank.receives[: recv.posted]:
            if matches(before.source, before.tag, message):
                assert before.got is not None and before.when < recv.when, (before, recv)
    # progress: nothing left that a waiting receive matches
    unreceived = [m for m in rank.messages if id(m) not in received]
    for recv in rank.receives:
        if recv.got is None:
            assert not any(matches(recv.source, recv.tag, m) for m in unreceived), \
                (recv, unreceived)


def test_a_later_receive_waits_behind_a_wildcard_that_could_take_its_message() -> None:
    wildcards: Wildcards[str] = Wildcards(lambda source: source in LOCAL)
    assert wildcards.must_wait(ANY_SOURCE, 5)
    wildcards.add("wild", ANY_SOURCE, 5)
    assert wildcards.must_wait(3, 5) and wildcards.must_wait(1, ANY_TAG)
    assert not wildcards.must_wait(3, 6)  # (tag 6 is no message the wildcard takes)
    assert wildcards.owner(4, 5) == "wild" and wildcards.owner(4, 6) is None
    assert wildcards.remove("wild") and not wildcards and not wildcards.remove("wild")

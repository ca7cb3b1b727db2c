"""cma.mpi's wildcard matching on mixed ranks (cma.mpi.mixed.Wildcards), without MPI.

A rank with peers on its node (ranks 1, 2: their messages come through cma) and
elsewhere (ranks 3, 4: through MPI). Each channel is the reference engine of MPI matching
(tests/matching_model.py: posted receives take arriving messages; the rest wait as
unexpected, in arrival order), as cma's engine and MPI are. Receives are posted as
cma.mpi.Comm posts them: one that ``Wildcards.must_wait`` says must wait joins the queue,
the others go straight to their channel; passes of ``Wildcards.matches`` (with the hook's
cma-only passes too) probe the channels and take what they find, as
``MixedRank.match_wildcards`` (cma/mpi/mixedio.py) does; messages may also arrive
between the probes of one pass, as they do in a real process. Whatever hypothesis makes
of the order of sends, posts and passes, the outcome must obey MPI's rules as the
reference model checks them
(``matching_model.violations``: what a receive admits, once each, non-overtaking per
sender, posted order, progress), since which channel a wildcard hears first is as open as
which sender's message arrives first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from matching_model import Engine, violations

from cma.mpi.mixed import Found, Wildcards
from cma.mpi.mpiapi import ANY_SOURCE, ANY_TAG

LOCAL = (1, 2)
REMOTE = (3, 4)


@dataclass(eq=False)
class Message:
    source: int
    tag: int
    seq: int  # per sender, in send order


@dataclass(eq=False)
class Receive:
    source: int
    tag: int
    got: Message | None = None
    when: int | None = None  # the clock when it got its message


class Rank:
    def __init__(self) -> None:
        self.cma: Engine[Receive, Message] = Engine(ANY_SOURCE)
        self.mpi: Engine[Receive, Message] = Engine(ANY_SOURCE)
        self.wildcards: Wildcards[Receive] = Wildcards(lambda source: source in LOCAL)
        self.receives: list[Receive] = []  # in post order
        self.messages: list[Message] = []
        self.sent = dict.fromkeys(LOCAL + REMOTE, 0)
        self.clock = 0
        self.arriving: list[tuple[int, int]] = []  # messages that come in during a pass

    def channel(self, source: int) -> Engine[Receive, Message]:
        return self.cma if source in LOCAL else self.mpi

    def complete(self, recv: Receive, message: Message) -> None:
        assert recv.got is None
        self.clock += 1
        recv.got, recv.when = message, self.clock

    def send(self, source: int, tag: int) -> None:
        self.sent[source] += 1
        message = Message(source, tag, self.sent[source])
        self.messages.append(message)
        recv = self.channel(source).arrive(message)
        if recv is not None:
            self.complete(recv, message)

    def post(self, source: int, tag: int) -> None:
        recv = Receive(source, tag)
        self.receives.append(recv)
        if self.wildcards.must_wait(source, tag):
            self.wildcards.add(recv, source, tag)
            self.advance(True)
            return
        message = self.channel(source).post(recv)
        if message is not None:
            self.complete(recv, message)

    def probe(self, on_cma: bool, source: int, tag: int) -> Found:
        message = (self.cma if on_cma else self.mpi).probe(source, tag)
        if self.arriving:  # (a message may arrive between one probe and the next)
            self.send(*self.arriving.pop(0))
        return None if message is None else (message.source, message.tag)

    def advance(self, probe_mpi: bool, arriving: list[tuple[int, int]] | None = None) -> None:
        self.arriving = list(arriving or [])
        for recv, on_cma, source, tag in self.wildcards.matches(self.probe, probe_mpi):
            # what cma's bind (a receive for exactly that source and tag) or MPI's
            # matched probe takes: the first such message
            message = (self.cma if on_cma else self.mpi).take(source, tag)
            assert message is not None, "a probe found a message that is not there"
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

    broken = violations(rank.receives, rank.messages, any_source=ANY_SOURCE)
    assert not broken, "\n".join(broken)


def test_a_later_receive_waits_behind_a_wildcard_that_could_take_its_message() -> None:
    wildcards: Wildcards[str] = Wildcards(lambda source: source in LOCAL)
    assert wildcards.must_wait(ANY_SOURCE, 5)
    wildcards.add("wild", ANY_SOURCE, 5)
    assert wildcards.must_wait(3, 5) and wildcards.must_wait(1, ANY_TAG)
    assert not wildcards.must_wait(3, 6)  # (tag 6 is no message the wildcard takes)
    assert wildcards.owner(4, 5) == "wild" and wildcards.owner(4, 6) is None
    assert wildcards.remove("wild") and not wildcards and not wildcards.remove("wild")

"""The reference model of MPI matching at one receiver, which every matching test checks
its subject against: cma's engine (test_protocol.py's hypothesis test, sans-IO, and
test_matching_property.py, across processes) and cma.mpi's wildcard matcher on mixed
ranks (test_mixed_matching.py).

MPI's rules (MPI 4.1, section 3.5), for one communicator:

- a receive takes only a message its source and tag admit: ANY_SOURCE admits every
  source, ANY_TAG every tag a user may send (>= 0; cma's own tags are negative);
- non-overtaking: of one sender's messages that a receive admits, it takes the earliest
  not taken yet;
- posted order: a message that several pending receives admit goes to the one posted
  first;
- progress: a pending receive and an arrived message it admits do not both stay so.

``Engine`` applies them as a receiver does, in the order messages arrive and receives
are posted. That order across senders is not always seen from outside (another process's
engine, or two channels); what the rules then fix is checked by ``BySource`` (per
sender, in post order) and ``violations`` (with the order receives completed in).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from cma import ANY_SOURCE, ANY_TAG


class Addressed(Protocol):
    """A receive (source and tag it asks for) or a message (source and tag it carries)."""

    @property
    def source(self) -> int: ...

    @property
    def tag(self) -> int: ...


R = TypeVar("R", bound=Addressed)
M = TypeVar("M", bound=Addressed)


def admits(source: int, tag: int, message: Addressed, any_source: int = ANY_SOURCE) -> bool:
    """Whether a receive for (``source``, ``tag``) may take ``message``."""
    return (source == message.source or source == any_source) and \
        (tag == message.tag or (tag == ANY_TAG and message.tag >= 0))


class Engine(Generic[R, M]):
    """One receiver's matching: posted receives wait in the order they were posted,
    arrived messages that no receive took wait in the order they arrived."""

    def __init__(self, any_source: int = ANY_SOURCE) -> None:
        self.any_source = any_source
        self.posted: list[R] = []
        self.unexpected: list[M] = []

    def post(self, receive: R) -> M | None:
        """The message ``receive`` takes at once, or None: then it waits."""
        message = self.take(receive.source, receive.tag)
        if message is None:
            self.posted.append(receive)
        return message

    def arrive(self, message: M) -> R | None:
        """The waiting receive that takes ``message``, or None: then the message waits."""
        for i, receive in enumerate(self.posted):
            if admits(receive.source, receive.tag, message, self.any_source):
                return self.posted.pop(i)
        self.unexpected.append(message)
        return None

    def _waiting(self, source: int, tag: int) -> int:
        return next((i for i, m in enumerate(self.unexpected)
                     if admits(source, tag, m, self.any_source)), -1)

    def probe(self, source: int, tag: int) -> M | None:
        """The waiting message a receive for (source, tag) would take, left waiting."""
        i = self._waiting(source, tag)
        return None if i < 0 else self.unexpected[i]

    def take(self, source: int, tag: int) -> M | None:
        """The waiting message a receive for (source, tag) takes, if any."""
        i = self._waiting(source, tag)
        return None if i < 0 else self.unexpected.pop(i)


class BySource(Generic[M]):
    """The rules where the order in which different senders' messages arrived is not known.

    MPI leaves open which sender's message a receive that admits several senders gets,
    never which of one sender's messages: each sender's messages, in the order sent, wait
    in an ``Engine`` of their own as if all had arrived, and receives, fed in the order
    they were posted with the sender each got its message from, take from that engine.
    """

    def __init__(self, messages: Iterable[M], any_source: int = ANY_SOURCE) -> None:
        self.any_source = any_source
        self.engines: dict[int, Engine[Any, M]] = {}
        for message in messages:
            self.engines.setdefault(message.source, Engine(any_source)).arrive(message)

    def receive(self, source: int, tag: int, sender: int) -> M | None:
        """The message that a receive for (source, tag), posted after those fed so far,
        must have got if it got one from ``sender``; None if it admits none left."""
        engine = self.engines.get(sender)
        return None if engine is None or source not in (sender, self.any_source) else \
            engine.take(source, tag)

    def probe(self, source: int, tag: int, sender: int) -> M | None:
        """The same for a probe, which takes nothing."""
        engine = self.engines.get(sender)
        return None if engine is None or source not in (sender, self.any_source) else \
            engine.probe(source, tag)

    def unreceived(self) -> list[M]:
        return [m for engine in self.engines.values() for m in engine.unexpected]


class Completed(Protocol[M]):
    """A receive as a test saw it: what it asked for, what it got and when (a clock that
    orders completions), or None for both while it is pending."""

    @property
    def source(self) -> int: ...

    @property
    def tag(self) -> int: ...

    @property
    def got(self) -> M | None: ...

    @property
    def when(self) -> int | None: ...


def violations(receives: Sequence[Completed[M]], messages: Sequence[M], *,
               any_source: int = ANY_SOURCE) -> list[str]:
    """Every break of the rules by ``receives`` (in the order posted) of ``messages`` (in
    the order sent, per sender), all sent and nothing more to come; [] if none."""
    out: list[str] = []
    taker = {}  # id(message): the receive that got it
    for receive in receives:
        message = receive.got
        if message is None:
            continue
        if not admits(receive.source, receive.tag, message, any_source):
            out.append(f"{receive} got a message it does not admit")
        if id(message) in taker:
            out.append(f"{message} was received twice: by {taker[id(message)]} and {receive}")
        taker[id(message)] = receive
    # non-overtaking, per sender in post order
    model = BySource(messages, any_source)
    for receive in receives:
        if receive.got is not None:
            expected = model.receive(receive.source, receive.tag, receive.got.source)
            if expected is not receive.got:
                out.append(f"{receive}: the model gives it {expected}")
    # ... and in the order receives completed
    sent = {id(m): i for i, m in enumerate(messages)}
    for posted, receive in enumerate(receives):
        message, when = receive.got, receive.when
        if message is None or when is None:
            continue
        for earlier in messages[: sent[id(message)]]:
            if earlier.source == message.source and admits(receive.source, receive.tag, earlier,
                                                           any_source):
                first = taker.get(id(earlier))
                if first is None or first.when is None or first.when > when:
                    out.append(f"{receive} overtook {earlier} (taken by {first})")
        # posted order: no receive posted before it that admits its message was pending
        for before in receives[:posted]:
            if admits(before.source, before.tag, message, any_source) and \
                    (before.when is None or before.when > when):
                out.append(f"{receive} took {message}, which {before}, posted before it, admits")
    # progress
    unreceived = [m for m in messages if id(m) not in taker]
    for receive in receives:
        if receive.got is None:
            left = [m for m in unreceived if admits(receive.source, receive.tag, m, any_source)]
            if left:
                out.append(f"{receive} is pending while {left[0]}, which it admits, was sent")
    return out

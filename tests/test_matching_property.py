"""Message matching under a seeded random mix of receives, probes and completions.

Rank 0 receives what ranks 1-3 send through a random mix of Irecv, Recv, irecv, recv
(some posted in a burst before their messages are sent), Probe or Iprobe then a receive
of what they saw (sometimes into a buffer a byte short), and test, wait, waitany,
waitall or testall over random subsets in random orders, and records what each call saw.
The test process replays the calls through the reference model of MPI matching
(tests/matching_model.py, which test_mixed_matching checks cma.mpi's wildcards against):
per source, in posting order, each receive or probe sees the earliest message of that
source not received yet that its tag admits. Source, tag, count, content and truncation must
agree, and every message must be received once.

Nothing can deadlock: rank 0 posts a receive, or blocks in one or in Probe, only when more
of the sent messages it admits are left than pending receives could take first; a sender
blocks only in a rendezvous or waiting for rank 0 to let it send its next chunk. A seed
fixes the messages and rank 0's choices, not the timing: a failure may take a few reruns.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from conftest import PUSH_TRANSPORTS, SMALL_RING, run_ranks
from matching_model import BySource

import cma
from cma import ANY_SOURCE, ANY_TAG
from cma.direct import DIRECT_FROM
from cma.errors import TruncationError

CONFIGS = [pytest.param(cma.ChannelConfig(), id="default"),
           pytest.param(SMALL_RING, id="small-ring")]
# (senders, seed). With one sender the world has two ranks, and rank 0 keeps the fast paths
# that bypass the matcher (more ranks than cores turn them off).
CASES = [pytest.param(1, 1, id="1sender-seed1"), pytest.param(1, 2, id="1sender-seed2"),
         pytest.param(2, 3, id="2senders-seed3"), pytest.param(3, 4, id="3senders-seed4")]
TAGS = [0, 1, 2, 7]
GO_TAG = 99  # rank 0 to a sender: send your next chunk
OFFSETS = 1 << 16  # where in the plan's random pool a message may start, so contents differ
PROBES = ("Probe", "Iprobe")
# Weights of rank 0's steps in its phases: posting (receives wait for their messages),
# blocking (few receives pending, so Recv and Irecv take the fast paths that bypass the
# matcher when it holds nothing) and probing (which moves arrivals to the unexpected queue).
PHASES = [
    {"release": 1, "post": 7, "receive": 1, "probe": 1, "complete": 3, "pause": 0.3},
    {"release": 2, "receive": 7, "probe": 1, "complete": 6, "pause": 1},
    {"release": 1, "post": 1, "receive": 4, "probe": 5, "complete": 2, "pause": 0.5},
]


def digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def admits(source: int, tag: int, key: tuple[int, int]) -> bool:
    return source in (ANY_SOURCE, key[0]) and tag in (ANY_TAG, key[1])


@dataclass(frozen=True)
class Message:
    source: int
    tag: int
    how: str  # "Send" or "Isend" (a buffer), "isend" (an object)
    data: Any = field(repr=False)  # what the sender passes (MiBs: kept out of tracebacks)
    count: int  # bytes a buffer receive gets: the buffer, or the object's pickle stream
    digest: str  # of those bytes


@dataclass
class Plan:
    seed: int
    tags: list[int]
    # per sender: what it sends at each go-ahead
    chunks: dict[int, list[list[Message]]] = field(repr=False)


def message_size(rng: random.Random, config: cma.ChannelConfig) -> int:
    """From 0 B across the eager limit to three fragments past it; mostly small."""
    eager, frag = config.eager_limit, config.frag_size
    return rng.choice([0, 1, rng.randint(2, 64), rng.randint(2, eager // 16),
                       rng.randint(eager // 16, eager - 1), eager, eager + 1,
                       rng.randint(eager + 2, eager + 3 * frag)])


def make_plan(seed: int, senders: int, config: cma.ChannelConfig) -> Plan:
    rng = random.Random(seed)
    tags = rng.sample(TAGS, rng.randint(2, 3))  # few tags: receives compete for messages
    pool = np.frombuffer(np.random.default_rng(seed).bytes(
        config.eager_limit + 3 * config.frag_size + OFFSETS), np.uint8)
    chunks = {}
    for source in range(1, senders + 1):
        messages = []
        for index in range(rng.randint(90, 150) // senders):
            tag = rng.choice(tags)
            offset = rng.randrange(OFFSETS)
            data = pool[offset : offset + message_size(rng, config)]
            if rng.random() < 0.2:
                obj = (source, index, data.tobytes())
                stream = pickle.dumps(obj, protocol=5)  # what cma sends: bytes stay in band
                messages.append(Message(source, tag, "isend", obj, len(stream), digest(stream)))
            else:
                # A Send that waits for rank 0 (a rendezvous, or the direct one from
                # DIRECT_FROM) would wait while rank 0 may be waiting for a later message of
                # this sender: blocking Sends are the ones that return at once only.
                eager = data.nbytes <= config.eager_limit and data.nbytes < DIRECT_FROM
                how = "Send" if eager and rng.random() < 0.5 else "Isend"
                messages.append(Message(source, tag, how, data, data.nbytes, digest(data)))
        cuts = sorted(rng.sample(range(1, len(messages)), len(messages) // 6))
        bounds = [0, *cuts, len(messages)]
        chunks[source] = [messages[a:b] for a, b in pairwise(bounds)]
    return Plan(seed, tags, chunks)


def send_chunks(plan: Plan, comm: cma.Comm) -> None:
    """A sender (ranks 1-3): chunk after chunk, each once rank 0 says so."""
    requests = []
    for number, chunk in enumerate(plan.chunks[comm.rank]):
        if number:
            assert comm.recv(source=0, tag=GO_TAG) == number
        for m in chunk:
            if m.how == "Send":
                comm.Send(m.data, 0, m.tag)
            elif m.how == "Isend":
                requests.append(comm.Isend(m.data, 0, m.tag))
            else:
                requests.append(comm.isend(m.data, 0, m.tag))
    cma.Request.Waitall(requests)
    comm.close()  # delivers what still waits for room in a full ring


@dataclass
class Call:
    """A receive or probe as rank 0 made it, and what it saw: (source, tag, count, outcome),
    the outcome being the digest of what arrived, "truncated", or None for a probe."""

    name: str
    source: int
    tag: int
    capacity: int | None = None  # of a buffer receive
    seen: tuple[int, int, int, str | None] | None = None


class Model:
    """The reference model of matching (matching_model.BySource), fed the calls in posting
    order: per source, each receive or probe sees the earliest message of that source not
    received yet that its tag admits."""

    def __init__(self, plan: Plan) -> None:
        self.messages = {source: [m for chunk in chunks for m in chunk]
                         for source, chunks in plan.chunks.items()}
        self.matching = BySource(m for messages in self.messages.values() for m in messages)

    def number(self, m: Message) -> str:
        index = next(i for i, sent in enumerate(self.messages[m.source]) if sent is m)
        return f"message {index} of rank {m.source}"

    def disagreement(self, number: int, call: Call) -> str | None:
        """What is wrong with what call ``number`` saw, if anything."""
        assert call.seen is not None
        source = call.seen[0]
        said = (f"call {number}, {call.name}(source={call.source}, tag={call.tag}, "
                f"capacity={call.capacity}), saw (source, tag, count, outcome) {call.seen}")
        see = self.matching.probe if call.name in PROBES else self.matching.receive
        m = see(call.source, call.tag, source)
        if m is None:
            return f"{said}: it admits no message left of rank {source}"
        outcome = None if call.name in PROBES else \
            "truncated" if call.capacity is not None and m.count > call.capacity else m.digest
        expected = (m.source, m.tag, m.count, outcome)
        if call.seen != expected:
            return f"{said}; the model: {self.number(m)}, {expected}"
        return None

    def unreceived(self) -> list[str]:
        return [f"{self.number(m)} ({m.how}, tag {m.tag}, {m.count} B) was never received"
                for m in self.matching.unreceived()]


class Receiver:
    """Rank 0: a random mix of calls, each checked against the model once it and the calls
    made before it are complete, so that a wrong match fails at once instead of leading to
    a hang."""

    def __init__(self, plan: Plan, comm: cma.Comm) -> None:
        self.plan, self.comm = plan, comm
        self.rng = random.Random(f"receiver {plan.seed}")
        self.sent = {source: 1 for source in plan.chunks}  # chunks each sender was let send
        # messages sent (or about to be) and not received yet, per (source, tag)
        self.left = Counter((m.source, m.tag) for chunks in plan.chunks.values() for m in chunks[0])
        self.model = Model(plan)
        self.messages = [m for messages in self.model.messages.values() for m in messages]
        self.calls: list[Call] = []
        self.checked = 0  # calls agreed with the model so far
        self.pending: list[tuple[Call, cma.Request, Any]] = []  # with the buffer, if any

    def safe(self, source: int, tag: int) -> bool:
        """Whether a receive of (source, tag) is sure to be satisfied: of the messages it
        admits, more are left than pending receives could take (a message goes to the
        earliest pending receive that admits it, so later receives cannot starve it)."""
        keys = [key for key, n in self.left.items() if n > 0 and admits(source, tag, key)]
        rivals = sum(any(admits(call.source, call.tag, key) for key in keys)
                     for call, _, _ in self.pending)
        return sum(self.left[key] for key in keys) > rivals

    def widen(self, source: int, tag: int) -> tuple[int, int]:
        """(source, tag), each sometimes replaced by its wildcard."""
        return (ANY_SOURCE if self.rng.random() < 0.3 else source,
                ANY_TAG if self.rng.random() < 0.3 else tag)

    def pattern(self) -> tuple[int, int] | None:
        """A safe (source, tag) of a message left, maybe widened to wildcards."""
        keys = [key for key, n in self.left.items() if n > 0]
        for _ in range(5 if keys else 0):
            pattern = self.widen(*self.rng.choice(keys))
            if self.safe(*pattern):
                return pattern
        return None

    def buffer(self, pattern: tuple[int, int], capacity: int | None = None) -> tuple[Any, int]:
        """A buffer of ``capacity`` bytes, by default room for the largest message the
        pattern admits, or for any message (so that a wrong match is not refused for lack
        of room), and sometimes a little more."""
        if capacity is None:
            anything = self.rng.random() < 0.5
            capacity = max(m.count for m in self.messages
                           if anything or admits(*pattern, (m.source, m.tag)))
            capacity += self.rng.choice([0, 0, 1, 64])
        buf = np.empty(capacity, np.uint8) if self.rng.random() < 0.7 else bytearray(capacity)
        return buf, capacity

    def record(self, call: Call, status: cma.Status, value: Any) -> None:
        if isinstance(value, tuple):  # an object message: compare its pickle stream
            value = pickle.dumps(value, protocol=5)
        self.saw(call, status.source, status.tag, status.count, digest(value))

    def saw(self, call: Call, source: int, tag: int, count: int, outcome: str | None) -> None:
        call.seen = (source, tag, count, outcome)
        if call.name not in PROBES:
            self.left[source, tag] -= 1

    def post(self, pattern: tuple[int, int] | None = None) -> None:
        """Irecv or irecv, left pending."""
        pattern = pattern or self.pattern()
        if pattern is None:
            return
        if self.rng.random() < 0.2:
            call, buf = Call("irecv", *pattern), None
            request = self.comm.irecv(None, *pattern)
        else:
            buf, capacity = self.buffer(pattern)
            call = Call("Irecv", *pattern, capacity)
            request = self.comm.Irecv(buf, *pattern)
        self.calls.append(call)
        self.pending.append((call, request, buf))

    def receive(self, pattern: tuple[int, int] | None = None, capacity: int | None = None
                ) -> None:
        """Recv, Irecv then Wait, or recv."""
        pattern = pattern or self.pattern()
        if pattern is None:
            return
        how = self.rng.choice(["Recv", "Recv", "Irecv", "recv"])
        call = Call(how, *pattern)
        self.calls.append(call)
        status = cma.Status()
        if how == "recv":
            self.record(call, status, self.comm.recv(None, *pattern, status))
            return
        buf, call.capacity = self.buffer(pattern, capacity)
        try:
            if how == "Recv":
                self.comm.Recv(buf, *pattern, status)
            else:
                self.comm.Irecv(buf, *pattern).Wait(status)
        except TruncationError as exc:
            self.saw(call, exc.source, exc.tag, exc.nbytes, "truncated")
        else:
            self.record(call, status, memoryview(buf)[: status.count])

    def probe(self) -> None:
        """Probe (when safe) or Iprobe; then mostly a receive of what it saw, which is next
        in line for that (source, tag), sometimes into a buffer a byte short."""
        status = cma.Status()
        if self.rng.random() < 0.5:
            pattern = self.pattern()
            if pattern is None:
                return
            call = Call("Probe", *pattern)
            self.comm.Probe(*pattern, status)
        else:
            call = Call("Iprobe", self.rng.choice([ANY_SOURCE, *self.plan.chunks]),
                        self.rng.choice([ANY_TAG, *self.plan.tags]))
            if not self.comm.Iprobe(call.source, call.tag, status):
                return
        self.saw(call, status.source, status.tag, status.count, None)
        self.calls.append(call)
        if self.rng.random() < 0.85:  # else it stays for a later receive: probes take nothing
            # room for exactly the probed message, or a byte less, or more
            capacity = max(0, status.count + self.rng.choice([-1, -1, 0, 0, 1, 100]))
            self.receive((status.source, status.tag), capacity)

    def complete(self) -> None:
        """Test or Wait one pending receive, or waitany, waitall or testall some of them, in
        random order (the lowercase calls return the objects of irecvs, and run Test, Wait,
        Waitany and Testall, which runs Waitall)."""
        if not self.pending:
            return
        entries = self.rng.sample(self.pending, self.rng.randint(1, len(self.pending)))
        requests = [request for _, request, _ in entries]
        statuses = [cma.Status() for _ in entries]
        how = self.rng.choice(["test", "wait", "waitany", "waitall", "testall"])
        if how == "waitany":
            index, value = cma.Request.waitany(requests, statuses[0])
            done = [(entries[index], statuses[0], value)]
        elif how in ("test", "wait"):
            finished, value = requests[0].test(statuses[0]) if how == "test" else \
                (True, requests[0].wait(statuses[0]))
            done = [(entries[0], statuses[0], value)] if finished else []
        else:
            finished, values = cma.Request.testall(requests, statuses) if how == "testall" else \
                (True, cma.Request.waitall(requests, statuses))
            done = list(zip(entries, statuses, values, strict=True)) if finished else []
        for (call, request, buf), status, value in done:
            self.pending.remove((call, request, buf))
            self.record(call, status, value if buf is None else memoryview(buf)[: status.count])

    def waiting(self) -> list[int]:
        return [source for source, n in self.sent.items() if n < len(self.plan.chunks[source])]

    def release(self) -> None:
        """Let a sender send its next chunk, often after posting receives for it, which are
        then waiting before any of its messages is sent."""
        if not self.waiting():
            return
        source = self.rng.choice(self.waiting())
        chunk = self.plan.chunks[source][self.sent[source]]
        self.left.update((m.source, m.tag) for m in chunk)
        if self.rng.random() < 0.6:
            for m in chunk:
                pattern = self.widen(m.source, m.tag)
                if self.safe(*pattern):
                    self.post(pattern)
        self.comm.send(self.sent[source], dest=source, tag=GO_TAG)
        self.sent[source] += 1

    def pause(self) -> None:
        """Let messages pile up in the rings, so that the next call finds several."""
        time.sleep(self.rng.random() * 0.003)

    def check(self) -> None:
        while self.checked < len(self.calls) and self.calls[self.checked].seen is not None:
            disagreement = self.model.disagreement(self.checked, self.calls[self.checked])
            if disagreement:
                raise AssertionError(disagreement)
            self.checked += 1

    def run(self) -> list[str]:
        """Receive every message; return what the model says was never received."""
        phase, steps_left = self.rng.randrange(len(PHASES)), 0
        while self.pending or self.waiting() or any(n > 0 for n in self.left.values()):
            if not steps_left:  # the phases take turns, so that every run has each
                phase, steps_left = (phase + 1) % len(PHASES), self.rng.randint(5, 30)
            steps_left -= 1
            weights = PHASES[phase]
            getattr(self, self.rng.choices(list(weights), list(weights.values()))[0])()
            self.check()
        status = cma.Status()
        if self.comm.Iprobe(ANY_SOURCE, ANY_TAG, status):  # one more than was sent
            self.calls.append(Call("Iprobe", ANY_SOURCE, ANY_TAG,
                                   seen=(status.source, status.tag, status.count, None)))
            self.check()
        return self.model.unreceived()


def check_matching(transport: str, config: cma.ChannelConfig, senders: int, seed: int,
                   **options: Any) -> None:
    plan = make_plan(seed, senders, config)
    funcs = [lambda comm: Receiver(plan, comm).run()] + [partial(send_chunks, plan)] * senders
    case = (f"seed={seed} senders={senders} transport={transport!r} options={options} "
            f"config={config}")
    try:
        unreceived = run_ranks(transport, config, funcs, timeout=30, **options)[0]
    except (AssertionError, pytest.fail.Exception) as exc:  # a disagreement, a hang, an error
        pytest.fail(f"{case}: {exc}")
    assert not unreceived, f"{case}: {unreceived[0]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("senders", "seed"), CASES)
def test_matching_follows_the_reference_model(transport, config, senders, seed):
    check_matching(transport, config, senders, seed)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{"push": True}, {"overlap": True}], ids=["push", "overlap"])
@pytest.mark.parametrize("name", PUSH_TRANSPORTS)
def test_matching_follows_the_reference_model_with_rput_or_overlap(name, options):
    """The sender writing (RPUT), or the receiver copying on a thread, change when a
    rendezvous receive completes, not which message it takes."""
    check_matching(name, SMALL_RING, 2, 5, **options)

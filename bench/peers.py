"""Hand a NumPy array to another process: cma's zero-copy ``recv_view`` and one-copy
xmap ``Recv`` against what a Python user would otherwise pick (Ray's object store,
``multiprocessing.shared_memory`` by hand, ``torch.multiprocessing``), in one run.

Not in CI: Ray and torch are not dependencies of cma (a way whose package is missing is
skipped, with the reason). In a venv of its own::

    python -m venv /tmp/peers && /tmp/peers/bin/pip install -e . ray torch  # (a CPU build of torch will do)
    /tmp/peers/bin/python bench/peers.py --repeat 20 --json peers.json

The ways, and the copies each makes of every payload byte. The producer is a forked
child (Ray: an actor) holding a ``uint8`` array of the size; the consumer is this
process (Ray: a second actor, and this process is the driver). The cma, shm and torch
ways take turns at each size; Ray runs after them, alone (one session for all sizes),
since its idle daemons and workers would take CPU from the others on a small machine:

- ``cma recv_view``: the producer's array is a heap array (``cma.empty``), sent with a
  blocking ``Send`` on a ``cma.Pipe(xmap=True)``; the consumer takes ``recv_view`` (a
  read-only view of the producer's pages) and releases it, and the producer's ``Send``
  returns then. **0 copies** where cma takes the direct rendezvous (from 256 KiB, the
  receiver being allowed to read the sender, as here, although the eager limit is
  2 MiB); below that the message goes inline through the control ring, copied into it
  and out of it (2 user copies), and ``Send`` returns once it is in the ring.
- ``cma xmap Recv``: the same array, ``Recv``'d into a warm ``np.empty`` buffer: **1
  copy**, out of the consumer's mapping of the producer's segment (2 when inline).
- ``ray put/get``: the producer actor ``ray.put``s its NumPy array (**1 copy**, into the
  plasma store) and calls the consumer actor with the ObjectRef (in a list, so that Ray
  does not resolve it before the call); the consumer ``ray.get``s it (**0 copies**: a
  read-only array on the store's shared memory) and drops it.
- ``shm by hand``: the producer copies its array into a ``SharedMemory`` block made once
  per size and already touched (**1 copy**) and sends the block's name on a pipe; the
  consumer attaches, builds an ndarray on ``shm.buf`` (**0 copies**), reads it and closes
  it; on Python < 3.13 it also unregisters the block from its resource tracker, which
  would otherwise unlink the block when the consumer exits.
- ``torch queue``: the producer ``copy_``s its array into a shared tensor made once per
  size and already touched (**1 copy**) and puts it in a ``torch.multiprocessing`` Queue;
  the consumer ``get``s it (the storage's fd, handed over by the producer's resource
  sharer, mapped: **0 copies**) and takes ``.numpy()`` (a writable array on the same
  pages).

Each round the producer writes the round's number into byte 0 (not timed) and the
consumer reads byte 0 and the last byte, so nothing is skipped lazily; the first round
of each size also compares every byte (not timed). The producer and the consumer read
the same clock (``perf_counter`` is CLOCK_MONOTONIC, one clock for the whole machine),
so times subtract across processes. The machine may be shared: before each way at each
size the run waits (2 min at most) until the CPUs are less than 25% busy while it idles,
and redoes that way (twice at most) when they are busy right after it; the report says
how often. Columns, in microseconds, median [min-max] of ``--repeat`` rounds after the
warm-up (at least 5 rounds, and at least 0.2 s of them):

- ``copy``: the producer's copy into shared storage (``ray.put``; the copy into the
  block or the shared tensor). None for cma: its array is made in the heap.
- ``take``: the consumer's own work from the handle being there (the RTS at the head of
  the ring, the ObjectRef in hand, the block's name received, the queue's item waiting)
  to holding the array with its two bytes read, plus letting it go afterwards:
  ``recv_view`` + ``release()``; ``Recv`` (its copy included); ``ray.get`` + ``del``;
  attach + ``close()``; ``get`` + ``.numpy()`` + ``del``.
- ``one-way``: from the end of the producer's copy (cma: the call to ``Send``) to the
  consumer holding the read array: the handle's way across and the consumer's wake-up
  (for Ray the actor call, that is Ray's scheduling), then the take.
- ``round``: from the producer's copy (cma: ``Send``) to the producer knowing the
  consumer let go (cma: ``Send`` returning, which for an inline message is earlier;
  shm, torch: the consumer's next message on the pipe). For Ray the driver's
  ``ray.get(producer.round.remote())``: the end-to-end task round trip, two actor
  calls, put and get included.
- ``1st take``: the take of the size's first (warm-up) round, which makes mappings.
- ``faults``: minor page faults in the producer during its copy / in the consumer during
  its take, medians (``getrusage``, every thread of the process): a copy into memory
  not touched before pays one per 4 KiB page.
- ``cma copies``: payload bytes copied per payload byte, user + kernel, counted by both
  processes' ``comm.stats()`` over the timed rounds, and what carried them.

Two summaries per size follow: the hand-over when the data is already shared (the take
and one-way of ``recv_view``, ``ray.get``, shm attach and torch ``get``) and the whole
hand-over, the copy into shared storage included (copy + take per round: xmap ``Recv``,
``ray.put`` + ``ray.get``, shm copy + attach, torch copy + get; and the time from the
copy's start to the array held), each against cma's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any

import numpy as np

import cma
from cma.bench.report import format_number, render_table
from cma.bench.results import copy_summary
from cma.bench.sizes import format_size, parse_size


def optional(name: str) -> tuple[ModuleType | None, str]:
    """The module, or None and why it could not be imported."""
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:
        return None, f"{name} is not importable ({exc})"


ray, RAY_MISSING = optional("ray")
torch, TORCH_MISSING = optional("torch")
torch_mp = importlib.import_module("torch.multiprocessing") if torch is not None else None

DEFAULT_SIZES = "64K,1M,4M,16M,64M,256M"
# Warm-up: rounds for at least this long, and at least this many. After idling (the
# other ways' turns) this VM's CPUs hand work over slowly for the first few ms: a cma
# round of 1 MiB took 1-5 ms for its first 4-5 rounds after a 1 s pause, 30-60 us after.
WARM_SECONDS = 0.2
WARM_UP = 5
TIMEOUT = 120.0  # seconds any one wait for a peer may take before the run gives up
PERIOD = 251  # byte i of the data is i % 251 (a prime: no page or line repeats the same bytes)
DATA, REQUEST, COMMAND, RESULT = 1, 2, 3, 4  # cma's tags
DONE, ROUND, TIMED = 0, 1, 2  # cma's requests: the size is done, a round, the first timed one
# The machine is shared: another user's work comes in bursts that take both CPUs for
# seconds, longer than one way's rounds at one size. So each way at each size starts on
# a quiet machine, and is redone when the machine is busy right after it.
QUIET_BUSY = 0.25  # the CPUs' busy fraction, this run idle, below which the machine is quiet
QUIET_PROBE = 0.2  # seconds per look
QUIET_WAIT = 120.0  # seconds waited at most before one way at one size
REDO = 2  # times one way at one size is redone at most
FORK = mp.get_context("fork")
VIEW, RECV, RAY, SHM, TORCH = "cma recv_view", "cma xmap Recv", "ray put/get", "shm by hand", "torch queue"
WAYS = {  # copies of each payload byte (the producer's + the consumer's), where cma sends none inline
    VIEW: "0", RECV: "0 + 1", RAY: "1 + 0", SHM: "1 + 0", TORCH: "1 + 0"}
# the summaries' columns: the hand-over of data already shared, and with the copy into it
SHARED = {VIEW: "recv_view", RAY: "ray.get", SHM: "shm attach", TORCH: "torch get"}
WHOLE = {RECV: "xmap Recv", RAY: "ray.put + get", SHM: "shm copy + attach", TORCH: "torch copy + get"}


def pattern(size: int) -> np.ndarray:
    return np.resize(np.arange(PERIOD, dtype=np.uint8), size)


def stamp(r: int) -> int:
    return (r + 1) & 0xFF


def check(arr: np.ndarray, r: int, whole: bool = False) -> None:
    """Read byte 0 (round ``r``'s stamp) and the last byte; with ``whole``, every byte."""
    size = arr.size
    if whole:
        want = pattern(size)
        want[0] = stamp(r)
        ok = bool(np.array_equal(arr, want))
    else:
        ok = int(arr[0]) == stamp(r) and int(arr[-1]) == (size - 1) % PERIOD
    if not ok:
        raise RuntimeError(f"round {r}: the consumer's {size}-byte array is not the producer's")


def minor_faults() -> int:
    """This process's minor page faults so far (every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def receive(conn: Connection) -> Any:
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no message from the peer in {TIMEOUT:.0f} s")
    return conn.recv()


def command(conn: Connection) -> Any:
    """A producer's next command: waited for as long as the parent lives, since the parent
    may wait minutes for a quiet machine between two."""
    parent = os.getppid()
    while not conn.poll(1.0):
        if os.getppid() != parent:
            raise SystemExit("the parent is gone")
    return conn.recv()


def stop(child: BaseProcess) -> None:
    """Join a producer, killing it if it does not end by itself."""
    child.join(TIMEOUT)
    if child.is_alive():
        child.kill()
        child.join(5)


@dataclass
class Rounds:
    """One way at one size: every round's timestamps (perf_counter seconds)."""

    copies: list[tuple[float, float]] = field(default_factory=list)  # producer: copy start, end
    takes: list[tuple[float, float]] = field(default_factory=list)  # consumer: take start, held
    lets: list[tuple[float, float]] = field(default_factory=list)  # consumer: letting go
    spans: list[tuple[float, float]] = field(default_factory=list)  # round start, end
    copy_faults: list[int] = field(default_factory=list)  # page faults during the copy
    take_faults: list[int] = field(default_factory=list)  # ... during the take
    stats: dict[str, Any] | None = None  # cma: copies per byte counted by comm.stats()
    readonly: bool = True  # whether the consumer's array was read-only
    warm: int = -1  # warm-up rounds (the first ones): -1 while still warming up
    faults_at: int = 0  # (the count when the take began)

    def schedule(self, repeat: int) -> Iterator[int]:
        """The rounds' numbers: warm-up ones (``warm`` is set when they end), then
        ``repeat`` timed ones."""
        start = time.perf_counter()
        r = 0
        while r < WARM_UP or time.perf_counter() - start < WARM_SECONDS:
            yield r
            r += 1
        self.warm = r
        yield from range(r, r + repeat)

    def begin(self) -> float:
        """The take's start: the handle is there."""
        self.faults_at = minor_faults()
        return time.perf_counter()

    def held(self, r: int, take0: float, arr: np.ndarray) -> float:
        """Read round ``r``'s ``arr``, got since ``take0``; when letting it go starts (the
        caller drops ``arr`` then, and calls ``let_go``)."""
        check(arr, r)
        self.takes.append((take0, time.perf_counter()))
        if r == 0:
            before = minor_faults()
            check(arr, r, whole=True)
            self.faults_at += minor_faults() - before  # (the check's own are not the take's)
            self.readonly = not arr.flags.writeable
        return time.perf_counter()

    def let_go(self, let0: float) -> None:
        self.lets.append((let0, time.perf_counter()))
        self.take_faults.append(minor_faults() - self.faults_at)

    def columns(self) -> dict[str, list[float]]:
        """Microseconds per round, warm-up rounds included."""
        us = 1e6
        take = [(h - t0 + t1 - let0) * us
                for (t0, h), (let0, t1) in zip(self.takes, self.lets, strict=True)]
        copy = [(c1 - c0) * us for c0, c1 in self.copies]
        holds = [h for _, h in self.takes]
        return {
            "copy": copy,
            "take": take,
            "one-way": [(h - c1) * us for (_, c1), h in zip(self.copies, holds, strict=True)],
            "round": [(end - start) * us for start, end in self.spans],
            "copy+take": [c + t for c, t in zip(copy, take, strict=True)],
            "copy start to held": [(h - c0) * us for (c0, _), h in zip(self.copies, holds, strict=True)],
        }


# ------------------------------------------------------------------ cma: both ways


def cma_producer(comm: cma.Comm) -> None:
    """For each size until None: send a heap array of it once per request, until DONE."""
    comm.attach()
    request = np.zeros(1, np.uint8)
    data = None
    try:
        while (size := comm.recv(source=1, tag=COMMAND)) is not None:
            if data is None or data.size != size:
                del data  # (first: two of the largest at once need not fit)
                data = cma.empty(size, np.uint8)
                data[:] = pattern(size)
            spans: list[tuple[float, float]] = []
            while True:
                comm.Recv(request, 1, REQUEST)
                if request[0] == DONE:
                    break
                if request[0] == TIMED:
                    comm.reset_stats()
                data[0] = stamp(len(spans))
                start = time.perf_counter()
                comm.Send(data, 1, DATA)  # returns once the view is released (or the copy made)
                spans.append((start, time.perf_counter()))
            comm.send((spans, comm.stats()), 1, RESULT)
    finally:
        comm.close()


class CmaWays:
    """Both cma ways through one forked producer on a ``cma.Pipe(xmap=True)``."""

    def __init__(self) -> None:
        child_end, self.comm = cma.Pipe(xmap=True)  # the producer is rank 0, this process 1
        self.child = FORK.Process(target=cma_producer, args=(child_end,), daemon=True)
        self.child.start()
        child_end.close()
        self.comm.attach()
        progress = self.comm._progress
        assert progress is not None
        self.progress = progress
        self.inbox = progress.inboxes[0]

    def run(self, size: int, repeat: int, view: bool) -> Rounds:
        comm = self.comm
        buf = np.empty(0 if view else size, np.uint8)
        buf.fill(0)  # touched: the copy is timed, not first-touch faults
        request = np.zeros(1, np.uint8)
        out = Rounds()
        comm.send(size, 0, COMMAND)
        for r in out.schedule(repeat):
            request[0] = ROUND
            if r == out.warm:
                comm.reset_stats()
                request[0] = TIMED
            comm.Send(request, 0, REQUEST)
            # the wait recv_view and Recv would do themselves for the RTS, kept out of the take
            self.progress.await_head(self.inbox)
            take0 = out.begin()
            if view:
                arr = comm.recv_view(0, DATA)
                let0 = out.held(r, take0, arr)
                arr.release()
            else:
                comm.Recv(buf, 0, DATA)
                let0 = out.held(r, take0, buf)
            out.let_go(let0)
        own = comm.stats()
        request[0] = DONE
        comm.Send(request, 0, REQUEST)
        spans, theirs = comm.recv(source=0, tag=RESULT)
        out.spans = spans
        out.copies = [(start, start) for start, _ in spans]
        summary = copy_summary([own, theirs], repeat, size)
        if summary is not None:
            out.stats = {"user": summary.user, "kernel": summary.kernel, "via": list(summary.via)}
        return out

    def close(self) -> None:
        try:
            if self.child.is_alive():
                self.comm.send(None, 0, COMMAND)
        finally:
            stop(self.child)
            self.comm.close()


# ------------------------------------------------------------------ shared_memory by hand


def shm_producer(ctl: Connection) -> None:
    """Per (name, size) command until None: for each round number the consumer sends, copy
    the array into the block and send its name; the consumer's next message says it let go
    (and is the next round's number, or None when the size is done)."""
    while (order := command(ctl)) is not None:
        name, size = order
        source = pattern(size)
        block = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:
            target = np.ndarray(size, np.uint8, buffer=block.buf)
            target.fill(0)  # touched: the copy is timed, not first-touch faults
            copies, faults, ends = [], [], []
            r = receive(ctl)
            while r is not None:
                source[0] = stamp(r)
                faults_at = minor_faults()
                start = time.perf_counter()
                np.copyto(target, source)
                copies.append((start, time.perf_counter()))
                faults.append(minor_faults() - faults_at)
                ctl.send(name)
                r = receive(ctl)
                ends.append(time.perf_counter())
            del target
        finally:
            block.unlink()
            with contextlib.suppress(BufferError):  # (an ndarray left on it by an exception)
                block.close()
        ctl.send((copies, faults, ends))


def attach(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    block = shared_memory.SharedMemory(name=name)
    # Python < 3.13 registers an attached block for unlinking at exit (bpo-38119): undo that
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    return block


class ShmWay:
    """A forked producer: the consumer gets each block's name on a pipe."""

    def __init__(self) -> None:
        self.ctl, child_ctl = FORK.Pipe()
        # (forked before this process attaches any block: the producer's resource tracker
        # is its own, as between two unrelated processes)
        self.child = FORK.Process(target=shm_producer, args=(child_ctl,), daemon=True)
        self.child.start()
        child_ctl.close()
        self.names: list[str] = []

    def run(self, size: int, repeat: int) -> Rounds:
        name = f"peers-{os.getpid()}-{size}"
        self.names.append(name)
        out = Rounds()
        self.ctl.send((name, size))
        rounds = out.schedule(repeat)
        r = next(rounds, None)
        self.ctl.send(r)
        while r is not None:
            handle = receive(self.ctl)
            take0 = out.begin()
            block = attach(handle)
            arr = np.ndarray(size, np.uint8, buffer=block.buf)
            let0 = out.held(r, take0, arr)
            del arr
            block.close()
            out.let_go(let0)
            r = next(rounds, None)
            self.ctl.send(r)
        out.copies, out.copy_faults, ends = receive(self.ctl)
        out.spans = [(start, end) for (start, _), end in zip(out.copies, ends, strict=True)]
        return out

    def close(self) -> None:
        try:
            with contextlib.suppress(BrokenPipeError):
                self.ctl.send(None)
            stop(self.child)
        finally:
            self.ctl.close()
            for name in self.names:  # (what a killed producer left)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{name}")


# ------------------------------------------------------------------ torch.multiprocessing


def torch_producer(queue: Any, ctl: Connection) -> None:
    """Per size until None: for each round number the consumer sends, copy the array into
    a shared tensor and put it in the queue; the consumer's next message says it let go
    (and is the next round's number, or None when the size is done)."""
    assert torch is not None
    while (size := command(ctl)) is not None:
        source = pattern(size)
        shared = torch.zeros(size, dtype=torch.uint8).share_memory_()  # touched (zeros)
        copies, faults, ends = [], [], []
        r = receive(ctl)
        while r is not None:
            source[0] = stamp(r)
            faults_at = minor_faults()
            start = time.perf_counter()
            shared.copy_(torch.from_numpy(source))
            copies.append((start, time.perf_counter()))
            faults.append(minor_faults() - faults_at)
            queue.put(shared)
            r = receive(ctl)
            ends.append(time.perf_counter())
        del shared
        ctl.send((copies, faults, ends))


class TorchWay:
    """A forked producer putting shared tensors in a ``torch.multiprocessing`` Queue."""

    def __init__(self) -> None:
        assert torch_mp is not None
        ctx = torch_mp.get_context("fork")
        self.queue = ctx.Queue()
        self.ctl, child_ctl = ctx.Pipe()
        self.child = ctx.Process(target=torch_producer, args=(self.queue, child_ctl), daemon=True)
        self.child.start()
        child_ctl.close()

    def run(self, size: int, repeat: int) -> Rounds:
        out = Rounds()
        self.ctl.send(size)
        rounds = out.schedule(repeat)
        r = next(rounds, None)
        self.ctl.send(r)
        while r is not None:
            # the wait get would do itself for the item, kept out of the take
            if not self.queue._reader.poll(TIMEOUT):
                raise TimeoutError(f"no tensor from the producer in {TIMEOUT:.0f} s")
            take0 = out.begin()
            tensor = self.queue.get(timeout=TIMEOUT)
            arr = tensor.numpy()
            let0 = out.held(r, take0, arr)
            del arr, tensor
            out.let_go(let0)
            r = next(rounds, None)
            self.ctl.send(r)
        out.copies, out.copy_faults, ends = receive(self.ctl)
        out.spans = [(start, end) for (start, _), end in zip(out.copies, ends, strict=True)]
        return out

    def close(self) -> None:
        try:
            with contextlib.suppress(BrokenPipeError):
                self.ctl.send(None)
            stop(self.child)
        finally:
            self.ctl.close()
            self.queue.close()


# ------------------------------------------------------------------ Ray


class RayConsumer:
    """The actor that gets each object (made an actor by ``ray.remote`` in RayWay). It keeps
    its times until ``collect``: a Rounds returned per call would bring its class along,
    pickled by value, every time."""

    def __init__(self) -> None:
        self.out = Rounds()

    def take(self, refs: list[Any], r: int) -> None:
        assert ray is not None
        take0 = self.out.begin()
        arr = ray.get(refs[0], timeout=TIMEOUT)
        let0 = self.out.held(r, take0, arr)
        del arr
        self.out.let_go(let0)

    def collect(self) -> Rounds:
        out, self.out = self.out, Rounds()
        return out


class RayProducer:
    """The actor that puts its array in the object store and calls the consumer with it."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.data = np.empty(0, np.uint8)
        self.copies: list[tuple[float, float]] = []
        self.faults: list[int] = []

    def prepare(self, size: int) -> None:
        self.data = np.empty(0, np.uint8)  # (first: two of the largest at once need not fit)
        self.data = pattern(size)

    def round(self, r: int) -> None:
        assert ray is not None
        self.data[0] = stamp(r)
        faults_at = minor_faults()
        start = time.perf_counter()
        ref = ray.put(self.data)
        self.copies.append((start, time.perf_counter()))
        self.faults.append(minor_faults() - faults_at)
        ray.get(self.consumer.take.remote([ref], r), timeout=TIMEOUT)

    def collect(self) -> tuple[list[tuple[float, float]], list[int]]:
        out = self.copies, self.faults
        self.copies, self.faults = [], []
        return out


class RayWay:
    """Two actors on a local Ray of 2 CPUs; this process drives them."""

    def __init__(self, store_bytes: int) -> None:
        assert ray is not None
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # (no network here to report to)
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=store_bytes,
                 logging_level=logging.ERROR, log_to_driver=False)
        try:
            self.consumer = ray.remote(RayConsumer).remote()
            self.producer = ray.remote(RayProducer).remote(self.consumer)
        except BaseException:
            ray.shutdown()
            raise

    def run(self, size: int, repeat: int) -> Rounds:
        assert ray is not None
        ray.get(self.producer.prepare.remote(size), timeout=TIMEOUT)
        plan = Rounds()
        for r in plan.schedule(repeat):
            start = time.perf_counter()
            ray.get(self.producer.round.remote(r), timeout=TIMEOUT)
            plan.spans.append((start, time.perf_counter()))
        out: Rounds = ray.get(self.consumer.collect.remote(), timeout=TIMEOUT)
        out.copies, out.copy_faults = ray.get(self.producer.collect.remote(), timeout=TIMEOUT)
        out.spans, out.warm = plan.spans, plan.warm
        return out

    def close(self) -> None:
        assert ray is not None
        ray.shutdown()


# ------------------------------------------------------------------ report


def spread(values: list[float]) -> str:
    low, mid, high = (format_number(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} [{low}-{high}]"


def summarize(rounds: Rounds) -> dict[str, Any]:
    columns = rounds.columns()
    timed = {name: values[rounds.warm:] for name, values in columns.items()}
    return {
        "warm_up_rounds": rounds.warm,
        "columns_us": {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
                       for name, v in timed.items() if v},
        "first_take_us": columns["take"][0],
        "copy_faults": {"median": statistics.median(rounds.copy_faults[rounds.warm:]),
                        "samples": rounds.copy_faults[rounds.warm:]} if rounds.copy_faults else None,
        "take_faults": {"median": statistics.median(rounds.take_faults[rounds.warm:]),
                        "samples": rounds.take_faults[rounds.warm:]},
        "cma_copies_per_byte": rounds.stats,
        "consumer_array_readonly": rounds.readonly,
    }


def way_table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    rows = []
    for size, ways in results.items():
        for way in (w for w in WAYS if w in ways):
            res = ways[way]
            col = res["columns_us"]
            stats = res["cma_copies_per_byte"]
            copy_faults = res["copy_faults"]
            rows.append([
                format_size(size), way, WAYS[way],
                "-" if copy_faults is None else spread(col["copy"]["samples"]),
                spread(col["take"]["samples"]), spread(col["one-way"]["samples"]),
                spread(col["round"]["samples"]), format_number(res["first_take_us"]),
                ("-" if copy_faults is None else f"{copy_faults['median']:.0f}")
                + f"/{res['take_faults']['median']:.0f}",
                "" if stats is None else f"{stats['user'] + stats['kernel']:.2f} via {stats['via'][0]}",
            ])
    headers = ["size", "way", "copies", "copy", "take", "one-way", "round", "1st take", "faults",
               "cma copies"]
    return render_table(headers, rows, left=3)


def versus(results: dict[int, dict[str, dict[str, Any]]], ways: dict[str, str], column: str) -> str:
    """Medians of ``column`` per size, each way also as a multiple of the first way's."""
    present = [w for w in ways if any(w in r for r in results.values())]
    first = next(iter(ways))
    rows = []
    for size, res in results.items():
        row = [format_size(size)]
        for way in present:
            if way not in res:
                row.append("-")
                continue
            value = res[way]["columns_us"][column]["median"]
            ratio = "" if first not in res or way == first else \
                f" ({value / res[first]['columns_us'][column]['median']:.2f}x)"
            row.append(format_number(value) + ratio)
        rows.append(row)
    return render_table(["size", *(ways[w] for w in present)], rows, left=1)


def ray_rest(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Ray's task round trip less its put and get: the two actor calls' scheduling."""
    rows = []
    for size, res in results.items():
        if RAY in res:
            samples = res[RAY]["columns_us"]
            rest = [r - c for r, c in zip(samples["round"]["samples"], samples["copy+take"]["samples"],
                                          strict=True)]
            rows.append([format_size(size), spread(samples["round"]["samples"]),
                         spread(samples["copy+take"]["samples"]), spread(rest)])
    return render_table(["size", "task round trip", "put + get", "the rest (scheduling)"], rows, left=1)


def report(results: dict[int, dict[str, dict[str, Any]]], skipped: dict[str, str]) -> str:
    parts = [
        "microseconds, median [min-max] of the timed rounds (column meanings: the docstring)",
        way_table(results),
        "",
        "hand-over when the data is already shared: take (consumer's own work), median us, x recv_view",
        versus(results, SHARED, "take"),
        "",
        "the same, one-way (producer's hand-over start to the array held), median us, x recv_view",
        versus(results, SHARED, "one-way"),
        "",
        "whole hand-over incl. the copy into shared storage: copy + take per round, median us, "
        "x xmap Recv",
        versus(results, WHOLE, "copy+take"),
        "",
        "the same, from the copy's start to the array held (one-way), median us, x xmap Recv",
        versus(results, WHOLE, "copy start to held"),
    ]
    if any(RAY in r for r in results.values()):
        parts += ["", "Ray: driver's task round trip, its put + get, and the rest", ray_rest(results)]
    guards = [res["guard"] for ways in results.values() for res in ways.values()]
    loud = [f"{format_size(size)} {way}" for size, ways in results.items() for way, res in ways.items()
            if max(res["guard"]["busy_before"], res["guard"]["busy_after"]) > QUIET_BUSY]
    parts += [
        "",
        f"quiet machine (CPUs < {QUIET_BUSY:.0%} busy while this run idles): waited "
        f"{sum(g['waited_s'] for g in guards):.0f} s in all, before "
        f"{sum(1 for g in guards if g['waited_s'])} of {len(guards)} runs; "
        f"{sum(g['redone'] for g in guards)} runs redone; busy all the same around: "
        + (", ".join(loud) or "none"),
        *(f"skipped: {way}: {why}" for way, why in skipped.items()),
    ]
    return "\n".join(parts)


def busy() -> float:
    """The fraction of the CPUs' time spent busy over QUIET_PROBE seconds (this run idles
    meanwhile: the rest is another user's)."""
    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        total = user + nice + system + idle + iowait + irq + softirq + steal
        return total - idle - iowait, total

    busy0, total0 = ticks()
    time.sleep(QUIET_PROBE)
    busy1, total1 = ticks()
    return (busy1 - busy0) / max(1, total1 - total0)


def guarded(run: Callable[[], Rounds]) -> tuple[Rounds, dict[str, float]]:
    """``run()`` on a quiet machine: waits for one first, and redoes it when the machine is
    busy right after it; how long it waited, how often it redid it, the last look."""
    waited, redone = 0.0, 0
    while True:
        start = time.monotonic()
        before = first = busy()
        while before > QUIET_BUSY and time.monotonic() - start < QUIET_WAIT:
            time.sleep(0.5)
            before = busy()
        if first > QUIET_BUSY:
            waited += time.monotonic() - start
        out = run()
        after = busy()
        if after <= QUIET_BUSY or redone == REDO:
            return out, {"waited_s": waited, "redone": redone, "busy_before": before, "busy_after": after}
        redone += 1


def measure(runners: dict[str, Callable[[int, int], Rounds]], repeat: int,
            results: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Every way at one size before the next size (the load drifts), in WAYS' order."""
    for size, done in results.items():
        for way in WAYS:
            if way in runners:
                out, guard = guarded(lambda run=runners[way], size=size: run(size, repeat))
                done[way] = {**summarize(out), "guard": guard}
                took = done[way]["columns_us"]["take"]["samples"]
                print(f"  {format_size(size)} {way}: take {spread(took)} us, {guard}", file=sys.stderr,
                      flush=True)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__,
             "cma": importlib.metadata.version("cma-ipc")}
    for name, module in (("ray", ray), ("torch", torch)):
        found[name] = getattr(module, "__version__", "missing")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda text: [parse_size(s) for s in text.split(",")],
                        default=[parse_size(s) for s in DEFAULT_SIZES.split(",")],
                        help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--repeat", type=int, default=20, help="timed rounds per way and size")
    parser.add_argument("--json", help="write every sample and the summaries here")
    args = parser.parse_args()
    clock = time.get_clock_info("perf_counter").implementation
    if "CLOCK_MONOTONIC" not in clock:  # (times taken in two processes must subtract)
        raise SystemExit(f"perf_counter is {clock}, not one clock for every process")
    load_before = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in load_before)}, "
          + ", ".join(f"{k} {v}" for k, v in versions().items()), flush=True)
    skipped = {}
    results: dict[int, dict[str, dict[str, Any]]] = {size: {} for size in args.sizes}
    loads = {"start": load_before}
    with contextlib.ExitStack() as stack:
        # the forked producers before this process starts threads (cma's fd server)
        runners: dict[str, Callable[[int, int], Rounds]] = {
            SHM: stack.enter_context(contextlib.closing(ShmWay())).run}
        if torch is None:
            skipped[TORCH] = TORCH_MISSING
        else:
            runners[TORCH] = stack.enter_context(contextlib.closing(TorchWay())).run
        ways = stack.enter_context(contextlib.closing(CmaWays()))
        runners[VIEW] = lambda size, n: ways.run(size, n, view=True)
        runners[RECV] = lambda size, n: ways.run(size, n, view=False)
        measure(runners, args.repeat, results)
    # Ray afterwards, alone: its idle daemons and workers take CPU from the others' runs
    # on 2 CPUs, which users of the other ways would not have running
    if ray is None:
        skipped[RAY] = RAY_MISSING
    else:
        loads["ray start"] = os.getloadavg()
        with contextlib.closing(RayWay(max(1 << 30, 6 * max(args.sizes)))) as way:
            measure({RAY: way.run}, args.repeat, results)
    loads["end"] = os.getloadavg()
    print(report(results, skipped))
    print("load average (1, 5, 15 min): "
          + "; ".join(f"{when} {' '.join(f'{x:.2f}' for x in load)}" for when, load in loads.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "command": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "load_average": loads, "versions": versions(),
                "warm_up": {"rounds_at_least": WARM_UP, "seconds_at_least": WARM_SECONDS},
                "repeat": args.repeat, "copies": WAYS, "skipped": skipped,
                "results": {str(size): ways_ for size, ways_ in results.items()},
            }, f, indent=1)


if __name__ == "__main__":
    main()

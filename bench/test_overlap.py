"""Irecv + computation + Wait, with the receiver's copy inline or on a background thread.

Each round: the peer announces a 16 MiB message, this process posts ``Irecv`` (the
message is already announced, so it matches at once), computes in pure Python for
COMPUTE_S seconds (holding the GIL, as user code does), then ``Wait``s. Without
overlap the receiver's copy happens inside ``Irecv``; with ``overlap=True`` it runs on
a thread while the computation runs. ``extra_info`` carries the round time minus the
computation: what the message cost on top of the work (OSU's non-blocking benchmarks
report the same idea as an overlap percentage).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cma

NBYTES = 16 << 20
COMPUTE_S = 0.002  # about one copy of NBYTES on the project machine
ROUNDS = 50
TAG_GO, TAG_DATA = 1, 2


def _serve(comm: cma.Comm, rounds: int) -> None:
    data = np.full(NBYTES, 0x5A, np.uint8)
    for _ in range(rounds):
        comm.recv(source=0, tag=TAG_GO)
        comm.Send(data, dest=0, tag=TAG_DATA)
    comm.close()


def _compute(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture(params=[False, True], ids=["inline", "overlap"])
def receiver(request: pytest.FixtureRequest) -> Iterator[tuple[cma.Comm, bool]]:
    overlap = request.param
    a, b = cma.Pipe(overlap=overlap)
    proc = multiprocessing.get_context("fork").Process(
        target=_serve, args=(b, ROUNDS * 2 + 2), daemon=True)
    proc.start()
    b.close()
    try:
        yield a, overlap
    finally:
        proc.kill()
        proc.join(10)
        a.close()


def test_irecv_compute_wait(benchmark: Any, receiver: tuple[cma.Comm, bool]) -> None:
    comm, overlap = receiver
    buf = np.zeros(NBYTES, np.uint8)

    def one_round() -> None:
        comm.send(None, dest=1, tag=TAG_GO)
        comm.Probe(source=1, tag=TAG_DATA)
        req = comm.Irecv(buf, source=1, tag=TAG_DATA)
        _compute(COMPUTE_S)
        req.Wait()

    benchmark.group = f"Irecv {NBYTES >> 20} MiB + {COMPUTE_S * 1e3:g} ms compute + Wait"
    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    assert buf[0] == buf[-1] == 0x5A
    info: dict[str, Any] = {"overlap": overlap, "uses": comm.transports()[1]["uses"],
                            "protocol": comm.transports()[1]["protocol"]}
    if benchmark.stats is not None:  # None under --benchmark-disable
        info["beyond_compute_us"] = (benchmark.stats.stats.median - COMPUTE_S) * 1e6
    benchmark.extra_info.update(info)

"""pytest-benchmark suites for cma: round trips per transport and message size.

Run them with::

    pytest bench/ --benchmark-only
    pytest bench/ --benchmark-only --benchmark-json=roundtrip.json   # every round, as JSON
    pytest bench/ --benchmark-only --benchmark-autosave             # then: pytest-benchmark compare

A plain ``pytest`` does not collect them (pyproject's testpaths is ``tests``). For the
OSU-style tables with baselines use ``cma-bench`` instead.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cma
from cma.bench.endpoints import TAG_CTRL, TAG_DATA, TAG_STATS, Endpoint, mp_pipe_pair
from cma.bench.results import CopySummary, copy_summary
from cma.bench.runners import JOIN_TIMEOUT, serve_echo
from cma.transports import REGISTRY

# Every practical transport (not the ~3 MB/s teaching ptrace), auto's choice, and what
# Python offers without cma.
TRANSPORTS = [*REGISTRY.practical(), "auto", "mp-pipe"]


class EchoPeer:
    """Rank 0 of a Pipe whose rank 1 is ``cma.bench.runners.serve_echo`` in a spawned child.

    pytest-benchmark decides how often it calls the benchmarked function (once when
    disabled, once more for --benchmark-cprofile), so a phase announces an upper bound
    and ``end`` pads the round trips that were not used, untimed.
    """

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.comm: Any
        remote: Any
        if transport == "mp-pipe":
            self.comm, remote = mp_pipe_pair()
            flavor = "pipe"
        else:
            self.comm, remote = cma.Pipe(transport=transport)
            flavor = "cma"
        self.remote = remote
        self.ep = Endpoint(self.comm, flavor)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=serve_echo, args=(remote, flavor), daemon=True)
        self.proc.start()
        self.announced = self.done = 0
        self.send = self.recv = np.zeros(0, dtype=np.uint8)

    def begin(self, size: int, most: int) -> None:
        self.send = np.full(size, 0x5A, dtype=np.uint8)
        self.recv = np.full(size, 0, dtype=np.uint8)
        self.announced, self.done = most, 0
        self.comm.send((size, most), 1, tag=TAG_CTRL)
        if self.ep.has_stats:
            self.comm.reset_stats()

    def round_trip(self) -> None:
        self.comm.Send(self.send, 1, TAG_DATA)
        self.comm.Recv(self.recv, 1, TAG_DATA)
        self.done += 1

    def end(self) -> CopySummary | None:
        """Pad to the announced count; copies per message over the whole phase."""
        if self.done > self.announced:
            raise RuntimeError(f"{self.done} round trips, {self.announced} announced")
        while self.done < self.announced:
            self.round_trip()
        own = self.ep.stats()
        peer = self.comm.recv(source=1, tag=TAG_STATS)
        sides = [s for s in (own, peer) if s is not None]
        return copy_summary(sides, 2 * self.announced, self.send.nbytes)

    def close(self) -> None:
        try:
            self.comm.send(None, 1, tag=TAG_CTRL)
            self.proc.join(JOIN_TIMEOUT)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.comm.close()
            self.remote.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def echo_peer(request: pytest.FixtureRequest) -> Iterator[EchoPeer]:
    peer = EchoPeer(request.param)
    yield peer
    peer.close()

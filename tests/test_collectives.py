"""cma.Comm's collectives against NumPy, in worlds of 1, 2, 3 and 4 ranks.

One world per rank count lives for the whole module (``world`` fixture): each rank is a
forked child serving ``(function, args)`` commands over a multiprocessing pipe, so a
hypothesis example costs a collective, not a world. The test process is no rank: it
draws the cases, waits for every rank with a deadline (a hang fails, kills the world and
never blocks), and computes the expected result with NumPy from the same seeded inputs
the ranks built. Half the cases shrink the algorithm thresholds to zero in the ranks, so
the ring and scatter algorithms run at small sizes as well as the trees.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import stop_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cma
from cma import collectives
from cma.comm import _shared_fds
from cma.errors import InvalidCount, InvalidDatatype, InvalidRank, PeerGone, TruncationError
from cma.world import WorldFds

RESULT_TIMEOUT = 60.0
PAIR = np.dtype([("v", "f8"), ("i", "i4")])
IPAIR = np.dtype([("v", "i4"), ("i", "i4")])
NUMERIC = ["i1", "u2", "i4", "i8", "f4", "f8", "c16"]
DTYPES_FOR = {
    "SUM": NUMERIC, "PROD": NUMERIC,
    "MIN": ["i1", "u2", "i4", "i8", "f4", "f8"], "MAX": ["i1", "u2", "i4", "i8", "f4", "f8"],
    "LAND": ["?", "i1", "i4", "f8"], "LOR": ["?", "i1", "i4", "f8"], "LXOR": ["?", "i1", "i4", "f8"],
    "BAND": ["?", "u1", "i4", "i8"], "BOR": ["?", "u1", "i4", "i8"], "BXOR": ["?", "u1", "i4", "i8"],
    "MINLOC": [PAIR.descr, IPAIR.descr], "MAXLOC": [PAIR.descr, IPAIR.descr],
}
ALL_DTYPES = ["u1", "i2", "i4", "f4", "f8", "c16", PAIR.descr]
REDUCTIONS = ["Reduce", "Allreduce", "Reduce_scatter_block", "Reduce_scatter", "Scan", "Exscan"]
MOVES = ["Bcast", "Gather", "Gatherv", "Scatter", "Scatterv", "Allgather", "Allgatherv",
         "Alltoall", "Alltoallv", "Alltoallw"]
WTYPES = [np.dtype(t) for t in ("u1", "i4", "f8", "c16")]
THRESHOLDS = ("BCAST_SCATTER_FROM", "ALLREDUCE_SCATTER_FROM",
              "XMAP_HOP_FROM", "REDUCE_SCATTER_FROM", "HALVING_UNTIL", "BCAST_PIPELINE_FROM",
              "BCAST_FLAT_FROM")
DEFAULTS = {name: getattr(collectives, name) for name in THRESHOLDS + ("BCAST_PIECE",)}
# small: a binomial Bcast (2 ranks) goes in pieces of this many bytes, which split elements
SMALL_PIECE = 1000
FIXTURE_HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


# ------------------------------------------------------------------ the world

def _serve(comm: cma.Comm, conn: Any) -> None:
    try:
        while True:
            command = conn.recv()
            if command is None:
                break
            func, args = command
            try:
                out = ("ok", func(comm, *args))
            except BaseException as exc:  # noqa: BLE001 - reported to the test process
                out = ("error", "".join(traceback.format_exception(exc)))
            conn.send(out)
    finally:
        comm.close()
        conn.close()


class World:
    """``size`` forked ranks of one fresh cma world, each serving commands. A rank that
    raises or hangs fails the call and ends the world; the next call starts a new one."""

    def __init__(self, size: int, transport: str | list[str] = "auto", xmap: bool = False,
                 config: cma.ChannelConfig | None = None, **options: Any) -> None:
        """``transport``: every rank's, or a list of each rank's; ``options``: the
        transport options every rank passes (push, split...)."""
        self.size = size
        self.transports = [transport] * size if isinstance(transport, str) else transport
        self.xmap = xmap
        self.config = config or cma.ChannelConfig()
        self.options = options
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        fds = WorldFds.create(self.size, self.config)
        comms = [cma.Comm(_shared_fds(fds), rank, self.transports[rank], xmap=self.xmap,
                          **self.options)
                 for rank in range(self.size)]
        fds.close()
        self.procs, self.conns = [], []
        try:
            for comm in comms:
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(comm, theirs), daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        finally:
            for comm in comms:
                comm.close()

    def run(self, func: Callable[..., Any], *args: Any) -> list[Any]:
        """``func(comm, *args)`` on every rank; the results in rank order."""
        if not all(proc.is_alive() for proc in self.procs):
            self.close()
            self._start()
        for conn in self.conns:
            conn.send((func, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + RESULT_TIMEOUT
        while len(results) < self.size:
            waiting = [c for r, c in enumerate(self.conns) if r not in results]
            ready = wait(waiting, max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                pytest.fail(f"ranks {sorted(set(range(self.size)) - set(results))} gave no "
                            f"result within {RESULT_TIMEOUT} s (deadlock)")
            for conn in ready:
                rank = self.conns.index(conn)
                status, value = conn.recv()
                if status != "ok":
                    self.kill()  # (the others may wait for it forever)
                    raise AssertionError(f"rank {rank} raised:\n{value}")
                results[rank] = value
        return [results[rank] for rank in range(self.size)]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    proc.kill()
        for conn, proc in zip(self.conns, self.procs, strict=True):
            stop_process(proc, 10.0)
            conn.close()


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world(request: pytest.FixtureRequest) -> Any:
    with World(request.param) as w:
        yield w


@pytest.fixture(scope="module")
def pair() -> Any:
    """A world of 2 ranks, for what only a pair shows: one peer each, a CPU each."""
    with World(2) as w:
        yield w


@pytest.fixture(scope="module")
def xmap_pair() -> Any:
    """``pair`` with xmap on."""
    with World(2, xmap=True, config=cma.ChannelConfig.for_ranks(2)) as w:
        yield w


@pytest.fixture(scope="module", params=[2, 3, 4])
def xmap_world(request: pytest.FixtureRequest) -> Any:
    """A world whose ranks map each other's shared heap (xmap on), its rings sized as
    cma-run and cma.mpi size them (3 ranks or more: a 256 KiB eager limit)."""
    with World(request.param, xmap=True, config=cma.ChannelConfig.for_ranks(request.param)) as w:
        yield w


# ------------------------------------------------------------------ inputs, both sides

def values(seed: int, rank: int, dtype: np.dtype, n: int, op: str | None) -> np.ndarray:
    """Rank ``rank``'s input of case ``seed``: the same in the rank and in the test."""
    rng = np.random.default_rng([seed, rank])
    if dtype.names:
        out = np.zeros(n, dtype)
        out["v"] = rng.integers(0, 4, n)  # few values: ties, which go to the smaller index
        out["i"] = rng.integers(0, 1000, n)
        return out
    if op in ("LAND", "LOR", "LXOR"):
        return rng.integers(0, 3, n).astype(dtype)  # zeros and non-zeros
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    low, high = (0.5, 1.5) if op == "PROD" else (-1.0, 1.0)
    real = rng.uniform(low, high, n)
    if dtype.kind == "c":
        return (real + 1j * rng.uniform(low, high, n)).astype(dtype)
    return real.astype(dtype)


def layout(seed: int, n: int, size: int) -> tuple[list[int], list[int]]:
    """Counts (0..n each) and displacements: for an even ``seed``, blocks in reverse rank
    order, one element apart; for an odd one, end to end in rank order from element 1 (the
    layout that lets Allgatherv go by recursive doubling)."""
    rng = np.random.default_rng([seed, 1 << 20])
    counts = [int(c) for c in rng.integers(0, n + 1, size)]
    displs, at = [0] * size, 0
    if seed % 2:
        return counts, list(itertools.accumulate(counts[:-1], initial=1))
    for r in reversed(range(size)):
        displs[r] = at
        at += counts[r] + 1
    return counts, displs


def matrix(seed: int, n: int, size: int, in_place: bool = False) -> np.ndarray:
    """Alltoallv: element counts [source, dest] (with IN_PLACE the same both ways: one
    layout serves both directions)."""
    sizes = np.random.default_rng([seed, 1 << 21]).integers(0, n + 1, (size, size))
    return np.minimum(sizes, sizes.T) if in_place else sizes


def vlayout(counts: list[int]) -> tuple[list[int], int]:
    """Alltoallv's receive displacements (blocks in reverse rank order, 2 elements apart)
    and the buffer's length."""
    displs, at = [0] * len(counts), 0
    for r in reversed(range(len(counts))):
        displs[r] = at
        at += counts[r] + 2
    return displs, at + 1


def wlayout(seed: int, n: int, size: int, in_place: bool) -> tuple[np.ndarray, list[list[np.dtype]]]:
    """Alltoallw: element counts [source, dest] and the datatype of each pair (the same
    both ways; with IN_PLACE the counts too, as one layout serves both directions)."""
    sizes = matrix(seed, n, size, in_place)
    return sizes, [[WTYPES[(s + d + seed) % len(WTYPES)] for d in range(size)] for s in range(size)]


def wblocks(counts: Any, dtypes: list[np.dtype], gap: int, backwards: bool
            ) -> tuple[list[int], list[int], int]:
    """Byte sizes and byte displacements of one rank's blocks, ``gap`` bytes apart (in
    reverse rank order if ``backwards``), and the buffer's length."""
    nbytes = [int(c) * t.itemsize for c, t in zip(counts, dtypes, strict=True)]
    displs, at = [0] * len(nbytes), gap
    for r in (reversed(range(len(nbytes))) if backwards else range(len(nbytes))):
        displs[r] = at
        at += nbytes[r] + gap
    return nbytes, displs, at


def wbytes(seed: int, rank: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, rank, 7]).integers(0, 256, nbytes, dtype=np.uint8)


def pack(counts: list[int], displs: list[int], dtype: np.dtype) -> np.ndarray:
    return np.zeros(max([d + c for c, d in zip(counts, displs, strict=True)] + [0]) + 1, dtype)


def wrap(form: str, array: np.ndarray, blocks: int = 1) -> tuple[Any, np.ndarray]:
    """A buffer spec over ``array`` in the form ``form``, and the view that holds the
    result (for the count form, a longer buffer whose tail must stay untouched)."""
    if form == "bare":
        return array, array
    if form == "heap":  # (a copy in the shared heap, which xmap maps)
        shared = cma.empty_like(array)
        shared[...] = array
        return shared, shared
    if form == "dtype":
        return [array, array.dtype], array
    padded = np.zeros(array.size + 3, array.dtype)
    padded[: array.size] = array
    return [padded, array.size // blocks, array.dtype], padded[: array.size]


def vwrap(form: str, array: np.ndarray, counts: list[int], displs: list[int]) -> Any:
    if form == "four":
        return [array, counts, displs, array.dtype]
    return [array, (counts, displs), array.dtype]


# ------------------------------------------------------------------ what a rank runs

def _set_thresholds(small: bool) -> None:
    for name in THRESHOLDS:
        setattr(collectives, name, 0 if small else DEFAULTS[name])
    collectives.BCAST_PIECE = SMALL_PIECE if small else DEFAULTS["BCAST_PIECE"]


def run_case(comm: cma.Comm, case: dict[str, Any]) -> Any:
    _set_thresholds(case["small"])
    if case.get("halving"):  # (5 ranks or more, no power of two: halving at every size)
        collectives.HALVING_UNTIL = 1 << 40
    name, n, root, seed = case["name"], case["count"], case["root"], case["seed"]
    dtype, form, in_place = np.dtype(case["dtype"]), case["form"], case["in_place"]
    op = getattr(cma, case["op"]) if case["op"] else None
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = values(seed, rank, dtype, n, case["op"])
    place = cma.IN_PLACE if seed % 2 else None  # (mpi4py reads None as IN_PLACE there)
    if name == "Bcast":
        buf = mine if rank == root else np.zeros(n, dtype)
        spec, out = wrap(form, buf)
        comm.Bcast(spec, root=root)
        return out
    if name in ("Reduce", "Allreduce", "Scan", "Exscan"):
        result = np.zeros(n, dtype)
        here = name != "Reduce" or rank == root
        if in_place and here:
            result[:] = mine
            spec, out = wrap(form, result)
            send: Any = place
        else:
            spec, out = wrap(form, result)
            send = wrap(form, mine)[0]
        if name == "Reduce":
            comm.Reduce(send, spec, op=op, root=root)
        else:
            getattr(comm, name)(send, spec, op=op)
        return out if here else None
    if name == "Reduce_scatter_block":
        full = values(seed, rank, dtype, n * size, case["op"])
        if in_place:
            spec, out = wrap(form, full.copy(), blocks=size)
            comm.Reduce_scatter_block(place, spec, op=op)
            assert np.array_equal(out[n:], full[n:]), "IN_PLACE changed recvbuf past block 0"
            return out[:n]
        spec, out = wrap(form, np.zeros(n, dtype))
        comm.Reduce_scatter_block(wrap(form, full, blocks=size)[0], spec, op=op)
        return out
    if name == "Reduce_scatter":
        counts, _ = layout(seed, n, size)
        full = values(seed, rank, dtype, sum(counts), case["op"])
        if in_place:
            spec, out = wrap(form, full.copy())
            comm.Reduce_scatter(place, spec, counts, op=op)
            assert np.array_equal(out[counts[rank] :], full[counts[rank] :]), \
                "IN_PLACE changed recvbuf past this rank's block"
            return out[: counts[rank]]
        spec, out = wrap(form, np.zeros(counts[rank], dtype))
        # without recvcounts, each rank's count is its recvbuf's (gathered, as in mpi4py)
        comm.Reduce_scatter(wrap(form, full)[0], spec, counts if seed % 2 else None, op=op)
        return out
    if name == "Gather":
        if rank != root:
            comm.Gather(wrap(form, mine)[0], None, root=root)
            return None
        recv = np.zeros(n * size, dtype)
        if in_place:
            recv[rank * n : (rank + 1) * n] = mine
        spec, out = wrap(form, recv, blocks=size)
        comm.Gather(place if in_place else wrap(form, mine)[0], spec, root=root)
        return out
    if name == "Gatherv":
        counts, displs = layout(seed, n, size)
        send = mine[: counts[rank]]
        if rank != root:
            comm.Gatherv(send, None, root=root)
            return None
        recv = pack(counts, displs, dtype)
        if in_place:
            recv[displs[rank] : displs[rank] + counts[rank]] = send
        comm.Gatherv(place if in_place else send, vwrap(form, recv, counts, displs), root=root)
        return recv
    if name == "Scatter":
        full = values(seed, root, dtype, n * size, None)
        if rank != root:
            spec, out = wrap(form, np.zeros(n, dtype))
            comm.Scatter(None, spec, root=root)
            return out
        send = wrap(form, full, blocks=size)[0]
        if in_place:
            comm.Scatter(send, place, root=root)
            return full[rank * n : (rank + 1) * n]
        spec, out = wrap(form, np.zeros(n, dtype))
        comm.Scatter(send, spec, root=root)
        return out
    if name == "Scatterv":
        counts, displs = layout(seed, n, size)
        recv = np.zeros(counts[rank], dtype)
        if rank != root:
            comm.Scatterv(None, recv, root=root)
            return recv
        full = values(seed, root, dtype, int(pack(counts, displs, dtype).size), None)
        comm.Scatterv(vwrap(form, full, counts, displs), place if in_place else recv, root=root)
        return full[displs[rank] : displs[rank] + counts[rank]] if in_place else recv
    if name == "Allgather":
        recv = np.zeros(n * size, dtype)
        if in_place:
            recv[rank * n : (rank + 1) * n] = mine
        spec, out = wrap(form, recv, blocks=size)
        comm.Allgather(place if in_place else wrap(form, mine)[0], spec)
        return out
    if name == "Allgatherv":
        counts, displs = layout(seed, n, size)
        send = mine[: counts[rank]]
        recv = pack(counts, displs, dtype)
        if in_place:
            recv[displs[rank] : displs[rank] + counts[rank]] = send
        comm.Allgatherv(place if in_place else send, vwrap(form, recv, counts, displs))
        return recv
    if name == "Alltoall":
        full = values(seed, rank, dtype, n * size, None)
        if in_place:
            spec, out = wrap(form, full.copy(), blocks=size)
            comm.Alltoall(place, spec)
            return out
        spec, out = wrap(form, np.zeros(n * size, dtype), blocks=size)
        comm.Alltoall(wrap(form, full, blocks=size)[0], spec)
        return out
    if name == "Alltoallv":
        sizes = matrix(seed, n, size, in_place)
        scounts = [int(c) for c in sizes[rank]]
        rcounts = [int(c) for c in sizes[:, rank]]
        sdispls = [sum(scounts[:d]) for d in range(size)]
        rdispls, length = vlayout(rcounts)
        if in_place:
            recv = values(seed, rank, dtype, length, None)
            comm.Alltoallv(place, vwrap(form, recv, rcounts, rdispls))
            return recv
        full = values(seed, rank, dtype, sum(scounts), None)
        recv = np.zeros(length, dtype)
        comm.Alltoallv(vwrap(form, full, scounts, sdispls), vwrap(form, recv, rcounts, rdispls))
        return recv
    if name == "Alltoallw":
        sizes, types = wlayout(seed, n, size, in_place)
        rtypes = [types[s][rank] for s in range(size)]
        rbytes, rdispls, rlen = wblocks(sizes[:, rank], rtypes, 5, backwards=True)
        rcounts = [int(c) for c in sizes[:, rank]]
        if in_place:
            recv = wbytes(seed, rank, rlen)
            comm.Alltoallw(place, vwrap(form, recv, rcounts, rdispls)[:-1] + [rtypes])
            return recv
        _, sdispls, slen = wblocks(sizes[rank], types[rank], 3, backwards=False)
        recv = np.zeros(rlen, np.uint8)
        comm.Alltoallw(vwrap(form, wbytes(seed, rank, slen), [int(c) for c in sizes[rank]],
                             sdispls)[:-1] + [types[rank]],
                       vwrap(form, recv, rcounts, rdispls)[:-1] + [rtypes])
        return recv
    raise AssertionError(name)


# ------------------------------------------------------------------ what the test expects

def combine(op: str, stack: np.ndarray) -> np.ndarray:
    """The reduction of ``stack`` (ranks along axis 0) by MPI's definition of ``op``."""
    dtype = stack.dtype
    if op in ("MINLOC", "MAXLOC"):
        sign = 1 if op == "MINLOC" else -1
        out = np.zeros(stack.shape[1], dtype)
        for j in range(stack.shape[1]):
            out[j] = min(((v, i) for v, i in zip(stack["v"][:, j], stack["i"][:, j], strict=True)),
                         key=lambda t: (sign * t[0], t[1]))
        return out
    ufunc = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
             "LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor,
             "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    if stack.shape[0] == 1:
        return stack[0]  # one rank's input is the result as it is (MPI applies no op)
    return ufunc.reduce(stack, axis=0).astype(dtype)  # (integers wrap alike in any order)


def expected(case: dict[str, Any], size: int) -> list[Any]:
    name, n, root, seed, op = case["name"], case["count"], case["root"], case["seed"], case["op"]
    dtype = np.dtype(case["dtype"])
    inputs = [values(seed, r, dtype, n, op) for r in range(size)]
    if name == "Bcast":
        return [inputs[root]] * size
    if name in ("Reduce", "Allreduce"):
        total = combine(op, np.stack(inputs))
        return [total if name == "Allreduce" or r == root else None for r in range(size)]
    if name == "Scan":
        return [combine(op, np.stack(inputs[: r + 1])) for r in range(size)]
    if name == "Exscan":
        # rank 0's recvbuf is left as it was: zeros, or its own input when in place
        first = inputs[0] if case["in_place"] else np.zeros(n, dtype)
        return [first] + [combine(op, np.stack(inputs[:r])) for r in range(1, size)]
    if name == "Reduce_scatter_block":
        fulls = [values(seed, r, dtype, n * size, op) for r in range(size)]
        total = combine(op, np.stack(fulls))
        return [total[r * n : (r + 1) * n] for r in range(size)]
    if name == "Reduce_scatter":
        counts, _ = layout(seed, n, size)
        fulls = [values(seed, r, dtype, sum(counts), op) for r in range(size)]
        total = combine(op, np.stack(fulls))
        return [total[sum(counts[:r]) : sum(counts[: r + 1])] for r in range(size)]
    if name == "Gather":
        return [np.concatenate(inputs) if r == root else None for r in range(size)]
    if name in ("Gatherv", "Allgatherv"):
        counts, displs = layout(seed, n, size)
        recv = pack(counts, displs, dtype)
        for r in range(size):
            recv[displs[r] : displs[r] + counts[r]] = inputs[r][: counts[r]]
        return [recv if name == "Allgatherv" or r == root else None for r in range(size)]
    if name == "Scatter":
        full = values(seed, root, dtype, n * size, None)
        return [full[r * n : (r + 1) * n] for r in range(size)]
    if name == "Scatterv":
        counts, displs = layout(seed, n, size)
        full = values(seed, root, dtype, int(pack(counts, displs, dtype).size), None)
        return [full[displs[r] : displs[r] + counts[r]] for r in range(size)]
    if name == "Allgather":
        return [np.concatenate(inputs)] * size
    if name == "Alltoall":
        fulls = [values(seed, r, dtype, n * size, None) for r in range(size)]
        return [np.concatenate([fulls[s][r * n : (r + 1) * n] for s in range(size)])
                for r in range(size)]
    if name == "Alltoallw":
        in_place = case["in_place"]
        sizes, types = wlayout(seed, n, size, in_place)
        sent = []  # (bytes, byte displacements of the blocks for each dest) per source
        for s in range(size):
            if in_place:
                _, displs, length = wblocks(sizes[:, s], [types[r][s] for r in range(size)], 5, True)
            else:
                _, displs, length = wblocks(sizes[s], types[s], 3, False)
            sent.append((wbytes(seed, s, length), displs))
        out = []
        for d in range(size):
            rbytes, rdispls, rlen = wblocks(sizes[:, d], [types[s][d] for s in range(size)], 5, True)
            recv = sent[d][0].copy() if in_place else np.zeros(rlen, np.uint8)
            for s in range(size):
                data, displs = sent[s]
                recv[rdispls[s] : rdispls[s] + rbytes[s]] = data[displs[d] : displs[d] + rbytes[s]]
            out.append(recv)
        return out
    if name == "Alltoallv":
        sizes = matrix(seed, n, size, case["in_place"])
        if case["in_place"]:  # (each rank sends from its receive layout, gaps kept)
            layouts = [vlayout([int(c) for c in sizes[:, r]]) for r in range(size)]
            befores = [values(seed, r, dtype, layouts[r][1], None) for r in range(size)]
            out = []
            for r in range(size):
                recv = befores[r].copy()
                for s in range(size):
                    c, at, there = int(sizes[s, r]), layouts[r][0][s], layouts[s][0][r]
                    recv[at : at + c] = befores[s][there : there + c]
                out.append(recv)
            return out
        fulls = [values(seed, s, dtype, int(sizes[s].sum()), None) for s in range(size)]
        out = []
        for r in range(size):
            rcounts = [int(c) for c in sizes[:, r]]
            rdispls, length = vlayout(rcounts)
            recv = np.zeros(length, dtype)
            for s in range(size):
                start = int(sizes[s, :r].sum())
                recv[rdispls[s] : rdispls[s] + rcounts[s]] = fulls[s][start : start + rcounts[s]]
            out.append(recv)
        return out
    raise AssertionError(name)


def assert_same(got: Any, want: Any, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got!r} vs {want!r}"
    if want.dtype.kind in "fc":
        tolerance = 1e-4 if want.dtype.itemsize * (2 if want.dtype.kind == "f" else 1) <= 8 else 1e-9
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance, err_msg=what)
    else:
        assert np.array_equal(got, want), f"{what}:\n got {got!r}\nwant {want!r}"


@st.composite
def cases(draw: st.DrawFn, size: int, heap: bool = False,
          names: list[str] = REDUCTIONS + MOVES) -> dict[str, Any]:
    name = draw(st.sampled_from(names))
    op = None
    if name in REDUCTIONS:
        op = draw(st.sampled_from(sorted(DTYPES_FOR)))
        dtype = draw(st.sampled_from(DTYPES_FOR[op]))
    else:
        dtype = draw(st.sampled_from(ALL_DTYPES))
    count = draw(st.one_of(st.just(0), st.integers(1, 50), st.integers(1000, 40_000)))
    if name in ("Gatherv", "Scatterv", "Allgatherv", "Alltoallv", "Alltoallw"):
        forms = ["tuple", "four"]
    else:
        forms = ["heap"] if heap else ["bare", "dtype", "count"]
    return {
        "name": name, "op": op, "dtype": dtype, "count": count,
        "root": draw(st.integers(0, size - 1)), "in_place": draw(st.booleans()),
        "form": draw(st.sampled_from(forms)),
        "small": draw(st.booleans()), "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=70, deadline=None, suppress_health_check=FIXTURE_HC)
@given(data=st.data())
def test_buffer_collectives_match_numpy(world: World, data: st.DataObject) -> None:
    case = data.draw(cases(world.size))
    got = world.run(run_case, case)
    want = expected(case, world.size)
    for rank in range(world.size):
        assert_same(got[rank], want[rank], f"rank {rank} of {world.size}, {case}")


def barrier_passes(comm: cma.Comm, owing: bool) -> int:
    """The passes of progress 20 Barriers make, this rank owing its peers nothing (or,
    with ``owing``, pretending to owe them something every time)."""
    progress = comm._progress or comm._attach()
    passes = [0]
    poll = progress.poll

    def counting() -> bool:
        passes[0] += 1
        return poll()

    progress.poll = counting  # type: ignore[method-assign]
    if owing:
        progress.owes = lambda: True  # type: ignore[method-assign]
    try:
        for _ in range(20):
            comm.Barrier()
    finally:
        del progress.poll
        if owing:
            del progress.owes
    return passes[0]


@pytest.mark.parametrize("owing", [False, True])
def test_a_barrier_runs_progress_only_when_its_rank_owes_something(world: World,
                                                                   owing: bool) -> None:
    """A pass of progress before the barrier's messages sends what a rank owes (queued
    packets, xmap's announcements) before its peers leave; but it also drained a peer's
    barrier message that had come already into the unexpected queue, whose slow path
    made a 2-rank Barrier ~3x slower (docs/guide.md section 7, "Barrier"). So the pass
    runs only where something is owed."""
    passes = world.run(barrier_passes, owing)
    assert passes == [20 if owing else 0] * world.size, passes


def into_wider(comm: cma.Comm, name: str, send_dtype: str, recv_dtype: str) -> Any:
    blocks = comm.Get_size() if name.startswith("Reduce_scatter") else 1
    mine = np.full(3 * blocks, 2**31 - 1 if send_dtype == "int32" else 0.1, send_dtype)
    out = np.full(3, -1, recv_dtype)
    getattr(comm, name)(mine, out)
    return out


@pytest.mark.parametrize("name", ["Scan", "Exscan", "Reduce_scatter_block", "Reduce_scatter"])
@pytest.mark.parametrize(("send_dtype", "recv_dtype"), [("int32", "int64"), ("float32", "float64")])
def test_a_reduction_into_a_wider_recvbuf_combines_in_its_dtype(world: World, name: str,
                                                                send_dtype: str,
                                                                recv_dtype: str) -> None:
    """Where every rank has a ``recvbuf`` of another dtype than ``sendbuf``'s, each casts
    its input first and the ranks combine in ``recvbuf``'s dtype (docs/api.md): int32
    maxima sum past 2**31 without wrapping, and an Exscan's last-round receive, straight
    into ``recvbuf``, is of that dtype (a raw copy of int32s into int64s gave garbage and
    half the buffer; the Reduce_scatters wrapped)."""
    got = world.run(into_wider, name, send_dtype, recv_dtype)
    one = np.asarray(np.array(2**31 - 1 if send_dtype == "int32" else 0.1, send_dtype), recv_dtype)
    for rank, out in enumerate(got):
        terms = {"Scan": rank + 1, "Exscan": rank}.get(name, world.size)
        if name == "Exscan" and rank == 0:
            assert (out == -1).all(), out  # (rank 0's recvbuf is left as it was)
            continue
        want = np.full(3, sum([one] * terms, np.zeros((), recv_dtype)), recv_dtype)
        assert out.dtype == np.dtype(recv_dtype) and np.allclose(out, want, rtol=1e-12), \
            f"rank {rank}: {out} != {want}"


@pytest.mark.parametrize("form", ["tuple", "four"])
def test_alltoallv_in_place_sends_from_its_receive_layout(world: World, form: str) -> None:
    """``Alltoallv(IN_PLACE, recvbuf)``: each rank sends the blocks its receive layout
    names (counts the same both ways) and gets its peers' in their place, the gaps
    between blocks kept (the drawn cases above meet it too seldom to rely on)."""
    for seed in range(4):  # (odd seeds pass cma.IN_PLACE, even ones None, as mpi4py reads it)
        case = {"name": "Alltoallv", "op": None, "dtype": np.dtype(np.int32), "count": 9,
                "root": 0, "in_place": True, "form": form, "small": False, "seed": seed}
        got = world.run(run_case, case)
        want = expected(case, world.size)
        for rank in range(world.size):
            assert_same(got[rank], want[rank], f"rank {rank} of {world.size}, {case}")


@pytest.fixture(scope="module", params=[5, 6, 8])
def many_world(request: pytest.FixtureRequest) -> Any:
    """More ranks than the 2-4 above, where reductions go by recursive halving: 5 and 6
    (no power of two: 1 and 2 pairs first) and 8 (three halving steps); xmap on, for the
    cases of heap buffers."""
    with World(request.param, xmap=True, config=cma.ChannelConfig.for_ranks(request.param)) as w:
        yield w


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURE_HC)
@given(data=st.data())
def test_collectives_over_more_ranks_match_numpy(many_world: World, data: st.DataObject) -> None:
    """Allreduce and Reduce by halving (and, at 5 and 6 ranks, by the ring, which larger
    messages take there), Bcast's allgathers, Allgather(v) and Reduce_scatter(_block)
    (halving and doubling at 8 ranks, the chain or the rings at 5 and 6), Scan and Exscan
    (a last round up only, some ranks out of it at 5 and 6), against NumPy,
    thresholds shrunk in half the cases; in half, every buffer in the shared heap (with
    the thresholds shrunk, every hop mapped and combined from views)."""
    case = data.draw(cases(many_world.size, heap=data.draw(st.booleans()),
                           names=["Allreduce", "Reduce", "Bcast", "Allgather", "Allgatherv",
                                  "Reduce_scatter_block", "Reduce_scatter", "Scan", "Exscan"]))
    case["halving"] = data.draw(st.booleans())
    got = many_world.run(run_case, case)
    want = expected(case, many_world.size)
    for rank in range(many_world.size):
        assert_same(got[rank], want[rank], f"rank {rank} of {many_world.size}, {case}")


@contextlib.contextmanager
def recorded_sends(comm: cma.Comm) -> Iterator[list[tuple[int, int]]]:
    """[(dest, bytes) of every message ``comm``'s collectives send meanwhile, in order]."""
    sent: list[tuple[int, int]] = []
    send = comm._coll_send

    def recording(data: Any, dest: int, *rest: Any, **options: Any) -> Any:
        sent.append((dest, data.nbytes))
        return send(data, dest, *rest, **options)

    comm._coll_send = recording  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        del comm._coll_send


def sends_of(comm: cma.Comm, name: str, nbytes: int, root: int = 0,
             heap: bool = False) -> list[tuple[int, int]]:
    """(dest, bytes) of every message this rank sends in one Allreduce or Bcast (from
    ``root``; ``heap``: of a shared-heap array) of ``nbytes``, or one Allgather or
    Reduce_scatter_block of ``nbytes`` a block (the default thresholds), in order."""
    _set_thresholds(False)
    with recorded_sends(comm) as sent:
        if name == "Bcast":
            buf = cma.zeros(nbytes, np.uint8) if heap else np.zeros(nbytes, np.uint8)
            if comm.Get_rank() == root:
                buf[:] = np.arange(nbytes, dtype=np.uint8)
            comm.Bcast(buf, root=root)
            assert np.array_equal(buf, np.arange(nbytes, dtype=np.uint8))
        elif name == "Allgather":
            everyone = np.empty(nbytes * comm.Get_size(), np.uint8)
            comm.Allgather(np.full(nbytes, comm.Get_rank(), np.uint8), everyone)
            assert np.array_equal(everyone, np.repeat(np.arange(comm.Get_size(), dtype=np.uint8), nbytes))
        elif name in ("Scan", "Exscan"):
            mine, result = np.full(nbytes // 8, comm.Get_rank() + 1.0), np.full(nbytes // 8, -1.0)
            getattr(comm, name)(mine, result)
            below = sum(range(1, comm.Get_rank() + 1 + (name == "Scan")))
            assert (result == (below if name == "Scan" or comm.Get_rank() else -1.0)).all()
        elif name == "Reduce_scatter_block":
            block = np.empty(nbytes, np.uint8)
            comm.Reduce_scatter_block(np.full(nbytes * comm.Get_size(), comm.Get_rank(), np.uint8), block)
            assert (block == sum(range(comm.Get_size()))).all()
        else:
            mine, result = np.full(nbytes // 8, comm.Get_rank(), np.float64), np.empty(nbytes // 8)
            comm.Allreduce(mine, result)
            assert (result == sum(range(comm.Get_size()))).all()
    return sent


def test_allreduce_over_more_ranks_takes_log2_steps_each_way(many_world: World) -> None:
    """From 256 KiB over 5-8 ranks an Allreduce goes by halving and doubling: over 2^k
    ranks each rank sends 2 k messages, to the ranks whose rank differs from its own in
    one bit (from the highest bit down, then back up), of n/2, n/4, ... then the same
    back; the ring sent 2 (p - 1) to its right neighbour. Over 2^k + rem ranks the first
    2 rem pair up: the even one sends its whole input to the odd one, which takes part
    and sends it the whole result at the end."""
    size, nbytes = many_world.size, 1 << 20
    pof2 = 1 << (size.bit_length() - 1)
    rem, steps = size - pof2, pof2.bit_length() - 1
    sends = many_world.run(sends_of, "Allreduce", nbytes)
    for rank, sent in enumerate(sends):
        if rank < 2 * rem and rank % 2 == 0:
            assert sent == [(rank + 1, nbytes)], f"rank {rank}"
            continue
        newrank = rank // 2 if rank < 2 * rem else rank - rem
        partners = [newrank ^ (pof2 >> (i + 1)) for i in range(steps)]
        partners += partners[::-1]
        halves = [nbytes >> (i + 1) for i in range(steps)]
        want = [(p * 2 + 1 if p < rem else p + rem, n)
                for p, n in zip(partners, halves + halves[::-1], strict=True)]
        if rank < 2 * rem:
            want.append((rank - 1, nbytes))
        assert sent == want, f"rank {rank}"


def scan_sends(size: int, rank: int, nbytes: int) -> list[tuple[int, int]]:
    """What a rank of a Scan or Exscan over ``size`` ranks sends: its group's partial
    result to the rank differing in one bit, from the lowest bit up (MPICH's recursive
    doubling); in the last round, which no rank's partial result outlives, only upwards."""
    sent, mask = [], 1
    last = 1 << max(0, (size - 1).bit_length() - 1)
    while mask < size:
        peer = rank ^ mask
        if peer < size and (mask < last or peer > rank):
            sent.append((peer, nbytes))
        mask <<= 1
    return sent


@pytest.mark.parametrize("name", ["Scan", "Exscan"])
def test_a_scan_sends_its_last_round_up_only(world: World, many_world: World, name: str) -> None:
    """At 2 ranks, Scan's one round is rank 0's input to rank 1, nothing back (half of
    MPICH's bytes); at 3-8 ranks every round but the last goes both ways."""
    for w in (world, many_world):
        for rank, sent in enumerate(w.run(sends_of, name, 4096)):
            assert sent == scan_sends(w.size, rank, 4096), f"rank {rank} of {w.size}"


@pytest.mark.parametrize("name", ["Allgather", "Reduce_scatter_block"])
def test_allgather_and_reduce_scatter_over_a_power_of_two_take_log2_steps(many_world: World,
                                                                          name: str) -> None:
    """Over 2^k ranks each rank sends to the rank whose rank differs from its own in one
    bit: an Allgather all it holds, from the lowest bit up (1, 2, 4... blocks), a
    Reduce_scatter_block the half it does not keep, from the highest bit down (2^(k-1),
    ... 1 blocks); over other counts the ring sends p - 1 blocks to the right neighbour."""
    size, nbytes = many_world.size, 1000
    sends = many_world.run(sends_of, name, nbytes)
    for rank, sent in enumerate(sends):
        if size & (size - 1) == 0:
            bits = [1 << i for i in range(size.bit_length() - 1)]
            if name == "Reduce_scatter_block":
                bits.reverse()
            want = [(rank ^ bit, nbytes * bit) for bit in bits]
        else:
            want = [((rank + 1) % size, nbytes)] * (size - 1)
        assert sent == want, f"rank {rank}"


def test_a_bcast_of_2_to_8_mib_between_two_ranks_goes_in_pieces(pair: World) -> None:
    """At 2 ranks a Bcast of 2-8 MiB goes as 1 MiB pieces (the reader copies one out
    while the root copies the next in); 1 MiB, 8 MiB + 1 and 16 MiB ones as one message.
    The values arrive in order (sends_of checks every byte)."""
    for nbytes, pieces in [(1 << 20, [1 << 20]), (2 << 20, [1 << 20] * 2),
                           ((5 << 20) + 3, [1 << 20] * 5 + [3]), (8 << 20, [1 << 20] * 8),
                           ((8 << 20) + 1, [(8 << 20) + 1]), (16 << 20, [16 << 20])]:
        for root in (0, 1):
            sends = pair.run(sends_of, "Bcast", nbytes, root)
            assert sends[root] == [(1 - root, n) for n in pieces], (nbytes, root)
            assert sends[1 - root] == [], (nbytes, root)


def flat_sends(size: int, root: int, nbytes: int) -> list[list[tuple[int, int]]]:
    """Every rank's sends in a flat Bcast: the whole message from the root to each other
    rank, relative rank 1 first; nothing from the readers."""
    return [[((root + i) % size, nbytes) for i in range(1, size)] if r == root else []
            for r in range(size)]


def test_a_bcast_from_1_mib_goes_flat(many_world: World) -> None:
    """From 1 MiB, over 3 ranks or more, where the message is a rendezvous, the root offers
    the whole message to every other rank and each takes it from the root (XHC's flat
    shape); at 512 KiB van de Geijn still runs (a reader sends)."""
    size, root = many_world.size, 3
    for nbytes in (1 << 20, (4 << 20) + 1):
        assert many_world.run(sends_of, "Bcast", nbytes, root) == flat_sends(size, root, nbytes)
    sends = many_world.run(sends_of, "Bcast", 512 << 10, root)
    assert any(sends[r] for r in range(size) if r != root)


@pytest.mark.parametrize("heap", [False, True])
def test_a_bcast_goes_flat_at_3_and_4_ranks(xmap_world: World, heap: bool) -> None:
    """The same at 3 and 4 ranks (a 256 KiB eager limit), of NumPy arrays and of heap
    arrays that the readers copy out of their mapping of the root's pages."""
    if xmap_world.size < 3:
        pytest.skip("a pair has a binomial tree only")
    size = xmap_world.size
    for root in (0, size - 1):
        got = xmap_world.run(sends_of, "Bcast", 1 << 20, root, heap)
        assert got == flat_sends(size, root, 1 << 20), root


def test_an_eager_bcast_stays_van_de_geijn(world: World) -> None:
    """With the default 2 MiB eager limit, a 1-2 MiB Bcast is eager: flat, the root would
    copy every reader's message into its ring, so van de Geijn runs (readers send); a
    4 MiB one goes flat."""
    if world.size < 3:
        pytest.skip("a pair has a binomial tree only")
    for nbytes in (1 << 20, 2 << 20):
        sends = world.run(sends_of, "Bcast", nbytes, 0)
        assert sends != flat_sends(world.size, 0, nbytes) and sends[1], nbytes
    assert world.run(sends_of, "Bcast", 4 << 20, 0) == flat_sends(world.size, 0, 4 << 20)


def bcast_copies(comm: cma.Comm, nbytes: int, crowded: bool | None) -> list[tuple[int, int]]:
    """Per Bcast from rank 0, twice, the first the world's first operation (no peer
    connected yet): (bytes this rank copied in all, user and kernel, through transports;
    system calls it made); ``crowded``, if given, set as if ranks did (not) outnumber
    CPUs (False: auto would SPLIT a message, the sender copying half)."""
    comm._coll_start()
    progress = comm._progress
    assert progress is not None
    if crowded is not None:
        progress.connection.policy.crowded = progress.oversubscribed = crowded
    got = []
    for _ in range(2):
        buf = np.full(nbytes, 7 if comm.Get_rank() == 0 else 0, np.uint8)
        comm.reset_stats()
        comm.Bcast(buf, root=0)
        assert (buf == 7).all()
        moved = [s for name, s in comm.stats().items() if name != "eager"]
        got.append((int(sum((s["user_copies"] + s["kernel_copies"]) * s["bytes"] for s in moved)),
                    int(sum(s["syscalls"] for s in moved))))
        comm.Barrier()
    return got


@pytest.mark.parametrize(("transport", "options", "crowded"), [
    ("auto", {}, False),  # auto's choice for one message here: SPLIT
    ("auto", {"overlap": True}, False),  # (the engine's path: no direct rendezvous)
    ("cma", {"push": True}, None),  # RPUT: the root would write every reader's copy
    ("auto", {}, None)])
def test_a_flat_bcast_s_readers_copy_it_themselves(transport: str, options: dict[str, Any],
                                                   crowded: bool | None) -> None:
    """A flat Bcast's root offers the message to all its readers at once, so each reader
    takes its copy itself wherever it can, whatever auto or the options would pick for one
    message, in the world's first operation too: the root copies nothing and makes no
    system call, each reader copies n."""
    nbytes = 8 << 20
    with World(4, transport, config=cma.ChannelConfig.for_ranks(4), **options) as w:
        copies = w.run(bcast_copies, nbytes, crowded)
    assert copies[0] == [(0, 0)] * 2
    assert all(copied == nbytes and calls for per_rank in copies[1:] for copied, calls in per_rank), copies


def test_a_bcast_s_shape_does_not_hang_on_the_ranks_transports() -> None:
    """Ranks may name different transports (rank 0 "shm", the others auto): every rank
    still picks the same shape, and the bytes arrive (sends_of checks them); the readers
    that cannot pull from rank 0 take what it pushes."""
    with World(3, ["shm", "auto", "auto"], config=cma.ChannelConfig.for_ranks(3)) as w:
        for root in (0, 1):
            assert w.run(sends_of, "Bcast", 1 << 20, root) == flat_sends(3, root, 1 << 20)


def test_a_2_rank_ring_step_above_the_eager_limit_goes_in_pieces(pair: World) -> None:
    """At 2 ranks an Allreduce whose blocks are above the eager limit (6 MiB: 3 MiB a
    block) swaps a byte first (whether its block goes whole, mapped: no), then sends its
    block in 512 KiB pieces, in the reduce-scatter and again in the allgather; 4 MiB
    (2 MiB blocks, eager) and 16 MiB + 16 (blocks past RING_PIECES_UNTIL) go as before,
    one block each way."""
    over = (16 << 20) + 16
    for nbytes, want in [(6 << 20, [1] + [512 << 10] * 6 + [1] + [512 << 10] * 6),
                         (16 << 20, ([1] + [512 << 10] * 16) * 2),
                         (4 << 20, [2 << 20, 2 << 20]), (over, [over // 2, over // 2])]:
        sends = pair.run(sends_of, "Allreduce", nbytes)
        assert sends == [[(1 - r, n) for n in want] for r in range(2)], nbytes


def reduce_mixed_buffers(comm: cma.Comm, n: int, heap_rank: int) -> tuple[list[tuple[int, int]], int]:
    """Allreduce, Reduce_scatter_block and Reduce (to rank 1) of ``n`` float64 a rank, the
    input of rank ``heap_rank`` in the shared heap (its peer maps it: xmap), the other's
    not; each result checked; (dest, bytes) of every message this rank sent, and how many
    receives the second Allreduce posted to the engine (none: every piece taken from the
    ring)."""
    _set_thresholds(False)
    rank = comm.Get_rank()
    with recorded_sends(comm) as sent:
        mine = cma.empty(n, np.float64) if rank == heap_rank else np.empty(n)
        mine[:] = np.arange(n) % 11 + rank
        want = 2 * (np.arange(n) % 11) + 1.0
        out = np.zeros(n)
        comm.Allreduce(mine, out)  # (the first also maps the peer's segment: engine work)
        assert (out == want).all()
        assert comm._progress is not None
        with engine_receives(comm._progress) as posted:
            comm.Allreduce(mine, out)
        assert (out == want).all()
        half = np.zeros(n // 2)
        comm.Reduce_scatter_block(mine[: n // 2 * 2], half)
        assert (half == want[rank * (n // 2) : (rank + 1) * (n // 2)]).all()
        out[:] = 0
        comm.Reduce(mine, out if rank == 1 else None, root=1)
        assert rank != 1 or (out == want).all()
    return sent, posted[0]


def test_pieces_one_way_and_a_mapped_block_the_other(xmap_pair: World) -> None:
    """In an Allreduce the rank whose input lies in its heap sends its reduce-scatter block
    whole (its peer combines it from its mapping); the other sends its own in pieces;
    results are right either way round (an odd count: blocks of n/2 and n/2 + 1 elements,
    short last pieces), and for Reduce_scatter_block and Reduce after it (whole blocks).
    The rank that takes a whole block sends all its pieces first, so that block's FIN
    does not come between them: no piece goes through the engine (before, the pieced
    rank's peer posted 1-6 engine receives a call, an extra copy each)."""
    n = (6 << 20) // 8 + 5
    first, second = (n - n // 2) * 8, n // 2 * 8  # (block 0 takes the odd element)
    for heap_rank in (0, 1):
        results = xmap_pair.run(reduce_mixed_buffers, n, heap_rank)
        assert [posted for _, posted in results] == [0, 0]
        mapped, pieced = results[heap_rank][0], results[1 - heap_rank][0]
        block_of = [second, first]  # (rank r sends the block it does not keep: 1 - r's)
        assert mapped[:2] == [(1 - heap_rank, 1), (1 - heap_rank, block_of[heap_rank])]
        rest = block_of[1 - heap_rank] - 6 * (512 << 10)
        assert pieced[:8] == [(heap_rank, 1)] + [(heap_rank, 512 << 10)] * 6 + [(heap_rank, rest)]


def test_a_large_bcast_gathers_its_blocks_by_doubling_or_along_the_chain(many_world: World
                                                                         ) -> None:
    """From 512 KiB (to BCAST_FLAT_FROM) the root sends block i of p to relative rank i;
    then, over 2^k ranks, the ranks swap what they hold with the rank whose relative rank
    differs in one bit (k steps; the root only sends, and nothing goes back to it), and
    over other counts the blocks pass along the chain root -> root + 1 -> ... (p - 1
    steps)."""
    size, nbytes, root = many_world.size, 512 << 10, 3
    cut = [sum(nbytes // size + (i < nbytes % size) for i in range(j)) for j in range(size + 1)]

    def block(i: int) -> int:
        i %= size
        return cut[i + 1] - cut[i]

    def rank(vr: int) -> int:
        return (vr + root) % size

    sends = many_world.run(sends_of, "Bcast", nbytes, root)
    for vr in range(size):
        want = [(rank(i), block(i)) for i in range(1, size)] if vr == 0 else []
        if size & (size - 1) == 0:
            mask = 1
            while mask < size:
                if vr ^ mask != 0:  # (the root's partners send nothing back to it)
                    want.append((rank(vr ^ mask), mask * nbytes // size))
                mask <<= 1
        elif vr < size - 1:
            want += [(rank(vr + 1), block(vr - step)) for step in range(size - 1)]
        assert sends[rank(vr)] == want, f"relative rank {vr}"


def left_queued(comm: cma.Comm) -> None:
    """Raise if this rank still has packets queued after a collective: its peers would
    wait in the collective until its next call into cma (here: never)."""
    queued = comm._progress.txq_pending if comm._progress is not None else 0
    if queued:
        raise AssertionError(f"rank {comm.Get_rank()} returned with {queued} packet(s) queued")


def bcasts_ahead(comm: cma.Comm, times: int, nbytes: int) -> None:
    """``times`` Bcasts of ``nbytes`` from rank 0 to a rank 1 that comes 0.3 s late: the
    root's eager messages fill the ring, and the next ones find it full."""
    data = np.zeros(nbytes, np.uint8)
    if comm.Get_rank() == 1:
        time.sleep(0.3)
    for i in range(times):
        if comm.Get_rank() == 0:
            data[:] = i
        comm.Bcast(data, root=0)
        assert (data == i).all()
        left_queued(comm)


def test_a_root_ahead_of_its_reader_returns_with_nothing_queued() -> None:
    """A Bcast whose message finds the ring full queues it, and returns only once it has
    gone into the ring: returned with it queued, the root left its reader waiting in the
    Bcast until the root's next call into cma. Rings of 64 KiB, messages of 16 KiB."""
    config = cma.ChannelConfig(eager_limit=16 << 10, ring_bytes=64 << 10, frag_size=8 << 10, stage_slots=4)
    with World(2, config=config) as world:
        world.run(bcasts_ahead, 12, 16 << 10)


def reduce_scatter_leaving_nothing_queued(comm: cma.Comm, count: int) -> None:
    """A ring Reduce_scatter_block of ``count`` int32 a block, rank 1 0.3 s late: each
    rank may run as many steps ahead of its right neighbour as its distance from rank 1
    allows, so rank 0 sends rank 1 all its p - 1 blocks before rank 1 reads one."""
    if comm.Get_rank() == 1:
        time.sleep(0.3)
    mine = np.full(count * comm.Get_size(), comm.Get_rank(), np.int32)
    block = np.empty(count, np.int32)
    comm.Reduce_scatter_block(mine, block)
    assert (block == sum(range(comm.Get_size()))).all()
    left_queued(comm)


def test_a_reduce_scatter_over_more_ranks_returns_with_nothing_queued() -> None:
    """The case hypothesis found: at 6 ranks (eager limit 128 KiB, rings of 512 KiB) the
    ring reduce-scatter's blocks of 89 KiB filled a ring, and a rank returned with its
    last block queued: its right neighbour waited in the collective for ever."""
    with World(6, config=cma.ChannelConfig.for_ranks(6)) as world:
        world.run(reduce_scatter_leaving_nothing_queued, 22756)


def isends_queued_then_bcast(comm: cma.Comm, flag: str, count: int, nbytes: int) -> None:
    """Rank 0 Isends ``count`` messages of ``nbytes`` to rank 1, more than its ring holds
    (the rest wait queued), then both Bcast from rank 1, in which rank 0 only receives.
    Rank 1 receives the Isends only once rank 0 has returned from the Bcast (``flag``, a
    file, says so)."""
    buf = np.zeros(16, np.uint8)
    if comm.Get_rank() == 0:
        requests = [comm.Isend(np.full(nbytes, i % 251, np.uint8), dest=1, tag=5) for i in range(count)]
        assert comm._progress is not None and comm._progress.txq_pending, "nothing queued: no test"
        comm.Bcast(buf, root=1)
        Path(flag).touch()
        for request in requests:
            request.Wait()  # (complete once queued: the Barrier below delivers them)
    else:
        buf[:] = 9
        comm.Bcast(buf, root=1)
        deadline = time.monotonic() + 20
        while not os.path.exists(flag):
            if time.monotonic() > deadline:
                raise AssertionError("rank 0 did not return from the Bcast")
            time.sleep(0.01)
        got = np.empty(nbytes, np.uint8)
        for i in range(count):
            comm.Recv(got, source=0, tag=5)
            assert (got == i % 251).all()
    assert (buf == 9).all()
    comm.Barrier()


def test_a_collective_does_not_wait_for_packets_queued_before_it(tmp_path: Path) -> None:
    """A collective waits for its own queued packets only: a user's Isends queued before
    it, which the peer does not need to finish the collective, are delivered later (a
    collective that waited for every packet queued for the peer waited here for ever)."""
    config = cma.ChannelConfig(eager_limit=16 << 10, ring_bytes=64 << 10, frag_size=8 << 10, stage_slots=4)
    with World(2, config=config) as world:
        world.run(isends_queued_then_bcast, str(tmp_path / "returned"), 24, 8 << 10)


def sends_of_empty_collectives(comm: cma.Comm) -> list[tuple[str, int]]:
    """(collective, dest) of every message sent by Bcast, Reduce, Allreduce, Allgather and
    Alltoall of zero elements."""
    sent: list[tuple[str, int]] = []
    send, current = comm._coll_send, [""]

    def recording(data: Any, dest: int, *rest: Any, **options: Any) -> Any:
        sent.append((current[0], dest))
        return send(data, dest, *rest, **options)

    comm._coll_send = recording  # type: ignore[method-assign]
    empty, out = np.zeros(0), np.zeros(0)
    try:
        for name, call in [("Bcast", lambda: comm.Bcast(empty, root=0)),
                           ("Reduce", lambda: comm.Reduce(empty, out, root=0)),
                           ("Allreduce", lambda: comm.Allreduce(empty, out)),
                           ("Allgather", lambda: comm.Allgather(empty, out)),
                           ("Alltoall", lambda: comm.Alltoall(empty, out))]:
            current[0] = name
            call()
    finally:
        del comm._coll_send
    return sent


def test_collectives_of_zero_elements_send_nothing(world: World) -> None:
    """The counts are the same on every rank (MPI's rule), so a collective of nothing has
    nothing to move or wait for, and returns at once, as MPICH's does (mpi4py's osu_bcast
    and osu_allgather demos time size 0 too: 1-3 us in MPICH, 59 and 1734 us in cma.mpi at
    16 ranks before this)."""
    assert world.run(sends_of_empty_collectives) == [[]] * world.size


def allgatherv_own_layouts(comm: cma.Comm) -> None:
    """Allgatherv where rank 0 lays the blocks out in reverse rank order with gaps and the
    others end to end: the layout is each rank's own, the algorithm must not depend on it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = [r + 1 for r in range(size)]
    if rank == 0:
        displs, at = [0] * size, 0
        for r in reversed(range(size)):
            displs[r], at = at, at + counts[r] + 2
    else:
        displs = list(itertools.accumulate(counts[:-1], initial=0))
    recv = np.full(max(d + c for d, c in zip(displs, counts, strict=True)), -1, np.int64)
    comm.Allgatherv(np.full(counts[rank], rank, np.int64), [recv, (counts, displs), np.int64])
    for r in range(size):
        assert (recv[displs[r] : displs[r] + counts[r]] == r).all(), f"rank {rank}: block {r}"


def test_allgatherv_takes_each_ranks_own_layout(many_world: World) -> None:
    many_world.run(allgatherv_own_layouts)


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_HC)
@given(data=st.data())
def test_collectives_of_heap_buffers_match_numpy(xmap_world: World, data: st.DataObject) -> None:
    """The same cases with every buffer in the shared heap and xmap on: with the
    thresholds shrunk, every hop goes as a rendezvous that its reader copies out of its
    mapping of the sender's pages, and the reductions combine from views of them."""
    case = data.draw(cases(xmap_world.size, heap=True))
    got = xmap_world.run(run_case, case)
    want = expected(case, xmap_world.size)
    for rank in range(xmap_world.size):
        assert_same(got[rank], want[rank], f"rank {rank} of {xmap_world.size}, {case}")


def _map_hops(doubling: bool = False) -> None:
    """The default thresholds, but every hop from 16 KiB through xmap, and (``doubling``)
    every Allreduce by recursive doubling (reset by _set_thresholds(False))."""
    _set_thresholds(False)
    collectives.XMAP_HOP_FROM = 16 << 10
    if doubling:
        collectives.ALLREDUCE_SCATTER_FROM = 1 << 40


def heap_traffic(comm: cma.Comm, name: str, nbytes: int, shrink: bool = True
                 ) -> dict[str, dict[str, float]]:
    """The stats of one ``name`` (Bcast, or Allreduce by reduce-scatter + allgather or by
    doubling) of ``nbytes`` of heap arrays, with XMAP_HOP_FROM shrunk so that every hop
    maps (unless not ``shrink``: the default thresholds)."""
    _map_hops(doubling=name == "doubling")
    if not shrink:
        collectives.XMAP_HOP_FROM = DEFAULTS["XMAP_HOP_FROM"]
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        if name == "Bcast":
            buf = cma.zeros(nbytes, np.uint8)
            if rank == 1:
                buf[:] = 7
            comm.reset_stats()
            comm.Barrier()
            comm.Bcast(buf, root=1)
            assert (buf == 7).all()
        else:
            send, recv = cma.empty(nbytes // 8, np.float64), cma.zeros(nbytes // 8, np.float64)
            send[:] = np.arange(send.size) + rank
            comm.reset_stats()
            comm.Barrier()
            comm.Allreduce(send, recv)
            assert np.array_equal(recv, size * np.arange(send.size) + size * (size - 1) // 2)
        comm.Barrier()  # (every FIN of a view is in before the stats are read)
        return comm.stats()
    finally:
        _set_thresholds(False)


def user_bytes(stats: list[dict[str, dict[str, float]]]) -> float:
    return sum(s["user_copies"] * s["bytes"] + s["kernel_copies"] * s["bytes"]
               for per_rank in stats for s in per_rank.values())


def scatter_hops(size: int) -> int:
    """The messages of an Allreduce by reduce-scatter + allgather over ``size`` ranks, all
    ranks together: 2 (p - 1) per rank by the ring (2 and 3 ranks), 2 log2 p by halving
    and doubling (4)."""
    return 2 * size * (size - 1 if size < 4 else (size - 1).bit_length())


@pytest.mark.parametrize("name", ["Bcast", "scatter", "doubling"])
def test_heap_buffers_are_copied_once_and_combined_in_place(xmap_world: World, name: str) -> None:
    """With xmap on, a collective's hop of a heap buffer is read out of the reader's
    mapping of the sender's pages, never through the ring: a Bcast copies each byte once
    per reader ((p - 1) n in all, against 2 (p - 1) n eager), and a reduction combines
    straight from a view of its peer's block, copying nothing for it: the reduce-scatter
    (ring or halving) copies nothing and its allgather (p - 1) n; doubling (2 and 4 ranks)
    nothing at its first step, n a rank at each later one."""
    size = xmap_world.size
    if name == "doubling" and size == 3:
        pytest.skip("doubling over 3 ranks pairs two ranks first: the input is copied")
    nbytes = 256 << 10
    stats = xmap_world.run(heap_traffic, name, nbytes)
    assert all(per_rank["eager"]["bytes"] == 0 for per_rank in stats), "a hop went eager"
    steps = (size - 1).bit_length() if name == "doubling" else 0
    want = {"Bcast": (size - 1) * nbytes, "scatter": (size - 1) * nbytes,
            "doubling": size * (steps - 1) * nbytes}[name]
    assert user_bytes(stats) == want
    hops = {"Bcast": size - 1, "scatter": scatter_hops(size), "doubling": size * steps}[name]
    assert sum(per_rank["xmap"]["messages"] for per_rank in stats) == hops


def test_heap_hops_above_a_lower_eager_limit_are_combined_from_views(xmap_world: World) -> None:
    """From 3 ranks the eager limit is 256 KiB, so the reduce-scatter's blocks of 384 KiB
    to 768 KiB are rendezvous below XMAP_HOP_FROM (2 MiB): they are mapped as well, and
    combined from views ((p - 1) n bytes copied in all: the allgather's), where the
    engine's path read them out of the mapping into a scratch block first (2 (p - 1) n)."""
    size = xmap_world.size
    if size == 2:
        pytest.skip("2 ranks: the eager limit is XMAP_HOP_FROM")
    nbytes = 3 << 19  # 1.5 MiB: blocks of 512 KiB (3 ranks, ring), 768 and 384 KiB (4, halving)
    stats = xmap_world.run(heap_traffic, "scatter", nbytes, False)
    assert user_bytes(stats) == (size - 1) * nbytes
    assert sum(per_rank["xmap"]["messages"] for per_rank in stats) == scatter_hops(size)


def _fail(*arrays: Any) -> None:
    if arrays[0].size:  # (Op.check's trial on empty arrays passes)
        raise ZeroDivisionError("the combine failed")


def views_after_a_failed_combine(comm: cma.Comm) -> tuple[str, int]:
    """Doubling over heap arrays with an op whose combine raises (as a KeyboardInterrupt
    in a long combine would): the view of the peer's input must be released as the error
    leaves the call, not when its traceback is collected (the peer waits for that FIN)."""
    _map_hops(doubling=True)
    failing = cma.Op("FAIL", _fail, _fail, _fail)
    send, recv = cma.empty(8192, np.float64), cma.empty(8192, np.float64)
    send[:] = 1.0
    try:
        try:
            comm.Allreduce(send, recv, op=failing)
        except ZeroDivisionError as exc:
            error = type(exc).__name__
            held = int(comm.stats()["xmap"]["views_held"])  # (the traceback still alive)
        comm.Allreduce(send, recv)  # (and the world still works)
        assert (recv == comm.Get_size()).all()
        return error, held
    finally:
        _set_thresholds(False)


def test_a_view_is_released_when_the_combine_raises(xmap_world: World) -> None:
    if xmap_world.size == 3:
        pytest.skip("doubling over 3 ranks pairs two ranks first: no view at its first step")
    assert xmap_world.run(views_after_a_failed_combine) == [("ZeroDivisionError", 0)] * xmap_world.size


def mismatched_allreduce(comm: cma.Comm) -> str:
    """Rank 0 gives twice the elements rank 1 gives (an erroneous program): rank 1's
    receive of the larger message must raise TruncationError, as the copying paths do,
    not fail to shape a view of it, and rank 0 must not wait for ever."""
    _map_hops(doubling=True)
    n = 8192 if comm.Get_rank() == 0 else 4096
    send, recv = cma.empty(n, np.float64), cma.empty(n, np.float64)
    send[:] = 1.0
    try:
        comm.Allreduce(send, recv)
        return "returned"
    except TruncationError:
        return "TruncationError"
    finally:
        _set_thresholds(False)


def test_a_larger_message_than_a_view_receive_holds_is_a_truncation(xmap_world: World) -> None:
    if xmap_world.size != 2:
        pytest.skip("the erroneous program is written for 2 ranks")
    assert xmap_world.run(mismatched_allreduce) == ["returned", "TruncationError"]


def allreduce_then_overwrite(comm: cma.Comm, rounds: int, nbytes: int) -> int:
    """``rounds`` Allreduces of heap arrays, each rank overwriting its input at once after
    each: a peer still reading it through a view after the call returned would see the
    next round's values, and its result would be wrong."""
    _map_hops()
    rank, size = comm.Get_rank(), comm.Get_size()
    send, recv = cma.empty(nbytes // 8, np.float64), cma.empty(nbytes // 8, np.float64)
    base = np.arange(send.size, dtype=np.float64)
    try:
        for i in range(rounds):
            send[:] = base * (i + 1) + rank
            comm.Allreduce(send, recv)
            send[:] = -1.0
            assert np.array_equal(recv, size * (i + 1) * base + size * (size - 1) // 2), i
        return rounds
    finally:
        _set_thresholds(False)


@pytest.mark.parametrize("nbytes", [32 << 10, 512 << 10])
def test_a_view_of_a_peer_input_is_released_before_the_peer_returns(xmap_world: World,
                                                                    nbytes: int) -> None:
    """Doubling (32 KiB) and the ring (512 KiB) over views of heap inputs, 40 rounds."""
    assert xmap_world.run(allreduce_then_overwrite, 40, nbytes) == [40] * xmap_world.size


# ------------------------------------------------------------------ object forms

def _first(a: Any, b: Any) -> Any:
    """Not commutative: the object reduction must keep rank order."""
    return a if isinstance(a, list) else [a, b]


def run_objects(comm: cma.Comm, name: str, root: int, seed: int, big: bool) -> Any:
    size, rank = comm.Get_size(), comm.Get_rank()
    array = np.full((3 << 20) // 4 if big else 5, rank, np.int32)  # 3 MiB: out of band
    item = {"rank": rank, "seed": seed, "array": array}
    if name == "bcast":
        return comm.bcast(item if rank == root else None, root=root)
    if name == "reduce":
        return comm.reduce(rank + seed, op=cma.SUM, root=root)
    if name == "reduce-ordered":  # list concatenation: the order of ranks must show
        return comm.reduce([rank], op=lambda a, b: a + b, root=root)
    if name == "allreduce":
        return comm.allreduce(array, op=cma.MAX)
    if name == "allreduce-default":
        return comm.allreduce(rank + 1)
    if name == "gather":
        return comm.gather(item, root=root)
    if name == "scatter":
        return comm.scatter([(r, seed) for r in range(size)] if rank == root else None, root=root)
    if name == "allgather":
        return comm.allgather((rank, seed))
    if name == "alltoall":
        return comm.alltoall([(rank, d, seed) for d in range(size)])
    raise AssertionError(name)


OBJECT_CASES = ["bcast", "reduce", "reduce-ordered", "allreduce", "allreduce-default", "gather",
                "scatter", "allgather", "alltoall"]


def expected_objects(name: str, root: int, seed: int, size: int, big: bool) -> list[Any]:
    def item(r: int) -> dict[str, Any]:
        return {"rank": r, "seed": seed, "array": np.full((3 << 20) // 4 if big else 5, r, np.int32)}
    at_root = {
        "bcast": [item(root)] * size,
        "reduce": [sum(range(size)) + size * seed if r == root else None for r in range(size)],
        "reduce-ordered": [list(range(size)) if r == root else None for r in range(size)],
        "allreduce": [np.full((3 << 20) // 4 if big else 5, size - 1, np.int32)] * size,
        "allreduce-default": [size * (size + 1) // 2] * size,
        "gather": [[item(s) for s in range(size)] if r == root else None for r in range(size)],
        "scatter": [(r, seed) for r in range(size)],
        "allgather": [[(s, seed) for s in range(size)]] * size,
        "alltoall": [[(s, r, seed) for s in range(size)] for r in range(size)],
    }
    return at_root[name]


def same_objects(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same_objects(got[k], want[k]) for k in want)
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and np.array_equal(got, want)
    if isinstance(want, list):
        return len(got) == len(want) and all(same_objects(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want)


@settings(max_examples=16, deadline=None, suppress_health_check=FIXTURE_HC)
@given(data=st.data())
def test_object_collectives(world: World, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(OBJECT_CASES))
    root = data.draw(st.integers(0, world.size - 1))
    seed = data.draw(st.integers(0, 1000))
    big = name in ("bcast", "gather", "allreduce") and data.draw(st.booleans())
    got = world.run(run_objects, name, root, seed, big)
    want = expected_objects(name, root, seed, world.size, big)
    for rank in range(world.size):
        assert same_objects(got[rank], want[rank]), f"{name} rank {rank}: {got[rank]!r}"


# ------------------------------------------------------------------ isolation, errors, stats

def interleave_user_messages(comm: cma.Comm) -> Any:
    """User messages sent before a collective (to ANY_TAG receives posted after it) and a
    collective between them: neither may take the other's messages."""
    size, rank = comm.Get_size(), comm.Get_rank()
    comm.Send(np.full(4, 100 + rank, np.int64), dest=(rank + 1) % size, tag=7)
    buf = np.full(4, rank, np.int64)
    comm.Allreduce(cma.IN_PLACE, buf, op=cma.SUM)
    got = np.zeros(4, np.int64)
    status = cma.Status()
    comm.Recv(got, source=cma.ANY_SOURCE, tag=cma.ANY_TAG, status=status)
    pending = comm.Iprobe(cma.ANY_SOURCE, cma.ANY_TAG)
    return int(buf[0]), int(got[0]), status.Get_source(), pending


def test_collectives_do_not_match_user_messages(world: World) -> None:
    results = world.run(interleave_user_messages)
    size = world.size
    for rank, (total, got, source, pending) in enumerate(results):
        assert total == size * (size - 1) // 2
        assert (got, source) == (100 + (rank - 1) % size, (rank - 1) % size)
        assert not pending


def refusals(comm: cma.Comm) -> list[str]:
    """Errors a rank finds before any message moves (so every rank raises, none waits)."""
    raised = []
    for call in (lambda: comm.Bcast(np.zeros(2), root=comm.Get_size()),
                 lambda: comm.Allreduce(np.zeros(2), np.zeros(2), op=cma.BAND),
                 lambda: comm.Allreduce(np.zeros(2), np.zeros(2), op=np.add),
                 lambda: comm.Reduce_scatter(cma.IN_PLACE, np.zeros(2)),
                 lambda: comm.Reduce_scatter(np.zeros(2), np.zeros(2), [2] * (comm.size + 1))):
        try:
            call()
        except (InvalidRank, InvalidDatatype, InvalidCount, TypeError) as exc:
            raised.append(type(exc).__name__)
    return raised


def numpy_roots(comm: cma.Comm) -> list[Any]:
    """A root given as a NumPy integer (mpi4py takes one) is that rank; a float is none."""
    rank, last = comm.Get_rank(), np.int64(comm.Get_size() - 1)
    buf = np.full(3, rank, np.int32)
    comm.Bcast(buf, root=last)
    got = [buf.tolist(), comm.bcast(rank, root=last), comm.gather(rank, root=np.int32(0)),
           comm.reduce(rank, root=last), comm.scatter(list(range(comm.size)) if rank == last else None,
                                                     root=last)]
    try:
        comm.bcast(rank, root=0.0)
    except InvalidRank:
        got.append("InvalidRank")
    return got


def test_a_numpy_integer_root_is_that_rank(world: World) -> None:
    last, size = world.size - 1, world.size
    assert world.run(numpy_roots) == [
        [[last] * 3, last, list(range(size)) if rank == 0 else None,
         size * last // 2 if rank == last else None, rank, "InvalidRank"] for rank in range(size)]


def test_bad_root_dtype_op_and_counts_are_refused_on_every_rank(world: World) -> None:
    results = world.run(refusals)
    assert results == [["InvalidRank", "InvalidDatatype", "TypeError", "InvalidCount",
                        "InvalidCount"]] * world.size


def reused_buffers(comm: cma.Comm) -> list[Any]:
    """The same arrays given to Allreduce, Reduce and Bcast call after call, while their
    contents, the op, IN_PLACE and the root change in between (a communicator keeps what
    it made of the last call's arrays and op for the next)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    send, recv, buf = np.empty(3, np.int64), np.empty(3, np.int64), np.empty(4, np.int32)
    out: list[Any] = []
    for step in range(2 * size):
        root = step % size
        send[:] = rank + step
        comm.Allreduce(send, recv, op=cma.SUM)
        out.append(recv.tolist())
        comm.Allreduce(send, recv, op=cma.MAX)
        out.append(recv.tolist())
        recv[:] = rank * step
        comm.Allreduce(cma.IN_PLACE, recv, op=cma.SUM)
        out.append(recv.tolist())
        recv[:] = -1
        comm.Reduce(send, recv, op=cma.SUM, root=root)  # (the root's role moves each step)
        out.append(recv.tolist() if rank == root else None)
        buf[:] = step if rank == root else -1
        comm.Bcast(buf, root=root)
        out.append(buf.tolist())
    return out


def test_reused_buffers_see_new_contents_ops_and_roots(world: World) -> None:
    results = world.run(reused_buffers)
    size = world.size
    ranks = range(size)
    for rank, got in enumerate(results):
        expected: list[Any] = []
        for step in range(2 * size):
            root = step % size
            total = sum(r + step for r in ranks)
            expected += [[total] * 3, [size - 1 + step] * 3, [sum(r * step for r in ranks)] * 3,
                         [total] * 3 if rank == root else None, [step] * 4]
        assert got == expected


def reused_specs(comm: cma.Comm) -> tuple[list[Any], list[int]]:
    """Allreduce and Reduce given inline spec lists (a new list each call) over a
    bytearray and an array, while the count, the contents, IN_PLACE and the op change:
    the results, and how many specs each call worked out (an equal one: none). The
    bytearray resizes afterwards (no view of it kept alive), and a bytearray shrunk
    below the kept spec is refused as a new spec would be."""
    rank = comm.Get_rank()
    worked_out = [0]
    message = collectives._message

    def counting(*args: Any, **kwargs: Any) -> np.ndarray:
        worked_out[0] += 1
        return message(*args, **kwargs)

    raw, result = bytearray(32), np.zeros(8, np.int32)
    out: list[Any] = []
    counts: list[int] = []
    collectives._message = counting  # type: ignore[assignment]
    try:
        for step, (n, op, in_place) in enumerate(
                [(4, cma.SUM, False), (4, cma.SUM, False), (8, cma.SUM, False),
                 (8, cma.MAX, False), (8, cma.MAX, False), (8, cma.SUM, True),
                 (8, cma.SUM, True)]):
            np.frombuffer(raw, np.int32)[:] = rank + step  # (a temporary view: released)
            result[:] = rank + step if in_place else -1
            before = worked_out[0]
            send = cma.IN_PLACE if in_place else [raw, n, "i4"]
            comm.Allreduce(send, [result, n, "i4"], op=op)
            counts.append(worked_out[0] - before)
            out.append(result.tolist())
    finally:
        collectives._message = message  # type: ignore[assignment]
    raw.extend(b"more")  # (BufferError if a view of it were kept)
    comm.Allreduce([raw, 4, "i4"], [result, 4, "i4"], op=cma.SUM)
    del raw[8:]
    try:
        comm.Allreduce([raw, 4, "i4"], [result, 4, "i4"], op=cma.SUM)
    except collectives.BufferError as exc:
        out.append(str(exc).split(":")[0])
    return out, counts


def kept_buffers_stay_the_owners(comm: cma.Comm) -> list[Any]:
    """What a communicator keeps of the last call's buffer pins nothing and goes stale on
    nothing: a bare array then a spec over it; a flat array reshaped in place; an array
    resized in place (its data moved) then the same spec; a spec over an mmap's array, then
    the array dropped and the mmap closed; a spec over an mmap closed since (refused); a
    large array dropped after a spec over it (freed); a result array made read-only since
    (refused, as a new one would be)."""
    rank = comm.Get_rank()
    out: list[Any] = []
    a = np.zeros(8, np.uint8)
    a[:] = 1 if rank == 0 else 0
    comm.Bcast(a, root=0)
    a[:] = 2 if rank == 0 else 0
    comm.Bcast([a, 8, "B"], root=0)  # (raised ValueError: the list compared with the array)
    out.append(a.tolist())
    flat = np.zeros(8, np.uint8)
    comm.Bcast(flat, root=0)
    flat.shape = (2, 4)  # (the same array, bytes and dtype, no longer flat: read anew)
    flat[:] = 3 if rank == 0 else 0
    comm.Bcast(flat, root=0)
    out.append(flat.ravel().tolist())
    r = np.zeros(2, np.int64)
    comm.Allreduce(np.ones(2, np.int64), r, op=cma.SUM)
    s = np.ones(2, np.int64)
    comm.Allreduce(s, r, op=cma.SUM)
    comm.Allreduce([s, 2, "i8"], [r, 2, "i8"], op=cma.SUM)
    out.append(r.tolist())
    b = np.zeros(16, np.uint8)
    comm.Bcast([b, 8, "B"], root=0)
    b.resize(4096, refcheck=True)  # (ValueError if a view of it were kept)
    b.resize(1 << 20, refcheck=False)  # (its data moves)
    b[:8] = 42 if rank == 0 else 0
    comm.Bcast([b, 8, "B"], root=0)
    out.append(b[:8].tolist())
    m = mmap.mmap(-1, 4096)
    view = np.frombuffer(m, np.uint8)
    comm.Bcast([view, 8, "B"], root=0)
    del view
    m.close()  # (BufferError if a view of it were kept)
    closed = mmap.mmap(-1, 64)
    comm.Bcast([closed, 8, "B"], root=0)
    closed.close()
    try:  # (refused on every rank, as a new spec over a closed mmap is)
        comm.Bcast([closed, 8, "B"], root=0)
        out.append("sent")
    except collectives.BufferError:
        out.append("refused")
    big = np.zeros(32 << 20, np.uint8)
    gone = weakref.ref(big)
    comm.Bcast([big, 8, "B"], root=0)
    del big
    out.append(gone() is None)
    c = np.zeros(2, np.int64)
    comm.Allreduce([s, 2, "i8"], [c, 2, "i8"], op=cma.SUM)
    c.flags.writeable = False  # (on every rank, so that every rank refuses the call)
    try:
        comm.Allreduce([s, 2, "i8"], [c, 2, "i8"], op=cma.SUM)
        out.append("written")
    except collectives.BufferError as exc:
        out.append(str(exc))
    return out


def test_what_a_communicator_keeps_of_a_buffer_pins_nothing(world: World) -> None:
    results = world.run(kept_buffers_stay_the_owners)
    for rank, out in enumerate(results):
        assert out == [[2] * 8, [3] * 8, [world.size] * 2, [42] * 8, "refused", True,
                       "receive buffer is read-only: pass a writable array"], f"rank {rank}"


def test_inline_specs_are_worked_out_once_and_keep_no_view(world: World) -> None:
    results = world.run(reused_specs)
    size, ranks = world.size, range(world.size)
    for out, counts in results:
        sums = [sum(r + step for r in ranks) for step in range(7)]
        highest = [size - 1 + step for step in range(7)]
        assert out[:7] == [
            [sums[0]] * 4 + [-1] * 4, [sums[1]] * 4 + [-1] * 4, [sums[2]] * 8,
            [highest[3]] * 8, [highest[4]] * 8, [sums[5]] * 8, [sums[6]] * 8]
        # new spec (2: input and result), equal, new count, new op (kept: the same
        # arrays), equal, IN_PLACE (1: the result only), equal
        assert counts == [2, 0, 2, 2, 0, 1, 0]
        assert out[7:] == ["1 block(s) of 4 elements do not fit a buffer of 2"]


def mpi4py_names(comm: cma.Comm) -> Any:
    import mpi4py

    mpi4py.rc.initialize = False  # only its constants are needed here, not an MPI world
    from mpi4py import MPI

    buf = np.array([comm.Get_rank(), -comm.Get_rank()], np.int32)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    out = np.zeros(2, np.int32)
    comm.Allreduce(np.array([1, 2], np.int32), out, op=MPI.SUM)
    return buf.tolist(), out.tolist()


def test_mpi4py_in_place_and_ops_are_accepted(world: World) -> None:
    results = world.run(mpi4py_names)
    size = world.size
    assert results == [([size - 1, 0], [size, 2 * size])] * size


def traffic(comm: cma.Comm, nbytes: int) -> tuple[dict[str, dict[str, float]], bool]:
    """The Bcast's stats, and whether the rank's ranks outnumber its CPUs."""
    buf = np.full(nbytes, 7 if comm.Get_rank() == 0 else 0, np.uint8)
    comm.reset_stats()  # (before the barrier: a rank may take the Bcast's packet in it)
    comm.Barrier()
    comm.Bcast(buf, root=0)
    assert (buf == 7).all()
    assert comm._progress is not None
    return comm.stats(), comm._progress.oversubscribed


@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 20, 16 << 20])
def test_stats_count_collective_traffic(world: World, nbytes: int) -> None:
    """Every non-root rank receives the whole message once (a binomial tree; at 1 MiB
    from 3 ranks the root's scatter and the chain or, at 4 ranks, recursive doubling; at
    16 MiB from 3 ranks the flat shape), so the bytes counted across ranks are (size-1) x
    n received, plus as many sent where the sender copies too: eager, and SPLIT above the
    eager limit at 2 ranks unless they outnumber CPUs; otherwise the receiver pulls all of
    it (a flat Bcast's reader always) and only it counts (the barrier's messages carry no
    bytes)."""
    if world.size == 1:
        pytest.skip("one rank moves nothing")
    results = world.run(traffic, nbytes)
    stats = [per_rank for per_rank, _ in results]
    moved = sum(s["bytes"] for per_rank in stats for s in per_rank.values())
    pulled = nbytes > cma.ChannelConfig().eager_limit and (world.size >= 3 or results[0][1])
    assert moved == (1 if pulled else 2) * (world.size - 1) * nbytes
    if nbytes > cma.ChannelConfig().eager_limit:
        # no eager bytes: each block rode a rendezvous through a transport
        assert all(per_rank["eager"]["bytes"] == 0 for per_rank in stats)


@contextlib.contextmanager
def engine_receives(progress: Any) -> Iterator[list[int]]:
    """[how many receives were posted to ``progress``'s engine meanwhile]."""
    posted = [0]
    post = progress.post_recv

    def counting(*args: Any, **kwargs: Any) -> Any:
        posted[0] += 1
        return post(*args, **kwargs)

    progress.post_recv = counting
    try:
        yield posted
    finally:
        del progress.post_recv


def engine_receives_when_late(comm: cma.Comm, name: str, nbytes: int) -> int:
    """How many receives this rank posted to the engine in a Bcast from rank 0 that came
    to it 0.3 s after the others; or, of heap arrays whose hops map (xmap), in a (binomial)
    Reduce to rank 0, which combines from a view, that rank 1 came to late, or in an Allreduce (a
    ring: the allgather's message follows the FIN of the reduce-scatter's) that rank 0
    came to late."""
    heap = name != "Bcast"
    if heap:
        _map_hops()
    else:
        _set_thresholds(False)
    rank = comm.Get_rank()
    mine = (cma.empty if heap else np.empty)(nbytes // 8, np.float64)
    mine[:] = rank + 1
    result = (cma.zeros if heap else np.zeros)(nbytes // 8, np.float64)
    comm.Barrier()
    try:
        with engine_receives(comm._progress) as posted:
            if rank == (1 if name == "Reduce" else 0):
                time.sleep(0.3)  # (the scenario: a rank that comes late)
            if name == "Reduce":
                comm.Reduce(mine, result, root=0)
                assert rank or (result == sum(range(1, comm.Get_size() + 1))).all()
            elif name == "Allreduce":
                comm.Allreduce(mine, result)
                assert (result == sum(range(1, comm.Get_size() + 1))).all()
            else:
                comm.Bcast(mine, root=0)
                assert (mine == 1).all()
    finally:
        _set_thresholds(False)
    comm.Barrier()  # (every view's FIN in before the next test)
    return posted[0]


@pytest.mark.parametrize("nbytes", [8, 64 << 10])
def test_a_late_collective_message_is_taken_without_the_engine(pair: World, nbytes: int) -> None:
    """A collective's receive whose message has not come yet waits for it as Recv does
    (Progress.await_head: spin, then sleep on the doorbell) and takes it on the fast
    path, instead of posting it to the engine once its spin ran out (the engine's
    receive cost ~16 us of Python more, which ranks that outnumber CPUs paid on most
    hops: docs/guide.md section 7, "Many ranks"). 2 ranks: with more, other work that
    comes during the wait (a third rank's packet; once in CI at 3 ranks, a cause not
    found) rightly sends it to the engine."""
    assert pair.run(engine_receives_when_late, "Bcast", nbytes) == [0, 0]


@pytest.mark.parametrize(("name", "nbytes"), [("Reduce", 256 << 10), ("Allreduce", 1 << 20)])
def test_late_hops_of_heap_buffers_are_taken_without_the_engine(xmap_pair: World, name: str,
                                                                nbytes: int) -> None:
    """The same for a reduction's hop of a heap buffer, which the root combines from a
    view; and a rendezvous's FIN (a mapped hop's is sent when its view is released) is
    taken from the ring as the direct rendezvous's Send takes it, not in the engine's
    wait, which took the message behind it too (the allgather's, here) and left its
    receive to the engine. 2 ranks: each rank's one peer is the late one (with more, a
    message of a third rank that comes first still sends a wait to the engine)."""
    assert xmap_pair.run(engine_receives_when_late, name, nbytes) == [0, 0]


def message_behind_a_fin(comm: cma.Comm) -> tuple[int, int]:
    """Rank 0 offers rank 1 a heap array (a rendezvous rank 1 copies out of its mapping,
    with no CTS), rank 1 answers with its FIN and then an eager message of its own; only
    then (0.3 s) does rank 0 wait for its send and take the message. Rank 0's count of
    messages left unexpected after the wait, and of receives it posted to the engine."""
    _map_hops()
    heap = cma.zeros(64 << 10, np.uint8)
    small = np.zeros(8, np.uint8)
    comm.Barrier()
    try:
        if comm.Get_rank() == 0:
            heap[:] = 3
            op = comm._coll_send(heap, 1)
            time.sleep(0.3)  # (the scenario: the FIN and the next message are both in)
            with engine_receives(comm._progress) as posted:
                comm._coll_wait(op)
                unexpected = len(comm._matcher.unexpected)
                comm._coll_take(small, 1)
            assert (small == 4).all()
            return unexpected, posted[0]
        comm._coll_take(heap, 0)
        assert (heap == 3).all()
        comm._coll_wait(comm._coll_send(np.full(8, 4, np.uint8), 0))
        return 0, 0
    finally:
        _set_thresholds(False)
        comm.Barrier()


def test_the_message_behind_a_fin_stays_in_the_ring(xmap_pair: World) -> None:
    """A collective's wait for a rendezvous send takes the FIN from the ring and leaves the
    reader's next message there for the fast path, where the engine's wait took it too,
    as an unexpected message, and its receive went through the engine."""
    assert xmap_pair.run(message_behind_a_fin)[0] == (0, 0)


def split_send_counted(comm: cma.Comm, nbytes: int) -> tuple[int, int]:
    """Rank 0 sends rank 1 a rendezvous message of ``nbytes`` and waits for it only after
    an engine pass has taken the reader's CTS (SPLIT: rank 0 has pushed its half), as a
    root waiting for its first message takes the CTSs of the others; rank 1 copies its
    half 0.2 s late, so its FIN comes while rank 0 waits. What rank 0's stats count for
    the message (messages, bytes)."""
    _set_thresholds(False)
    buf = np.full(nbytes, 5 if comm.Get_rank() == 0 else 0, np.uint8)
    comm.Barrier()  # (attached by now)
    progress = comm._progress
    assert progress is not None
    comm.reset_stats()
    if comm.Get_rank() == 0:
        op = comm._coll_send(buf, 1)
        while op is not None and op.awaits_cts and not op.done:
            progress.poll()
        comm._coll_wait(op)
    else:
        pull = progress._pull

        def late_pull(action: Any) -> None:
            time.sleep(0.2)  # (the scenario: the reader's half comes late)
            pull(action)

        progress._pull = late_pull  # type: ignore[method-assign]
        try:
            comm._coll_wait(comm._coll_recv(buf, 0))
        finally:
            del progress._pull
        assert (buf == 5).all()
    stats = comm.stats()
    comm.Barrier()
    return (sum(int(s["messages"]) for name, s in stats.items() if name != "eager"),
            sum(int(s["bytes"]) for name, s in stats.items() if name != "eager"))


def test_a_send_completed_after_its_cts_is_counted(pair: World) -> None:
    """A send whose reader answered with a CTS (SPLIT: the sender pushes half) completes
    in the engine, which counts it: its FIN is not for the ring's fast path to take (which
    took it too, and the sender's stats lost the message)."""
    nbytes = 16 << 20  # (a pair, a CPU each, splits it)
    sender, _ = pair.run(split_send_counted, nbytes)
    assert sender == (1, nbytes)


BEHIND_BCASTS = 64
BEHIND_BYTES = 256 << 10  # within the eager limit up to 4 ranks, binomial up to 4 ranks


def bcasts_to_late_readers(comm: cma.Comm, nbytes: int, calls: int, objects: bool,
                           queue_limit: int) -> tuple[dict[str, dict[str, float]], int]:
    """The root broadcasts ``calls`` messages of ``nbytes`` back to back (arrays through
    Bcast, or bytes through bcast) while the other ranks start 0.3 s late, so its rings
    fill; every message is checked as it arrives, and nothing may be left queued after a
    call. QUEUED_BYTES_LIMIT is ``queue_limit`` meanwhile (set and restored in each
    rank). The stats, and the most bytes queued at once with a message just admitted."""
    _set_thresholds(False)  # (binomial: a scatter's blocks would be small enough to queue)
    limit = collectives.QUEUED_BYTES_LIMIT
    collectives.QUEUED_BYTES_LIMIT = queue_limit
    try:
        rank = comm.Get_rank()
        buf = np.zeros(nbytes, np.uint8)
        comm.Barrier()
        comm.reset_stats()
        if rank != 0:
            time.sleep(0.3)
        progress = comm._progress
        assert progress is not None
        most = 0
        may_queue = comm._may_queue

        def recording(n: int) -> bool:
            nonlocal most
            queues = may_queue(n)
            if queues:
                most = max(most, progress.txq_bytes + n)
            return queues

        comm._may_queue = recording  # type: ignore[method-assign]
        for i in range(calls):
            if objects:
                got = comm.bcast(bytes([i % 251]) * nbytes if rank == 0 else None, root=0)
                assert got == bytes([i % 251]) * nbytes, i
            else:
                if rank == 0:
                    buf[:] = i % 251
                comm.Bcast(buf, root=0)
                assert (buf == i % 251).all(), i
            left_queued(comm)
        comm.Barrier()
        return comm.stats(), most
    finally:
        collectives.QUEUED_BYTES_LIMIT = limit
        comm.__dict__.pop("_may_queue", None)


def rendezvous_messages(results: list[tuple[dict[str, dict[str, float]], int]]) -> float:
    """Messages the ranks moved other than eager (counted where copied: a reader's pull)."""
    return sum(s["messages"] for stats, _ in results for name, s in stats.items()
               if name != "eager")


def test_a_root_that_runs_ahead_waits_for_its_readers_instead_of_copying(world: World) -> None:
    """Once a reader's ring is full, the root's next Bcast to it waits as a rendezvous
    from the root's buffer: the root copies nothing into packets of its own (before, each
    message was copied into a new heap block and queued, so a root of back-to-back 1 MiB
    Bcasts ran ahead without bound, each copy faulting in fresh pages: 5x slower under
    mpi4py's osu_bcast). Its readers still get every message, in order."""
    if world.size == 1:
        pytest.skip("one rank sends nothing")
    results = world.run(bcasts_to_late_readers, BEHIND_BYTES, BEHIND_BCASTS, False,
                        collectives.QUEUED_BYTES_LIMIT)
    assert results[0][0]["eager"]["user_copies"] == 1.0  # the ring's copy; none into a queue
    assert rendezvous_messages(results) > 0, "the rings never filled: the test did not test"


def queue_rule(comm: cma.Comm, limit: int, n: int) -> tuple[bool, bool]:
    """Whether a message of ``n`` bytes that found the ring full may be queued with
    nothing queued, and with ``limit`` bytes queued (QUEUED_BYTES_LIMIT = ``limit``)."""
    saved, collectives.QUEUED_BYTES_LIMIT = collectives.QUEUED_BYTES_LIMIT, limit
    progress = comm._progress
    assert progress is not None
    queued = progress.txq_bytes
    try:
        progress.txq_bytes = 0
        empty = comm._may_queue(n)
        progress.txq_bytes = limit
        return empty, comm._may_queue(n)
    finally:
        progress.txq_bytes = queued
        collectives.QUEUED_BYTES_LIMIT = saved


@pytest.mark.parametrize("objects", [False, True])
def test_a_root_of_small_messages_queues_at_most_its_limit(world: World, objects: bool) -> None:
    """Below QUEUED_COPY_LIMIT a message that finds the ring full is copied into the queue
    only while less than QUEUED_BYTES_LIMIT waits queued, else it goes as a rendezvous,
    for arrays and for objects' pickles alike (a reviewer had 2000 Isends of 120 KiB to a
    reader 2 s late grow a sender by 234 MiB, and 200 bcasts of a 1 MiB array queue
    193 MiB). Since a call returns only once what it queued has gone out, the limit
    bounds what one call queues; three rings' worth of 8 KiB Bcasts (bcasts) to readers
    0.3 s late queue some and leave nothing queued after any call. Whether two of a
    root's rings are full within one call depends on where earlier traffic left each
    ring's writer, so the rule itself is checked apart (``queue_rule``)."""
    if world.size == 1:
        pytest.skip("one rank sends nothing")
    nbytes = 8 << 10
    calls = 3 * cma.ChannelConfig().ring_bytes // nbytes  # (the World's rings)
    results = world.run(bcasts_to_late_readers, nbytes, calls, objects, nbytes)
    assert results[0][1] > 0, "nothing was queued: the test did not test"
    assert world.run(queue_rule, 64 << 10, nbytes)[0] == (True, False)


# ------------------------------------------------------------------ the same bits everywhere

def allreduce_bits(comm: cma.Comm, n: int, sdt: str, rdt: str) -> list[Any]:
    """Allreduce MIN and MAX of -0.0 (even ranks) and +0.0 (odd ones), whose order decides
    the sign NumPy returns, and SUM from ``sdt`` into ``rdt``: the results' bytes."""
    _set_thresholds(False)
    rank = comm.Get_rank()
    zeros = np.full(n, -0.0 if rank % 2 == 0 else 0.0)
    out: list[Any] = []
    for op in (cma.MIN, cma.MAX):
        result = np.empty(n)
        comm.Allreduce(zeros, result, op=op)
        out.append(result.tobytes())
    mixed = np.empty(n, rdt)
    comm.Allreduce((np.arange(n) % 7 + rank).astype(sdt), mixed, op=cma.SUM)
    out.append(mixed.tolist())
    return out


@pytest.mark.parametrize("nbytes", [8 << 10, 128 << 10, 1 << 20])
def test_allreduce_gives_every_rank_the_same_bits_and_casts_to_the_result(
        world: World, nbytes: int) -> None:
    """Partners in recursive doubling combine in rank order, so every rank gets the same
    bits (MIN and MAX of -0.0 and +0.0 differ by operand order in NumPy); a recvbuf of
    another dtype than sendbuf gets the sum cast to it, by the ring and by halving too
    (which read the input in place only when the two dtypes agree)."""
    n = nbytes // 8
    results = world.run(allreduce_bits, n, "i4", "i8")
    want = sum((np.arange(n) % 7 + r) for r in range(world.size)).tolist()
    for rank, (low, high, mixed) in enumerate(results):
        assert (low, high) == (results[0][0], results[0][1]), f"rank {rank}"
        assert mixed == want, f"rank {rank}"


def reduce_into_wider(comm: cma.Comm, n: int) -> Any:
    """Reduce int32 inputs into an int64 recvbuf at the last rank (the others' recvbuf
    is None): the root's result."""
    _set_thresholds(False)
    rank, root = comm.Get_rank(), comm.Get_size() - 1
    result = np.full(n, -1, np.int64) if rank == root else None
    comm.Reduce((np.arange(n) % 7 + rank).astype(np.int32), result, op=cma.SUM, root=root)
    return None if result is None else result.tolist()


@pytest.mark.parametrize("nbytes", [8 << 10, 1 << 20])
def test_reduce_casts_into_a_root_recvbuf_of_another_dtype(world: World, nbytes: int) -> None:
    """The messages carry sendbuf's type on every rank, the root's too, which casts the
    result into its recvbuf at the end: on the tree (8 KiB) and a reduce-scatter (1 MiB:
    the ring at 2-3 ranks, halving at 4). Before,
    the root combined in recvbuf's type, reading its peers' int32 blocks as int64 (the
    tree) or refusing them as truncated (the ring)."""
    n = nbytes // 4
    results = world.run(reduce_into_wider, n)
    want = sum((np.arange(n) % 7 + r) for r in range(world.size)).tolist()
    assert results[-1] == want
    assert results[:-1] == [None] * (world.size - 1)


# ------------------------------------------------------------------ a rank that dies

def _die_soon() -> None:
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()


RAISED_PEERGONE = 17


def until_someone_dies(comm: cma.Comm, name: str, victim: int, nbytes: int) -> None:
    """Allreduce (or Bcast from rank 0) in a loop; the victim is killed in the middle of
    one. A survivor that raises PeerGone exits as an uncaught exception would end it (and
    as cma-run ends a world), which is what lets the ranks still waiting on it raise in
    turn."""
    buf = np.ones(nbytes // 8)
    if comm.Get_rank() == victim:
        _die_soon()
    try:
        while True:
            if name == "Bcast":
                comm.Bcast(buf, root=0)
            else:
                comm.Allreduce(cma.IN_PLACE, buf, op=cma.MAX)
    except PeerGone:
        os._exit(RAISED_PEERGONE)


@pytest.mark.parametrize(("name", "victim", "nbytes"), [
    ("Allreduce", 1, 64), ("Allreduce", 1, 8 << 20),
    # a flat Bcast: every reader pulls from the root at once
    ("Bcast", 0, 8 << 20), ("Bcast", 1, 8 << 20)])
def test_rank_that_dies_inside_a_collective_makes_the_others_raise(name: str, victim: int,
                                                                    nbytes: int) -> None:
    world = World(3)
    try:
        for conn in world.conns:
            conn.send((until_someone_dies, (name, victim, nbytes)))
        for proc in world.procs:
            proc.join(RESULT_TIMEOUT)
        codes = [proc.exitcode for proc in world.procs]
        assert codes == [-signal.SIGKILL if r == victim else RAISED_PEERGONE for r in range(3)]
    finally:
        world.close()



# ------------------------------------------------------------------ cma-bench

def one_size(tmp_path: Any, kind: str, nbytes: int) -> dict[str, Any]:
    """``cma-bench KIND`` at 2 ranks and one size (5 iterations): its one result, checked
    to be of that size and both ranks."""
    from cma.bench.cli import main

    out = tmp_path / "bench.json"
    code = main([kind, "-n", "2", "--min-size", str(nbytes), "--max-size", str(nbytes),
                 "--iterations", "5", "--warmup", "1", "--json", str(out)])
    assert code == 0
    (series,) = json.loads(out.read_text())["series"]
    (result,) = series["results"]
    assert result["size"] == nbytes and len(result["rank_means_us"]) == 2
    return result


@pytest.mark.parametrize(("kind", "nbytes"), [("allreduce", 8), ("bcast", 4 << 20),
                                              ("bcast", 16 << 20)])
def test_bench_times_collectives_and_counts_their_copies(tmp_path: Any, kind: str,
                                                          nbytes: int) -> None:
    """``cma-bench bcast|allreduce`` at 2 ranks: one result per size, and the copies
    comm.stats() saw: an eager message is copied into the ring and out of it (a third
    time when it arrives before its receive is posted), and so is each piece of a 4 MiB
    Bcast, but for a piece that finds the ring full (behind the skip of a jump back to
    its start), a rendezvous the reader pulls (one kernel copy); beyond the pieces
    (16 MiB) auto uses cma, one kernel copy, where both ranks may read each other."""
    from conftest import TWO_WAY_PTRACE

    result = one_size(tmp_path, kind, nbytes)
    user, kernel = result["user_copied"] / nbytes, result["kernel_copied"] / nbytes
    if nbytes > collectives.BCAST_PIPELINE_UNTIL:
        if TWO_WAY_PTRACE:
            assert (user, kernel) == (0.0, 1.0)
    elif kind == "bcast":  # (of each byte: eager, 2-3 user copies, or pulled, 1 kernel copy)
        assert 2 * (1 - kernel) <= user <= 3 * (1 - kernel) and 0 <= kernel < 1
    else:
        # allreduce at 2 ranks: each rank sends its vector once (recursive doubling)
        assert 2 * 2 <= user <= 3 * 2 and kernel == 0



class _Recording:
    """A communicator stand-in that records the first byte of what each call sends."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sent = rank, []

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's names
        return 2

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Bcast(self, buf: np.ndarray, root: int) -> None:  # noqa: N802
        self.sent.append(int(buf[0]))

    def Allreduce(self, send: np.ndarray, recv: np.ndarray) -> None:  # noqa: N802
        self.sent.append(int(send[0]))


@pytest.mark.parametrize(("kind", "rank", "writes"), [("bcast", 0, True), ("bcast", 1, False),
                                                      ("allreduce", 1, True)])
def test_bench_write_gives_each_call_new_data(kind: str, rank: int, writes: bool) -> None:
    """``cma-bench ... --write``: a Bcast's root, and every rank of an Allreduce, sends new
    values at every call (the OSU pattern, without it, sends the same ones); a Bcast's other
    ranks write nothing (their buffer is the receive buffer)."""
    from cma.bench.collective import operation

    for write in (False, True):
        comm = _Recording(rank)
        run = operation(comm, kind, 64, write=write)
        for _ in range(4):
            run()
        assert (len(set(comm.sent)) == 4) == (write and writes), (write, comm.sent)


@pytest.mark.parametrize(("kind", "nbytes"), [("bcast", 16 << 20), ("allreduce", 4 << 20)])
def test_bench_times_collectives_of_heap_buffers(tmp_path: Any, kind: str, nbytes: int) -> None:
    """``cma-bench bcast|allreduce --heap`` at 2 ranks: xmap on and every array in the
    shared heap, so each byte is copied once in all, in user space: a 16 MiB Bcast's reader
    copies the root's buffer out of its mapping (one of 2-8 MiB goes in eager pieces,
    faster, heap or not: docs/guide.md section 7, "Bcast in pieces"); a 4 MiB Allreduce's
    ring combines the peer's half of the input from a view (no copy) and copies the other
    half of the result out of its mapping (each rank half, 2 x 1/2). Without --heap the
    same sizes move 2 copies per byte (Allreduce: 4) or go through the kernel."""
    from cma.bench.cli import main

    out = tmp_path / "bench.json"
    code = main([kind, "--heap", "-n", "2", "--min-size", str(nbytes), "--max-size", str(nbytes),
                 "--iterations", "3", "--warmup", "1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    (series,) = report["series"]
    (result,) = series["results"]
    assert report["heap"] and series["name"] == "cma auto heap"
    assert (result["user_copied"] / nbytes, result["kernel_copied"] / nbytes) == (1.0, 0.0)


@pytest.mark.parametrize(("kind", "messages"), [("scan", 1), ("exscan", 1), ("reduce_scatter", 2)])
def test_bench_times_the_prefix_reductions_and_reduce_scatter(tmp_path: Any, kind: str,
                                                              messages: int) -> None:
    """``cma-bench scan|exscan|reduce_scatter`` at 2 ranks and 4 KiB (eager: two copies a
    byte, a third for a message that came before its receive): a Scan's or Exscan's one
    round goes from rank 0 to rank 1 only; a Reduce_scatter_block's ranks each send the
    other its block."""
    nbytes = 4096
    result = one_size(tmp_path, kind, nbytes)
    assert 2 * messages <= result["user_copied"] / nbytes <= 3 * messages
    assert result["kernel_copied"] == 0


@pytest.mark.parametrize(("kind", "kernel_copies"), [("bcast", 1.0), ("allreduce", 2.0)])
def test_bench_times_the_object_forms(tmp_path: Any, kind: str, kernel_copies: float) -> None:
    """``cma-bench bcast|allreduce --objects``: a dict holding a 4 MiB array broadcast (its
    array out of band: one kernel copy per byte), the array allreduced as an object (to
    rank 0, summed there, back: two)."""
    from conftest import TWO_WAY_PTRACE

    from cma.bench.cli import main

    out = tmp_path / "bench.json"
    nbytes = 4 << 20
    code = main([kind, "--objects", "-n", "2", "--min-size", str(nbytes), "--max-size",
                 str(nbytes), "--iterations", "3", "--warmup", "1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    (series,) = report["series"]
    (result,) = series["results"]
    assert report["objects"] and result["size"] == nbytes and len(result["rank_means_us"]) == 2
    if TWO_WAY_PTRACE:
        # (the pickles' few hundred bytes travel with the arrays, or eager)
        assert result["kernel_copied"] / nbytes == pytest.approx(kernel_copies, abs=1e-3)
        assert result["user_copied"] / nbytes < 1e-3

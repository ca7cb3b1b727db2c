"""Who runs a ``cma-bench`` series: one size on one rank (guarded or not), the peer
processes, the ``Runner`` of each kind of series, the echo server of ``bench/``, CPU
binding and the MPI world."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .endpoints import TAG_CTRL, TAG_DATA, TAG_STATS, Endpoint
from .guard import GUARD_REDO, QUIET_RATIO, await_quiet, probe_together
from .kernels import Plan, SizePlan, kernel_for, make_buffers, memcpy_size, touched
from .results import SizeResult
from .sizes import messages_per_sample

# A peer that has not exited this long after its last message is stuck: it is killed
# (exit takes well under a second even when loaded; chosen, not measured).
JOIN_TIMEOUT = 10.0


def _run_size(ep: Endpoint, plan: Plan, sp: SizePlan) -> SizeResult | None:
    """One size on one rank; rank 0 gets the result, rank 1 sends it its stats, others idle.

    Under ``plan.guard`` (two ranks only) each timed loop waits for a quiet machine and
    is redone, at most GUARD_REDO times, when the probe after it finds the machine slow;
    the result lists every probe and the mean of every loop left out.
    """
    comm = ep.comm
    kernel = kernel_for(plan.kind, plan.buffer, plan.view)
    active = ep.rank < 2
    result = SizeResult(size=sp.size, iterations=sp.iterations, warmup=sp.warmup,
                        messages_per_sample=messages_per_sample(plan.kind, plan.window),
                        samples_ns=[])
    guarded = plan.guard > 0 and active
    redos = 0
    comm.Barrier()
    if active:
        bufs = make_buffers(sp.size, plan.buffer)
    while True:
        if guarded:
            await_quiet(ep, plan, result)
        if active:
            kernel(ep, bufs, sp.warmup, plan.cold, plan.window)
        # After this barrier no message of the warm-up is left to process, so resetting
        # the counters right away makes them cover exactly the timed loop.
        comm.Barrier()
        if not active:
            return None
        if ep.has_stats:
            comm.reset_stats()
        samples = kernel(ep, bufs, sp.iterations, plan.cold, plan.window)
        own = ep.stats()
        if not guarded:
            break
        ratio, _ = probe_together(ep, plan, None)
        result.probes.append(ratio)
        if ratio <= QUIET_RATIO or redos == GUARD_REDO:
            break
        redos += 1
        result.samples_ns = samples
        if samples:  # rank 0 times, rank 1 only answers
            result.redone_us.append(result.mean_us)
    if ep.rank == 1:
        comm.send(own, 0, tag=TAG_STATS)
        return None
    peer = comm.recv(source=1, tag=TAG_STATS)
    result.samples_ns = samples
    result.stats = [s for s in (own, peer) if s is not None]
    return result


def run_plan(ep: Endpoint, plan: Plan) -> list[SizeResult]:
    """Run every size of ``plan`` on this rank; only rank 0's list is non-empty."""
    results = []
    for sp in plan.sizes:
        result = _run_size(ep, plan, sp)
        if result is not None:
            results.append(result)
    return results


# ---------------------------------------------------------------- peer processes


# CPUs for this process and for the peer child when --bind is on (set by cli.main).
bound_cpus: dict[str, int] = {}


def bind_cpus(rank: int) -> dict[str, int]:
    """Pin this process to one CPU and choose the next for a peer, as OSU runs are bound:
    two spinning processes that share a CPU measure the scheduler, not the transport."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    own = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {own})
    return {"self": own, "peer": cpus[(rank + 1) % len(cpus)]}


def _peer_main(comm: Any, flavor: str, plan: Plan, cpu: int | None = None) -> None:
    # Ctrl-C reaches the whole process group; the parent handles it and ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        run_plan(Endpoint(comm, flavor), plan)
    finally:
        comm.close()


def _close(comm: Any) -> None:
    try:
        comm.close()
    except Exception as exc:  # cleanup must go on; say what failed
        print(f"cma-bench: closing {type(comm).__name__}: {exc}", file=sys.stderr)


class Runner:
    """One series for one session of the schedule: ``open`` with the sizes it will run,
    then ``run_size`` for each in that order, then ``close``."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def open(self, sizes: Sequence[SizePlan]) -> None:
        """Set up for ``sizes`` (the session's, in the order they will run); nothing by default."""

    def run_size(self, sp: SizePlan) -> SizeResult | None:
        """Time one size; None where the series does not run it."""
        raise NotImplementedError

    def close(self, completed: bool) -> None:
        """``completed``: every size ran, so a peer process ends on its own."""


class MemcpyRunner(Runner):
    threads = 1

    def run_size(self, sp: SizePlan) -> SizeResult:
        """Time one size's copy in this process (the memcpy baseline)."""
        return memcpy_size(self.plan, sp, self.threads)


class Memcpy2Runner(MemcpyRunner):
    threads = 2


class EndpointRunner(Runner):
    """A series between two endpoints; ``open`` sets ``ep``, this rank's."""

    ep: Endpoint

    def run_size(self, sp: SizePlan) -> SizeResult | None:
        """Time one size between this rank's endpoint and its peer."""
        return _run_size(self.ep, self.plan, sp)


class PeerRunner(EndpointRunner):
    """Rank 0 here, rank 1 in a spawned child that runs the session's sizes in turn."""

    def __init__(self, plan: Plan, pair: Callable[[], tuple[Any, Any]], flavor: str) -> None:
        super().__init__(plan)
        self.pair = pair
        self.flavor = flavor
        self.ends: tuple[Any, Any] | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None

    def open(self, sizes: Sequence[SizePlan]) -> None:
        """Make the pair and start the peer (rank 1) in a spawned child with the session's sizes."""
        local, remote = self.ends = self.pair()
        self.ep = Endpoint(local, self.flavor)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_peer_main, name="cma-bench-peer", daemon=True,
            args=(remote, self.flavor, replace(self.plan, sizes=tuple(sizes)), bound_cpus.get("peer")))
        self.proc.start()
        if self.flavor == "pipe":
            # The child holds its own copy now; dropping ours turns the child's death
            # into EOF here instead of a receive that waits forever.
            remote.close()

    def close(self, completed: bool) -> None:
        """Close both ends and end the child (killed if it does not exit in time)."""
        if self.ends is None:
            return
        local, remote = self.ends
        _close(local)
        proc = self.proc
        if proc is not None:
            if completed:
                proc.join(JOIN_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
            if completed and proc.exitcode:
                print(f"cma-bench: peer process exited with code {proc.exitcode}",
                      file=sys.stderr)
        _close(remote)


class WorldRunner(EndpointRunner):
    """Ranks 0 and 1 of an MPI world (every rank takes part)."""

    def __init__(self, plan: Plan, comm: Callable[[], Any], flavor: str) -> None:
        super().__init__(plan)
        self.make_comm = comm
        self.flavor = flavor

    def open(self, sizes: Sequence[SizePlan]) -> None:
        """Make this rank's communicator of the MPI world."""
        # (a cma.mpi.Comm over COMM_WORLD is left open: its Free would free COMM_WORLD)
        self.ep = Endpoint(self.make_comm(), self.flavor, self.plan.waitall)


def serve_echo(comm: Any, flavor: str = "cma") -> None:
    """Echo server for round-trip benchmarks (``bench/``), run as rank 1 in a child process.

    Commands come from rank 0 with ``send(obj, tag=TAG_CTRL)``: ``(size, count)`` echoes
    ``count`` messages of ``size`` bytes, then answers with this process's stats over them;
    ``None`` ends the server.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ep = Endpoint(comm, flavor)
    try:
        while (command := comm.recv(source=0, tag=TAG_CTRL)) is not None:
            size, count = command
            buf = touched(size, 0)
            if ep.has_stats:
                comm.reset_stats()
            for _ in range(count):
                comm.Recv(buf, 0, TAG_DATA)
                comm.Send(buf, 0, TAG_DATA)
            comm.send(ep.stats(), 0, tag=TAG_STATS)
    finally:
        comm.close()


# ---------------------------------------------------------------- MPI


# Set by mpiexec/mpirun (MPICH hydra, Open MPI, PMIx); checked first so that a plain run
# never initialises MPI just to learn that it is alone.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def mpi_world() -> Any | None:
    """MPI.COMM_WORLD when started by mpiexec with at least 2 ranks and mpi4py installed."""
    if not any(name in os.environ for name in _LAUNCHER_VARS):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    return world if world.Get_size() >= 2 else None

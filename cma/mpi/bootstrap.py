"""How the ranks of a node find each other: one cma world per node, its fds passed on."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from .. import _linux
from ..channel import ChannelConfig
from ..errors import CmaError
from ..world import World, WorldFds, announce, fetch_fds
from .node import NodeComm

if TYPE_CHECKING:
    from .comm import Comm

ENV_DISABLE = "CMA_MPI_DISABLE"
ENV_NODES = "CMA_MPI_NODES"
ENV_RANKS_PER_NODE = "CMA_MPI_RANKS_PER_NODE"
# what node rank 0's fd server hands the other ranks of the node: the world's memfd and doorbells
WORLD_FDS = "world"


# How Barrier is done, the same on every rank: MPI does not match a blocking collective
# with a nonblocking one, so ranks that must keep cma moving (Ibarrier) need the others
# to use Ibarrier too.
BARRIER_MPI = 0  # no cma anywhere: MPI_Barrier
BARRIER_CMA = 1  # one node: cma's own barrier
BARRIER_NONBLOCKING = 2  # cma on some node and several nodes: MPI_Ibarrier, polled


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _pretend_node(rank: int, size: int) -> int | None:
    """This rank's pretend node from the environment, or None to use the real nodes."""
    text = os.environ.get(ENV_NODES, "").strip()
    if text:
        ids = [part.strip() for part in text.split(",")]
        if len(ids) != size or not all(part.isdigit() for part in ids):
            raise ValueError(f"{ENV_NODES}={text!r} must list a node number (>= 0) for each "
                             f"of the {size} ranks, e.g. {','.join(['0'] * size)}")
        return int(ids[rank])
    text = os.environ.get(ENV_RANKS_PER_NODE, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{ENV_RANKS_PER_NODE}={text!r} must be a positive integer")
        return rank // int(text)
    return None


def _share_world(node: MPI.Comm, members: list[tuple[int, int]]
                 ) -> tuple[WorldFds, World | None] | None:
    """Node rank 0 creates the node's world and passes its fds to the others (collective):
    through its fd server, the one every attached rank runs, which admits the members' pids
    announced in the world's header and nobody else. None where a member failed (it reports
    that; nobody may wait to connect to it), else this rank's fds of the world, and on node
    rank 0 its World, serving already, for its communicator to attach."""
    me = node.Get_rank()
    size = len(members)
    owner = members[0][1]
    fds: WorldFds | None = None
    world: World | None = None
    offer: tuple[str | None, str | None, str | None] = (None, None, None)
    error = None
    try:
        if me == 0:
            try:
                fds = WorldFds.create(size)
                for rank, (_, pid) in enumerate(members):
                    announce(fds, rank, pid)  # who may fetch; attach then sees them exit early
                world = World(fds, 0)
                shared = fds
                world.expose_fds(WORLD_FDS, lambda: [os.dup(fd) for fd in shared.inheritable()])
                world.serve()
                offer = (fds.world_id, fds.config.encode(), None)
            except (OSError, CmaError, ValueError) as exc:
                offer = (None, None, f"node rank 0 could not create the world: {exc}")
            world_id, config, failed = node.bcast(offer, root=0)
        else:
            world_id, config, failed = node.bcast(None, root=0)
        if failed is not None:
            raise CmaError(failed)
        if me != 0:
            try:
                fdlist = fetch_fds(world_id, 0, owner, WORLD_FDS, size + 1)
                fds = WorldFds(world_id, size, fdlist[0], fdlist[1:], ChannelConfig.decode(config))
            except (OSError, CmaError, ValueError) as exc:
                error = f"could not take the node's world from node rank 0: {exc}"
        # every member has its fds, or all learn who failed (and report nothing of their own)
        if any(node.allgather(error)):
            if error is not None:
                raise CmaError(error)
            _release(fds, world)
            return None
    except BaseException:
        _release(fds, world)
        raise
    assert fds is not None
    if world is not None:
        world.withdraw_fd(WORLD_FDS)  # every member has it
    return fds, world


def _release(fds: WorldFds | None, world: World | None) -> None:
    if world is not None:
        world.close()
    if fds is not None:
        fds.close()


def bootstrap(comm: Comm, transport: str, options: dict[str, Any]
               ) -> tuple[NodeComm | None, list[tuple[int, int]], bool, int]:
    """This node's cma Comm or None, node members as (rank, pid), whether the machine's
    ranks outnumber the CPUs they may run on, and how every rank of ``comm`` will do
    Barrier (one of the ``BARRIER_*``).

    Collective over ``comm``; every rank raises if any rank failed, so none is left
    waiting for a peer that gave up.
    """
    rank = comm.Get_rank()
    # (a property of the process: numbered by its rank in COMM_WORLD, whatever comm is wrapped)
    pretend = _pretend_node(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    # (the union of the ranks' CPUs: a launcher that binds each rank to its own core
    # leaves each a mask of one CPU)
    cpus = _linux.usable_cpus(set().union(*shared.allgather(os.sched_getaffinity(0))))
    oversubscribed = shared.Get_size() > cpus
    node = shared if pretend is None else shared.Split(pretend, key=rank)
    cma: NodeComm | None = None
    error = None
    try:
        members: list[tuple[int, int]] = node.allgather((rank, os.getpid()))
        # The node communicator counts its own node's ranks (the same count as the
        # machine's on a real node; on pretend nodes, fewer). Chosen when a mixed rank's
        # interrupt test failed with the machine's count; that failure's cause was the
        # idle rule in progress.py (docs/reliability.md), so this choice rests on no
        # measurement now.
        crowded_node = len(members) > cpus
        if len(members) > 1:
            try:
                handed = _share_world(node, members)
                if handed is not None:
                    fds, world = handed
                    try:
                        cma = NodeComm(comm, fds, node.Get_rank(), transport,
                                       ranks=[r for r, _ in members], world=world,
                                       oversubscribed=crowded_node, **options)
                    except BaseException:
                        _release(fds, world)
                        raise
                    cma.attach()  # now: a rank that never talks on-node must not stall the others
            except (CmaError, OSError, ValueError) as exc:
                error = f"rank {rank}: {exc}"
    finally:
        if node is not shared:
            node.Free()
        shared.Free()
    reports = comm.allgather((error, len(members)))
    errors = [e for e, _ in reports if e]
    if errors:
        if cma is not None:
            cma.close()
        raise CmaError("cma.mpi.Comm could not connect the ranks of a node: " + "; ".join(errors)
                       + f" (set {ENV_DISABLE}=1 to send everything through MPI)")
    sizes = [n for _, n in reports]
    barrier = BARRIER_CMA if min(sizes) == len(sizes) > 1 else \
        BARRIER_NONBLOCKING if max(sizes) > 1 else BARRIER_MPI
    return cma, members, oversubscribed, barrier

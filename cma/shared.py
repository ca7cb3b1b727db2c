"""``cma.shared_array``: one array per node, in the root's shared heap, mapped by every rank.

The root makes the array with ``cma.zeros``, exposes a dup of its heap segment's fd on
its world's fd server (SO_PEERCRED-checked, ``World.expose_fd``) and broadcasts where the
array lies and that fd's number; every other rank takes the fd with ``pidfd_getfd`` where
ptrace rules allow, else fetches it from the fd server, maps the pages covering the array through
the heap (``Heap.imported``, so the mapping is freed with the array) and wraps them in
an ndarray. The call ends with an allgather of the ranks' errors, so it either succeeds
on every rank or raises on every rank, and the root's fd is exposed only during the call.

``cma.mpi`` registers how to find the cma communicator of a node's ranks
(``register_node_comm``), so this module never imports it. docs/guide.md section 5 has
the measurements.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from . import _linux, heap
from .comm import Comm
from .errors import CmaError, InvalidRank
from .world import World

__all__ = ["register_node_comm", "shared_array"]

_calls = itertools.count()  # names each exposure apart, two calls may share a slab
_NODE_FINDERS: list[tuple[type, Callable[[Any], Comm | None]]] = []


def register_node_comm(cls: type, finder: Callable[[Any], Comm | None]) -> None:
    """Let ``shared_array`` take communicators of class ``cls``: ``finder(comm)`` returns
    the cma communicator of this rank's node (its rank 0 the node's lowest rank), or None
    when the rank is alone on its node. It is called collectively."""
    _NODE_FINDERS.append((cls, finder))


def _node_comm(comm: Any) -> Comm | None:
    if isinstance(comm, Comm):
        return comm
    for cls, finder in _NODE_FINDERS:
        if isinstance(comm, cls):
            return finder(comm)
    raise TypeError(f"shared_array takes a cma.Comm or a cma.mpi.Comm, not {type(comm).__name__}"
                    " (wrap an mpi4py communicator with cma.mpi.Comm)")


def _world_of(comm: Comm) -> World:
    """The communicator's World, attaching it first: the one place that knows where a
    Comm keeps it."""
    comm.attach()
    world = comm._world
    assert world is not None  # attached
    return world


def shared_array(comm: Any, shape: int | tuple[int, ...] | list[int], dtype: DTypeLike = float,
                 root: int = 0, writable: bool = False, order: str = "C") -> np.ndarray[Any, Any]:
    """One array per node, in ``root``'s shared heap, mapped by every rank (collective).

    ``comm`` is a ``cma.Comm`` (``root`` is one of its ranks) or a ``cma.mpi.Comm`` (one
    array per node; ``root`` is a rank *within each node*, 0 being the node's lowest
    rank). The root's ``shape``, ``dtype`` and ``order`` are what every rank gets; the
    other ranks' are not used. The array starts as zeros. It is writable on the root,
    and on the other ranks only with ``writable=True`` (else it is mapped read-only: a
    write raises ``ValueError``). Fill it on the root, then ``Barrier`` before others read.

    The root's heap block stays allocated while the root's array lives, and each rank's
    mapping while its own array lives. If any rank fails, every rank raises: a root that
    could not make the array its own error, the others ``CmaError``.
    """
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    node = _node_comm(comm)
    if node is None:  # alone on its node
        return heap.zeros(shape, dtype, order)
    if not (isinstance(root, int) and 0 <= root < node.size):
        raise InvalidRank(f"root {root!r} is not in 0..{node.size - 1}")
    world = _world_of(node)
    if node.rank == root:
        return _share(node, world, shape, dtype, order)
    return _map(node, world, root, writable)


def _share(node: Comm, world: World, shape: int | tuple[int, ...] | list[int], dtype: DTypeLike,
           order: str) -> np.ndarray[Any, Any]:
    try:
        arr = heap.zeros(shape, dtype, order)
        where = heap.locate(arr)
        assert where is not None  # a fresh heap array
        heap.HEAP.exported(where)  # a slab block peers map is never handed out again
        # our own fd, exposed for the call only: the segment's may close with the array
        fd = os.dup(where.segment.fd)
    except (ValueError, TypeError, OSError, CmaError) as exc:
        node.bcast(("error", f"rank {node.rank} (root) could not make the array: {exc}"), node.rank)
        raise
    segment = where.segment
    name = f"shared-{segment.index}-{segment.generation}-{next(_calls)}"
    world.expose_fd(name, lambda: os.dup(fd))
    try:
        node.bcast((name, fd, where.offset, arr.shape, arr.dtype, order), node.rank)
        _all_succeeded(node, None)
    finally:
        world.withdraw_fd(name)
        _linux.close_fd(fd)
    return arr


def _map(node: Comm, world: World, root: int, writable: bool) -> np.ndarray[Any, Any]:
    message = node.bcast(None, root)
    if message[0] == "error":
        raise CmaError(message[1])
    name, root_fd, offset, shape, dtype, order = message
    arr = None
    error = None
    try:
        node.connect(root)  # (peers connect on first use: the bcast need not have named it)
        fd = world.take_fd(root, root_fd, name)
        # whole pages around the array (at least one byte, so a 0-size array maps too)
        first = offset - offset % mmap.ALLOCATIONGRANULARITY
        end = offset + max(math.prod(shape) * dtype.itemsize, 1)
        mm = heap.HEAP.imported(fd, first, end - first, writable)
        arr = np.ndarray(shape, dtype, buffer=mm, offset=offset - first, order=order)
    except (OSError, CmaError) as exc:
        error = f"rank {node.rank}: {exc}"
    _all_succeeded(node, error)
    assert arr is not None  # no error anywhere
    return arr


def _all_succeeded(node: Comm, error: str | None) -> None:
    """Raise on every rank if any rank failed; on success every rank has mapped the array."""
    errors = [e for e in node.allgather(error) if e]
    if errors:
        raise CmaError("shared_array failed: " + "; ".join(errors))

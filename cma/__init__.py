"""cma: move messages between processes on one Linux machine with as few copies as possible.

``cma.Pipe()`` gives two connected communicators; ``cma.COMM_WORLD`` is the world of a
program started by ``cma-run``. The API follows mpi4py's ``Comm``. ``cma.empty`` and
``cma.zeros`` make arrays in the shared heap, which ``multiprocessing`` passes by handle;
``cma.shared_array`` makes one array that every rank of a node maps.
"""

from __future__ import annotations

from typing import Any

from . import errors
from .channel import ChannelConfig
from .collectives import (
    BAND,
    BOR,
    BXOR,
    IN_PLACE,
    LAND,
    LOR,
    LXOR,
    MAX,
    MAXLOC,
    MIN,
    MINLOC,
    PROD,
    SUM,
    Op,
)
from .comm import AUTO, Comm, Pipe, Request, Status
from .heap import alloc, empty, empty_like, is_shared, zeros
from .shared import shared_array
from .transports import REGISTRY
from .transports.xmap import View
from .wire import ANY_SOURCE, ANY_TAG, PROC_NULL, UNDEFINED

__version__ = "0.1.0"

__all__ = [
    "ANY_SOURCE", "ANY_TAG", "AUTO", "BAND", "BOR", "BXOR", "COMM_WORLD", "ChannelConfig",
    "Comm", "IN_PLACE", "LAND", "LOR", "LXOR", "MAX", "MAXLOC", "MIN", "MINLOC", "Op",
    "PROC_NULL", "PROD", "Pipe", "Request", "SUM", "Status", "UNDEFINED", "View", "alloc", "empty",
    "empty_like",
    "errors", "is_shared", "shared_array", "transport_names", "zeros",
]


def transport_names() -> list[str]:
    """The registered transports, in registry order (``auto`` is not a transport)."""
    return list(REGISTRY.classes)


def __getattr__(name: str) -> Any:
    if name == "COMM_WORLD":
        from .comm import world_comm

        return world_comm()
    raise AttributeError(f"module 'cma' has no attribute {name!r}")

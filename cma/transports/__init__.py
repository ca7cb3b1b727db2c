"""Copy mechanisms. ``REGISTRY`` maps a name to its class; see ``base.Transport``."""

from __future__ import annotations

from .base import Copies, Region, Registry, Transport, TransportStats
from .cma import CmaTransport
from .ptrace import PtraceTransport
from .shm import ShmTransport
from .vmfd import VmfdTransport

REGISTRY = Registry()
REGISTRY.add(ShmTransport)
REGISTRY.add(CmaTransport)
REGISTRY.add(VmfdTransport)
REGISTRY.add(PtraceTransport)

__all__ = ["Copies", "REGISTRY", "Region", "Registry", "Transport", "TransportStats"]

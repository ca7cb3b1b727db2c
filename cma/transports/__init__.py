"""Copy mechanisms. ``REGISTRY`` maps a name to its class; see ``base.Transport``."""

from __future__ import annotations

from .base import Copies, Region, Registry, Transport, TransportStats
from .shm import ShmTransport

REGISTRY = Registry()
REGISTRY.add(ShmTransport)

__all__ = ["Copies", "REGISTRY", "Region", "Registry", "Transport", "TransportStats"]

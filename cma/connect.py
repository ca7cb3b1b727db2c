"""Connect time: a communicator's transports, probed against every peer, and the policy
its engine chooses mechanisms by (docs/architecture.md, "Connect time")."""

from __future__ import annotations

import os
from typing import Any

from .errors import CmaError, TransportUnavailable
from .protocol import PIPELINE, PROTOCOL_NAMES, PULL, PUSH, Policy
from .transports import REGISTRY, Transport
from .transports.xmap import XmapTransport
from .world import PeerLink, World

AUTO = "auto"
# Preference for large messages under "auto": fewest copies first.
AUTO_ORDER = ["cma", "vmfd", "shm"]
# Smallest rendezvous message each transport takes under "auto" (bytes). Here shm's
# pipelined double copy beat one-sided cma and vmfd copies at every size, and cma with both
# sides copying (SPLIT) matched it from 4 MiB (docs/transports.md has the runs); where
# one-sided copies win, lower them: thresholds={"cma": 0} also lifts the SPLIT rule.
# From 3 ranks cma takes every rendezvous: the pipeline's staging stays resident per pair
# (docs/architecture.md, "Memory per rank").
NEVER = 1 << 62
AUTO_THRESHOLDS = {"cma": 4 << 20, "vmfd": NEVER, "shm": 0}
AUTO_SPLIT_ONLY = {"cma"}
# xmap (mapping a peer's heap segments, for send buffers in its heap) beside the transport:
# the ``xmap`` option, else CMA_XMAP ("1" on, "0" off)
ENV_XMAP = "CMA_XMAP"
XMAP_DEFAULT = "0"


def check_transport_name(transport: str) -> None:
    if transport != AUTO and transport not in REGISTRY.classes:
        raise TransportUnavailable(
            f"unknown transport {transport!r}; registered: {', '.join(REGISTRY.classes)}, auto"
        )


class Connection:
    """What connect time leaves: the transports set up, a link per peer, why the others
    cannot be used with it, and the policy built from what every rank could use."""

    def __init__(self, world: World, rank: int, transport: str, options: dict[str, Any],
                 thresholds: dict[str, int]) -> None:
        """Set up ``transport`` (or every practical one for ``auto``) with ``options``
        (``push``, ``split`` and ``overlap`` concern all of them) and probe every peer;
        ``thresholds`` are the caller's, over ``AUTO_THRESHOLDS``."""
        self.rank = rank
        self.size = world.size
        names = REGISTRY.practical() if transport == AUTO else [transport]
        # push concerns every transport (prefer RPUT, so every one that can write is set up
        # to: vmfd exchanges read-write fds); other options belong to the one named
        options = dict(options)
        push = bool(options.pop("push", False))
        split = bool(options.pop("split", True))
        # overlap wants pulls even one-sided: a pipeline needs both processes in cma calls
        overlap = bool(options.pop("overlap", False))
        xmap = options.pop("xmap", None)
        if xmap is None:
            xmap = os.environ.get(ENV_XMAP, XMAP_DEFAULT) not in ("", "0")
        self.transports: dict[str, Transport] = {}
        self.reasons: dict[int, dict[str, str]] = {}
        self.links: list[PeerLink | None] = [None] * self.size
        try:
            for name in names:
                cls = REGISTRY.classes[name]
                writes = True if push and "push" in cls.styles else None  # None: the class default
                self.transports[name] = cls(world, writes=writes,
                                            **(options if transport != AUTO else {}))
            if xmap:  # (last: the reach bits of the others stay their index in names)
                self.transports[XmapTransport.name] = XmapTransport(world)
            world.attach(self._probe_peers)
            forced = None if transport == AUTO else transport
            if forced is not None:
                self._check_forced(world, forced, 1 << names.index(forced))
            self.policy = self._policy(world, names, forced, push, split, overlap, thresholds)
        except BaseException:
            self.close()  # a connect that fails half way releases what it set up
            raise

    def _probe_peers(self, world: World) -> dict[int, int]:
        """Connect every transport to every peer: per peer, a bit per transport that works."""
        masks = {}
        for peer in range(self.size):
            if peer == self.rank:
                continue
            link = PeerLink(world, peer)
            self.links[peer] = link
            mask = 0
            for bit, (name, transport) in enumerate(self.transports.items()):
                try:
                    transport.connect(link)
                    mask |= 1 << bit
                except (TransportUnavailable, CmaError, OSError) as exc:
                    self.reasons.setdefault(peer, {})[name] = str(exc)
            masks[peer] = mask
        return masks

    def _check_forced(self, world: World, forced: str, bit: int) -> None:
        """A transport asked for by name must work between every pair, or no rank starts."""
        for r in range(self.size):
            for p in range(self.size):
                if r != p and not world.reach(r, p) & bit:
                    reason = self.reasons.get(p, {}).get(forced) if r == self.rank else None
                    raise TransportUnavailable(
                        f"transport {forced!r} cannot be used from rank {r} to rank {p}"
                        + (f": {reason}" if reason else " (see that rank's error)")
                    )

    def _policy(self, world: World, names: list[str], forced: str | None, push: bool,
                split: bool, overlap: bool, thresholds: dict[str, int]) -> Policy:
        bits = {name: 1 << i for i, name in enumerate(names)}
        policy = Policy(
            order=[n for n in AUTO_ORDER if n in names] or names,
            thresholds={**AUTO_THRESHOLDS, **({"cma": 0} if overlap or self.size > 2 else {}),
                        **thresholds}
            if forced is None else {},
            forced=forced,
            staged={n for n in names if "staged" in REGISTRY.classes[n].styles},
            push=push,
            split=split,
            split_only=(set() if forced is not None or overlap
                        else AUTO_SPLIT_ONLY - set(thresholds)),
        )
        for p in range(self.size):
            if p == self.rank:
                continue
            policy.pullable[p] = {n for n in names if world.reach(self.rank, p) & bits[n]
                                  and "pull" in REGISTRY.classes[n].styles}
            policy.pushable[p] = {n for n in names if world.reach(p, self.rank) & bits[n]
                                  and self.transports[n].writes}
        if XmapTransport.name in self.transports:
            bit = 1 << len(names)
            policy.mappable = {p for p in range(self.size)
                               if p != self.rank and world.reach(self.rank, p) & bit}
        policy.pullable[self.rank] = {"self"}
        policy.order = ["self", *policy.order]
        if forced:
            policy.forced = None
            policy.order = ["self", forced]
        return policy

    def report(self) -> dict[int, dict[str, Any]]:
        """``Comm.transports()``: per peer, the transports usable with it, the one a large
        message would use, and why the others are unavailable."""
        policy = self.policy
        report = {}
        for p in range(self.size):
            if p == self.rank:
                continue
            usable = [n for n in policy.order if n in policy.pullable[p] | policy.pushable[p]
                      or n in policy.staged] + (["xmap"] if p in policy.mappable else [])
            mode, large = policy.choose(p, 1 << 40, PULL | PUSH | PIPELINE)
            report[p] = {"uses": large, "protocol": PROTOCOL_NAMES[mode], "usable": usable,
                         "unavailable": dict(self.reasons.get(p, {}))}
        return report

    def close(self) -> None:
        for transport in self.transports.values():
            for link in self.links:
                if link is not None:
                    transport.disconnect(link)
            transport.close()

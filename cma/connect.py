"""Connect time: a communicator's transports, probed against each peer it talks to, and
the policy its engine chooses mechanisms by (docs/architecture.md, "Connect time")."""

from __future__ import annotations

import os
from typing import Any

from .errors import CmaError, TransportUnavailable
from .protocol import PIPELINE, PROTOCOL_NAMES, PULL, PUSH, Policy
from .transports import REGISTRY, Transport
from .transports.xmap import XmapTransport
from .world import PHASE_PROBED, PeerLink, World

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
    """What connect time leaves: the transports set up, a link per connected peer, why the
    others cannot be used with it, and the policy, which learns what each peer can use
    towards this rank once that peer has connected (``learn``)."""

    def __init__(self, world: World, rank: int, transport: str, options: dict[str, Any],
                 thresholds: dict[str, int]) -> None:
        """Set up ``transport`` (or every practical one for ``auto``) with ``options``
        (``push``, ``split`` and ``overlap`` concern all of them) and attach; a world of two
        ranks connects its pair now, a larger one each pair on first use (``connect``).
        ``thresholds`` are the caller's, over ``AUTO_THRESHOLDS``."""
        self.rank = rank
        self.size = world.size
        self.world = world
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
        self.unprobed: dict[int, list[str]] = {}  # per peer: transports auto left alone
        self.links: list[PeerLink | None] = [None] * self.size
        self.names = names
        self.bits = {name: 1 << i for i, name in enumerate(names)}
        self.forced = None if transport == AUTO else transport
        try:
            for name in names:
                cls = REGISTRY.classes[name]
                writes = True if push and "push" in cls.styles else None  # None: the class default
                self.transports[name] = cls(world, writes=writes,
                                            **(options if transport != AUTO else {}))
            if xmap:  # (last: the reach bits of the others stay their index in names)
                self.transports[XmapTransport.name] = XmapTransport(world)
            self.policy = self._policy(names, self.forced, push, split, overlap, thresholds)
            world.publish()
            if self.size == 2:
                # the pair at once, as before lazy connection: the ping-pong's hot paths then
                # find everything in place, and a refused transport fails on both ranks here
                peer = 1 - rank
                self.connect(peer, check=False)
                world.set_phase(PHASE_PROBED)
                world.await_phase(PHASE_PROBED, [peer])
                if self.forced is not None:
                    self._check_forced(rank, peer, world.reach(rank, peer))
                self.learn(peer)
        except BaseException:
            self.close()  # a connect that fails half way releases what it set up
            raise

    def connect(self, peer: int, check: bool = True) -> None:
        """Connect ``peer`` (see ``World.open_pair``): probe every transport against it and
        publish what works, which tells the peer to connect back; ``check``: fail now if
        a transport asked for by name does not work. Idempotent."""
        if self.links[peer] is not None:
            return
        world = self.world
        world.open_pair(peer)
        link = PeerLink(world, peer)
        self.links[peer] = link
        mask = 0
        for bit, (name, transport) in enumerate(self.transports.items()):
            if self._never_chosen(name, mask):
                self.unprobed.setdefault(peer, []).append(name)
                continue
            try:
                transport.connect(link)
                mask |= 1 << bit
            except (TransportUnavailable, CmaError, OSError) as exc:
                self.reasons.setdefault(peer, {})[name] = str(exc)
        world.publish_reach(peer, mask)
        policy = self.policy
        policy.pullable[peer] = {n for n in self.names if mask & self.bits[n]
                                 and "pull" in REGISTRY.classes[n].styles}
        if mask & 1 << len(self.names):  # (xmap's bit: it comes last, when it is set up)
            policy.mappable.add(peer)
        # (a peer that has closed serves no fds: what it sent is all there is to take)
        if check and self.forced is not None and not world.has_closed(peer):
            self._check_forced(self.rank, peer, mask)
        if world.reach_published(peer, self.rank):
            self.learn(peer, check)

    def _never_chosen(self, name: str, reached: int) -> bool:
        """Under auto, whether ``name`` would never move a byte to or from a peer that the
        transports in ``reached`` (reach bits) reach: auto picks it by no size (threshold
        NEVER: vmfd's), and a pull of a full ring's message takes a transport before it in
        the order (cma). Probing it would cost a fetch through the peer's fd server and an
        fd per peer (5 % of a 64-rank connect: docs/architecture.md, "Connect time")."""
        policy = self.policy
        if self.forced is not None or policy.thresholds.get(name, 0) < NEVER:
            return False
        earlier = policy.order[: policy.order.index(name)] if name in policy.order else []
        return any(reached & self.bits[n] and "pull" in REGISTRY.classes[n].styles
                   for n in earlier if n in self.bits)

    def learn(self, peer: int, check: bool = True) -> None:
        """Take what ``peer`` published it reaches this rank with, once it has connected
        (the receiver's choice needs it for pushes; until then it only pulls or stages)."""
        world = self.world
        if self.links[peer] is None or not world.reach_published(peer, self.rank):
            return
        mask = world.reach(peer, self.rank)
        self.policy.pushable[peer] = {n for n in self.names if mask & self.bits[n]
                                      and self.transports[n].writes}
        if check and self.forced is not None and not world.has_closed(peer):
            self._check_forced(peer, self.rank, mask)

    def learned(self, peer: int) -> bool:
        """Whether the policy knows what ``peer`` reaches this rank with (``learn``)."""
        if peer not in self.policy.pushable:
            self.learn(peer)
        return peer in self.policy.pushable

    def _check_forced(self, r: int, p: int, mask: int) -> None:
        """A transport asked for by name must work in both directions of a pair, or the
        pair's first operation fails (in a world of two: attach, on both ranks)."""
        assert self.forced is not None
        if not mask & self.bits[self.forced]:
            reason = self.reasons.get(p, {}).get(self.forced) if r == self.rank else None
            raise TransportUnavailable(
                f"transport {self.forced!r} cannot be used from rank {r} to rank {p}"
                + (f": {reason}" if reason else " (see that rank's error)")
            )

    def _policy(self, names: list[str], forced: str | None, push: bool,
                split: bool, overlap: bool, thresholds: dict[str, int]) -> Policy:
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
        policy.learn = self.learn
        policy.pullable[self.rank] = {"self"}
        policy.order = ["self", *policy.order]
        if forced:
            policy.forced = None
            policy.order = ["self", forced]
        return policy

    def report(self) -> dict[int, dict[str, Any]]:
        """``Comm.transports()``: per peer, the transports usable with it, the one a large
        message would use, why the others are unavailable, and which auto did not probe
        because it would never use them with that peer (the caller connects them)."""
        policy = self.policy
        report = {}
        for p in range(self.size):
            if p == self.rank:
                continue
            usable = [n for n in policy.order if n in policy.pullable[p] | policy.pushable[p]
                      or n in policy.staged] + (["xmap"] if p in policy.mappable else [])
            mode, large = policy.choose(p, 1 << 40, PULL | PUSH | PIPELINE)
            report[p] = {"uses": large, "protocol": PROTOCOL_NAMES[mode], "usable": usable,
                         "unavailable": dict(self.reasons.get(p, {})),
                         "unprobed": list(self.unprobed.get(p, []))}
        return report

    def close(self) -> None:
        """Disconnect every peer from every transport, then close the transports."""
        for transport in self.transports.values():
            for link in self.links:
                if link is not None:
                    transport.disconnect(link)
            transport.close()

"""The I/O of a mixed rank (peers on its node and on others): waits in both engines and
the wildcard receives' probes and receives.

``cma.mpi.Comm`` builds a ``MixedRank`` only on such a rank and hands it to its node
communicator; ranks whose peers are all on their node, or all elsewhere, have none, so
their paths never reach this module. What a wildcard receive may take is decided by
``mixed.Wildcards`` (sans-IO); here the probes of both channels and the receives it asks
for, and the one wait loop (cma's ``Progress.wait_until``, MPI's pass as its ``outside``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from ..errors import PeerGone
from ..protocol import ANY_SOURCE as CMA_ANY_SOURCE
from ..protocol import SendOp
from .mixed import Found, Wildcards
from .mpiapi import ANY_SOURCE, ANY_TAG, BYTE, fill, mpi_improbe, mpi_improbe_obj, mpi_iprobe
from .requests import SERVED, Request, start_request

if TYPE_CHECKING:
    from .comm import Comm
    from .node import NodeComm

# Mixed ranks wait in both engines: they spin this long, then sleep in short pauses
# (progress.OUTSIDE_PAUSE_*). 100 us is cma.Comm's first spin, kept here when cma.Comm's
# grew to 1 ms; not measured for mixed ranks, whose every turn polls MPI too (docs/mpi.md,
# "Mixed ranks").
SPIN_SECONDS = float(os.environ.get("CMA_SPIN_US", "100")) * 1e-6


class MixedRank:
    """What a rank with peers on its node and elsewhere does beyond dispatch: it keeps
    both engines moving while it waits, and matches the receives waiting behind a
    wildcard (``wildcards``) by probing both channels.

    ``comm`` is the ``cma.mpi.Comm`` (MPI's channel, and its errors), ``node`` its node
    communicator (cma's channel); ``local`` and ``ranks`` are ``comm``'s maps between its
    ranks and cma's.
    """

    __slots__ = ("comm", "node", "local", "ranks", "yield_cpu", "wildcards", "matching")

    def __init__(self, comm: Comm, node: NodeComm, local: dict[int, int], ranks: list[int],
                 yield_cpu: bool) -> None:
        self.comm = comm
        self.node = node
        self.local = local  # rank of the wrapped comm -> cma rank, for this node's ranks
        self.ranks = ranks  # cma rank -> rank of the wrapped comm
        self.yield_cpu = yield_cpu  # more ranks than cores on this machine: yield while spinning
        # receives waiting behind a wildcard receive
        self.wildcards: Wildcards[Request] = Wildcards(local.__contains__)
        self.matching = False  # inside match_wildcards

    # -- receives

    def waits_in_cma(self, source: int, tag: int) -> bool:
        """Whether a receive goes through cma's matching or the deferred wildcards (else
        it is MPI's alone, and MPI's wait keeps cma moving)."""
        return source in self.local or self.wildcards.must_wait(source, tag)

    def irecv_wildcard(self, buf: Any, source: int, tag: int, is_object: bool) -> Request:
        """A receive that must wait behind the wildcards (``Wildcards.must_wait``): its
        request, matched now if a probe finds its message, else by a later pass."""
        req = start_request(self.node, None, is_object, (buf, source, tag))
        self.wildcards.add(req, source, tag)
        self.match_wildcards()
        return req

    def match_wildcards(self, probe_mpi: bool = True) -> None:
        """Match the receives waiting behind a wildcard, in the order they were posted
        (``Wildcards.matches`` decides which takes what; here the probes and receives).
        ``probe_mpi=False``: cma's messages only (from the progress hook, inside MPI).
        """
        if self.matching:
            return  # (MPI's probe below runs the hook, which would match the same receives)
        self.matching = True
        try:
            for req, on_cma, source, tag in self.wildcards.matches(self.probe, probe_mpi):
                self.take(req, on_cma, source, tag)
        finally:
            self.matching = False

    def probe(self, on_cma: bool, source: int, tag: int) -> Found:
        """(source, tag) of the first message for (source, tag) on one channel, or None."""
        comm = self.comm
        if on_cma:
            peer = self.local.get(source)
            if not comm._iprobe_cma(CMA_ANY_SOURCE if peer is None else peer, tag, None):
                return None
            return self.ranks[comm._cstatus.source], comm._cstatus.tag
        st = MPI.Status()
        if not mpi_iprobe(comm, source, tag, st):
            return None
        return st.Get_source(), st.Get_tag()

    def take(self, req: Request, on_cma: bool, source: int, tag: int) -> None:
        """Receive for ``req`` the message a probe found (from ``source`` with ``tag``)."""
        if on_cma:
            self.node.bind(req, self.local[source], tag)
            return
        assert req._spec is not None
        buf = req._spec[0]
        message = (mpi_improbe_obj if req._object else mpi_improbe)(self.comm, source, tag)
        assert message is not None  # probed just now, and only this thread receives
        req._spec = None
        # (MPI's receive, blocking: the message is here or on its way, and the hook keeps
        # cma moving meanwhile)
        st = MPI.Status()
        value = None
        if req._object:
            value = message.recv(st)
        else:
            message.Recv(buf, st)
        req._finish_elsewhere((st.Get_source(), st.Get_tag(), st.Get_elements(BYTE)), value)

    def withdraw(self, req: Request) -> bool:
        """Cancel a wildcard receive still waiting to be matched; whether it was waiting."""
        return self.wildcards.remove(req)

    def iprobe(self, source: int, tag: int, status: MPI.Status | None) -> bool:
        """``Iprobe`` on both channels: cma's for a rank on this node, MPI's for the
        others, both for ``ANY_SOURCE`` (cma's first); a message that a receive waiting
        behind a wildcard will take is not reported."""
        if self.wildcards:
            self.match_wildcards()
        comm = self.comm
        peer = self.local.get(source)
        st = MPI.Status()
        if peer is not None:
            found = comm._iprobe_cma(peer, tag, st)
        elif source == ANY_SOURCE:
            found = comm._iprobe_cma(CMA_ANY_SOURCE, tag, st) or mpi_iprobe(comm, source, tag, st)
        else:
            found = mpi_iprobe(comm, source, tag, st)
        if not found or self.wildcards.owner(st.Get_source(), st.Get_tag()) is not None:
            return False  # a receive posted earlier takes that message
        if status is not None:
            fill(status, st.Get_source(), st.Get_tag(), st.Get_elements(BYTE))
        return True

    # -- waits in both engines

    def settle(self, req: Request, posted_only: bool = False) -> None:
        """Drive both engines until ``req`` is over (``posted_only``: until it is posted)."""
        op = req._op
        peer = None if op is None else op.dest if isinstance(op, SendOp) else op.source
        if posted_only:
            self.progress_until(lambda: req._op is not None or req._over, None)
        else:
            self.progress_until(lambda: req._over or req._done_in_cma(),
                                peer if peer is not None and peer >= 0 else None)

    def step(self) -> None:
        """Move both engines once."""
        self.node.progress()
        self.step_mpi()

    def step_mpi(self) -> None:
        """Move MPI once, and the wildcard receives waiting on both engines; raise what
        MPI's progress hook caught while running cma.

        Passed to ``Progress.wait_until`` as itself, not wrapped: a Ctrl-C landing in
        this frame (in MPI's probe) then counts as landing in the idle wait, which it is
        for cma; one landing deeper (matching wildcards) breaks the communicator.
        """
        mpi_iprobe(self.comm, ANY_SOURCE, ANY_TAG)  # MPI progresses inside its calls
        if self.wildcards:
            self.match_wildcards()
        SERVED.raise_pending()

    def progress_until(self, done: Callable[[], bool], peer: int | None) -> None:
        """Drive cma and MPI until ``done()``: cma's one wait loop (``Progress.wait_until``)
        with MPI's pass as its ``outside`` engine.

        ``peer`` is the cma rank whose exit makes waiting pointless (None: none is, since
        an off-node rank may still answer).
        """
        node = self.node
        try:
            (node._progress or node._attach()).wait_until(done, peer, SPIN_SECONDS, self.yield_cpu,
                                                          outside=self.step_mpi)
        except PeerGone as exc:
            if isinstance(exc, MPI.Exception):
                raise  # (converted already)
            self.comm._fail(exc)

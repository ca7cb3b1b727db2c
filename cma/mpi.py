"""mpi4py plugin: an mpi4py ``Intracomm`` whose on-node point-to-point goes through cma.

    from mpi4py import MPI
    import cma.mpi
    comm = cma.mpi.Comm(MPI.COMM_WORLD)

``Comm`` *is* an ``MPI.Intracomm`` (a second Python object on the same MPI handle, as
``mpi4py.util.pkl5.Comm`` is), so everything it does not override (collectives,
Split, attributes, Abort, Get_name, ...) is plain mpi4py, and it can be passed to
anything that takes an mpi4py communicator, C-level mpi4py functions included.

Routing is fixed per pair of ranks: a peer on this node always goes through one cma
world (one memfd segment shared by the node's ranks), a peer on another node always
through MPI. MPI's non-overtaking rule is per pair, so it holds in each channel.
Two things need care when a rank has peers of both kinds ("mixed"):

* progress: MPI progresses only inside MPI calls and cma only inside cma calls, and
  either may need this rank's help to finish a transfer (MPI rendezvous, cma's shm
  pipeline). Mixed ranks therefore never block inside one engine: they poll both
  (``_progress_until``), spinning briefly and then sleeping with a growing pause.
* ANY_SOURCE: a wildcard receive is matched lazily, by probing both channels and
  posting a receive for exactly the message found. To keep MPI's order of posted
  receives, a receive posted after an unmatched wildcard receive that could take the
  same messages waits behind it (``_deferred``), and probes do not report messages
  such a waiting receive owns.

Node membership comes from ``Split_type(COMM_TYPE_SHARED)``, narrowed by
``CMA_MPI_NODES`` / ``CMA_MPI_RANKS_PER_NODE`` to pretend to be several nodes. The
node's lowest rank creates the world and hands its fds to the others over an abstract
Unix socket (SO_PEERCRED checked), the socket's name travelling in an MPI bcast.
``CMA_MPI_DISABLE=1`` sends everything through MPI. docs/mpi.md is the user's guide.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn

import numpy as np
from mpi4py import MPI

from . import _linux
from .channel import ChannelConfig
from .comm import AUTO, send_view
from .comm import Comm as CmaComm
from .comm import Request as CmaRequest
from .comm import Status as CmaStatus
from .errors import CmaError, InvalidRank, InvalidTag, PeerGone, TruncationError
from .protocol import ANY_SOURCE as CMA_ANY_SOURCE
from .protocol import ANY_TAG as CMA_ANY_TAG
from .protocol import PROC_NULL as CMA_PROC_NULL
from .protocol import RecvOp, SendOp
from .world import CONNECT_TIMEOUT, WorldFds

__all__ = [
    "ENV_DISABLE", "ENV_NODES", "ENV_RANKS_PER_NODE", "Comm", "PeerGoneError", "Request",
    "TruncateError",
]

ENV_DISABLE = "CMA_MPI_DISABLE"
ENV_NODES = "CMA_MPI_NODES"
ENV_RANKS_PER_NODE = "CMA_MPI_RANKS_PER_NODE"

# Mixed ranks poll both engines: spin this long, then sleep pauses doubling up to the max.
SPIN_SECONDS = float(os.environ.get("CMA_SPIN_US", "100")) * 1e-6
PAUSE_MIN = 20e-6
PAUSE_MAX = 1e-3

_ANY_SOURCE: int = MPI.ANY_SOURCE
_ANY_TAG: int = MPI.ANY_TAG
if _ANY_TAG != CMA_ANY_TAG:  # -1 in MPICH, Open MPI, Intel MPI, MS-MPI: tags pass unchanged
    raise ImportError(f"cma.mpi needs MPI_ANY_TAG == {CMA_ANY_TAG}; this MPI has {_ANY_TAG}")
_BYTE = MPI.BYTE
_fromcode = getattr(MPI.Datatype, "fromcode", None) or MPI._typedict.__getitem__  # mpi4py 4 / 3
_SPECS = frozenset((list, tuple))  # what an mpi4py buffer spec (not a plain buffer) is
# methods an all-on-node Comm takes from its cma communicator
_HANDED_OUT = ("Send", "Recv", "Isend", "Irecv")
# The handed-out methods get the caller's ranks as they are, so they need MPI's wildcard
# ranks to be cma's: so in MPICH; Open MPI swaps ANY_SOURCE (-1) and PROC_NULL (-2).
_SAME_WILDCARDS = _ANY_SOURCE == CMA_ANY_SOURCE and MPI.PROC_NULL == CMA_PROC_NULL
_NO_BYTES = memoryview(b"")

# Unbound MPI methods: the off-node path calls them on ``self`` (which is the MPI comm).
_mpi_send = MPI.Intracomm.Send
_mpi_recv = MPI.Intracomm.Recv
_mpi_isend = MPI.Intracomm.Isend
_mpi_irecv = MPI.Intracomm.Irecv
_mpi_send_obj = MPI.Intracomm.send
_mpi_recv_obj = MPI.Intracomm.recv
_mpi_isend_obj = MPI.Intracomm.isend
_mpi_irecv_obj = MPI.Intracomm.irecv
_mpi_iprobe = MPI.Intracomm.Iprobe
_mpi_probe = MPI.Intracomm.Probe
_mpi_improbe = MPI.Intracomm.Improbe
_mpi_improbe_obj = MPI.Intracomm.improbe  # its Message knows the pickle's size
_mpi_sendrecv = MPI.Intracomm.Sendrecv
_mpi_sendrecv_obj = MPI.Intracomm.sendrecv
_mpi_barrier = MPI.Intracomm.Barrier
_mpi_ibarrier = MPI.Intracomm.Ibarrier
_mpi_free = MPI.Intracomm.Free
_mpi_dup = MPI.Intracomm.Dup


# ------------------------------------------------------------------ errors

class TruncateError(MPI.Exception, TruncationError):
    """A receive buffer too small: ``MPI.Exception`` with ``ERR_TRUNCATE``, as mpi4py raises.

    Also a ``cma.errors.TruncationError`` carrying ``source`` (a rank of the wrapped
    communicator), ``tag``, ``nbytes`` and ``capacity``. The message is consumed.
    """

    def __init__(self, message: str, *, source: int, tag: int, nbytes: int, capacity: int):
        MPI.Exception.__init__(self, MPI.ERR_TRUNCATE)
        self.message = message
        self.source = source
        self.tag = tag
        self.nbytes = nbytes
        self.capacity = capacity

    def __str__(self) -> str:
        return self.message


class PeerGoneError(MPI.Exception, PeerGone):
    """An on-node peer exited while this rank needed it: ``MPI.Exception`` with ``ERR_OTHER``."""

    def __init__(self, message: str):
        MPI.Exception.__init__(self, MPI.ERR_OTHER)
        self.message = message

    def __str__(self) -> str:
        return self.message


# ------------------------------------------------------------------ buffer specs

def _contiguous_size(datatype: MPI.Datatype) -> int | None:
    """Bytes per element if elements are gap-free bytes (what cma can move), else None."""
    try:
        size: int = datatype.Get_size()
        if size and datatype.Get_extent() == (0, size) and datatype.Get_true_extent() == (0, size):
            return size
    except MPI.Exception:
        pass  # a datatype this MPI lacks (e.g. Fortran types in a C-only build)
    return None


# id() of mpi4py's predefined datatype objects -> element size, for gap-free ones: the
# buffer specs of the hot path are looked up here instead of asking MPI each time.
_SIZES: dict[int, int] = {
    id(datatype): size for datatype in vars(MPI).values()
    if isinstance(datatype, MPI.Datatype) and (size := _contiguous_size(datatype)) is not None
}


def _itemsize(datatype: Any, buf: Any) -> int:
    """Bytes per element of a spec's datatype (an MPI.Datatype, a typechar, or None)."""
    size = _SIZES.get(id(datatype))
    if size is not None:
        return size
    if datatype is None:
        return memoryview(buf).itemsize
    if isinstance(datatype, str):
        datatype = _fromcode(datatype)
    size = _contiguous_size(datatype)
    if size is None:
        raise NotImplementedError(
            "cma.mpi.Comm moves contiguous bytes to on-node peers; this datatype has gaps "
            "(pack it with datatype.Pack, or set CMA_MPI_DISABLE=1)")
    return size


def _spec(spec: Sequence[Any]) -> Any:
    """An mpi4py buffer spec as something cma takes: the buffer itself or a byte view.

    Accepts mpi4py's point-to-point forms: [buf, datatype], [buf, count],
    [buf, count, datatype], [buf, (count, displ), datatype] and
    [buf, count, displ, datatype], datatypes as MPI.Datatype or typechar.
    """
    n = len(spec)
    displ = 0
    count: Any = None
    if n == 2:
        buf, datatype = spec
        if id(datatype) in _SIZES:
            return _NO_BYTES if buf is None else buf  # the whole buffer: nothing to build
        if isinstance(datatype, (int, tuple, list)):
            count, datatype = datatype, None
    elif n == 3:
        buf, count, datatype = spec
    elif n == 4:
        buf, count, displ, datatype = spec
    else:
        raise ValueError(f"message: expecting 2 to 4 items, got {n}")
    if isinstance(count, (tuple, list)):
        count, displ = count
    if buf is None:
        if count:
            raise ValueError("message: a None buffer needs a count of 0")
        return _NO_BYTES
    view = send_view(buf)
    itemsize = _itemsize(datatype, buf)
    if count is None:
        if view.nbytes % itemsize:
            raise ValueError(f"message: buffer length {view.nbytes} is not a multiple of "
                             f"datatype size {itemsize}")
        return buf
    start = displ * itemsize
    stop = start + count * itemsize
    if start == 0 and stop == view.nbytes:
        return buf
    if stop > view.nbytes or count < 0 or displ < 0:
        raise ValueError(f"message: {count} elements at {displ} exceed a {view.nbytes}-byte buffer")
    return view[start:stop]


class _SpecCache:
    """The last [array, count, datatype] spec seen on one path, converted once.

    Programs resend the same spec in a loop (``[buf, n, MPI.BYTE]``, built anew each
    call); the converted form is kept as an array so that cma's own per-object view
    cache hits too. Only NumPy arrays are remembered: holding a view of a bytearray
    would stop its owner from resizing it.
    """

    __slots__ = ("buf", "count", "datatype", "out")

    def __init__(self) -> None:
        self.buf: Any = None
        self.count: Any = None
        self.datatype: Any = None
        self.out: Any = None

    def convert(self, spec: Sequence[Any]) -> Any:
        if len(spec) == 3 and spec[0] is self.buf and spec[2] is self.datatype \
                and spec[1] == self.count:
            return self.out
        out = _spec(spec)
        if len(spec) == 3 and type(spec[0]) is np.ndarray and type(spec[1]) is int:
            self.buf, self.count, self.datatype = spec
            self.out = out if out is spec[0] else np.frombuffer(out, dtype=np.uint8)
        return out


class _NodeComm(CmaComm):
    """The cma communicator of this node's ranks, speaking mpi4py where the hot paths end.

    When every rank is on this node, its ranks are the wrapped communicator's and
    ``Comm`` hands out its point-to-point methods as its own (``_HANDED_OUT``): a
    message then costs no wrapper frame, and a non-blocking call returns one request
    (``_NodeRequest``) instead of a wrapper around cma's. So buffer specs are converted,
    statuses filled and errors raised as mpi4py's here, on the paths the eager fast
    paths fall back to.
    """

    def __init__(self, mpi: Comm, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._mpi = mpi  # the wrapper: its _fail runs the error handler, raises its exception
        self._send_spec = _SpecCache()
        self._recv_spec = _SpecCache()
        self._mpi_scratch = CmaStatus()

    def _cached_view(self, buf: Any, convert: Callable[[Any], memoryview]) -> memoryview:
        if buf.__class__ in _SPECS:  # [buf, MPI.DOUBLE] & co: never cached themselves
            buf = (self._send_spec if convert is send_view else self._recv_spec).convert(buf)
        return super()._cached_view(buf, convert)

    def _send(self, mv: memoryview, dest: Any, tag: Any) -> None:
        try:
            super()._send(mv, dest, tag)
        except CmaError as exc:
            self._mpi._fail(exc)

    def _recv(self, mv: memoryview, source: Any, tag: Any, status: Any) -> None:
        mpi_status = None if status is None or status.__class__ is CmaStatus else status
        scratch = self._mpi_scratch if mpi_status is not None else status
        try:
            super()._recv(mv, source, tag, scratch)
        except CmaError as exc:
            self._mpi._fail(exc, mpi_status)
        if mpi_status is not None:
            _fill(mpi_status, scratch.source, scratch.tag, scratch.count)

    def _isend(self, mv: memoryview, dest: Any, tag: Any) -> CmaRequest:
        try:
            return super()._isend(mv, dest, tag)
        except CmaError as exc:
            self._mpi._fail(exc)

    def _irecv(self, mv: memoryview, source: Any, tag: Any) -> CmaRequest:
        try:
            return super()._irecv(mv, source, tag)
        except CmaError as exc:
            self._mpi._fail(exc)


# ------------------------------------------------------------------ bootstrap

# How Barrier is done, the same on every rank: MPI does not match a blocking collective
# with a nonblocking one, so ranks that must keep cma moving (Ibarrier) need the others
# to use Ibarrier too.
BARRIER_MPI = 0  # no cma anywhere: MPI_Barrier
BARRIER_CMA = 1  # one node: cma's own barrier
BARRIER_NONBLOCKING = 2  # cma on some node and several nodes: MPI_Ibarrier, polled


def _env_flag(name: str) -> bool:
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


def _share_world(node: MPI.Comm, members: list[tuple[int, int]]) -> WorldFds:
    """Node rank 0 creates the node's world and passes its fds to the others (collective)."""
    me = node.Get_rank()
    size = len(members)
    if me == 0:
        fds: WorldFds | None = None
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fds = WorldFds.create(size)
            address = f"\0cma-mpi-{secrets.token_hex(8)}"
            server.bind(address)
            server.listen(size)
            node.bcast((address, fds.world_id, fds.config.encode(), None), root=0)
        except (OSError, CmaError, ValueError) as exc:
            node.bcast((None, None, None, f"node rank 0 could not create the world: {exc}"), root=0)
            server.close()
            if fds is not None:
                fds.close()
            raise
        try:
            server.settimeout(CONNECT_TIMEOUT)
            pending = {pid for _, pid in members[1:]}
            while pending:
                conn, _ = server.accept()
                with conn:
                    pid, uid, _ = _linux.peer_credentials(conn)
                    if uid == os.getuid() and pid in pending:  # others are refused: closed
                        socket.send_fds(conn, [b"cma"], [fds.memfd, *fds.doorbells])
                        pending.discard(pid)
        except BaseException:
            fds.close()
            raise
        finally:
            server.close()
        return fds
    address, world_id, config, error = node.bcast(None, root=0)
    if error is not None:
        raise CmaError(error)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(address)
        pid, uid, _ = _linux.peer_credentials(sock)
        if uid != os.getuid() or pid != members[0][1]:
            raise CmaError(f"the bootstrap socket belongs to pid {pid} uid {uid}, not to "
                           "node rank 0: another process took its name")
        _, fdlist, _, _ = socket.recv_fds(sock, 16, size + 1)
    if len(fdlist) != size + 1:
        for fd in fdlist:
            os.close(fd)
        raise CmaError(f"node rank 0 passed {len(fdlist)} fds, expected {size + 1}")
    return WorldFds(world_id, size, fdlist[0], fdlist[1:], ChannelConfig.decode(config))


def _bootstrap(comm: Comm, transport: str, options: dict[str, Any]
               ) -> tuple[_NodeComm | None, list[tuple[int, int]], int, int]:
    """This node's cma Comm or None, node members as (rank, pid), ranks on the machine,
    and how every rank of ``comm`` will do Barrier (one of the ``BARRIER_*``).

    Collective over ``comm``; every rank raises if any rank failed, so none is left
    waiting for a peer that gave up.
    """
    rank = comm.Get_rank()
    pretend = _pretend_node(rank, comm.Get_size())
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    node = shared if pretend is None else shared.Split(pretend, key=rank)
    cma: _NodeComm | None = None
    error = None
    try:
        members: list[tuple[int, int]] = node.allgather((rank, os.getpid()))
        if len(members) > 1:
            try:
                fds = _share_world(node, members)
                cma = _NodeComm(comm, fds, node.Get_rank(), transport, **options)
                cma.attach()  # now: a rank that never talks on-node must not stall the others
            except (CmaError, OSError, ValueError) as exc:
                error = f"rank {rank}: {exc}"
        machine = shared.Get_size()
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
    barrier = BARRIER_CMA if min(sizes) == len(sizes) else \
        BARRIER_NONBLOCKING if max(sizes) > 1 else BARRIER_MPI
    return cma, members, machine, barrier


def _overlap(a: _RoutedRequest, source: int, tag: int) -> bool:
    """Whether receive ``a`` and a receive for (source, tag) could take the same message."""
    return (a._source == source or a._source == _ANY_SOURCE or source == _ANY_SOURCE) and \
        (a._tag == tag or a._tag == _ANY_TAG or tag == _ANY_TAG)


def _owner(waiting: Sequence[_RoutedRequest], source: int, tag: int) -> bool:
    """Whether one of the waiting receives matches a message from ``source`` with ``tag``."""
    return any((w._source == source or w._source == _ANY_SOURCE)
               and (w._tag == tag or w._tag == _ANY_TAG) for w in waiting)


# ------------------------------------------------------------------ requests

ACTIVE, COMPLETE, INACTIVE = 0, 1, 2
_EMPTY = (_ANY_SOURCE, _ANY_TAG, 0)


class Request:
    """An mpi4py-style request on an on-node (cma) or off-node (MPI) operation.

    Not an ``MPI.Request`` (MPI could not progress cma): wait for a list with
    ``cma.mpi.Request.Waitall``, which also takes plain ``MPI.Request`` objects. A
    completed request becomes inactive: waiting again returns at once with an empty
    status, as for ``MPI.REQUEST_NULL``.
    """

    # Two kinds: cma's own request where every peer is on this node (_NodeRequest),
    # else one that routes to either engine (_RoutedRequest). What the methods below
    # need from them: _poll progresses once and says whether the request is complete,
    # _complete blocks until it is, _outcome is the (source, tag, bytes) it will report,
    # _report fills a status, raises a failure, hands over the value and leaves the
    # request inactive; _wrapper is the Comm it came from.
    __slots__ = ()

    def _poll(self) -> bool:
        raise NotImplementedError

    def _complete(self) -> None:
        raise NotImplementedError

    def _outcome(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def _report(self, status: MPI.Status | None) -> Any:
        raise NotImplementedError

    def _wrapper(self) -> Comm:
        raise NotImplementedError

    # -- mpi4py's API

    def Wait(self, status: MPI.Status | None = None) -> Literal[True]:
        self._complete()
        self._report(status)
        return True

    def wait(self, status: MPI.Status | None = None) -> Any:
        self._complete()
        return self._report(status)

    def Test(self, status: MPI.Status | None = None) -> bool:
        if not self._poll():
            return False
        self._report(status)
        return True

    def test(self, status: MPI.Status | None = None) -> tuple[bool, Any]:
        if not self._poll():
            return False, None
        return True, self._report(status)

    def Get_status(self, status: MPI.Status | None = None) -> bool:
        """Whether it has completed, without completing it (``status`` filled if so)."""
        if not self._poll():
            return False
        if status is not None:
            _fill(status, *self._outcome())
        return True

    # -- many requests

    @staticmethod
    def _adopt(requests: Sequence[Request | MPI.Request]) -> list[Request]:
        """Our requests, plain MPI requests wrapped so that one loop progresses both."""
        first = next((r for r in requests if isinstance(r, Request)), None)
        if first is None and requests:
            raise TypeError("cma.mpi.Request.Waitall and friends need at least one request "
                            "from a cma.mpi.Comm; use MPI.Request's methods for plain ones")
        out = []
        for r in requests:
            if isinstance(r, Request):
                out.append(r)
            else:
                assert first is not None
                comm = first._wrapper()
                out.append(_RoutedRequest(comm, None, r, False) if r else _inactive(comm))
        return out

    @staticmethod
    def _report_all(requests: list[Request], statuses: list[MPI.Status] | None) -> list[Any]:
        if statuses is not None:
            statuses.extend(MPI.Status() for _ in range(len(requests) - len(statuses)))
        values = []
        first: BaseException | None = None
        for i, req in enumerate(requests):
            try:
                values.append(req._report(None if statuses is None else statuses[i]))
            except (MPI.Exception, CmaError) as exc:  # report every request, raise the first failure
                values.append(None)
                first = first or exc
        if first is not None:
            raise first
        return values

    @classmethod
    def Waitall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> Literal[True]:
        cls.waitall(requests, statuses)
        return True

    @classmethod
    def waitall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> list[Any]:
        reqs = cls._adopt(requests)
        for req in reqs:
            req._complete()
        return cls._report_all(reqs, statuses)

    @classmethod
    def Testall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> bool:
        return cls.testall(requests, statuses)[0]

    @classmethod
    def testall(cls, requests: Sequence[Request | MPI.Request],
                statuses: list[MPI.Status] | None = None) -> tuple[bool, list[Any] | None]:
        reqs = cls._adopt(requests)
        if not all([req._poll() for req in reqs]):  # a list: progress every one each time
            return False, None
        return True, cls._report_all(reqs, statuses)

    @classmethod
    def Waitany(cls, requests: Sequence[Request | MPI.Request],
                status: MPI.Status | None = None) -> int:
        return cls.waitany(requests, status)[0]

    @classmethod
    def waitany(cls, requests: Sequence[Request | MPI.Request],
                status: MPI.Status | None = None) -> tuple[int, Any]:
        """(index, value) of a completed request; (``MPI.UNDEFINED``, None) if none is active."""
        reqs = cls._adopt(requests)
        active = [i for i, req in enumerate(reqs) if req]
        if not active:
            if status is not None:
                _fill(status, *_EMPTY)
            return MPI.UNDEFINED, None
        found: list[int] = []

        def any_done() -> bool:
            found.extend(i for i in active if reqs[i]._poll())
            return bool(found)

        reqs[active[0]]._wrapper()._progress_until(any_done, None)
        return found[0], reqs[found[0]]._report(status)


class _RoutedRequest(Request):
    """A request of a Comm with peers off its node: a cma or an MPI request inside, or
    (on a mixed rank) a receive still waiting behind a wildcard to be posted in either."""

    __slots__ = ("_comm", "_creq", "_mreq", "_object", "_peer", "_state", "_buf", "_source",
                 "_tag", "_record", "_error", "_value")
    _comm: Comm
    _creq: CmaRequest | None  # at most one of the two is set; neither while pending
    _mreq: MPI.Request | None
    _object: bool
    _peer: int  # cma rank of the on-node peer whose exit dooms this request, or -1
    _state: int
    # a receive waiting behind a wildcard (Comm._advance) keeps what it will be posted with
    _buf: Any
    _source: int
    _tag: int
    # set on completion, handed over by _report
    _record: tuple[int, int, int]
    _error: BaseException | None
    _value: Any

    def __init__(self, comm: Comm, creq: CmaRequest | None, mreq: MPI.Request | None,
                 is_object: bool, peer: int = -1) -> None:
        self._comm = comm
        self._creq = creq
        self._mreq = mreq
        self._object = is_object
        self._peer = peer
        self._state = ACTIVE

    def _wrapper(self) -> Comm:
        return self._comm

    # -- completion, kept until reported (so that Testall completes all or none)

    def _done_cma(self, cs: CmaStatus, error: CmaError | None, value: Any) -> None:
        self._state = COMPLETE
        self._creq = None
        self._record = (self._comm._ranks[cs.source], cs.tag, cs.count) if cs.source >= 0 else _EMPTY
        self._error = error
        self._value = value

    def _done_mpi(self, st: MPI.Status, error: MPI.Exception | None, value: Any) -> None:
        self._state = COMPLETE
        self._mreq = None
        self._record = (st.Get_source(), st.Get_tag(), st.Get_elements(_BYTE))
        self._error = error
        self._value = value

    def _poll(self) -> bool:
        """Progress this request's engine once; True when complete."""
        if self._state:
            return True
        if self._creq is None and self._mreq is None:  # waiting to be matched
            self._comm._advance()
        creq = self._creq
        if creq is not None:
            cs = self._comm._cstatus
            cs.source = CMA_ANY_SOURCE  # stays so for sends: cma fills only receive statuses
            value = None
            try:
                if self._object:
                    done, value = creq.test(cs)
                else:
                    done = creq.Test(cs)
            except CmaError as exc:
                self._done_cma(cs, exc, None)
                return True
            if done:
                self._done_cma(cs, None, value)
            return done
        mreq = self._mreq
        if mreq is None:
            return False
        st = MPI.Status()
        try:
            if self._object:
                done, value = mreq.test(st)
            else:
                done, value = mreq.Test(st), None
        except MPI.Exception as exc:
            self._done_mpi(st, exc, None)
            return True
        if done:
            self._done_mpi(st, None, value)
        return done

    def _complete(self) -> None:
        """Block until complete: inside its engine, or polling both engines on a mixed rank."""
        if self._state:
            return
        comm = self._comm
        creq, mreq = self._creq, self._mreq
        if comm._mixed or (creq is None and mreq is None):
            comm._progress_until(self._poll, self._peer)
        elif creq is not None:
            cs = comm._cstatus
            cs.source = CMA_ANY_SOURCE
            try:
                value = creq.wait(cs) if self._object else creq.Wait(cs)
            except CmaError as exc:
                self._done_cma(cs, exc, None)
                return
            self._done_cma(cs, None, value)
        elif mreq is not None:
            st = MPI.Status()
            try:
                value = mreq.wait(st) if self._object else mreq.Wait(st)
            except MPI.Exception as exc:
                self._done_mpi(st, exc, None)
                return
            self._done_mpi(st, None, value)

    def _report(self, status: MPI.Status | None) -> Any:
        """Fill ``status``, raise a failure, hand over the value; the request becomes inactive."""
        if self._state != COMPLETE:
            if status is not None:
                _fill(status, *_EMPTY)
            return None
        self._state = INACTIVE
        error, value = self._error, self._value
        self._error = self._value = None
        if status is not None:
            _fill(status, *self._record)
        if error is not None:
            self._comm._fail(error, status)
        return value

    def _outcome(self) -> tuple[int, int, int]:
        return self._record if self._state == COMPLETE else _EMPTY

    def __bool__(self) -> bool:
        """False once completed and reported, as ``MPI.REQUEST_NULL`` is."""
        return self._state != INACTIVE

    def __repr__(self) -> str:
        where = "cma" if self._creq is not None else "MPI" if self._mreq is not None else "pending"
        return f"<cma.mpi.Request {where} {('active', 'complete', 'inactive')[self._state]}>"


class _Finished:
    """The op of a _NodeRequest once reported, or once waiting for it failed (PeerGone)."""

    __slots__ = ("error",)
    done = True

    def __init__(self, error: CmaError | None) -> None:
        self.error = error


_REPORTED = _Finished(None)


# (a cma request whose methods take MPI.Status where cma's take cma.Status: hence the ignore)
class _NodeRequest(Request, CmaRequest):  # type: ignore[misc]
    """cma's own request, as a Comm whose peers are all on its node hands it out.

    One object per message instead of two: the node is the whole communicator, so cma's
    ranks are the wrapped communicator's and only statuses, errors and inactivity need
    mpi4py's behaviour, all of it here.
    """

    __slots__ = ()
    _comm: _NodeComm
    _op: SendOp | RecvOp | _Finished | None  # type: ignore[assignment]

    def _wrapper(self) -> Comm:
        return self._comm._mpi

    def _poll(self) -> bool:
        op = self._op
        if op is None or op.done:
            return True
        try:
            self._comm._progress()
        except CmaError as exc:
            self._op = _Finished(exc)
            return True
        return op.done

    def _complete(self) -> None:
        op = self._op
        if op is not None and not op.done:
            try:
                self._comm._wait(op)  # type: ignore[arg-type]
            except CmaError as exc:
                self._op = _Finished(exc)

    def _outcome(self) -> tuple[int, int, int]:
        op = self._op
        if isinstance(op, RecvOp):
            return op.matched_source, op.matched_tag, op.nbytes
        return _EMPTY

    def _report(self, status: MPI.Status | None) -> Any:
        op = self._op
        error: BaseException | None = None
        value = None
        if isinstance(op, RecvOp):
            error, op.error = op.error, None
            if error is None and self._object:
                value = self._result()  # cma's: the object received
        elif isinstance(op, _Finished):
            error = op.error
        if status is not None:
            _fill(status, *self._outcome())
        self._op = _REPORTED
        if error is not None:
            self._comm._mpi._fail(error, status)
        return value

    def __bool__(self) -> bool:
        """False once completed and reported, as ``MPI.REQUEST_NULL`` is."""
        return self._op is not _REPORTED

    def __repr__(self) -> str:
        op = self._op
        state = "inactive" if op is _REPORTED else "complete" if op is None or op.done else "active"
        return f"<cma.mpi.Request cma {state}>"


def _inactive(comm: Comm) -> _RoutedRequest:
    req = _RoutedRequest(comm, None, None, False)
    req._state = INACTIVE
    return req


def _fill(status: MPI.Status, source: int, tag: int, nbytes: int) -> None:
    status.Set_source(source)
    status.Set_tag(tag)
    status.Set_elements(_BYTE, nbytes)


# ------------------------------------------------------------------ the communicator

class Comm(MPI.Intracomm):
    """An mpi4py ``Intracomm`` whose point-to-point with on-node peers goes through cma.

    ``Comm(MPI.COMM_WORLD)`` is collective over the wrapped communicator. ``transport``
    and ``options`` are those of ``cma.Comm`` ("auto" picks per message). Ranks, tags,
    statuses, requests and errors are mpi4py's; docs/mpi.md says what differs.
    """

    # __dict__: when every rank is on this node, an instance's _HANDED_OUT methods are its
    # cma communicator's own bound methods (see _NodeComm), found before the class's.
    __slots__ = ("_cma", "_cma_send", "_cma_recv", "_fast", "_local", "_ranks", "_mixed",
                 "_cma_any", "_pidfds", "_deferred", "_cstatus", "_cma_first", "_yield",
                 "_barrier", "_transport", "_options", "__dict__")
    _cma: _NodeComm | None
    _cma_send: Callable[..., None]  # bound methods of _cma: one lookup less per message
    _cma_recv: Callable[..., None]
    # rank of the wrapped comm -> cma rank, for the blocking fast paths: empty on a mixed
    # rank (which must not block in cma); holds ANY_SOURCE when every peer is on-node
    _fast: dict[int, int]
    _local: dict[int, int]  # rank of the wrapped comm -> cma rank, for this node's ranks
    _ranks: list[int]  # cma rank -> rank of the wrapped comm
    _mixed: bool  # this rank has peers on this node and on others
    _cma_any: bool  # every peer is on this node: ANY_SOURCE is cma's
    _pidfds: dict[int, int]  # cma rank -> pidfd, to notice a peer's exit on a mixed rank
    _deferred: list[_RoutedRequest]  # receives waiting behind a wildcard receive (mixed ranks)
    _cstatus: CmaStatus  # reused: one thread uses a communicator at a time
    _cma_first: bool
    _yield: bool  # more ranks than cores on this machine: yield while spinning
    _barrier: int
    _transport: str
    _options: dict[str, Any]

    def __new__(cls, comm: MPI.Intracomm | None = None, transport: str = AUTO,
                **options: Any) -> Comm:
        self = super().__new__(cls, comm)
        # mpi4py's Dup and Clone build instances of this class without __init__: such a
        # bare instance sends everything through MPI (and Dup then wraps it properly).
        self._cma = None
        self._fast = {}
        self._local = {}
        self._ranks = []
        self._mixed = False
        self._cma_any = False
        self._pidfds = {}
        self._deferred = []
        self._cstatus = CmaStatus()
        self._cma_first = True
        self._yield = False
        self._barrier = BARRIER_MPI
        self._transport = transport
        self._options = options
        return self

    def __init__(self, comm: MPI.Intracomm, transport: str = AUTO, **options: Any) -> None:
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"cma.mpi.Comm wraps an mpi4py Intracomm, got {comm!r}")
        if MPI.Intracomm.allreduce(self, _env_flag(ENV_DISABLE), op=MPI.LOR):
            return
        cma, members, machine, self._barrier = _bootstrap(self, transport, options)
        if cma is None:
            return
        self._cma = cma
        self._cma_send = cma.Send
        self._cma_recv = cma.Recv
        self._ranks = [rank for rank, _ in members]
        self._local = {rank: i for i, rank in enumerate(self._ranks)}
        self._mixed = len(members) < self.Get_size()
        self._cma_any = not self._mixed
        if self._cma_any:
            self._fast = {**self._local, _ANY_SOURCE: CMA_ANY_SOURCE}
            cma._request = _NodeRequest
            for name in _HANDED_OUT if _SAME_WILDCARDS else ():
                if getattr(type(self), name) is getattr(Comm, name):  # not overridden
                    self.__dict__[name] = getattr(cma, name)
        else:
            me = self.Get_rank()
            self._pidfds = {i: os.pidfd_open(pid) for i, (rank, pid) in enumerate(members)
                            if rank != me}
        self._yield = machine > (os.cpu_count() or 1)

    # -- what the wrapper adds

    @property
    def cma(self) -> CmaComm | None:
        """The cma communicator of this node's ranks (``stats()``, ``transports()``), if any."""
        return self._cma

    @property
    def node_ranks(self) -> list[int]:
        """Ranks of the wrapped communicator that this rank reaches through cma."""
        return list(self._ranks)

    def __repr__(self) -> str:
        if self._cma is None:
            return f"<cma.mpi.Comm rank {self.Get_rank()} of {self.Get_size()}, MPI only>"
        return (f"<cma.mpi.Comm rank {self.Get_rank()} of {self.Get_size()}, cma "
                f"({self._cma.transport}) to ranks {self._ranks}, MPI to the rest>")

    # -- errors

    def _fail(self, exc: BaseException, status: MPI.Status | None = None) -> NoReturn:
        """Raise a cma error as mpi4py would, after the communicator's error handler ran
        (any other exception as it is)."""
        error: MPI.Exception
        if isinstance(exc, TruncationError):
            source = self._ranks[exc.source]
            error = TruncateError(
                f"message of {exc.nbytes} bytes from rank {source} (tag {exc.tag}) does not fit "
                f"the {exc.capacity}-byte receive buffer; it was consumed",
                source=source, tag=exc.tag, nbytes=exc.nbytes, capacity=exc.capacity)
            if status is not None:
                _fill(status, source, exc.tag, 0)
        elif isinstance(exc, PeerGone):
            error = PeerGoneError(f"{exc} (cma ranks 0, 1, ... are ranks {self._ranks})")
        elif isinstance(exc, InvalidTag):
            error = MPI.Exception(MPI.ERR_TAG)
        elif isinstance(exc, InvalidRank):
            error = MPI.Exception(MPI.ERR_RANK)
        else:
            raise exc
        if status is not None:
            status.Set_error(error.Get_error_code())
        self.Call_errhandler(error.Get_error_code())
        raise error from exc

    # -- blocking buffer point-to-point

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        peer = self._fast.get(dest)
        if peer is None:
            if self._mixed:
                self.Isend(buf, dest, tag).Wait()
            else:
                _mpi_send(self, buf, dest, tag)
            return
        self._cma_send(buf, peer, tag)  # _NodeComm converts specs, raises mpi4py's errors

    def Recv(self, buf: Any, source: int = _ANY_SOURCE, tag: int = _ANY_TAG,
             status: MPI.Status | None = None) -> None:
        peer = self._fast.get(source)
        if peer is None:
            if self._mixed:
                self.Irecv(buf, source, tag).Wait(status)
            else:
                _mpi_recv(self, buf, source, tag, status)
            return
        self._cma_recv(buf, peer, tag, status)  # and fills an MPI.Status

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = _ANY_SOURCE, recvtag: int = _ANY_TAG,
                 status: MPI.Status | None = None) -> None:
        if self._cma is None:
            _mpi_sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
            return
        send = self.Isend(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)
        send.Wait()

    def Sendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0, source: int = _ANY_SOURCE,
                         recvtag: int = _ANY_TAG, status: MPI.Status | None = None) -> None:
        if self._cma is None:
            MPI.Intracomm.Sendrecv_replace(self, buf, dest, sendtag, source, recvtag, status)
            return
        outgoing = bytes(send_view(_spec(buf) if buf.__class__ in _SPECS else buf))
        self.Sendrecv(outgoing, dest, sendtag, buf, source, recvtag, status)

    # Ready mode may be implemented as standard mode (MPI-4.1, section 3.4).
    def Rsend(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.Send(buf, dest, tag)

    # -- non-blocking buffer point-to-point (our Request is no MPI.Request: MPI could not
    # progress cma, hence the type: ignore[override])

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # type: ignore[override]
        peer = self._local.get(dest)
        if peer is None:
            return _RoutedRequest(self, None, _mpi_isend(self, buf, dest, tag), False)
        try:
            creq = self._cma.Isend(buf, peer, tag)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)
        return self._on_node(creq, False, peer)

    def Irsend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # type: ignore[override]
        return self.Isend(buf, dest, tag)

    def Irecv(self, buf: Any, source: int = _ANY_SOURCE,  # type: ignore[override]
              tag: int = _ANY_TAG) -> Request:
        return self._irecv(buf, source, tag, False)

    # -- objects (on-node: pickle protocol 5, large buffers out of band through cma)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        peer = self._fast.get(dest)
        if peer is None:
            if self._mixed:
                self.isend(obj, dest, tag).Wait()
            else:
                _mpi_send_obj(self, obj, dest, tag)
            return
        try:
            self._cma.send(obj, peer, tag)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)

    def recv(self, buf: Any = None, source: int = _ANY_SOURCE, tag: int = _ANY_TAG,
             status: MPI.Status | None = None) -> Any:
        if source in self._fast or self._mixed and (source in self._local
                                                    or source == _ANY_SOURCE):
            return self._irecv(buf, source, tag, True).wait(status)
        if self._mixed:
            return self._recv_mpi_mixed(source, tag, status)  # any size, as mpi4py's recv
        return _mpi_recv_obj(self, buf, source, tag, status)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:  # type: ignore[override]
        peer = self._local.get(dest)
        if peer is None:
            return _RoutedRequest(self, None, _mpi_isend_obj(self, obj, dest, tag), True)
        try:
            creq = self._cma.isend(obj, peer, tag)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)
        return self._on_node(creq, True, peer)

    def irecv(self, buf: Any = None, source: int = _ANY_SOURCE,  # type: ignore[override]
              tag: int = _ANY_TAG) -> Request:
        """On-node: any size. Off-node: mpi4py's irecv, bounded unless ``buf`` is given."""
        return self._irecv(buf, source, tag, True)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = _ANY_SOURCE, recvtag: int = _ANY_TAG,
                 status: MPI.Status | None = None) -> Any:
        if self._cma is None:
            return _mpi_sendrecv_obj(self, sendobj, dest, sendtag, recvbuf, source, recvtag,
                                     status)
        send = self.isend(sendobj, dest, sendtag)
        obj = self.recv(recvbuf, source, recvtag, status)
        send.Wait()
        return obj

    # -- probes

    def Iprobe(self, source: int = _ANY_SOURCE, tag: int = _ANY_TAG,
               status: MPI.Status | None = None) -> bool:
        if self._mixed:
            return self._iprobe_mixed(source, tag, status)
        peer = self._fast.get(source)
        if peer is None:
            return _mpi_iprobe(self, source, tag, status)
        return self._iprobe_cma(peer, tag, status)

    def Probe(self, source: int = _ANY_SOURCE, tag: int = _ANY_TAG,
              status: MPI.Status | None = None) -> Literal[True]:
        if self._mixed:
            self._progress_until(lambda: self._iprobe_mixed(source, tag, status),
                                 self._local.get(source))
            return True
        peer = self._fast.get(source)
        if peer is None:
            return _mpi_probe(self, source, tag, status)
        cs = self._cstatus
        try:
            self._cma.Probe(peer, tag, cs)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)
        if status is not None:
            _fill(status, self._ranks[cs.source], cs.tag, cs.count)
        return True

    iprobe = Iprobe
    probe = Probe

    # -- synchronisation

    def Barrier(self) -> None:
        """cma's barrier on one node, else MPI's; either keeps pending cma transfers moving."""
        if self._barrier == BARRIER_CMA:
            try:
                self._cma.Barrier()  # type: ignore[union-attr]
            except CmaError as exc:
                self._fail(exc)
        elif self._barrier == BARRIER_NONBLOCKING:
            request = _mpi_ibarrier(self)
            if self._cma is None:
                request.Wait()
            else:
                self._progress_until(request.Test, None)
        else:
            _mpi_barrier(self)

    barrier = Barrier

    # -- communicators made from this one

    def Dup(self, info: MPI.Info | None = None) -> Comm:
        """A new cma.mpi.Comm (collective), with its own node worlds and this one's transport."""
        dup = _mpi_dup(self) if info is None else _mpi_dup(self, info)
        return type(self)(dup, self._transport, **self._options)

    def Clone(self) -> Comm:
        return self.Dup()

    def Free(self) -> None:
        """Close this rank's cma world, then free the MPI communicator."""
        if self._cma is not None:
            self._cma.close()
            self._cma = None
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds = {}
        self._fast = {}
        self._local = {}
        self._mixed = self._cma_any = False
        for name in _HANDED_OUT:
            self.__dict__.pop(name, None)
        self._barrier = BARRIER_MPI
        _mpi_free(self)

    # -- internals: the cma half

    def _iprobe_cma(self, peer: int, tag: int, status: MPI.Status | None) -> bool:
        cs = self._cstatus
        try:
            found = self._cma.Iprobe(peer, tag, cs)  # type: ignore[union-attr]
        except CmaError as exc:
            self._fail(exc)
        if found and status is not None:
            _fill(status, self._ranks[cs.source], cs.tag, cs.count)
        return found

    def _on_node(self, creq: CmaRequest, is_object: bool, peer: int) -> Request:
        """The request of an on-node operation: cma's own when every peer is on this node."""
        if self._cma_any:
            return creq  # type: ignore[return-value]  # a _NodeRequest (see __init__)
        return _RoutedRequest(self, creq, None, is_object, peer)

    def _irecv(self, buf: Any, source: int, tag: int, is_object: bool) -> Request:
        peer = self._fast.get(source)
        if peer is not None:
            cma = self._cma
            assert cma is not None
            try:
                creq = cma.irecv(None, peer, tag) if is_object else cma.Irecv(buf, peer, tag)
            except CmaError as exc:
                self._fail(exc)
            return self._on_node(creq, is_object, peer)
        if self._mixed and (source == _ANY_SOURCE
                            or any(_overlap(w, source, tag) for w in self._deferred)):
            req = _RoutedRequest(self, None, None, is_object)
            req._buf = buf
            req._source = source
            req._tag = tag
            self._deferred.append(req)
            self._advance()
            return req
        req = _RoutedRequest(self, None, None, is_object)
        self._post(req, buf, source, tag)
        return req

    def _post(self, req: _RoutedRequest, buf: Any, source: int, tag: int) -> None:
        """Post ``req`` now in the channel of ``source`` (cma for ANY_SOURCE on one node)."""
        peer = self._local.get(source)
        if peer is None and not (source == _ANY_SOURCE and self._cma_any):
            req._mreq = _mpi_irecv_obj(self, buf, source, tag) if req._object \
                else _mpi_irecv(self, buf, source, tag)
            return
        if peer is None:
            peer = CMA_ANY_SOURCE
        cma = self._cma
        assert cma is not None
        try:
            if req._object:
                req._creq = cma.irecv(None, peer, tag)
            else:
                req._creq = cma.Irecv(buf, peer, tag)  # (_NodeComm converts buffer specs)
        except CmaError as exc:
            self._fail(exc)
        req._peer = peer

    # -- internals: mixed ranks (peers on this node and on others)

    def _advance(self) -> None:
        """Match the receives waiting behind a wildcard, in the order they were posted.

        A waiting receive is posted as it is once no earlier waiting receive overlaps it;
        otherwise it takes the first message it matches unless an earlier waiting receive
        matches that message too (then the earlier one gets it on a later pass).
        """
        waiting: list[_RoutedRequest] = []
        for req in self._deferred:
            if req._source != _ANY_SOURCE and not any(_overlap(w, req._source, req._tag)
                                                      for w in waiting):
                self._post(req, req._buf, req._source, req._tag)
            elif not self._match(req, waiting):
                waiting.append(req)
                continue
            req._buf = None
        self._deferred = waiting

    def _match(self, req: _RoutedRequest, earlier: list[_RoutedRequest]) -> bool:
        """Post ``req`` for exactly the first message it matches, if no earlier one owns it."""
        source, tag = req._source, req._tag
        peer = self._local.get(source)
        self._cma_first = not self._cma_first  # alternate: neither channel starves the other
        for on_cma in (self._cma_first, not self._cma_first):
            if on_cma and (peer is not None or source == _ANY_SOURCE):
                if not self._iprobe_cma(CMA_ANY_SOURCE if peer is None else peer, tag, None):
                    continue
                found_source, found_tag = self._ranks[self._cstatus.source], self._cstatus.tag
                if _owner(earlier, found_source, found_tag):
                    return False
                self._post(req, req._buf, found_source, found_tag)
                return True
            if not on_cma and peer is None:
                st = MPI.Status()
                if not _mpi_iprobe(self, source, tag, st):
                    continue
                found_source, found_tag = st.Get_source(), st.Get_tag()
                if _owner(earlier, found_source, found_tag):
                    return False
                message = (_mpi_improbe_obj if req._object else _mpi_improbe)(
                    self, found_source, found_tag)
                assert message is not None  # probed just now, and only this thread receives
                req._mreq = message.irecv() if req._object else message.Irecv(req._buf)
                return True
        return False

    def _iprobe_mixed(self, source: int, tag: int, status: MPI.Status | None) -> bool:
        if self._deferred:
            self._advance()
        peer = self._local.get(source)
        st = MPI.Status()
        if peer is not None:
            found = self._iprobe_cma(peer, tag, st)
        elif source == _ANY_SOURCE:
            found = self._iprobe_cma(CMA_ANY_SOURCE, tag, st) or _mpi_iprobe(self, source, tag, st)
        else:
            found = _mpi_iprobe(self, source, tag, st)
        if not found or _owner(self._deferred, st.Get_source(), st.Get_tag()):
            return False  # a receive posted earlier takes that message
        if status is not None:
            _fill(status, st.Get_source(), st.Get_tag(), st.Get_elements(_BYTE))
        return True

    def _recv_mpi_mixed(self, source: int, tag: int, status: MPI.Status | None) -> Any:
        """Off-node ``recv`` without starving cma: probe, then receive exactly that message."""
        st = MPI.Status()
        self._progress_until(lambda: self._iprobe_mixed(source, tag, st), None)
        message = _mpi_improbe_obj(self, st.Get_source(), st.Get_tag())
        assert message is not None  # probed just now, and only this thread receives
        return message.recv(status)

    def _progress_until(self, done: Callable[[], bool], peer: int | None) -> None:
        """Drive cma and MPI until ``done()``: spin, then sleep with a growing pause.

        ``peer`` is the cma rank whose exit makes waiting pointless (None: none is).
        """
        cma = self._cma
        pidfd = self._pidfds.get(peer) if peer is not None else None
        watched = [] if pidfd is None else [pidfd]
        deadline = 0.0
        pause = PAUSE_MIN
        while not done():
            if cma is not None:
                cma.progress()
            _mpi_iprobe(self, _ANY_SOURCE, _ANY_TAG)  # MPI progresses inside its calls
            if self._deferred:
                self._advance()
            now = time.perf_counter()
            if not deadline:
                deadline = now + SPIN_SECONDS
            if now < deadline:
                if self._yield:
                    os.sched_yield()
                continue
            if select.select(watched, [], [], pause)[0]:
                watched = []  # the peer exited: take what it left, then give up
                if cma is not None:
                    cma.Iprobe(CMA_ANY_SOURCE, _ANY_TAG)
                if not done():
                    self._fail(PeerGone(f"rank {peer} exited before completing this operation"))
                return
            pause = min(pause * 2, PAUSE_MAX)


def _refuse_on_node(name: str, peers: Sequence[tuple[int, str, int]]) -> Callable[..., Any]:
    """An mpi4py method this wrapper cannot route through cma: MPI for off-node peers only.

    ``peers`` lists (position, keyword, default) of the rank arguments. Sent to an
    on-node peer through MPI, the message would miss a receive posted on cma, so refuse.
    """
    method = getattr(MPI.Intracomm, name)

    def call(self: Comm, *args: Any, **kwargs: Any) -> Any:
        for position, keyword, default in peers:
            rank = args[position] if len(args) > position else kwargs.get(keyword, default)
            if rank in self._local or (rank == _ANY_SOURCE and self._cma is not None):
                raise NotImplementedError(
                    f"cma.mpi.Comm.{name} with on-node rank {rank}: not available through cma "
                    "(use Send/Isend/Recv/Irecv/probes, or CMA_MPI_DISABLE=1)")
        return method(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"mpi4py's {name} for off-node peers; NotImplementedError for on-node ones."
    return call


_DEST = (1, "dest", MPI.PROC_NULL)
_SOURCE_FIRST = (0, "source", _ANY_SOURCE)
_SOURCE = (1, "source", _ANY_SOURCE)
_REFUSED = {
    "Ssend": [_DEST], "Issend": [_DEST], "ssend": [_DEST], "issend": [_DEST],
    "Bsend": [_DEST], "Ibsend": [_DEST], "bsend": [_DEST], "ibsend": [_DEST],
    "Send_init": [_DEST], "Ssend_init": [_DEST], "Bsend_init": [_DEST], "Rsend_init": [_DEST],
    "Recv_init": [_SOURCE], "Psend_init": [(2, "dest", MPI.PROC_NULL)],
    "Precv_init": [(2, "source", _ANY_SOURCE)],
    "Mprobe": [_SOURCE_FIRST], "Improbe": [_SOURCE_FIRST], "mprobe": [_SOURCE_FIRST],
    "improbe": [_SOURCE_FIRST],
    "Isendrecv": [_DEST, (4, "source", _ANY_SOURCE)],
    "Isendrecv_replace": [_DEST, (3, "source", _ANY_SOURCE)],
}
for _name, _peers in _REFUSED.items():
    if hasattr(MPI.Intracomm, _name):  # older mpi4py lacks some (Isendrecv, partitioned)
        setattr(Comm, _name, _refuse_on_node(_name, _peers))

"""The two sides of a ``cma-bench`` benchmark: the message tags, the
``multiprocessing.Pipe`` baseline dressed as a communicator, and ``Endpoint``, any
communicator with what the kernels need to drive it."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

TAG_DATA = 1
TAG_ACK = 2
TAG_STATS = 3
TAG_CTRL = 4
TAG_GUARD = 5

Bytes = npt.NDArray[np.uint8]
WAITALL_MODES = ("each", "mpi")


# ---------------------------------------------------------------- the multiprocessing.Pipe baseline


class _Done:
    def Wait(self) -> bool:
        return True


class _DeferredRecv:
    def __init__(self, conn: Connection, buf: Bytes) -> None:
        self.conn = conn
        self.buf = buf

    def Wait(self) -> bool:
        self.conn.recv_bytes_into(self.buf)
        return True


class PipeComm:
    """A ``multiprocessing.Pipe`` end dressed as a size-2 communicator: what a Python user
    without cma would write (``send_bytes`` / ``recv_bytes_into``).

    Tags are ignored because the benchmarks send in a fixed order. ``Isend`` writes at
    once (the kernel buffers the pipe) and ``Irecv`` reads when waited on, which is enough
    for latency and bw; a bidirectional window would fill both pipe buffers and block.
    """

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank

    def Send(self, buf: Bytes, dest: int, tag: int = 0) -> None:
        """``MPI.Comm.Send`` as a pipe does it: ``send_bytes`` (tag ignored)."""
        self.conn.send_bytes(buf.data)

    def Recv(self, buf: Bytes, source: int = -1, tag: int = -1) -> None:
        """``MPI.Comm.Recv`` as a pipe does it: ``recv_bytes_into`` (source and tag ignored)."""
        self.conn.recv_bytes_into(buf)

    def Isend(self, buf: Bytes, dest: int, tag: int = 0) -> _Done:
        """``MPI.Comm.Isend`` as a pipe does it: written at once, a request already done."""
        self.conn.send_bytes(buf.data)
        return _Done()

    def Irecv(self, buf: Bytes, source: int = -1, tag: int = -1) -> _DeferredRecv:
        """``MPI.Comm.Irecv`` as a pipe does it: read when the request is waited for."""
        return _DeferredRecv(self.conn, buf)

    def Barrier(self) -> None:
        """``MPI.Comm.Barrier`` for two: one byte each way."""
        self.conn.send_bytes(b"\0")
        self.conn.recv_bytes()

    def send(self, obj: object, dest: int, tag: int = 0) -> None:
        """``MPI.Comm.send``: the pipe's own pickling ``send``."""
        self.conn.send(obj)

    def recv(self, source: int = -1, tag: int = -1) -> Any:
        """``MPI.Comm.recv``: the pipe's own ``recv``."""
        return self.conn.recv()

    def close(self) -> None:
        """Close the pipe end."""
        self.conn.close()


def mp_pipe_pair() -> tuple[PipeComm, PipeComm]:
    a, b = multiprocessing.Pipe(duplex=True)
    return PipeComm(a, 0), PipeComm(b, 1)


# ---------------------------------------------------------------- one side of a benchmark


def _wait_each(requests: Sequence[Any]) -> None:
    for request in requests:
        request.Wait()


class Endpoint:
    """A communicator of any flavour plus the few things the kernels need to drive it.

    Flavours: ``cma`` (a ``cma.Pipe`` end), ``mpi`` (an mpi4py Intracomm), ``cma.mpi``
    (``cma.mpi.Comm``) and ``pipe`` (``PipeComm``). ``waitall="mpi"`` makes ``cma.mpi``
    wait for a list of requests with ``MPI.Request.Waitall``; ``mpi`` always does, the
    others cannot (they have no MPI).
    """

    def __init__(self, comm: Any, flavor: str, waitall: str = "each") -> None:
        self.comm = comm
        self.rank = int(comm.rank)
        self.has_stats = callable(getattr(comm, "stats", None)) and callable(
            getattr(comm, "reset_stats", None))
        self.waitall: Callable[[Sequence[Any]], object] = _wait_each
        self.byte: Any = "B"  # the datatype of a --buffer spec list
        if flavor == "cma":
            import cma

            self.waitall = cma.Request.Waitall
        elif flavor in ("mpi", "cma.mpi"):
            from mpi4py import MPI

            self.byte = MPI.BYTE
            if flavor == "mpi" or waitall == "mpi":
                self.waitall = MPI.Request.Waitall

    def stats(self) -> dict[str, dict[str, float]] | None:
        """The communicator's ``stats()``, or None for one that counts nothing (MPI, a pipe)."""
        return self.comm.stats() if self.has_stats else None

"""What cma.mpi takes from mpi4py, looked up once: wildcard ranks, unbound methods, statuses.

The off-node paths call the unbound ``MPI.Intracomm`` methods on the wrapper itself
(which is the MPI communicator): a module global is one lookup where an attribute of
``MPI.Intracomm`` would be two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from ..protocol import ANY_SOURCE as CMA_ANY_SOURCE
from ..protocol import ANY_TAG as CMA_ANY_TAG
from ..wire import PROC_NULL as CMA_PROC_NULL

ANY_SOURCE: int = MPI.ANY_SOURCE
ANY_TAG: int = MPI.ANY_TAG
if ANY_TAG != CMA_ANY_TAG:  # -1 in MPICH, Open MPI, Intel MPI, MS-MPI: tags pass unchanged
    raise ImportError(f"cma.mpi needs MPI_ANY_TAG == {CMA_ANY_TAG}; this MPI has {ANY_TAG}")
BYTE = MPI.BYTE
# Handed-out methods get the caller's ranks as they are, so they need MPI's wildcard
# ranks to be cma's: so in MPICH; Open MPI swaps ANY_SOURCE (-1) and PROC_NULL (-2).
SAME_WILDCARDS = ANY_SOURCE == CMA_ANY_SOURCE and MPI.PROC_NULL == CMA_PROC_NULL
EMPTY = (ANY_SOURCE, ANY_TAG, 0)  # what an empty status reports: source, tag, bytes

mpi_send = MPI.Intracomm.Send
mpi_recv = MPI.Intracomm.Recv
mpi_isend = MPI.Intracomm.Isend
mpi_irecv = MPI.Intracomm.Irecv
mpi_send_obj = MPI.Intracomm.send
mpi_recv_obj = MPI.Intracomm.recv
mpi_isend_obj = MPI.Intracomm.isend
mpi_irecv_obj = MPI.Intracomm.irecv
mpi_iprobe = MPI.Intracomm.Iprobe
mpi_probe = MPI.Intracomm.Probe
mpi_improbe = MPI.Intracomm.Improbe
mpi_improbe_obj = MPI.Intracomm.improbe  # its Message knows the pickle's size
mpi_mprobe = MPI.Intracomm.Mprobe
mpi_mprobe_obj = MPI.Intracomm.mprobe


def _needs_mpi4py_4(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("MPI_Isendrecv needs mpi4py >= 4 over an MPI-4 library")


mpi_isendrecv: Callable[..., MPI.Request] = getattr(MPI.Intracomm, "Isendrecv", _needs_mpi4py_4)
mpi_isendrecv_replace: Callable[..., MPI.Request] = getattr(
    MPI.Intracomm, "Isendrecv_replace", _needs_mpi4py_4)
mpi_sendrecv = MPI.Intracomm.Sendrecv
mpi_sendrecv_obj = MPI.Intracomm.sendrecv
mpi_barrier = MPI.Intracomm.Barrier
mpi_ibarrier = MPI.Intracomm.Ibarrier
mpi_free = MPI.Intracomm.Free
mpi_dup = MPI.Intracomm.Dup


def fill(status: MPI.Status, source: int, tag: int, nbytes: int) -> None:
    status.Set_source(source)
    status.Set_tag(tag)
    status.Set_elements(BYTE, nbytes)

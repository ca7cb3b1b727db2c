"""cma.mpi.Comm with CMA_XMAP=1: a heap buffer received on the node through xmap (a bare
array and a buffer spec) and as a view, and an object of heap arrays received with
views=True, counted by the node communicator's stats; with
CMA_MPI_NODES=0,1 (each rank a node of its own) the same calls through MPI, the view a
copy. Prints "OK <rank>"."""

import os

import numpy as np
from mpi4py import MPI

import cma
import cma.mpi

comm = cma.mpi.Comm(MPI.COMM_WORLD)
apart = bool(os.environ.get("CMA_MPI_NODES"))


def xmap_stats() -> dict:
    return {} if apart else comm._cma.stats()["xmap"]  # the node communicator's



def rts_to_engine(node: cma.Comm) -> list:
    """The sources of the RTSs that ``node``'s engine handles from now on (the direct
    rendezvous takes its RTS without the engine)."""
    from cma.wire import KIND_MASK, RTS
    engine = node._progress.engine
    handle = engine.packet
    seen: list = []

    def packet(source, kind, *rest):
        if kind & KIND_MASK == RTS:
            seen.append(source)
        return handle(source, kind, *rest)
    engine.packet = packet
    return seen


n = 8 << 20
if comm.Get_rank() == 1:
    a = cma.empty(n, np.uint8)
    a[:] = 7
    comm.Send(a, 0, 1)
    comm.Send([a, n, MPI.BYTE], 0, 2)
    comm.Send(a, 0, 3)  # returns once rank 0 released its view
    comm.Send(np.full(100, 3, np.uint8), 0, 4)  # eager: a view of a copy
    comm.recv(source=0, tag=7)  # (rank 0 watches its engine from now on)
    comm.Send(a, 0, 6)  # viewed with no status: the direct rendezvous's view, on the node
    b = cma.empty(n, np.uint8)
    b[:] = 5
    comm.send({"b": b}, 0, 5)  # on the node: returns once rank 0 dropped its view
    ok = True
else:
    buf = np.zeros(n, np.uint8)
    comm.Recv(buf, 1, 1)
    ok = bool((buf == 7).all())
    buf[:] = 0
    comm.Recv([buf, n, MPI.BYTE], 1, 2)
    ok = ok and bool((buf == 7).all())
    stats = xmap_stats()
    ok = ok and (apart or stats["messages"] == 2 and stats["user_copies"] == 1.0
                 and stats["cache_hits"] == 1)
    status = MPI.Status()
    with comm.recv_view(1, 3, status) as view:
        ok = ok and isinstance(view, cma.View) and bool((view == 7).all()) and view.size == n
        ok = ok and status.Get_source() == 1 and status.Get_count(MPI.BYTE) == n
    small = comm.recv_view(MPI.ANY_SOURCE, 4)
    ok = ok and bool((small == 3).all()) and not small.flags.writeable
    stats = xmap_stats()
    ok = ok and (apart or stats["messages"] == 3 and stats["user_copies"] == 2 / 3)
    rts_seen = [] if apart else rts_to_engine(comm._cma)
    comm.send("go", 1, 7)
    with comm.recv_view(1, 6) as view:
        ok = ok and not rts_seen  # (the direct rendezvous's view: no RTS through the engine)
        ok = ok and isinstance(view, cma.View) and bool((view == 7).all()) and view.size == n
    stats = xmap_stats()
    ok = ok and (apart or stats["messages"] == 4 and stats["user_copies"] == 2 / 4)
    # an object of heap arrays: views of rank 1's memory on the node, copies through MPI
    got = comm.recv(source=1, tag=5, views=True)
    ok = ok and bool((got["b"] == 5).all()) and got["b"].flags.writeable == apart
    stats = xmap_stats()
    ok = ok and (apart or stats["messages"] == 5 and stats["views_held"] >= 1)
    del got  # (rank 1's send returns once this view is gone and the Barrier moved the FIN)
comm.Barrier()
if ok:
    print(f"OK {comm.Get_rank()}", flush=True)

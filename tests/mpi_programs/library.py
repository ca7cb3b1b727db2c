"""Code written as a library would write it against mpi4py's ``MPI.Comm``, handed the plugin.

A task farm (the shape of process pools and samplers): the master hands out tasks as
objects and collects results by polling ``Iprobe(ANY_SOURCE, ...)`` with a status, then
receiving exactly what it found, buffers and objects mixed; workers take orders with
``recv(ANY_TAG, status)`` and answer with ``isend`` + ``wait``. Then a halo exchange of
a domain decomposition (``Sendrecv`` of NumPy rows) and a window of ``Irecv(ANY_SOURCE)``
drained with ``MPI.Request.Waitany``. Nothing here knows it talks to cma. Prints
"OK <rank>" at the end; run with 2 or more ranks.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import cma.mpi

TASK, STOP, RESULT, DATA = 1, 2, 3, 4


def task_farm(comm: MPI.Comm, tasks: int) -> None:
    """Rank 0 farms out ``tasks`` squarings; every answer comes back as an object and,
    for even tasks, a NumPy buffer too."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        todo = list(range(tasks))
        busy = 0
        for worker in range(1, size):
            if todo:
                comm.send(todo.pop(), dest=worker, tag=TASK)
                busy += 1
        results: dict[int, int] = {}
        status = MPI.Status()
        while busy:
            if not comm.Iprobe(MPI.ANY_SOURCE, RESULT, status):
                continue
            worker = status.Get_source()
            task, value = comm.recv(source=worker, tag=RESULT)
            if task % 2 == 0:
                array = np.empty(1000, dtype=np.int64)
                comm.Recv([array, MPI.INT64_T], source=worker, tag=DATA, status=status)
                assert status.Get_count(MPI.INT64_T) == 1000 and (array == value).all()
            results[task] = value
            if todo:
                comm.send(todo.pop(), dest=worker, tag=TASK)
            else:
                comm.send(None, dest=worker, tag=STOP)
                busy -= 1
        for worker in range(busy + 1, size):  # workers that never got a task
            if worker > tasks:
                comm.send(None, dest=worker, tag=STOP)
        assert results == {t: t * t for t in range(tasks)}, results
    else:
        status = MPI.Status()
        while True:
            task = comm.recv(source=0, tag=MPI.ANY_TAG, status=status)
            if status.Get_tag() == STOP:
                break
            comm.isend((task, task * task), dest=0, tag=RESULT).wait()
            if task % 2 == 0:
                comm.Send(np.full(1000, task * task, dtype=np.int64), dest=0, tag=DATA)


def halo_exchange(comm: MPI.Comm, steps: int) -> None:
    """A 1-D decomposition of a 2-D grid: each step trades boundary rows with both
    neighbours and relaxes; the result is compared with the same run on one rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows, cols = 8, 64
    grid = np.zeros((rows + 2, cols))
    grid[1:-1] = rank
    up, down = (rank - 1) % size, (rank + 1) % size
    for _ in range(steps):
        comm.Sendrecv(grid[1], dest=up, sendtag=5, recvbuf=grid[-1], source=down, recvtag=5)
        comm.Sendrecv(grid[-2], dest=down, sendtag=6, recvbuf=grid[0], source=up, recvtag=6)
        grid[1:-1] = (grid[:-2] + grid[2:] + 2 * grid[1:-1]) / 4
    whole = comm.gather(grid[1:-1], root=0)
    if rank == 0:
        reference = np.repeat(np.arange(size, dtype=float), rows)[:, None] * np.ones(cols)
        for _ in range(steps):
            padded = np.vstack([reference[-1:], reference, reference[:1]])
            reference = (padded[:-2] + padded[2:] + 2 * padded[1:-1]) / 4
        assert np.allclose(np.vstack(whole), reference)


def fan_in(comm: MPI.Comm) -> None:
    """Rank 0 posts a window of wildcard receives and drains it with Waitany.

    (MPI.Request.Waitany: with peers on rank 0's node and elsewhere, a wildcard receive
    takes off-node messages only inside cma.mpi's calls, so such a rank would wait for
    ever in MPI's; docs/mpi.md. test_mpi.py runs this on one node.)
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    per_peer = 3
    if rank == 0:
        buffers = [np.empty(2, dtype=np.int64) for _ in range((size - 1) * per_peer)]
        requests = [comm.Irecv(b, MPI.ANY_SOURCE, 7) for b in buffers]
        seen: dict[int, list[int]] = {}
        status = MPI.Status()
        for _ in requests:
            index = MPI.Request.Waitany(requests, status)
            source, k = buffers[index]
            assert source == status.Get_source()
            seen.setdefault(int(source), []).append(int(k))
        assert all(sorted(v) == list(range(per_peer)) for v in seen.values()), seen
        assert sorted(seen) == list(range(1, size))
    else:
        sends = [comm.Isend(np.array([rank, k], dtype=np.int64), 0, 7) for k in range(per_peer)]
        MPI.Request.Waitall(sends)


comm = cma.mpi.Comm(MPI.COMM_WORLD)
assert comm.Get_size() >= 2
task_farm(comm, tasks=25)
comm.Barrier()
halo_exchange(comm, steps=5)
comm.Barrier()
fan_in(comm)
comm.Barrier()
print(f"OK {comm.Get_rank()}", flush=True)

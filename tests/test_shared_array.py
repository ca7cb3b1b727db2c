"""cma.shared_array: one array in the root's heap, mapped by every rank of the world.

Worlds of 3 ranks: forked children of a fresh world (``run_ranks``, cheap), one
``cma-run -n 3`` program, and a ``cma.Pipe`` end handed to a forked child. Every world
has a deadline and its children are killed at the end (conftest).
"""

from __future__ import annotations

import errno
import gc
import multiprocessing as mp
import os
import textwrap

import numpy as np
import pytest
from conftest import run_ranks, stop_process
from test_run import cma_run

import cma
from cma import _linux, heap
from cma.errors import CmaError, InvalidRank
from cma.shared import _world_of
from cma.world import World

PAIR = np.dtype([("v", "f8"), ("i", "i4")])
# (shape, dtype, order): 0-size, a slab block, a segment of its own, Fortran, structured
LAYOUTS = [((0,), "f8", "C"), ((3, 0), "i4", "F"), ((5,), "u1", "C"), ((7, 11), "f4", "F"),
           ((300, 301), "i8", "C"), ((2, 3, 4), PAIR, "C"), ((), "c16", "C")]


def _fill(arr: np.ndarray) -> None:
    flat = arr.reshape(-1, order="A").view(np.uint8)
    flat[...] = np.arange(flat.size, dtype=np.uint64) * 7 % 251


def _expected(shape: tuple[int, ...], dtype: np.dtype, order: str) -> np.ndarray:
    arr = np.empty(shape, dtype, order)
    _fill(arr)
    return arr


def _heap_maps() -> int:
    """How many mappings of heap segments (memfds named cma-heap) this process has."""
    with open("/proc/self/maps") as f:
        return sum("memfd:cma-heap" in line for line in f)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------ ranks' functions

def _layouts(comm: cma.Comm) -> list[tuple[bytes, bool, bool, bool, str, tuple[int, ...]]]:
    """Rank 1 is the root; every rank reports what it got for each layout."""
    seen = []
    for shape, dtype, order in LAYOUTS:
        if comm.rank == 1:
            arr = cma.shared_array(comm, shape, dtype, root=1, order=order)
            assert not arr.any() if arr.dtype.fields is None else not arr.view(np.uint8).any()
            _fill(arr)
        else:  # the other ranks' shape, dtype and order are not used
            arr = cma.shared_array(comm, 0, root=1)
        comm.Barrier()
        seen.append((arr.tobytes(order="A"), arr.flags.writeable, arr.flags.f_contiguous,
                     cma.is_shared(arr), arr.dtype.str, arr.shape))
        comm.Barrier()  # the root's array lives until every rank has read it
    return seen


def _writes(comm: cma.Comm) -> list[object]:
    """Root 0 writes after a Barrier; rank 2 writes into a writable mapping."""
    arr = cma.shared_array(comm, 4, np.int64)
    ours = cma.shared_array(comm, 4, np.int64, writable=comm.rank == 2)
    seen: list[object] = []
    if comm.rank == 0:
        arr[:] = [1, 2, 3, 4]
    comm.Barrier()
    seen.append(arr.tolist())
    comm.Barrier()  # everyone has read before the root writes again
    if comm.rank == 0:
        arr[0] = 10
    comm.Barrier()
    seen.append(arr.tolist())
    if comm.rank == 2:
        ours[:] = 5
    comm.Barrier()
    seen.append(ours.tolist())
    if comm.rank == 1:
        try:
            arr[1] = 0
            seen.append("written")
        except ValueError:
            try:
                arr.flags.writeable = True
                seen.append("made writable")
            except ValueError:
                seen.append("refused")
    comm.Barrier()
    return seen


def _released(comm: cma.Comm) -> list[tuple[int, int]]:
    """(fds, heap mappings) before, while the array lives, and after it is dropped."""
    _world_of(comm)
    comm.transports()  # connect every peer first: attaching and connecting open fds of their own
    gc.collect()
    counts = [(_fds(), _heap_maps())]
    arr = cma.shared_array(comm, 1 << 20, np.uint8)  # a segment of its own
    counts.append((_fds(), _heap_maps()))
    comm.Barrier()
    del arr
    gc.collect()
    counts.append((_fds(), _heap_maps()))
    comm.Barrier()
    return counts


def _no_alias(comm: cma.Comm) -> list[list[int]]:
    """The root drops a small and a large shared array while the others keep them; its
    next arrays of those sizes must not take the same memory, and the others' pages must
    stay valid."""
    small = cma.shared_array(comm, 16, np.int32, writable=True)  # a slab block
    large = cma.shared_array(comm, 1 << 18, np.int32, writable=True)  # a segment of its own
    if comm.rank == 0:
        small[:] = 7
        large[:] = 8
        del small, large
        gc.collect()
        fresh = [cma.zeros(16, np.int32) for _ in range(4)] + [cma.zeros(1 << 18, np.int32)]
        for a in fresh:
            a[:] = -1
        comm.Barrier()
        comm.Barrier()
        return []
    comm.Barrier()
    result = [sorted(set(small.tolist())), sorted(set(large.tolist()))]
    comm.Barrier()
    return result


def _root_fails(comm: cma.Comm) -> str:
    try:
        cma.shared_array(comm, (-1,) if comm.rank == 0 else 3)
    except ValueError as exc:
        return f"ValueError: {exc}"
    except CmaError as exc:
        return f"CmaError: {exc}"
    return "no error"


def _exposed_after(comm: cma.Comm) -> list[str]:
    arr = cma.shared_array(comm, 10)
    comm.Barrier()
    names = [n for n in _world_of(comm)._exposed if n.startswith("shared-")]
    del arr
    return names


def _fd_paths(comm: cma.Comm) -> str:
    """Make one array and say how the fd reached this rank ("pidfd_getfd" or "fd server")."""
    world = _world_of(comm)
    comm.transports()  # connect every peer first: connecting fetches fds (vmfd, doorbells)
    refused = comm.rank and _linux.cma_access_errno(world.pid_of(0)) == errno.EPERM
    used = ["ptrace refused"] if refused else []
    take, fetch = _linux.pidfd_getfd, World.fetch_fd

    def counted_take(pidfd: int, fd: int) -> int:
        got = take(pidfd, fd)
        used.append("pidfd_getfd")
        return got

    def counted_fetch(self: World, peer: int, name: str) -> int:
        used.append("fd server")
        return fetch(self, peer, name)

    _linux.pidfd_getfd = counted_take  # type: ignore[assignment]
    World.fetch_fd = counted_fetch  # type: ignore[method-assign]
    arr = cma.shared_array(comm, 1000, np.int16)
    if comm.rank == 0:
        arr[:] = 3
    comm.Barrier()
    assert (arr == 3).all()
    comm.Barrier()
    return ",".join(used) if comm.rank else "root"


def _refuse(pidfd: int, fd: int) -> int:
    raise PermissionError(errno.EPERM, "ptrace rules refuse (as under Yama scope 1)")


# ------------------------------------------------------------------ tests

def test_every_layout_reaches_every_rank() -> None:
    results = run_ranks("auto", None, [_layouts] * 3, timeout=60)
    for i, (shape, dtype, order) in enumerate(LAYOUTS):
        want = _expected(shape, np.dtype(dtype), order)
        for rank, seen in enumerate(results):
            data, writeable, f_contiguous, shared, dtype_str, got_shape = seen[i]
            assert data == want.tobytes(order="A"), (rank, shape, dtype)
            assert got_shape == shape and dtype_str == want.dtype.str
            assert writeable == (rank == 1), (rank, shape)
            assert f_contiguous == want.flags.f_contiguous, (rank, shape, order)
            assert shared


def test_writes_after_a_barrier_are_seen_and_read_only_is_enforced() -> None:
    results = run_ranks("auto", None, [_writes] * 3, timeout=60)
    for seen in results:
        assert seen[:3] == [[1, 2, 3, 4], [10, 2, 3, 4], [5, 5, 5, 5]]
    assert results[1][3] == "refused"  # neither a write nor making it writable goes through


def test_no_fd_or_mapping_is_left_after_the_array_is_dropped() -> None:
    for rank, (before, alive, after) in enumerate(run_ranks("auto", None, [_released] * 3,
                                                            timeout=60)):
        assert after == before, f"rank {rank}: (fds, heap mappings) {before} -> {after}"
        assert alive[1] == before[1] + 1, f"rank {rank} does not map the array: {alive}"


def test_memory_the_root_dropped_stays_valid_and_unaliased() -> None:
    results = run_ranks("auto", None, [_no_alias] * 3, timeout=60)
    assert results[1] == results[2] == [[7], [8]]


def test_a_root_that_fails_fails_every_rank() -> None:
    results = run_ranks("auto", None, [_root_fails] * 3, timeout=60)
    assert results[0].startswith("ValueError: negative dimensions")
    for text in results[1:]:
        assert text.startswith("CmaError: rank 0 (root) could not make the array"), text


def test_the_fd_is_exposed_only_during_the_call() -> None:
    assert run_ranks("auto", None, [_exposed_after] * 3, timeout=60) == [[], [], []]


def test_bad_arguments_are_refused_before_any_message() -> None:
    a, b = cma.Pipe()
    try:
        with pytest.raises(TypeError, match="cma.Comm or a cma.mpi.Comm"):
            cma.shared_array(object(), 3)
        with pytest.raises(InvalidRank):
            cma.shared_array(a, 3, root=2)
        with pytest.raises(ValueError, match="order"):
            cma.shared_array(a, 3, order="K")
    finally:
        a.close()
        b.close()


def _pipe_child(end: cma.Comm) -> None:
    arr = cma.shared_array(end, None)
    end.Barrier()
    end.send(arr.sum(), 0)
    end.Barrier()
    end.close()


def test_pipe() -> None:
    a, b = cma.Pipe()
    proc = mp.get_context("fork").Process(target=_pipe_child, args=(b,))
    proc.start()
    try:
        arr = cma.shared_array(a, (1000,), np.float32)
        arr[:] = 0.5
        a.Barrier()
        assert a.recv(source=1) == 500.0
        a.Barrier()
        assert heap.locate(arr) is not None
    finally:
        a.close()
        b.close()
        stop_process(proc, 10.0)
    assert proc.exitcode == 0


RUN_PROGRAM = """
    import os, sys
    import numpy as np
    import cma

    comm = cma.COMM_WORLD
    table = cma.shared_array(comm, (256, 3), np.float64, root=2)
    if comm.rank == 2:
        table[:] = np.arange(table.size).reshape(table.shape)
    comm.Barrier()
    ok = float(table.sum()) == float(np.arange(768).sum())
    comm.Barrier()  # every rank has read before the root writes again
    try:
        table[0, 0] = 1.0
        ok = ok and comm.rank == 2
    except ValueError:
        ok = ok and comm.rank != 2
    comm.Barrier()
    with open(os.path.join(sys.argv[1], f"rank{comm.rank}"), "w") as f:
        f.write("ok" if ok else "bad")
"""


def test_cma_run_world_of_three(tmp_path) -> None:
    code, out, err, _ = cma_run(["-n", "3"], textwrap.dedent(RUN_PROGRAM), tmp_path, timeout=90)
    assert code == 0, err
    assert [(tmp_path / f"rank{r}").read_text() for r in range(3)] == ["ok"] * 3


def test_the_fd_comes_by_pidfd_getfd_where_ptrace_allows() -> None:
    paths = run_ranks("auto", None, [_fd_paths] * 3, timeout=60)
    if any(path.startswith("ptrace refused") for path in paths):
        pytest.skip("ptrace rules (Yama) refuse the ranks access to the root: no pidfd_getfd")
    assert paths == ["root", "pidfd_getfd", "pidfd_getfd"]


def test_the_fd_server_serves_when_ptrace_rules_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_linux, "pidfd_getfd", _refuse)  # the forked ranks inherit it
    paths = run_ranks("auto", None, [_fd_paths] * 3, timeout=60)
    assert [path.removeprefix("ptrace refused,") for path in paths] == \
        ["root", "fd server", "fd server"]

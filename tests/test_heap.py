"""The shared heap (cma/heap.py): allocation, reuse, giving back, fork, and passing by handle.

Every multi-process test joins its children with a timeout and checks that no heap
segment fd is left open in this process once the arrays are gone.
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
from conftest import stop_process

import cma
from cma import heap

JOIN_TIMEOUT = 30.0


def heap_files() -> set[int]:
    """Heap segments this process holds open, by inode (each may be open through two fds)."""
    files = set()
    for name in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{name}"
        try:
            if os.readlink(path).startswith("/memfd:cma-heap"):
                files.add(os.stat(path).st_ino)
        except OSError:  # the fd listdir itself used, closed since
            pass
    return files


def address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


@pytest.fixture
def no_fd_left() -> Iterator[None]:
    gc.collect()
    heap.HEAP.trim()
    before = heap_files()
    yield
    gc.collect()
    heap.HEAP.trim()  # gives back the empty slabs kept for reuse
    assert heap_files() <= before, "a heap segment's fd outlived its arrays"


# ---------------------------------------------------------------- allocation

@pytest.mark.parametrize("nbytes", [0, 1, 100, heap.LARGEST_BLOCK, heap.LARGEST_BLOCK + 1, 5 << 20])
def test_arrays_of_every_size_are_in_the_heap(nbytes: int, no_fd_left: None) -> None:
    arr = cma.alloc(nbytes)
    assert arr.shape == (nbytes,) and arr.dtype == np.uint8 and cma.is_shared(arr)
    arr[:] = 0xAB
    assert (arr == 0xAB).all()
    if nbytes:
        assert cma.is_shared(arr[1:]) and cma.is_shared(memoryview(arr)) and cma.is_shared(arr[::-1])
        found = heap.locate(arr)
        assert found is not None and found.segment.kind == ("own" if nbytes > heap.LARGEST_BLOCK else "slab")


def test_the_numpy_constructors_keep_their_meaning(no_fd_left: None) -> None:
    a = cma.empty((3, 4), dtype=np.int32, order="F")
    assert a.shape == (3, 4) and a.dtype == np.int32 and a.flags.f_contiguous
    like = cma.empty_like(a)
    assert like.shape == a.shape and like.dtype == a.dtype and like.flags.f_contiguous
    assert cma.empty_like(np.zeros(5), dtype=np.float32).dtype == np.float32
    assert cma.empty(7).dtype == np.float64
    dirty = cma.empty(100)
    dirty[:] = 1.5
    del dirty  # its block goes back to the free list and is handed out next
    clean = cma.zeros(100)
    assert (clean == 0).all()
    assert not cma.is_shared(np.zeros(10)) and not cma.is_shared(b"bytes")
    with pytest.raises(TypeError, match="Python objects"):
        cma.empty(3, dtype=object)
    with pytest.raises(ValueError, match="order"):
        cma.empty(3, order="K")
    with pytest.raises(ValueError, match="negative"):
        cma.empty((2, -1))


def test_a_block_is_reused_only_after_its_last_view_is_gone(no_fd_left: None) -> None:
    first = cma.alloc(1000)
    where = address(first)
    view = first[10:]
    del first
    other = cma.alloc(1000)
    assert address(other) != where, "a block was handed out while a view of it lived"
    del view
    again = cma.alloc(1000)
    assert address(again) == where
    del other, again


def test_a_full_slab_gets_a_second_and_takes_blocks_again_once_freed(no_fd_left: None) -> None:
    per_slab = heap.SLAB_BYTES // heap.LARGEST_BLOCK
    first = [cma.alloc(heap.LARGEST_BLOCK) for _ in range(per_slab)]
    segments = {heap.locate(a).segment for a in first}
    assert len(segments) == 1
    extra = cma.alloc(heap.LARGEST_BLOCK)
    assert heap.locate(extra).segment not in segments
    where = address(first[3])
    first[3][:] = 9
    del first[3]
    again = cma.zeros(heap.LARGEST_BLOCK, dtype=np.uint8)
    assert address(again) == where and not again.any()
    del first, extra, again


def test_a_segment_given_back_closes_its_fd_and_its_index_gets_a_new_generation(no_fd_left: None) -> None:
    before = heap_files()
    big = cma.empty(8 << 20, dtype=np.uint8)
    found = heap.locate(big)
    assert found is not None and found.offset == 0 and len(heap_files() - before) == 1
    where = address(big)
    del big
    assert heap_files() == before and heap.HEAP.locate(where) is None
    again = heap.locate(cma.empty(8 << 20, dtype=np.uint8))
    assert again is not None and again.segment.index == found.segment.index
    assert again.segment.generation > found.segment.generation


# ---------------------------------------------------------------- fork

def _child_writes_and_allocates(arr: np.ndarray, conn: mp.connection.Connection) -> None:
    arr[:] = 42
    mine = cma.alloc(1000)
    mine[:] = 0x55
    conn.send("done")
    conn.close()


def test_a_forked_child_shares_the_parents_arrays_but_not_its_free_blocks(no_fd_left: None) -> None:
    shared = cma.zeros(1000, dtype=np.int64)
    freed = cma.zeros(1000, dtype=np.uint8)
    free_block = address(freed)
    del freed  # on the parent's free list when the child is forked
    ctx = mp.get_context("fork")
    recv_end, send_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_writes_and_allocates, args=(shared, send_end))
    child.start()
    send_end.close()
    try:
        assert recv_end.poll(JOIN_TIMEOUT), "the child did not answer"
        assert recv_end.recv() == "done"
    finally:
        stop_process(child, JOIN_TIMEOUT)
        recv_end.close()
    assert child.exitcode == 0
    assert (shared == 42).all(), "the child's writes did not reach the parent"
    mine = cma.alloc(1000)
    assert address(mine) == free_block
    assert not mine.any(), "the child allocated a block the parent had free and hands out now"


# ---------------------------------------------------------------- by handle through multiprocessing

def _fill(arr: np.ndarray) -> tuple[bool, float]:
    """In a worker: the array is a heap mapping; write through it."""
    arr[...] = 3
    return cma.is_shared(arr), float(arr.sum())


def _make(n: int) -> np.ndarray:
    out = cma.empty(n, dtype=np.int16)
    out[:] = np.arange(n, dtype=np.int16)
    return out


def _check_pool_results(big: np.ndarray, view: np.ndarray, results: list, made: np.ndarray) -> None:
    assert results[0] == (True, 3.0 * big.size) and results[1] == (True, 3.0 * view.size)
    assert (big == 3).all(), "a write in the worker did not reach the parent: the array was copied"
    assert (view == 3).all()
    assert cma.is_shared(made) and (made == np.arange(made.size, dtype=np.int16)).all()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_pool_worker_gets_the_parents_memory_not_a_copy(context: str, no_fd_left: None) -> None:
    big = cma.zeros(3 << 20, dtype=np.uint8)
    small = cma.zeros((40, 30), dtype=np.float32)
    view = small[::-2, ::3]  # a strided view of a slab block
    pool = mp.get_context(context).Pool(1)
    try:
        results = pool.map(_fill, [big, view])
        made = pool.apply(_make, (5000,))  # a result allocated in the worker's heap
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    _check_pool_results(big, view, results, made)
    assert (small[::2] == 0).all() and (small[1::2, 1::3] == 0).all(), "the worker wrote outside the view"
    assert not mp.active_children()
    del big, small, view, made


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_process_pool_executor_passes_arrays_by_handle(context: str, no_fd_left: None) -> None:
    big = cma.zeros(1 << 20, dtype=np.float64)
    view = big[::1000]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context(context)) as pool:
        results = list(pool.map(_fill, [big, view]))
        made = pool.submit(_make, 300).result(timeout=JOIN_TIMEOUT)
    _check_pool_results(big, view, results, made)
    assert not mp.active_children()
    del big, view, made


def _echo_doubled(queue_in: mp.Queue, queue_out: mp.Queue, argument: np.ndarray) -> None:
    argument[:] = 5  # an argument of a spawned Process travels by handle too
    arr = queue_in.get(timeout=JOIN_TIMEOUT)
    arr *= 2
    queue_out.put(arr)
    queue_in.get(timeout=JOIN_TIMEOUT)  # the fd is fetched from this process: stay until it is


def test_a_queue_carries_a_handle_both_ways(no_fd_left: None) -> None:
    ctx = mp.get_context("spawn")
    queue_in, queue_out = ctx.Queue(), ctx.Queue()
    argument = cma.zeros(1000, dtype=np.uint8)
    child = ctx.Process(target=_echo_doubled, args=(queue_in, queue_out, argument))
    child.start()
    try:
        arr = cma.empty(1 << 19, dtype=np.int32)
        arr[:] = 21
        queue_in.put(arr)
        back = queue_out.get(timeout=JOIN_TIMEOUT)
        queue_in.put(None)
    finally:
        stop_process(child, JOIN_TIMEOUT)
        for queue in (queue_in, queue_out):
            queue.close()
            queue.join_thread()
    assert (arr == 42).all() and cma.is_shared(back) and (argument == 5).all()
    back[0] = 7  # the same pages, mapped twice in this process
    assert arr[0] == 7
    del arr, back, argument


def test_the_handle_keeps_layout_and_read_only_flag(no_fd_left: None) -> None:
    base = cma.zeros((6, 8), dtype=np.int64, order="F")
    base.flat = np.arange(48)
    for view in (base, base[::-1, 1::3], base.T, base[2:4]):
        copy = ForkingPickler.loads(ForkingPickler.dumps(view))
        assert copy.shape == view.shape and copy.strides == view.strides
        assert (copy == view).all() and address(copy) != address(view)
        copy[...] = -1  # mapped again, the same memory
        assert (view == -1).all()
        base.flat = np.arange(48)
    frozen = base[1:3]
    frozen.flags.writeable = False
    assert not ForkingPickler.loads(ForkingPickler.dumps(frozen)).flags.writeable
    plain = np.arange(5)
    again = ForkingPickler.loads(ForkingPickler.dumps(plain))
    again[0] = 99  # a non-heap array still travels by value
    assert plain[0] == 0 and not cma.is_shared(again)
    del base, frozen, view, copy


def test_a_block_whose_handle_went_out_is_never_handed_out_again(no_fd_left: None) -> None:
    arr = cma.alloc(3000)
    received = ForkingPickler.loads(ForkingPickler.dumps(arr))
    del arr
    fresh = [cma.zeros(3000, dtype=np.uint8) for _ in range(4)]
    received[:] = 1  # the block lives on in this mapping of it
    assert not any(a.any() for a in fresh), "a block still mapped elsewhere was handed out again"
    del received, fresh


def _fd_of_imported(arr: np.ndarray) -> bool:
    """In a worker: whether the fd behind a received array would survive an exec."""
    found = heap.locate(arr)
    assert found is not None and found.segment.kind == "imported"
    return os.get_inheritable(found.segment.fd)


def test_a_received_segment_fd_is_close_on_exec(no_fd_left: None) -> None:
    arr = cma.zeros(1 << 20, dtype=np.uint8)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        assert pool.submit(_fd_of_imported, arr).result(timeout=JOIN_TIMEOUT) is False
    del arr


def test_threads_allocating_and_freeing_never_share_a_block(no_fd_left: None) -> None:
    """Frees run in whichever thread drops the last view, often while another holds the
    heap's lock (they are then left to the lock holder): no block may be handed out twice."""
    errors: list[str] = []

    def churn(mark: int) -> None:
        live: list[np.ndarray] = []
        for i in range(1500):
            arr = cma.empty(16 + i % 200, dtype=np.int64)
            arr[:] = mark
            live.append(arr)
            if len(live) > 20:
                gone = live.pop(i % len(live))
                if (gone != mark).any():
                    errors.append(f"thread {mark}: a live array was overwritten")
                del gone
        for arr in live:
            if (arr != mark).any():
                errors.append(f"thread {mark}: a live array was overwritten")

    threads = [threading.Thread(target=churn, args=(mark,)) for mark in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs (a deadlock in the heap?)"
    assert not errors, errors[:3]


def test_a_free_that_finds_the_heap_locked_by_its_own_thread_is_done_later(no_fd_left: None) -> None:
    """A garbage collection inside the heap's locked section frees arrays in the thread
    that holds the lock: the free must wait for the lock's release, not deadlock."""
    arr = cma.alloc(500)
    where = address(arr)
    box = [arr]
    del arr
    left_for_later: list[bool] = []

    def drop_while_locked() -> None:
        with heap.HEAP._lock:
            box.clear()  # the last view goes: the finalizer runs here, in this thread
            left_for_later.append(bool(heap.HEAP._pending))
        heap.HEAP.locate(0)  # the next heap call does it

    thread = threading.Thread(target=drop_while_locked, daemon=True)  # daemon: a deadlock must not hang exit
    thread.start()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive(), "the free deadlocked on the heap's lock"
    assert left_for_later == [True] and not heap.HEAP._pending
    assert address(cma.alloc(500)) == where

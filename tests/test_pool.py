"""cma/_pool.py: one executor per process, however many threads ask first, and after fork."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from _peers import run_in_child

from cma import _pool
from cma._pool import ProcessPool

pytestmark = pytest.mark.timeout(60)


def test_threads_asking_at_once_share_one_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[ThreadPoolExecutor] = []

    def slow_executor(*args: Any, **kwargs: Any) -> ThreadPoolExecutor:
        time.sleep(0.05)  # widen the window in which an unlocked get() would make another
        made.append(ThreadPoolExecutor(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_pool, "ThreadPoolExecutor", slow_executor)
    pool = ProcessPool(1, "test-pool")
    start = threading.Barrier(8)
    got: list[ThreadPoolExecutor] = []

    def ask() -> None:
        start.wait()
        got.append(pool.get())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(made) == 1 and got == made * 8
    assert pool.shutdown()


def test_child_forked_while_another_thread_holds_the_lock_can_use_the_pool() -> None:
    pool = ProcessPool(1, "test-pool")
    with pool._lock:  # as if another thread were inside get() at the fork
        pid_and_answer = run_in_child(lambda: (os.getpid(), pool.get().submit(lambda: 42).result(5)),
                                      timeout=20)
    assert pid_and_answer[1] == 42 and pid_and_answer[0] != os.getpid()
    assert not pool.shutdown()  # nothing was made in this process

"""A thread pool that belongs to one process.

A ``ThreadPoolExecutor`` inherited through fork has no threads: work submitted to it in
the child would never run. ``ProcessPool`` makes its executor on first use in each
process and shuts down only one made in the calling process.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

_pools: weakref.WeakSet[ProcessPool] = weakref.WeakSet()


class ProcessPool:
    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0
        # the main thread and overlap's copy thread may both make the first call
        self._lock = threading.Lock()
        _pools.add(self)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid():
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
                self._pid = os.getpid()
            return self._executor

    def shutdown(self) -> bool:
        """Wait for this process's submitted work; True if there was a pool to shut down."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is None or self._pid != os.getpid():
            return False
        executor.shutdown(wait=True)
        return True


def _after_fork_in_child() -> None:
    # a fork taken while another thread held a pool's lock would leave it held forever
    for pool in list(_pools):
        pool._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

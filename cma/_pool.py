"""A thread pool that belongs to one process.

A ``ThreadPoolExecutor`` inherited through fork has no threads: work submitted to it in
the child would never run. ``ProcessPool`` makes its executor on first use in each
process and shuts down only one made in the calling process.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor


class ProcessPool:
    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0

    def get(self) -> ThreadPoolExecutor:
        if self._executor is None or self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            self._pid = os.getpid()
        return self._executor

    def shutdown(self) -> bool:
        """Wait for this process's submitted work; True if there was a pool to shut down."""
        executor, self._executor = self._executor, None
        if executor is None or self._pid != os.getpid():
            return False
        executor.shutdown(wait=True)
        return True

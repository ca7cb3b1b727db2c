"""``overlap=True``: pulls that run on a copy thread while the caller computes.

The thread copies inside a system call (process_vm_readv, preadv), where it does not
need the GIL; the rank completes the pulls, in order, in its next pass of progress.
docs/architecture.md ("Where this departs from DESIGN.md") says why a thread pool.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ._pool import ProcessPool
from .protocol import Pull


class BackgroundPulls:
    """The pulls started on the copy thread and not completed yet, oldest first."""

    def __init__(self, wake: Callable[[Future[None]], None]) -> None:
        """``wake`` runs on the copy thread when a pull ends (it rings our doorbell)."""
        self._copier = ProcessPool(1, "cma-pull")
        self._pending: deque[tuple[Future[None], Pull]] = deque()
        self._wake = wake

    def __bool__(self) -> bool:
        return bool(self._pending)

    def start(self, read: Callable[[], None], action: Pull) -> None:
        """Run ``read`` (the copy ``action`` asks for) on the copy thread."""
        started = threading.Event()

        def copy() -> None:
            started.set()
            read()

        future = self._copier.get().submit(copy)
        future.add_done_callback(self._wake)
        self._pending.append((future, action))
        if len(self._pending) == 1:
            # Return once the thread runs: it needs the GIL to start the copy, and caller
            # code computing in Python would keep it for a switch interval (5 ms); inside
            # the system call it no longer needs it. (Behind an earlier pull, waiting
            # would mean waiting for that copy.)
            started.wait()

    def finished(self) -> Iterator[Pull]:
        """Take out the pulls that are done, in order (stopping at one still running).

        A pull that failed with an exception is finished too, its receive holding the
        error: it fails in Wait/Test, not whichever call is here, and FIN still releases
        the sender, as for a truncated message.
        """
        pending = self._pending
        while pending and pending[0][0].done():
            future, action = pending.popleft()
            error = future.exception()
            if isinstance(error, Exception):
                action.op.error = error
            elif error is not None:
                raise error
            yield action

    def shutdown(self) -> bool:
        """Wait for the copy thread's work; True if there was a thread in this process."""
        return self._copier.shutdown()

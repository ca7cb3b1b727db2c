"""Ctrl-C inside MPI's own waits: a KeyboardInterrupt when MPI returns, as plain mpi4py has it.

A rank blocked in ``MPI.Request.Waitall`` (or any MPI function that waits) on cma's
requests runs Python only in the callbacks MPI makes into cma: the progress hook
(``libmpi``) and a generalized request's query. Python raises a signal's
``KeyboardInterrupt`` at the first bytecode it runs after the signal, so a Ctrl-C there
came out of a callback, where nothing may unwind into C: ctypes printed it as an
"Exception ignored" and dropped it, and the wait went on as if no key had been pressed.
Plain mpi4py raises it as soon as MPI returns.

So once cma.mpi has a hook in MPI's loop, SIGINT's handler (if it is still Python's
default) defers an interrupt that lands in one of those callbacks: a helper thread sends
SIGINT again every 0.2 ms until one lands outside them, in the caller's code once
MPI has returned, where it raises ``KeyboardInterrupt``. Anywhere else the handler
raises at once, as the default one does. docs/reliability.md has the test.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

RESEND_SECONDS = 2e-4  # at most how late after MPI returns the interrupt comes (and a sleep)


class DeferredInterrupt:
    """SIGINT's handler while MPI may call back into cma (one per process)."""

    def __init__(self) -> None:
        self._callbacks: set[CodeType] = set()
        self._owed = False  # a SIGINT landed in a callback and was not raised yet
        self._lock = threading.Lock()  # (so that no SIGINT is sent once the owed one is raised)
        self.installed = False

    def install(self, *callbacks: Callable[..., Any]) -> None:
        """Defer SIGINTs that land in ``callbacks`` (functions MPI calls, and what they
        call), if SIGINT still has Python's default handler and this is the main thread
        (a program's own handler, or SIG_IGN, is left to decide)."""
        self._callbacks.update(callback.__code__ for callback in callbacks)
        if self.installed or threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        signal.signal(signal.SIGINT, self._on_sigint)
        self.installed = True

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Python's default handler, unless ``frame`` runs inside one of the callbacks."""
        callbacks = self._callbacks
        inside = frame
        while inside is not None:
            if inside.f_code in callbacks:
                with self._lock:
                    if not self._owed:
                        self._owed = True
                        threading.Thread(target=self._resend, name="cma-mpi-sigint",
                                         daemon=True).start()
                return
            inside = inside.f_back
        with self._lock:
            self._owed = False
        signal.default_int_handler(signum, frame)

    def _resend(self) -> None:
        main = threading.main_thread().ident
        assert main is not None
        while True:
            time.sleep(RESEND_SECONDS)
            with self._lock:
                if not self._owed:
                    return
                signal.pthread_kill(main, signal.SIGINT)


DEFERRED = DeferredInterrupt()

"""The MPI library's progress loop, reached through ctypes: a hook that runs cma's progress.

cma.mpi's requests are MPI generalized requests, so that every mpi4py function taking
requests (``MPI.Request.Waitall`` and the rest) takes them. MPI completes such a request
only when told to, and a rank blocked in ``MPI_Waitall`` runs none of its own Python:
this hook has the MPI library call back into cma from its progress loop, where cma
moves its messages and completes the requests they finish. MPICH offers
``MPIX_Async_start`` for it; Open MPI's ``opal_progress_register`` (libopen-pal) is
internal but exported, and has kept its signature since Open MPI 1.x. docs/mpi.md
says what it costs.

The callback must not call an MPI function that progresses (MPICH holds a lock of its
progress loop while it runs, and aborts on a second one): it moves cma's rings, calls
``MPI_Grequest_complete``, posts sends (``MPI_Isend``, which does not progress) and asks
whether a request is active with ``MPIX_Request_is_complete`` (which does not either).
"""

from __future__ import annotations

import atexit
import ctypes
import re
import threading
from collections.abc import Callable

from mpi4py import MPI

# MPICH's mpi.h: MPIX_STREAM_NULL and enum MPIX_Async_status
MPICH_STREAM_NULL = 0x3C000000
ASYNC_NOPROGRESS = 0
ASYNC_DONE = 1

_MPICH_POLL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)  # int poll(MPIX_Async_thing)
_OPAL_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)  # int callback(void)


def _loaded_library(pattern: str) -> str | None:
    """The path of the shared library this process has mapped whose name matches."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if re.search(pattern, path.rsplit("/", 1)[-1]):
                return path
    return None


class ProgressHook:
    """Calls ``poll`` from inside the MPI library's progress loop while armed.

    ``poll()`` returns whether work is left; the hook stays armed until it says no.
    Only the thread that made the hook is served (a communicator is used by one
    thread at a time), and never re-entered.
    """

    def __init__(self, poll: Callable[[], bool]) -> None:
        self._poll = poll
        self._thread = threading.get_ident()
        self._running = False
        self._armed = False
        self._closed = False
        self.error: BaseException | None = None  # what poll raised, for the next caller

    def _call(self) -> bool:
        """Run poll once; whether to stay armed."""
        if self._closed:
            return False
        if self._running or threading.get_ident() != self._thread:
            return True
        self._running = True
        try:
            return self._poll()
        except BaseException as exc:  # noqa: BLE001 - nothing may unwind into C
            self.error = exc
            return True
        finally:
            self._running = False

    def arm(self) -> None:
        """Have the MPI library call ``poll`` from its progress loop (until ``poll`` says to stop)."""
        raise NotImplementedError

    def active(self, request: MPI.Request) -> bool:
        """Whether a persistent request was started and is not complete (MPI's Startall
        starts ours without telling us), asked without progressing MPI; False where the
        library offers no such question (then only our own Start is seen)."""
        return False

    def rest(self) -> None:
        """Nothing is pending now: stop calling back where that costs a call per progress."""

    def close(self) -> None:
        """Never call ``poll`` again (at exit, before MPI_Finalize)."""
        self._closed = True


class MpichHook(ProgressHook):
    """MPIX_Async_start: MPICH polls the thing until it returns MPIX_ASYNC_DONE."""

    def __init__(self, poll: Callable[[], bool], lib: ctypes.CDLL) -> None:
        super().__init__(poll)
        self._start = lib.MPIX_Async_start
        self._start.argtypes = [_MPICH_POLL, ctypes.c_void_p, ctypes.c_int]
        self._start.restype = ctypes.c_int
        self._is_complete = lib.MPIX_Request_is_complete  # tells without progressing MPI,
        self._is_complete.argtypes = [ctypes.c_int]        # which its callbacks may not do
        self._is_complete.restype = ctypes.c_int
        self._stream_progress = lib.MPIX_Stream_progress
        self._stream_progress.argtypes = [ctypes.c_int]
        self._stream_progress.restype = ctypes.c_int
        self._callback = _MPICH_POLL(self._async_poll)  # kept: C holds the pointer

    def _async_poll(self, _thing: int | None) -> int:
        if self._call():
            return ASYNC_NOPROGRESS
        self._armed = False
        return ASYNC_DONE

    def arm(self) -> None:
        """``MPIX_Async_start`` the hook unless it is armed already (MPICH drops it when ``poll`` says
        done)."""
        if not self._armed and not self._closed:
            if self._start(self._callback, None, MPICH_STREAM_NULL) != 0:
                raise RuntimeError("MPIX_Async_start failed")
            self._armed = True

    def active(self, request: MPI.Request) -> bool:
        """``MPIX_Request_is_complete``, negated: MPICH answers without progressing MPI."""
        return not self._is_complete(ctypes.c_int(request.handle & 0xFFFFFFFF).value)

    def close(self) -> None:
        """Let MPICH drop the hook now: MPI_Finalize, which would otherwise poll it, runs
        after the interpreter is gone (mpi4py finalizes from Py_AtExit)."""
        super().close()
        while self._armed:
            self._stream_progress(MPICH_STREAM_NULL)


class OpenMpiHook(ProgressHook):
    """opal_progress_register: called on every opal_progress until unregistered, which it
    does itself once ``poll`` says no."""

    def __init__(self, poll: Callable[[], bool], lib: ctypes.CDLL) -> None:
        super().__init__(poll)
        self._register = lib.opal_progress_register
        self._unregister = lib.opal_progress_unregister
        for function in (self._register, self._unregister):
            function.argtypes = [_OPAL_CALLBACK]
            function.restype = ctypes.c_int
        self._callback = _OPAL_CALLBACK(self._progress)

    def _progress(self) -> int:
        if not self._call() and self._armed:
            # Open MPI lets a callback unregister itself (its walk rereads the array); left
            # registered, every opal_progress paid a call into Python (docs/mpi.md, "Requests")
            self._unregister(self._callback)
            self._armed = False
        return 0  # events progressed: opal only sums them

    def arm(self) -> None:
        """``opal_progress_register`` the hook unless it is registered already."""
        if not self._armed and not self._closed:
            if self._register(self._callback) != 0:
                raise RuntimeError("opal_progress_register failed")
            self._armed = True

    def rest(self) -> None:
        """``opal_progress_unregister`` the hook (not from inside Open MPI's walk of its callbacks)."""
        if self._armed and not self._running:  # not from inside the callback list's walk
            self._unregister(self._callback)
            self._armed = False

    def close(self) -> None:
        """Unregister, then never call ``poll`` again."""
        self.rest()
        super().close()


# the functions through which MPI's progress loop enters Python
HOOK_CALLBACKS = (MpichHook._async_poll, OpenMpiHook._progress)


def make_hook(poll: Callable[[], bool]) -> ProgressHook | None:
    """A progress hook into the MPI library mpi4py loaded, or None where none is known."""
    version = MPI.Get_library_version()
    hook: ProgressHook | None = None
    if version.startswith("MPICH"):
        path = _loaded_library(r"^libmpi(ch)?\.so")
        lib = ctypes.CDLL(path) if path is not None else None
        if lib is not None and all(hasattr(lib, name) for name in (
                "MPIX_Async_start", "MPIX_Stream_progress", "MPIX_Request_is_complete")):
            hook = MpichHook(poll, lib)
    elif version.startswith("Open MPI"):
        path = _loaded_library(r"^libopen-pal\.so")
        if path is not None and hasattr(lib := ctypes.CDLL(path), "opal_progress_register"):
            hook = OpenMpiHook(poll, lib)
    if hook is not None:
        # before mpi4py's MPI_Finalize, which runs from Py_AtExit, after the interpreter
        # is gone: the MPI library must not call back into Python by then
        atexit.register(hook.close)
    return hook

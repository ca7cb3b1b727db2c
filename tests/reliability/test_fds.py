"""File descriptors: none of the library's reaches a program a rank starts, and the
README's ``cma.Pipe`` pattern leaves none behind in the parent.

Regression tests of issue #23: a vmfd peer's /proc/PID/mem fd (received over SCM_RIGHTS)
was inherited by ``subprocess.run(..., close_fds=False)``, as were the world's memfd and
doorbells in a spawned rank (they arrive through ``pass_fds``); and the end a parent
hands to its child and never closes kept 3 fds open per Pipe.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import TRANSPORTS, open_fds, stop_process

import cma
from cma.errors import TransportUnavailable

# Prints (fd, what it is) for every fd the new program started with, but 0-2.
LIST_FDS = """
import os
found = []
for name in os.listdir("/proc/self/fd"):
    try:
        found.append((int(name), os.readlink("/proc/self/fd/" + name)))
    except OSError:
        pass  # the directory fd listdir used, closed by now
print(sorted(f for f in found if f[0] > 2))
"""
TAG = 5


def inherited_fds() -> set[tuple[int, str]]:
    """The fds (number, target) a program started with ``close_fds=False`` inherits."""
    out = subprocess.run([sys.executable, "-c", LIST_FDS], close_fds=False, check=True,
                         capture_output=True, text=True, timeout=30).stdout
    return set(eval(out))  # noqa: S307 - a list of (int, str) we printed ourselves


def gone_since(before: dict[int, str]) -> dict[int, str]:
    """The fds of ``before`` no longer open, or now open on something else: closed by
    someone who did not own them (a double close that hit a reused number does that)."""
    now = open_fds()
    return {fd: what for fd, what in before.items() if now.get(fd) != what}


def leaks(before: set[tuple[int, str]]) -> dict[str, object]:
    """What a started program inherits now and did not before, and which fds opened
    since ``before`` are not close-on-exec (both must be empty)."""
    previous = {fd for fd, _ in before}
    inheritable = {fd: what for fd, what in open_fds().items()
                   if fd not in previous and fd > 2 and _inheritable(fd)}
    return {"inherited": sorted(inherited_fds() - before), "inheritable": inheritable}


def the_librarys(found: set[tuple[int, str]] | dict[int, str]) -> list[tuple[int, str]]:
    """The fds among ``found`` that cma opens: memfds, eventfds, pidfds, the epoll set a
    sleep waits on, sockets, /proc/PID/mem."""
    kinds = ("memfd:cma-", "anon_inode:[eventfd]", "anon_inode:[pidfd]", "anon_inode:[eventpoll]",
             "socket:", "/mem")
    pairs = found.items() if isinstance(found, dict) else found
    return sorted((fd, what) for fd, what in pairs if what.startswith(kinds) or what.endswith("/mem"))


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:
        return False  # the fd listdir used


def child_checks_its_fds(comm: cma.Comm, conn: mp.connection.Connection) -> None:
    """A spawned rank: connect, then report which of the library's fds a program it starts
    would inherit (its world fds came through pass_fds, before any baseline could be taken)."""
    try:
        comm.Recv(buf := np.empty(3, np.int64), source=0, tag=TAG)
        comm.Send(buf, dest=0, tag=TAG)
        inheritable = {fd: what for fd, what in open_fds().items() if _inheritable(fd)}
        conn.send(("ok", {"inherited": the_librarys(inherited_fds()),
                          "inheritable": the_librarys(inheritable)}))
        comm.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", repr(exc)))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_started_program_inherits_no_fd_of_the_library(transport: str) -> None:
    ctx = mp.get_context("spawn")  # the child's world fds arrive through pass_fds
    gc.collect()  # (garbage of earlier tests closes its fds now, not inside this check)
    before = inherited_fds()
    open_before = open_fds()
    a, b = cma.Pipe(transport=transport)
    results, report = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child_checks_its_fds, args=(b, report))
    try:
        proc.start()
        report.close()
        b.close()
        try:
            a.Send(np.arange(3, dtype=np.int64), dest=1, tag=TAG)
        except TransportUnavailable as exc:
            pytest.skip(f"transport {transport!r} is not usable here: {exc}")
        got = np.empty(3, np.int64)
        a.Recv(got, source=1, tag=TAG)
        assert got.tolist() == [0, 1, 2]
        assert leaks(before) == {"inherited": [], "inheritable": {}}, "rank 0 (the test process)"
        assert results.poll(30), "the child did not report"
        status, value = results.recv()
        assert status == "ok", value
        assert value == {"inherited": [], "inheritable": []}, "rank 1 (spawned)"
    finally:
        a.close()
        stop_process(proc)
        results.close()
    assert not gone_since(open_before), "fds open before the test were closed"


def readme_child(comm: cma.Comm) -> None:
    buf = np.empty(16)
    comm.Recv(buf, source=0, tag=7)
    comm.send(float(buf.sum()), dest=0, tag=8)
    comm.close()


def readme_cycles(count: int, context: str) -> None:
    """The README's pattern, ``count`` times: the parent closes ``a``, never ``b``."""
    ctx = mp.get_context(context)
    for _ in range(count):
        a, b = cma.Pipe(transport="shm")
        p = ctx.Process(target=readme_child, args=(b,))
        p.start()
        try:
            a.Send(np.arange(16, dtype=float), dest=1, tag=7)
            assert a.recv(source=1, tag=8) == 120.0
        finally:
            a.close()
            stop_process(p)


@pytest.mark.parametrize(("context", "count"), [("fork", 100), ("spawn", 2)])
def test_the_readme_pattern_leaves_no_fd_open(context: str, count: int) -> None:
    readme_cycles(1, context)  # whatever the first use opens for good (imports, pools)
    gc.collect()
    open_before = open_fds()
    before = len(os.listdir("/proc/self/fd"))
    readme_cycles(count, context)
    after = len(os.listdir("/proc/self/fd"))  # no gc.collect(): released as soon as unused
    assert abs(after - before) <= 2, f"{before} fds before {count} Pipes, {after} after"
    assert not gone_since(open_before), "fds open before the Pipes were closed"


def test_an_unused_end_is_released_when_collected_and_a_used_one_is_not() -> None:
    gc.collect()
    open_before = open_fds()
    before = len(open_before)
    a, b = cma.Pipe()
    assert len(open_fds()) == before + 6  # a memfd and two doorbells per end
    del b
    assert len(open_fds()) == before + 3
    a.close()
    assert len(open_fds()) == before
    assert not gone_since(open_before)

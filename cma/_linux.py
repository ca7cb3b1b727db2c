"""Every binding to the kernel that cma uses, in one place.

ctypes functions get full ``argtypes``/``restype`` (without argtypes Python ints are
truncated to 32 bits, which breaks pointers), and errno values become cma exceptions
here, so the layers above never see a bare ``OSError`` from a system call.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import math
import mmap
import os
import resource
import select
import signal
import socket
import struct
import time
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import CmaError, FdAlreadyClosed, PeerGone, TransportFault, TransportUnavailable


def _load_libc() -> ctypes.CDLL:
    """glibc by its soname; ``find_library`` (which runs ldconfig in a child process,
    ~10 ms of every import here, times every rank of a world) only where that fails."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


_libc = _load_libc()

PAGE_SIZE = mmap.PAGESIZE


# ---------------------------------------------------------------- shared memory

def memfd_segment(name: str, nbytes: int, sealed: bool = False) -> int:
    """An anonymous shared-memory file of ``nbytes`` (never a named /dev/shm file: nothing leaks).

    ``sealed``: it can never shrink (F_SEAL_SHRINK), so a process that maps it cannot be
    killed by SIGBUS because its owner cut it short; ``cannot_shrink`` checks it.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    try:
        os.ftruncate(fd, nbytes)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError:
        close_fd(fd)
        raise
    return fd


def cannot_shrink(fd: int) -> bool:
    """Whether the file behind ``fd`` is sealed against shrinking (a sealed memfd)."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # EINVAL: not a file that takes seals
        return False


_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10


def map_shared(fd: int, nbytes: int, offset: int = 0, writable: bool = True) -> mmap.mmap:
    """Map ``nbytes`` of ``fd`` from ``offset`` (a multiple of the page size) shared,
    read-write, or read-only when ``writable`` is false.

    ``mmap.mmap(fd, ...)`` keeps a dup of ``fd`` for as long as the mapping lives (before
    Python 3.13's ``trackfd``), which made a rank hold an fd per channel it maps. So the
    range is reserved as an anonymous ``mmap.mmap`` (no fd; it still refuses to close while
    a view is exported) and the file is mapped over it in place with MAP_FIXED. A read-only
    reservation exports read-only buffers, so a NumPy view of it cannot be made writable
    (a write would otherwise fault on the read-only pages instead of raising).
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE, prot)
    address = local_address(memoryview(mm))  # (the view is released here: mm can close later)
    got = _mmap(address, nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
    if got == _MAP_FAILED:
        err = ctypes.get_errno()
        mm.close()
        raise OSError(err, os.strerror(err))
    return mm


def advise_huge_pages(mm: mmap.mmap) -> None:
    """madvise(MADV_HUGEPAGE): lets a shared mapping use 2 MiB pages where the shmem THP
    setting allows it ("advise", "within_size", "always"); a no-op under "never".

    A kernel built without THP answers EINVAL, which only means small pages.
    """
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise


_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_MADV_POPULATE_WRITE = 23  # linux/mman.h, 5.14+ (no Python version's mmap names it)


def populate(address: int, length: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) on [address, address + length) (page aligned): fault
    the pages in now, in one call (ctypes lets go of the GIL meanwhile: ~2.5 ms for 4 MiB
    here), so that the first writes there take no page fault each. False where the
    kernel did not, for whatever reason (before 5.14; short of memory; a signal): it
    only saves time, and the pages then come on first touch."""
    if address % PAGE_SIZE or length % PAGE_SIZE:
        raise ValueError(f"populate wants whole pages, got {length} bytes at {address:#x}")
    return _madvise(address, length, _MADV_POPULATE_WRITE) == 0


@functools.cache
def can_populate() -> bool:
    """Whether this kernel populates a mapping on request (MADV_POPULATE_WRITE)."""
    probe = mmap.mmap(-1, PAGE_SIZE)
    try:
        with memoryview(probe) as view:
            return populate(buffer_address(view), PAGE_SIZE)
    finally:
        probe.close()


def release_pages(mm: mmap.mmap, start: int, length: int) -> None:
    """madvise(MADV_REMOVE) on bytes [start, start + length) of a shared mapping of a
    memfd (both page aligned): the kernel frees the pages (a hole in the file), and every
    process that maps them reads zeros until one writes them again."""
    try:
        mm.madvise(mmap.MADV_REMOVE, start, length)
    except OSError as exc:
        raise CmaError(f"cannot hand {length} bytes of shared memory back to the kernel: "
                       f"{exc.strerror}") from exc


def shmem_huge_pages() -> str:
    """The shmem THP setting (memfd included): "never", "advise", "always", ... or "unsupported"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            words = f.read().split()
    except OSError:
        return "unsupported"
    chosen = [w[1:-1] for w in words if w.startswith("[")]
    return chosen[0] if chosen else "unsupported"


def huge_page_size() -> int:
    """The PMD (transparent huge page) size: 2 MiB on x86-64."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def file_size(fd: int) -> int:
    """The size of an open file (a mapping of it beyond this size faults with SIGBUS)."""
    return os.fstat(fd).st_size


def reopen_read_only(fd: int) -> int:
    """A new, read-only open of the file behind ``fd`` (close-on-exec): whoever gets it can
    map the file only read-only."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def file_inode(fd: int) -> int:
    """The inode number of an open file: names a memfd for good while it is open."""
    return os.fstat(fd).st_ino


def buffer_address(buf: memoryview) -> int:
    """Virtual address of the first byte of a C-contiguous buffer (read-only ones too)."""
    if buf.nbytes == 0:
        return 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


# ---------------------------------------------------------------- wake-ups

def eventfd() -> int:
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def ring_doorbell(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:  # counter saturated: the sleeper is certainly woken
        pass


def drain_doorbell(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def wait_readable(fds: list[int], timeout_ms: int) -> list[int]:
    """poll() the fds for input, once; returns the ready ones (a pidfd is ready when its
    process exits). A wait repeated on the same fds uses an ``EpollSet`` instead."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout_ms)]


class EpollSet:
    """An epoll instance watching fds for input: each is registered once, so a wait costs
    the same whatever the number of fds (docs/architecture.md, "Waiting", has the numbers).

    The epoll fd is close-on-exec (Python opens it with EPOLL_CLOEXEC). A process forked
    from its owner shares the instance, so only the owner may add or remove fds; ``close``
    removes none (it closes the instance, whose registrations go with it).
    """

    def __init__(self) -> None:
        try:
            self._epoll = select.epoll()
        except OSError as exc:
            raise CmaError(f"cannot create an epoll instance: {exc.strerror} (raise the "
                           "open-file limit, ulimit -n)") from exc
        self._count = 0

    def add(self, fd: int) -> None:
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except OSError as exc:
            hint = (" (the per-user limit /proc/sys/fs/epoll/max_user_watches is reached)"
                    if exc.errno == errno.ENOSPC else "")
            raise CmaError(f"cannot watch fd {fd} with epoll: {exc.strerror}{hint}") from exc
        self._count += 1

    def remove(self, fd: int) -> None:
        """Stop watching ``fd``; call it before closing ``fd``, whose registration would
        otherwise outlive it in a forked process that still holds a copy."""
        try:
            self._epoll.unregister(fd)
        except OSError as exc:
            raise CmaError(f"fd {fd} was not watched by this epoll instance: {exc.strerror}") from exc
        self._count -= 1

    def wait(self, timeout_ms: int) -> list[int]:
        """The watched fds that are readable, waiting up to ``timeout_ms`` for one.

        A signal ends the wait at once: epoll_wait returns EINTR, Python runs the handler,
        and what the handler raises (KeyboardInterrupt) comes out of here (PEP 475).
        """
        return [fd for fd, _ in self._epoll.poll(timeout_ms / 1000, self._count or 1)]

    def close(self) -> None:
        self._epoll.close()


# ---------------------------------------------------------------- processes

def pidfd_open(pid: int) -> int:
    """A pidfd for ``pid``; ``PeerGone`` if it no longer exists."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError as exc:
        raise PeerGone(f"process {pid} has exited") from exc


# syscall(2) is variadic, so ctypes cannot type it once for all; this prototype fixes the
# four longs of pidfd_getfd (integer arguments travel in the same registers either way on
# Linux's ABIs). os.pidfd_getfd does not exist (Python 3.11).
_syscall4 = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                             ctypes.c_long, use_errno=True)(("syscall", _libc))
_SYS_PIDFD_GETFD = 438  # x86-64 and the generic table alike (Linux 5.6)


def pidfd_getfd(pidfd: int, target_fd: int) -> int:
    """A duplicate, close-on-exec, of the process's fd ``target_fd`` (pidfd_getfd(2)).

    Needs ptrace-attach permission over the process (OSError EPERM otherwise, ENOSYS
    before Linux 5.6); no help from the process, so no thread of it must run.
    """
    fd = _syscall4(_SYS_PIDFD_GETFD, pidfd, target_fd, 0)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def is_eventfd(fd: int) -> bool:
    """Whether ``fd`` is an eventfd (what a doorbell taken by number must be)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


def process_alive(pidfd: int) -> bool:
    return not wait_readable([pidfd], 0)


def pid_still_held(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` still holds its pid: running, or exited and not yet
    reaped. Until it is reaped no other process can get the pid, so a copy by pid reaches
    it or nobody. A signal 0 (~0.4 us here) where ``process_alive``'s poll takes ~1.1
    (docs/reliability.md, "Pid reuse"); a peer we may not signal is polled."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM; EINVAL across pid namespaces; ENOSYS under some seccomp filters
        return process_alive(pidfd)
    return True


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
    """``socket.recv_fds``, but the fds arrive close-on-exec (MSG_CMSG_CLOEXEC).

    ``socket.recv_fds`` leaves them inheritable, so a program the process starts later
    with ``close_fds=False`` would get them; for a /proc/PID/mem fd that is a whole
    address space. With the flag no moment exists in which they are inheritable.
    """
    fds = array.array("i")
    msg, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_SPACE(maxfds * fds.itemsize),
                                          socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if flags & socket.MSG_CTRUNC:  # the kernel dropped fds this process had no room for
        for fd in fds:
            close_fd(fd)
        raise OSError(errno.EMFILE, f"{os.strerror(errno.EMFILE)}: fds passed to this process were "
                      "dropped (raise the open-file limit, ulimit -n)")
    return msg, list(fds)


def ensure_fd_limit(count: int) -> None:
    """Let this process hold ``count`` fds: raise the soft RLIMIT_NOFILE up to the hard one.

    A world holds a few fds per rank, and the usual soft limit (1024) would otherwise cap
    a world below a thousand ranks; raising the soft limit is what the hard one is for.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= count:
        return
    if hard != resource.RLIM_INFINITY and hard < count:
        raise CmaError(f"this world needs about {count} open files per process but the hard "
                       f"limit is {hard} (raise it: ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


def usable_cpus(cpus: Iterable[int] | None = None, cgroup_root: str = "/sys/fs/cgroup",
                proc_cgroup: str = "/proc/self/cgroup") -> int:
    """How many CPUs can run this process's work at once: the CPUs it may run on (its
    affinity mask, or ``cpus``: the union of several processes' masks) or its cgroup's CPU
    quota, whichever is fewer. ``os.cpu_count()`` counts the machine's CPUs: under
    taskset, a Slurm allocation or a container's cpuset it is too many."""
    count = len(os.sched_getaffinity(0) if cpus is None else set(cpus))
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us over cpu.cfs_period_us), or None if there is none or it cannot be
    read. Only the process's own cgroup is read, at the path /proc/self/cgroup names or,
    inside a container whose cgroup is mounted as the root, at the root."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # cgroup v2
            for base in (cgroup_root, os.path.join(cgroup_root, "unified")):
                for where in (base + path.rstrip("/"), base):
                    words = _read_words(os.path.join(where, "cpu.max"))
                    if len(words) == 2:
                        return None if words[0] == "max" else int(words[0]) / int(words[1])
        elif "cpu" in controllers.split(","):  # cgroup v1
            for where in (f"{cgroup_root}/cpu{path.rstrip('/')}", f"{cgroup_root}/cpu"):
                quota = _read_words(os.path.join(where, "cpu.cfs_quota_us"))
                period = _read_words(os.path.join(where, "cpu.cfs_period_us"))
                if quota and period:
                    return None if int(quota[0]) < 0 else int(quota[0]) / int(period[0])
    return None


def _read_words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


def close_on_exec(fds: Sequence[int]) -> None:
    """Mark ``fds`` close-on-exec (fds inherited through ``pass_fds`` or spawn are not)."""
    for fd in fds:
        os.set_inheritable(fd, False)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def set_dumpable(dumpable: bool) -> None:
    """prctl(PR_SET_DUMPABLE): a non-dumpable process refuses ptrace-style access by its peers."""
    if _prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def is_dumpable() -> bool:
    return bool(_prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))


# ---------------------------------------------------------------- errno mapping

def raise_for_errno(err: int, what: str, pid: int) -> None:
    """Turn the errno of a failed cross-process copy into the cma exception a person can act on."""
    if err == errno.ESRCH:
        raise PeerGone(f"{what}: process {pid} has exited")
    if err == errno.EPERM:
        raise TransportUnavailable(f"{what}: not permitted to access process {pid} ({PTRACE_HELP})")
    if err == errno.EFAULT:
        raise TransportFault(errno.EFAULT, f"{what}: a region is not mapped in process {pid}")
    raise TransportFault(err, f"{what} on process {pid}: {os.strerror(err)}")


PTRACE_HELP = (
    "this needs ptrace-attach permission over the peer: run both processes "
    "as the same user and keep them dumpable (no setuid, no prctl(PR_SET_DUMPABLE, 0)); on hosts "
    "with Yama set /proc/sys/kernel/yama/ptrace_scope to 0 or have the target call "
    "prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY); in containers grant CAP_SYS_PTRACE and allow "
    "process_vm_readv/writev (and ptrace) in the seccomp profile. The 'vmfd' transport needs "
    "none of this."
)


# ---------------------------------------------------------------- cross-memory attach

IOV_MAX = 1024  # iovecs per side of one call; 1025 gets EINVAL
MAX_RW_COUNT = 0x7FFFF000  # bytes the kernel moves per call; larger requests come back short


class iovec(ctypes.Structure):  # noqa: N801 - the C name, as in <sys/uio.h>
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


IovecArray = ctypes.Array[iovec]

_IOVEC_P = ctypes.POINTER(iovec)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.argtypes = [
    ctypes.c_int,  # pid_t
    _IOVEC_P,
    ctypes.c_ulong,
    _IOVEC_P,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.argtypes = _process_vm_readv.argtypes
_process_vm_writev.restype = ctypes.c_ssize_t

# Below this many spans, setting fields one by one beats the slice assignment's set-up cost.
_FEW_SPANS = 8


def iovec_array(addrs: Sequence[int], lens: Sequence[int]) -> IovecArray:
    """An iovec array of (addrs[i], lens[i]), to hand to process_vm_readv/writev."""
    count = len(addrs)
    array = (iovec * count)()
    if count <= _FEW_SPANS:
        for i in range(count):
            array[i].iov_base = addrs[i]
            array[i].iov_len = lens[i]
    else:
        words = (ctypes.c_size_t * (2 * count)).from_buffer(array)
        words[0::2] = [*addrs]
        words[1::2] = [*lens]
    return array


def process_vm_copy(
    pid: int,
    local: IovecArray | iovec,
    remote: IovecArray | iovec,
    *,
    write: bool,
    what: str,
) -> int:
    """One process_vm_readv (or, with ``write``, process_vm_writev) call; bytes moved.

    ``local`` and ``remote`` are iovec arrays, or single iovecs (an array of one costs
    ~0.8 us more to build). The count may be short of the request (the kernel stops at a
    remote page it cannot reach, or at MAX_RW_COUNT); the caller loops. An error comes
    back only when nothing was copied, and becomes the cma exception ``raise_for_errno``
    chooses.
    """
    call = _process_vm_writev if write else _process_vm_readv
    moved = call(pid, local, 1 if isinstance(local, iovec) else len(local),
                 remote, 1 if isinstance(remote, iovec) else len(remote), 0)
    if moved < 0:
        raise_for_errno(ctypes.get_errno(), what, pid)
    return int(moved)


def local_address(buf: memoryview) -> int:
    """``buffer_address`` of a C-contiguous buffer, ~7x faster when it is writable.

    ctypes can wrap a writable buffer directly; a read-only one still goes through NumPy.
    """
    if buf.readonly:
        return buffer_address(buf)
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def cma_access_errno(pid: int) -> int:
    """errno of a 16-byte process_vm_readv from address 0 of ``pid`` (0 if it succeeded).

    The UCX permission probe: the kernel checks ptrace-attach permission before touching
    memory, so EFAULT (nothing at address 0) means permitted and EPERM means refused.
    """
    scratch = ctypes.create_string_buffer(16)
    local = iovec_array([ctypes.addressof(scratch)], [16])
    remote = iovec_array([0], [16])
    if _process_vm_readv(pid, local, 1, remote, 1, 0) < 0:
        return ctypes.get_errno()
    return 0


# ---------------------------------------------------------------- ptrace (teaching transport)

_PTRACE_PEEKDATA = 2
_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PTRACE_EVENT_STOP = 128
_WALL = 0x40000000  # wait for every kind of child; the tracee need not be ours
_ptrace = _libc.ptrace
_ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_ptrace.restype = ctypes.c_long
_WORD = struct.Struct("l")  # PEEKDATA returns one C long
PTRACE_WORD_BYTES = _WORD.size
_STOP_POLL_SECONDS = 0.00005


def _status_fields(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as status:
            return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)
    except OSError:
        return {}


def _ptrace_call(request: int, pid: int, data: int, what: str) -> None:
    if _ptrace(request, pid, None, data) != -1:
        return
    err = ctypes.get_errno()
    if err != errno.EPERM:
        raise_for_errno(err, what, pid)
    # EPERM also answers a zombie and a process someone else already traces
    status = _status_fields(pid)
    if not status or status.get("State", "").startswith(("Z", "X")):
        raise PeerGone(f"{what}: process {pid} has exited")
    tracer = status.get("TracerPid", "0")
    if tracer != "0":
        raise TransportUnavailable(
            f"{what}: process {pid} is already traced by process {tracer} (a debugger or "
            "strace?), and a process has one tracer at a time"
        )
    raise TransportUnavailable(f"{what}: not permitted to trace process {pid} ({PTRACE_HELP})")


def _forget_exited(pid: int) -> None:
    """Stop tracing ``pid``, which has exited or is dying, without taking its exit status.

    A traced zombie is reported to its tracer first and to its parent only after the
    tracer has waited for it. If we are the parent, the status is ours to leave to
    whoever waits for the child (multiprocessing, subprocess); else wait to release it.
    """
    if _status_fields(pid).get("PPid") == str(os.getpid()):
        return
    try:
        os.waitpid(pid, _WALL)  # returns soon: the tracee is dead or dying
    except ChildProcessError:  # someone in this process (a SIGCHLD handler) already did
        pass


def _await_stop(pid: int, what: str) -> int:
    """Wait until the tracee ``pid`` is stopped; the signal its stop holds back (0 if none).

    Polls rather than blocks: a SIGCHLD handler in this process may collect the stop
    report first, and then /proc still shows the tracing stop. An exit is peeked at
    (WNOWAIT), not collected, so ``_forget_exited`` can leave it to the parent.
    """
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WSTOPPED | os.WNOWAIT | os.WNOHANG | _WALL)
        except ChildProcessError as exc:
            raise PeerGone(f"{what}: process {pid} has exited") from exc
        if info is None:
            if _status_fields(pid).get("State", "").startswith("t"):
                return 0
            time.sleep(_STOP_POLL_SECONDS)
            continue
        if info.si_code not in (os.CLD_TRAPPED, os.CLD_STOPPED):
            _forget_exited(pid)
            raise PeerGone(f"{what}: process {pid} exited while being stopped")
        _, status = os.waitpid(pid, _WALL | os.WNOHANG)  # collect the stop report
        if not os.WIFSTOPPED(status) or status >> 16 == _PTRACE_EVENT_STOP:
            return 0
        return os.WSTOPSIG(status)  # a signal-delivery stop: the signal waits for detach


def ptrace_stop(pid: int, what: str) -> int:
    """Attach to ``pid`` (PTRACE_SEIZE) and stop it; the signal to hand back on detach.

    PEEKDATA works only on a stopped tracee. PTRACE_INTERRUPT stops the traced thread
    (the main one; the peer's other threads run on) wherever it is. A system call it
    was blocked in returns EINTR or restarts: Python retries on EINTR (PEP 475), C code
    in the peer might not.
    """
    _ptrace_call(_PTRACE_SEIZE, pid, 0, what)
    _ptrace(_PTRACE_INTERRUPT, pid, None, 0)  # fails only for a tracee already dying
    try:
        return _await_stop(pid, what)
    except PeerGone:
        raise
    except BaseException:  # e.g. KeyboardInterrupt: the stop is on its way; do not leave it stopped
        ptrace_resume(pid, _await_stop(pid, what), what)
        raise


def ptrace_resume(pid: int, signal: int, what: str) -> None:
    """Detach from the stopped ``pid`` and let it run, delivering ``signal`` if not 0."""
    if _ptrace(_PTRACE_DETACH, pid, None, signal) == -1:
        err = ctypes.get_errno()
        if err != errno.ESRCH:
            raise_for_errno(err, what, pid)
        _forget_exited(pid)  # a stopped tracee leaves its stop only to die (SIGKILL)
        raise PeerGone(f"{what}: process {pid} was killed while stopped")


def ptrace_peek_into(pid: int, addr: int, dest: memoryview, what: str) -> int:
    """Fill the byte view ``dest`` from ``addr`` in the stopped tracee; PEEKDATA calls made.

    One call per aligned word, so a word never straddles a page the region does not
    touch. glibc returns the word, so a word of all ones looks like an error until
    errno says otherwise.
    """
    size = PTRACE_WORD_BYTES
    end = addr + dest.nbytes
    pack = _WORD.pack_into
    peek = _ptrace
    calls = 0
    for word_addr in range(addr - addr % size, end, size):
        word = peek(_PTRACE_PEEKDATA, pid, word_addr, None)
        calls += 1
        if word == -1:
            ctypes.set_errno(0)
            word = peek(_PTRACE_PEEKDATA, pid, word_addr, None)
            calls += 1
            err = ctypes.get_errno()
            if word == -1 and err:
                if err in (errno.EIO, errno.EFAULT):
                    raise TransportFault(
                        errno.EFAULT, f"{what}: address {word_addr:#x} is not mapped in process {pid}"
                    )
                raise_for_errno(err, what, pid)
        lo = word_addr - addr
        if lo >= 0 and word_addr + size <= end:
            pack(dest, lo, word)
        else:  # the region's first or last word: keep only the bytes inside it
            part = _WORD.pack(word)[max(0, -lo) : min(size, end - word_addr)]
            start = max(0, lo)
            dest[start : start + len(part)] = part
    return calls


# ---------------------------------------------------------------- /proc/PID/mem (vmfd emulation)

def open_self_mem(writable: bool) -> int:
    """An fd onto this process's whole address space: /proc/self/mem, read-only unless ``writable``.

    The kernel checks permission here, at open, and never again: whoever holds the fd
    can read (and, if writable, write) this process's memory.
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
    try:
        return os.open("/proc/self/mem", flags)
    except OSError as exc:
        raise TransportUnavailable(
            f"cannot open /proc/self/mem ({exc.strerror}): a process that is not root and has "
            "changed uid or called prctl(PR_SET_DUMPABLE, 0) may not open its own memory file; "
            "create the vmfd transport before dropping privileges"
        ) from exc


def memory_bytes() -> int:
    """RAM plus swap of this machine: no process here can hold more."""
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(("MemTotal:", "SwapTotal:")):
                total += int(line.split()[1]) * 1024
    return total or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mem_fd_owner(fd: int) -> tuple[int, bool]:
    """(pid, writable) of a /proc/PID/mem fd; ``TransportFault`` if ``fd`` is anything else."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        accmode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError as exc:
        raise TransportFault(exc.errno, f"fd {fd} is not usable: {exc.strerror}") from exc
    parts = target.split("/")
    if len(parts) != 4 or parts[:2] != ["", "proc"] or not parts[2].isdigit() or parts[3] != "mem":
        raise TransportFault(errno.EBADF, f"fd {fd} is {target!r}, not a /proc/PID/mem file")
    return int(parts[2]), accmode == os.O_RDWR


def dup_fd(fd: int) -> int:
    return os.dup(fd)


def close_fd(fd: int) -> None:
    """Close ``fd``; ``FdAlreadyClosed`` if it was not open (EBADF: a double close, which
    closes another file of this process once the number is reused). Other errors leave
    the fd closed (Linux releases it before reporting EINTR or EIO): nothing to do."""
    try:
        os.close(fd)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise FdAlreadyClosed(errno.EBADF, f"fd {fd} is not open: cma closed it twice "
                                  "(a bug in cma; please report it)") from exc


def _mem_error(exc: OSError, access: str, addr: int, nbytes: int, pid: int) -> TransportFault:
    span = f"[0x{addr:x}, 0x{addr + nbytes:x})"
    if exc.errno == errno.EIO:
        return TransportFault(
            errno.EIO, f"{access} {span}: the address 0x{addr:x} is not mapped in process {pid}"
        )
    return TransportFault(exc.errno, f"{access} {span} of process {pid}: {exc.strerror}")


def mem_copy(fd: int, buffers: Sequence[memoryview], addr: int, *, write: bool, pid: int,
             what: str) -> int:
    """preadv (pwritev if ``write``) on a /proc/PID/mem fd at offset ``addr``; bytes moved,
    possibly short (> 0).

    0 bytes for a non-empty request means the owner's address space is gone (it exited
    or exec'd): ``PeerGone``. An unmapped address (EIO): ``TransportFault`` naming it.
    """
    try:
        moved = os.pwritev(fd, buffers, addr) if write else os.preadv(fd, buffers, addr)
    except OSError as exc:
        nbytes = sum(b.nbytes for b in buffers)
        raise _mem_error(exc, f"{what}: {'writing' if write else 'reading'}", addr, nbytes,
                         pid) from exc
    if moved == 0:
        raise PeerGone(f"{what}: process {pid} has exited or exec'd; its memory is gone")
    return moved


# ---------------------------------------------------------------- same-process copies

def copy_from_address(dest: memoryview, addr: int) -> None:
    """Copy ``dest.nbytes`` bytes from ``addr`` in this process (a message sent to oneself)."""
    if dest.nbytes:
        ctypes.memmove(buffer_address(dest), addr, dest.nbytes)

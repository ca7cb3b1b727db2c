"""Bootstrap: how the processes of a world find each other and share their channels.

A world of N ranks is one memfd segment (see ``channel``) plus one eventfd doorbell
per rank. Whoever creates the world (``cma.Pipe``, the ``cma-run`` launcher, the
mpi4py plugin) hands those fds to every rank: by fork inheritance, by pickling for
``multiprocessing`` spawn, by ``pass_fds`` and the environment, or over a Unix socket.

Each rank then *attaches* in its own process: it publishes its pid and its doorbell's
fd number and starts a small fd server on an abstract Unix socket (nothing on disk to
leak) so verified peers can fetch fds it exposes (its doorbell, where ptrace rules keep
them from taking it by number; the vmfd transport's /proc/self/mem; cma.mpi's node
rank 0 serves the world's own fds so, before it attaches). It *connects* a peer when it
first talks to it (``open_pair``): waits until that peer has attached, opens its pidfd,
maps the pair's two channels, takes its doorbell, probes the transports against it and
publishes what it can reach (``publish_reach``), which also tells the peer to map the
pair in turn. A world of two ranks connects its pair at attach and waits for the peer's
probe too, so an explicitly requested transport that cannot work fails there, on both
ranks, before any message moves.
"""

from __future__ import annotations

import errno
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from . import _linux
from .channel import (
    CONNECTS,
    CPU_WORDS,
    CPUS,
    DOORBELL,
    LAUNCHED,
    PHASE,
    PID,
    PREAMBLE_WORDS,
    RANK_BLOCK_WORDS,
    REACH_PUBLISHED,
    SLEEPING,
    ChannelConfig,
    Inbox,
    Outbox,
    heads_word,
    pair_boxes,
)
from .errors import CmaError, PeerGone, ProtocolError

ENV_WORLD = "CMA_WORLD"
ENV_TRANSPORT = "CMA_TRANSPORT"
# How long a rank waits for a peer to attach: far above the 0.25-1.75 s 16 ranks' attach
# took here (docs/architecture.md,
# "Peers connected on first use"), for slow starts on loaded machines; chosen.
CONNECT_TIMEOUT = float(os.environ.get("CMA_CONNECT_TIMEOUT", "60"))
# A rank's PHASE word moves up through these; peers wait until every rank reaches one.
PHASE_PUBLISHED = 1  # pid and server are up
PHASE_PROBED = 2  # (two-rank worlds) the reach mask towards the peer is written
PHASE_CLOSED = 3  # reads its rings no more
# The fd server drops a connection that has not sent its request by then: a peer sends
# it at once, and a silent client must not hold on to a socket for long.
REQUEST_SECONDS = 2.0
# fds a rank of an N-rank world may hold: per connected peer a doorbell, a pidfd and a
# transport fd or two (docs/architecture.md, "Memory per rank"), plus the process's own
# (the interpreter, its libraries and the caller's files: a round 64, chosen)
FDS_PER_RANK = 4
FDS_SPARE = 64
# The kernel's PID_MAX_LIMIT: a pid word above it (or below 1) was not written by a rank.
PID_LIMIT = 1 << 22
# The kernel's SCM_MAX_FD: a message carries at most this many fds (more: EINVAL), so the
# fd server answers a request for more (a world's fds, from 253 ranks) in several.
FDS_PER_MESSAGE = 253


@dataclass
class WorldFds:
    """The shared objects of one world, as file descriptors of this process."""

    world_id: str
    size: int
    memfd: int
    doorbells: list[int]
    config: ChannelConfig = field(default_factory=ChannelConfig)

    def __post_init__(self) -> None:
        # Fds that came through pass_fds (cma-run), spawn or SCM_RIGHTS may be inheritable:
        # a program this process starts must not get the world's memory and doorbells.
        _linux.close_on_exec(self.inheritable())

    @classmethod
    def create(cls, size: int, config: ChannelConfig | None = None) -> WorldFds:
        """A new world of ``size`` ranks: a memfd segment sized by ``config`` and one eventfd per rank."""
        config = config or ChannelConfig.for_ranks(size)
        config.validate()
        world_id = secrets.token_hex(8)
        memfd = _linux.memfd_segment(f"cma-{world_id}", config.segment_bytes(size))
        doorbells = [_linux.eventfd() for _ in range(size)]
        return cls(world_id, size, memfd, doorbells, config)

    def close(self) -> None:
        """Close the fds (once: a second call must not close numbers reused since)."""
        for fd in [self.memfd, *self.doorbells]:
            if fd >= 0:
                _linux.close_fd(fd)
        self.memfd = -1
        self.doorbells = []

    def to_env(self, rank: int) -> str:
        """What ``rank``'s process needs: the segment and its own doorbell (-1 for the
        others, which it fetches from a peer when it connects to it)."""
        bells = ",".join(str(fd if r == rank else -1) for r, fd in enumerate(self.doorbells))
        return f"{self.world_id}:{rank}:{self.size}:{self.memfd}:{bells}:{self.config.encode()}"

    def inheritable_by(self, rank: int) -> list[int]:
        """The fds ``to_env(rank)`` names."""
        return [self.memfd, self.doorbells[rank]]

    @classmethod
    def from_env(cls, text: str) -> tuple[WorldFds, int]:
        """The fds and rank that ``to_env`` wrote (``CMA_WORLD``); ``CmaError`` if malformed or not open."""
        try:
            world_id, rank, size, memfd, bells, config = text.split(":")
            fds = cls(world_id, int(size), int(memfd), [int(b) for b in bells.split(",")],
                      ChannelConfig.decode(config))
            return fds, int(rank)
        except ValueError as exc:
            raise CmaError(f"malformed {ENV_WORLD}={text!r}: start the program with cma-run") from exc
        except OSError as exc:
            raise CmaError(f"the fds named by {ENV_WORLD}={text!r} are not open here ({exc.strerror}): "
                           "start the program with cma-run, which passes them") from exc

    def inheritable(self) -> list[int]:
        """Every fd still open (the segment and the doorbells this process holds)."""
        return [fd for fd in [self.memfd, *self.doorbells] if fd >= 0]


def announce(fds: WorldFds, rank: int, pid: int) -> None:
    """Record ``pid`` as the process that is to attach ``rank`` (0: no longer known).

    Whoever starts that process knows its pid before it attaches (``cma-run``; a process
    that unpickles an end is the one that will use it), so its peers can tell an exit
    before connecting from a slow start instead of waiting for the connect timeout.
    """
    word = PREAMBLE_WORDS + rank * RANK_BLOCK_WORDS + LAUNCHED
    with _linux.map_shared(fds.memfd, fds.config.header_bytes(fds.size)) as mm:
        header = memoryview(mm).cast("q")
        header[word] = pid
        header.release()


def fd_server_address(world_id: str, rank: int) -> str:
    """The abstract Unix socket of a rank's fd server (nothing on disk to leak)."""
    return f"\0cma-{world_id}-{rank}"


def fetch_fds(world_id: str, rank: int, pid: int, name: str, count: int = 1) -> list[int]:
    """The ``count`` fds that rank ``rank`` of the world, process ``pid``, exposes as ``name``.

    The one client of the fd server (``World.expose_fds``): the server must be ``pid``,
    owned by our user (SO_PEERCRED), so a process that took the rank's address is told
    nothing and hands nothing over.
    """
    fds: list[int] = []
    reason = "connection closed"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(fd_server_address(world_id, rank))
            server_pid, uid, _ = _linux.peer_credentials(sock)
            if uid != os.getuid() or server_pid != pid:
                raise CmaError(f"rank {rank}'s fd server is pid {server_pid} of uid {uid}, not "
                               f"pid {pid} of uid {os.getuid()}: another process took its "
                               f"address, so its {name!r} fd was not asked for")
            try:
                sock.sendall(name.encode())
            except BrokenPipeError:
                pass  # refused at accept: the refusal is waiting to be read
            while len(fds) < count:
                msg, got = _linux.recv_fds(sock, 256, min(count - len(fds), FDS_PER_MESSAGE))
                if not got:
                    reason = msg.decode(errors="replace") or reason
                    break
                fds += got
        except OSError as exc:
            for fd in fds:
                _linux.close_fd(fd)
            if exc.errno == errno.EMFILE:
                raise CmaError(f"rank {rank}'s {name!r} fd could not be taken: {exc}") from exc
            raise PeerGone(f"rank {rank} did not answer a request for its {name!r} fd: {exc}") from exc
    if len(fds) != count:
        for fd in fds:
            _linux.close_fd(fd)
        got_some = f" (got {len(fds)} of {count})" if fds else ""
        raise CmaError(f"rank {rank} did not pass its {name!r} fd{got_some}: {reason}")
    return fds


class PeerLink:
    """What transports may know about one peer (see ``transports.base.Peer``)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.pid = world.pid_of(rank)

    def fetch_fd(self, name: str) -> int:
        """The fd the peer exposed under ``name``, through its fd server (SCM_RIGHTS)."""
        return self.world.fetch_fd(self.rank, name)

    def take_fd(self, number: int, name: str) -> int:
        """The peer's fd ``number`` (``World.take_fd``)."""
        return self.world.take_fd(self.rank, number, name)


class World:
    """One rank's view of a world: the mapping, its rings, doorbells and peers."""

    def __init__(self, fds: WorldFds, rank: int) -> None:
        if not 0 <= rank < fds.size:
            raise CmaError(f"rank {rank} outside a world of size {fds.size}")
        _linux.ensure_fd_limit(FDS_PER_RANK * fds.size + FDS_SPARE)
        self.fds = fds
        self.rank = rank
        self.size = fds.size
        self.config = fds.config
        # The header now; the two channels of a pair, each mapped alone, when the pair
        # connects: the segment holds all N(N-1) channels, and mapping them all cost every
        # rank O(N^2) address space (mapping its own 2(N-1), O(N) fds and probes).
        self._maps = [_linux.map_shared(fds.memfd, fds.config.header_bytes(fds.size))]
        header = memoryview(self._maps[0]).cast("q")
        self.header = header
        self.outboxes: list[Outbox | None] = [None] * self.size
        self.inboxes: list[Inbox | None] = [None] * self.size
        self._views: list[memoryview] = []  # views into the header that close() releases
        # Set by a peer that connected to this rank; and the reach matrix's column of this
        # rank (what every rank published towards it), read when that word was set.
        self.connects = self._header_view(self._word(rank, CONNECTS), 1)
        first = self._reach_word(0, rank)
        self._reach_column = self._header_view(first, (self.size - 1) * self.size + 1)[:: self.size]
        self.pidfds: list[int] = [-1] * self.size
        # What a sleep waits on, registered once: this rank's doorbell, and each peer's
        # pidfd from its connect (_watch) to its burial (unwatch) or close.
        self._sleep_set = _linux.EpollSet()
        self._sleep_set.add(fds.doorbells[rank])
        self._peer_of_pidfd: dict[int, int] = {}
        # while connecting: (pid, pidfd) of the process started to attach a late rank
        self._launched: dict[int, tuple[int, int]] = {}
        self._exposed: dict[str, Callable[[], list[int]]] = {}
        self._server: socket.socket | None = None
        self._server_pid = 0
        self._server_thread: threading.Thread | None = None

    def _header_view(self, word: int, words: int) -> memoryview:
        view = self.header[word : word + words]
        self._views.append(view)
        return view

    def _head_word(self, src: int, dst: int) -> memoryview:
        return self._header_view(heads_word(self.size, src, dst), 1)

    def heads_row(self) -> memoryview:
        """This rank's row of the heads matrix: the heads of the rings into it, as bytes
        (a comparison of two reads of it says whether any ring got a packet between)."""
        first = heads_word(self.size, 0, self.rank)
        row = self._header_view(first, self.size).cast("B")
        self._views.append(row)
        return row

    def _map_pair(self, src: int, dst: int) -> memoryview:
        config = self.config
        mm = _linux.map_shared(self.fds.memfd, config.pair_bytes, config.pair_offset(self.size, src, dst))
        self._maps.append(mm)
        return memoryview(mm)

    # -- header words

    def _word(self, rank: int, which: int) -> int:
        return PREAMBLE_WORDS + rank * RANK_BLOCK_WORDS + which

    def _reach_word(self, rank: int, peer: int) -> int:
        return PREAMBLE_WORDS + self.size * RANK_BLOCK_WORDS + rank * self.size + peer

    def pid_of(self, rank: int) -> int:
        """The pid ``rank`` published in the header (0 before it attached)."""
        return self.header[self._word(rank, PID)]

    def reach(self, rank: int, peer: int) -> int:
        """Bitmask of transports (by registry order) that ``rank`` can use towards ``peer``."""
        return self.header[self._reach_word(rank, peer)] & ~REACH_PUBLISHED

    def reach_published(self, rank: int, peer: int) -> bool:
        """Whether ``rank`` has connected to ``peer`` (probed it and published ``reach``)."""
        return bool(self.header[self._reach_word(rank, peer)])

    def connected_to_me(self) -> list[int]:
        """The ranks that have connected to this one (published their reach towards it)."""
        return [r for r, word in enumerate(self._reach_column.tolist()) if word]

    # -- connect time

    def publish(self) -> None:
        """Attach: start the fd server, expose the doorbell, publish the pid (no waiting)."""
        self._start_server()
        bell = self.fds.doorbells[self.rank]
        self.expose_fd("doorbell", lambda: os.dup(bell))
        self.header[self._word(self.rank, DOORBELL)] = bell
        self.header[self._word(self.rank, PID)] = os.getpid()
        self.publish_cpus(os.sched_getaffinity(0))
        self.header[self._word(self.rank, PHASE)] = PHASE_PUBLISHED

    def publish_cpus(self, cpus: Iterable[int]) -> None:
        """Write the CPUs this rank may run on into its header block (``CPUS``)."""
        bitmap = [0] * CPU_WORDS
        for cpu in cpus:
            cpu %= CPU_WORDS * 64
            bitmap[cpu >> 6] |= 1 << (cpu & 63)
        for i, word in enumerate(bitmap):
            # (as a signed word: the header holds int64s)
            self.header[self._word(self.rank, CPUS + i)] = word - (1 << 64) if word >> 63 else word

    def published_cpus(self) -> set[int]:
        """The CPUs that the ranks attached so far (this one included) may run on."""
        cpus: set[int] = set()
        for rank in range(self.size):
            if self.header[self._word(rank, PHASE)] >= PHASE_PUBLISHED:
                cpus |= self.cpus_of(rank)
        return cpus

    def cpus_of(self, rank: int) -> set[int]:
        """The CPUs that ``rank`` published at attach (folded as ``publish`` folds them)."""
        cpus = set()
        for i in range(CPU_WORDS):
            word = self.header[self._word(rank, CPUS + i)] & ((1 << 64) - 1)
            while word:
                low = word & -word
                cpus.add(i * 64 + low.bit_length() - 1)
                word ^= low
        return cpus

    def open_pair(self, peer: int) -> None:
        """Connect ``peer``'s end of the pair: wait until it has attached, map the two
        channels, watch its exit (pidfd) and fetch its doorbell. Idempotent.

        PeerGone once the channels are mapped means that the peer attached and exited
        (what it sent before is in its ring); before, that it exited before attaching.
        A peer that has closed its end keeps its rings (what it sent) but no longer
        serves fds: its doorbell stays unknown (-1), and it sleeps no more.
        """
        if self.outboxes[peer] is None:
            try:
                self.await_phase(PHASE_PUBLISHED, [peer])
            finally:
                self._forget_launched()
            sleeping = self._header_view(self._word(peer, SLEEPING), 1)
            self.outboxes[peer], self.inboxes[peer] = pair_boxes(
                self._map_pair, self._head_word, self.rank, peer, self.config, sleeping,
                resident=self.config.keeps_windows(self.size))
        self._watch(peer)
        if self.fds.doorbells[peer] < 0:
            try:
                self.fds.doorbells[peer] = self._take_doorbell(peer)
            except CmaError:
                if not self.has_closed(peer):
                    raise

    def _take_doorbell(self, peer: int) -> int:
        """``peer``'s doorbell, by the number it published, checked to be an eventfd (a
        reused number may name any fd, and a doorbell is written to). The fd server's
        round trips for doorbells were 14 % of a 64-rank world's first all-peer exchange
        (docs/architecture.md, "Connect time")."""
        return self.take_fd(peer, self.header[self._word(peer, DOORBELL)], "doorbell",
                            _linux.is_eventfd)

    def take_fd(self, peer: int, number: int, name: str,
                accept: Callable[[int], bool] | None = None) -> int:
        """``peer``'s fd ``number``, taken with pidfd_getfd where ptrace rules allow (~3 us),
        else the fd it exposed as ``name``, fetched from its fd server (~50 us and a
        wake-up of its server thread); so too when ``accept(fd)`` refuses the fd taken."""
        pidfd = self.pidfds[peer]
        if pidfd >= 0 and 0 <= number < 1 << 31:
            try:
                fd = _linux.pidfd_getfd(pidfd, number)
            except OSError:  # EPERM (ptrace rules), ENOSYS (before Linux 5.6), EBADF
                fd = -1
            if fd >= 0:
                if accept is None or accept(fd):
                    return fd
                _linux.close_fd(fd)  # (the number names something else)
        return self.fetch_fd(peer, name)

    def publish_reach(self, peer: int, mask: int) -> None:
        """Publish what this rank reaches ``peer`` with, and tell ``peer`` to connect back."""
        self.header[self._reach_word(self.rank, peer)] = mask | REACH_PUBLISHED
        self.header[self._word(peer, CONNECTS)] = 1  # (after the reach word: x86 keeps the order)

    def set_phase(self, phase: int) -> None:
        """Publish this rank's connect phase (``PHASE_*``), which its peers wait for."""
        self.header[self._word(self.rank, PHASE)] = phase

    def _watch(self, rank: int) -> int:
        """The pidfd of ``rank``'s published pid, opened once (it reports the exit)."""
        if self.pidfds[rank] < 0:
            pid = self._checked_pid(rank, self.pid_of(rank))
            try:
                pidfd = _linux.pidfd_open(pid)
            except PeerGone as exc:
                raise PeerGone(f"rank {rank} (pid {pid}) exited while connecting") from exc
            try:
                self._sleep_set.add(pidfd)
            except CmaError:
                _linux.close_fd(pidfd)
                raise
            self.pidfds[rank] = pidfd
            self._peer_of_pidfd[pidfd] = rank
        return self.pidfds[rank]

    def unwatch(self, rank: int) -> None:
        """Stop watching ``rank``'s exit (it is buried): close its pidfd."""
        pidfd = self.pidfds[rank]
        if pidfd >= 0:
            self.pidfds[rank] = -1
            del self._peer_of_pidfd[pidfd]
            self._sleep_set.remove(pidfd)
            _linux.close_fd(pidfd)

    @staticmethod
    def _checked_pid(rank: int, pid: int) -> int:
        if not 0 < pid <= PID_LIMIT:
            raise ProtocolError(f"rank {rank} broke the protocol: its block of the world header "
                                f"names pid {pid}, which no process has", peer=rank)
        return pid

    def exited(self, rank: int) -> bool:
        """Whether the process that attached ``rank`` (or was started to) is known to have
        exited, for a rank not connected (no pidfd); False when no pid of it is known."""
        pid = self.pid_of(rank) or self.header[self._word(rank, LAUNCHED)]
        if not 0 < pid <= PID_LIMIT:
            return False
        try:
            pidfd = _linux.pidfd_open(pid)
        except PeerGone:
            return True
        try:
            return not _linux.process_alive(pidfd)
        finally:
            _linux.close_fd(pidfd)

    def _launched_pidfd(self, rank: int) -> tuple[int, int]:
        """(pid, pidfd) of the process announced to attach ``rank``; (0, -1) if none is known."""
        pid = self.header[self._word(rank, LAUNCHED)]
        known = self._launched.get(rank)
        if known is not None and known[0] != pid:
            _linux.close_fd(known[1])
            del self._launched[rank]
            known = None
        if not pid or pid == os.getpid():
            return 0, -1
        if known is None:
            self._checked_pid(rank, pid)
            try:
                known = (pid, _linux.pidfd_open(pid))
            except PeerGone as exc:
                raise self._gone_before_connecting(rank, pid) from exc
            self._launched[rank] = known
        return known

    def _gone_before_connecting(self, rank: int, pid: int) -> PeerGone:
        return PeerGone(f"rank {rank} (pid {pid}) exited before connecting: the process started "
                        "to use that end of the world never attached it")

    def _forget_launched(self) -> None:
        for _, pidfd in self._launched.values():
            _linux.close_fd(pidfd)
        self._launched.clear()

    def await_phase(self, phase: int, ranks: list[int]) -> None:
        """Wait until each of ``ranks`` has reached ``phase``; PeerGone if one exits first."""
        deadline = time.monotonic() + CONNECT_TIMEOUT
        pause = 1e-5
        while True:
            late = [r for r in ranks if self.header[self._word(r, PHASE)] < phase]
            if not late:
                return
            for r in late:
                if self.pid_of(r):
                    if not _linux.process_alive(self._watch(r)):
                        raise PeerGone(f"rank {r} (pid {self.pid_of(r)}) exited while connecting")
                    continue
                pid, pidfd = self._launched_pidfd(r)
                if pidfd >= 0 and not _linux.process_alive(pidfd):
                    raise self._gone_before_connecting(r, pid)
            if time.monotonic() > deadline:
                raise CmaError(self._late_message(late))
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _late_message(self, late: list[int]) -> str:
        never = [r for r in late if not self.pid_of(r)]
        started = [f"{r} (pid {self.pid_of(r)})" for r in late if self.pid_of(r)]
        parts = []
        if never:
            parts.append(
                f"rank{'s' if len(never) > 1 else ''} {', '.join(map(str, never))} never connected: "
                "no process attached that end, and no pid of one was known here, so its exit "
                "could not be told apart from a slow start"
            )
        if started:
            parts.append(f"rank{'s' if len(started) > 1 else ''} {', '.join(started)} attached but "
                         "did not finish connecting")
        return (f"rank {self.rank}: within {CONNECT_TIMEOUT:.0f} s, {'; '.join(parts)} (every "
                "process must use its communicator; CMA_CONNECT_TIMEOUT sets the limit)")

    # -- fd exposure (SCM_RIGHTS over an abstract Unix socket, same user and same world only)

    def expose_fd(self, name: str, opener: Callable[[], int]) -> None:
        """Serve the fd ``opener()`` returns to verified peers that ask for ``name`` (closed once sent)."""
        self._exposed[name] = lambda: [opener()]

    def expose_fds(self, name: str, opener: Callable[[], list[int]]) -> None:
        """Answer requests for ``name`` with the fds ``opener()`` returns (closed once sent)."""
        self._exposed[name] = opener

    def withdraw_fd(self, name: str) -> None:
        """Stop answering requests for ``name`` (a request already being answered finishes)."""
        self._exposed.pop(name, None)

    def serve(self) -> None:
        """Start the fd server before attaching (``attach`` starts it otherwise): cma.mpi's
        bootstrap hands the world's own fds so, to the pids announced in the header."""
        self._start_server()

    def _start_server(self) -> None:
        if self._server is not None:
            return
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(fd_server_address(self.fds.world_id, self.rank))
        except OSError as exc:
            server.close()
            raise CmaError(
                f"rank {self.rank} of world {self.fds.world_id} is already attached in another "
                "process: each end of a communicator is used by one process"
            ) from exc
        server.listen(max(4, self.size))
        # poll, not epoll: close()'s shutdown of the listener did not wake an epoll wait
        # (every close then waited out its 5 s join); poll wakes at once. Registered here,
        # not on the thread: a close() before the thread ran left it a closed socket.
        selector = selectors.PollSelector()
        selector.register(server, selectors.EVENT_READ)
        self._server = server
        self._server_pid = os.getpid()
        self._server_thread = threading.Thread(target=self._serve, args=(server, selector),
                                               name="cma-fd-server", daemon=True)
        self._server_thread.start()

    def _serve(self, server: socket.socket, selector: selectors.BaseSelector) -> None:
        """Answer fd requests, never waiting on one client: a silent or slow one is dropped
        after REQUEST_SECONDS while others are served, and bad ones are refused quietly."""
        waiting: dict[socket.socket, float] = {}  # accepted connection -> when it is dropped
        with selector:
            while True:
                now = time.monotonic()
                for conn in [c for c, drop_at in waiting.items() if drop_at <= now]:
                    selector.unregister(conn)
                    del waiting[conn]
                    conn.close()
                timeout = min(waiting.values(), default=now + 3600) - now
                for key, _ in selector.select(max(timeout, 0.0)):
                    if key.fileobj is server:
                        try:
                            conn, _ = server.accept()
                        except OSError:
                            for conn in waiting:
                                conn.close()
                            return  # closed
                        if self._admit(conn):
                            selector.register(conn, selectors.EVENT_READ, conn)
                            waiting[conn] = time.monotonic() + REQUEST_SECONDS
                        continue
                    conn = key.data
                    selector.unregister(conn)
                    del waiting[conn]
                    with conn:
                        self._answer(conn)

    def _admit(self, conn: socket.socket) -> bool:
        """Whether ``conn`` comes from a peer of this world owned by our user (SO_PEERCRED):
        a process that attached another rank, or one announced to (``announce``); anyone
        else is refused before the server reads a byte from it."""
        conn.setblocking(False)
        try:
            pid, uid, _ = _linux.peer_credentials(conn)
        except OSError:
            conn.close()
            return False
        peers = {self.header[self._word(r, which)] for r in range(self.size) if r != self.rank
                 for which in (PID, LAUNCHED)}
        if uid == os.getuid() and pid in peers - {0}:
            return True
        self._reply(conn, b"refused: not a process of this world owned by the same user")
        conn.close()
        return False

    def _answer(self, conn: socket.socket) -> None:
        try:
            name = conn.recv(256).decode()
        except (OSError, UnicodeDecodeError):
            self._reply(conn, b"refused: malformed request")
            return
        opener = self._exposed.get(name)
        if opener is None:
            self._reply(conn, b"refused: nothing exposed under " + name.encode())
            return
        try:
            fds = opener()
        except (CmaError, OSError) as exc:
            self._reply(conn, f"refused: {exc}".encode())
            return
        try:
            for at in range(0, len(fds), FDS_PER_MESSAGE):
                socket.send_fds(conn, [b"ok"], fds[at : at + FDS_PER_MESSAGE])
        except OSError:
            pass  # the asker went away
        finally:
            for fd in fds:
                _linux.close_fd(fd)

    @staticmethod
    def _reply(conn: socket.socket, text: bytes) -> None:
        """Send a short refusal; a client that does not take it gets nothing more."""
        try:
            conn.send(text)
        except OSError:
            pass

    def fetch_fd(self, peer: int, name: str) -> int:
        """The fd ``peer`` exposed under ``name``, through its fd server."""
        return fetch_fds(self.fds.world_id, peer, self.pid_of(peer), name)[0]

    # -- waking and sleeping

    def sleep(self, timeout_ms: int) -> list[int]:
        """Block on this rank's doorbell and the peers' pidfds; returns the peers that exited.

        The caller has set its sleeping flag and re-checked its rings already. The timeout
        bounds the rare lost wake-up: a sender's load of our flag may pass its own store
        of the head (x86 store-load reordering), and Python has no fence to prevent it.
        """
        ready = self._sleep_set.wait(timeout_ms)
        if not ready:
            return []
        bell = self.fds.doorbells[self.rank]
        peer_of = self._peer_of_pidfd
        gone = []
        for fd in ready:
            if fd == bell:
                _linux.drain_doorbell(bell)
            else:
                gone.append(peer_of[fd])
        return gone

    def set_sleeping(self, flag: int) -> None:
        """Publish this rank's about-to-sleep flag (1: a sender must ring the doorbell)."""
        self.header[self._word(self.rank, SLEEPING)] = flag

    # -- teardown

    def owned_here(self) -> bool:
        """Whether this process attached this rank (not a child that inherited it by fork)."""
        return self.pid_of(self.rank) == os.getpid()

    def mark_closed(self) -> None:
        """Tell the peers this rank reads its rings no more: what they queue for it is moot."""
        self.header[self._word(self.rank, PHASE)] = PHASE_CLOSED

    def has_closed(self, rank: int) -> bool:
        """Whether ``rank`` said it reads its rings no more."""
        return self.header[self._word(rank, PHASE)] == PHASE_CLOSED

    def close(self) -> None:
        """Stop the fd server, close the pidfds and unmap the rings and header."""
        if self._server is not None:
            # (in a forked child the listener is still the parent's; the pid is kept here,
            # not read from the header, which a peer can overwrite)
            if self._server_pid == os.getpid():
                try:
                    self._server.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._server.close()
            self._server = None
            if self._server_thread is not None:
                self._server_thread.join(timeout=5)
        self._forget_launched()
        # (the set goes first, whole: removing fds one by one from a set a forked child
        # shares with its parent would edit the parent's)
        self._sleep_set.close()
        self._peer_of_pidfd.clear()
        for i, fd in enumerate(self.pidfds):
            if fd >= 0:
                _linux.close_fd(fd)
                self.pidfds[i] = -1
        for box in [*self.outboxes, *self.inboxes]:
            if box is not None:
                for view in (box.words, box.ctl, box.data, box.staging):
                    view.release()
        self.outboxes = [None] * self.size
        self.inboxes = [None] * self.size
        self._reach_column.release()
        for view in self._views:
            view.release()
        self.header.release()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                # A view into the segment is alive (a user's, or one in an exception's traceback
                # awaiting the garbage collector): the mapping goes with the last of them, as
                # long as nothing else (PeerLinks hold this World) keeps it.
                pass
        self._maps = []


"""Bootstrap: how the processes of a world find each other and share their channels.

A world of N ranks is one memfd segment (see ``channel``) plus one eventfd doorbell
per rank. Whoever creates the world (``cma.Pipe``, the ``cma-run`` launcher, the
mpi4py plugin) hands those fds to every rank: by fork inheritance, by pickling for
``multiprocessing`` spawn, by ``pass_fds`` and the environment, or over a Unix socket.

Each rank then *attaches* in its own process (this is "connect time"): it publishes
its pid, starts a small fd server on an abstract Unix socket (nothing on disk to
leak) so verified peers can fetch fds it exposes (the vmfd transport's
/proc/self/mem), waits until every rank has attached, probes each transport
against each peer, publishes what it can reach, and waits until every rank has.
After that every rank knows, for each pair, which transports work in each
direction, so an explicitly requested transport that cannot work fails here, on
every rank, before any message moves.
"""

from __future__ import annotations

import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import _linux
from .channel import (
    LAUNCHED,
    PHASE,
    PID,
    PREAMBLE_WORDS,
    RANK_BLOCK_WORDS,
    SLEEPING,
    ChannelConfig,
    pair_views,
)
from .errors import CmaError, PeerGone, ProtocolError

ENV_WORLD = "CMA_WORLD"
ENV_TRANSPORT = "CMA_TRANSPORT"
CONNECT_TIMEOUT = float(os.environ.get("CMA_CONNECT_TIMEOUT", "60"))
# A rank's PHASE word moves up through these; peers wait until every rank reaches one.
PHASE_PUBLISHED = 1  # pid and server are up
PHASE_PROBED = 2  # reach masks towards every peer are written
PHASE_CLOSED = 3  # reads its rings no more
# The fd server drops a connection that has not sent its request by then: a peer sends
# it at once, and a silent client must not hold on to a socket for long.
REQUEST_SECONDS = 2.0
# fds a rank of an N-rank world may hold: N doorbells, and per peer a pidfd and a transport
# fd or two (docs/architecture.md, "Memory per rank"), plus the process's own
FDS_PER_RANK = 4
FDS_SPARE = 64
# The kernel's PID_MAX_LIMIT: a pid word above it (or below 1) was not written by a rank.
PID_LIMIT = 1 << 22


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
                os.close(fd)
        self.memfd = -1
        self.doorbells = []

    def to_env(self, rank: int) -> str:
        bells = ",".join(map(str, self.doorbells))
        return f"{self.world_id}:{rank}:{self.size}:{self.memfd}:{bells}:{self.config.encode()}"

    @classmethod
    def from_env(cls, text: str) -> tuple[WorldFds, int]:
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
        return [self.memfd, *self.doorbells]


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


class PeerLink:
    """What transports may know about one peer (see ``transports.base.Peer``)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.pid = world.pid_of(rank)

    def fetch_fd(self, name: str) -> int:
        return self.world.fetch_fd(self.rank, name)

    def take_fd(self, number: int, name: str) -> int:
        """The peer's fd ``number``, taken with pidfd_getfd where ptrace rules allow (~3 us),
        else the fd it exposed as ``name``, fetched from its fd server (~50 us)."""
        pidfd = self.world.pidfds[self.rank]
        if pidfd >= 0:
            try:
                return _linux.pidfd_getfd(pidfd, number)
            except OSError:  # EPERM (ptrace rules), ENOSYS (before Linux 5.6), EBADF
                pass
        return self.fetch_fd(name)


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
        # The header and this rank's own 2(N-1) channels, each mapped alone: the segment holds
        # all N(N-1) channels, and mapping it whole cost every rank O(N^2) address space.
        self._maps = [_linux.map_shared(fds.memfd, fds.config.header_bytes(fds.size))]
        header = memoryview(self._maps[0]).cast("q")
        self.header = header
        sleeping = [header[self._word(r, SLEEPING) : self._word(r, SLEEPING) + 1]
                    for r in range(self.size)]
        self.outboxes, self.inboxes = pair_views(self._map_pair, self.size, rank, fds.config, sleeping)
        self._sleeping_views = sleeping
        self.pidfds: list[int] = [-1] * self.size
        # while connecting: (pid, pidfd) of the process started to attach a late rank
        self._launched: dict[int, tuple[int, int]] = {}
        self._exposed: dict[str, Callable[[], int]] = {}
        self._server: socket.socket | None = None
        self._server_pid = 0
        self._server_thread: threading.Thread | None = None

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
        return self.header[self._word(rank, PID)]

    def reach(self, rank: int, peer: int) -> int:
        """Bitmask of transports (by registry order) that ``rank`` can use towards ``peer``."""
        return self.header[self._reach_word(rank, peer)]

    # -- connect time

    def attach(self, publish_reach: Callable[[World], dict[int, int]]) -> None:
        """Publish this rank, wait for all, probe (``publish_reach``), wait for all again."""
        self._start_server()
        self.header[self._word(self.rank, PID)] = os.getpid()
        self.header[self._word(self.rank, PHASE)] = PHASE_PUBLISHED
        self._await_phase(PHASE_PUBLISHED)
        for peer in range(self.size):
            if peer != self.rank:
                self._watch(peer)
        for peer, mask in publish_reach(self).items():
            self.header[self._reach_word(self.rank, peer)] = mask
        self.header[self._word(self.rank, PHASE)] = PHASE_PROBED
        self._await_phase(PHASE_PROBED)
        self._forget_launched()

    def _watch(self, rank: int) -> int:
        """The pidfd of ``rank``'s published pid, opened once (it reports the exit)."""
        if self.pidfds[rank] < 0:
            pid = self._checked_pid(rank, self.pid_of(rank))
            try:
                self.pidfds[rank] = _linux.pidfd_open(pid)
            except PeerGone as exc:
                raise PeerGone(f"rank {rank} (pid {pid}) exited while connecting") from exc
        return self.pidfds[rank]

    @staticmethod
    def _checked_pid(rank: int, pid: int) -> int:
        if not 0 < pid <= PID_LIMIT:
            raise ProtocolError(f"rank {rank} broke the protocol: its block of the world header "
                                f"names pid {pid}, which no process has", peer=rank)
        return pid

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

    def _await_phase(self, phase: int) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT
        pause = 1e-5
        while True:
            late = [r for r in range(self.size) if self.header[self._word(r, PHASE)] < phase]
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

    def _address(self, rank: int) -> str:
        return f"\0cma-{self.fds.world_id}-{rank}"

    def expose_fd(self, name: str, opener: Callable[[], int]) -> None:
        self._exposed[name] = opener

    def withdraw_fd(self, name: str) -> None:
        """Stop answering requests for ``name`` (a request already being answered finishes)."""
        self._exposed.pop(name, None)

    def _start_server(self) -> None:
        if self._server is not None:
            return
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(self._address(self.rank))
        except OSError as exc:
            server.close()
            raise CmaError(
                f"rank {self.rank} of world {self.fds.world_id} is already attached in another "
                "process: each end of a communicator is used by one process"
            ) from exc
        server.listen(max(4, self.size))
        self._server = server
        self._server_pid = os.getpid()
        self._server_thread = threading.Thread(target=self._serve, name="cma-fd-server", daemon=True)
        self._server_thread.start()

    def _serve(self) -> None:
        """Answer fd requests, never waiting on one client: a silent or slow one is dropped
        after REQUEST_SECONDS while others are served, and bad ones are refused quietly."""
        server = self._server
        assert server is not None
        waiting: dict[socket.socket, float] = {}  # accepted connection -> when it is dropped
        # poll, not epoll: close()'s shutdown of the listener did not wake an epoll wait
        # here (every close then waited out its 5 s join); poll wakes at once
        with selectors.PollSelector() as selector:
            selector.register(server, selectors.EVENT_READ)
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
        """Whether ``conn`` comes from a peer of this world owned by our user (SO_PEERCRED);
        anyone else is refused before the server reads a byte from it."""
        conn.setblocking(False)
        try:
            pid, uid, _ = _linux.peer_credentials(conn)
        except OSError:
            conn.close()
            return False
        peers = {self.pid_of(r) for r in range(self.size) if r != self.rank}
        if uid == os.getuid() and pid in peers:
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
            fd = opener()
        except (CmaError, OSError) as exc:
            self._reply(conn, f"refused: {exc}".encode())
            return
        try:
            socket.send_fds(conn, [b"ok"], [fd])
        except OSError:
            pass  # the asker went away
        finally:
            os.close(fd)

    @staticmethod
    def _reply(conn: socket.socket, text: bytes) -> None:
        """Send a short refusal; a client that does not take it gets nothing more."""
        try:
            conn.send(text)
        except OSError:
            pass

    def fetch_fd(self, peer: int, name: str) -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CONNECT_TIMEOUT)
            try:
                sock.connect(self._address(peer))
                sock.sendall(name.encode())
                msg, fds = _linux.recv_fds(sock, 256, 1)
            except OSError as exc:
                raise PeerGone(f"rank {peer} did not answer a request for its {name!r} fd: {exc}") from exc
            if not fds:
                reason = msg.decode(errors="replace") or "connection closed"
                raise CmaError(f"rank {peer} did not pass its {name!r} fd: {reason}")
            return fds[0]

    # -- waking and sleeping

    def sleep(self, timeout_ms: int) -> list[int]:
        """Block on this rank's doorbell and the peers' pidfds; returns the peers that exited.

        The caller has set its sleeping flag and re-checked its rings already. The timeout
        bounds the rare lost wake-up: a sender's load of our flag may pass its own store
        of the head (x86 store-load reordering), and Python has no fence to prevent it.
        """
        bell = self.fds.doorbells[self.rank]
        live = [fd for fd in self.pidfds if fd >= 0]
        ready = _linux.wait_readable([bell, *live], timeout_ms)
        if bell in ready:
            _linux.drain_doorbell(bell)
        return [r for r, fd in enumerate(self.pidfds) if fd >= 0 and fd in ready]

    def set_sleeping(self, flag: int) -> None:
        self.header[self._word(self.rank, SLEEPING)] = flag

    # -- teardown

    def owned_here(self) -> bool:
        """Whether this process attached this rank (not a child that inherited it by fork)."""
        return self.pid_of(self.rank) == os.getpid()

    def mark_closed(self) -> None:
        """Tell the peers this rank reads its rings no more: what they queue for it is moot."""
        self.header[self._word(self.rank, PHASE)] = PHASE_CLOSED

    def has_closed(self, rank: int) -> bool:
        return self.header[self._word(rank, PHASE)] == PHASE_CLOSED

    def close(self) -> None:
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
        for i, fd in enumerate(self.pidfds):
            if fd >= 0:
                os.close(fd)
                self.pidfds[i] = -1
        for box in [*self.outboxes, *self.inboxes]:
            if box is not None:
                for view in (box.words, box.ctl, box.data, box.staging):
                    view.release()
        for view in self._sleeping_views:
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


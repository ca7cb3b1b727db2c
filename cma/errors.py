"""Exceptions raised by cma. Every one says what went wrong and what to do about it."""

from __future__ import annotations


class CmaError(Exception):
    """Base class of every error cma raises."""


class InvalidRank(CmaError, ValueError):
    """A rank outside ``0 .. size-1`` (and not a wildcard where one is allowed)."""


class InvalidTag(CmaError, ValueError):
    """A tag that is negative (and not ``ANY_TAG`` where one is allowed)."""


class InvalidConfig(CmaError, ValueError):
    """Channel sizes (``ChannelConfig``) that the rings and staging cannot be built with."""


class BufferError(CmaError, TypeError):
    """A buffer that cannot be used: not contiguous, read-only for a receive, bad spec."""


class InvalidDatatype(BufferError):
    """A buffer spec's datatype that is not a NumPy typechar or dtype of fixed-size values."""


class InvalidCount(BufferError, ValueError):
    """A buffer spec's count that is not a non-negative integer."""


class TruncationError(CmaError):
    """The matched message is larger than the receive buffer.

    The message is consumed (as in MPI): no other receive can match it afterwards.
    """

    def __init__(self, message: str, *, source: int, tag: int, nbytes: int, capacity: int):
        super().__init__(message)
        self.source = source
        self.tag = tag
        self.nbytes = nbytes
        self.capacity = capacity


class MessageTooLarge(CmaError, MemoryError):
    """A message more than this machine's memory and swap would have to be allocated:
    an object to pickle-receive, or a copy for a buffered send. Refused before anything
    is allocated or sent; a receive that matched such a message consumed it (as in
    truncation). Large data goes with ``Send``/``Recv`` into buffers of the caller's own."""


class PeerGone(CmaError, ConnectionError):
    """The peer process exited (or its memory vanished) while we needed it."""


class TransportUnavailable(CmaError, RuntimeError):
    """A transport cannot be used with a peer; the message says why and how to fix it."""


class TransportFault(CmaError, OSError):
    """A transport copy failed part way, e.g. the peer's region is no longer mapped."""


class FdAlreadyClosed(CmaError, OSError):
    """cma closed a file descriptor that was not open (EBADF): it closed it twice, a bug in
    cma. Had the number been reused in between, the second close would have ended another
    file of this process; please report it."""


class WindowError(CmaError, PermissionError):
    """An access outside the memory window a peer exposed was refused before any copy."""


class Cancelled(CmaError):
    """The receive was withdrawn from matching before any message matched it.

    An exception (a ``KeyboardInterrupt``, a timeout) left its ``Wait``; nothing was or
    will be received into its buffer, and the next receive takes the message it would have.
    """


class RequestActive(CmaError, RuntimeError):
    """A persistent request started again while active: complete it (Wait, Test) first."""


class CommClosed(CmaError):
    """The communicator was closed; make a new world (cma.Pipe, cma-run) to talk again."""


class ConcurrentUse(CmaError, RuntimeError):
    """A second thread called into a communicator while another thread was inside a call
    on it. Refused before anything was touched: the other thread's call goes on, and the
    communicator stays usable. Use one communicator per thread, or a lock of your own."""


class CommBroken(CmaError, RuntimeError):
    """The communicator cannot be used any more: an exception interrupted it half way
    through bookkeeping it shares with its peers. Close it and make a new world."""


class ProtocolError(CmaError):
    """A peer broke the protocol: bytes it shares with this rank (its ring, a packet, a
    rendezvous descriptor, the world header) make no sense. ``peer`` is its rank.

    Raised where the bytes are decoded, before anything is copied on their word; the
    communicator is then broken (later calls raise ``CommBroken`` saying why). A peer
    gets there by corrupting its shared mappings (a bug or a hostile program), never by
    using cma's API. One exception: an object message whose pickle stream does not load
    here (corrupt bytes, or a class this process cannot import) raises it from ``recv``
    or ``wait``, and only that message is lost; the communicator stays usable."""

    def __init__(self, message: str, *, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class NotTransferable(CmaError, TypeError):
    """A communicator that cannot be handed to another process (pickled) in its state."""


class RegistrationCacheFull(CmaError, MemoryError):
    """A registration cache at its limit could not make room: every mapping is in use.

    Nothing was evicted or mapped; release leases (or raise the limit) and try again.
    """


class StaleRegistration(CmaError, RuntimeError):
    """A registration lease used after its release, or after its memory went away."""

"""What the layers above agree on and nothing below needs: rank and tag wildcards, the
kinds of control packet, and ``Region``. The bottom of the package (docs/architecture.md,
"Import floors"): it imports nothing of cma, so the sans-IO protocol and the ring can
share these without the protocol loading a transport or ctypes."""

from __future__ import annotations

from typing import NamedTuple

ANY_SOURCE = -2
ANY_TAG = -1
PROC_NULL = -1
UNDEFINED = -32766  # Waitany of no active request (mpi4py's MPI.UNDEFINED)

# Tags below zero are cma's own (barrier, collectives): ANY_TAG never matches them.
BARRIER_TAG = -10
TAG_MAX = 2**63 - 1  # a packet holds the tag in an int64 word
COLLECTIVE_TAG = -11  # every message of cma.collectives

# packet kinds (word 0 of a control packet)
EAGER = 1
RTS = 2
CTS = 3
FIN = 4
UNMAP = 5  # a sender gave heap segments back: payload (index, generation) pairs, aux their count
OBJECT = 0x100  # flag on EAGER/RTS: the payload is a pickle stream (+ out-of-band buffers)
# flag on EAGER: a synchronous send (Ssend), complete only once matched; aux holds its
# msgid, which the receiver's FIN names when a receive takes the message
SYNC = 0x400
MORE = 0x200  # flag: the packet's payload continues in the next packet (a split control packet)
KIND_MASK = 0xFF
# A packet is four words (kind, tag, payload size, aux) and its payload. What aux holds is
# the kind's: EAGER|SYNC the send's msgid (which FIN names back), EAGER 0, RTS the message's
# size, CTS the msgid it answers, FIN the id (msgid or recvid) of the operation whose copy
# the peer finished, UNMAP how many segments its payload names.


class Region(NamedTuple):
    """``nbytes`` bytes starting at virtual address ``addr`` in the owner's address space."""

    addr: int
    nbytes: int


class HeapRef(NamedTuple):
    """Where a send buffer lies in its owner's shared heap (``cma.heap``), as an RTS offers it
    for ``xmap``: the segment's index (``segment``) and generation (never reused: stale mappings are told
    apart by it), the buffer's byte offset in the segment's file, the bytes of the file a
    mapping needs (``extent``), the owner's fd number for it (``pidfd_getfd``) and its inode
    (checked on the fd received, whichever way it came)."""

    segment: int
    generation: int
    offset: int
    extent: int
    fd: int
    inode: int

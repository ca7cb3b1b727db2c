"""Collectives over ranks on several nodes: a step among each node's ranks through cma,
one among the nodes' leaders through MPI, then a node step again (the shape of Open
MPI's HAN component). A node's leader is its lowest rank; a rank alone on its node is
its own leader and has no node step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..collectives import IN_PLACE, Op, _array_op, _in_type_of, _is_in_place, _message
from ..comm import Comm as CmaComm
from ..errors import InvalidDatatype
from .datatypes import pair_datatype

if TYPE_CHECKING:
    from .node import NodeComm

# the collectives that go this way; the others are MPI's on a communicator of several nodes
HIERARCHICAL = ("Bcast", "Reduce", "Allreduce", "Gather", "Scatter", "Allgather")


class Hierarchy:
    """This rank's node and the leaders' MPI communicator (made collectively, once)."""

    def __init__(self, comm: MPI.Intracomm, node: NodeComm | None, node_ranks: list[int]) -> None:
        self.rank = comm.Get_rank()
        self.node = node
        self.local = {r: i for i, r in enumerate(node_ranks)}  # rank -> node rank, this node
        mine = node_ranks[0] if node_ranks else self.rank
        leader_of = MPI.Intracomm.allgather(comm, mine)
        leaders = sorted(set(leader_of))
        self.leads = mine == self.rank
        # rank of the wrapped comm -> the rank of its node's leader among the leaders
        self.leader_index = [leaders.index(leader) for leader in leader_of]
        # every rank, node by node (in leader order), each node's in rank order: where
        # the leaders' gather puts each rank's block
        self.node_order = sorted(range(len(leader_of)), key=lambda r: (self.leader_index[r], r))
        self.node_sizes = [self.leader_index.count(i) for i in range(len(leaders))]
        self.leaders = MPI.Intracomm.Split(comm, 0 if self.leads else MPI.UNDEFINED,
                                           key=self.rank)

    def free(self) -> None:
        """Free the leaders' communicator (``cma.mpi.Comm.Free`` calls it)."""
        if self.leaders != MPI.COMM_NULL:
            self.leaders.Free()

    def _holds(self, rank: int) -> bool:
        """Whether ``rank`` is on this rank's node."""
        return self.leader_index[rank] == self.leader_index[self.rank]

    # -- the collectives

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """``MPI.Comm.Bcast`` over nodes: cma on the root's node, MPI between leaders, cma on the others."""
        node, here = self.node, self._holds(root)
        if here and node is not None:
            CmaComm.Bcast(node, buf, root=self.local[root])
        if self.leads:  # (as bytes: a Bcast combines nothing, and mpi4py maps few dtypes)
            data = _message(buf, writable=root != self.rank).view(np.uint8)
            MPI.Intracomm.Bcast(self.leaders, [data, MPI.BYTE], root=self.leader_index[root])
        if not here and node is not None:
            CmaComm.Bcast(node, buf, root=0)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any, root: int, node_op: Any) -> None:
        """``MPI.Comm.Reduce`` over nodes: cma reduces each node at its leader, MPI reduces the leaders'
        results at the root's leader, which hands it to the root if needed. Every rank
        combines in sendbuf's type and the root casts the result into its recvbuf last, as
        cma's Reduce does on one node."""
        at_root = root == self.rank
        data = _message(recvbuf if at_root and _is_in_place(sendbuf) else sendbuf, writable=False)
        op = _checked_op(data.dtype, op, node_op)
        result = None
        if at_root:  # (read and its size checked before any step, as cma's Reduce's root does;
            # its dtype, as there, by the cast at the end)
            result = _message(recvbuf, writable=True)
            if result.size != data.size:
                raise BufferError(f"recvbuf holds {result.size} elements, sendbuf {data.size}")
        into = result if result is not None and result.dtype == data.dtype else None
        partial = self._node_reduce(data, into, node_op)
        here = self._holds(root)
        if self.leads:
            assert partial is not None
            spec = _spec(partial)
            MPI.Intracomm.Reduce(self.leaders, MPI.IN_PLACE if here else spec,
                                 spec if here else None, op, root=self.leader_index[root])
        if here and self.leads != at_root:
            node = self.node  # (the root is not its node's leader: the leader hands it on)
            assert node is not None
            if self.leads:
                node._coll_wait(node._coll_send(partial, self.local[root]))
            else:
                partial = np.empty_like(data) if into is None else into
                node._coll_wait(node._coll_recv(partial, 0))
        if result is not None and partial is not result:  # (the root's cast, last)
            assert partial is not None
            np.copyto(result, partial)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any, node_op: Any) -> None:
        """``MPI.Comm.Allreduce`` over nodes: cma reduces each node, MPI allreduces the leaders, cma
        broadcasts. Every rank combines in recvbuf's type, casting its input first, as
        cma's Allreduce does on one node."""
        result = _message(recvbuf, writable=True)
        data = result if _is_in_place(sendbuf) else _message(sendbuf, writable=False)
        if data.size != result.size:
            raise BufferError(f"recvbuf holds {result.size} elements, sendbuf {data.size}")
        data = _in_type_of(result, data)
        op = _checked_op(result.dtype, op, node_op)
        self._node_reduce(data, result if self.leads else None, node_op)
        if self.leads:
            MPI.Intracomm.Allreduce(self.leaders, MPI.IN_PLACE, _spec(result), op)
        if self.node is not None:
            CmaComm.Bcast(self.node, result, root=0)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``MPI.Comm.Gather`` over nodes: cma gathers each node's blocks at its leader, MPI
        gathers the leaders' (a node's blocks are one piece) at the root's leader, which
        puts them in rank order and hands them to the root if needed."""
        size, at_root = len(self.node_order), root == self.rank
        if at_root:
            data = _message(recvbuf, writable=True, blocks=size).view(np.uint8)
            nbytes = data.size // size
            mine = data[root * nbytes : (root + 1) * nbytes] if _is_in_place(sendbuf) \
                else _message(sendbuf, writable=False).view(np.uint8)[:nbytes]
        else:
            mine = _message(sendbuf, writable=False).view(np.uint8)
            nbytes = mine.size
        node, here = self.node, self._holds(root)
        if not self.leads:
            assert node is not None  # (a rank alone on its node leads it)
            CmaComm.Gather(node, mine, None, root=0)
            if at_root:
                node._coll_wait(node._coll_recv(data, 0))
            return
        pieces = self._node_pieces(mine, nbytes)
        whole = np.empty(size * nbytes if here else 0, np.uint8)
        MPI.Intracomm.Gatherv(self.leaders, [pieces, MPI.BYTE],
                              [whole, [n * nbytes for n in self.node_sizes], MPI.BYTE] if here
                              else None, root=self.leader_index[root])
        if not here:
            return
        ordered = data if at_root else np.empty(size * nbytes, np.uint8)
        if nbytes:
            ordered.reshape(size, nbytes)[self.node_order] = whole.reshape(size, nbytes)
        if not at_root:
            assert node is not None
            node._coll_wait(node._coll_send(ordered, self.local[root]))

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``MPI.Comm.Scatter`` over nodes: the root's blocks go to its leader if needed, MPI
        scatters each node's blocks (one piece) to the leaders, cma each block on the node."""
        size, at_root = len(self.node_order), root == self.rank
        out = None if at_root and _is_in_place(recvbuf) \
            else _message(recvbuf, writable=True).view(np.uint8)
        if at_root:
            data = _message(sendbuf, writable=False, blocks=size).view(np.uint8)
            nbytes = data.size // size
        else:
            assert out is not None
            nbytes = out.size
        node, here = self.node, self._holds(root)
        if here and self.leads != at_root:
            assert node is not None  # (the root is not its node's leader: it hands it over)
            if at_root:
                node._coll_wait(node._coll_send(data, 0))
            else:
                data = np.empty(size * nbytes, np.uint8)
                node._coll_wait(node._coll_recv(data, self.local[root]))
        if not self.leads:
            assert node is not None  # (a root keeping its block in place takes it all the same)
            CmaComm.Scatter(node, None, np.empty(nbytes, np.uint8) if out is None else out, root=0)
            return
        by_node = None
        if here:
            by_node = data.reshape(size, nbytes)[self.node_order].reshape(-1) if nbytes \
                else data[:0]
        pieces = np.empty(self.node_sizes[self.leader_index[self.rank]] * nbytes, np.uint8)
        MPI.Intracomm.Scatterv(self.leaders,
                               [by_node, [n * nbytes for n in self.node_sizes], MPI.BYTE]
                               if here else None, [pieces, MPI.BYTE],
                               root=self.leader_index[root])
        if node is not None:
            CmaComm.Scatter(node, pieces, IN_PLACE if out is None else out, root=0)
        elif out is not None:
            np.copyto(out, pieces[:nbytes])

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """``MPI.Comm.Allgather`` over nodes: cma gathers each node's blocks at its leader, MPI
        allgathers the leaders' (a node's blocks are one piece), cma broadcasts the whole."""
        size = len(self.node_order)
        data = _message(recvbuf, writable=True, blocks=size).view(np.uint8)
        nbytes = data.size // size  # one rank's block
        mine = data[self.rank * nbytes : (self.rank + 1) * nbytes] if _is_in_place(sendbuf) \
            else _message(sendbuf, writable=False).view(np.uint8)[:nbytes]
        node = self.node
        if self.leads:
            pieces = self._node_pieces(mine, nbytes)
            gathered = np.empty(size * nbytes, np.uint8)
            MPI.Intracomm.Allgatherv(self.leaders, [pieces, MPI.BYTE],
                                     [gathered, [n * nbytes for n in self.node_sizes], MPI.BYTE])
            if nbytes:
                data.reshape(size, nbytes)[self.node_order] = gathered.reshape(size, nbytes)
        elif node is not None:
            CmaComm.Gather(node, mine, None, root=0)
        if node is not None:
            CmaComm.Bcast(node, data, root=0)

    def _node_pieces(self, mine: np.ndarray, nbytes: int) -> np.ndarray:
        """At a leader: its node's blocks (``mine`` first), gathered through cma."""
        pieces = np.empty(self.node_sizes[self.leader_index[self.rank]] * nbytes, np.uint8)
        if self.node is not None:
            CmaComm.Gather(self.node, mine, pieces, root=0)
        else:
            np.copyto(pieces, mine)
        return pieces

    def _node_reduce(self, data: np.ndarray, result: np.ndarray | None, node_op: Any
                     ) -> np.ndarray | None:
        """Combine the node's inputs at its leader, into ``result`` if given there (of
        ``data``'s dtype), else into a new array: the leader's array; None elsewhere."""
        if not self.leads:
            assert self.node is not None  # (a rank alone on its node leads it)
            CmaComm.Reduce(self.node, data, None, op=node_op, root=0)
            return None
        out = np.empty_like(data) if result is None else result
        same = out.ctypes.data == data.ctypes.data
        if self.node is not None:
            CmaComm.Reduce(self.node, IN_PLACE if same else data, out, op=node_op, root=0)
        elif not same:
            np.copyto(out, data[: out.size])
        return out


# The dtype kinds MPI defines each predefined op on (MPI 4.1, section 6.9.2: MAX and MIN on
# integers and floats, SUM and PROD on complex too, the logical ops on integers and C's
# bool, the bitwise ones on integers; MINLOC and MAXLOC on the pairs); cma's ops take more
# (SUM of bools, LAND of floats), which MPI's step between nodes would refuse.
_MPI_OP_KINDS = ((MPI.MAX, "iuf"), (MPI.MIN, "iuf"), (MPI.SUM, "iufc"), (MPI.PROD, "iufc"),
                 (MPI.LAND, "iub"), (MPI.LOR, "iub"), (MPI.LXOR, "iub"), (MPI.BAND, "iu"),
                 (MPI.BOR, "iu"), (MPI.BXOR, "iu"), (MPI.MINLOC, "pair"), (MPI.MAXLOC, "pair"))


def _checked_op(dtype: np.dtype, op: Any, node_op: Any) -> Any:
    """The MPI op for the leaders' step (mpi4py's for one of cma's own), after raising
    InvalidDatatype where either step could not reduce ``dtype``: the node's op refuses
    it (as the node step would, which a rank alone on its node has not), mpi4py cannot
    name it, or MPI does not define the predefined op on it. Every rank calls it before
    any step, with the same dtype and op, so every rank raises (a leader raising in MPI's
    step would leave its node waiting)."""
    _array_op(node_op).check(dtype)
    if isinstance(op, Op):
        op = getattr(MPI, op.name)
    kinds = next((kinds for known, kinds in _MPI_OP_KINDS if op == known), None)  # (None: a
    # user's op, which MPI applies to any datatype)
    if kinds is None:
        defined = True
    elif kinds == "pair":
        defined = dtype.names is not None
    else:
        defined = dtype.names is None and dtype.kind in kinds
    if not _named(dtype) or not defined:
        raise InvalidDatatype(f"MPI's step between nodes cannot reduce arrays of dtype {dtype} "
                              f"with {op!r} (MPI defines its predefined ops on native numbers, "
                              "C's bool and the MINLOC/MAXLOC pairs, each on some of them)")
    return op


def _named(dtype: np.dtype) -> bool:
    """Whether the leaders' MPI step can name ``dtype``: mpi4py maps a native number or
    bool itself, and a (value, index) pair of MINLOC and MAXLOC is its pair type."""
    if dtype.names:
        return pair_datatype(dtype) is not None
    return dtype.isnative and dtype.kind in "biufc"


def _spec(array: np.ndarray) -> Any:
    """``array`` as the leaders' MPI reduction takes it (its dtype ``_named``): bare, or a
    pair with its pair type."""
    return [array, pair_datatype(array.dtype)] if array.dtype.names else array

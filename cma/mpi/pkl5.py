"""``mpi4py.util.pkl5`` over a cma.mpi.Comm: its messages go through the wrapper.

pkl5 calls mpi4py's C methods unbound on its communicator (``MPI.Comm.Send(comm, ...)``,
``MPI.Message.Recv(message, ...)``), looking ``MPI`` up in its module's globals at each
call. A C method acts on the MPI handle, which no Python subclass can take over, so this
module gives pkl5 its own view of mpi4py's ``MPI``: the same names, except that ``Comm``
and ``Message`` stand for classes whose methods look at their first argument first.

- ``pkl5.Comm(c)`` with ``c`` a cma.mpi.Comm (or a pkl5 communicator built so) marks
  the new communicator with ``c``; ``MPI.Comm.X(comm, ...)`` on a marked communicator
  is ``c.X(...)`` for every method cma.mpi.Comm overrides.
- ``MPI.Message.X(message, ...)`` on a cma.mpi.Message is its own ``X``.
- Anything else is mpi4py's, for a cost of one attribute look-up per call (docs/mpi.md,
  "mpi4py.util.pkl5").
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from .comm import Comm, Message

ROUTED = "_cma_mpi_comm"  # the attribute that marks a pkl5 communicator with its wrapper


def routed_to(comm: Any) -> Comm | None:
    """The cma.mpi.Comm whose methods serve ``comm``'s pkl5 traffic, if any."""
    if isinstance(comm, Comm):
        # every rank of a wrapper must route alike: pkl5's collectives are the wrapper's,
        # which differ from MPI's on ranks of several nodes (even on a rank alone on its
        # node, which has no cma); a disabled wrapper forwards everything to MPI
        return comm
    return getattr(comm, ROUTED, None)


def _new(cls: type, comm: Any = None) -> MPI.Comm:
    made: MPI.Comm = MPI.Comm.__new__(cls, comm)
    wrapper = routed_to(comm)
    if wrapper is not None:
        try:
            setattr(made, ROUTED, wrapper)
        except AttributeError:  # a subclass with __slots__: it stays on MPI's channel
            pass
    return made


def _comm_method(name: str, unbound: Callable[..., Any]) -> Callable[..., Any]:
    def call(comm: Any, *args: Any, **kwargs: Any) -> Any:
        wrapper = getattr(comm, ROUTED, None)
        if wrapper is None:
            return unbound(comm, *args, **kwargs)
        return getattr(wrapper, name)(*args, **kwargs)  # (an instance's handed-out methods too)
    call.__name__ = call.__qualname__ = name
    return call


def _message_method(name: str, unbound: Callable[..., Any]) -> Callable[..., Any]:
    def call(message: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(message, Message):
            return getattr(message, name)(*args, **kwargs)
        return unbound(message, *args, **kwargs)
    call.__name__ = call.__qualname__ = name
    return call


def _overridden(base: type, ours: type) -> list[str]:
    """The instance methods of ``base`` that ``ours`` defines anew."""
    def static(cls: type, name: str) -> Any:
        return inspect.getattr_static(cls, name, None)
    return [name for name in dir(base) if not name.startswith("_")
            and inspect.ismethoddescriptor(static(base, name))
            and not isinstance(static(base, name), (classmethod, staticmethod))
            and static(ours, name) is not static(base, name)]


class _StandIn(type):
    """The type of a stand-in: pkl5 asks ``isinstance(x, MPI.Message)`` of mpi4py's objects."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.__mro__[1])

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls.__mro__[1])


def _stand_in(base: type, ours: type, method: Callable[[str, Callable[..., Any]], Callable[..., Any]],
              extra: dict[str, Any]) -> type:
    """A subclass of ``base`` (never instantiated) whose methods that ``ours`` overrides
    are ``method``'s dispatchers, called unbound as pkl5 calls them."""
    names = {name: staticmethod(method(name, getattr(base, name))) for name in _overridden(base, ours)}
    return _StandIn(base.__name__, (base,), {**names, **extra, "__slots__": (),
                                             "__doc__": f"pkl5's MPI.{base.__name__} (cma.mpi.pkl5)"})


def mpi_view() -> types.ModuleType:
    """mpi4py's ``MPI`` as pkl5 is to see it: every name, with ``Comm`` and ``Message`` routed."""
    view = types.ModuleType(MPI.__name__, MPI.__doc__)
    view.__dict__.update({k: v for k, v in vars(MPI).items() if not k.startswith("__")})
    view.Comm = _stand_in(MPI.Comm, Comm, _comm_method,  # type: ignore[attr-defined]
                          {"__new__": staticmethod(_new)})
    view.Message = _stand_in(MPI.Message, Message, _message_method, {})  # type: ignore[attr-defined]
    return view


def install() -> None:
    """Give ``mpi4py.util.pkl5`` (if this mpi4py has it) the routed view of ``MPI``."""
    try:
        from mpi4py.util import pkl5
    except ImportError:
        return
    if getattr(pkl5, "MPI", None) is MPI:
        pkl5.MPI = mpi_view()  # type: ignore[attr-defined]

"""Wildcard receives on a rank with peers on its node and elsewhere: who may take what.

Such a receive waits (``Comm._deferred``) until a probe of either channel finds its
message; receives posted after it that could take the same messages wait behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .mpiapi import ANY_SOURCE, ANY_TAG

if TYPE_CHECKING:
    from .requests import Request


def overlap(waiting: Request, source: int, tag: int) -> bool:
    """Whether a waiting receive and a receive for (source, tag) could take the same message."""
    assert waiting._spec is not None
    _, wanted_source, wanted_tag = waiting._spec
    return (wanted_source == source or wanted_source == ANY_SOURCE or source == ANY_SOURCE) and \
        (wanted_tag == tag or wanted_tag == ANY_TAG or tag == ANY_TAG)


def owner(waiting: Sequence[Request], source: int, tag: int) -> bool:
    """Whether one of the waiting receives matches a message from ``source`` with ``tag``."""
    for req in waiting:
        assert req._spec is not None
        _, wanted_source, wanted_tag = req._spec
        if (wanted_source == source or wanted_source == ANY_SOURCE) and \
                (wanted_tag == tag or wanted_tag == ANY_TAG):
            return True
    return False

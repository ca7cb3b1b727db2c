"""Wildcard receives on a rank with peers on its node and elsewhere: who may take what."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .mpiapi import ANY_SOURCE, ANY_TAG

if TYPE_CHECKING:
    from .requests import RoutedRequest


def overlap(a: RoutedRequest, source: int, tag: int) -> bool:
    """Whether receive ``a`` and a receive for (source, tag) could take the same message."""
    return (a._source == source or a._source == ANY_SOURCE or source == ANY_SOURCE) and \
        (a._tag == tag or a._tag == ANY_TAG or tag == ANY_TAG)


def owner(waiting: Sequence[RoutedRequest], source: int, tag: int) -> bool:
    """Whether one of the waiting receives matches a message from ``source`` with ``tag``."""
    return any((w._source == source or w._source == ANY_SOURCE)
               and (w._tag == tag or w._tag == ANY_TAG) for w in waiting)


"""The one :class:`PreservedBook` of each LMDeploy ``Engine``, shared by the engine-process patches."""

from __future__ import annotations

import os
from typing import Any

from lmdeploy_pdfix.preserved import DEFAULT_ORPHAN_TTL_S, PreservedBook

ORPHAN_TTL_ENV = 'LMDEPLOY_PDFIX_ORPHAN_TTL_S'
_ATTRIBUTE = '_lmdeploy_pdfix_preserved_book'


def orphan_ttl_s() -> float:
    return float(os.environ.get(ORPHAN_TTL_ENV, DEFAULT_ORPHAN_TTL_S))


def book_of(engine: Any) -> PreservedBook:
    """``engine``'s book of preserved caches, created on first use."""
    book = getattr(engine, _ATTRIBUTE, None)
    if book is None:
        book = PreservedBook(orphan_ttl_s=orphan_ttl_s())
        setattr(engine, _ATTRIBUTE, book)
    return book

"""The one :class:`PreservedBook` of each LMDeploy ``Engine``, shared by the engine-process patches."""

from __future__ import annotations

from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.preserved import PreservedBook

_ATTRIBUTE = '_lmdeploy_pdfix_preserved_book'


def book_of(engine: Any) -> PreservedBook:
    """``engine``'s book of preserved caches, created on first use."""
    book = getattr(engine, _ATTRIBUTE, None)
    if book is None:
        book = PreservedBook(orphan_ttl_s=settings.ORPHAN_TTL_S.value(), claim_hold_s=settings.claim_hold_s())
        setattr(engine, _ATTRIBUTE, book)
    return book

"""The cache owner: which internal Prefill scheduler session holds a preserved KV cache.

A Prefill node answering a ``with_cache`` request names the owner in ``cache_session_id``
(:mod:`lmdeploy_pdfix.protocol`). The proxy carries it, and only it, to the Decode node
(``migration_request.remote_session_id``) and into every release. The public response ``id`` is never an
owner: for chat it is ``chatcmpl-…``, for completions it is the caller's ``session_id`` (``-1`` by default).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

# An owner id is ``incarnation << 32 | n``: each api_server process numbers its sessions from a fresh random
# base, so an id from before a node restart can never name a session of the restarted node (D14), and the
# node that consumes an id can tell a stale one from an unknown one.
INCARNATION_SHIFT = 32
_INCARNATIONS = 2**30  # keeps every owner id below 2**62


def new_incarnation() -> int:
    return 1 + secrets.randbelow(_INCARNATIONS - 1)


def first_session_id(incarnation: int) -> int:
    return incarnation << INCARNATION_SHIFT


def incarnation_of(owner: int) -> int:
    return owner >> INCARNATION_SHIFT


def is_owner_id(value: Any) -> bool:
    """Internal scheduler session ids are non-negative ints."""
    return is_index(value)


def is_index(value: Any) -> bool:
    # bool is an int subclass, but True is never a session, block or token id; the engine keeps them in 64 bits
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 63


def single_owner(session_ids: Sequence[int]) -> int | None:
    """The owner of a request that created exactly one scheduler session; None for zero or several."""
    return session_ids[0] if len(session_ids) == 1 else None


def finished_without_tokens(finish_reason: str | None, generated_tokens: int) -> bool:
    """A generation that ended before producing a token (its first token was a stop token)."""
    return finish_reason is not None and generated_tokens == 0

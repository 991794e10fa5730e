"""The cache owner: which internal Prefill scheduler session holds a preserved KV cache.

A Prefill node answering a ``with_cache`` request names the owner in ``cache_session_id``
(:mod:`lmdeploy_pdfix.domain.protocol`). The proxy carries it, and only it, to the Decode node
(``migration_request.remote_session_id``) and into every release. The public response ``id`` is never an
owner: for chat it is ``chatcmpl-…``, for completions it is the caller's ``session_id`` (``-1`` by default).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

# Session ids, and so owner ids, are 0, 1, 2, … run through a keyed permutation of the 62-bit integers, with a
# fresh random key per session manager (so per api_server process and restart). Knowing one id tells nothing
# of any other, so nobody can name, and free, a cache from a neighbour's id; and an id from before a restart
# names a session after it only by a 2**-62 chance (D14). A Feistel network keeps it a permutation: no two
# sessions of one process ever share an id.
_HALF_BITS = 31
_HALF_MASK = (1 << _HALF_BITS) - 1
_ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudorandom function give a strong pseudorandom permutation


def unguessable_session_ids() -> Iterator[int]:
    """A session manager's id sequence: distinct, below 2**62, unpredictable without its key."""
    key = secrets.token_bytes(16)
    return (permuted(key, n) for n in itertools.count())


def permuted(key: bytes, n: int) -> int:
    left, right = n >> _HALF_BITS, n & _HALF_MASK
    for round_index in range(_ROUNDS):
        left, right = right, left ^ _round(key, round_index, right)
    return left << _HALF_BITS | right


def _round(key: bytes, round_index: int, half: int) -> int:
    digest = hashlib.blake2b(bytes((round_index,)) + half.to_bytes(4, 'big'), key=key, digest_size=4).digest()
    return int.from_bytes(digest, 'big') & _HALF_MASK


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

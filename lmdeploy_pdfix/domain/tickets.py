"""Cache tickets: a Prefill node vouches for the blocks of a cache it preserved, so a Decode node can check a
``migration_request`` without a round trip (issue 14). No patching here.

A ticket is an HMAC, with a key only the Prefill node's api_server process holds, over the cache owner, its
block ids and an expiry (the end of the orphan TTL). A Decode node that has the key (it asks the Prefill node
once, with the node credentials) knows, before its engine sees the request, that the owner and blocks are
exactly what the Prefill preserved: a forged or mistyped migration never reaches the engine. That the cache is
still preserved (not freed, reclaimed or aborted since) is the claim's to confirm; with a ticket the claim
runs while the Decode migrates instead of before, and the answer waits for it.

A Prefill restart makes a new key with a new key id, so a ticket of an earlier incarnation never verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

_VERSION = 'v1'
_MAC_BYTES = 16
MAX_TICKET_CHARS = 128
# key id, expiry (ASCII digits: str.isdigit() also takes '²', which int() refuses) and MAC (ASCII hex)
_TICKET = re.compile(rf'{_VERSION}\.([0-9a-f]{{1,32}})\.([0-9]{{1,12}})\.([0-9a-f]{{{2 * _MAC_BYTES}}})')


class TicketError(ValueError):
    """A ticket that does not vouch for the cache it came with; the message says why, briefly."""


class StaleTicketError(TicketError):
    """A ticket made with a key this Prefill node no longer holds (an earlier incarnation's)."""


class ExpiredTicketError(TicketError):
    """A ticket whose cache's orphan TTL has passed: the cache may have been reclaimed."""


class Voucher(NamedTuple):
    """What a verified ticket vouched for, as a Decode node remembers it: its MAC (one per cache) and expiry."""

    mac: bytes
    expires_at: int


@dataclass(frozen=True)
class TicketKey:
    """One Prefill node incarnation's ticket key: an id that names it, and the secret."""

    key_id: str
    secret: bytes

    @classmethod
    def generate(cls) -> TicketKey:
        return cls(key_id=secrets.token_hex(8), secret=secrets.token_bytes(32))

    def issue(self, owner: int, block_ids: Sequence[int], expires_at: float) -> str:
        expiry = int(expires_at)
        return f'{_VERSION}.{self.key_id}.{expiry}.{self._mac(expiry, owner, block_ids)}'

    def verify(self, ticket: str, owner: int, block_ids: Sequence[int], now: float, longest_s: float) -> Voucher:
        """``ticket``'s voucher if it vouches for ``owner`` holding exactly ``block_ids`` and expires within
        ``longest_s`` of ``now`` (no Prefill issues a longer one); else raise :class:`TicketError`."""
        key_id, expiry, mac = _parts(ticket)
        if key_id != self.key_id:
            raise StaleTicketError('cache_ticket was issued by an earlier incarnation of the Prefill node')
        if not hmac.compare_digest(mac, self._mac(expiry, owner, block_ids)):
            raise TicketError('cache_ticket does not vouch for this owner and these block ids')
        if now > expiry:
            raise ExpiredTicketError('cache_ticket has expired (the orphan TTL of its cache has passed)')
        if expiry > now + longest_s:
            raise TicketError('cache_ticket expires later than any Prefill node issues one')
        return Voucher(bytes.fromhex(mac), expiry)

    def _mac(self, expiry: int, owner: int, block_ids: Sequence[int]) -> str:
        message = f'{self.key_id}.{expiry}.{owner}.{",".join(map(str, block_ids))}'.encode()
        return hmac.new(self.secret, message, hashlib.sha256).digest()[:_MAC_BYTES].hex()


def ticket_key_id(ticket: str) -> str:
    """The id of the key ``ticket`` claims to be made with; raise :class:`TicketError` if it is not a ticket."""
    return _parts(ticket)[0]


def _parts(ticket: str) -> tuple[str, int, str]:
    """A ticket's key id, expiry and MAC; raise :class:`TicketError` if it is not a ticket."""
    parts = _TICKET.fullmatch(ticket) if len(ticket) <= MAX_TICKET_CHARS else None
    if parts is None:
        raise TicketError('cache_ticket is not a ticket')
    return parts[1], int(parts[2]), parts[3]

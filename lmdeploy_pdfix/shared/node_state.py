"""What a node's api_server process knows besides its engine's book: the peers it is linked to, the migrations it
refused, its ticket key; and the node audit, which adds the engine's book (reached by :func:`engine_call`).

No HTTP stack here: the serving, link, route and metrics units of a node share it.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.tickets import TicketKey
from lmdeploy_pdfix.shared.node_book import engine_book_available, engine_call

ORPHAN_TTL_S = settings.ORPHAN_TTL_S.value()  # read once, as the engine's book reads it at its start


class NodeBooks:
    """What this api_server process knows besides the engine's book: its links and refused migrations."""

    def __init__(self) -> None:
        self.linked_peers: dict[str, str] = {}  # a linked node: this node, as that link names it
        self.refused_migrations: Counter[str] = Counter()
        self.server_context: Any = None  # LMDeploy's, once its distserve routes are registered
        self.ticket_key = TicketKey.generate()  # this incarnation's, for the caches it preserves as a Prefill


NODE = NodeBooks()


async def node_audit() -> dict[str, Any]:
    """The engine's book of preserved caches, with this api_server's refused migrations and links."""
    engine = await engine_call(NODE.server_context.async_engine, 'pdfix_audit')
    return {**engine, 'refused_migration_requests': dict(NODE.refused_migrations),
            'linked_peers': sorted(NODE.linked_peers)}


def record_link(init_request: Any) -> None:
    NODE.linked_peers[init_request.remote_engine_id] = init_request.local_engine_id


def forget_link(drop_request: Any) -> None:
    # LMDeploy's route passes one request, its type hint says a list
    for request in drop_request if isinstance(drop_request, list) else [drop_request]:
        NODE.linked_peers.pop(request.remote_engine_id, None)


def issue_ticket(owner: int, block_ids: list[int]) -> str | None:
    """This Prefill node's ticket for ``owner``'s preserved blocks, valid until the orphan TTL would reclaim them;
    None where the engine keeps no book (no claim could confirm the cache either)."""
    if not engine_book_available():
        return None
    return NODE.ticket_key.issue(owner, block_ids, time.time() + ORPHAN_TTL_S)

"""The routes a node serves from its engine's book of preserved caches.

The book lives in the engine process; these handlers reach it through the methods the ``engine_sessions`` unit
adds to the engine's RPC worker (or directly, for an in-process engine).

- ``POST /distserve/free_cache`` (D15) releases only a preserved cache of this node and always answers 200
  with ``status`` ``released``, ``not_found`` or ``refused`` and a ``detail``: each is definitive, so no
  caller retries it, and unknown ids are counted instead of logged as errors.
- ``POST /distserve/pdfix/claim`` lets a Decode node confirm that the owner still holds exactly those blocks;
  a confirmed cache is safe from the orphan TTL for the claim's lease.
- ``GET /distserve/pdfix/ticket_key``: this Prefill node's ticket key (:mod:`lmdeploy_pdfix.domain.tickets`), for
  the Decode nodes that check the tickets its answers carry; only to a caller presenting the node key (whoever
  holds the ticket key can forge tickets), so without a node key the Decodes confirm every cache by a claim first.
- ``GET /distserve/pdfix/audit``: preserved caches by age, releases by cause, frees that released nothing,
  claims, migration failures, and the migration requests this node refused.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.owner_ids import is_owner_id
from lmdeploy_pdfix.domain.preserved import ReleaseCause, Verdict
from lmdeploy_pdfix.domain.protocol import (
    AUDIT_PATH,
    CLAIM_PATH,
    CLAIM_STATUS,
    TICKET_KEY_PATH,
    MigrationRequestError,
    parse_claim,
    parse_json,
    presents_node_key,
    ticket_key_answer,
)
from lmdeploy_pdfix.patching import installation, warn
from lmdeploy_pdfix.shared.node_book import engine_call
from lmdeploy_pdfix.shared.node_state import NODE, node_audit


def add_node_routes(router: Any, server_context: Any) -> None:
    """The claim and audit routes; the caller swaps ``/distserve/free_cache`` for :func:`free_cache`."""

    @router.post(CLAIM_PATH)
    async def pdfix_claim(raw_request: Request) -> JSONResponse:
        try:
            claim = parse_claim(parse_json(await raw_request.body()))
        except ValueError as exc:  # not JSON (json's error) or not a claim (ours)
            detail = str(exc) if isinstance(exc, MigrationRequestError) else 'the body is not JSON'
            return JSONResponse({'status': Verdict.REFUSED.value, 'detail': detail}, HTTPStatus.BAD_REQUEST)
        return await _engine_answer(server_context, CLAIM_STATUS, 'pdfix_claim_preserved', *claim)

    NODE.server_context = server_context

    @router.get(TICKET_KEY_PATH)
    async def pdfix_ticket_key(raw_request: Request) -> JSONResponse:
        if not presents_node_key(raw_request.headers):  # whoever has the key forges tickets
            return JSONResponse({'detail': f'the ticket key is given only to nodes presenting '
                                           f'{settings.NODE_API_KEY.name}; without it a Decode node confirms '
                                           'each cache by a claim first'}, HTTPStatus.FORBIDDEN)
        return JSONResponse(ticket_key_answer(NODE.ticket_key))

    @router.get(AUDIT_PATH)
    async def pdfix_audit() -> dict[str, Any]:
        return {**await node_audit(), 'software': installation(), 'node_key': settings.NODE_API_KEY.value() is not None}


async def _engine_answer(server_context: Any, statuses: dict[str, int], method: str, *args: Any) -> JSONResponse:
    """The book's answer to a free or a claim, with the HTTP status of its verdict (200 where ``statuses`` has
    none); 503 when the engine cannot answer: the request is undecided, not refused."""
    try:
        answer = await engine_call(server_context.async_engine, method, *args)
    except Exception as exc:
        warn(f'{method} failed in the engine: {exc!r}')
        return JSONResponse({'status': 'unavailable', 'detail': 'the engine did not answer'},
                            HTTPStatus.SERVICE_UNAVAILABLE)
    return JSONResponse(answer, statuses.get(answer['status'], HTTPStatus.OK))


def free_cache_endpoint(server_context: Any):
    def make_endpoint(endpoint):
        # FastAPI reads the body model from LMDeploy's endpoint: swap_endpoint makes it this one's __wrapped__
        async def free_cache(cache_free_request) -> JSONResponse:
            owner = cache_free_request.remote_session_id
            if not is_owner_id(owner):
                return JSONResponse({'status': Verdict.REFUSED.value, 'detail': 'remote_session_id is not a cache '
                                     'owner (a non-negative 64-bit integer)'}, HTTPStatus.BAD_REQUEST)
            return await _engine_answer(server_context, {}, 'pdfix_release_preserved', owner,
                                        ReleaseCause.FREED.value)

        return free_cache

    return make_endpoint

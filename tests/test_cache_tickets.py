"""Cache tickets take the Decode node's claim off the request path without losing what it protects (issue 14).

A Prefill node's ticket vouches for a cache's owner and blocks; a Decode node that can check it sends the
request to its engine at once and lets the claim (is the cache still preserved?) run meanwhile: the answer
waits for the claim, and a refusal stops the request and is the answer. A ticket that does not vouch for the
request is refused before the engine, with no claim. The Decode node is LMDeploy's real OpenAI router; the
Prefill node it asks is a stand-in served over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lmdeploy_pdfix.domain.protocol import (
    CACHE_TICKET_FIELD,
    CLAIM_PATH,
    COMPLETIONS_PATH,
    NODE_PROOF_PATH,
    TICKET_KEY_PATH,
    bearer,
    node_address,
    node_proof,
    parse_ticket_key,
    ticket_key_answer,
)
from lmdeploy_pdfix.domain.tickets import ExpiredTicketError, StaleTicketError, TicketError, TicketKey
from tests.servers import serving
from tests.test_node_input import migrating, node_client
from tests.test_serving_cache_owner import MODEL, FakePrefillEngine

OWNER, BLOCKS = 7, [1, 2]
THIS_DECODE = 'http://127.0.0.1:9001'  # this Decode node, as its link to the Prefill names it
TICKET_LIFETIME_S = 600.0
LONGEST_S = 660.0  # the longest ticket lifetime a Decode accepts
NODE_KEY = 'node-key-of-the-operator'


def later() -> float:
    # at issue, not at collection: a full run reaches these tests long after it collected them
    return time.time() + TICKET_LIFETIME_S


def test_a_ticket_vouches_for_exactly_its_owner_and_blocks_until_it_expires() -> None:
    key = TicketKey.generate()
    ticket = key.issue(OWNER, BLOCKS, expires_at=1000.0)
    key.verify(ticket, OWNER, BLOCKS, now=999.0, longest_s=LONGEST_S)
    for owner, blocks in ((OWNER + 1, BLOCKS), (OWNER, [1, 3]), (OWNER, [1, 2, 3]), (OWNER, [2, 1])):
        with pytest.raises(TicketError, match='does not vouch'):
            key.verify(ticket, owner, blocks, now=999.0, longest_s=LONGEST_S)
    with pytest.raises(ExpiredTicketError):
        key.verify(ticket, OWNER, BLOCKS, now=1001.0, longest_s=LONGEST_S)
    with pytest.raises(StaleTicketError):  # another incarnation of the Prefill node
        TicketKey.generate().verify(ticket, OWNER, BLOCKS, now=999.0, longest_s=LONGEST_S)
    forged = ticket.rsplit('.', 1)[0] + '.' + '0' * 32
    with pytest.raises(TicketError, match='does not vouch'):
        key.verify(forged, OWNER, BLOCKS, now=999.0, longest_s=LONGEST_S)


def test_a_ticket_that_expires_later_than_any_prefill_issues_one_is_refused() -> None:
    key = TicketKey.generate()
    with pytest.raises(TicketError, match='later than any Prefill'):
        key.verify(key.issue(OWNER, BLOCKS, expires_at=3600.0), OWNER, BLOCKS, now=0.0, longest_s=LONGEST_S)


def test_a_decode_node_remembers_a_used_ticket_until_it_expires_and_no_longer() -> None:
    # a replay is refused while the ticket could still verify; after that the ticket itself is refused as expired,
    # so the Decode's memory of used tickets follows the orphan TTL, not the traffic
    from lmdeploy_pdfix.units.decode_migration_checks.checks import TicketKeys

    keys, key = TicketKeys(), TicketKey.generate()
    early, late = (key.verify(key.issue(OWNER, [block], expiry), OWNER, [block], now=0.0, longest_s=LONGEST_S)
                   for block, expiry in ((1, 100.0), (2, 200.0)))
    assert keys.spend(early, now=0.0) and keys.spend(late, now=0.0)
    assert not keys.spend(early, now=99.0) and not keys.spend(late, now=99.0)
    assert keys.spend(early, now=101.0)  # forgotten once expired
    assert not keys.spend(late, now=101.0)


class StandInPrefill:
    """A Prefill node's ticket key and claim routes; each claim waits until the test lets it answer."""

    def __init__(self) -> None:
        self.key = TicketKey.generate()
        self.claims: list[dict[str, Any]] = []
        self.key_requests = 0
        self.verdict = ('claimed', 200)
        self.claim_answer: tuple[Any, int] | None = None
        self.node_key: str | None = None  # the node key it proves it holds (None: it proves nothing)
        self.authorizations: list[str | None] = []  # of each claim
        self.answer_claims = threading.Event()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get(TICKET_KEY_PATH)
        async def ticket_key() -> dict[str, str]:
            self.key_requests += 1
            return ticket_key_answer(self.key)

        @app.post(NODE_PROOF_PATH)
        async def proof(request: Request) -> JSONResponse:
            if self.node_key is None:
                return JSONResponse({'detail': 'Not Found'}, 404)
            address = node_address(*request.scope['server'])
            return JSONResponse({'proof': node_proof(self.node_key, (await request.json())['nonce'], address)})

        @app.post(CLAIM_PATH)
        async def claim(request: Request) -> JSONResponse:
            self.authorizations.append(request.headers.get('Authorization'))
            self.claims.append(await request.json())
            await asyncio.to_thread(self.answer_claims.wait, 10)
            status, code = self.verdict
            if self.claim_answer is not None:  # not a verdict of pdfix
                return JSONResponse(*self.claim_answer)
            return JSONResponse({'status': status, 'detail': f'preserved cache {status}'}, code)

        return app

    def ticket(self, block_ids: list[int] = BLOCKS, owner: int = OWNER) -> str:
        return self.key.issue(owner, block_ids, later())


class HeldDecodeEngine(FakePrefillEngine):
    """A Decode engine whose request runs until it is stopped or let go, noting when it began and ended."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.let_go = asyncio.Event()
        self.stopped = False

    async def generate(self, request: Any, stream_response: bool = True) -> AsyncIterator[Any]:
        self.started.set()
        try:
            await self.let_go.wait()
        except asyncio.CancelledError:
            self.stopped = True
            raise
        async for output in super().generate(request, stream_response):
            yield output


@pytest.fixture
def prefill() -> Iterator[tuple[StandInPrefill, str]]:
    node = StandInPrefill()
    with serving(node.app()) as url:
        yield node, url
    node.answer_claims.set()


@pytest.fixture
async def decode(apply_patch: Callable[[str], ModuleType],
                 prefill: tuple[StandInPrefill, str]) -> AsyncIterator[tuple[httpx.AsyncClient, HeldDecodeEngine]]:
    api_server = apply_patch('decode_migration_checks')
    from lmdeploy_pdfix.shared.node_state import NODE

    NODE.linked_peers[prefill[1]] = THIS_DECODE  # as the proxy's link set-up notes it
    engine = HeldDecodeEngine()
    try:
        async with await node_client(api_server, engine) as client:
            yield client, engine
    finally:
        engine.let_go.set()  # a request a failed test left in the engine ends
        NODE.linked_peers.pop(prefill[1], None)


def vouched(url: str, ticket: str, **migration: Any) -> dict[str, Any]:
    return migrating(remote_engine_id=url, **{CACHE_TICKET_FIELD: ticket, **migration})


def answering_at_once(node: StandInPrefill, engine: HeldDecodeEngine) -> None:
    node.answer_claims.set()
    engine.let_go.set()


async def _until(condition: Callable[[], bool], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return condition()


@pytest.mark.regression
@pytest.mark.parametrize('stream', [False, True])
async def test_a_vouched_migration_reaches_the_engine_while_its_claim_is_on_its_way_and_answers_once_confirmed(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine], stream: bool) -> None:
    (node, url), (client, engine) = prefill, decode
    body = {**vouched(url, node.ticket()), 'stream': stream}
    answer = asyncio.ensure_future(client.post(COMPLETIONS_PATH, json=body))
    assert await _until(lambda: engine.started.is_set() and len(node.claims) == 1)
    assert not answer.done()  # the claim has not answered: neither has the request
    engine.let_go.set()
    await asyncio.sleep(0.2)
    assert not answer.done()  # the engine is done; the answer waits for the claim
    node.answer_claims.set()
    response = await asyncio.wait_for(answer, 10)
    assert response.status_code == 200 and 'Hello' in response.text, response.text
    # the claim names this node as its link to the Prefill does: a late claim is confirmed only for the node
    # whose free released the cache
    assert node.claims == [{'owner': OWNER, 'block_ids': BLOCKS, 'decode': THIS_DECODE}]


@pytest.mark.regression
@pytest.mark.parametrize('stream', [False, True])
async def test_a_claim_that_refuses_a_vouched_migration_stops_its_request_and_is_the_answer(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine], stream: bool) -> None:
    (node, url), (client, engine) = prefill, decode
    node.verdict = ('not_found', 404)  # freed or aborted since the Prefill answered
    body = {**vouched(url, node.ticket()), 'stream': stream}
    answer = asyncio.ensure_future(client.post(COMPLETIONS_PATH, json=body))
    assert await _until(engine.started.is_set)
    node.answer_claims.set()
    response = await asyncio.wait_for(answer, 10)
    assert response.status_code == 404 and 'migration_request refused' in response.json()['message']
    assert engine.stopped  # whatever it copied is never decoded into an answer


@pytest.mark.regression
@pytest.mark.parametrize('case', ['other blocks', 'other key', 'expired', 'not a ticket'])
async def test_a_ticket_that_does_not_vouch_for_the_migration_is_refused_before_the_engine(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine], case: str) -> None:
    (node, url), (client, engine) = prefill, decode
    ticket, status = {
        'other blocks': (node.ticket([1, 3]), 409),
        'other key': (TicketKey.generate().issue(OWNER, BLOCKS, later()), 410),
        'expired': (node.key.issue(OWNER, BLOCKS, time.time() - 1), 410),
        'not a ticket': ('v1.abc', 400),
    }[case]
    engine.let_go.set()
    response = await client.post(COMPLETIONS_PATH, json=vouched(url, ticket))
    assert response.status_code == status and 'migration_request refused' in response.json()['message'], response.text
    assert not engine.started.is_set() and node.claims == []


@pytest.mark.regression
async def test_a_decode_node_asks_a_prefill_node_for_its_key_once_and_again_after_it_restarted(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine]) -> None:
    (node, url), (client, engine) = prefill, decode
    answering_at_once(node, engine)
    for owner in range(3):
        ticket = node.ticket(owner=owner)
        response = await client.post(COMPLETIONS_PATH, json=vouched(url, ticket, remote_session_id=owner))
        assert response.status_code == 200, response.text
    node.key = TicketKey.generate()  # the Prefill node restarted
    assert (await client.post(COMPLETIONS_PATH, json=vouched(url, node.ticket()))).status_code == 200
    assert node.key_requests == 2 and len(node.claims) == 4


@pytest.mark.regression
async def test_a_ticket_used_once_is_refused_the_second_time(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine]) -> None:
    # the first migration's free gave the blocks back: a second copy of them may read another request's KV
    (node, url), (client, engine) = prefill, decode
    answering_at_once(node, engine)
    ticket = node.ticket()  # once: two issued a second apart expire a second apart, so they are two tickets
    first, again = [await client.post(COMPLETIONS_PATH, json=vouched(url, ticket)) for _ in range(2)]
    assert first.status_code == 200, first.text
    assert again.status_code == 409 and 'already used' in again.json()['message']
    assert len(node.claims) == 1


@pytest.mark.regression
@pytest.mark.parametrize('path', [COMPLETIONS_PATH, '/v1/chat/completions'])
async def test_a_prefill_answer_carries_a_ticket_its_node_key_verifies_for_that_cache(
        apply_patch: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', NODE_KEY)
    for unit in ('engine_sessions', 'node_cache_routes', 'link_routes'):
        apply_patch(unit)
    api_server = apply_patch('serving_cache_owner')
    body = {'model': MODEL, 'max_completion_tokens': 1, 'with_cache': True, 'preserve_cache': True,
            **({'prompt': 'hi'} if path == COMPLETIONS_PATH else {'messages': [{'role': 'user', 'content': 'hi'}]})}
    async with await node_client(api_server, FakePrefillEngine()) as node:
        answer = (await node.post(path, json=body)).json()
        key = parse_ticket_key((await node.get(TICKET_KEY_PATH, headers=bearer(NODE_KEY))).json())
    key.verify(answer[CACHE_TICKET_FIELD], answer['cache_session_id'], answer['cache_block_ids'], time.time(),
               longest_s=TICKET_LIFETIME_S)


HOSTILE_TICKETS = {
    'a number': 123,
    'a boolean': True,
    'the string "false"': 'false',
    'an array': ['v1', 'a', '1', 'b'],
    'an object': {'key_id': 'a'},
    'a 100,000-character string': 'v1.' + 'a' * 100_000,
    'a 100-digit expiry': 'v1.a.' + '9' * 100 + '.b',
    'an empty key id': 'v1..1.' + '0' * 32,
    'an expiry of superscript digits': 'v1.ab.\u00b9\u00b2\u00b3.' + '0' * 32,
    'a MAC that is not ASCII': 'v1.ab.1.' + '\u00e9' * 32,
    'a key id of Unicode digits': 'v1.\u0661\u0662.1.' + '0' * 32,
}


@pytest.mark.regression
@pytest.mark.parametrize('ticket', HOSTILE_TICKETS.values(), ids=HOSTILE_TICKETS.keys())
async def test_a_hostile_ticket_gets_a_short_4xx_and_never_reaches_the_engine_or_the_prefill(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine], ticket: Any) -> None:
    (node, url), (client, engine) = prefill, decode
    answering_at_once(node, engine)
    response = await client.post(COMPLETIONS_PATH, json=vouched(url, ticket))
    assert 400 <= response.status_code < 500 and len(response.text) < 400, response.text
    assert not engine.started.is_set() and node.claims == []


@pytest.mark.parametrize('node_key, presented', [(None, None), (None, NODE_KEY), (NODE_KEY, None),
                                                 (NODE_KEY, 'another key'), (NODE_KEY, '\u00e9' * 8)],
                         ids=['no key anywhere', 'a key this node lacks', 'no key presented', 'a wrong key',
                              'a key that is not ASCII'])
async def test_a_prefill_gives_its_ticket_key_only_to_a_caller_presenting_the_node_key(
        apply_patch: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, node_key: str | None,
        presented: str | None) -> None:
    # whoever holds the ticket key forges tickets: before, any caller of the node port got it
    if node_key is not None:
        monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', node_key)
    for unit in ('engine_sessions', 'node_cache_routes', 'link_routes'):
        apply_patch(unit)
    api_server = apply_patch('serving_cache_owner')
    async with await node_client(api_server, FakePrefillEngine()) as node:
        # as bytes: a header that is not ASCII is sent as its UTF-8
        refused = await node.get(TICKET_KEY_PATH, headers={'Authorization': f'Bearer {presented}'.encode()}
                                 if presented else {})
        monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', NODE_KEY)
        given = await node.get(TICKET_KEY_PATH, headers=bearer(NODE_KEY))
    assert refused.status_code == 403 and 'secret' not in refused.text
    assert 'LMDEPLOY_PDFIX_NODE_API_KEY' in refused.json()['detail']
    assert given.status_code == 200 and parse_ticket_key(given.json())


NOT_A_VERDICT = {
    'a 404 of a URL that is no claim route': ({'detail': 'Not Found'}, 404),
    'a 405': ({'detail': 'Method Not Allowed'}, 405),
    'a 200 without a verdict': ({'ok': True}, 200),
    'a 200 naming another verdict': ({'status': 'refused'}, 200),
    'a 404 naming claimed': ({'status': 'claimed'}, 404),
    'a 401': ({'error': 'Unauthorized'}, 401),
}


@pytest.mark.regression
@pytest.mark.parametrize('answer', NOT_A_VERDICT.values(), ids=NOT_A_VERDICT.keys())
async def test_a_claim_not_answered_with_a_pdfix_verdict_refuses_the_migration_before_the_engine(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine],
        answer: tuple[Any, int]) -> None:
    # fails closed: a Prefill alias (its URL plus a path) answered 404, read as "a Prefill without pdfix", and the
    # Decode migrated another request's blocks
    (node, url), (client, engine) = prefill, decode
    node.claim_answer = answer
    answering_at_once(node, engine)
    response = await client.post(COMPLETIONS_PATH, json=migrating(remote_engine_id=url))
    assert response.status_code == 502 and 'did not confirm the cache' in response.json()['message']
    assert not engine.started.is_set() and len(node.claims) == 1


@pytest.mark.parametrize('proves', [NODE_KEY, 'another key', None], ids=['the node key', 'another key', 'nothing'])
async def test_a_decode_sends_the_node_key_only_to_a_prefill_that_proved_it_holds_it(
        prefill: tuple[StandInPrefill, str], decode: tuple[httpx.AsyncClient, HeldDecodeEngine],
        monkeypatch: pytest.MonkeyPatch, proves: str | None) -> None:
    from lmdeploy_pdfix.shared import node_client as _client

    (node, url), (client, engine) = prefill, decode
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', NODE_KEY)
    monkeypatch.setattr(_client, '_PROOFS', _client._Proofs())
    node.node_key = proves
    answering_at_once(node, engine)
    response = await client.post(COMPLETIONS_PATH, json=migrating(remote_engine_id=url))
    if proves == NODE_KEY:
        assert response.status_code == 200 and node.authorizations == [f'Bearer {NODE_KEY}']
    else:  # a linked alias of a Prefill, or anything else: nothing confirmed, no key sent
        assert response.status_code == 502 and 'has not proven' in response.json()['message']
        assert node.claims == [] and not engine.started.is_set()

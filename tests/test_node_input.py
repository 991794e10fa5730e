"""What a node does with hostile or malformed DistServe input: a short 4xx, nothing acted on (issue 11).

LMDeploy's real OpenAI router, built as ``api_server.serve`` builds it, over the fake engine of
``test_serving_cache_owner``; the claim route's engine call is a stand-in that records what reached it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from lmdeploy.serve.parsers import ResponseParserManager

from lmdeploy_pdfix.domain.protocol import CLAIM_PATH, COMPLETIONS_PATH, DUMMY_PREFILL_FIELD
from tests.test_serving_cache_owner import MODEL, FakePrefillEngine

PREFILL = 'http://127.0.0.1:1'  # never linked to the node under test


class EngineRpc:
    """Stands in for the engine process's RPC: records each call, answers or fails as told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fails = False

    async def __call__(self, method: str, *args: Any) -> dict[str, str]:
        self.calls.append((method, args))
        if self.fails:
            raise ConnectionError('engine process gone')
        return {'status': 'not_found', 'detail': 'no preserved cache'}


async def node_client(api_server: ModuleType, engine: FakePrefillEngine) -> httpx.AsyncClient:
    context = api_server.ServerContext()
    context.async_engine = engine
    context.response_parser_cls = ResponseParserManager.get('default')
    app = FastAPI()
    app.include_router(api_server.create_openai_router(context))
    app.add_exception_handler(RequestValidationError, api_server.validation_exception_handler)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url='http://node')


@pytest.fixture
async def decode_node(apply_patch: Callable[[str], ModuleType]) -> AsyncIterator[httpx.AsyncClient]:
    async with await node_client(apply_patch('decode_migration_checks'), FakePrefillEngine()) as client:
        yield client


@pytest.fixture
async def prefill_node(apply_patch: Callable[[str], ModuleType]) -> AsyncIterator[tuple[httpx.AsyncClient, EngineRpc]]:
    apply_patch('engine_sessions')  # the book the claim route asks, in the engine process
    apply_patch('node_cache_routes')
    engine, rpc = FakePrefillEngine(), EngineRpc()
    engine.engine = SimpleNamespace(_collective_rpc_async=rpc)
    api_server = apply_patch('link_routes')
    async with await node_client(api_server, engine) as client:
        yield client, rpc


def migrating(**migration: Any) -> dict[str, Any]:
    request = {'protocol': 1, 'remote_engine_id': PREFILL, 'remote_session_id': 7, 'remote_block_ids': [1, 2],
               'remote_token_id': 3, **migration}
    return {'model': MODEL, 'prompt': 'hi', 'max_completion_tokens': 1, 'migration_request': request}


@pytest.mark.regression
@pytest.mark.parametrize('dummy', ['false', '0', 'no', 1, 'true'])
async def test_a_dummy_prefill_flag_that_is_not_a_boolean_is_refused_before_anything_migrates(
        decode_node: httpx.AsyncClient, dummy: Any) -> None:
    # LMDeploy reads "false" as False and would migrate blocks nobody confirmed; 1 and "true" as a dummy decode
    response = await decode_node.post(COMPLETIONS_PATH, json=migrating(is_dummy_prefill=dummy))
    assert response.status_code == 400
    assert 'is_dummy_prefill must be true or false' in response.json()['message']


@pytest.mark.regression
async def test_a_dummy_prefill_is_refused_unless_the_deployment_allows_it(decode_node: httpx.AsyncClient) -> None:
    # it decodes from KV blocks no Prefill filled: right after another request, that request's continuation
    response = await decode_node.post(COMPLETIONS_PATH, json=migrating(is_dummy_prefill=True))
    assert response.status_code == 400 and 'LMDEPLOY_PDFIX_ALLOW_DUMMY_PREFILL=1' in response.json()['message']


@pytest.mark.regression
async def test_a_dummy_prefill_the_deployment_allows_is_marked(decode_node: httpx.AsyncClient,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_PDFIX_ALLOW_DUMMY_PREFILL', '1')
    response = await decode_node.post(COMPLETIONS_PATH, json=migrating(is_dummy_prefill=True))
    assert response.status_code == 200 and response.json()[DUMMY_PREFILL_FIELD] is True


@pytest.mark.regression
@pytest.mark.parametrize('extra', [{'prompt': ['a', 'b']}, {'n': 2}], ids=['two prompts', 'two sequences'])
async def test_one_migration_request_serves_one_prompt_and_one_sequence(decode_node: httpx.AsyncClient,
                                                                         extra: dict[str, Any]) -> None:
    response = await decode_node.post(COMPLETIONS_PATH, json={**migrating(), **extra})
    assert response.status_code == 400
    assert 'exactly one prompt and one sequence' in response.json()['message']


@pytest.mark.regression
async def test_a_migration_request_lmdeploy_cannot_parse_is_a_400_naming_the_field(
        decode_node: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_PDFIX_ALLOW_DUMMY_PREFILL', '1')  # no Prefill link needed
    migration = migrating(is_dummy_prefill=True)
    del migration['migration_request']['protocol']
    response = await decode_node.post(COMPLETIONS_PATH, json=migration)
    assert response.status_code == 400 and 'protocol: Field required' in response.json()['message']


@pytest.mark.regression
async def test_a_migration_from_a_prefill_node_this_decode_is_not_linked_to_is_refused(
        decode_node: httpx.AsyncClient) -> None:
    response = await decode_node.post(COMPLETIONS_PATH, json=migrating())
    assert response.status_code == 400 and 'not linked' in response.json()['message']


@pytest.mark.regression
@pytest.mark.parametrize('prefill', ['', 'h' * 100_000, 5], ids=['empty', '100,000 characters', 'a number'])
async def test_a_migration_request_whose_prefill_is_no_node_url_gets_a_short_400(
        decode_node: httpx.AsyncClient, prefill: Any) -> None:
    response = await decode_node.post(COMPLETIONS_PATH, json=migrating(remote_engine_id=prefill))
    assert response.status_code == 400
    assert 'is not a node URL' in response.json()['message'] and len(response.text) < 300


HOSTILE_CLAIMS = {
    'not JSON': b'owner=1',
    'a JSON array': b'[1, 2]',
    'a bare number': b'5',
    'a 5,000-digit owner': b'{"owner": ' + b'9' * 5000 + b', "block_ids": [1]}',
    'a huge block list': json.dumps({'owner': 1, 'block_ids': list(range(-1, 100_000))}).encode(),
    'a boolean owner': b'{"owner": true, "block_ids": [1]}',
    'a repeated block': b'{"owner": 1, "block_ids": [1, 1]}',
    'a numeric claimant': b'{"owner": 1, "block_ids": [1], "decode": 5}',
    'an empty claimant': b'{"owner": 1, "block_ids": [1], "decode": ""}',
    'a 100,000-character claimant': json.dumps({'owner': 1, 'block_ids': [1], 'decode': 'h' * 100_000}).encode(),
    'a claimant object': b'{"owner": 1, "block_ids": [1], "decode": {"url": "x"}}',
}


@pytest.mark.regression
@pytest.mark.parametrize('body', HOSTILE_CLAIMS.values(), ids=HOSTILE_CLAIMS.keys())
async def test_a_malformed_claim_gets_a_short_400_and_never_reaches_the_engine(
        prefill_node: tuple[httpx.AsyncClient, EngineRpc], body: bytes) -> None:
    client, rpc = prefill_node
    response = await client.post(CLAIM_PATH, content=body, headers={'content-type': 'application/json'})
    assert response.status_code == 400
    assert len(response.text) < 300, 'the refusal echoes the input'
    assert rpc.calls == []


@pytest.mark.regression
async def test_a_claim_the_engine_cannot_answer_is_a_503_not_a_500(
        prefill_node: tuple[httpx.AsyncClient, EngineRpc]) -> None:
    client, rpc = prefill_node
    rpc.fails = True
    response = await client.post(CLAIM_PATH, json={'owner': 1, 'block_ids': [1]})
    assert response.status_code == 503 and rpc.calls == [('pdfix_claim_preserved', (1, [1], None))]


@pytest.mark.regression
@pytest.mark.parametrize('owner', [10 ** 40, -3], ids=['beyond 64 bits', 'negative'])
async def test_a_free_of_an_id_that_cannot_be_an_owner_is_a_short_400_that_never_reaches_the_engine(
        prefill_node: tuple[httpx.AsyncClient, EngineRpc], owner: int) -> None:
    client, rpc = prefill_node
    free = {'remote_engine_id': PREFILL, 'remote_session_id': owner}
    response = await client.post('/distserve/free_cache', json=free)
    assert response.status_code == 400 and rpc.calls == []


@pytest.mark.regression
async def test_a_free_the_engine_cannot_answer_is_a_503_not_a_500(
        prefill_node: tuple[httpx.AsyncClient, EngineRpc]) -> None:
    client, rpc = prefill_node
    rpc.fails = True
    response = await client.post('/distserve/free_cache', json={'remote_engine_id': PREFILL, 'remote_session_id': 5})
    assert response.status_code == 503 and rpc.calls == [('pdfix_release_preserved', (5, 'freed'))]


@pytest.mark.regression
@pytest.mark.parametrize('field, value', [
    ('cache_prompt_digest', 12), ('cache_prompt_digest', 'false'), ('cache_prompt_digest', ['3-' + 'a' * 32]),
    ('cache_prompt_digest', 'x' * 100_000), ('cache_prompt_digest', '3-' + 'A' * 32),
    ('cache_first_token_logprobs', 'false'), ('cache_first_token_logprobs', {'3': -0.1}),
    ('cache_first_token_logprobs', [[3, -0.1, 4]]), ('cache_first_token_logprobs', [[True, -0.1]]),
    ('cache_first_token_logprobs', [[3, 'x']]), ('cache_first_token_logprobs', [[-1, -0.1]]),
    ('cache_first_token_logprobs', [[3, -0.1]] * 2000), ('cache_first_token_logprobs', []),
    ('cache_first_token_logprobs', [[3, float('nan')]]), ('cache_first_token_logprobs', [[3, 10 ** 400]]),
], ids=lambda value: repr(value)[:30])
async def test_hostile_cache_facts_in_a_migration_request_get_a_short_400_and_nothing_migrates(
        decode_node: httpx.AsyncClient, field: str, value: Any) -> None:
    # stock LMDeploy's model ignores these fields: it migrates whatever the rest names (here: an unlinked Prefill)
    body = json.dumps(migrating(**{field: value}))  # NaN too, which a JSON parser reads and httpx would not send
    response = await decode_node.post(COMPLETIONS_PATH, content=body, headers={'Content-Type': 'application/json'})
    assert response.status_code == 400, response.text
    assert field in response.json()['message'] and len(response.text) < 400

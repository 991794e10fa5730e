"""A Prefill node's ``with_cache`` answers name the internal session that owns the retained cache (D1, D2).

These tests drive LMDeploy's real ``/v1/completions`` and ``/v1/chat/completions`` routes, assembled by the
real ``create_openai_router`` on a real ``ServerContext`` and ``SessionManager``. Only the engine's token
generation is faked (it needs a model and a GPU): the fake records which scheduler session it was driven
with, so each answer can be checked against the session that actually holds its cache.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.disagg.config import EngineRole
from lmdeploy.serve.core.async_engine import GenOut, PreprocessedRequest
from lmdeploy.serve.managers.session_manager import Session, SessionManager
from lmdeploy.serve.parsers import ResponseParserManager

from lmdeploy_pdfix.domain.protocol import CACHE_OWNER_FIELD, CAPABILITIES_PATH, NODE_PROOF_PATH, node_proof
from tests.servers import serving

MODEL = 'pdfix-test-model'
# The server has already handed out this many scheduler sessions, so internal ids never coincide with the
# public ids a client sees (-1, the caller's session_id) by accident.
SESSIONS_SERVED_BEFORE = 41
CACHE_BLOCK_IDS = [11, 12, 13]
FIRST_TOKEN_ID = 4242


class FakePrefillEngine:
    """The part of ``AsyncEngine`` the OpenAI endpoints use, on a Prefill node, without a model.

    ``preprocess`` returns LMDeploy's own ``PreprocessedRequest``; ``generate`` yields LMDeploy's own ``GenOut``,
    one output per request, as a Prefill node does (it stops after the first token). A ``with_cache`` request gets
    its cache block ids back, as the PyTorch engine's migration path reports them.
    """

    def __init__(self) -> None:
        self.model_name = MODEL
        self.arch = 'LlamaForCausalLM'
        self.backend_config = PytorchEngineConfig(role=EngineRole.Prefill)
        self.epoch = 0
        self.session_mgr = SessionManager()
        self.session_mgr.session_id_generator = itertools.count(SESSIONS_SERVED_BEFORE)
        # Chat reads ``tokenizer.model.model`` (for logit_bias and logprobs only, which these requests do not use).
        self.tokenizer = SimpleNamespace(model=SimpleNamespace(model=None))
        self.driven_sessions: list[int] = []
        self.preserved: list[bool] = []  # each request's preserve_cache, as the engine got it

    async def preprocess(self, prompt: Any, session: Session, gen_config: Any = None, adapter_name: str | None = None,
                         **kwargs: Any) -> PreprocessedRequest:
        input_ids = list(range(len(json.dumps(prompt))))
        return PreprocessedRequest(session=session, inputs={'prompt': prompt, 'input_ids': input_ids},
                                   input_token_len=len(input_ids), gen_config=gen_config, adapter_name=adapter_name)

    async def generate(self, request: PreprocessedRequest, stream_response: bool = True) -> AsyncIterator[GenOut]:
        request.consumed = True
        self.driven_sessions.append(request.session.session_id)
        gen_config = request.gen_config
        self.preserved.append(bool(getattr(gen_config, 'preserve_cache', False)))
        yield GenOut(response='Hello',
                     input_token_len=request.input_token_len,
                     generate_token_len=1,
                     finish_reason='length',
                     token_ids=[FIRST_TOKEN_ID],
                     cache_block_ids=list(CACHE_BLOCK_IDS) if gen_config.with_cache else None)


@dataclass
class PrefillServer:
    client: httpx.AsyncClient
    engine: FakePrefillEngine

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        response = await self.client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return (await self.post(path, body)).json()

    async def post_stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The JSON events of a server-sent-event answer, without the closing ``[DONE]``."""
        text = (await self.post(path, {**body, 'stream': True})).text
        events = [event.removeprefix('data: ') for event in text.split('\n\n') if event.startswith('data: ')]
        assert events[-1] == '[DONE]', text
        return [json.loads(event) for event in events[:-1]]

    def only_driven_session(self) -> int:
        assert len(self.engine.driven_sessions) == 1, self.engine.driven_sessions
        return self.engine.driven_sessions[0]


@pytest.fixture
def app() -> FastAPI:
    return FastAPI()


@pytest.fixture
async def prefill_server(apply_patch: Callable[[str], ModuleType], app: FastAPI) -> AsyncIterator[PrefillServer]:
    """LMDeploy's OpenAI router, built as ``api_server.serve`` builds it, over a fake Prefill engine."""
    api_server = apply_patch('serving_cache_owner')
    apply_patch('link_routes')
    engine = FakePrefillEngine()
    context = api_server.ServerContext()
    context.async_engine = engine
    context.response_parser_cls = ResponseParserManager.get('default')
    app.include_router(api_server.create_openai_router(context))
    app.add_exception_handler(RequestValidationError, api_server.validation_exception_handler)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url='http://prefill') as client:
        yield PrefillServer(client=client, engine=engine)


def completion_request(**extra: Any) -> dict[str, Any]:
    return {'model': MODEL, 'prompt': 'The capital of France is', 'max_completion_tokens': 1, **extra}


def chat_request(**extra: Any) -> dict[str, Any]:
    return {'model': MODEL, 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_completion_tokens': 1, **extra}


WITH_CACHE = {'with_cache': True, 'preserve_cache': True}


@pytest.mark.regression
async def test_prefill_completion_names_the_session_that_owns_its_cache(prefill_server: PrefillServer) -> None:
    body = await prefill_server.post_json('/v1/completions', completion_request(**WITH_CACHE))

    owner = prefill_server.only_driven_session()
    assert owner >= SESSIONS_SERVED_BEFORE
    assert body[CACHE_OWNER_FIELD] == owner
    assert body['cache_block_ids'] == CACHE_BLOCK_IDS
    assert body['remote_token_ids'] == [FIRST_TOKEN_ID]
    assert body['id'] == '-1', 'the public completion id is unchanged'


@pytest.mark.regression
async def test_prefill_completion_with_a_caller_session_id_names_the_internal_session_not_the_callers(
        prefill_server: PrefillServer) -> None:
    caller_session_id = 7
    body = await prefill_server.post_json('/v1/completions',
                                          completion_request(session_id=caller_session_id, **WITH_CACHE))

    owner = prefill_server.only_driven_session()
    assert owner != caller_session_id
    assert body[CACHE_OWNER_FIELD] == owner
    assert body['id'] == str(caller_session_id), 'the public completion id is still the caller session_id'


@pytest.mark.regression
async def test_prefill_chat_completion_names_the_session_that_owns_its_cache(prefill_server: PrefillServer) -> None:
    body = await prefill_server.post_json('/v1/chat/completions', chat_request(**WITH_CACHE))

    owner = prefill_server.only_driven_session()
    assert body[CACHE_OWNER_FIELD] == owner
    assert body['cache_block_ids'] == CACHE_BLOCK_IDS
    assert body['remote_token_ids'] == [FIRST_TOKEN_ID]
    assert body['id'].startswith('chatcmpl-'), 'the public chat id is unchanged'


@pytest.mark.regression
async def test_streamed_prefill_completion_names_the_owner_on_the_chunk_that_carries_the_cache(
        prefill_server: PrefillServer) -> None:
    events = await prefill_server.post_stream('/v1/completions', completion_request(**WITH_CACHE))

    owner = prefill_server.only_driven_session()
    cache_events = [event for event in events if 'cache_block_ids' in event]
    assert len(cache_events) == 1, events
    assert cache_events[0]['cache_block_ids'] == CACHE_BLOCK_IDS
    assert cache_events[0][CACHE_OWNER_FIELD] == owner
    assert all(event['id'] == '-1' for event in events)


@pytest.mark.regression
async def test_streamed_prefill_chat_completion_names_the_owner_on_the_chunk_that_carries_the_cache(
        prefill_server: PrefillServer) -> None:
    events = await prefill_server.post_stream('/v1/chat/completions', chat_request(**WITH_CACHE))

    owner = prefill_server.only_driven_session()
    cache_events = [event for event in events if 'cache_block_ids' in event]
    assert len(cache_events) == 1, events
    assert cache_events[0][CACHE_OWNER_FIELD] == owner
    assert all(event['id'].startswith('chatcmpl-') for event in events)


@pytest.mark.regression
@pytest.mark.parametrize('path, make_request', [('/v1/completions', completion_request),
                                                 ('/v1/chat/completions', chat_request)],
                         ids=['completions', 'chat'])
async def test_only_answers_that_retain_a_cache_name_an_owner(
        prefill_server: PrefillServer, path: str, make_request: Callable[..., dict[str, Any]]) -> None:
    plain = await prefill_server.post_json(path, make_request())
    streamed = await prefill_server.post_stream(path, make_request())
    retained = await prefill_server.post_json(path, make_request(**WITH_CACHE))

    assert CACHE_OWNER_FIELD not in plain
    assert all(CACHE_OWNER_FIELD not in event for event in streamed)
    plain_session, streamed_session, retained_session = prefill_server.engine.driven_sessions
    assert retained[CACHE_OWNER_FIELD] == retained_session
    assert len({plain_session, streamed_session, retained_session}) == 3


@pytest.mark.regression
async def test_prefill_node_tells_a_proxy_that_it_names_cache_owners(prefill_server: PrefillServer) -> None:
    response = await prefill_server.client.get(CAPABILITIES_PATH)
    assert response.status_code == 200 and response.json()['cache_owner'] is True


@pytest.mark.regression
@pytest.mark.parametrize('caching', [True, False])
async def test_prefill_node_tells_a_proxy_whether_it_caches_prefixes(prefill_server: PrefillServer,
                                                                       caching: bool) -> None:
    prefill_server.engine.backend_config = PytorchEngineConfig(role=EngineRole.Prefill,
                                                               enable_prefix_caching=caching)
    response = await prefill_server.client.get(CAPABILITIES_PATH)
    assert response.status_code == 200 and response.json()['prefix_caching'] is caching


@pytest.mark.regression
async def test_only_a_prefill_node_keeps_a_cache_a_client_asked_to_preserve(prefill_server: PrefillServer) -> None:
    # Preserved caches are never evicted until migrated, freed or reclaimed: on other roles a client could pin KV
    for role in ('Prefill', 'Decode', 'Hybrid'):
        prefill_server.engine.backend_config = PytorchEngineConfig(role=EngineRole[role])
        await prefill_server.post('/v1/completions', completion_request(**WITH_CACHE))
        await prefill_server.post('/v1/chat/completions', chat_request(**WITH_CACHE))
    assert prefill_server.engine.preserved == [True, True, False, False, False, False]


@pytest.mark.regression
@pytest.mark.parametrize('prompt', [['a', 'b'], ['p'] * 70, []], ids=['two prompts', '70 prompts', 'none'])
async def test_a_prefill_node_keeps_one_cache_per_request_and_refuses_a_prompt_list_to_preserve(
        prefill_server: PrefillServer, prompt: list) -> None:
    # each prompt of a list kept a preserved cache that no answer named: nobody could free it before the orphan TTL
    response = await prefill_server.client.post('/v1/completions', json=completion_request(prompt=prompt,
                                                                                           **WITH_CACHE))
    assert response.status_code == 400 and 'keeps one cache' in response.json()['message']
    assert prefill_server.engine.driven_sessions == []


NODE_KEY = 'the-operators-node-key'
NONCE = '0123456789abcdef' * 2


async def test_a_node_proves_it_holds_the_node_key_for_the_address_it_was_reached_at(
        prefill_server: PrefillServer, app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', NODE_KEY)
    with serving(app) as url:  # over a real socket: the address is the one the connection arrived at
        async with httpx.AsyncClient() as client:
            answer = (await client.post(url + NODE_PROOF_PATH, json={'nonce': NONCE})).json()
            monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_ADDRESS', '203.0.113.7:8000')  # behind NAT, as peers reach it
            behind_nat = (await client.post(url + NODE_PROOF_PATH, json={'nonce': NONCE})).json()
    assert answer == {'proof': node_proof(NODE_KEY, NONCE, url.removeprefix('http://'))}
    assert behind_nat == {'proof': node_proof(NODE_KEY, NONCE, '203.0.113.7:8000')}


HOSTILE_CHALLENGES = {'no nonce': b'{}', 'a short nonce': b'{"nonce": "ab"}', 'not JSON': b'{',
                      'Unicode digits': json.dumps({'nonce': '\u0661' * 32}).encode(),
                      'deep nesting': b'[' * 100_000 + b']' * 100_000}


@pytest.mark.parametrize('body', HOSTILE_CHALLENGES.values(), ids=HOSTILE_CHALLENGES.keys())
async def test_a_challenge_that_is_not_one_gets_a_short_400(
        prefill_server: PrefillServer, monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', NODE_KEY)
    response = await prefill_server.client.post(NODE_PROOF_PATH, content=body)
    assert response.status_code == 400 and len(response.text) < 200


async def test_a_node_without_a_node_key_proves_nothing(prefill_server: PrefillServer) -> None:
    response = await prefill_server.client.post(NODE_PROOF_PATH, json={'nonce': NONCE})
    assert response.status_code == 403 and 'proof' not in response.json()


# --- the link routes never block the api_server's event loop (issue 9) ---------------------------------------

ENGINE_BUSY_S = 1.0


class BusyEngineProcess:
    """The api_server's handle on its engine process (``ZMQMPEngine``) while that engine is busy.

    LMDeploy's link routes reach the engine by ``_collective_rpc``, which blocks until the engine answers;
    ``_collective_rpc_async`` waits without blocking.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _collective_rpc(self, method: str, *args: Any) -> dict[str, str]:
        time.sleep(ENGINE_BUSY_S)
        self.calls.append(method)
        return {'status': 'SUCCESS'}

    async def _collective_rpc_async(self, method: str, *args: Any) -> dict[str, str]:
        await asyncio.sleep(ENGINE_BUSY_S)
        self.calls.append(method)
        return {'status': 'SUCCESS'}

    def p2p_drop_connect(self, drop_conn_request: Any) -> dict[str, str]:
        return self._collective_rpc('p2p_drop_connect', drop_conn_request)


@pytest.mark.regression
async def test_a_link_route_waiting_for_a_busy_engine_leaves_the_node_answering(
        prefill_server: PrefillServer, app: FastAPI) -> None:
    engine_process = BusyEngineProcess()
    prefill_server.engine.engine = engine_process
    prefill_server.engine.p2p_drop_connect = engine_process.p2p_drop_connect  # as AsyncEngine delegates it
    finished: list[str] = []

    @app.get('/ping')
    async def ping() -> dict[str, str]:
        return {}

    async def call(method: str, path: str, body: Any = None) -> None:
        response = await prefill_server.client.request(method, path, json=body)
        assert response.status_code == 200, response.text
        finished.append(path)

    drop = {'engine_id': 'http://decode', 'remote_engine_id': 'http://prefill'}
    dropping = asyncio.ensure_future(call('POST', '/distserve/p2p_drop_connect', drop))
    await asyncio.sleep(ENGINE_BUSY_S / 10)  # the drop is waiting for the engine now
    await call('GET', '/ping')
    await dropping

    assert finished == ['/ping', '/distserve/p2p_drop_connect'], \
        'the node answered nothing while its engine was busy with the drop'
    assert engine_process.calls == ['p2p_drop_connect']

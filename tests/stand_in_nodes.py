"""Stand-in Prefill and Decode api_servers that speak LMDeploy's DistServe HTTP protocol and record it all.

They answer the proxy's connection handshake with LMDeploy's own protocol models, keep a book of the
Prefill sessions they retain, and free one when a Decode "migrates" it, as the real nodes do over ZMQ.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from lmdeploy.pytorch.disagg.config import DistServeEngineConfig
from lmdeploy.pytorch.disagg.conn.protocol import (
    DistServeConnectionResponse,
    DistServeConnectionStatus,
    DistServeInitResponse,
)

from lmdeploy_pdfix.domain.protocol import CAPABILITIES_PATH, NODE_PROOF_PATH, node_address, node_proof

MODEL = 'pdfix-stand-in'
BLOCK_IDS = [3, 4]
FIRST_TOKEN = 42


def decoded_text(owner: Any) -> str:
    return f'decoded from Prefill session {owner}'


@dataclass
class NodeBook:
    """What any stand-in node was sent, and how it answers a challenge to prove it holds the node key."""

    client_ports: set[int] = field(default_factory=set)  # one per TCP connection the node was called on
    authorizations: list[str] = field(default_factory=list)  # every Authorization header it was sent
    node_key: str | None = None  # the node key it proves it holds (None: it has no proof route)
    proof_relayed_to: str | None = None  # a real node it passes challenges on to, as a relay would
    hung: bool = False  # its process hangs: not even /health answers
    kv_usage: float | None = None  # the KV cache use its /metrics shows, as LMDeploy's gauge (None: no /metrics)


@dataclass
class PrefillBook(NodeBook):
    """What a Prefill node retains and what it was asked."""

    answer: str = 'owner'  # owner | no_owner | bad_owner | no_blocks | bad_digest | bad_logprobs | error | finished
    fixed: bool = True  # runs lmdeploy-pdfix: says so at the capability route
    probe_status: int = 200  # what the capability route answers (401: started with --api-keys the proxy lacks)
    free_status: int = 200  # what /distserve/free_cache answers
    delay_s: float = 0.0  # how long the prefill takes; like a real engine it keeps the cache if the caller left
    free_delay_s: float = 0.0  # how long a free takes to arrive; a caller that gives up first frees nothing
    free_delay_step_s: float = 0.0  # each free takes this much longer than the one asked before it
    frees_asked: int = 0
    kv_layout: dict[str, Any] | None = None  # what its capability route says of its KV cache (None: nothing)
    prefix_caching: bool = False  # what its capability route says: it caches prefixes
    retained: set[int] = field(default_factory=set)
    freed: list[int] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    invalid_frees: list[Any] = field(default_factory=list)
    owner_of_prompt: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    _ids: itertools.count = field(default_factory=lambda: itertools.count(100))

    def free(self, owner: Any) -> None:
        if owner in self.retained:
            self.retained.discard(owner)
            self.freed.append(owner)
        else:
            self.invalid_frees.append(owner)


@dataclass
class DecodeBook(NodeBook):
    answer: str = 'ok'  # ok | error | refuses (names the owner) | slow | dies | hangs (mid-stream)
    confirms: bool = False  # refuses (404) a cache its Prefill no longer retains, as a Decode's claim does
    migrations: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[Any] = field(default_factory=list)  # owners whose request the client abandoned
    kv_layout: dict[str, Any] | None = None  # what its capability route says of its KV cache (None: nothing)


def _new_app(book: NodeBook) -> FastAPI:
    """An app that notes the client port and credentials of every call, so a test can count the connections it
    came on and tell who was sent a key."""
    app = FastAPI()
    app.add_middleware(_NotingConnections, book=book)
    _add_handshake(app, book)
    _add_proof(app, book)
    return app


def _add_proof(app: FastAPI, book: NodeBook) -> None:
    @app.post(NODE_PROOF_PATH)
    async def proof(request: Request):
        if book.proof_relayed_to is not None:
            async with httpx.AsyncClient() as client:
                relayed = await client.post(book.proof_relayed_to + NODE_PROOF_PATH, content=await request.body())
            return JSONResponse(relayed.json(), relayed.status_code)
        if book.node_key is None:
            return JSONResponse({'detail': 'Not Found'}, 404)
        nonce = (await request.json())['nonce']
        return {'proof': node_proof(book.node_key, nonce, node_address(*request.scope['server']))}


class _NotingConnections:
    """Plain ASGI (Starlette's BaseHTTPMiddleware would hide a client's disconnect from the endpoints)."""

    def __init__(self, app, book: NodeBook) -> None:
        self.app, self.book = app, book

    async def __call__(self, scope, receive, send) -> None:
        if scope['type'] == 'http':
            self.book.client_ports.add(scope['client'][1])
            self.book.authorizations += [value.decode() for name, value in scope['headers']
                                         if name == b'authorization']
        await self.app(scope, receive, send)


def _add_handshake(app: FastAPI, book: NodeBook) -> None:
    @app.get('/health')
    async def health():  # LMDeploy's proxy heartbeat (every 90 s) removes a node whose /health is not 200
        await _while_hung(book)
        return {}

    @app.get('/metrics')
    async def metrics():
        if book.kv_usage is None:
            return JSONResponse({'detail': 'Not Found'}, 404)
        return PlainTextResponse(f'# TYPE lmdeploy:gpu_cache_usage_perc gauge\n'
                                 f'lmdeploy:gpu_cache_usage_perc{{model_name="{MODEL}"}} {book.kv_usage}\n')

    @app.get('/v1/models')
    async def models():
        return {'object': 'list', 'data': [{'id': MODEL, 'object': 'model'}]}

    @app.get('/distserve/engine_info')
    async def engine_info():
        return DistServeEngineConfig(tp_size=1, ep_size=1, dp_size=1, pp_size=None, dp_rank=0, block_size=64,
                                     num_cpu_blocks=0, num_gpu_blocks=128).model_dump_json()

    @app.post('/distserve/p2p_initialize')
    async def p2p_initialize():
        return DistServeInitResponse(status=DistServeConnectionStatus.SUCCESS,
                                     engine_endpoint_info={'zmq_address': 'tcp://127.0.0.1:1'},
                                     kvtransfer_endpoint_info=[]).model_dump(mode='json')

    @app.post('/distserve/p2p_connect')
    async def p2p_connect():
        return DistServeConnectionResponse(status=DistServeConnectionStatus.SUCCESS).model_dump(mode='json')


def prefill_app(book: PrefillBook) -> FastAPI:
    app = _new_app(book)
    if book.fixed:
        app.get(CAPABILITIES_PATH)(lambda: JSONResponse(
            {'cache_owner': True, 'kv_layout': book.kv_layout, 'prefix_caching': book.prefix_caching}
            if book.probe_status == 200 else
            {'error': 'Unauthorized'}, status_code=book.probe_status))

    @app.post('/distserve/free_cache')
    async def free_cache(request: Request):
        if book.free_status != 200:
            return JSONResponse({'status': 'FAILED'}, status_code=book.free_status)
        owner = (await request.json())['remote_session_id']
        delay_s = book.free_delay_s + book.free_delay_step_s * book.frees_asked
        book.frees_asked += 1
        if delay_s and await _abandoned(request, delay_s):
            return JSONResponse({'status': 'FAILED'}, status_code=499)
        book.free(owner)
        return {'status': 'SUCCESS'}

    async def prefill(request: Request, public_id: str):
        body = await request.json()
        book.requests.append(body)
        book.in_flight += 1
        book.most_in_flight = max(book.most_in_flight, book.in_flight)
        try:
            await asyncio.sleep(book.delay_s)
        finally:
            book.in_flight -= 1
        if book.answer == 'error':
            return JSONResponse({'error': {'message': 'prompt too long', 'code': 400}}, status_code=400)
        if book.answer == 'finished':  # the first token was a stop token: the Prefill ended the session itself
            return {'id': public_id, 'object': 'x', 'created': 1, 'model': MODEL, 'prefill_finished': True,
                    'choices': [{'index': 0, 'text': '', 'message': {'role': 'assistant', 'content': ''},
                                 'finish_reason': 'stop'}]}
        owner = next(book._ids)
        book.retained.add(owner)
        book.owner_of_prompt[str(body.get('prompt'))] = owner
        answer = {'id': public_id, 'object': 'x', 'choices': [], 'cache_block_ids': BLOCK_IDS,
                  'remote_token_ids': [FIRST_TOKEN], 'cache_session_id': owner}
        if book.answer == 'no_owner':
            del answer['cache_session_id']
        elif book.answer == 'bad_owner':
            answer['cache_session_id'] = 'chatcmpl-abc'
        elif book.answer == 'no_blocks':
            answer['cache_block_ids'] = []
        elif book.answer == 'bad_digest':
            answer['cache_prompt_digest'] = 'not a digest'
        elif book.answer == 'bad_logprobs':
            answer['cache_first_token_logprobs'] = [['a', 'b']]
        return answer

    @app.post('/v1/chat/completions')
    async def chat(request: Request):
        return await prefill(request, 'chatcmpl-StandIn')

    @app.post('/v1/completions')
    async def completions(request: Request):
        return await prefill(request, str((await request.json()).get('session_id', -1)))

    return app


def decode_app(book: DecodeBook, prefill: PrefillBook) -> FastAPI:
    app = _new_app(book)
    app.get(CAPABILITIES_PATH)(lambda: {'cache_owner': True, 'kv_layout': book.kv_layout})

    async def decode(request: Request):
        body = await request.json()
        migration = body.get('migration_request') or {}
        book.migrations.append(migration)
        if book.answer == 'error':
            return JSONResponse({'error': {'message': 'decode engine failed', 'code': 500}}, status_code=500)
        owner = migration.get('remote_session_id')
        if book.confirms and owner not in prefill.retained:
            message = f'migration_request refused: Prefill node: no preserved cache {owner}'
            return JSONResponse({'error': {'message': message, 'code': 404}}, status_code=404)
        if book.answer == 'refuses':
            message = f'migration_request refused: Prefill node: no preserved cache {owner} on this node'
            return JSONResponse({'error': {'message': message, 'code': 404}}, status_code=404)
        if book.answer == 'slow' and await _abandoned(request, seconds=5):
            book.aborted.append(owner)  # as LMDeploy's endpoints do: poll for the client, abort when it left
            return JSONResponse({'error': 'aborted'}, status_code=499)
        await asyncio.sleep(0.01)  # the KV copy
        prefill.free(owner)  # a real Decode frees the Prefill session over ZMQ once it has copied it
        text = decoded_text(owner)
        if body.get('stream'):
            return StreamingResponse(_events(text, book), media_type='text/event-stream')
        return {'id': 'decode', 'object': 'text_completion', 'choices': [{'index': 0, 'text': text}]}

    app.post('/v1/chat/completions')(decode)
    app.post('/v1/completions')(decode)
    return app


async def _while_hung(book: NodeBook) -> None:
    """Answer nothing until the test is over (its books are reset)."""
    while book.hung:
        await asyncio.sleep(0.05)


async def _abandoned(request: Request, seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.05)
    return False


async def _events(text: str, book: DecodeBook):
    for word in text.split(' '):
        yield f'data: {json.dumps({"choices": [{"index": 0, "text": word}]})}\n\n'
        if book.answer == 'dies':
            raise RuntimeError('the Decode engine died')  # the connection breaks mid-stream
        if book.answer == 'hangs':
            book.hung = True
            await _while_hung(book)
    yield 'data: [DONE]\n\n'


@dataclass
class Cluster:
    """The real proxy app over real HTTP to a stand-in Prefill and Decode node."""

    proxy: ModuleType
    url: str
    p_url: str
    d_url: str
    prefill: PrefillBook
    decode: DecodeBook

    def reset(self) -> None:
        self.prefill.__init__()
        self.decode.__init__()

    def register(self, role: str) -> None:
        roles = self.proxy.EngineRole
        url = self.p_url if role == 'Prefill' else self.d_url
        self.proxy.node_manager.add(url, self.proxy.Status(role=getattr(roles, role), models=[MODEL]))

    async def post(self, path: str, body: dict) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(self.url + path, json=body)


async def audit(cluster: Cluster) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(cluster.url + '/distserve/pdfix/audit')
    assert response.status_code == 200, response.text
    return response.json()

"""Prefill answers name the internal session that owns their retained cache (defects D1, D2).

LMDeploy's chat and completions endpoints answer a ``with_cache`` request with the cache's block ids but
not with its owner: the public ``id`` is ``chatcmpl-…`` (chat) or the caller's ``session_id`` (completions),
never the scheduler session the Decode node must free. This patch records the sessions an endpoint creates
(``ServerContext.create_session``) and adds ``cache_session_id`` to the non-streaming body and to the stream
chunk that carries ``cache_block_ids``, with the node's ticket for that cache (``cache_ticket``, issue 14) where
the engine keeps a book of preserved caches. Public ids are unchanged. A request whose first token is a stop
token (D8) gets a finished answer marked ``prefill_finished`` and its preserved session ended, instead of a
500 that keeps the session. Only a Prefill node honours ``preserve_cache``: elsewhere a client could pin KV
blocks that nothing evicts (D6) until the orphan TTL. The node also answers
``GET /distserve/pdfix/capabilities``, so a proxy can tell it names owners before sending it any work, and that
its KV layout matches the Decode's (D28).

A Prefill answer also names what a Decode needs beyond the blocks (issue 27): the digest of the prompt's token
ids (``cache_prompt_digest``: the Decode checks it renders the same prompt, D26) and the logprobs of the first
token where they were asked for (``cache_first_token_logprobs``: the Decode reports them with that token, D25).

The DistServe routes of the node (truthful frees, claims, audit) are the ``node_cache_routes`` unit; the
Decode node's checks of ``migration_request`` are ``decode_migration_checks``.
"""

from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass, field
from http import HTTPStatus
from types import ModuleType
from typing import Any

import shortuuid
from fastapi import Request
from fastapi.responses import JSONResponse

from lmdeploy_pdfix import __version__, settings
from lmdeploy_pdfix.domain.kv_layout import kv_layout
from lmdeploy_pdfix.domain.owner_ids import finished_without_tokens, single_owner
from lmdeploy_pdfix.domain.preserved import ReleaseCause
from lmdeploy_pdfix.domain.protocol import (
    CAPABILITIES_PATH,
    CHAT_PATH,
    CLAIM_PATH,
    FIRST_LOGPROBS_FIELD,
    NODE_PROOF_PATH,
    PREFILL_FINISHED_FIELD,
    PROMPT_DIGEST_FIELD,
    TicketIssuer,
    first_logprobs_on_wire,
    node_address,
    node_proof,
    parse_json,
    parse_nonce,
    prompt_digest,
    sse_chunk_with_owner,
    with_owner,
)
from lmdeploy_pdfix.patching import Patch, first_problem, signature_problem
from lmdeploy_pdfix.shared.lmdeploy_modules import (
    ASYNC_ENGINE_MODULE,
    DISTSERVE_MODULE,
    ENDPOINT_MODULES,
    ERRORS_MODULE,
)
from lmdeploy_pdfix.shared.node_book import release_cache
from lmdeploy_pdfix.shared.node_state import issue_ticket
from lmdeploy_pdfix.shared.routes import (
    each_transformed,
    find_post_route,
    rewritten_answer,
    swapping_after_register,
)


@dataclass
class _RequestTrace:
    """What one endpoint call created and generated, seen from LMDeploy's own calls."""

    sessions: list[int] = field(default_factory=list)
    # what a Decode needs to know of the cache the request keeps, beyond its blocks (issue 27): the digest of its
    # prompt, the logprobs of its first token; None when it keeps none
    cache_facts: dict[str, Any] | None = None
    input_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str | None = None

    def observe(self, output: Any) -> Any:
        self.input_tokens = output.input_token_len
        self.generated_tokens += len(output.token_ids or ())
        self.finish_reason = output.finish_reason or self.finish_reason
        if self.cache_facts is not None and output.logprobs and FIRST_LOGPROBS_FIELD not in self.cache_facts:
            self.cache_facts[FIRST_LOGPROBS_FIELD] = first_logprobs_on_wire(output.logprobs[0])
        return output


_trace: contextvars.ContextVar[_RequestTrace | None] = contextvars.ContextVar('lmdeploy_pdfix_trace', default=None)


def _recording_created_sessions(original):
    def create_session(self, *args, **kwargs):
        session = original(self, *args, **kwargs)
        trace = _trace.get()
        if trace is not None:
            trace.sessions.append(session.session_id)
        return session

    return create_session


def _observing_outputs(original):
    def generate(self, request, *args, **kwargs):
        outputs = original(self, request, *args, **kwargs)
        trace = _trace.get()
        if trace is None:
            return outputs
        if getattr(getattr(request, 'gen_config', None), 'with_cache', False):  # a Decode continues this prompt
            trace.cache_facts = {PROMPT_DIGEST_FIELD: prompt_digest(request.inputs['input_ids'])}
        return each_transformed(outputs, trace.observe)

    return generate


def _reporting_owner(path: str, server_context):
    def make_endpoint(endpoint):
        async def endpoint_reporting_owner(*args, **kwargs):
            raw_request = kwargs.get('raw_request')
            if raw_request is not None and not _is_prefill(server_context):
                # LMDeploy reads this very dict (Starlette caches the body): only a Prefill keeps caches for others
                (await raw_request.json()).pop('preserve_cache', None)
            elif raw_request is not None and _keeps_several_caches(await raw_request.json()):
                return _error_response(400, 'A preserve_cache request keeps one cache: send one prompt (a prompt '
                                            'list kept a cache per prompt that no answer named, until the '
                                            'orphan TTL).')
            trace = _RequestTrace()
            token = _trace.set(trace)
            try:
                response = await endpoint(*args, **kwargs)
            except IndexError:
                # D8: the first token was a stop token, LMDeploy indexes the absent token and would answer 500
                # while the engine keeps the preserved session. Answer the finished request and end it.
                owner = single_owner(trace.sessions)
                if owner is None or not finished_without_tokens(trace.finish_reason, trace.generated_tokens):
                    raise
                await release_cache(server_context.async_engine, owner, ReleaseCause.FREED)
                return _finished_answer(path, kwargs['request'], trace)
            finally:
                _trace.reset(token)
            tickets = issue_ticket if _is_prefill(server_context) else None  # only a Prefill preserves caches
            return _response_with_owner(response, single_owner(trace.sessions), tickets, trace.cache_facts)

        return endpoint_reporting_owner

    return make_endpoint


def _keeps_several_caches(body: Any) -> bool:
    prompt = body.get('prompt') if isinstance(body, dict) else None
    return bool(body.get('preserve_cache')) and isinstance(prompt, list) and len(prompt) != 1


def _error_response(status: int, message: str) -> Any:
    return importlib.import_module(ERRORS_MODULE).create_error_response(status, message)


def _is_prefill(server_context: Any) -> bool:
    role = getattr(getattr(server_context.async_engine, 'backend_config', None), 'role', None)
    return getattr(role, 'name', None) == 'Prefill'


def _finished_answer(path: str, request: Any, trace: _RequestTrace) -> dict[str, Any]:
    from lmdeploy.serve.openai import protocol

    usage = protocol.UsageInfo(prompt_tokens=trace.input_tokens, completion_tokens=0,
                               total_tokens=trace.input_tokens)
    if path == CHAT_PATH:
        choice = protocol.ChatCompletionResponseChoice(
            index=0, message=protocol.ChatMessage(role='assistant', content=''), finish_reason=trace.finish_reason)
        body = protocol.ChatCompletionResponse(id=f'chatcmpl-{shortuuid.random()}', model=request.model,
                                               choices=[choice], usage=usage)
    else:
        choice = protocol.CompletionResponseChoice(index=0, text='', finish_reason=trace.finish_reason)
        body = protocol.CompletionResponse(id=str(request.session_id), model=request.model, choices=[choice],
                                           usage=usage)
    return {**body.model_dump(), PREFILL_FINISHED_FIELD: True}


def _response_with_owner(response: Any, owner: int | None, tickets: TicketIssuer | None,
                         facts: dict[str, Any] | None) -> Any:
    if owner is None:
        return response
    return rewritten_answer(response, lambda body: with_owner(body, owner, tickets, facts),
                            lambda chunk: sse_chunk_with_owner(chunk, owner, tickets, facts))


def _layout_of(engine: Any) -> dict[str, Any]:
    """The node's KV cache layout, which the proxy compares between a Prefill and a Decode before linking them."""
    return kv_layout(getattr(engine, 'arch', None), getattr(engine, 'hf_cfg', None),
                     getattr(engine, 'backend_config', None))


def _caches_prefixes(engine: Any) -> bool:
    """Whether the node's engine keeps prefixes cached: the proxy then sends a prompt where its beginning may
    be cached already."""
    return getattr(getattr(engine, 'backend_config', None), 'enable_prefix_caching', False) is True


def _adding_capabilities(original):
    def register(router, server_context):
        original(router, server_context)

        @router.get(CAPABILITIES_PATH)
        async def pdfix_capabilities():
            # asked of the router, not of the switches: node_cache_routes adds claims and the truthful free together
            book = find_post_route(router.routes, CLAIM_PATH) is not None
            engine = server_context.async_engine
            return {'cache_owner': True, 'truthful_free': book, 'claims': book, 'lmdeploy_pdfix': __version__,
                    'kv_layout': _layout_of(engine), 'prefix_caching': _caches_prefixes(engine)}

        @router.post(NODE_PROOF_PATH)
        async def pdfix_node_proof(raw_request: Request) -> JSONResponse:
            return _proof_answer(await raw_request.body(), raw_request.scope.get('server'))

    return register


def _proof_answer(body: bytes, server: Any) -> JSONResponse:
    """This node's proof that it holds the node key, over the asker's nonce and the address it was reached at."""
    key = settings.NODE_API_KEY.value()
    if key is None:
        return JSONResponse({'detail': f'this node holds no {settings.NODE_API_KEY.name}'}, HTTPStatus.FORBIDDEN)
    try:
        nonce = parse_nonce(parse_json(body))
    except ValueError as exc:
        return JSONResponse({'detail': str(exc)}, HTTPStatus.BAD_REQUEST)
    address = settings.NODE_ADDRESS.value() or (node_address(*server) if server else '')
    return JSONResponse({'proof': node_proof(key, nonce, address)})


class ServingCacheOwnerPatch(Patch):
    wraps = (
        'lmdeploy.serve.openai.api_server:ServerContext.create_session',
        'lmdeploy.serve.core.async_engine:AsyncEngine.generate',
        'lmdeploy.serve.openai.chat_completions:register',
        'lmdeploy.serve.openai.endpoints.completions:register',
        'lmdeploy.serve.openai.endpoints.distserve:register',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        context = getattr(module, 'ServerContext', None)
        if context is None:
            return 'ServerContext is missing'
        registers = [signature_problem(importlib.import_module(name), 'register', ['router', 'server_context'])
                     for name in (*ENDPOINT_MODULES, DISTSERVE_MODULE)]
        engine = getattr(importlib.import_module(ASYNC_ENGINE_MODULE), 'AsyncEngine', None)
        if engine is None:
            return 'AsyncEngine is missing'
        if not callable(getattr(importlib.import_module(ERRORS_MODULE), 'create_error_response', None)):
            return 'create_error_response is missing'
        return first_problem(signature_problem(context, 'create_session', ['self', 'user_session_id']),
                             signature_problem(engine, 'generate', ['self', 'request', 'stream_response']),
                             *registers)

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.ServerContext, 'create_session', _recording_created_sessions)
        engine = importlib.import_module(ASYNC_ENGINE_MODULE).AsyncEngine
        self.wrap(engine, 'generate', _observing_outputs)
        for name, path in ENDPOINT_MODULES.items():
            self.wrap(importlib.import_module(name), 'register',
                      swapping_after_register(path, lambda context, path=path: _reporting_owner(path, context)))
        self.wrap(importlib.import_module(DISTSERVE_MODULE), 'register', _adding_capabilities)


PATCH = ServingCacheOwnerPatch()

"""Prefill answers name the internal session that owns their retained cache (defects D1, D2).

LMDeploy's chat and completions endpoints answer a ``with_cache`` request with the cache's block ids but
not with its owner: the public ``id`` is ``chatcmpl-…`` (chat) or the caller's ``session_id`` (completions),
never the scheduler session the Decode node must free. This patch records the sessions an endpoint creates
(``ServerContext.create_session``) and adds ``cache_session_id`` to the non-streaming body and to the stream
chunk that carries ``cache_block_ids``. Public ids are unchanged. The node also answers
``GET /distserve/pdfix/capabilities``, so a proxy can tell it names owners before sending it any work.
"""

from __future__ import annotations

import contextvars
import importlib
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from fastapi.responses import StreamingResponse

from lmdeploy_pdfix import __version__
from lmdeploy_pdfix.owner_ids import CAPABILITIES_PATH, single_owner, sse_chunk_with_owner, with_owner
from lmdeploy_pdfix.patches._routes import swap_endpoint
from lmdeploy_pdfix.patching import Patch, first_problem, install_wrapper, remove_wrapper, signature_problem

# The routes whose ``with_cache`` answers must name their owner, by the module that registers each.
ENDPOINT_MODULES = {
    'lmdeploy.serve.openai.chat_completions': '/v1/chat/completions',
    'lmdeploy.serve.openai.endpoints.completions': '/v1/completions',
}
DISTSERVE_MODULE = 'lmdeploy.serve.openai.endpoints.distserve'  # where the capability route joins

_created_sessions: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    'lmdeploy_pdfix_created_sessions', default=None)


def _recording_created_sessions(original):
    def create_session(self, *args, **kwargs):
        session = original(self, *args, **kwargs)
        created = _created_sessions.get()
        if created is not None:
            created.append(session.session_id)
        return session

    return create_session


def _reporting_owner(endpoint):
    async def endpoint_reporting_owner(*args, **kwargs):
        created: list[int] = []
        token = _created_sessions.set(created)
        try:
            response = await endpoint(*args, **kwargs)
        finally:
            _created_sessions.reset(token)
        return _response_with_owner(response, single_owner(created))

    return endpoint_reporting_owner


def _response_with_owner(response: Any, owner: int | None) -> Any:
    if owner is None:
        return response
    if isinstance(response, dict):
        return with_owner(response, owner)
    if isinstance(response, StreamingResponse):
        response.body_iterator = _stream_with_owner(response.body_iterator, owner)
    return response


async def _stream_with_owner(chunks: AsyncIterator[Any], owner: int) -> AsyncIterator[Any]:
    try:
        async for chunk in chunks:
            yield sse_chunk_with_owner(chunk, owner)
    finally:
        close = getattr(chunks, 'aclose', None)
        if close is not None:
            await close()


def _announcing_capabilities(original):
    def register(router, server_context):
        original(router, server_context)

        @router.get(CAPABILITIES_PATH)
        async def pdfix_capabilities():
            return {'cache_owner': True, 'lmdeploy_pdfix': __version__}

    return register


def _registering_owner_routes(path: str):
    def make_register(original):
        def register(router, server_context):
            original(router, server_context)
            swap_endpoint(router.routes, path, _reporting_owner)

        return register

    return make_register


class ServingCacheOwnerPatch(Patch):
    name = 'serving_cache_owner'
    target = 'lmdeploy.serve.openai.api_server'

    def shape_problem(self, module: ModuleType) -> str | None:
        context = getattr(module, 'ServerContext', None)
        if context is None:
            return 'ServerContext is missing'
        registers = [signature_problem(importlib.import_module(name), 'register', ['router', 'server_context'])
                     for name in (*ENDPOINT_MODULES, DISTSERVE_MODULE)]
        return first_problem(signature_problem(context, 'create_session', ['self', 'user_session_id']), *registers)

    def _apply(self, module: ModuleType) -> None:
        install_wrapper(module.ServerContext, 'create_session', _recording_created_sessions)
        for name, path in ENDPOINT_MODULES.items():
            install_wrapper(importlib.import_module(name), 'register', _registering_owner_routes(path))
        install_wrapper(importlib.import_module(DISTSERVE_MODULE), 'register', _announcing_capabilities)

    def _revert(self, module: ModuleType) -> None:
        remove_wrapper(module.ServerContext, 'create_session')
        for name in (*ENDPOINT_MODULES, DISTSERVE_MODULE):
            remove_wrapper(importlib.import_module(name), 'register')


PATCH = ServingCacheOwnerPatch()

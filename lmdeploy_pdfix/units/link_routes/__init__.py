"""A node's link routes and frees never block its event loop while the engine works (issue 9).

LMDeploy's ``/distserve/p2p_initialize``, ``p2p_connect``, ``p2p_drop_connect`` and ``free_cache`` call the
engine process by a synchronous RPC from inside the api_server's event loop: while the engine is busy, the
node answers nothing, ``/health`` included, and the proxy drops it. Here they call the same engine methods by
the engine's asynchronous RPC. (``node_cache_routes`` swaps ``free_cache`` for its truthful one where the
engine keeps a book of preserved caches; the plain one here serves otherwise.)
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.domain.protocol import FREE_PATH, P2P_CONNECT_PATH, P2P_DROP_CONNECT_PATH, P2P_INITIALIZE_PATH
from lmdeploy_pdfix.patching import (
    Patch,
    first_problem,
    signature_problem,
    wrapped_original,
)
from lmdeploy_pdfix.shared.lmdeploy_modules import WORKER_MODULE
from lmdeploy_pdfix.shared.node_book import engine_call
from lmdeploy_pdfix.shared.node_state import forget_link, record_link
from lmdeploy_pdfix.shared.routes import find_post_route, swap_endpoint

# LMDeploy's link routes, by path: the engine method each calls, and what this node notes of it afterwards.
LINK_ROUTES: dict[str, tuple[str, Any]] = {
    P2P_INITIALIZE_PATH: ('p2p_initialize', record_link),
    P2P_CONNECT_PATH: ('p2p_connect', None),
    P2P_DROP_CONNECT_PATH: ('p2p_drop_connect', forget_link),
}


def link_endpoint(server_context: Any, method: str, note: Any):
    """The endpoint of a link route, calling ``method`` by the engine's asynchronous RPC (never blocking)."""

    def make_endpoint(endpoint):
        # FastAPI reads the body model from LMDeploy's endpoint (this one's __wrapped__): one parameter
        async def link_route(**kwargs: Any) -> Any:
            (request,) = kwargs.values()
            result = await engine_call(server_context.async_engine, method, request)
            if note is not None:
                note(request)
            return result

        return link_route

    return make_endpoint


def plain_free_endpoint(server_context: Any):
    """LMDeploy's ``/distserve/free_cache`` answer when the engine keeps no book, without its blocking RPC."""

    def make_endpoint(endpoint):
        async def free_cache(cache_free_request) -> dict[str, str]:
            await engine_call(server_context.async_engine, 'end_session', cache_free_request.remote_session_id)
            return {'status': 'SUCCESS'}

        return free_cache

    return make_endpoint



def _nonblocking_links(original):
    def create_openai_router(server_context):
        router = original(server_context)
        for path, (method, note) in LINK_ROUTES.items():
            swap_endpoint(router.routes, path, link_endpoint(server_context, method, note))
        free = find_post_route(router.routes, FREE_PATH)
        if free is not None and wrapped_original(free.endpoint) is None:  # still LMDeploy's own
            swap_endpoint(router.routes, FREE_PATH, plain_free_endpoint(server_context))
        return router

    return create_openai_router


class LinkRoutesPatch(Patch):
    wraps = (
        'lmdeploy.serve.openai.api_server:create_openai_router',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        worker = getattr(importlib.import_module(WORKER_MODULE), 'EngineWorkerBase', None)
        if worker is None:
            return 'EngineWorkerBase is missing'
        return first_problem(signature_problem(module, 'create_openai_router', ['server_context']),
                             signature_problem(worker, 'end_session', ['self', 'session_id']),
                             signature_problem(worker, 'p2p_initialize', ['self', 'conn_request']),
                             signature_problem(worker, 'p2p_connect', ['self', 'conn_request']),
                             signature_problem(worker, 'p2p_drop_connect', ['self', 'drop_conn_request']))

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module, 'create_openai_router', _nonblocking_links)


PATCH = LinkRoutesPatch()

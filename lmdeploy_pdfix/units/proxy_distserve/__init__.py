"""The proxy's DistServe chat and completions routes migrate, shelve and release by cache owner (D1, D2, D12).

LMDeploy's proxy takes the Prefill answer's public ``id`` as the cache owner: ``int('chatcmpl-…')`` fails
every chat with HTTP 500, and completions carry the caller's ``session_id`` (``-1``), so the Decode node's
free misses and the Prefill session is kept forever. This patch serves both routes in DistServe mode with
our own relay (``relay.py`` beside it), which takes the owner from ``cache_session_id`` only, answers a missing or
invalid owner with a clear 502, releases the Prefill cache on every failure it sees, and returns the Decode
node's status as it is. It also makes ``POST /distserve/gc`` work (D17) and adds ``GET
/distserve/pdfix/audit``. Hybrid mode and ``--dummy-prefill`` keep LMDeploy's own handlers.

An answer is the one a Hybrid node gives (issue 27): a chat with ``n > 1`` goes through LMDeploy's own fan-out
(``chat_completions.fanout``), one relayed request per choice, each with its own Prefill cache (D18); completions
keep LMDeploy's single choice; the Prefill's request keeps a ``min_new_tokens`` that bans stop words from the
first token; and a Prefill/Decode pair whose KV layouts differ is refused before any work (D28).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib
import time
from collections import Counter
from http import HTTPStatus
from types import ModuleType
from typing import Any

from starlette.middleware import Middleware

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.ledger import OwnerLedger, ReleaseCause
from lmdeploy_pdfix.domain.protocol import (
    AUDIT_PATH,
    CHAT_PATH,
    COMPLETIONS_PATH,
    GC_PATH,
    forwarded_credentials,
    request_deadline_s,
)
from lmdeploy_pdfix.patching import (
    Patch,
    first_problem,
    installation,
    signature_problem,
)
from lmdeploy_pdfix.shared.node_client import close_node_client
from lmdeploy_pdfix.shared.proxy_books import PROXY
from lmdeploy_pdfix.shared.routes import find_post_route, restore_route, swap_endpoint
from lmdeploy_pdfix.units.proxy_distserve.fast_path import DistServeFastPath
from lmdeploy_pdfix.units.proxy_distserve.relay import (
    FANOUT_MODULE,
    observed,
    relay_distserve,
    release,
    within_deadline,
)

MIGRATION_FIELDS = {'protocol', 'remote_engine_id', 'remote_session_id', 'remote_token_id', 'remote_block_ids'}
# What the relay and the heartbeat read of LMDeploy's node manager at run time
NODE_MANAGER_READS = ('nodes', 'aiotimeout', 'migration_protocol', 'rdma_config', 'pd_connection_pool',
                      'dummy_prefill', 'serving_strategy')
# Never cut a migration that is merely queued: peers hold unmatched caches for 300-480 s.
GC_AGE_S = settings.GC_AGE_S.value()
REQUEST_DEADLINE_S = settings.REQUEST_DEADLINE_S.value()


def _relays_distserve(proxy: ModuleType) -> bool:
    """Whether the proxy serves DistServe through this relay (Hybrid and ``--dummy-prefill`` keep LMDeploy's)."""
    nodes = proxy.node_manager
    return nodes.serving_strategy == proxy.ServingStrategy.DistServe and not nodes.dummy_prefill


def _relaying_distserve(proxy: ModuleType, path: str):
    def make_endpoint(original):
        async def endpoint(request, raw_request=None):
            if not _relays_distserve(proxy):
                return await original(request, raw_request)
            nodes = proxy.node_manager
            rejected = await nodes.check_request_model(request.model)
            if rejected is not None:
                return rejected
            started, observer = time.perf_counter(), PROXY.observer
            headers = getattr(raw_request, 'headers', None)
            try:
                deadline_s = request_deadline_s(headers, REQUEST_DEADLINE_S)
            except ValueError as exc:
                return observed(proxy.create_error_response(HTTPStatus.BAD_REQUEST, str(exc)), observer, path, started)
            work = relay_distserve(proxy, path, PROXY.ledger, PROXY.breakers, request, forwarded_credentials(headers),
                                   observer)
            try:
                answer = await within_deadline(raw_request, work, deadline_s)
            except asyncio.TimeoutError:
                answer = proxy.create_error_response(HTTPStatus.GATEWAY_TIMEOUT,
                                                     f'The request took longer than its deadline ({deadline_s:g} s).')
            return observed(answer, observer, path, started)

        return endpoint

    return make_endpoint


def _closing_its_breaker(original):
    def add(self, node_url, status=None):
        # a node that registers (at its start, or again through the heartbeat) answers: it may take requests at
        # once, not only after its breaker's back-off (D29)
        PROXY.breakers.answered(node_url)
        return original(self, node_url, status)

    return add


def _collecting_garbage(proxy: ModuleType, ledger: OwnerLedger):
    def make_endpoint(original):
        async def cache_block_gc_to_be_migrated():
            live = set(proxy.node_manager.nodes)
            outcomes: Counter[bool] = Counter()
            for record in ledger.collectable(older_than_s=GC_AGE_S, live_urls=live, now=time.monotonic()):
                outcomes[await release(ledger, record, ReleaseCause.GC, 'gc')] += 1
            # counts, not owners: an owner id names a cache someone could free
            return {'released': outcomes[True], 'release_failed': outcomes[False],
                    'audit': ledger.audit(time.monotonic())}

        return cache_block_gc_to_be_migrated

    return make_endpoint


class ProxyDistServePatch(Patch):
    wraps = (
        'lmdeploy.serve.proxy.proxy:app.router.routes',
        'lmdeploy.serve.proxy.proxy:NodeManager.add',
        'lmdeploy.serve.proxy.proxy:app.user_middleware',
    )

    def __init__(self) -> None:
        super().__init__()
        self._originals: list[Any] = []

    def shape_problem(self, module: ModuleType) -> str | None:
        missing = [name for name in ('app', 'node_manager', 'NodeManager', 'EngineRole', 'ServingStrategy',
                                     'MigrationRequest', 'PDConnectionMessage', 'create_error_response',
                                     'CompletionRequest', 'ChatCompletionRequest')
                   if not hasattr(module, name)]
        if missing:
            return f'missing {", ".join(missing)}'
        if not isinstance(getattr(module.app, 'user_middleware', None), list):
            return 'the proxy app keeps no user_middleware list'
        router = module.app.router
        if not all(isinstance(getattr(router, hooks, None), list) for hooks in ('on_startup', 'on_shutdown')):
            return 'the proxy app has no on_startup and on_shutdown lists'
        routes = [path for path in (CHAT_PATH, COMPLETIONS_PATH, GC_PATH)
                  if find_post_route(module.app.router.routes, path)]
        if len(routes) != 3:
            return f'the proxy app does not serve POST {CHAT_PATH}, {COMPLETIONS_PATH} and {GC_PATH}'
        fields = set(module.MigrationRequest.model_fields)
        if not fields >= MIGRATION_FIELDS:
            return f'MigrationRequest lacks {sorted(MIGRATION_FIELDS - fields)}'
        protocol = importlib.import_module('lmdeploy.pytorch.disagg.conn.protocol')
        if not hasattr(protocol, 'DistServeCacheFreeRequest'):
            return 'DistServeCacheFreeRequest is missing'
        manager = module.NodeManager
        read = [name for name in NODE_MANAGER_READS if not hasattr(module.node_manager, name)]
        if read:
            return f'node_manager has no {", ".join(read)}'
        return first_problem(
            signature_problem(importlib.import_module(FANOUT_MODULE), 'fanout_chat_completions',
                              ['endpoint', 'request', 'raw_request', 'payload']),
            signature_problem(manager, 'get_node_url', ['self', 'model_name', 'role']),
            signature_problem(manager, 'add', ['self', 'node_url', 'status']),
            signature_problem(manager, 'pre_call', ['self', 'node_url']),
            signature_problem(manager, 'post_call', ['self', 'node_url', 'start']),
            signature_problem(manager, 'check_request_model', ['self', 'model_name']),
        )

    def _apply(self, module: ModuleType) -> None:
        PROXY.ledger = OwnerLedger()
        routes = module.app.router.routes
        for path in (CHAT_PATH, COMPLETIONS_PATH):
            self._originals.append(swap_endpoint(routes, path, _relaying_distserve(module, path)))
        # inside the operator's middlewares (added later, outside it), outside LMDeploy's CORS and FastAPI's own
        models = {CHAT_PATH: module.ChatCompletionRequest, COMPLETIONS_PATH: module.CompletionRequest}
        module.app.user_middleware.insert(0, Middleware(
            DistServeFastPath, serves=functools.partial(_relays_distserve, module),
            routes={path: (model, find_post_route(routes, path).endpoint) for path, model in models.items()}))
        module.app.middleware_stack = None  # (built again at the next request)
        self._originals.append(swap_endpoint(routes, GC_PATH, _collecting_garbage(module, PROXY.ledger)))
        module.app.add_api_route(AUDIT_PATH, self.audit, methods=['GET'], name='pdfix_audit')
        module.app.router.on_shutdown.append(close_node_client)
        # LMDeploy's imports (torch among them) leave some 320,000 objects that a full collection walks: 0.1-0.2 s
        # in which the proxy answers nobody. Frozen once it starts, they are never walked again.
        module.app.router.on_startup.append(gc.freeze)
        self.wrap(module.NodeManager, 'add', _closing_its_breaker)

    def audit(self) -> dict[str, Any]:
        """The proxy's books (open records by state, oldest age, releases by cause, owner rejections), the nodes
        its heartbeat removed, the nodes it skips after a failure (their breaker's state), and what it runs."""
        now = time.monotonic()
        breakers = {url: state.value for url, state in PROXY.breakers.snapshot(now).items()}
        return {**PROXY.ledger.audit(now), 'removed_nodes': PROXY.removed_roles(), 'breakers': breakers,
                'software': installation()}

    def _revert(self, module: ModuleType) -> None:
        super()._revert(module)
        module.app.user_middleware[:] = [layer for layer in module.app.user_middleware
                                         if layer.cls is not DistServeFastPath]
        module.app.middleware_stack = None
        routes = module.app.router.routes
        while self._originals:
            restore_route(routes, self._originals.pop())
        routes[:] = [route for route in routes if getattr(route, 'path', None) != AUDIT_PATH]
        module.app.router.on_shutdown.remove(close_node_client)
        module.app.router.on_startup.remove(gc.freeze)


PATCH = ProxyDistServePatch()

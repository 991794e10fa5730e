"""A node's ``/metrics`` carries its preserved caches, claims, refused migrations and migration failures.

LMDeploy's api_server serves its Prometheus registry at ``/metrics`` unless started with ``--disable-metrics``;
this unit adds pdfix's series to that registry (and none when metrics are disabled). The book they come from
lives in the engine process: each scrape first reads it over the engine's RPC (the audit the node serves at
``/distserve/pdfix/audit``), so a scrape shows the engine's figures as of that scrape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.patching import Patch, signature_problem, warn_once
from lmdeploy_pdfix.shared.lmdeploy_modules import API_SERVER_MODULE
from lmdeploy_pdfix.shared.node_state import NODE, node_audit

METRICS_PATH = '/metrics'
ENGINE_READ_TIMEOUT_S = 2.0  # a wedged engine must not wedge the scrape: its figures go stale, engine_book_up 0


class NodeFigures:
    """The latest read of the node's books, kept for the collector (which cannot await the engine itself)."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {'up': False}
        self.collector: Any = None

    def snapshot(self) -> Mapping[str, Any]:
        return self.latest

    async def refresh(self) -> None:
        read = asyncio.ensure_future(node_audit())
        try:  # shielded: an RPC cancelled half-way could leave its answer to the next caller
            self.latest = {**await asyncio.wait_for(asyncio.shield(read), ENGINE_READ_TIMEOUT_S), 'up': True}
        except Exception as exc:
            warn_once('node metrics', f'reading the book of preserved caches for /metrics failed: {exc!r}')
            self.latest = {**self.latest, 'up': False, 'refused_migration_requests': dict(NODE.refused_migrations)}

    def register(self) -> None:
        from prometheus_client import REGISTRY

        from lmdeploy_pdfix.shared.metrics import NodeCollector

        if self.collector is None:
            self.collector = NodeCollector(self.snapshot)
            REGISTRY.register(self.collector)

    def unregister(self) -> None:
        from prometheus_client import REGISTRY

        if self.collector is not None:
            REGISTRY.unregister(self.collector)
            self.collector = None


FIGURES = NodeFigures()


def _refreshing_first(app: Any):
    async def metrics_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope['type'] == 'http':
            await FIGURES.refresh()
        await app(scope, receive, send)

    metrics_app.__wrapped__ = app
    return metrics_app


def _with_node_figures(original):
    def mount_metrics(app, backend_config):
        original(app, backend_config)
        mounted = next((route for route in app.routes if getattr(route, 'path', None) == METRICS_PATH
                        and hasattr(route, 'app')), None)
        if mounted is None or NODE.server_context is None:  # --disable-metrics, or no distserve routes
            return
        FIGURES.register()
        mounted.app = _refreshing_first(mounted.app)

    return mount_metrics


class NodeMetricsPatch(Patch):
    wraps = (f'{API_SERVER_MODULE}:mount_metrics',)

    def shape_problem(self, module: ModuleType) -> str | None:
        return signature_problem(module, 'mount_metrics', ['app', 'backend_config'])

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module, 'mount_metrics', _with_node_figures)

    def _revert(self, module: ModuleType) -> None:
        super()._revert(module)
        FIGURES.unregister()


PATCH = NodeMetricsPatch()

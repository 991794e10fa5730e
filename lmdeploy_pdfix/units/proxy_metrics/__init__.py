"""The proxy serves Prometheus metrics of its DistServe relay at ``/metrics``; LMDeploy's proxy serves none.

Requests by route and outcome, the time each phase took, the retained Prefill caches open by state and the
oldest one's age, releases by cause, failed releases and rejected owners, calls sent to another node by cause,
the wait for a node and the nodes out of rotation (:mod:`lmdeploy_pdfix.shared.metrics`), beside the process's
own CPU, memory and garbage-collector series.
"""

from __future__ import annotations

import importlib.util
import time
from types import ModuleType

from fastapi.responses import Response

from lmdeploy_pdfix.patching import Patch
from lmdeploy_pdfix.shared.proxy_books import PROXY, RelayObserver

PROXY_MODULE = 'lmdeploy.serve.proxy.proxy'
METRICS_PATH = '/metrics'


class ProxyMetricsPatch(Patch):
    wraps = (f'{PROXY_MODULE}:app.router.routes',)

    def shape_problem(self, module: ModuleType) -> str | None:
        if importlib.util.find_spec('prometheus_client') is None:
            return 'not applicable: prometheus_client is not installed'
        if not hasattr(module, 'app'):
            return 'the proxy app is missing'
        if any(getattr(route, 'path', None) == METRICS_PATH for route in module.app.router.routes):
            return f'the proxy already serves {METRICS_PATH}'
        return None

    def _apply(self, module: ModuleType) -> None:
        from prometheus_client import (
            CONTENT_TYPE_LATEST,
            CollectorRegistry,
            gc_collector,
            generate_latest,
            platform_collector,
            process_collector,
        )

        from lmdeploy_pdfix.shared.metrics import BreakerCollector, LedgerCollector, ProxyMetrics

        registry = CollectorRegistry()  # its own: a process may apply and revert this unit more than once
        for collector in (process_collector.ProcessCollector, gc_collector.GCCollector,
                          platform_collector.PlatformCollector):
            collector(registry=registry)
        registry.register(LedgerCollector(lambda: PROXY.ledger, time.monotonic))
        registry.register(BreakerCollector(lambda: PROXY.breakers, time.monotonic))
        PROXY.observer = ProxyMetrics(registry)

        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

        module.app.add_api_route(METRICS_PATH, metrics, methods=['GET'], include_in_schema=False)

    def _revert(self, module: ModuleType) -> None:
        PROXY.observer = RelayObserver()
        routes = module.app.router.routes
        routes[:] = [route for route in routes if getattr(route, 'path', None) != METRICS_PATH]


PATCH = ProxyMetricsPatch()

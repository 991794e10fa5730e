"""The proxy's heartbeat: a node that was slow or unhealthy for a while comes back once it answers (D21, issue 9).

LMDeploy's real ``NodeManager`` asks real HTTP nodes on 127.0.0.1 for ``/health``; each node here answers as
the test says (200, 503, or nothing at all). The heartbeat runs as LMDeploy's heartbeat thread runs it:
``remove_stale_nodes_by_expiration()``.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lmdeploy_pdfix.patches import proxy_heartbeat
from tests.servers import serving

HEALTH_TIMEOUT_S = 0.5
HEARTBEAT_LIMIT_S = 5.0  # a heartbeat that has not returned by then hangs


@dataclass
class Health:
    answer: str = 'ok'  # ok | unhealthy | silent


def node_app(health: Health) -> FastAPI:
    app = FastAPI()

    @app.get('/health')
    async def health_route():
        while health.answer == 'silent':  # accepts the connection, answers nothing (a wedged event loop)
            await asyncio.sleep(0.05)
        return JSONResponse({}, status_code=200 if health.answer == 'ok' else 503)

    return app


@pytest.fixture
def proxy(apply_patch, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setattr(proxy_heartbeat, 'HEALTH_TIMEOUT_S', HEALTH_TIMEOUT_S)
    module = importlib.import_module('lmdeploy.serve.proxy.proxy')
    nodes = module.node_manager
    monkeypatch.setattr(nodes, 'cache_status', False)  # never write proxy_config.json into site-packages
    apply_patch('proxy_heartbeat')
    yield module
    nodes.nodes.clear()


def register(proxy: ModuleType, url: str, role: str) -> None:
    status = proxy.Status(role=proxy.EngineRole[role], models=['pdfix-stand-in'])
    proxy.node_manager.add(url, status)


def heartbeat(proxy: ModuleType) -> None:
    """One heartbeat, failing the test if it does not return (LMDeploy's thread would hang there for good)."""
    done = threading.Event()

    def beat() -> None:
        proxy.node_manager.remove_stale_nodes_by_expiration()
        done.set()

    threading.Thread(target=beat, daemon=True).start()
    assert done.wait(HEARTBEAT_LIMIT_S), 'the heartbeat hangs on a node that answers nothing: no node is ' \
                                         'checked again'


@pytest.mark.regression
def test_a_node_removed_while_unhealthy_is_registered_again_once_it_answers(proxy: ModuleType) -> None:
    health = Health()
    with serving(node_app(health)) as decode:
        register(proxy, decode, 'Decode')

        health.answer = 'unhealthy'
        heartbeat(proxy)
        assert decode not in proxy.node_manager.nodes, 'an unhealthy node stays registered'

        health.answer = 'ok'
        heartbeat(proxy)
        assert decode in proxy.node_manager.nodes, 'the node answers again, but the proxy dropped it for good'
        status = proxy.node_manager.nodes[decode]
        assert status.role == proxy.EngineRole.Decode and status.models == ['pdfix-stand-in']
        assert status.unfinished == 0


@pytest.mark.regression
def test_a_node_that_answers_nothing_does_not_stop_the_heartbeat(proxy: ModuleType) -> None:
    silent, unhealthy = Health(answer='silent'), Health(answer='unhealthy')
    with serving(node_app(silent)) as wedged, serving(node_app(unhealthy)) as failing:
        register(proxy, wedged, 'Decode')
        register(proxy, failing, 'Prefill')

        try:
            heartbeat(proxy)
        finally:
            silent.answer = 'ok'  # lets its server stop

        assert wedged not in proxy.node_manager.nodes
        assert failing not in proxy.node_manager.nodes


def test_a_node_an_operator_removed_stays_removed(proxy: ModuleType) -> None:
    health = Health(answer='unhealthy')
    with serving(node_app(health)) as decode:
        register(proxy, decode, 'Decode')
        heartbeat(proxy)
        proxy.node_manager.remove(decode)  # the operator's /nodes/remove

        health.answer = 'ok'
        heartbeat(proxy)

        assert decode not in proxy.node_manager.nodes


def test_a_healthy_node_stays_registered_as_it_was(proxy: ModuleType) -> None:
    with serving(node_app(Health())) as prefill:
        register(proxy, prefill, 'Prefill')
        before = proxy.node_manager.nodes[prefill]

        heartbeat(proxy)

        assert proxy.node_manager.nodes[prefill] is before

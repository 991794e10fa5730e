"""A node registers with every proxy replica its ``--proxy-url`` names (issue 31, D30).

LMDeploy's own ``register_to_proxy``, as the api_server's lifespan calls it at start-up, over real HTTP to
stand-in proxies that record each ``/nodes/add``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request

from tests.servers import free_port, serving
from tests.stand_in_nodes import MODEL

pytestmark = pytest.mark.regression

NODE_URL = 'http://127.0.0.1:23333'
PREFILL = 2  # LMDeploy's EngineRole.Prefill


def proxy_app(registered: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post('/nodes/add')
    async def add(request: Request) -> str:
        registered.append(await request.json())
        return 'Added successfully'

    return app


@pytest.fixture
def api_server(apply_patch: Callable[[str], ModuleType]) -> ModuleType:
    return apply_patch('replica_registration')


def started_node(api_server: ModuleType, proxy_url: str) -> Any:
    context = api_server.ServerContext()
    engine = SimpleNamespace(engine=SimpleNamespace(is_dummy=False), model_name=MODEL,
                             backend_config=SimpleNamespace(role=SimpleNamespace(value=PREFILL), adapters=None))
    context.async_engine, context.proxy_url, context.api_server_url = engine, proxy_url, NODE_URL
    return context


def test_a_node_registers_with_every_proxy_its_proxy_url_names(api_server: ModuleType) -> None:
    first: list[dict] = []
    second: list[dict] = []
    with serving(proxy_app(first)) as first_url, serving(proxy_app(second)) as second_url:
        api_server.register_to_proxy(started_node(api_server, f'{first_url}, {second_url}/'))

    expected = {'url': NODE_URL, 'status': {'models': [MODEL], 'role': PREFILL}}
    assert (first, second) == ([expected], [expected])


def test_a_replica_that_is_down_does_not_keep_the_node_from_the_others(api_server: ModuleType) -> None:
    registered: list[dict] = []
    with serving(proxy_app(registered)) as live_url:
        api_server.register_to_proxy(started_node(api_server, f'http://127.0.0.1:{free_port()},{live_url}'))

    assert [body['url'] for body in registered] == [NODE_URL]

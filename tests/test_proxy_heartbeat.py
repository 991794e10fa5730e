"""The proxy's heartbeat: a node that was slow or unhealthy for a while comes back once it answers (D21, issue 9).

LMDeploy's real ``NodeManager`` asks real HTTP nodes on 127.0.0.1 for ``/health``; each node here answers as
the test says (200, 503, or nothing at all). The heartbeat runs as LMDeploy's heartbeat thread runs it:
``remove_stale_nodes_by_expiration()``, where an exception ends that thread for good.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from types import ModuleType

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmdeploy_pdfix.units import proxy_heartbeat as proxy_heartbeat
from tests.servers import serving

HEALTH_TIMEOUT_S = 0.5
HEARTBEAT_LIMIT_S = 5.0  # a heartbeat that has not returned by then hangs
UNPARSABLE_URL = 'http://a..b:1'  # /nodes/add takes it; urllib3 refuses it (LocationParseError) at every request


@dataclass
class Health:
    answer: str = 'ok'  # ok | unhealthy | silent
    asked: int = 0  # how many times the node was asked for /health


def node_app(health: Health) -> FastAPI:
    app = FastAPI()

    @app.get('/health')
    async def health_route():
        health.asked += 1
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
    """One heartbeat, failing the test if it raises or does not return: LMDeploy's heartbeat thread would end or
    hang there for good, and no node would be checked again."""
    outcome: list[Exception | None] = []

    def beat() -> None:
        try:
            proxy.node_manager.remove_stale_nodes_by_expiration()
        except Exception as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    thread.join(HEARTBEAT_LIMIT_S)
    assert outcome, 'the heartbeat hangs on a node that answers nothing: no node is checked again'
    assert outcome[0] is None, f'the heartbeat raised {outcome[0]!r}: its thread ends, no node is checked again'


class Clock:
    """The heartbeat's clock, moved on by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


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


def test_a_node_url_that_cannot_even_be_parsed_is_dropped_and_the_heartbeat_goes_on(proxy: ModuleType) -> None:
    dead, returning = Health(answer='unhealthy'), Health(answer='unhealthy')
    with serving(node_app(dead)) as prefill, serving(node_app(returning)) as decode:
        register(proxy, UNPARSABLE_URL, 'Decode')  # POST /nodes/add {"url": "http://a..b:1", "status": {...}}
        register(proxy, prefill, 'Prefill')
        register(proxy, decode, 'Decode')

        heartbeat(proxy)
        assert proxy.node_manager.nodes == {}, 'the unparsable node or a dead node stays registered'

        returning.answer = 'ok'
        heartbeat(proxy)
        assert list(proxy.node_manager.nodes) == [decode], 'the node that answers again is not registered again'


@pytest.mark.regression
def test_a_heartbeat_that_fails_midway_does_not_stop_the_next_one(proxy: ModuleType,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full() -> None:
        raise OSError(28, 'No space left on device')

    with serving(node_app(Health(answer='unhealthy'))) as dead, serving(node_app(Health(answer='unhealthy'))) as later:
        register(proxy, dead, 'Decode')
        with monkeypatch.context() as disk:
            disk.setattr(proxy.node_manager, 'update_config_file', disk_full)  # proxy_config.json cannot be written
            heartbeat(proxy)

        register(proxy, later, 'Prefill')
        heartbeat(proxy)

        assert later not in proxy.node_manager.nodes, 'the heartbeat after a failed one removes no dead node'


def test_a_removed_node_that_never_answers_is_forgotten_after_a_while(proxy: ModuleType,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(proxy_heartbeat, 'time', clock)
    monkeypatch.setattr(proxy_heartbeat, 'FORGET_REMOVED_AFTER_S', 600.0)
    health = Health(answer='unhealthy')
    with serving(node_app(health)) as decode:
        register(proxy, decode, 'Decode')
        heartbeat(proxy)  # removes it
        clock.now += 599.0
        heartbeat(proxy)
        assert health.asked == 2, 'a removed node is not asked again within 600 s of its removal'

        clock.now += 2.0
        heartbeat(proxy)  # 601 s after its removal
        health.answer = 'ok'
        clock.now += 90.0
        heartbeat(proxy)
        assert health.asked == 2, 'a node removed more than 600 s ago is still asked at every heartbeat'
        assert decode not in proxy.node_manager.nodes

        register(proxy, decode, 'Decode')  # as an LMDeploy node registers at its start
        heartbeat(proxy)
        assert decode in proxy.node_manager.nodes, 'a forgotten node cannot register again'


def test_the_oldest_removed_nodes_are_forgotten_beyond_the_most_remembered(proxy: ModuleType,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_heartbeat, 'MAX_REMOVED_NODES', 2)
    healths = [Health(answer='unhealthy') for _ in range(3)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serving(node_app(health))) for health in healths]
        for url in urls:  # removed one heartbeat after another: the first is the oldest
            register(proxy, url, 'Decode')
            heartbeat(proxy)
        assert proxy.node_manager.nodes == {}

        for health in healths:
            health.answer = 'ok'
        asked = healths[0].asked
        heartbeat(proxy)

        assert sorted(proxy.node_manager.nodes) == sorted(urls[1:]), 'the oldest removed node is not forgotten'
        assert healths[0].asked == asked, 'a forgotten node is still asked'


# anything /nodes/add takes as a URL, without letters (a name would wait on DNS): empty, unparsable, odd ports
junk_urls = st.one_of(st.text(alphabet='.:[]%@/?#0123456789- ', max_size=24),
                      st.text(alphabet='.:[]%@/0123456789', max_size=24).map('http://'.__add__))


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(urls=st.lists(junk_urls, min_size=1, max_size=4, unique=True))
@example(urls=[UNPARSABLE_URL, ''])
def test_any_registered_url_leaves_the_heartbeat_running_and_the_healthy_node_registered(
        proxy: ModuleType, urls: list[str]) -> None:
    health = Health()
    with serving(node_app(health)) as decode:
        register(proxy, decode, 'Decode')
        junk = [url for url in urls if url != decode]
        for url in junk:
            register(proxy, url, 'Prefill')
        try:
            heartbeat(proxy)
            assert decode in proxy.node_manager.nodes
            assert not set(junk) & set(proxy.node_manager.nodes), 'a URL that answers nothing stays registered'
        finally:
            for url in [decode, *junk]:
                proxy.node_manager.nodes.pop(url, None)
                proxy_heartbeat.PATCH.removed_nodes.forget(url)

"""Shared test machinery.

Regression tests (``@pytest.mark.regression``) specify operator-visible behaviour that stock LMDeploy gets
wrong. They take their patches from the ``apply_patch`` fixture; with ``PDFIX_TESTS_STOCK=1`` that fixture
applies nothing, so the same tests run against stock LMDeploy and must fail there
(``scripts/prove_regressions.py`` checks that every one of them does).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType

import pytest

from lmdeploy_pdfix import settings
from lmdeploy_pdfix._bootstrap import load_patch
from lmdeploy_pdfix.registry import BY_NAME
from lmdeploy_pdfix.shared.node_client import close_node_client
from tests.servers import serving
from tests.stand_in_nodes import Cluster, DecodeBook, PrefillBook, decode_app, prefill_app

STOCK = os.environ.get('PDFIX_TESTS_STOCK') == '1'


def pytest_configure(config: pytest.Config) -> None:
    if settings.enabled():
        raise pytest.UsageError(f'run the tests with {settings.TOGGLE} unset: each test applies what it needs')


@pytest.fixture(autouse=True)
async def closed_node_client() -> AsyncIterator[None]:
    """Each test's event loop closes its pooled node client when the test ends, as a served app does."""
    yield
    await close_node_client()


@pytest.fixture
def apply_patch() -> Iterator[Callable[[str], ModuleType]]:
    """``apply_patch(name)`` imports the patch's LMDeploy module, patches it (unless STOCK) and returns it."""
    applied = []

    def apply(name: str) -> ModuleType:
        spec = BY_NAME[name]
        module = importlib.import_module(spec.target)
        if not STOCK:
            patch = load_patch(spec)
            patch.apply(module)
            assert patch.reason is None, patch.reason
            applied.append(patch)
        return module

    yield apply
    for patch in reversed(applied):
        patch.revert()


@pytest.fixture(scope='session')
def stand_in_cluster() -> Iterator[Cluster]:
    """The proxy app served once per session: LMDeploy's connection pool keeps an HTTP session bound to the
    event loop of the first server that used it, so a second server of the same app would hang on it."""
    proxy = importlib.import_module('lmdeploy.serve.proxy.proxy')  # the package re-exports a function 'proxy'
    proxy.node_manager.cache_status = False  # never write proxy_config.json into site-packages
    prefill, decode = PrefillBook(), DecodeBook()
    with serving(prefill_app(prefill)) as p_url, serving(decode_app(decode, prefill)) as d_url, \
            serving(proxy.app) as url:
        yield Cluster(proxy, url, p_url, d_url, prefill, decode)


@pytest.fixture
def distserve(stand_in_cluster: Cluster, apply_patch: Callable[[str], ModuleType]) -> Iterator[Cluster]:
    """The stand-in cluster in DistServe mode, patched (unless STOCK), its books empty, both nodes registered."""
    nodes = stand_in_cluster.proxy.node_manager
    strategy = nodes.serving_strategy
    nodes.serving_strategy = stand_in_cluster.proxy.ServingStrategy.DistServe
    apply_patch('proxy_distserve')
    apply_patch('proxy_connections')
    stand_in_cluster.reset()
    stand_in_cluster.register('Prefill')
    stand_in_cluster.register('Decode')
    yield stand_in_cluster
    stand_in_cluster.reset()  # a node a test left hung answers its calls' ends
    nodes.nodes.clear()
    nodes.serving_strategy = strategy


@pytest.fixture
def admission_wait_s(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """A short LMDEPLOY_PDFIX_ADMISSION_WAIT_S for this test (the relay reads it once, at import)."""
    wait_s = 1.0
    relay = importlib.import_module('lmdeploy_pdfix.units.proxy_distserve.relay')
    monkeypatch.setattr(relay, 'ADMISSION_WAIT_S', wait_s)
    yield wait_s

"""A node's ``/metrics`` (LMDeploy's own, mounted by its ``mount_metrics``) carries the book of preserved caches.

LMDeploy's real ``mount_metrics`` and prometheus registry, an in-process engine's book; the cluster suite
checks the same series on real nodes (``tests/e2e/test_operator_view.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy_pdfix.shared.node_book import book_of
from lmdeploy_pdfix.shared.node_state import NODE


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """An in-process engine whose book the node's routes read (what ``node_cache_routes`` registers)."""
    engine = SimpleNamespace()
    monkeypatch.setattr(NODE, 'server_context', SimpleNamespace(async_engine=SimpleNamespace(engine=engine)))
    yield engine


def mounted_app(api_server: ModuleType, enable_metrics: bool) -> FastAPI:
    app = FastAPI()
    api_server.mount_metrics(app, SimpleNamespace(enable_metrics=enable_metrics))
    return app


async def scrape(app: FastAPI) -> dict[str, float]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url='http://node') as client:
        response = await client.get('/metrics')
    assert response.status_code == 200
    return {sample.name + str(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


@pytest.mark.regression
async def test_metrics_show_the_preserved_caches_and_releases_as_of_the_scrape(
        apply_patch: Callable[[str], ModuleType], engine: SimpleNamespace) -> None:
    app = mounted_app(apply_patch('node_metrics'), enable_metrics=True)
    book = book_of(engine)
    book.preserve(1, [3, 4])
    book.preserve(2, [5])
    book.claim(2, [5])
    first = await scrape(app)
    assert first["lmdeploy_pdfix_preserved_caches[('state', 'unclaimed')]"] == 1
    assert first["lmdeploy_pdfix_preserved_caches[('state', 'claimed')]"] == 1
    assert first["lmdeploy_pdfix_claims_total[('verdict', 'claimed')]"] == 1
    assert first['lmdeploy_pdfix_engine_book_up[]'] == 1

    from lmdeploy_pdfix.domain.preserved import ReleaseCause

    book.release(1, ReleaseCause.RECLAIMED, session_exists=True)
    book.release(9, ReleaseCause.FREED, session_exists=False)
    second = await scrape(app)
    assert second["lmdeploy_pdfix_preserved_caches[('state', 'unclaimed')]"] == 0
    assert second["lmdeploy_pdfix_preserved_cache_releases_total[('cause', 'reclaimed')]"] == 1
    assert second["lmdeploy_pdfix_frees_not_released_total[('reason', 'unknown')]"] == 1


@pytest.mark.regression
async def test_an_engine_that_does_not_answer_shows_as_down_not_as_an_error(
        apply_patch: Callable[[str], ModuleType], engine: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    app = mounted_app(apply_patch('node_metrics'), enable_metrics=True)

    async def unanswered(*args: object) -> None:
        raise TimeoutError('the engine process is gone')

    monkeypatch.setattr('lmdeploy_pdfix.shared.node_state.engine_call', unanswered)
    scraped = await scrape(app)
    assert scraped['lmdeploy_pdfix_engine_book_up[]'] == 0


def test_with_metrics_disabled_pdfix_adds_no_series(apply_patch: Callable[[str], ModuleType],
                                                    engine: SimpleNamespace) -> None:
    app = mounted_app(apply_patch('node_metrics'), enable_metrics=False)
    assert not any(getattr(route, 'path', None) == '/metrics' for route in app.routes)
    assert b'lmdeploy_pdfix_' not in generate_latest(REGISTRY)

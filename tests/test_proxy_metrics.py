"""The proxy's ``/metrics``: Prometheus text whose DistServe series move with the traffic it relays.

The real proxy app over real HTTP to stand-in nodes (the ``distserve`` fixture); the output is read with
prometheus_client's own parser, as Prometheus would read it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from types import ModuleType

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.stand_in_nodes import MODEL, Cluster

CHAT = {'model': MODEL, 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 8}
COMPLETION = {'model': MODEL, 'prompt': 'hi', 'max_tokens': 8}
PHASES = ('probe', 'prefill', 'link', 'decode_first_byte', 'total')


@pytest.fixture
def metered(distserve: Cluster, apply_patch: Callable[[str], ModuleType]) -> Iterator[Cluster]:
    apply_patch('proxy_metrics')
    yield distserve


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by name and sorted labels."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def scrape(cluster: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(cluster.url + '/metrics')
    assert response.status_code == 200, response.text
    assert response.headers['content-type'].startswith('text/plain')
    return samples(response.text)


def requests_total(scraped, route: str, outcome: str) -> float:
    return scraped.get(('lmdeploy_pdfix_proxy_requests_total', (('outcome', outcome), ('route', route))), 0.0)


def phase_count(scraped, phase: str) -> float:
    return scraped[('lmdeploy_pdfix_proxy_phase_seconds_count', (('phase', phase),))]


@pytest.mark.regression
async def test_requests_are_counted_by_route_and_outcome(metered: Cluster) -> None:
    before = await scrape(metered)
    assert (await metered.post('/v1/chat/completions', CHAT)).status_code == 200
    assert (await metered.post('/v1/completions', COMPLETION)).status_code == 200
    metered.decode.answer = 'error'
    assert (await metered.post('/v1/completions', COMPLETION)).status_code == 500
    assert (await metered.post('/v1/completions', {**COMPLETION, 'prompt': []})).status_code == 400
    after = await scrape(metered)

    def moved(route: str, outcome: str) -> float:
        return requests_total(after, route, outcome) - requests_total(before, route, outcome)

    assert moved('/v1/chat/completions', 'ok') == 1
    assert moved('/v1/completions', 'ok') == 1
    assert moved('/v1/completions', 'failed') == 1
    assert moved('/v1/completions', 'rejected') == 1


@pytest.mark.regression
async def test_every_phase_of_a_relayed_request_is_timed(metered: Cluster) -> None:
    before = await scrape(metered)
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream('POST', metered.url + '/v1/completions', json={**COMPLETION, 'stream': True}) as response:
        assert response.status_code == 200
        [line async for line in response.aiter_lines()]
    assert (await metered.post('/v1/chat/completions', CHAT)).status_code == 200
    after = await scrape(metered)
    for phase in PHASES:
        assert phase_count(after, phase) - phase_count(before, phase) == 2, phase
    assert requests_total(after, '/v1/completions', 'ok') - requests_total(before, '/v1/completions', 'ok') == 1


@pytest.mark.regression
async def test_retained_caches_are_shown_while_held_and_their_releases_by_cause(metered: Cluster) -> None:
    before = await scrape(metered)
    metered.decode.answer = 'slow'  # the Decode holds the request: its Prefill cache stays retained meanwhile
    request = asyncio.ensure_future(metered.post('/v1/completions', COMPLETION))
    await asyncio.sleep(1.0)
    during = await scrape(metered)
    assert during[('lmdeploy_pdfix_proxy_retained_caches', (('state', 'migrating'),))] == 1
    assert during[('lmdeploy_pdfix_proxy_retained_cache_oldest_age_seconds', ())] > 0.5
    assert (await request).status_code == 200
    metered.decode.answer = 'error'
    assert (await metered.post('/v1/completions', COMPLETION)).status_code == 500
    after = await scrape(metered)
    assert after[('lmdeploy_pdfix_proxy_retained_caches', (('state', 'migrating'),))] == 0

    def releases(cause: str) -> float:
        key = ('lmdeploy_pdfix_proxy_releases_total', (('cause', cause),))
        return after[key] - before[key]

    assert releases('migrated') == 1 and releases('compensated') == 1


@pytest.mark.regression
async def test_failed_releases_and_rejected_owners_are_counted(metered: Cluster) -> None:
    before = await scrape(metered)
    metered.prefill.free_status = 500
    metered.decode.answer = 'error'
    assert (await metered.post('/v1/completions', COMPLETION)).status_code == 500
    metered.prefill.free_status = 200
    metered.decode.answer = 'ok'
    metered.prefill.answer = 'bad_owner'
    assert (await metered.post('/v1/completions', COMPLETION)).status_code == 502
    after = await scrape(metered)
    failures = ('lmdeploy_pdfix_proxy_release_failures_total', (('cause', 'compensated'),))
    assert after[failures] - before[failures] == 1
    assert after[('lmdeploy_pdfix_proxy_retained_caches', (('state', 'release_failed'),))] >= 1
    rejections = {key: value for key, value in after.items() if key[0] == 'lmdeploy_pdfix_proxy_owner_rejections_total'}
    assert sum(rejections.values()) - sum(value for key, value in before.items() if key in rejections) == 1

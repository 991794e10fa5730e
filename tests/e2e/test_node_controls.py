"""Switches and controls an operator uses on a node, on the real cluster (issue 12).

Every node runs with ``LMDEPLOY_USE_ASYNC_MIGRATION=1`` and ``--enable-abort-handling``:

- D23: with asynchronous Mooncake migration, stock never answers a DistServe request (its transfer awaits a
  future nothing completes); patched answers exactly as the synchronous path does, and leaves nothing.
- Aborts on a Prefill node (``POST /abort_request``): of all its work once its answers are out, or while the
  requests still run, all at once or by session id. Each aborted request ends as aborted and no preserved
  cache is left; the node goes on serving. Stock keeps the caches nobody will migrate (until the orphan TTL,
  600 s) and, aborted mid-prefill, answers 500 and keeps them too (D4).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmdeploy_pdfix.domain.protocol import AUDIT_PATH
from lmdeploy_pdfix_sim import client, faults
from lmdeploy_pdfix_sim.cluster import MODEL_NAME, Cluster
from tests.e2e.conftest import MODES
from tests.e2e.test_engine_faults import prefill_sessions, restart
from tests.e2e.test_failure_paths import KINDS, Answer, get, post

pytestmark = pytest.mark.e2e

NODE_ENV = {'LMDEPLOY_USE_ASYNC_MIGRATION': '1', 'LMDEPLOY_PDFIX_MIGRATION_TIMEOUT_S': '10'}
STOCK_WAIT_S = 8.0  # a stock migration never ends: a request waits this long, then counts as unanswered
PRESERVED = 3
RELEASED_WITHIN_S = 5.0


@pytest.fixture(scope='module', params=MODES)
def controlled(request: pytest.FixtureRequest, start_cluster: Callable[..., Any]) -> Iterator[tuple[str, Cluster]]:
    mode = request.param
    with start_cluster(f'node-controls-{mode}', stock=mode == 'stock', env=NODE_ENV,
                       node_args=('--enable-abort-handling',)) as started:
        yield mode, started


@pytest.mark.regression
def test_with_async_migration_every_kind_of_request_answers_exactly_and_leaves_nothing(
        controlled: tuple[str, Cluster]) -> None:
    mode, cluster = controlled
    if mode == 'stock':  # its first migration never returns, and the Decode's migration loop with it
        result = client.request(cluster.proxy_url, 'completions', client.prompt_for(900), timeout_s=STOCK_WAIT_S)
        assert not result.ok, result
        return
    results = [client.request(cluster.proxy_url, kind, client.prompt_for(900 + index), timeout_s=60)
               for index, kind in enumerate(KINDS * 2)]
    assert all(result.ok for result in results), [result for result in results if not result.ok]
    audit = get(f'{cluster.decode_urls[0]}{AUDIT_PATH}').body
    assert audit['migration_failures'] == {}, audit
    assert cluster.settled_state(cluster.prefill_urls[0])['sessions'] == 0


def preserve_all(prefill: str, first: int,
                 extra: Callable[[int], dict[str, Any]]) -> tuple[list[Answer], list[threading.Thread]]:
    """``PRESERVED`` Prefill requests that keep their cache, as the proxy sends them, all at once (running)."""
    answers: list[Answer] = [None] * PRESERVED  # type: ignore[list-item]

    def send(index: int) -> None:
        answers[index] = post(f'{prefill}/v1/completions',
                              {**client.preserved_prefill_body(first + index), **extra(index)}, timeout_s=30)

    threads = [threading.Thread(target=send, args=(index,)) for index in range(PRESERVED)]
    for thread in threads:
        thread.start()
    return answers, threads


def serves(prefill: str) -> bool:
    """The Prefill node answers a plain completion (its engine goes on)."""
    answer = post(f'{prefill}/v1/completions', {'model': MODEL_NAME, 'prompt': client.prompt_for(990),
                                                'max_tokens': 2}, timeout_s=30)
    return answer.status == 200


def abort(prefill: str, **body: Any) -> int:
    return post(f'{prefill}/abort_request', body).status


@pytest.mark.regression
def test_aborting_all_work_releases_the_caches_a_prefill_preserved_for_decode_nodes(
        controlled: tuple[str, Cluster]) -> None:
    mode, cluster = controlled
    prefill = cluster.prefill_urls[0]
    baseline = prefill_sessions(cluster)
    answers, threads = preserve_all(prefill, 920, extra=lambda index: {})
    for thread in threads:
        thread.join()
    assert [answer.status for answer in answers] == [200] * PRESERVED
    assert prefill_sessions(cluster, expected=baseline + PRESERVED) == baseline + PRESERVED
    assert abort(prefill, abort_all=True) == 200
    left = prefill_sessions(cluster, expected=baseline, within_s=RELEASED_WITHIN_S) - baseline
    if mode == 'stock':
        assert left == PRESERVED  # kept for the orphan TTL's 600 s, though nobody will migrate them
        return
    assert left == 0 and serves(prefill)


@pytest.mark.regression
@pytest.mark.parametrize('how', ['all', 'by session id'])
def test_aborting_preserved_requests_while_they_run_ends_them_as_aborted_and_leaves_nothing(
        controlled: tuple[str, Cluster], how: str) -> None:
    mode, cluster = controlled
    prefill = cluster.prefill_urls[0]
    baseline = prefill_sessions(cluster)
    cluster.arm_fault(prefill, faults.SLOW_PREFILL, '4')
    first_session = 7000 if how == 'all' else 7100
    answers, threads = preserve_all(prefill, 930, extra=lambda index: {'session_id': first_session + index})
    cluster.wait_fault_taken(prefill, faults.SLOW_PREFILL)
    time.sleep(0.5)  # every request is in the engine
    if how == 'all':
        aborts = [abort(prefill, abort_all=True)]
    else:
        aborts = [abort(prefill, session_id=first_session + index) for index in range(PRESERVED)]
    for thread in threads:
        thread.join()
    left = prefill_sessions(cluster, expected=baseline, within_s=RELEASED_WITHIN_S) - baseline
    if mode == 'stock':
        try:
            assert left > 0 or any(answer.status != 200 for answer in answers), answers
        finally:
            restart(cluster, prefill)  # D4 may have ended its engine loop
        return
    reasons = [answer.body['choices'][0]['finish_reason'] for answer in answers]
    assert set(aborts) == {200} and [answer.status for answer in answers] == [200] * PRESERVED
    assert reasons == ['abort'] * PRESERVED
    assert left == 0 and serves(prefill)

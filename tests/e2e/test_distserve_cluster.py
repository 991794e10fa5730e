"""DistServe through the real proxy and nodes: stock shows each defect, patched fixes it.

Every answer is checked against the emulated model's exact text, which depends on the KV blocks the
Decode received, so a wrong or missing migration fails even with HTTP 200.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, prefill_forwards
from tests.e2e.conftest import MAX_PREFILL_TOKEN_NUM

pytestmark = pytest.mark.e2e

LEAK_REQUESTS = 100
CONCURRENCY = 32


@pytest.mark.parametrize('kind', ['chat', 'stream'])
def test_chat_through_proxy(cluster: Cluster, mode: str, kind: str) -> None:
    result = client.request(cluster.proxy_url, kind, client.prompt_for(1), timeout_s=30)
    if mode == 'stock':
        # D1: the proxy parses the chat id 'chatcmpl-…' as an int.
        assert not result.ok and result.status == 500, result
    else:
        assert result.ok, result


def test_prefill_returns_to_baseline_after_mixed_requests(cluster: Cluster, mode: str) -> None:
    prefill = cluster.prefill_urls[0]
    before = cluster.settled_state(prefill)
    results = [client.request(cluster.proxy_url, client.KINDS[i % 3], client.prompt_for(i), timeout_s=30)
               for i in range(LEAK_REQUESTS)]
    after = cluster.settled_state(prefill)
    leaked_sessions = after['sessions'] - before['sessions']
    lost_blocks = before['free_blocks'] - after['free_blocks']
    if mode == 'stock':
        # D1/D2: every preserved Prefill session (and its KV) stays behind, answered or not.
        assert leaked_sessions >= LEAK_REQUESTS // 2, (before, after)
        assert lost_blocks >= LEAK_REQUESTS // 2, (before, after)
    else:
        assert [r for r in results if not r.ok] == []
        assert (leaked_sessions, lost_blocks) == (0, 0), (before, after)


def test_concurrent_mix(cluster: Cluster, mode: str) -> None:
    def one(i: int) -> client.Result:
        return client.request(cluster.proxy_url, client.KINDS[i % 3], client.prompt_for(1000 + i), timeout_s=60)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, range(CONCURRENCY)))
    failed = [r for r in results if not r.ok]
    if mode == 'stock':
        # D1 (chat) and D12 (shared shelf key '-1' for completions) under concurrency.
        assert len(failed) >= CONCURRENCY // 3, failed
    else:
        assert failed == []


def _long_prompt_case(cluster: Cluster, timeout_s: float) -> tuple[client.Result, int]:
    prefill = cluster.prefill_urls[0]
    before = prefill_forwards(cluster.settled_state(prefill))
    result = client.request(cluster.proxy_url, 'completions', client.prompt_for(7, length=1500), timeout_s=timeout_s)
    after = prefill_forwards(cluster.settled_state(prefill))  # snapshots lag up to 0.1 s
    return result, after - before


def test_long_prompt_is_chunked_once_stock(start_cluster) -> None:
    # Own cluster: D3 leaves the Prefill re-running chunk 0 forever, which would load every later test.
    with start_cluster('stock-long', stock=True, max_prefill_token_num=MAX_PREFILL_TOKEN_NUM) as cluster:
        result, forwards = _long_prompt_case(cluster, timeout_s=10)
    assert result.status == 0, result  # no answer within the timeout
    assert forwards > 10 * math.ceil(1500 / MAX_PREFILL_TOKEN_NUM), forwards


def test_long_prompt_is_chunked_once_patched(patched_cluster: Cluster) -> None:
    result, forwards = _long_prompt_case(patched_cluster, timeout_s=60)
    assert result.ok, result
    assert forwards == math.ceil(1500 / MAX_PREFILL_TOKEN_NUM)

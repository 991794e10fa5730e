"""Owners across several nodes, and a negative control proving the text check sees a skipped KV transfer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster

pytestmark = pytest.mark.e2e


def test_owners_never_mix_across_two_prefill_two_decode(two_by_two_cluster: Cluster) -> None:
    cluster = two_by_two_cluster

    def one(i: int) -> client.Result:
        return client.request(cluster.proxy_url, client.KINDS[i % 3], client.prompt_for(2000 + i), timeout_s=60)

    before = [cluster.node_state(url)['counters'].get('tokens', 0) for url in cluster.prefill_urls]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    served = [cluster.node_state(url)['counters'].get('tokens', 0) - was
              for url, was in zip(cluster.prefill_urls, before, strict=True)]
    assert [r for r in results if not r.ok] == []
    assert all(served), f'a Prefill node served nothing: {served}'


def test_text_check_catches_a_skipped_kv_transfer(start_cluster) -> None:
    # Stock and sequential completions: the one path that answers 200 without the patches.
    with start_cluster('drop-kv', stock=True, drop_kv_on_decode=True) as cluster:
        results = [client.request(cluster.proxy_url, 'completions', client.prompt_for(i), timeout_s=30)
                   for i in range(5)]
        decode = cluster.settled_state(cluster.decode_urls[0])
    assert all(r.status == 200 for r in results), results
    assert not any(r.text == r.expected for r in results), results
    assert decode['counters'].get('migrations_dropped', 0) >= 5
    assert decode['counters'].get('kv_unwritten', 0) > 0

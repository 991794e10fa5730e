"""A node whose engine stopped making progress answers /health 503 within seconds, and the proxy stops
routing to it (issue 12, D24).

One Prefill and two Decode nodes; the proxy's heartbeat runs every 2 s. A fault ends a Decode's migration loop
(its task is cancelled, as an escaped cancellation would) or holds a Prefill's forward for an hour. Stock keeps
answering 200 for both: the ended task leaves the set its health check looks in, and its stall rule waits 90 s.
Each node a fault stopped is restarted after its test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmdeploy_pdfix_sim import client, faults
from lmdeploy_pdfix_sim.cluster import Cluster
from tests.e2e.conftest import MODES
from tests.e2e.test_engine_faults import migration_request, preserve_directly, restart
from tests.e2e.test_failure_paths import get, post

pytestmark = pytest.mark.e2e

HEARTBEAT_S = 2
STALL_S = 3.0
NODE_ENV = {'LMDEPLOY_CONTROLLER_HEART_BEAT_EXPIRATION': str(HEARTBEAT_S), 'LMDEPLOY_PDFIX_LOOP_STALL_S': str(STALL_S),
            'LMDEPLOY_PDFIX_ORPHAN_TTL_S': '3'}
SEEN_WITHIN_S = 5.0  # a second's poll, an RPC, and a loaded 2-core host


@pytest.fixture(scope='module', params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope='module')
def cluster(mode: str, start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    with start_cluster(f'engine-health-{mode}', stock=mode == 'stock', decode=2, env=NODE_ENV) as started:
        yield started


def first_503_within(url: str, seconds: float) -> float | None:
    """Seconds until ``url``'s /health first answered 503, or None if it did not within ``seconds``."""
    began = time.monotonic()
    while (waited := time.monotonic() - began) < seconds:
        if get(f'{url}/health', timeout_s=5).status == 503:
            return waited
        time.sleep(0.2)
    return None


def routed_to(cluster: Cluster, url: str, within_s: float) -> bool:
    """Whether the proxy still lists ``url`` after ``within_s`` (asked until it no longer does)."""
    deadline = time.monotonic() + within_s
    while url in get(f'{cluster.proxy_url}/nodes/status').body:
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)
    return False


def in_background(call: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


@pytest.mark.regression
def test_a_decode_whose_migration_loop_ended_answers_503_and_the_proxy_routes_around_it(
        cluster: Cluster, mode: str) -> None:
    decode = cluster.decode_urls[0]
    try:
        cluster.arm_fault(decode, faults.MIGRATION_LOOP_END)
        prefill = preserve_directly(cluster, 950).body
        owner, block_ids = prefill.get('cache_session_id', 0), prefill['cache_block_ids']  # stock names no owner
        in_background(lambda: post(f'{decode}/v1/completions', migration_request(cluster, owner, block_ids),
                                   timeout_s=10))
        cluster.wait_fault_taken(decode, faults.MIGRATION_LOOP_END)
        seen_after = first_503_within(decode, SEEN_WITHIN_S)
        if mode == 'stock':
            assert seen_after is None and routed_to(cluster, decode, HEARTBEAT_S * 2)
            return
        assert seen_after is not None, f'{decode} still answered 200 after {SEEN_WITHIN_S} s'
        assert not routed_to(cluster, decode, HEARTBEAT_S * 3), 'the proxy still routes to the dead Decode'
        results = [client.request(cluster.proxy_url, 'completions', client.prompt_for(960 + index), timeout_s=30)
                   for index in range(4)]
        assert all(result.ok for result in results), results  # served by the other Decode
    finally:
        restart(cluster, decode)


@pytest.mark.regression
def test_a_prefill_stuck_in_one_forward_answers_503_and_the_proxy_drops_it(cluster: Cluster, mode: str) -> None:
    prefill = cluster.prefill_urls[0]
    try:
        cluster.arm_fault(prefill, faults.SLOW_PREFILL, '3600')
        in_background(lambda: post(f'{prefill}/v1/completions', client.preserved_prefill_body(970), timeout_s=10))
        cluster.wait_fault_taken(prefill, faults.SLOW_PREFILL)
        seen_after = first_503_within(prefill, STALL_S + SEEN_WITHIN_S)
        if mode == 'stock':
            assert seen_after is None and routed_to(cluster, prefill, HEARTBEAT_S * 2)
            return
        assert seen_after is not None, f'{prefill} still answered 200 {STALL_S + SEEN_WITHIN_S} s into its forward'
        assert not routed_to(cluster, prefill, HEARTBEAT_S * 3), 'the proxy still routes to the stuck Prefill'
    finally:
        restart(cluster, prefill)

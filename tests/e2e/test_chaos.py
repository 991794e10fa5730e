"""Clients that leave under load, on the real cluster (issue 9): no wrong answer, nothing left, nodes serving.

The chaos of ``lmdeploy-pdfix-sim soak --chaos``, shorter than the benchmark's (``benchmarks/soak_chaos.py``, 10,000
requests per version): at concurrency 8, clients that leave right after sending, after the first chunk and
mid-stream, give up, or send what the Prefill rejects, at random, while the Decode node is killed and
restarted once. The regression tests behind it, which fail on stock, are the deterministic ones in
``test_migration_faults.py``, ``test_proxy_heartbeat.py`` and ``test_proxy_distserve.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmdeploy_pdfix_sim.cluster import Cluster
from lmdeploy_pdfix_sim.soak import _parser as soak_parser
from lmdeploy_pdfix_sim.soak import discover_nodes, run_chaos

pytestmark = pytest.mark.e2e

REQUESTS = 600
HEARTBEAT_S = 3  # the proxy checks its nodes often, so a removal and a return happen inside the run


@pytest.fixture(scope='module')
def chaos_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    with start_cluster('chaos', env={'LMDEPLOY_CONTROLLER_HEART_BEAT_EXPIRATION': str(HEARTBEAT_S)}) as cluster:
        yield cluster


@pytest.mark.parametrize('seed', [11, 12])
def test_clients_leaving_under_load_get_no_wrong_answer_and_leave_nothing_behind(
        chaos_cluster: Cluster, seed: int) -> None:
    cluster = chaos_cluster.revive()
    # the seeds share the cluster: each starts from a Prefill that the one before left with nothing
    assert cluster.settled_state(cluster.prefill_urls[0], timeout_s=60)['sessions'] == 0
    args = soak_parser().parse_args(['--proxy', cluster.proxy_url, '--chaos', '--requests', str(REQUESTS),
                                     '--concurrency', '8', '--seed', str(seed), '--decode-restarts', '1'])
    summary = run_chaos(args, discover_nodes(cluster.proxy_url), lambda: cluster.bounce(cluster.decode_urls[0]))
    print(json.dumps(summary, indent=1))  # whole, where a failing assert would shorten it

    assert summary['wrong_text_200'] == 0, summary
    assert not any(summary['prefill_sessions_left'].values()), summary
    assert summary['unhealthy_nodes'] == [], summary
    assert summary['exact_afterwards'] == '10/10', summary
    assert summary['decode_restarts'] == 1
    assert sum(summary['client_faults'].values()) > REQUESTS // 10, 'the load had too few misbehaving clients'

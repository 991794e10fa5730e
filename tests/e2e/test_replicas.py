"""Two proxy replicas over the same nodes, as behind a load balancer (issue 31, D30).

The 2 Prefill + 2 Decode cluster runs two patched proxies, and every node was started with ``--proxy-url``
naming both. A client that spreads its requests over the replicas gets every answer exact, each replica
releases what it relayed, and no node keeps a cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmdeploy_pdfix.domain.protocol import AUDIT_PATH
from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, http_json

pytestmark = pytest.mark.e2e

KINDS = ('completions', 'chat', 'stream')
REQUESTS = 48


def test_requests_spread_over_two_proxy_replicas_are_all_answered_and_leave_nothing(
        two_by_two_cluster: Cluster) -> None:
    cluster = two_by_two_cluster
    replicas = cluster.proxy_urls
    assert len(replicas) == 2
    open_before = [http_json('GET', f'{url}{AUDIT_PATH}')['open'] for url in replicas]  # an earlier test's dead caches
    # each replica links every Prefill/Decode pair before the load: a replica that links a pair the other already
    # uses re-links it on the nodes, and the other's migrations in flight on it fail (a 500; open, see D30)
    for url in replicas:
        http_json('POST', f'{url}/distserve/connection_warmup', {}, timeout=60)

    with ThreadPoolExecutor(8) as pool:  # a load balancer's round robin
        results = list(pool.map(lambda index: client.request(replicas[index % 2], KINDS[index % 3],
                                                             client.prompt_for(11000 + index), timeout_s=90),
                                range(REQUESTS)))

    failed = [result for result in results if not result.ok]
    assert failed == [], f'{len(failed)} of {REQUESTS} failed: {failed[:3]}'
    assert [cluster.settled_state(url)['sessions'] for url in cluster.prefill_urls] == [0, 0]
    assert [http_json('GET', f'{url}{AUDIT_PATH}')['open'] for url in replicas] == open_before


def test_doctor_examines_both_replicas_and_finds_them_agreeing(two_by_two_cluster: Cluster) -> None:
    run = subprocess.run([sys.executable, '-m', 'lmdeploy_pdfix.tools.cli', 'doctor', '--json', '--proxy',
                          ','.join(two_by_two_cluster.proxy_urls)], capture_output=True, text=True, timeout=120,
                         check=False)

    report = json.loads(run.stdout)
    assert [replica['proxy'] for replica in report['replicas']] == two_by_two_cluster.proxy_urls
    assert [len(replica['nodes']) for replica in report['replicas']] == [4, 4]
    assert report['problems'] == [], report['problems']

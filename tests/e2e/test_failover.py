"""A lost node costs a client nothing a retry can save, on the real cluster (issue 30, D29).

2 Prefill + 2 Decode nodes behind the patched proxy, under steady load: a Decode node is killed, later started
again, then a Prefill node is killed; or a Decode node hangs (SIGSTOP) for a while. Every request is answered with
its exact text, and no cache is left. With
1 Prefill + 1 Decode, requests sent while the only Decode restarts wait for it and are served. The proxy's
heartbeat (90 s) plays no part: the requests that meet a dead node find it out. Stock LMDeploy beside it
is measured by ``benchmarks/bench_failover.py``; the regression tests are in ``tests/test_proxy_failover.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmdeploy_pdfix.domain.protocol import AUDIT_PATH
from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, http_json

pytestmark = pytest.mark.e2e

CLIENTS = 8
KINDS = ('completions', 'chat')  # a stream that started on the killed Decode may fail: that is allowed, not tested


class Load:
    """``CLIENTS`` clients sending requests one after another while the ``with`` block runs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.results = cluster, []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CLIENTS)

    def _client(self, number: int) -> None:
        index = 0
        while not self._stop.is_set():
            index += 1
            prompt = client.prompt_for(5000 + number * 1000 + index)
            self.results.append(client.request(self.cluster.proxy_url, KINDS[index % 2], prompt, timeout_s=90))

    def __enter__(self) -> Load:
        for number in range(CLIENTS):
            self._pool.submit(self._client, number)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


def test_a_decode_then_a_prefill_killed_under_load_fail_no_request(two_by_two_cluster: Cluster) -> None:
    cluster = two_by_two_cluster
    decode, prefill = cluster.decode_urls[0], cluster.prefill_urls[0]
    with Load(cluster) as load:
        time.sleep(3)
        cluster.stop_node(decode)  # SIGKILL: the proxy still lists it
        time.sleep(3)
        cluster.restart_node(decode)
        time.sleep(3)
        cluster.stop_node(prefill)
        time.sleep(4)
        survivor = cluster.prefill_urls[1]

    failed = [result for result in load.results if not result.ok]
    assert len(load.results) >= 40, len(load.results)
    assert failed == [], f'{len(failed)} of {len(load.results)} failed: {failed[:3]}'
    assert cluster.settled_state(survivor)['sessions'] == 0
    # caches of the killed Prefill died with it: their frees failed, and gc keeps them until the node is gone
    assert set(http_json('GET', f'{cluster.proxy_url}{AUDIT_PATH}')['open_by_prefill']) <= {prefill}


def test_a_decode_that_hangs_under_load_fails_no_request(two_by_two_cluster: Cluster) -> None:
    cluster, decode = two_by_two_cluster, two_by_two_cluster.decode_urls[0]
    open_before = http_json('GET', f'{cluster.proxy_url}{AUDIT_PATH}')['open']  # an earlier test's dead caches
    with Load(cluster) as load:
        time.sleep(3)
        cluster.freeze(decode)  # SIGSTOP: it accepts connections and answers nothing, not even /health
        time.sleep(12)
        cluster.thaw(decode)
        time.sleep(2)

    failed = [result for result in load.results if not result.ok]
    assert len(load.results) >= 40, len(load.results)
    assert failed == [], f'{len(failed)} of {len(load.results)} failed: {failed[:3]}'
    # the calls given up on the frozen Decode were closed: once it runs again it aborts them and frees their caches
    assert [cluster.settled_state(url, timeout_s=60)['sessions'] for url in cluster.prefill_urls] == [0, 0]
    audit = http_json('GET', f'{cluster.proxy_url}{AUDIT_PATH}')
    assert audit['open'] == open_before, audit


def test_requests_that_meet_the_only_decode_restarting_wait_for_it_and_are_served(patched_cluster: Cluster) -> None:
    cluster, decode = patched_cluster, patched_cluster.decode_urls[0]
    cluster.stop_node(decode)
    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(client.request, cluster.proxy_url, KINDS[index % 2], client.prompt_for(7000 + index),
                               timeout_s=180) for index in range(4)]
        time.sleep(1)
        cluster.restart_node(decode)
        results = [answer.result() for answer in waiting]

    assert [result for result in results if not result.ok] == []
    assert cluster.settled_state(cluster.prefill_urls[0])['sessions'] == 0
    assert http_json('GET', f'{cluster.proxy_url}{AUDIT_PATH}')['open'] == 0

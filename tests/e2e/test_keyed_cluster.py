"""A cluster started with ``--api-keys`` serves DistServe (issue 11).

Stock DistServe sends no credentials on the proxy's calls to its nodes, so with keys it cannot link or serve at
all. Patched, the proxy forwards the client's ``Authorization`` with the requests it relays (as LMDeploy's
Hybrid proxy does) and authenticates its own calls, and the Decode's claims, with
``LMDEPLOY_PDFIX_NODE_API_KEY``; every route pdfix adds stays behind LMDeploy's authentication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmdeploy_pdfix.domain.protocol import AUDIT_PATH, CLAIM_PATH, FREE_PATH
from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster
from tests.e2e.conftest import MODES
from tests.e2e.test_failure_paths import KINDS, get, post

pytestmark = pytest.mark.e2e

KEY = 'pdfix-e2e-key'


@pytest.fixture(scope='module', params=MODES)
def keyed(request: pytest.FixtureRequest, start_cluster: Callable[..., Any]) -> Iterator[tuple[str, Cluster]]:
    mode = request.param
    # stock cannot link with keys: no warm-up, or the cluster would not even start
    with start_cluster(f'keyed-{mode}', stock=mode == 'stock', api_key=KEY, warmup=mode == 'patched') as started:
        yield mode, started


@pytest.mark.regression
def test_with_the_key_chat_and_completions_answer_exactly_and_leave_nothing(keyed: tuple[str, Cluster]) -> None:
    mode, cluster = keyed
    results = [client.request(cluster.proxy_url, kind, client.prompt_for(800 + index), api_key=KEY, timeout_s=60)
               for index, kind in enumerate(KINDS)]
    if mode == 'stock':
        assert not any(result.ok for result in results), results  # no credentials on its calls to the nodes
        return
    assert all(result.ok for result in results), results
    assert cluster.settled_state(cluster.prefill_urls[0])['sessions'] == 0


def test_without_the_key_the_proxy_and_every_distserve_route_answer_401(keyed: tuple[str, Cluster]) -> None:
    _, cluster = keyed
    assert client.request(cluster.proxy_url, 'completions', client.prompt_for(810)).status == 401
    prefill = cluster.prefill_urls[0]
    unauthenticated = [post(f'{prefill}{FREE_PATH}', {'remote_engine_id': 'x', 'remote_session_id': 1}),
                       post(f'{prefill}{CLAIM_PATH}', {'owner': 1, 'block_ids': [1]}),
                       get(f'{prefill}{AUDIT_PATH}')]
    assert [answer.status for answer in unauthenticated] == [401, 401, 401]
    assert get(f'{prefill}{AUDIT_PATH}', headers=cluster.credentials).status in (200, 404)  # 404: stock

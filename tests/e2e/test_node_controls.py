"""Switches and controls an operator uses on a node, on the real cluster (issue 12).

Every node runs with ``LMDEPLOY_USE_ASYNC_MIGRATION=1`` and ``--enable-abort-handling``:

- D23: with asynchronous Mooncake migration, stock never answers a DistServe request (its transfer awaits a
  future nothing completes); patched answers exactly as the synchronous path does, and leaves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmdeploy_pdfix.protocol import AUDIT_PATH
from lmdeploy_pdfix.sim import client
from lmdeploy_pdfix.sim.cluster import Cluster
from tests.e2e.conftest import MODES
from tests.e2e.test_failure_paths import KINDS, get

pytestmark = pytest.mark.e2e

NODE_ENV = {'LMDEPLOY_USE_ASYNC_MIGRATION': '1', 'LMDEPLOY_PDFIX_MIGRATION_TIMEOUT_S': '10'}
STOCK_WAIT_S = 8.0  # a stock migration never ends: a request waits this long, then counts as unanswered


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

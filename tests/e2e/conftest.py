"""Clusters for the end-to-end suite: real LMDeploy proxy and api_server processes, emulated model only.

Modules share a cluster wherever they need the same one: the 1 Prefill + 1 Decode clusters of each mode and
the cluster with an unfixed Prefill live for the whole session, and each test gets them with every node up
(``Cluster.revive``). Every cluster is stopped by process group, also when a test fails; a cluster a test is
done with stops in the background while the next test runs. ``stock`` = LMDeploy as released, ``patched`` =
LMDEPLOY_PDFIX=1.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig

MAX_PREFILL_TOKEN_NUM = 512
MODES = ('stock', 'patched')


@pytest.fixture(scope='session')
def sim_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp('sim')


@pytest.fixture(scope='session')
def stopping() -> Iterator[list[threading.Thread]]:
    """Clusters stopping in the background; the session ends once each has stopped."""
    threads: list[threading.Thread] = []
    yield threads
    for thread in threads:
        thread.join()


@pytest.fixture(scope='session')
def start_cluster(sim_root: Path, stopping: list[threading.Thread]) -> Callable[..., Any]:
    """``with start_cluster(name, **config): ...`` starts a cluster logging under the session's tmp dir."""

    @contextmanager
    def start(name: str, **config: Any) -> Iterator[Cluster]:
        cfg = ClusterConfig(log_dir=sim_root / name, model_dir=sim_root / 'model', **config)
        cluster = Cluster(cfg).start()
        try:
            yield cluster
        finally:
            stopping.append(threading.Thread(target=cluster.stop, name=f'stop {name}'))
            stopping[-1].start()

    return start


def _session_cluster(start_cluster: Callable[..., Any], name: str, **config: Any) -> Iterator[Cluster]:
    with start_cluster(name, max_prefill_token_num=MAX_PREFILL_TOKEN_NUM, **config) as cluster:
        yield cluster


@pytest.fixture(scope='session')
def stock_session_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    yield from _session_cluster(start_cluster, 'stock-1p1d', stock=True)


@pytest.fixture(scope='session')
def patched_session_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    # a request that meets the only Decode restarting waits for it (test_failover): longer than a loaded host's
    # restart takes
    yield from _session_cluster(start_cluster, 'patched-1p1d', stock=False,
                                env={'LMDEPLOY_PDFIX_ADMISSION_WAIT_S': '45'})


@pytest.fixture(scope='session')
def mixed_session_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    """A patched proxy and Decode with an unfixed (stock) Prefill node."""
    yield from _session_cluster(start_cluster, 'unfixed-prefill', stock=False, stock_roles=('Prefill',))


@pytest.fixture(scope='session')
def two_by_two_session_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    """2 Prefill + 2 Decode nodes behind two patched proxy replicas (the failover tests use the first); a node
    that hangs is found out within 5 + 2 s."""
    yield from _session_cluster(start_cluster, 'patched-2p2d', stock=False, prefill=2, decode=2, proxies=2,
                                env={'LMDEPLOY_PDFIX_HEALTH_TIMEOUT_S': '2'})


@pytest.fixture
def two_by_two_cluster(two_by_two_session_cluster: Cluster) -> Cluster:
    return two_by_two_session_cluster.revive()


@pytest.fixture
def stock_cluster(stock_session_cluster: Cluster) -> Cluster:
    return stock_session_cluster.revive()


@pytest.fixture
def patched_cluster(patched_session_cluster: Cluster) -> Cluster:
    return patched_session_cluster.revive()


@pytest.fixture
def mixed_cluster(mixed_session_cluster: Cluster) -> Cluster:
    return mixed_session_cluster.revive()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def cluster(mode: str, request: pytest.FixtureRequest) -> Cluster:
    return request.getfixturevalue(f'{mode}_cluster')

"""Clusters for the end-to-end suite: real LMDeploy proxy and api_server processes, emulated model only.

Clusters are session-scoped where the tests leave them usable; each is stopped (by process group) at the end
of the session, also when a test fails. ``stock`` = LMDeploy as released, ``patched`` = LMDEPLOY_PDFIX=1.
"""

from __future__ import annotations

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
def start_cluster(sim_root: Path) -> Callable[..., Any]:
    """``with start_cluster(name, **config): ...`` starts a cluster logging under the session's tmp dir."""

    @contextmanager
    def start(name: str, **config: Any) -> Iterator[Cluster]:
        cfg = ClusterConfig(log_dir=sim_root / name, model_dir=sim_root / 'model', **config)
        with Cluster(cfg) as cluster:
            yield cluster

    return start


def _session_cluster(start_cluster: Callable[..., Any], name: str, **config: Any) -> Iterator[Cluster]:
    with start_cluster(name, max_prefill_token_num=MAX_PREFILL_TOKEN_NUM, **config) as cluster:
        yield cluster


@pytest.fixture(scope='session')
def stock_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    yield from _session_cluster(start_cluster, 'stock-1p1d', stock=True)


@pytest.fixture(scope='session')
def patched_cluster(start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    yield from _session_cluster(start_cluster, 'patched-1p1d', stock=False)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def cluster(mode: str, request: pytest.FixtureRequest) -> Cluster:
    return request.getfixturevalue(f'{mode}_cluster')


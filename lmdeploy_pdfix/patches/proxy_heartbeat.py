"""The proxy's heartbeat: a node that was slow or unhealthy for a while comes back once it answers (D21).

LMDeploy's heartbeat removes every node whose ``/health`` does not answer 200, for good (a node registers
once, at its start), and asks with no timeout, so one node that accepts connections but answers
nothing stops the heartbeat itself. A node that was merely slow for one heartbeat thus turned a working
cluster into "No Decode node serves model" until restarted by hand (issue 9). The heartbeat here asks every
node at once, each under ``LMDEPLOY_PDFIX_HEALTH_TIMEOUT_S``, removes those that fail as LMDeploy does, and
keeps asking them: a removed node that answers again is registered again with its role and models.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.patching import (
    Patch,
    first_problem,
    signature_problem,
    warn,
)

HEALTH_TIMEOUT_S = settings.HEALTH_TIMEOUT_S.value()


class RemovedNodes:
    """Nodes the heartbeat removed, with what they registered as, until they answer again or register anew."""

    def __init__(self) -> None:
        self._status: dict[str, Any] = {}
        self._lock = threading.Lock()

    def remember(self, url: str, status: Any) -> None:
        with self._lock:
            self._status[url] = status

    def forget(self, url: str) -> None:
        with self._lock:
            self._status.pop(url, None)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)


def _healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f'{url}/health', timeout=HEALTH_TIMEOUT_S).status_code == 200
    except requests.RequestException:
        return False


def _heartbeat(removed: RemovedNodes):
    def make(original):
        def remove_stale_nodes_by_expiration(self):
            registered, gone = dict(self.nodes), removed.snapshot()
            urls = [*registered, *(url for url in gone if url not in registered)]
            if not urls:
                return
            with ThreadPoolExecutor(min(len(urls), 32), thread_name_prefix='pdfix-heartbeat') as pool:
                health = dict(zip(urls, pool.map(_healthy, urls), strict=True))
            for url, status in registered.items():
                if not health[url] and self.nodes.get(url) is status:  # not re-registered meanwhile
                    self.remove(url)
                    removed.remember(url, status)
                    warn(f'removed node {url} (no healthy answer within {HEALTH_TIMEOUT_S:g} s); it is registered '
                         'again once it answers')
            for url, status in gone.items():
                if url in self.nodes:  # it registered anew meanwhile (a restart)
                    removed.forget(url)
                elif health[url]:
                    self.add(url, status.model_copy(update={'unfinished': 0}))  # forgets it: add removes first
                    warn(f"node {url} answers again; registered again as {getattr(status.role, 'name', status.role)}")

        return remove_stale_nodes_by_expiration

    return make


def _forgetting_removed(removed: RemovedNodes):
    def make(original):
        def remove(self, node_url):
            removed.forget(node_url)  # removed by an operator, or registering anew: no longer ours to bring back
            return original(self, node_url)

        return remove

    return make


class ProxyHeartbeatPatch(Patch):
    name = 'proxy_heartbeat'
    target = 'lmdeploy.serve.proxy.proxy'
    wraps = (
        'lmdeploy.serve.proxy.proxy:NodeManager.remove_stale_nodes_by_expiration',
        'lmdeploy.serve.proxy.proxy:NodeManager.remove',
    )

    def __init__(self) -> None:
        super().__init__()
        self.removed_nodes = RemovedNodes()

    def shape_problem(self, module: ModuleType) -> str | None:
        manager = getattr(module, 'NodeManager', None)
        if manager is None or not hasattr(getattr(module, 'node_manager', None), 'nodes'):
            return 'NodeManager or node_manager.nodes is missing'
        if not {'role', 'models', 'unfinished'} <= set(getattr(module.Status, 'model_fields', {})):
            return 'Status lacks role, models or unfinished'
        return first_problem(
            signature_problem(manager, 'remove_stale_nodes_by_expiration', ['self']),
            signature_problem(manager, 'remove', ['self', 'node_url']),
            signature_problem(manager, 'add', ['self', 'node_url', 'status']),
        )

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.NodeManager, 'remove_stale_nodes_by_expiration', _heartbeat(self.removed_nodes))
        self.wrap(module.NodeManager, 'remove', _forgetting_removed(self.removed_nodes))

    def _revert(self, module: ModuleType) -> None:
        super()._revert(module)
        self.removed_nodes = RemovedNodes()


PATCH = ProxyHeartbeatPatch()

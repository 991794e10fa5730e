"""The proxy's heartbeat: a node that was slow or unhealthy for a while comes back once it answers (D21).

LMDeploy's heartbeat removes every node whose ``/health`` does not answer 200, for good (a node registers
once, at its start), and asks with no timeout, so one node that accepts connections but answers
nothing stops the heartbeat itself. A node that was merely slow for one heartbeat thus turned a working
cluster into "No Decode node serves model" until restarted by hand (issue 9). The heartbeat here asks every
node at once, each under ``LMDEPLOY_PDFIX_HEALTH_TIMEOUT_S``, removes those that fail as LMDeploy does, and
keeps asking them for ``FORGET_REMOVED_AFTER_S`` after their removal: a removed node that answers again within
that time is registered again with its role and models; after it, the node is forgotten (it registers anew at
its start, as LMDeploy nodes do). At most ``MAX_REMOVED_NODES`` removed nodes are remembered, the oldest
forgotten first, since anyone may register nodes through the proxy's ``/nodes/add``.

A node whose check raises anything (a URL urllib3 cannot parse, say) is unhealthy, and a round that fails
midway is logged: LMDeploy's heartbeat thread ends at its first exception, and no node would be checked again.
"""

from __future__ import annotations

import threading
import time
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
from lmdeploy_pdfix.shared.proxy_books import PROXY

HEALTH_TIMEOUT_S = settings.HEALTH_TIMEOUT_S.value()
# well above a slow spell (several of LMDeploy's 90-s heartbeats); a node down longer registers anew at its start
FORGET_REMOVED_AFTER_S = 600.0
# /nodes/add is open to anyone: junk registrations must not make every round longer without end
MAX_REMOVED_NODES = 256


class RemovedNodes:
    """Nodes the heartbeat removed, with what they registered as and when, until they answer again, register
    anew or are forgotten (``FORGET_REMOVED_AFTER_S`` after their removal, or the oldest beyond
    ``MAX_REMOVED_NODES``)."""

    def __init__(self) -> None:
        self._removed: dict[str, tuple[Any, float]] = {}  # in the order of removal
        self._lock = threading.Lock()

    def remember(self, url: str, status: Any) -> list[str]:
        """Remembers ``url`` as removed now; returns the oldest nodes forgotten to stay within the bound."""
        with self._lock:
            self._removed.pop(url, None)
            self._removed[url] = (status, time.monotonic())
            excess = list(self._removed)[:max(0, len(self._removed) - MAX_REMOVED_NODES)]
            for old in excess:
                del self._removed[old]
        return excess

    def forget(self, url: str) -> None:
        with self._lock:
            self._removed.pop(url, None)

    def forget_expired(self) -> list[str]:
        """Forgets the nodes removed ``FORGET_REMOVED_AFTER_S`` ago or earlier; returns them."""
        deadline = time.monotonic() - FORGET_REMOVED_AFTER_S
        with self._lock:
            expired = [url for url, (_, removed_at) in self._removed.items() if removed_at <= deadline]
            for url in expired:
                del self._removed[url]
        return expired

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {url: status for url, (status, _) in self._removed.items()}


def _healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f'{url}/health', timeout=HEALTH_TIMEOUT_S).status_code == 200
    except Exception:  # not only RequestException: urllib3's LocationParseError for http://a..b:1, say
        return False


def _heartbeat(removed: RemovedNodes):
    def make(original):
        def remove_stale_nodes_by_expiration(self):
            try:
                _beat(self, removed)
            except Exception as error:  # LMDeploy's heartbeat thread would end here, for good
                warn(f'a heartbeat failed midway ({error!r}); the next one runs as usual')

        return remove_stale_nodes_by_expiration

    return make


def _beat(manager: Any, removed: RemovedNodes) -> None:
    """One heartbeat: asks every registered node and every remembered removed one at once, removes the
    registered ones that fail and registers again the removed ones that answer."""
    for url in removed.forget_expired():
        warn(f'forgot removed node {url}: no healthy answer for {FORGET_REMOVED_AFTER_S:g} s; it registers anew '
             'at its start')
    registered, gone = dict(manager.nodes), removed.snapshot()
    urls = [*registered, *(url for url in gone if url not in registered)]
    if not urls:
        return
    with ThreadPoolExecutor(min(len(urls), 32), thread_name_prefix='pdfix-heartbeat') as pool:
        health = dict(zip(urls, pool.map(_healthy, urls), strict=True))
    for url, status in registered.items():
        if not health[url] and manager.nodes.get(url) is status:  # not re-registered meanwhile
            manager.remove(url)
            for old in removed.remember(url, status):
                warn(f'forgot removed node {old}: more than {MAX_REMOVED_NODES} removed nodes')
            warn(f'removed node {url} (no healthy answer within {HEALTH_TIMEOUT_S:g} s); it is registered again '
                 f'once it answers within {FORGET_REMOVED_AFTER_S:g} s')
    for url, status in gone.items():
        if url in manager.nodes:  # it registered anew meanwhile (a restart)
            removed.forget(url)
        elif health[url]:
            manager.add(url, status.model_copy(update={'unfinished': 0}))  # forgets it: add removes first
            warn(f"node {url} answers again; registered again as {getattr(status.role, 'name', status.role)}")


def _forgetting_removed(removed: RemovedNodes):
    def make(original):
        def remove(self, node_url):
            removed.forget(node_url)  # removed by an operator, or registering anew: no longer ours to bring back
            return original(self, node_url)

        return remove

    return make


class ProxyHeartbeatPatch(Patch):
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
        PROXY.removed_nodes = self.removed_nodes  # the proxy's audit names them
        self.wrap(module.NodeManager, 'remove_stale_nodes_by_expiration', _heartbeat(self.removed_nodes))
        self.wrap(module.NodeManager, 'remove', _forgetting_removed(self.removed_nodes))

    def _revert(self, module: ModuleType) -> None:
        super()._revert(module)
        self.removed_nodes = RemovedNodes()
        PROXY.removed_nodes = None


PATCH = ProxyHeartbeatPatch()

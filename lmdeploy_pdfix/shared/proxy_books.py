"""What the proxy's units share in the proxy process, so that none imports another: the ledger of retained caches
and the nodes' breakers (``proxy_distserve`` keeps them), the relay's observer (``proxy_metrics`` puts in one that
counts) and the nodes the heartbeat removed (``proxy_heartbeat`` keeps them)."""

from __future__ import annotations

from typing import Any

from lmdeploy_pdfix.domain.breakers import NodeBreakers
from lmdeploy_pdfix.domain.ledger import OwnerLedger


class RelayObserver:
    """What the relay reports of each request; this one drops it (``proxy_metrics`` puts in one that counts)."""

    def phase(self, name: str, seconds: float) -> None:
        """``seconds`` spent in one phase: probe, prefill, link, decode_first_byte."""

    def finished(self, route: str, status: int, seconds: float) -> None:
        """A request to ``route`` ended with the ``status`` its client got (499: the client left) after
        ``seconds`` in all."""

    def retried(self, role: str, cause: str) -> None:
        """A call to a ``role`` node failed for ``cause`` and went to another node, or waited for one: unreachable,
        disconnected, gone; decode_failed (a 5xx) and cache_taken (a Decode that failed may have taken the cache)
        start the request again from a Prefill."""

    def admission_waited(self, role: str, seconds: float, admitted: bool) -> None:
        """A request waited ``seconds`` for a ``role`` node; ``admitted``: one took it, else it was refused."""

    def waiting(self, role: str, change: int) -> None:
        """A request began (1) or ended (-1) waiting for a ``role`` node."""


class ProxyBooks:
    def __init__(self) -> None:
        self.ledger = OwnerLedger()
        self.breakers = NodeBreakers()
        self.observer = RelayObserver()
        self.removed_nodes: Any = None  # proxy_heartbeat's, while it is applied: has ``snapshot()``

    def removed_roles(self) -> dict[str, str | None]:
        """The nodes the heartbeat removed, with the role each registered as."""
        removed = self.removed_nodes.snapshot() if self.removed_nodes is not None else {}
        return {url: getattr(getattr(status, 'role', None), 'name', None) for url, status in removed.items()}


PROXY = ProxyBooks()

"""Which nodes the proxy may send a request to: a circuit breaker per node (issue 30, D29).

LMDeploy's proxy learns that a node is gone only from its heartbeat (every 90 s by default) and meanwhile keeps
choosing it. Here the request that finds a node unreachable opens that node's breaker at once: no request is
sent to it until its back-off has passed (1 s, doubling after each failed trial, at most 5 s); then one request
tries it (half-open), and an answer of any kind closes the breaker again. Plain rules, no I/O: the relay
reports what it saw and asks which nodes it may choose.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 5.0  # a node restarting (15 s here, minutes on GPUs) is tried again soon after it is back


class BreakerState(str, enum.Enum):
    CLOSED = 'closed'  # the node gets requests
    OPEN = 'open'  # the node failed; no request until its back-off has passed
    HALF_OPEN = 'half_open'  # the back-off has passed: the next request tries the node


@dataclass
class _Breaker:
    failures: int  # in a row, since the node last answered
    retry_at: float  # when the back-off ends (time.monotonic)

    @property
    def backoff_s(self) -> float:
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self.failures - 1))


class NodeBreakers:
    """The breakers of the nodes that failed; a node without one is closed."""

    def __init__(self) -> None:
        self._open: dict[str, _Breaker] = {}

    def state(self, url: str, now: float) -> BreakerState:
        breaker = self._open.get(url)
        if breaker is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < breaker.retry_at else BreakerState.HALF_OPEN

    def admissible(self, urls: Iterable[str], now: float) -> list[str]:
        """Those of ``urls`` a request may go to now (closed or half-open)."""
        return [url for url in urls if self.state(url, now) is not BreakerState.OPEN]

    def admit(self, url: str, now: float) -> bool:
        """Whether a request may go to ``url`` now. The one request admitted to a half-open node is its trial:
        the node is open again for its back-off, so a trial whose outcome never comes is not the last."""
        state = self.state(url, now)
        if state is BreakerState.HALF_OPEN:
            breaker = self._open[url]
            breaker.retry_at = now + breaker.backoff_s
        return state is not BreakerState.OPEN

    def failed(self, url: str, now: float) -> None:
        """A request found ``url`` unreachable: open its breaker, for longer after each failure in a row."""
        breaker = _Breaker(self._open[url].failures + 1 if url in self._open else 1, now)
        breaker.retry_at = now + breaker.backoff_s
        self._open[url] = breaker

    def answered(self, url: str) -> None:
        """``url`` answered (whatever the status): it is reachable, its breaker closes."""
        self._open.pop(url, None)

    def retry_after_s(self, urls: Iterable[str], now: float) -> float:
        """Seconds until the first of ``urls`` may be tried again (0 if one may be tried now)."""
        waits = [max(0.0, self._open[url].retry_at - now) if url in self._open else 0.0 for url in urls]
        return min(waits, default=0.0)

    def snapshot(self, now: float) -> dict[str, BreakerState]:
        """The state of every node whose breaker is not closed."""
        return {url: self.state(url, now) for url in self._open}


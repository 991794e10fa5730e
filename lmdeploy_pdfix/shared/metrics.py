"""Prometheus series of the DistServe control plane: the proxy's relay and ledger, each node's preserved caches.

Every name starts ``lmdeploy_pdfix_``; counters end ``_total``, durations are ``_seconds``; labels take few
values (a route, a phase, a state, a cause, a verdict, a reason). Counters and gauges that mirror a book are
read from it at scrape time, so a scrape never disagrees with the audit routes. No patching here: the
``proxy_metrics`` and ``node_metrics`` units register these. Imported only by them (prometheus_client is
LMDeploy's dependency, never loaded at interpreter start-up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmdeploy_pdfix.domain import breakers, ledger, preserved
from lmdeploy_pdfix.domain.protocol import CLIENT_CLOSED_REQUEST
from lmdeploy_pdfix.shared.proxy_books import RelayObserver

PREFIX = 'lmdeploy_pdfix'
PHASES = ('probe', 'prefill', 'link', 'decode_first_byte', 'total')
# from a cached capability answer (sub-millisecond) to a Decode queued for minutes
# the reasons known up front (others appear as they happen): a refusal's HTTP phrase, a failure's kind
REFUSAL_REASONS = [HTTPStatus(status).phrase for status in (400, 404, 409, 410, 502)]
MIGRATION_FAILURE_REASONS = ['timeout', 'cancelled', 'aborted', 'claim_expired']
ROLES = ('Prefill', 'Decode')
RETRY_CAUSES = ('unreachable', 'disconnected', 'hung', 'gone', 'decode_failed', 'cache_taken')
PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def outcome_of(status: int) -> str:
    """How a relayed request ended, from the status the client got."""
    if status == CLIENT_CLOSED_REQUEST:
        return 'client_gone'
    if status < HTTPStatus.BAD_REQUEST:
        return 'ok'
    return 'rejected' if status < HTTPStatus.INTERNAL_SERVER_ERROR else 'failed'


class ProxyMetrics(RelayObserver):
    """What the relay observes of each request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests = Counter(f'{PREFIX}_proxy_requests', 'DistServe requests relayed, by route and outcome',
                                 ['route', 'outcome'], registry=registry)
        self._phases = Histogram(f'{PREFIX}_proxy_phase_seconds', 'Time a DistServe request spent in each phase',
                                 ['phase'], buckets=PHASE_BUCKETS_S, registry=registry)
        for phase in PHASES:
            self._phases.labels(phase)
        self._retries = Counter(f'{PREFIX}_proxy_retries', 'Calls to a node that could not take them, sent to '
                                'another node or waited on, by role and cause', ['role', 'cause'], registry=registry)
        self._admission = Histogram(f'{PREFIX}_proxy_admission_wait_seconds', 'Time a DistServe request waited '
                                    'for a node of a role, by outcome (admitted; refused: 503 or 429 with Retry-After)',
                                    ['role', 'outcome'], buckets=PHASE_BUCKETS_S, registry=registry)
        self._waiting = Gauge(f'{PREFIX}_proxy_waiting_requests', 'DistServe requests waiting now for a node of a '
                              'role (every one down, failed just now, or at its limit of requests in flight)',
                              ['role'], registry=registry)
        for role in ROLES:
            self._waiting.labels(role)
            for cause in RETRY_CAUSES:
                self._retries.labels(role, cause)
            for outcome in ('admitted', 'refused'):
                self._admission.labels(role, outcome)

    def phase(self, name: str, seconds: float) -> None:
        self._phases.labels(name).observe(seconds)

    def finished(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route, outcome_of(status)).inc()
        self.phase('total', seconds)

    def retried(self, role: str, cause: str) -> None:
        self._retries.labels(role, cause).inc()

    def admission_waited(self, role: str, seconds: float, admitted: bool) -> None:
        self._admission.labels(role, 'admitted' if admitted else 'refused').observe(seconds)

    def waiting(self, role: str, change: int) -> None:
        self._waiting.labels(role).inc(change)


class BreakerCollector(Collector):
    """How many nodes the proxy keeps out of rotation now, by breaker state, read from its breakers at each
    scrape."""

    def __init__(self, current_breakers: Callable[[], breakers.NodeBreakers], clock: Callable[[], float]) -> None:
        self._breakers = current_breakers
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        states = [state.value for state in self._breakers().snapshot(self._clock()).values()]
        yield _gauge_by('proxy_node_breakers', 'Nodes whose breaker is not closed (open: skipped after a failure; '
                        'half_open: the next request tries them), by state', 'state',
                        {state: states.count(state) for state in states},
                        [breakers.BreakerState.OPEN.value, breakers.BreakerState.HALF_OPEN.value])


class LedgerCollector(Collector):
    """The proxy's open records and their outcomes, read from its ledger at each scrape."""

    def __init__(self, current_ledger: Callable[[], ledger.OwnerLedger], clock: Callable[[], float]) -> None:
        self._ledger = current_ledger
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        audit = self._ledger().audit(self._clock())
        yield _gauge_by('proxy_retained_caches', 'Prefill caches retained for a request, by state', 'state',
                        audit['open_by_state'], [state.value for state in ledger.RecordState])
        yield _gauge('proxy_retained_cache_oldest_age_seconds', 'Age of the oldest retained Prefill cache',
                     audit['oldest_age_s'])
        yield _counter_by('proxy_releases', 'Retained Prefill caches released, by cause', 'cause',
                          audit['releases'], [cause.value for cause in ledger.ReleaseCause])
        yield _counter_by('proxy_release_failures', 'Frees of retained Prefill caches that did not get through '
                          '(gc retries them), by cause', 'cause', audit['release_failures'],
                          [ledger.ReleaseCause.COMPENSATED.value, ledger.ReleaseCause.GC.value])
        yield _counter_by('proxy_owner_rejections', 'Prefill answers whose cache owner could not be used, by reason',
                          'reason', audit['owner_rejections'], ['PrefillAnswerError', 'DuplicateOwnerError'])


class NodeCollector(Collector):
    """A node's book of preserved caches (kept in its engine process) and its refused migration requests.

    ``snapshot`` returns the latest engine audit merged with the api_server's counts, refreshed before each
    scrape; ``engine_book_up`` is 0 when the engine did not answer that refresh (the figures are then stale).
    """

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        audit = self._snapshot()
        yield _gauge('engine_book_up', 'Whether the engine answered the latest read of its book of preserved caches',
                     1.0 if audit.get('up') else 0.0)
        claimed = audit.get('claimed', 0)
        yield _gauge_by('preserved_caches', 'Prefill caches preserved for a Decode node, by state', 'state',
                        {'claimed': claimed, 'unclaimed': audit.get('preserved', 0) - claimed}, [])
        yield _gauge('preserved_cache_oldest_age_seconds', 'Age of the oldest preserved Prefill cache',
                     audit.get('oldest_age_s', 0.0))
        yield _counter_by('preserved_cache_releases', 'Preserved caches released, by cause (reclaimed: by the '
                          'orphan TTL)', 'cause', audit.get('releases', {}),
                          [cause.value for cause in preserved.ReleaseCause])
        yield _counter_by('frees_not_released', 'Frees that released nothing, by reason', 'reason',
                          audit.get('frees_not_released', {}), ['not_preserved', 'already_reclaimed', 'unknown'])
        yield _counter_by('claims', "Decode nodes' claims of preserved caches, by verdict", 'verdict',
                          audit.get('claims', {}), [preserved.Verdict.CLAIMED.value, preserved.Verdict.NOT_FOUND.value,
                                                    preserved.Verdict.RECLAIMED.value, preserved.Verdict.REFUSED.value])
        yield _counter_by('refused_migration_requests', 'Migration requests this Decode node refused, by reason',
                          'reason', audit.get('refused_migration_requests', {}), REFUSAL_REASONS)
        yield _counter_by('migration_failures', 'Migrations that failed on this Decode node, by reason', 'reason',
                          audit.get('migration_failures', {}), MIGRATION_FAILURE_REASONS)
        yield _counter('migrations_aborted', 'Decode requests whose client left before or during their migration',
                       audit.get('migrations_aborted', 0))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f'{PREFIX}_{name}', documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f'{PREFIX}_{name}', documentation, value=value)


def _gauge_by(name: str, documentation: str, label: str, values: Mapping[str, float],
              known: Iterable[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f'{PREFIX}_{name}', documentation, labels=[label])
    _add_samples(family, values, known)
    return family


def _counter_by(name: str, documentation: str, label: str, values: Mapping[str, float],
                known: Iterable[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(f'{PREFIX}_{name}', documentation, labels=[label])
    _add_samples(family, values, known)
    return family


def _add_samples(family: GaugeMetricFamily | CounterMetricFamily, values: Mapping[str, float],
                 known: Iterable[str]) -> None:
    """One sample per label value seen, and a zero for each ``known`` one not seen yet (so every series exists
    from the first scrape: rates and dashboards need no special case for "never happened")."""
    for value in sorted({*known, *values}):
        family.add_metric([value], values.get(value, 0))

"""Soak a GPU-free 1P+1D cluster with injected faults; every Prefill must end with nothing retained.

Mixed completions / chat / streamed chat and completions, ``--concurrency`` at a time. A share of the requests is
faulty: the client faults of :mod:`lmdeploy_pdfix_sim.chaos` (clients that leave right after sending, after the
first chunk or mid-stream, give up, or send what the Prefill rejects). ``--engine-fault-rate`` adds engine-side
faults (issue 5): a KV transfer that fails, a preserved Prefill request dropped while the engine is busy (D4), a
hand-made ``migration_request`` (D5), a Prefill cache nobody takes (reclaimed after the orphan TTL) and a free of
an unknown owner (D15). On top, the Decode node is killed and restarted ``--decode-restarts`` times while traffic
runs. At the end the Prefill's preserved sessions and free KV blocks are compared with their baseline and the
proxy's books (``/distserve/pdfix/audit``) must be closed; node state is sampled throughout into a CSV and a PNG
plot. ``--stock`` runs LMDeploy as released, for contrast.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lmdeploy_pdfix_sim import chaos, client, faults
from lmdeploy_pdfix_sim.chaos import CLIENT_FAULTS, Outcome
from lmdeploy_pdfix_sim.cluster import MODEL_NAME, Cluster, ClusterConfig, http_json
from lmdeploy_pdfix_sim.soak import Sampler, discover_nodes, percentile, write_samples

ENGINE_FAULTS = ('transfer_fails', 'cancelled_prefill', 'bad_migration', 'orphan', 'unknown_free')
ORPHAN_TTL_S = 5.0  # short, so the soak's orphans are reclaimed before it ends
RSS_AT = (0.0, 0.3, 1.0)  # the points of the run, as shares of its samples, whose RSS the summary reports


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--requests', type=int, default=10_000)
    parser.add_argument('--concurrency', type=int, default=4)
    parser.add_argument('--fault-rate', type=float, default=0.04, help='share of requests made faulty by the client')
    parser.add_argument('--engine-fault-rate', type=float, default=0.0, help='share given an engine-side fault')
    parser.add_argument('--decode-restarts', type=int, default=2)
    parser.add_argument('--orphan-ttl-s', type=float, default=ORPHAN_TTL_S,
                        help='the Prefill\'s orphan TTL (also how long a Decode remembers a used cache ticket); '
                             'the soak waits 1.5 times it for the last orphans when it plans any')
    parser.add_argument('--stock', action='store_true')
    parser.add_argument('--seed', type=int, default=4967)
    parser.add_argument('--out', type=Path, default=Path('artifacts/soak-faults'))
    return parser


def plan(requests: int, fault_rate: float, engine_fault_rate: float, seed: int) -> list[str | None]:
    """The fault (or None) of each request, reproducibly."""
    rng = random.Random(seed)

    def one() -> str | None:
        draw = rng.random()
        if draw < fault_rate:
            return rng.choice(CLIENT_FAULTS)
        return rng.choice(ENGINE_FAULTS) if draw < fault_rate + engine_fault_rate else None

    return [one() for _ in range(requests)]


def send(cluster: Cluster, index: int, fault: str | None) -> Outcome:
    """What became of request ``index``."""
    if fault in ENGINE_FAULTS:
        return Outcome(fault, _engine_fault(cluster, index, fault), False, 0.0)
    return chaos.send(cluster.proxy_url, index, fault)


def _engine_fault(cluster: Cluster, index: int, fault: str) -> int:
    """Inject ``fault``; the HTTP status of the request that carried it (0: none expected)."""
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    if fault == 'transfer_fails':  # the next migration, whichever request it serves, fails
        cluster.arm_fault(decode, faults.MIGRATE_ERROR)
        return client.request(cluster.proxy_url, 'completions', client.prompt_for(index)).status
    if fault == 'cancelled_prefill':  # queued behind a busy engine, then the caller leaves (D4)
        cluster.arm_fault(prefill, faults.SLOW_PREFILL, '0.3')
        client.drop_preserved_stream(prefill, index, wait=lambda: time.sleep(0.1))
        return 0
    if fault == 'orphan':  # a proxy that died after the Prefill answered
        return _status('POST', f'{prefill}/v1/completions', client.preserved_prefill_body(index))
    owner = 2**40 + index  # no node ever issued it
    if fault == 'bad_migration':
        migration = {'protocol': 1, 'remote_engine_id': prefill, 'remote_session_id': owner,
                     'remote_token_id': 1, 'remote_block_ids': [0, 1]}
        body = {'model': MODEL_NAME, 'prompt': client.prompt_for(index), 'max_tokens': 4,
                'migration_request': migration}
        return _status('POST', f'{decode}/v1/completions', body)
    return _status('POST', f'{prefill}/distserve/free_cache', {'remote_engine_id': decode, 'remote_session_id': owner})


def _status(method: str, url: str, body: dict[str, Any]) -> int:
    try:
        http_json(method, url, body, timeout=30)
    except OSError as exc:  # urllib's HTTPError is an OSError with the status
        return getattr(exc, 'code', 0)
    return 200


def run(args: argparse.Namespace) -> dict[str, Any]:
    mode = 'stock' if args.stock else 'patched'
    config = ClusterConfig(stock=args.stock, log_dir=args.out / mode / 'logs', model_dir=args.out / 'model',
                           env={'LMDEPLOY_PDFIX_ORPHAN_TTL_S': str(args.orphan_ttl_s)})
    with Cluster(config) as cluster:
        prefill = cluster.prefill_urls[0]
        baseline = cluster.settled_state(prefill)
        sampler = Sampler(discover_nodes(cluster.proxy_url), 1.0, {'Proxy': cluster.processes[0].pid})
        restarts = chaos.DecodeRestarts(lambda: cluster.bounce(cluster.decode_urls[0]), args.decode_restarts,
                                        args.requests, args.seed)
        planned = plan(args.requests, args.fault_rate, args.engine_fault_rate, args.seed)
        sampler.start()
        outcomes, elapsed = chaos.run_load(lambda index: send(cluster, index, planned[index]), args.requests,
                                           args.concurrency, restarts)
        if 'orphan' in planned:
            time.sleep(args.orphan_ttl_s * 1.5)  # the last orphans are reclaimed
        settled = cluster.settled_state(prefill, timeout_s=60)
        node_books = {url: _audit(url) for url in (prefill, cluster.decode_urls[0])} if not args.stock else None
        sampler.stop()
        audit = _audit(cluster.proxy_url) if not args.stock else None
    csv_path, png_path = write_samples(sampler.rows, args.out / mode)
    summary = _summary(mode, outcomes, elapsed, restarts.downtime_s, baseline, settled, audit, csv_path, png_path)
    return {**summary, 'rss_mb': rss_over_the_run(sampler.rows), 'node_books': node_books}


def rss_over_the_run(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each process's RSS in MiB (a node's api_server and engine together) at the :data:`RSS_AT` points."""
    by_node: dict[str, list[float]] = {}
    for row in rows:
        rss = (row['api_server_rss_mb'] or 0) + (row['engine_rss_mb'] or 0)
        name = f"{row['role']} {row['node']}" if '://' in row['node'] else row['node']
        by_node.setdefault(name, []).append(round(rss, 1))
    return {node: [series[round(share * (len(series) - 1))] for share in RSS_AT] for node, series in by_node.items()}


def _audit(proxy: str) -> dict[str, Any] | None:
    try:
        return http_json('GET', f'{proxy}/distserve/pdfix/audit')
    except OSError:
        return None


def _summary(mode: str, outcomes: list[Outcome], elapsed: float, downtime_s: float,
             baseline: dict[str, Any], settled: dict[str, Any], audit: dict[str, Any] | None,
             csv_path: Path, png_path: Path | None) -> dict[str, Any]:
    latencies = [outcome.latency_s * 1000 for outcome in outcomes if outcome.exact]
    return {
        'mode': mode,
        'req_per_s': round(len(outcomes) / elapsed, 2),
        **chaos.summarize(outcomes),
        'engine_fault_statuses': dict(Counter(f'{outcome.category} {outcome.status}' for outcome in outcomes
                                              if outcome.category in ENGINE_FAULTS)),
        'decode_downtime_s': round(downtime_s, 1),
        'p50_ms': round(percentile(latencies, 50), 1),
        'p99_ms': round(percentile(latencies, 99), 1),
        'prefill_sessions_before_after': (baseline['sessions'], settled['sessions']),
        'prefill_free_blocks_before_after': (baseline['free_blocks'], settled['free_blocks']),
        'proxy_books': audit,
        'samples': str(csv_path),
        'plot': str(png_path),
    }


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    summary = run(args)
    print(json.dumps(summary, indent=2))
    sessions_before, sessions_after = summary['prefill_sessions_before_after']
    books_closed = (summary['proxy_books'] or {}).get('open') == 0
    clean = sessions_after == sessions_before and summary['wrong_text_200'] == 0 and books_closed
    return 0 if args.stock or clean else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

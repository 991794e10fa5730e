"""A lost node, stock vs patched (issue 30, D29): 2 Prefill + 2 Decode under steady load, one Decode killed and
started again, then one Prefill killed; the proxy's heartbeat is LMDeploy's (90 s), so only the requests that
meet a dead node can find it out.

Each mode runs on its own cluster, one after the other, with the same load and timeline. Reported per mode:
requests, failed (non-200 or no answer), wrong texts among the 200s, p50/p99 latency of the requests sent during
the outage (from the first kill to the end), and the recovery time: seconds from the first kill to the last
failed request (0 when none failed). ``--json`` prints only JSON on stdout. Exit status 1 when a patched answer
was wrong or failed.
Usage: python benchmarks/bench_failover.py [--clients N] [--seconds S] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix_sim.soak import percentile

KIND = 'completions'  # stock answers no DistServe chat (D1): completions compare the two fairly


def run_load(cluster: Cluster, clients: int, seconds: float) -> tuple[list[tuple[float, client.Result]], float]:
    """Closed-loop load for ``seconds`` while the timeline kills and restarts nodes; (sent at, result) pairs and
    the time of the first kill."""
    results: list[tuple[float, client.Result]] = []
    stop = threading.Event()
    began = time.monotonic()

    def one_client(number: int) -> None:
        index = 0
        while not stop.is_set():
            index += 1
            sent = time.monotonic() - began
            result = client.request(cluster.proxy_url, KIND, client.prompt_for(number * 100_000 + index), timeout_s=60)
            results.append((sent, result))

    decode, prefill = cluster.decode_urls[0], cluster.prefill_urls[0]
    with ThreadPoolExecutor(clients) as pool:
        for number in range(clients):
            pool.submit(one_client, number)
        time.sleep(seconds * 0.15)
        first_kill = time.monotonic() - began
        cluster.stop_node(decode)
        time.sleep(seconds * 0.15)
        cluster.restart_node(decode)
        time.sleep(seconds * 0.15)
        cluster.stop_node(prefill)
        time.sleep(max(0.0, seconds - (time.monotonic() - began)))
        stop.set()
    return results, first_kill


def summary(results: list[tuple[float, client.Result]], first_kill: float) -> dict[str, Any]:
    failed = [(sent, result) for sent, result in results if result.status != 200]
    during = [result.latency_s * 1000 for sent, result in results if sent >= first_kill and result.ok]
    return {
        'requests': len(results),
        'failed': len(failed),
        'wrong_200': sum(result.status == 200 and not result.ok for _, result in results),
        'outage_p50_ms': round(percentile(during, 50), 1) if during else None,
        'outage_p99_ms': round(percentile(during, 99), 1) if during else None,
        'recovery_s': round(max((sent - first_kill for sent, _ in failed), default=0.0), 1),
        'failures_by_status': {str(status): sum(r.status == status for _, r in failed)
                               for status in sorted({r.status for _, r in failed})},
    }


def measure(stock: bool, clients: int, seconds: float, root: Path) -> dict[str, Any]:
    name = 'stock' if stock else 'patched'
    config = ClusterConfig(prefill=2, decode=2, stock=stock, log_dir=root / name, model_dir=root / 'model')
    with Cluster(config) as cluster:
        results, first_kill = run_load(cluster, clients, seconds)
    return summary(results, first_kill)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--clients', type=int, default=16)
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--json', action='store_true', help='print only JSON on stdout')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = {mode: measure(mode == 'stock', args.clients, args.seconds, Path(tmp))
                  for mode in ('stock', 'patched')}
    if args.json:
        print(json.dumps(report))
    else:
        for mode, figures in report.items():
            print(f'{mode:8} ' + '  '.join(f'{key}={value}' for key, value in figures.items()))
    patched = report['patched']
    return 1 if patched['failed'] or patched['wrong_200'] else 0


if __name__ == '__main__':
    sys.exit(main())

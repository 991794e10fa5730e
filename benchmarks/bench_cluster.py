"""Stock vs patched throughput on a GPU-free 1 Prefill + 1 Decode DistServe cluster, in one run.

The same N sequential completions (the one workload stock answers) go through each cluster; reported:
requests/s, p50/p99 latency, start-up time, RSS of every process, Prefill sessions left, and patched/stock.
Usage: python benchmarks/bench_cluster.py [--requests N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from lmdeploy_pdfix.sim import client
from lmdeploy_pdfix.sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix.sim.state import rss_bytes
from lmdeploy_pdfix.soak import percentile

MODES = ('stock', 'patched')
METRICS = ('req_per_s', 'p50_ms', 'p99_ms', 'startup_s', 'rss_mb', 'prefill_sessions_left', 'ok')


def _total_rss_mb(cluster: Cluster) -> float:
    """Proxy + api_servers + engine processes."""
    total = rss_bytes(cluster.processes[0].pid) or 0
    for url in [*cluster.prefill_urls, *cluster.decode_urls]:
        state = cluster.node_state(url)
        total += (state.get('api_server_rss') or 0) + (state.get('engine_rss') or 0)
    return total / 2**20


def measure(mode: str, requests: int, log_dir: Path) -> dict[str, Any]:
    config = ClusterConfig(stock=mode == 'stock', log_dir=log_dir / mode, model_dir=log_dir / 'model')
    with Cluster(config) as cluster:
        prefill = cluster.prefill_urls[0]
        baseline = cluster.settled_state(prefill)['sessions']
        client.request(cluster.proxy_url, 'completions', 'warm up', timeout_s=60)
        began = time.monotonic()
        results = [client.request(cluster.proxy_url, 'completions', client.prompt_for(i), timeout_s=30)
                   for i in range(requests)]
        elapsed = time.monotonic() - began
        latencies = [r.latency_s * 1000 for r in results if r.ok]
        return {
            'req_per_s': requests / elapsed,
            'p50_ms': percentile(latencies, 50),
            'p99_ms': percentile(latencies, 99),
            'startup_s': cluster.startup_s,
            'rss_mb': _total_rss_mb(cluster),
            'prefill_sessions_left': cluster.settled_state(prefill)['sessions'] - baseline,
            'ok': sum(r.ok for r in results),
        }


def _ratio(patched: float, stock: float) -> str:
    return f'{patched / stock:.2f}' if stock else 'n/a'


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--requests', type=int, default=200)
    parser.add_argument('--log-dir', type=Path, default=Path('.sim/bench'))
    args = parser.parse_args(argv)
    figures = {mode: measure(mode, args.requests, args.log_dir) for mode in MODES}
    print(f'\n{args.requests} sequential completions through a 1P+1D cluster (max_tokens=8)')
    print(f'{"metric":<24}{"stock":>12}{"patched":>12}{"patched/stock":>15}')
    for metric in METRICS:
        stock, patched = figures['stock'][metric], figures['patched'][metric]
        print(f'{metric:<24}{stock:>12.1f}{patched:>12.1f}{_ratio(patched, stock):>15}')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

"""Stock vs patched DistServe on the GPU-free cluster, in one run.

1. Sequential: a stock and a patched 1 Prefill + 1 Decode cluster side by side; the same completions go
   through both, interleaved (which goes first alternates), so both see the same host load. Reported:
   p50/p90/p99 latency, requests/s and proxy CPU ms per request, each with patched/stock.
2. Concurrent, patched only (stock answers no concurrent DistServe load; see the defect index): throughput,
   p50/p99 at concurrency 1, 8 and 64, and proxy CPU ms per request, at each scale (1P+1D, 2P+2D, 4P+4D), with
   each scale's proxy CPU per request over 1P+1D's, so the proxy's cost can be read against the number of nodes.
   Every cluster gets the same warm-up first. The growth ratios come from a paced load, one request every
   1/PACED_RATE_PER_S s, at every scale: under a closed loop the proxy's CPU per request follows its cluster's
   throughput (the more requests each wake-up of its event loop serves, the less each costs; 4P+4D puts 17
   processes on this host's cores and answers slower), so at one rate it is the proxy's own work per request that
   is compared.

Every answer is checked against the emulated model's exact text; Prefill sessions left after each load are
counted. Exit status 1 when an answer was wrong or a session was left. ``--json`` prints only JSON on stdout.
Usage: python benchmarks/bench_cluster.py [--requests N] [--concurrent-requests N] [--scales 1p1d,2p2d,4p4d]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix_sim.soak import percentile

CONCURRENCIES = (1, 8, 64)
WARM_UP_REQUESTS = 200  # at concurrency 8, before a cluster's loads are measured: its first requests cost more
# a rate the largest scale sustains one request at a time (4P+4D answers about 35 per second here)
PACED_RATE_PER_S = 10
PACED_REQUESTS = 300
KIND = 'completions'
MAX_TOKENS = 8


def proxy_cpu_s(cluster: Cluster) -> float:
    """User + system CPU seconds the proxy process has used so far."""
    fields = Path(f'/proc/{cluster.processes[0].pid}/stat').read_text().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def prefill_sessions(cluster: Cluster) -> int:
    return sum(cluster.settled_state(url)['sessions'] for url in cluster.prefill_urls)


def summary(results: list[client.Result], elapsed_s: float, cpu_s: float) -> dict[str, Any]:
    latencies = [result.latency_s * 1000 for result in results if result.ok]
    return {
        'requests': len(results),
        'exact': sum(result.ok for result in results),
        'req_per_s': round(len(results) / elapsed_s, 1),
        'p50_ms': round(percentile(latencies, 50), 1),
        'p90_ms': round(percentile(latencies, 90), 1),
        'p99_ms': round(percentile(latencies, 99), 1),
        'proxy_cpu_ms_per_request': round(cpu_s * 1000 / len(results), 2),
    }


def _send(cluster: Cluster, index: int) -> client.Result:
    return client.request(cluster.proxy_url, KIND, client.prompt_for(index), MAX_TOKENS, timeout_s=60)


def sequential(clusters: dict[str, Cluster], requests: int) -> dict[str, dict[str, Any]]:
    """The same prompts through every cluster, one request at a time, alternating which cluster goes first."""
    results: dict[str, list[client.Result]] = {mode: [] for mode in clusters}
    elapsed = dict.fromkeys(clusters, 0.0)
    cpu_before = {mode: proxy_cpu_s(cluster) for mode, cluster in clusters.items()}
    for index in range(requests):
        order = list(clusters) if index % 2 == 0 else list(reversed(clusters))
        for mode in order:
            began = time.monotonic()
            results[mode].append(_send(clusters[mode], index))
            elapsed[mode] += time.monotonic() - began
    return {mode: summary(results[mode], elapsed[mode], proxy_cpu_s(cluster) - cpu_before[mode])
            for mode, cluster in clusters.items()}


def measured(cluster: Cluster, load: Callable[[], list[client.Result]]) -> dict[str, Any]:
    """The summary of ``load`` (it sends the requests) with its duration and the proxy CPU it cost."""
    cpu_before, began = proxy_cpu_s(cluster), time.monotonic()
    results = load()
    return summary(results, time.monotonic() - began, proxy_cpu_s(cluster) - cpu_before)


def concurrent(cluster: Cluster, requests: int, concurrency: int) -> dict[str, Any]:
    def load() -> list[client.Result]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda index: _send(cluster, index), range(requests)))

    return measured(cluster, load)


def paced(cluster: Cluster, requests: int, rate_per_s: float) -> dict[str, Any]:
    """One request at a time, each started 1/``rate_per_s`` s after the previous one started."""
    def load() -> list[client.Result]:
        results, began = [], time.monotonic()
        for index in range(requests):
            time.sleep(max(0.0, began + index / rate_per_s - time.monotonic()))
            results.append(_send(cluster, index))
        return results

    return measured(cluster, load)


def _started(mode: str, prefill: int, decode: int, log_dir: Path) -> Cluster:
    name = f'{mode}-{prefill}p{decode}d'
    config = ClusterConfig(prefill=prefill, decode=decode, stock=mode == 'stock', log_dir=log_dir / name,
                           model_dir=log_dir / 'model')
    _progress(f'starting the {mode} {prefill}P+{decode}D cluster')
    return Cluster(config).start()


def _warm_up(cluster: Cluster) -> int:
    """A few requests through every pair, then the Prefill sessions that remain (the baseline)."""
    for index in range(4 * len(cluster.prefill_urls) * len(cluster.decode_urls)):
        _send(cluster, -1 - index)
    return prefill_sessions(cluster)


def under_load(cluster: Cluster, requests: int) -> dict[str, Any]:
    """Concurrent loads on a patched cluster, and the Prefill sessions they left."""
    concurrent(cluster, WARM_UP_REQUESTS, 8)
    baseline = _warm_up(cluster)
    figures: dict[str, Any] = {}
    for concurrency in CONCURRENCIES:
        _progress(f'{requests} completions at concurrency {concurrency}')
        figures[f'c{concurrency}'] = concurrent(cluster, requests, concurrency)
    _progress(f'{PACED_REQUESTS} completions at {PACED_RATE_PER_S} per second')
    figures['paced'] = paced(cluster, PACED_REQUESTS, PACED_RATE_PER_S)
    figures['prefill_sessions_left'] = prefill_sessions(cluster) - baseline
    return figures


def _scale(text: str) -> tuple[int, int]:
    prefill, decode = text.lower().removesuffix('d').split('p')
    return int(prefill), int(decode)


def run(args: argparse.Namespace) -> dict[str, Any]:
    scales = [_scale(text) for text in args.scales.split(',') if text]
    figures: dict[str, Any] = {'max_tokens': MAX_TOKENS}
    stock, patched = (_started(mode, 1, 1, args.log_dir) for mode in ('stock', 'patched'))
    try:
        baselines = {'stock': _warm_up(stock), 'patched': _warm_up(patched)}
        _progress(f'{args.requests} sequential completions through each cluster, interleaved')
        figures['sequential'] = sequential({'stock': stock, 'patched': patched}, args.requests)
        for mode, cluster in (('stock', stock), ('patched', patched)):
            figures['sequential'][mode]['prefill_sessions_left'] = prefill_sessions(cluster) - baselines[mode]
        stock.stop()
        figures['concurrent'] = {}
        if (1, 1) in scales:
            figures['concurrent']['1p1d'] = under_load(patched, args.concurrent_requests)
    finally:
        stock.stop()
        patched.stop()
    for prefill, decode in scales:
        if (prefill, decode) == (1, 1):
            continue
        cluster = _started('patched', prefill, decode, args.log_dir)
        try:
            figures['concurrent'][f'{prefill}p{decode}d'] = under_load(cluster, args.concurrent_requests)
        finally:
            cluster.stop()
    return figures


def _ratio(patched: float, stock: float) -> str:
    return f'{patched / stock:.3f}' if stock else 'n/a'


def render(figures: dict[str, Any]) -> str:
    sequential_figures = figures['sequential']
    stock, patched = sequential_figures['stock'], sequential_figures['patched']
    lines = [f'{stock["requests"]} sequential completions (max_tokens={figures["max_tokens"]}), stock and patched '
             '1P+1D side by side, interleaved',
             f'{"metric":<28}{"stock":>10}{"patched":>10}{"patched/stock":>15}']
    for metric in ('p50_ms', 'p90_ms', 'p99_ms', 'req_per_s', 'proxy_cpu_ms_per_request', 'exact',
                   'prefill_sessions_left'):
        ratio = _ratio(patched[metric], stock[metric])
        lines.append(f'{metric:<28}{stock[metric]:>10}{patched[metric]:>10}{ratio:>15}')
    lines += ['', 'patched, concurrent completions',
              f'{"nodes":<8}{"conc.":>6}{"req/s":>8}{"p50 ms":>9}{"p99 ms":>9}{"proxy CPU ms/req":>18}'
              f'{"exact":>11}{"sessions left":>15}']
    for scale, loads in figures['concurrent'].items():
        for concurrency in CONCURRENCIES:
            load = loads[f'c{concurrency}']
            lines.append(f'{scale.upper():<8}{concurrency:>6}{load["req_per_s"]:>8}{load["p50_ms"]:>9}'
                         f'{load["p99_ms"]:>9}{load["proxy_cpu_ms_per_request"]:>18}'
                         f'{load["exact"]:>6}/{load["requests"]:<4}{loads["prefill_sessions_left"]:>15}')
    lines += ['', f'paced, {PACED_RATE_PER_S} completions per second one at a time: proxy CPU ms per request '
              '(over 1P1D\'s)']
    growth = figures['proxy_cpu_growth_over_1p1d']
    for scale, loads in figures['concurrent'].items():
        load = loads['paced']
        lines.append(f'{scale.upper():<8}{load["proxy_cpu_ms_per_request"]:>6} ({growth.get(scale, "1.000")}), '
                     f'p50 {load["p50_ms"]} ms, {load["exact"]}/{load["requests"]} exact')
    return '\n'.join(lines)


def cpu_growth(figures: dict[str, Any]) -> dict[str, str]:
    """Each scale's proxy CPU ms per request under the paced load over 1P+1D's (flat: about 1)."""
    loads = figures['concurrent']
    base = loads.get('1p1d')
    if base is None:
        return {}
    return {scale: _ratio(load['paced']['proxy_cpu_ms_per_request'], base['paced']['proxy_cpu_ms_per_request'])
            for scale, load in loads.items() if scale != '1p1d'}


def all_exact(figures: dict[str, Any]) -> bool:
    loads = [*figures['sequential'].values(),
             *(load for loads in figures['concurrent'].values() for load in loads.values() if isinstance(load, dict))]
    left = [figures['sequential']['patched']['prefill_sessions_left'],
            *(loads['prefill_sessions_left'] for loads in figures['concurrent'].values())]
    return all(load['exact'] == load['requests'] for load in loads) and not any(left)


def _progress(message: str) -> None:
    print(f'[bench] {message}', file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 2000 (about 2 minutes): with 600, the p50 and p90 ratios still moved by 2-4% from run to run
    parser.add_argument('--requests', type=int, default=2000, help='sequential completions per cluster')
    parser.add_argument('--concurrent-requests', type=int, default=640, help='completions per concurrent load')
    parser.add_argument('--scales', default='1p1d,2p2d,4p4d', help='patched cluster sizes for the concurrent loads')
    parser.add_argument('--log-dir', type=Path, default=Path('.sim/bench'))
    parser.add_argument('--json', action='store_true', help='print only the figures, as JSON, on stdout')
    args = parser.parse_args(argv)
    figures = run(args)
    figures['proxy_cpu_growth_over_1p1d'] = cpu_growth(figures)
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return 0 if all_exact(figures) else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

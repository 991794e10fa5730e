"""``lmdeploy-pdfix soak``: a bounded load loop against any DistServe proxy.

Sends N requests (C at a time, a mix of completions, chat and streaming chat), checks each answer's text
where the nodes run the emulated model, and reports success counts and latency percentiles. Nodes that
expose the sim state endpoint are sampled while it runs: Prefill/Decode sessions, free KV blocks and RSS go
to a CSV and a PNG plot.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmdeploy_pdfix.sim import client
from lmdeploy_pdfix.sim.cluster import STATE_ROUTE, http_json

SAMPLE_FIELDS = ('t_s', 'node', 'role', 'sessions', 'free_blocks', 'api_server_rss_mb', 'engine_rss_mb')


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='lmdeploy-pdfix soak', description=__doc__)
    parser.add_argument('--proxy', required=True, help='proxy URL, e.g. http://127.0.0.1:8000')
    parser.add_argument('--requests', type=int, required=True)
    parser.add_argument('--concurrency', type=int, default=1)
    parser.add_argument('--mix', default='completions', help=f'comma-separated subset of {",".join(client.KINDS)}')
    parser.add_argument('--max-tokens', type=int, default=8)
    parser.add_argument('--timeout', type=float, default=30.0, help='seconds per request')
    parser.add_argument('--sample-every', type=float, default=1.0, help='seconds between node state samples')
    parser.add_argument('--out', type=Path, default=Path('artifacts/soak'), help='directory for CSV and PNG')
    parser.add_argument('--no-text-check', action='store_true',
                        help='count any HTTP 200 as success (nodes not running the emulated model)')
    return parser


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def discover_nodes(proxy: str) -> dict[str, str]:
    """url → role of the nodes the proxy knows that answer the sim state endpoint."""
    try:
        status = http_json('GET', f'{proxy}/nodes/status', timeout=5) or {}
    except OSError:
        return {}
    nodes = {}
    for url in status:
        try:
            nodes[url] = http_json('GET', f'{url}{STATE_ROUTE}', timeout=5).get('role', '?')
        except OSError:
            continue  # not an emulated node: nothing to sample
    return nodes


class Sampler(threading.Thread):
    """Samples every node's state until stopped; rows go to ``self.rows``."""

    def __init__(self, nodes: dict[str, str], period_s: float) -> None:
        super().__init__(name='soak-sampler', daemon=True)
        self.nodes, self.period_s = nodes, period_s
        self.rows: list[dict[str, Any]] = []
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def sample_once(self) -> None:
        for url, role in self.nodes.items():
            try:
                state = http_json('GET', f'{url}{STATE_ROUTE}', timeout=5)
            except OSError:
                continue
            self.rows.append({
                't_s': round(time.monotonic() - self._t0, 2), 'node': url, 'role': role,
                'sessions': state.get('sessions'), 'free_blocks': state.get('free_blocks'),
                'api_server_rss_mb': _mb(state.get('api_server_rss')), 'engine_rss_mb': _mb(state.get('engine_rss')),
            })

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.sample_once()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample_once()  # the state the load left behind


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def run_load(args: argparse.Namespace, kinds: list[str]) -> tuple[list[client.Result], float]:
    def one(i: int) -> client.Result:
        return client.request(args.proxy, kinds[i % len(kinds)], client.prompt_for(i), args.max_tokens, args.timeout)

    began = time.monotonic()
    with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        results = list(pool.map(one, range(args.requests)))
    return results, time.monotonic() - began


def summarize(results: list[client.Result], elapsed_s: float, text_check: bool) -> dict[str, Any]:
    ok = [r for r in results if (r.ok if text_check else r.status == 200)]
    latencies = [r.latency_s * 1000 for r in ok]
    return {
        'requests': len(results),
        'succeeded': len(ok),
        'wrong_text_200': sum(r.status == 200 and r.text != r.expected for r in results) if text_check else None,
        'status_counts': dict(Counter(r.status for r in results)),
        'by_kind': {kind: f'{sum(r in ok for r in results if r.kind == kind)}/'
                          f'{sum(r.kind == kind for r in results)}' for kind in sorted({r.kind for r in results})},
        'req_per_s': round(len(results) / elapsed_s, 2) if elapsed_s else 0.0,
        'p50_ms': round(percentile(latencies, 50), 1),
        'p99_ms': round(percentile(latencies, 99), 1),
        'mean_ms': round(statistics.fmean(latencies), 1) if latencies else 0.0,
    }


def write_samples(rows: list[dict[str, Any]], out: Path) -> tuple[Path, Path | None]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / 'samples.csv'
    with csv_path.open('w', newline='') as fh:
        writer = csv.DictWriter(fh, fieldnames=SAMPLE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return csv_path, plot_samples(rows, out / 'samples.png') if rows else None


def plot_samples(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (ax_sessions, ax_rss) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for node in sorted({row['node'] for row in rows}):
        mine = [row for row in rows if row['node'] == node]
        label = f"{mine[0]['role']} {node.rsplit(':', 1)[-1]}"
        times = [row['t_s'] for row in mine]
        ax_sessions.plot(times, [row['sessions'] for row in mine], label=label)
        ax_rss.plot(times, [(row['api_server_rss_mb'] or 0) + (row['engine_rss_mb'] or 0) for row in mine], label=label)
    ax_sessions.set_ylabel('scheduler sessions')
    ax_rss.set_ylabel('RSS MB (api_server + engine)')
    ax_rss.set_xlabel('seconds')
    ax_sessions.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    kinds = [kind.strip() for kind in args.mix.split(',') if kind.strip()]
    unknown = set(kinds) - set(client.KINDS)
    if not kinds or unknown or args.requests <= 0:
        print(f'--mix must name some of {client.KINDS}, --requests must be positive', file=sys.stderr)
        return 2
    sampler = Sampler(discover_nodes(args.proxy), args.sample_every)
    sampler.start()
    try:
        results, elapsed = run_load(args, kinds)
    finally:
        sampler.stop()
    summary = summarize(results, elapsed, text_check=not args.no_text_check)
    for key, value in summary.items():
        print(f'{key:>15}: {value}')
    csv_path, png_path = write_samples(sampler.rows, args.out)
    print(f'{"samples":>15}: {csv_path} ({len(sampler.rows)} rows)' + (f', plot {png_path}' if png_path else ''))
    return 0 if summary['succeeded'] == summary['requests'] else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

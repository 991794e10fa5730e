"""``lmdeploy-pdfix-sim soak``: a bounded load loop against any DistServe proxy.

Sends N requests (C at a time, a mix of completions, chat and streaming chat), checks each answer's text
where the nodes run the emulated model, and reports success counts and latency percentiles. Nodes that
expose the sim state endpoint are sampled while it runs: Prefill/Decode sessions, free KV blocks and RSS go
to a CSV and a PNG plot.

``--chaos`` makes clients behave as they do under real load (:mod:`lmdeploy_pdfix_sim.chaos`): a share of
them leave right after sending, after the first chunk or mid-stream, give up, or send what the Prefill
rejects, at random; ``--decode-restarts`` kills and restarts the Decode node of the cluster ``sim up``
recorded at random points. It then checks what an operator needs: no answer with HTTP 200 and a wrong text,
no Prefill session left, every node healthy and registered, and 10 of 10 requests exact afterwards.

On a terminal a live line on stderr shows requests done, requests/s, errors and the Prefill sessions of the
latest sample; piped or redirected, the output is only the report.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmdeploy_pdfix.domain.protocol import AUDIT_PATH
from lmdeploy_pdfix_sim import chaos, client
from lmdeploy_pdfix_sim.cluster import STATE_ROUTE, Cluster, http_json
from lmdeploy_pdfix_sim.progress import live

SAMPLE_FIELDS = ('t_s', 'node', 'role', 'sessions', 'free_blocks', 'api_server_rss_mb', 'engine_rss_mb')


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='lmdeploy-pdfix-sim soak', description=__doc__)
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
    parser.add_argument('--chaos', action='store_true', help='misbehaving clients at random (see above)')
    parser.add_argument('--fault-rate', type=float, default=0.15, help='--chaos: share of misbehaving clients')
    parser.add_argument('--seed', type=int, default=9, help='--chaos: which clients misbehave, and when')
    parser.add_argument('--decode-restarts', type=int, default=0,
                        help='--chaos: Decode kills and restarts, at random points (a cluster `sim up` recorded)')
    parser.add_argument('--cluster-file', type=Path, default=Path('.sim/cluster.json'),
                        help='the record `sim up` wrote, for --decode-restarts')
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

    def __init__(self, nodes: dict[str, str], period_s: float, local_pids: dict[str, int] | None = None) -> None:
        """``local_pids``: name → pid of processes on this host without the state endpoint (a proxy), whose RSS
        is sampled from /proc."""
        super().__init__(name='soak-sampler', daemon=True)
        self.nodes, self.period_s, self.local_pids = nodes, period_s, local_pids or {}
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
        for name, pid in self.local_pids.items():
            self.rows.append({'t_s': round(time.monotonic() - self._t0, 2), 'node': name, 'role': name,
                              'sessions': None, 'free_blocks': None, 'api_server_rss_mb': _mb(_rss(pid)),
                              'engine_rss_mb': None})

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.sample_once()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample_once()  # the state the load left behind

    def prefill_sessions(self) -> int | None:
        """Sessions the Prefill nodes held at their latest samples, summed; None before any was sampled."""
        latest = {row['node']: row['sessions'] or 0 for row in list(self.rows) if row['role'] == 'Prefill'}
        return sum(latest.values()) if latest else None


def _rss(pid: int) -> int | None:
    try:
        status = Path(f'/proc/{pid}/status').read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith('VmRSS:')), None)


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


class LoadProgress:
    """Requests as they finish, for the live line: ``done/total, N req/s, E errors, P Prefill sessions``."""

    def __init__(self, total: int, prefill_sessions: Callable[[], int | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.prefill_sessions, self._clock = total, prefill_sessions, clock
        self.done = self.errors = 0
        self._began = clock()
        self._finished_at: float | None = None  # the rate stops falling once the load is over
        self._lock = threading.Lock()

    def count(self, failed: bool) -> None:
        with self._lock:
            self.done += 1
            self.errors += failed
            if self.done == self.total:
                self._finished_at = self._clock()

    def render(self) -> str:
        end = self._clock() if self._finished_at is None else self._finished_at
        elapsed_s = end - self._began
        rate = self.done / elapsed_s if elapsed_s > 0 else 0.0
        parts = [f'{self.done}/{self.total}', f'{rate:.1f} req/s', f'{self.errors} errors']
        sessions = self.prefill_sessions()
        if sessions is not None:  # no emulated Prefill node to sample: leave it out rather than show 0
            parts.append(f'{sessions} Prefill sessions')
        return ', '.join(parts)


def succeeded(result: client.Result, text_check: bool) -> bool:
    """Exactly the emulated model's text with HTTP 200, or any HTTP 200 where the text is not checked."""
    return result.ok if text_check else result.status == 200


def run_load(args: argparse.Namespace, kinds: list[str],
             progress: LoadProgress) -> tuple[list[client.Result], float]:
    def one(i: int) -> client.Result:
        result = client.request(args.proxy, kinds[i % len(kinds)], client.prompt_for(i), args.max_tokens,
                                args.timeout)
        progress.count(failed=not succeeded(result, not args.no_text_check))
        return result

    began = time.monotonic()
    with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        results = list(pool.map(one, range(args.requests)))
    return results, time.monotonic() - began


def summarize(results: list[client.Result], elapsed_s: float, text_check: bool) -> dict[str, Any]:
    ok = [r for r in results if succeeded(r, text_check)]
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


def plot_samples(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """A PNG of the samples; None where matplotlib is missing (``pip install lmdeploy-pdfix[plot]``)."""
    try:
        import matplotlib
    except ImportError:
        print('no plot: matplotlib is not installed (pip install "lmdeploy-pdfix[plot]")', file=sys.stderr)
        return None

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (ax_sessions, ax_rss) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for node in sorted({row['node'] for row in rows}):
        mine = [row for row in rows if row['node'] == node]
        label = f"{mine[0]['role']} node, port {node.rsplit(':', 1)[-1]}" if '://' in node else node
        times = [row['t_s'] for row in mine]
        if mine[0]['sessions'] is not None:  # a local process (a proxy) has RSS only
            ax_sessions.plot(times, [row['sessions'] for row in mine], label=label)
        ax_rss.plot(times, [(row['api_server_rss_mb'] or 0) + (row['engine_rss_mb'] or 0) for row in mine], label=label)
    fig.suptitle('soak: per-node state sampled from the sim state endpoint')
    ax_sessions.set_title('sessions held in the scheduler, per node')
    ax_sessions.set_ylabel('sessions')
    ax_rss.set_title('resident memory: api_server + engine processes')
    ax_rss.set_ylabel('RSS (MiB)')  # _mb divides by 2**20
    ax_rss.set_xlabel('seconds since sampling began')
    ax_sessions.legend()
    ax_rss.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


SETTLE_S = 30.0  # how long the Prefill may take to release the last caches after the load
AFTERWARDS = 10  # requests that must all be exact once the chaos is over


def run_chaos(args: argparse.Namespace, nodes: dict[str, str], restart_decode: Callable[[], None] | None,
              progress: LoadProgress | None = None) -> dict[str, Any]:
    """The chaos load, then the operator's checks; the summary's ``clean`` says whether all passed.

    ``nodes``: url → role; ``restart_decode`` kills and restarts the Decode node ``args.decode_restarts`` times;
    ``progress`` counts each request of the load (an error: a normal request without its exact answer).
    """
    baseline = {url: _sessions(url) for url, role in nodes.items() if role == 'Prefill'}
    restarts = None
    if restart_decode is not None and args.decode_restarts > 0:
        restarts = chaos.DecodeRestarts(restart_decode, args.decode_restarts, args.requests, args.seed)
    planned = chaos.plan(args.requests, args.fault_rate, args.seed)

    def send(index: int) -> chaos.Outcome:
        outcome = chaos.send(args.proxy, index, planned[index], args.max_tokens)
        if progress is not None:
            progress.count(failed=outcome.normal and not outcome.exact)
        return outcome

    outcomes, elapsed = chaos.run_load(send, args.requests, args.concurrency, restarts)
    summary = chaos.summarize(outcomes)
    left = _sessions_left(baseline)
    unhealthy = _unhealthy_nodes(args.proxy, nodes)
    afterwards = [chaos.send(args.proxy, args.requests + i, None, args.max_tokens) for i in range(AFTERWARDS)]
    exact_afterwards = sum(outcome.exact for outcome in afterwards)
    clean = (summary['wrong_text_200'] == 0 and not any(left.values()) and not unhealthy
             and exact_afterwards == AFTERWARDS)
    books = {} if clean else _books(args.proxy, [url for url, count in left.items() if count])
    return {**summary, 'req_per_s': round(len(outcomes) / elapsed, 2) if elapsed else 0.0,
            'decode_restarts': len(restarts.marks) if restarts else 0,
            'decode_downtime_s': round(restarts.downtime_s, 1) if restarts else 0.0,
            'prefill_sessions_left': left, 'unhealthy_nodes': unhealthy,
            'exact_afterwards': f'{exact_afterwards}/{AFTERWARDS}', 'clean': clean, **books}


def _recorded_decode_restart(cluster_file: Path) -> Callable[[], None]:
    """Kill and restart the Decode node of the cluster ``sim up`` recorded, and record the new process."""
    cluster = Cluster.from_json(json.loads(cluster_file.read_text()))

    def restart() -> None:
        cluster.bounce(cluster.decode_urls[0])
        cluster_file.write_text(json.dumps(cluster.to_json(), indent=1))  # so `sim down` stops the new one

    return restart


def _sessions(url: str) -> int:
    return http_json('GET', f'{url}{STATE_ROUTE}', timeout=5).get('sessions') or 0


def _sessions_left(baseline: dict[str, int]) -> dict[str, int]:
    """Prefill sessions above the baseline once the releases had ``SETTLE_S`` to land."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = {url: _sessions(url) - before for url, before in baseline.items()}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _books(proxy: str, prefills: list[str]) -> dict[str, Any]:
    """What the proxy's ledger and the leaking Prefill nodes' books say, to find where a release went missing."""
    books: dict[str, Any] = {}
    for name, url in [('proxy_ledger', proxy)] + [(f'prefill_book {url}', url) for url in prefills]:
        try:
            books[name] = http_json('GET', f'{url}{AUDIT_PATH}', timeout=10)
        except OSError as exc:
            books[name] = repr(exc)
    return books


def _unhealthy_nodes(proxy: str, nodes: dict[str, str]) -> list[str]:
    """Nodes that do not answer /health with 200, or that the proxy no longer lists."""
    registered = set(http_json('GET', f'{proxy}/nodes/status', timeout=5) or {})
    unhealthy = []
    for url in nodes:
        try:
            http_json('GET', f'{url}/health', timeout=10)
        except OSError:
            unhealthy.append(url)
            continue
        if url not in registered:
            unhealthy.append(url)
    return unhealthy


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.chaos:
        return _main_chaos(args)
    kinds = [kind.strip() for kind in args.mix.split(',') if kind.strip()]
    unknown = set(kinds) - set(client.KINDS)
    if not kinds or unknown or args.requests <= 0:
        print(f'--mix must name some of {client.KINDS}, --requests must be positive', file=sys.stderr)
        return 2
    sampler = Sampler(discover_nodes(args.proxy), args.sample_every)
    sampler.start()
    progress = LoadProgress(args.requests, sampler.prefill_sessions)
    with live(progress.render):  # closed after the last sample: the final line shows what the load left behind
        try:
            results, elapsed = run_load(args, kinds, progress)
        finally:
            sampler.stop()
    summary = summarize(results, elapsed, text_check=not args.no_text_check)
    for key, value in summary.items():
        print(f'{key:>15}: {value}')
    csv_path, png_path = write_samples(sampler.rows, args.out)
    print(f'{"samples":>15}: {csv_path} ({len(sampler.rows)} rows)' + (f', plot {png_path}' if png_path else ''))
    return 0 if summary['succeeded'] == summary['requests'] else 1


def _main_chaos(args: argparse.Namespace) -> int:
    if args.requests <= 0 or not 0 <= args.fault_rate <= 1:
        print('--requests must be positive and --fault-rate within 0..1', file=sys.stderr)
        return 2
    if args.decode_restarts > 0 and not args.cluster_file.exists():
        print(f'--decode-restarts needs a cluster recorded by `lmdeploy-pdfix-sim up` ({args.cluster_file})',
              file=sys.stderr)
        return 2
    restart = _recorded_decode_restart(args.cluster_file) if args.decode_restarts > 0 else None
    sampler = Sampler(discover_nodes(args.proxy), args.sample_every)
    sampler.start()
    progress = LoadProgress(args.requests, sampler.prefill_sessions)
    with live(progress.render):  # through the settling too: the Prefill sessions falling to 0 is the check
        try:
            summary = run_chaos(args, sampler.nodes, restart, progress)
        finally:
            sampler.stop()
    summary['samples'] = str(write_samples(sampler.rows, args.out)[0])
    print(json.dumps(summary, indent=2))
    return 0 if summary['clean'] else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

"""A lost node, stock vs patched (issue 30, D29), in two runs per mode, each on its own cluster:

- ``2p2d``: 2 Prefill + 2 Decode under a closed-loop mix (one request in ten a long prompt that is prefilled in
  chunks, two in ten streamed, one in ten a client that leaves before its answer) until ``--requests`` were
  sent; one Decode is killed when a quarter of them was sent and started again at 40%, then one Prefill is killed
  at 60% (of the requests, or of ``--seconds`` where a cluster stops answering first).
- ``1p1d``: 1 Prefill + 1 Decode under a quarter of the clients; the only Decode is killed at 20% of a quarter
  of the requests and started again at once.

The proxy's heartbeat is LMDeploy's (90 s): only the requests that meet a dead node can find it out. Reported per
run: requests answered, clients that left, failed (non-200, no answer, or a stream cut before its first event),
streams cut after their first event (allowed: a stream is never replayed), wrong texts among the 200s, p50/p99
latency of the requests sent from the first kill on, recovery (seconds from the first kill to the last failed
request; 0 when none failed) and the sessions the live Prefill nodes hold once settled. ``--json`` prints only
JSON on stdout. Exit status 1 when a patched answer was wrong, failed, or a session was left.
Usage: python benchmarks/bench_failover.py [--clients N] [--requests N] [--seconds S] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix_sim.soak import percentile

LONG_PROMPT_CHARS = 2400  # several chunks of MAX_PREFILL_TOKEN_NUM
MAX_PREFILL_TOKEN_NUM = 256
TIMEOUT_S = 120.0


@dataclass
class Sent:
    at: float  # seconds from the start of the run
    kind: str
    result: client.Result | None  # None: the client left before its answer

    @property
    def stream_cut(self) -> bool:
        """A stream that failed after its first event (a 200 whose events end in an error)."""
        return self.result is not None and self.result.status == 200 and self.result.error.startswith('stream error')


def send(proxy_url: str, index: int, at: float) -> Sent:
    """Request ``index`` of the mix, sent ``at``: long prompts, streams, and clients that leave (stock answers no
    DistServe chat, D1: completions compare the two fairly)."""
    kind = 'stream_completions' if index % 10 in (3, 7) else 'completions'
    prompt = client.prompt_for(index, LONG_PROMPT_CHARS if index % 10 == 1 else 0)
    if index % 10 == 5:
        client.send_then_leave(proxy_url, kind, prompt, max_tokens=8)
        return Sent(at, kind, None)
    return Sent(at, kind, client.request(proxy_url, kind, prompt, timeout_s=TIMEOUT_S))


def run_load(cluster: Cluster, clients: int, requests: int, seconds: float,
             timeline: list[tuple[float, Callable[[], object]]]) -> tuple[list[Sent], float]:
    """``requests`` sent by ``clients`` closed-loop clients, or as many as ``seconds`` allow (a cluster that stops
    answering); each step of ``timeline`` runs once that share of the requests was answered, or of the seconds
    passed. Returns what was sent, and when the first step ran."""
    results: list[Sent] = []
    numbers = itertools.count()
    began = time.monotonic()

    def elapsed() -> float:
        return time.monotonic() - began

    def one_client() -> None:
        while (index := next(numbers)) < requests and elapsed() < seconds:
            results.append(send(cluster.proxy_url, index, elapsed()))

    first_step = None
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(one_client)
        for share, step in timeline:
            while len(results) < share * requests and elapsed() < share * seconds:
                time.sleep(0.05)
            first_step = elapsed() if first_step is None else first_step
            step()
    return results, first_step or 0.0


def summary(sent: list[Sent], first_kill: float, sessions_left: int) -> dict[str, Any]:
    answered = [one for one in sent if one.result is not None]
    failed = [one for one in answered if one.result.status != 200 or (one.result.error and not one.stream_cut)]
    during = [one.result.latency_s * 1000 for one in answered if one.at >= first_kill and one.result.ok]
    return {
        'requests': len(answered),
        'left': len(sent) - len(answered),
        'failed': len(failed),
        'streams_cut': sum(one.stream_cut for one in answered),
        'wrong_200': sum(one.result.status == 200 and not one.result.error and not one.result.ok for one in answered),
        'outage_p50_ms': round(percentile(during, 50), 1) if during else None,
        'outage_p99_ms': round(percentile(during, 99), 1) if during else None,
        'recovery_s': round(max((one.at - first_kill for one in failed), default=0.0), 1),
        'failures_by_status': {str(status): sum(one.result.status == status for one in failed)
                               for status in sorted({one.result.status for one in failed})},
        'prefill_sessions_left': sessions_left,
    }


def two_by_two(cluster: Cluster, clients: int, requests: int, seconds: float) -> dict[str, Any]:
    decode, prefill = cluster.decode_urls[0], cluster.prefill_urls[0]
    timeline = [(0.25, lambda: cluster.stop_node(decode)), (0.40, lambda: cluster.restart_node(decode)),
                (0.60, lambda: cluster.stop_node(prefill))]
    sent, first_kill = run_load(cluster, clients, requests, seconds, timeline)
    return summary(sent, first_kill, cluster.settled_state(cluster.prefill_urls[1], timeout_s=60)['sessions'])


def only_decode_restarted(cluster: Cluster, clients: int, requests: int, seconds: float) -> dict[str, Any]:
    decode = cluster.decode_urls[0]
    sent, first_kill = run_load(cluster, clients, requests, seconds,
                                [(0.2, lambda: cluster.bounce(decode, down_s=0.0))])
    return summary(sent, first_kill, cluster.settled_state(cluster.prefill_urls[0], timeout_s=60)['sessions'])


def measure(stock: bool, clients: int, requests: int, seconds: float, root: Path) -> dict[str, Any]:
    name = 'stock' if stock else 'patched'
    common = {'stock': stock, 'model_dir': root / 'model', 'max_prefill_token_num': MAX_PREFILL_TOKEN_NUM}
    with Cluster(ClusterConfig(prefill=2, decode=2, log_dir=root / f'{name}-2p2d', **common)) as cluster:
        report = {'2p2d': two_by_two(cluster, clients, requests, seconds)}
    with Cluster(ClusterConfig(log_dir=root / f'{name}-1p1d', **common)) as cluster:
        report['1p1d'] = only_decode_restarted(cluster, max(1, clients // 4), max(1, requests // 4), seconds / 4)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--clients', type=int, default=32)
    parser.add_argument('--requests', type=int, default=4000)
    parser.add_argument('--seconds', type=float, default=240.0, help='the most a 2P+2D run may take (a quarter for '
                        '1P+1D): a cluster that stops answering is measured for this long')
    parser.add_argument('--json', action='store_true', help='print only JSON on stdout')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = {mode: measure(mode == 'stock', args.clients, args.requests, args.seconds, Path(tmp))
                  for mode in ('stock', 'patched')}
    if args.json:
        print(json.dumps(report))
    else:
        for mode, runs in report.items():
            for run, figures in runs.items():
                print(f'{mode:8} {run:5} ' + '  '.join(f'{key}={value}' for key, value in figures.items()))
    bad = [figures for figures in report['patched'].values()
           if figures['failed'] or figures['wrong_200'] or figures['prefill_sessions_left']]
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())

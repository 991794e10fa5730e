"""A warmup storm against the proxy, stock vs patched (#4972, issue 12): memory and what the callers get.

For each mode a GPU-free cluster of ``--prefill`` Prefill and ``--decode`` Decode nodes starts without its
warmup, so no Prefill/Decode link is up; then ``--warmups`` ``POST /distserve/connection_warmup`` calls go out
at once (and again, ``--rounds`` times). The proxy's resident memory is sampled throughout (peak, and after
the storm settled), with the answers by status and the time the storm took; then one completion per pair
checks that the cluster serves. Prints JSON on stdout; exit status 1 when the patched proxy answered a 5xx
other than 503 or a completion went wrong.
Usage: python benchmarks/bench_warmup_storm.py [--prefill 2] [--decode 4] [--warmups 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig

SAMPLE_S = 0.05


def rss_mb(pid: int) -> float:
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """The proxy's resident memory, sampled in the background while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mb = pid, rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def storm(proxy_url: str, warmups: int) -> Counter[str]:
    connector = aiohttp.TCPConnector(limit=warmups)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def warmup() -> str:
            try:
                async with session.post(f'{proxy_url}/distserve/connection_warmup', json={}) as response:
                    await response.read()
                    return str(response.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return type(exc).__name__

        return Counter(await asyncio.gather(*(warmup() for _ in range(warmups))))


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    config = ClusterConfig(prefill=args.prefill, decode=args.decode, stock=mode == 'stock', warmup=False,
                           log_dir=root / mode, model_dir=root / 'model')
    with Cluster(config) as cluster:
        proxy_pid = cluster.processes[0].pid
        before_mb = rss_mb(proxy_pid)
        answers: Counter[str] = Counter()
        began = time.monotonic()
        with Sampler(proxy_pid) as sampler:
            for _ in range(args.rounds):
                answers += asyncio.run(storm(cluster.proxy_url, args.warmups))
        storm_s = time.monotonic() - began
        time.sleep(2)
        after_mb = rss_mb(proxy_pid)
        pairs = args.prefill * args.decode
        served = [client.request(cluster.proxy_url, 'completions', client.prompt_for(index), timeout_s=60)
                  for index in range(pairs)]
    return {'warmups': args.warmups * args.rounds, 'answers': dict(answers), 'storm_s': round(storm_s, 1),
            'proxy_rss_mb': {'before': round(before_mb, 1), 'peak': round(sampler.peak_mb, 1),
                             'after': round(after_mb, 1)},
            'completions_exact': f'{sum(result.ok for result in served)}/{len(served)}'}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--prefill', type=int, default=2)
    parser.add_argument('--decode', type=int, default=4)
    parser.add_argument('--warmups', type=int, default=1000)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--modes', default='stock,patched')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix='bench-warmups-') as tmp:
        report = {mode: run_mode(mode, args, Path(tmp)) for mode in args.modes.split(',')}
    print(json.dumps(report))
    patched = report.get('patched')
    if patched is None:
        return 0
    bad = [status for status in patched['answers'] if status.startswith('5') and status != '503']
    exact, total = patched['completions_exact'].split('/')
    return 1 if bad or exact != total else 0


if __name__ == '__main__':
    sys.exit(main())

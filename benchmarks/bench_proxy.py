"""The proxy alone (issue 31): its CPU per request, stock vs patched, for completions, chat and streams.

Stand-in Prefill and Decode nodes (``tests/stand_in_nodes.py``: LMDeploy's DistServe wire format, answered at
once but for a 10-ms "KV copy") run in a process of their own; LMDeploy's proxy, with and without
``LMDEPLOY_PDFIX=1``, runs pinned to core 0; the nodes and this load generator to the other cores. Per mode and
kind: ``--requests`` sequential requests (p50/p90 latency, proxy CPU per request), then as many at concurrency
``--concurrency`` (requests per second, proxy CPU per request). ``one_core_req_per_s`` is the rate the proxy's CPU
per request allows one core (1 / CPU seconds per request): the proxy's own ceiling, where a 2-core host's load
generator saturates before the proxy does. Stock answers no DistServe chat (D1): its chat row counts the 500s.
``--json`` prints only JSON on stdout.
Usage: python benchmarks/bench_proxy.py [--requests N] [--concurrency N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmdeploy_pdfix_sim.cluster import Process as ClusterProcess  # noqa: E402
from lmdeploy_pdfix_sim.cluster import free_port, http_json, stop_processes, wait_http_ok  # noqa: E402
from lmdeploy_pdfix_sim.soak import percentile  # noqa: E402
from tests.servers import serving  # noqa: E402
from tests.stand_in_nodes import MODEL, DecodeBook, PrefillBook, decode_app, prefill_app  # noqa: E402

PROXY_CORE = 0
KINDS = {
    'completions': ('/v1/completions', {'prompt': 'hello', 'stream': False}),
    'chat': ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hello'}], 'stream': False}),
    'stream': ('/v1/completions', {'prompt': 'hello', 'stream': True}),
}
ROLES = {'Prefill': 2, 'Decode': 3}  # LMDeploy's EngineRole values


def serve_nodes(port_file: Path) -> None:
    """This process's part with ``--serve-nodes``: a stand-in Prefill and Decode until killed."""
    prefill = PrefillBook()
    with serving(prefill_app(prefill)) as p_url, serving(decode_app(DecodeBook(), prefill)) as d_url:
        port_file.write_text(json.dumps({'Prefill': p_url, 'Decode': d_url}))
        while True:
            time.sleep(3600)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> ClusterProcess:
    with open(log, 'wb') as out:
        popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
    return ClusterProcess(log.stem, 'bench', '', popen.pid, str(log))


@contextlib.contextmanager
def nodes(root: Path) -> Iterator[dict[str, str]]:
    port_file = root / 'nodes.json'
    others = sorted(os.sched_getaffinity(0) - {PROXY_CORE}) or [PROXY_CORE]
    env = {**os.environ, 'NO_PROXY': '127.0.0.1'}
    env.pop('LMDEPLOY_PDFIX', None)
    proc = _spawn(['taskset', '-c', ','.join(map(str, others)), sys.executable, __file__, '--serve-nodes',
                   str(port_file)], root / 'nodes.log', env)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError('the stand-in nodes did not start')
            time.sleep(0.1)
        yield json.loads(port_file.read_text())
    finally:
        stop_processes([proc])


@contextlib.contextmanager
def proxy(mode: str, urls: dict[str, str], root: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    env = {**os.environ, 'NO_PROXY': '127.0.0.1', 'no_proxy': '127.0.0.1'}
    env.pop('LMDEPLOY_PDFIX', None)
    if mode == 'patched':
        env['LMDEPLOY_PDFIX'] = '1'
    proc = _spawn(['taskset', '-c', str(PROXY_CORE), sys.executable, '-m', 'lmdeploy', 'serve', 'proxy',
                   '--server-name', '127.0.0.1', '--server-port', str(port), '--serving-strategy', 'DistServe',
                   '--disable-cache-status', '--log-level', 'ERROR'], root / f'proxy-{mode}.log', env)
    try:
        url = f'http://127.0.0.1:{port}'
        wait_http_ok(f'{url}/nodes/status', time.monotonic() + 60, proc.pid)
        for role, node_url in urls.items():
            http_json('POST', f'{url}/nodes/add', {'url': node_url, 'status': {'role': ROLES[role],
                                                                               'models': [MODEL]}})
        yield url, proc.pid
    finally:
        stop_processes([proc])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far."""
    fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def answered_text(raw: bytes, stream: bool) -> str:
    """The text of an answer, streamed (its events' text joined) or not; '' for an error."""
    try:
        if not stream:
            choice = json.loads(raw)['choices'][0]
            return choice.get('text') or choice['message']['content']
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith('data: ') and line != 'data: [DONE]']
        return ' '.join(event['choices'][0]['text'] for event in events)  # the stand-in streams a word an event
    except (ValueError, KeyError, IndexError, TypeError):
        return ''


SESSION_IDS = itertools.count(1)


async def one(session: aiohttp.ClientSession, url: str, kind: str) -> tuple[bool, float]:
    path, body = KINDS[kind]
    if path == '/v1/completions':  # stock shelves every completion under its session_id: -1 for all collides
        body = {**body, 'session_id': next(SESSION_IDS)}
    began = time.perf_counter()
    try:
        async with session.post(url + path, json={'model': MODEL, 'max_tokens': 8, **body}) as response:
            raw = await response.read()
    except aiohttp.ClientError:  # stock's DistServe chat resets the connection (D1)
        return False, time.perf_counter() - began
    words = answered_text(raw, body['stream']).split()
    ok = response.status == 200 and words[:4] == ['decoded', 'from', 'Prefill', 'session']
    return ok, time.perf_counter() - began


async def load(url: str, pid: int, kind: str, requests: int, concurrency: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for _ in range(20):  # the proxy's first requests pay for its link set-up and imports
            await one(session, url, kind)
        numbers = iter(range(requests))
        results: list[tuple[bool, float]] = []

        async def client() -> None:
            for _ in numbers:
                results.append(await one(session, url, kind))

        cpu_before, began = cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - began, cpu_s(pid) - cpu_before
    latencies = [seconds * 1000 for ok, seconds in results if ok]
    return {
        'requests': requests, 'ok': sum(ok for ok, _ in results), 'req_per_s': round(requests / elapsed, 1),
        'p50_ms': round(percentile(latencies, 50), 2) if latencies else None,
        'p90_ms': round(percentile(latencies, 90), 2) if latencies else None,
        'proxy_cpu_ms_per_request': round(cpu * 1000 / requests, 3),
        'one_core_req_per_s': round(requests / cpu) if cpu else None,
    }


def measure(requests: int, concurrency: int) -> dict[str, Any]:
    os.sched_setaffinity(0, os.sched_getaffinity(0) - {PROXY_CORE} or {PROXY_CORE})
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, nodes(Path(tmp)) as urls:
        for mode in ('stock', 'patched'):
            with proxy(mode, urls, Path(tmp)) as (url, pid):
                report[mode] = {kind: {'sequential': asyncio.run(load(url, pid, kind, requests, 1)),
                                       f'concurrency_{concurrency}': asyncio.run(load(url, pid, kind, requests,
                                                                                      concurrency))}
                                for kind in KINDS}
    return report


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    """Patched over stock, per kind and load: CPU per request and latency (below 1: patched spends less)."""
    out: dict[str, Any] = {}
    for kind, loads in report['patched'].items():
        for name, patched in loads.items():
            stock = report['stock'][kind][name]
            out[f'{kind}/{name}'] = {key: round(patched[key] / stock[key], 3) if patched[key] and stock[key] else None
                                     for key in ('proxy_cpu_ms_per_request', 'p50_ms', 'p90_ms')}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--requests', type=int, default=1000)
    parser.add_argument('--concurrency', type=int, default=64)
    parser.add_argument('--serve-nodes', type=Path, help=argparse.SUPPRESS)
    parser.add_argument('--json', action='store_true', help='print only JSON on stdout')
    args = parser.parse_args()
    if args.serve_nodes:
        serve_nodes(args.serve_nodes)
        return 0
    report = measure(args.requests, args.concurrency)
    report['patched_over_stock'] = ratios(report)
    if args.json:
        print(json.dumps(report))
        return 0
    for mode in ('stock', 'patched'):
        for kind, loads in report[mode].items():
            for name, figures in loads.items():
                print(f'{mode:8} {kind:12} {name:15} ' + '  '.join(f'{k}={v}' for k, v in figures.items()))
    for row, figures in report['patched_over_stock'].items():
        print(f'patched/stock {row:28} ' + '  '.join(f'{k}={v}' for k, v in figures.items()))
    return 0


if __name__ == '__main__':
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

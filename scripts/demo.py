"""Stock vs patched LMDeploy DistServe, side by side, on a GPU-free 1 Prefill + 1 Decode cluster.

Each cluster runs the real proxy and api_servers (model forward emulated, KV moved over Mooncake TCP).
Every request is bounded; the stock long prompt gets a short timeout because it never finishes (D3).
Usage: python scripts/demo.py [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmdeploy_pdfix_sim import client, faults
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig, prefill_forwards

MAX_PREFILL = 512
LONG_PROMPT = 1500
BURST = 16
MODES = ('stock', 'patched')


def _cell(result: client.Result) -> str:
    if result.status == 0:
        return 'no answer (timeout)'
    if result.status != 200:
        return f'HTTP {result.status}'
    return f'200, text {"ok" if result.text == result.expected else "WRONG"}'


def _scenarios(cluster: Cluster, mode: str) -> dict[str, str]:
    proxy, prefill = cluster.proxy_url, cluster.prefill_urls[0]
    rows = {'start-up': f'{cluster.startup_s:.1f} s'}
    baseline = cluster.settled_state(prefill)['sessions']
    for kind, label in (('chat', 'chat'), ('stream', 'chat, streaming'), ('completions', 'completions')):
        rows[label] = _cell(client.request(proxy, kind, client.prompt_for(len(rows)), timeout_s=30))
    with ThreadPoolExecutor(BURST) as pool:
        burst = list(pool.map(lambda i: client.request(proxy, client.KINDS[i % 3], client.prompt_for(100 + i),
                                                       timeout_s=60), range(BURST)))
    rows[f'burst of {BURST} (mixed)'] = f'{sum(r.ok for r in burst)}/{BURST} ok'
    rows['Prefill sessions left'] = f"{cluster.settled_state(prefill)['sessions'] - baseline}"
    cluster.arm_fault(cluster.decode_urls[0], faults.MIGRATE_ERROR)  # one KV transfer fails (D5)
    client.request(proxy, 'completions', client.prompt_for(200), timeout_s=30)
    after = [client.request(proxy, 'completions', client.prompt_for(201 + i), timeout_s=30) for i in range(3)]
    rows['one KV transfer fails, then 3 requests'] = f'{sum(r.ok for r in after)}/3 ok'
    # Last: on stock the Prefill keeps re-running the first chunk after this.
    before = prefill_forwards(cluster.settled_state(prefill))
    long = client.request(proxy, 'completions', client.prompt_for(7, length=LONG_PROMPT),
                          timeout_s=8 if mode == 'stock' else 60)
    # settled: the engine publishes its counters a few times a second, so a fresh read may miss a quick answer's
    forwards = prefill_forwards(cluster.settled_state(prefill)) - before
    rows[f'{LONG_PROMPT}-token prompt, chunks of {MAX_PREFILL}'] = f'{_cell(long)}, {forwards} Prefill forwards'
    return rows


def run_mode(mode: str, log_dir: Path) -> dict[str, str]:
    print(f'starting the {mode} cluster ...', flush=True)
    config = ClusterConfig(stock=mode == 'stock', max_prefill_token_num=MAX_PREFILL, log_dir=log_dir / mode,
                           model_dir=log_dir / 'model')
    with Cluster(config) as cluster:
        return _scenarios(cluster, mode)


def print_table(columns: dict[str, dict[str, str]]) -> None:
    labels = list(next(iter(columns.values())))
    width = max(map(len, labels)) + 2
    col = max(len(v) for rows in columns.values() for v in rows.values()) + 2
    print('\n' + ''.ljust(width) + ''.join(mode.ljust(col) for mode in columns))
    for label in labels:
        print(label.ljust(width) + ''.join(rows.get(label, '').ljust(col) for rows in columns.values()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--log-dir', type=Path, default=Path('.sim/demo'))
    args = parser.parse_args(argv)
    columns = {mode: run_mode(mode, args.log_dir) for mode in MODES}
    print_table(columns)
    print(f'\nlogs: {args.log_dir}/<mode>/*.log')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

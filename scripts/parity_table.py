"""The README's parity table: every request option, sent to a Hybrid node and through DistServe, stock and patched.

Starts a GPU-free cluster (1 Prefill + 1 Decode + 1 Hybrid) with LMDeploy as released, then one with
lmdeploy-pdfix, sends every case of ``tests/parity.py`` (whole and streamed) to each cluster's Hybrid node and
through its DistServe proxy, and prints a Markdown table (option, route, stock DistServe, patched, Hybrid) on
stdout; ``--json`` prints every case's differences instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lmdeploy_pdfix.sim.cluster import Cluster, ClusterConfig
from tests.parity import NODE_ARGS, Case, answer, cases, differences, protocol_fields, send


def run(stock: bool, all_cases: list[Case], root: Path) -> dict[str, tuple[dict, list[str]]]:
    """case id -> (the Hybrid node's answer, what DistServe answered otherwise)."""
    name = 'stock' if stock else 'patched'
    config = ClusterConfig(stock=stock, hybrid=1, node_args=NODE_ARGS, log_dir=root / name, model_dir=root / 'model')
    results = {}
    with Cluster(config) as cluster:
        for case in all_cases:
            hybrid = answer(*send(cluster.hybrid_urls[0], case), case.stream)
            distserve = answer(*send(cluster.proxy_url, case), case.stream)
            results[case.id] = (hybrid, differences(hybrid, distserve))
            print(f'{name} {case.id}: {differences(hybrid, distserve) or "same"}', file=sys.stderr)
    return results


def _cell(found: list[str], stream: list[str]) -> str:
    if not found and not stream:
        return 'same'
    parts = [f'whole: {found[0]}'] if found else []
    parts += [f'stream: {stream[0]}'] if stream else []
    return '; '.join(parts).replace('|', '\\|')


def _hybrid_cell(hybrid: dict) -> str:
    if 'choices' not in hybrid:
        return str(hybrid['status'])
    finishes = sorted({choice.get('finish_reason') for choice in hybrid['choices']} - {None})
    return f'{hybrid["status"]}, {len(hybrid["choices"])} choice(s), {"/".join(finishes)}'


def table(all_cases: list[Case], stock: dict, patched: dict) -> str:
    rows = ['| option | route | stock DistServe | patched DistServe | Hybrid |', '|---|---|---|---|---|']
    for case in all_cases:
        if case.stream:
            continue
        streamed = Case(case.option, case.route, True).id
        stock_cell = _cell(stock[case.id][1], stock[streamed][1]) if stock else '-'
        rows.append(f'| `{case.option}` | {case.route} | {stock_cell} | '
                    f'{_cell(patched[case.id][1], patched[streamed][1])} | {_hybrid_cell(patched[case.id][0])} |')
    return '\n'.join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--json', action='store_true', help='every case and its differences, as JSON')
    parser.add_argument('--logs', type=Path, help='keep the clusters\' logs here (default: a temporary folder)')
    parser.add_argument('--patched-only', action='store_true', help='skip the stock cluster (its column is empty)')
    args = parser.parse_args()
    all_cases = cases(protocol_fields())
    with tempfile.TemporaryDirectory() as tmp:
        root = args.logs or Path(tmp)
        stock = {} if args.patched_only else run(True, all_cases, root)
        patched = run(False, all_cases, root)
    if args.json:
        print(json.dumps({'stock': {key: found for key, (_, found) in stock.items()},
                          'patched': {key: found for key, (_, found) in patched.items()}}, indent=1))
    else:
        print(table(all_cases, stock, patched))
    return 0 if not any(found for _, found in patched.values()) else 1


if __name__ == '__main__':
    sys.exit(main())

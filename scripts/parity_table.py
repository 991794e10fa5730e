"""The parity table of docs/parity.md: every request option, sent to a Hybrid node and through DistServe.

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
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig
from tests.parity import NODE_ARGS, Case, answer, cases, differences, protocol_fields, send


def run(stock: bool, all_cases: list[Case], root: Path) -> dict[str, tuple[dict, dict]]:
    """case id -> (the Hybrid node's answer, the DistServe answer)."""
    name = 'stock' if stock else 'patched'
    config = ClusterConfig(stock=stock, hybrid=1, node_args=NODE_ARGS, log_dir=root / name, model_dir=root / 'model')
    results = {}
    with Cluster(config) as cluster:
        for case in all_cases:
            hybrid = answer(*send(cluster.hybrid_urls[0], case), case.stream)
            distserve = answer(*send(cluster.proxy_url, case), case.stream)
            results[case.id] = (hybrid, distserve)
            print(f'{name} {case.id}: {differences(hybrid, distserve) or "same"}', file=sys.stderr)
    return results


def _outcome(answer: dict) -> str:
    if answer.get('broken_off'):
        return f'{answer["status"]}, the stream breaks off'
    if answer.get('stream_error'):
        return f'{answer["status"]}, then an error event'
    if 'choices' not in answer:
        return str(answer['status'])
    finishes = sorted({choice.get('finish_reason') for choice in answer['choices']} - {None})
    return f'{answer["status"]}, {len(answer["choices"])} choice(s), {"/".join(finishes) or "no finish_reason"}'


def _label(hybrid: dict, distserve: dict) -> str:
    """How a DistServe answer differs from the Hybrid one, in a few words."""
    if not differences(hybrid, distserve):
        return 'same'
    if 'choices' not in hybrid or 'choices' not in distserve or hybrid['status'] != distserve['status']:
        return _outcome(distserve)
    parts = {found.split(':')[0].split(' ')[2] if found.startswith('choice') else found.split(' ')[0]
             for found in differences(hybrid, distserve)}
    return 'other ' + ', '.join(sorted(parts))


def _cell(results: dict, case: Case, say=_label) -> str:
    """What ``say`` says of the case's answers, whole and streamed, once where they agree."""
    if not results:
        return '-'
    whole = say(*results[case.id])
    stream = say(*results[Case(case.option, case.route, True).id])
    return whole if whole == stream else f'whole: {whole}; stream: {stream}'


def table(all_cases: list[Case], stock: dict, patched: dict) -> str:
    rows = ['| option | route | stock DistServe | patched DistServe | Hybrid |', '|---|---|---|---|---|']
    for case in all_cases:
        if not case.stream:
            hybrid = _cell(patched, case, lambda hybrid, _: _outcome(hybrid))
            rows.append(f'| `{case.option}` | {case.route} | {_cell(stock, case)} | {_cell(patched, case)} | '
                        f'{hybrid} |')
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
        print(json.dumps({mode: {key: differences(*pair) for key, pair in results.items()}
                          for mode, results in (('stock', stock), ('patched', patched))}, indent=1))
    else:
        print(table(all_cases, stock, patched))
    return 0 if not any(differences(*pair) for pair in patched.values()) else 1


if __name__ == '__main__':
    sys.exit(main())

"""Synchronous vs asynchronous Mooncake migration (``LMDEPLOY_USE_ASYNC_MIGRATION``), patched, side by side (D23).

Two patched 1 Prefill + 1 Decode clusters of the GPU-free cluster, one with the switch set, take the same
sequential completions interleaved (as ``bench_cluster`` does for stock vs patched); stock with the switch set
answers none (its transfer never returns), so it is not run. Reported: p50/p90/p99 latency, requests/s, exact
answers and Prefill sessions left, with async/sync ratios. ``--json`` prints only JSON on stdout; exit status 1
when an answer was wrong or a session was left.
Usage: python benchmarks/bench_async_migration.py [--requests 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import prefill_sessions, sequential

MODES = {'sync': {}, 'async': {'LMDEPLOY_USE_ASYNC_MIGRATION': '1'}}
METRICS = ('p50_ms', 'p90_ms', 'p99_ms', 'req_per_s')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--requests', type=int, default=100)
    parser.add_argument('--log-dir', type=Path, default=Path('.sim/bench-migration'))
    parser.add_argument('--json', action='store_true', help='print only the figures, as JSON, on stdout')
    args = parser.parse_args()
    clusters = {mode: Cluster(ClusterConfig(env=env, log_dir=args.log_dir / mode, model_dir=args.log_dir / 'model'))
                for mode, env in MODES.items()}
    try:
        for cluster in clusters.values():
            cluster.start()
        figures = sequential(clusters, args.requests)
        for mode, cluster in clusters.items():
            figures[mode]['prefill_sessions_left'] = prefill_sessions(cluster)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    figures['async_over_sync'] = {metric: round(figures['async'][metric] / figures['sync'][metric], 3)
                                  for metric in METRICS if figures['sync'][metric]}
    if args.json:
        print(json.dumps(figures))
    else:
        for mode in (*MODES, 'async_over_sync'):
            print(f'{mode:<16}', json.dumps(figures[mode]))
    clean = all(figures[mode]['exact'] == figures[mode]['requests'] and not figures[mode]['prefill_sessions_left']
                for mode in MODES)
    return 0 if clean else 1


if __name__ == '__main__':
    sys.exit(main())

"""Chaos soak (issue 9): clients that leave under load, Prefill rejections and a Decode restart, stock vs patched.

For each seed, a fresh GPU-free 1P+1D cluster (patched, and with ``--stock`` a stock one too) takes
``--requests`` requests at ``--concurrency`` from :mod:`lmdeploy_pdfix_sim.chaos`'s clients, while its Decode
node is killed and restarted ``--decode-restarts`` times at random points. Each run ends with the operator's
checks of ``lmdeploy-pdfix-sim soak --chaos``: answers with HTTP 200 and a wrong text, Prefill sessions left,
unhealthy or unregistered nodes, 10 exact requests afterwards. Prints one JSON object per run on stdout and
exits non-zero if a patched run is not clean.

    python benchmarks/soak_chaos.py --requests 10000 --seeds 1,2 --stock-requests 1000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmdeploy_pdfix.compat import lmdeploy_version
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix_sim.soak import _parser as soak_parser
from lmdeploy_pdfix_sim.soak import discover_nodes, run_chaos

HEARTBEAT_S = 5  # the proxy's heartbeat period in these runs (LMDeploy's default is 90 s)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--requests', type=int, default=10_000)
    parser.add_argument('--stock-requests', type=int, default=0, help='also run stock with this many (0: no)')
    parser.add_argument('--concurrency', type=int, default=8)
    parser.add_argument('--fault-rate', type=float, default=0.15)
    parser.add_argument('--decode-restarts', type=int, default=1)
    parser.add_argument('--seeds', default='1', help='comma-separated')
    parser.add_argument('--out', type=Path, default=Path('artifacts/soak-chaos'))
    return parser


def soak_once(stock: bool, requests: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    mode = 'stock' if stock else 'patched'
    out = args.out / f'{mode}-seed{seed}'
    config = ClusterConfig(stock=stock, log_dir=out / 'logs', model_dir=args.out / 'model',
                           env={'LMDEPLOY_CONTROLLER_HEART_BEAT_EXPIRATION': str(HEARTBEAT_S)})
    soak_args = soak_parser().parse_args(['--proxy', '-', '--chaos', '--requests', str(requests),
                                          '--concurrency', str(args.concurrency), '--seed', str(seed),
                                          '--fault-rate', str(args.fault_rate),
                                          '--decode-restarts', str(args.decode_restarts)])
    with Cluster(config) as cluster:
        soak_args.proxy = cluster.proxy_url
        summary = run_chaos(soak_args, discover_nodes(cluster.proxy_url),
                            lambda: cluster.bounce(cluster.decode_urls[0]))
    return {'lmdeploy': lmdeploy_version(), 'mode': mode, 'seed': seed, **summary}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    clean = True
    for seed in (int(seed) for seed in args.seeds.split(',')):
        runs = [(False, args.requests)] + ([(True, args.stock_requests)] if args.stock_requests else [])
        for stock, requests in runs:
            summary = soak_once(stock, requests, seed, args)
            print(json.dumps(summary), flush=True)
            clean = clean and (stock or summary['clean'])
    return 0 if clean else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

"""``lmdeploy-pdfix-sim up|status|down``: a GPU-free DistServe cluster that outlives the command; ``soak``: a
load loop against a DistServe proxy.

``up`` records what it started in ``.sim/cluster.json`` under the current directory; ``down`` stops exactly
those process groups. On a terminal ``up`` shows a live line on stderr while the cluster starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig, stop_processes
from lmdeploy_pdfix_sim.progress import live

STATE_DIR = Path('.sim')
STATE_FILE = STATE_DIR / 'cluster.json'


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='lmdeploy-pdfix-sim', description=__doc__)
    sub = parser.add_subparsers(dest='command', required=True)
    up = sub.add_parser('up', help='start proxy + Prefill + Decode nodes and wait until healthy')
    up.add_argument('--prefill', type=int, default=1)
    up.add_argument('--decode', type=int, default=1)
    up.add_argument('--stock', action='store_true', help='LMDeploy as released (LMDEPLOY_PDFIX unset)')
    up.add_argument('--max-prefill-token-num', type=int, default=None)
    up.add_argument('--num-blocks', type=int, default=512, help='KV blocks per node (64 tokens each)')
    up.add_argument('--drop-kv-on-decode', action='store_true', help='negative control: skip the KV transfer')
    up.add_argument('--log-dir', type=Path, default=STATE_DIR / 'logs')
    up.add_argument('--python', default=sys.executable, help='interpreter of the venv holding LMDeploy')
    sub.add_parser('status', help='show the recorded cluster and each node state')
    sub.add_parser('down', help='stop the recorded cluster')
    sub.add_parser('soak', help='load loop against a DistServe proxy (see soak --help)')
    return parser


def _up(args: argparse.Namespace) -> int:
    if STATE_FILE.exists():
        print(f'a cluster is already recorded in {STATE_FILE}; run `lmdeploy-pdfix-sim down` first', file=sys.stderr)
        return 1
    config = ClusterConfig(prefill=args.prefill, decode=args.decode, stock=args.stock,
                           max_prefill_token_num=args.max_prefill_token_num, num_blocks=args.num_blocks,
                           log_dir=args.log_dir, model_dir=STATE_DIR / 'model',
                           drop_kv_on_decode=args.drop_kv_on_decode, python=args.python)
    cluster = Cluster(config)
    with live(_starting_line(cluster)):
        cluster.start()
    STATE_FILE.write_text(json.dumps(cluster.to_json(), indent=1))
    print(f'proxy   {cluster.proxy_url}')
    for proc in cluster.processes[1:]:
        print(f'{proc.role:<7} {proc.url}  pid {proc.pid}  log {proc.log}')
    print(f'{"stock" if config.stock else "patched"} cluster healthy in {cluster.startup_s:.1f} s; '
          f'state in {STATE_FILE}')
    return 0


def _starting_line(cluster: Cluster) -> Callable[[], str]:
    """``starting: 2/3 processes spawned, 41 s``; spawned, not healthy: ``start()`` reports no more than that."""
    expected = 1 + cluster.config.prefill + cluster.config.decode  # the proxy, then every node
    began = time.monotonic()
    return lambda: f'starting: {len(cluster.processes)}/{expected} processes spawned, {time.monotonic() - began:.0f} s'


def _load() -> Cluster | None:
    if not STATE_FILE.exists():
        print(f'no cluster recorded in {STATE_FILE}', file=sys.stderr)
        return None
    return Cluster.from_json(json.loads(STATE_FILE.read_text()))


def _status(_: argparse.Namespace) -> int:
    cluster = _load()
    if cluster is None:
        return 1
    print(f'proxy   {cluster.proxy_url}  pid {cluster.processes[0].pid}')
    healthy = True
    for proc in cluster.processes[1:]:
        try:
            state = cluster.node_state(proc.url)
        except OSError as exc:
            healthy = False
            print(f'{proc.role:<7} {proc.url}  UNREACHABLE ({exc})')
            continue
        print(f'{proc.role:<7} {proc.url}  sessions {state.get("sessions")} {state.get("sessions_by_status")}  '
              f'free blocks {state.get("free_blocks")}/{state.get("total_blocks")}  '
              f'counters {state.get("counters")}')
    return 0 if healthy else 1


def _down(_: argparse.Namespace) -> int:
    cluster = _load()
    if cluster is None:
        return 1
    stop_processes(cluster.processes)
    STATE_FILE.unlink()
    print(f'stopped {len(cluster.processes)} process groups')
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['soak']:
        from lmdeploy_pdfix_sim.soak import main as soak_main

        return soak_main(argv[1:])
    args = _parser().parse_args(argv)
    return {'up': _up, 'status': _status, 'down': _down}[args.command](args)


if __name__ == '__main__':
    sys.exit(main())

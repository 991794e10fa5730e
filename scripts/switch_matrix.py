"""Each patch switched off alone brings back its own defect and no other (issue 10's switch matrix).

For every patch of the registry: ``lmdeploy-pdfix status --json`` with ``LMDEPLOY_PDFIX_DISABLE=<patch>``
(what it says of every patch), then a fresh GPU-free 1P+1D cluster with the same switch taking a mix of
``--requests`` requests (completions, chat, both streamed) at concurrency 4, and the operator's checks of
``lmdeploy-pdfix soak --chaos``: answers with HTTP 200 and a wrong text, Prefill sessions left, node health.
Prints one JSON object per patch on stdout.

    python scripts/switch_matrix.py --requests 50
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.registry import PATCHES
from lmdeploy_pdfix.sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix.soak import _parser as soak_parser
from lmdeploy_pdfix.soak import discover_nodes, run_chaos


def status_with(disabled: str) -> dict[str, str]:
    """What ``lmdeploy-pdfix status`` says of each patch with ``disabled`` switched off (state, and why)."""
    env = {**os.environ, settings.TOGGLE: '1', settings.DISABLE: disabled}
    run = subprocess.run([sys.executable, '-m', 'lmdeploy_pdfix.cli', 'status', '--json'], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(run.stdout[run.stdout.index('{'):])
    return {row['name']: row['state'] + (f" ({row['reason']})" if row['state'] == 'refused' else '')
            for row in report['patches']}


def run_one(disabled: str, args: argparse.Namespace) -> dict[str, Any]:
    config = ClusterConfig(log_dir=args.out / disabled, model_dir=args.out / 'model',
                           env={settings.DISABLE: disabled})
    soak_args = soak_parser().parse_args(['--proxy', '-', '--chaos', '--requests', str(args.requests),
                                          '--concurrency', '4', '--fault-rate', '0'])
    with Cluster(config) as cluster:
        soak_args.proxy = cluster.proxy_url
        summary = run_chaos(soak_args, discover_nodes(cluster.proxy_url), None)
    keys = ('normal_exact', 'normal_failed_by_status', 'wrong_text_200', 'prefill_sessions_left', 'unhealthy_nodes',
            'exact_afterwards')
    return {'disabled': disabled, 'status': status_with(disabled), **{key: summary[key] for key in keys}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--requests', type=int, default=50)
    parser.add_argument('--only', default='', help='comma-separated patch names (default: every patch)')
    parser.add_argument('--out', type=Path, default=Path('artifacts/switch-matrix'))
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(',') if name] or [spec.name for spec in PATCHES]
    for name in names:
        print(json.dumps(run_one(name, args)), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

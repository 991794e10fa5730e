"""Each unit switched off alone, or refused alone, brings back its own defect and no other (issue 10).

For every unit of the registry: ``lmdeploy-pdfix status --json`` with ``LMDEPLOY_PDFIX_DISABLE=<unit>``
(what it says of every unit), then a fresh GPU-free 1P+1D cluster with the same switch taking a mix of
``--requests`` requests (completions, chat, both streamed) at concurrency 4, and the operator's checks of
``lmdeploy-pdfix-sim soak --chaos``: answers with HTTP 200 and a wrong text, Prefill sessions left, node health.
With ``--refuse`` the unit is not switched off but refused by its own guard: every process of the cluster (and
``status``) sees the first LMDeploy function that unit checks replaced by one of another shape.
Prints one JSON object per unit on stdout.

    python scripts/switch_matrix.py --requests 50 [--refuse]
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
from lmdeploy_pdfix_sim import settings as sim_settings
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig
from lmdeploy_pdfix_sim.misshape import misshapen_target
from lmdeploy_pdfix_sim.soak import _parser as soak_parser
from lmdeploy_pdfix_sim.soak import discover_nodes, run_chaos


def switches(unit: str, refuse: bool) -> dict[str, str]:
    """The environment that disables ``unit``, or that has its guard refuse it."""
    if refuse:
        return {sim_settings.TOGGLE: '1', sim_settings.MISSHAPE: misshapen_target(unit)}
    return {settings.DISABLE: unit}


def status_with(env_switches: dict[str, str]) -> dict[str, str]:
    """What ``lmdeploy-pdfix status`` says of each unit under ``env_switches`` (state, and why)."""
    env = {**os.environ, settings.TOGGLE: '1', **env_switches}
    run = subprocess.run([sys.executable, '-m', 'lmdeploy_pdfix.tools.cli', 'status', '--json'], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(run.stdout[run.stdout.index('{'):])
    return {row['name']: row['state'] + (f" ({row['reason']})" if row['state'] == 'refused' else '')
            for row in report['patches']}


def run_one(unit: str, args: argparse.Namespace) -> dict[str, Any]:
    env_switches = switches(unit, args.refuse)
    config = ClusterConfig(log_dir=args.out / unit, model_dir=args.out / 'model', env=env_switches)
    soak_args = soak_parser().parse_args(['--proxy', '-', '--chaos', '--requests', str(args.requests),
                                          '--concurrency', '4', '--fault-rate', '0'])
    with Cluster(config) as cluster:
        soak_args.proxy = cluster.proxy_url
        summary = run_chaos(soak_args, discover_nodes(cluster.proxy_url), None)
    keys = ('normal_exact', 'normal_failed_by_status', 'wrong_text_200', 'prefill_sessions_left', 'unhealthy_nodes',
            'exact_afterwards')
    return {'refused' if args.refuse else 'disabled': unit, 'status': status_with(env_switches),
            **{key: summary[key] for key in keys}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--requests', type=int, default=50)
    parser.add_argument('--only', default='', help='comma-separated unit names (default: every unit)')
    parser.add_argument('--refuse', action='store_true', help="have each unit's guard refuse it, not the switch")
    parser.add_argument('--out', type=Path, default=Path('artifacts/switch-matrix'))
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(',') if name] or [spec.name for spec in PATCHES]
    for name in names:
        print(json.dumps(run_one(name, args)), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

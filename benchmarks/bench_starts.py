"""Node starts on a loaded host, stock vs patched (D22: the engine process loses the start-up handshake race).

For each mode, Prefill nodes of the GPU-free cluster are started ``--at-once`` at a time, while ``--burners``
processes keep every core busy, until ``--starts`` starts were tried. A start fails when the node's api_server
exits before its ``/health`` answers; the node's log names the cause. Stock nodes start as LMDeploy 0.17/0.18
do (``LMDEPLOY_PDFIX_SIM_RAW_START=1``: the GPU-free cluster otherwise gives stock nodes the fix too, to start
reliably). Prints JSON on stdout; exit status 1 when a patched start failed.
Usage: python benchmarks/bench_starts.py [--starts 100] [--at-once 4] [--burners 2] [--modes stock,patched]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lmdeploy_pdfix_sim import settings as sim_settings
from lmdeploy_pdfix_sim.cluster import Cluster, ClusterConfig, Process, stop_processes, wait_http_ok

CAUSES = ('EOFError', 'BrokenPipeError', 'ConnectionResetError', 'RPCServerDeadError')
START_TIMEOUT_S = 240.0


def burn() -> None:
    while True:
        pass


def cause_of(proc: Process) -> str:
    log = Path(proc.log).read_text(errors='replace')
    return next((cause for cause in CAUSES if cause in log), 'other')


def start_round(cluster: Cluster, count: int, first: int) -> list[tuple[Process, float, str | None]]:
    """Start ``count`` Prefill nodes at once; each with its start time and, if it died, the cause."""
    began = time.monotonic()
    nodes = [cluster.spawn_node(f'node{first + i}', 'Prefill') for i in range(count)]
    outcomes = []
    for node in nodes:
        try:
            wait_http_ok(f'{node.url}/health', began + START_TIMEOUT_S, node.pid)
            outcomes.append((node, time.monotonic() - began, None))
        except (RuntimeError, TimeoutError):
            outcomes.append((node, time.monotonic() - began, cause_of(node)))
    stop_processes(nodes)
    return outcomes


def run_mode(mode: str, starts: int, at_once: int, root: Path) -> dict[str, Any]:
    env = {sim_settings.RAW_START: '1'} if mode == 'stock' else {}
    config = ClusterConfig(prefill=0, decode=0, stock=mode == 'stock', warmup=False, env=env,
                           log_dir=root / mode, model_dir=root / 'model')
    failures: Counter[str] = Counter()
    durations = []
    with Cluster(config) as cluster:
        tried = 0
        while tried < starts:
            for _, seconds, cause in start_round(cluster, min(at_once, starts - tried), tried):
                if cause is None:
                    durations.append(seconds)
                else:
                    failures[cause] += 1
            tried += at_once
    return {'starts': starts, 'failed': sum(failures.values()), 'causes': dict(failures),
            'mean_start_s': round(sum(durations) / max(len(durations), 1), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--starts', type=int, default=100)
    parser.add_argument('--at-once', type=int, default=4)
    parser.add_argument('--burners', type=int, default=2, help='busy processes that load the host meanwhile')
    parser.add_argument('--modes', default='stock,patched')
    args = parser.parse_args()
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for burner in burners:
        burner.start()
    try:
        with tempfile.TemporaryDirectory(prefix='bench-starts-') as tmp:
            report = {mode: run_mode(mode, args.starts, args.at_once, Path(tmp)) for mode in args.modes.split(',')}
    finally:
        for burner in burners:
            burner.kill()
    report['host_load'] = {'busy_processes': args.burners, 'starts_at_once': args.at_once}
    print(json.dumps(report))
    return 1 if report.get('patched', {}).get('failed') else 0


if __name__ == '__main__':
    sys.exit(main())

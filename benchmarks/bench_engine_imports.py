"""The import cost of an engine process, stock vs patched, as a ratio (goal: within 2%).

LMDeploy's engine process imports the PyTorch engine and none of the HTTP stack; the units that apply there must
not add it. Times ``python -c 'import <the engine process's modules>'`` round-robin with LMDEPLOY_PDFIX unset
and set, in this interpreter's environment (LMDeploy and lmdeploy-pdfix installed), and reports each run's CPU
time (user + system), which the other processes on a loaded host disturb less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

# what LMDeploy's engine process imports before its model: the engine, its loop, worker, agent, migration link
ENGINE_MODULES = (
    'lmdeploy.pytorch.engine.mp_engine.zmq_engine',
    'lmdeploy.pytorch.engine.mp_engine.base_worker',
    'lmdeploy.pytorch.engine.engine',
    'lmdeploy.pytorch.engine.engine_loop',
    'lmdeploy.pytorch.engine.inputs_maker',
    'lmdeploy.pytorch.engine.guided_process',
    'lmdeploy.pytorch.engine.model_agent',
    'lmdeploy.pytorch.disagg.conn.engine_conn',
)
HTTP_STACK = ('aiohttp', 'fastapi', 'starlette', 'uvicorn')
PROGRAM = (f'import importlib, json, sys\nfor name in {ENGINE_MODULES!r}: importlib.import_module(name)\n'
           f'print(json.dumps([len(sys.modules), [m for m in {HTTP_STACK!r} if m in sys.modules]]))')


def import_once(env: dict[str, str]) -> tuple[float, int, list[str]]:
    """CPU seconds of one engine-process import, its module count, and the HTTP modules it loaded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, '-c', PROGRAM], env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    modules, http = json.loads(done.stdout.splitlines()[-1])
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, modules, http


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--runs', type=int, default=15, help='imports per configuration')
    args = parser.parse_args()
    stock_env = {key: value for key, value in os.environ.items() if not key.startswith('LMDEPLOY_PDFIX')}
    configs = {'stock': stock_env, 'patched': {**stock_env, 'LMDEPLOY_PDFIX': '1'}}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    seen: dict[str, tuple[int, list[str]]] = {}
    for _ in range(args.runs):
        for name, env in configs.items():
            seconds, modules, http = import_once(env)
            cpu[name].append(seconds)
            seen[name] = (modules, http)
    medians = {name: statistics.median(samples) for name, samples in cpu.items()}
    print(f'engine process imports, CPU time, median of {args.runs} runs each (round-robin):')
    for name, median in medians.items():
        modules, http = seen[name]
        print(f'  {name:<8} {median * 1000:7.0f} ms  {modules} modules  HTTP stack: {", ".join(http) or "none"}')
    print(f'  patched / stock: {medians["patched"] / medians["stock"]:.3f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

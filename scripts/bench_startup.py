"""Interpreter start-up cost of the start-up hook, as ratios to an environment without the package.

Builds two throw-away virtual environments from this interpreter, identical but for lmdeploy-pdfix (installed
from this checkout as a wheel in one of them), and times ``python -c pass`` round-robin in three
configurations: not installed, installed with LMDEPLOY_PDFIX unset, installed with LMDEPLOY_PDFIX=1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_env(root: Path, name: str, wheel_dir: Path | None) -> Path:
    path = root / name
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / 'bin' / 'python'
    if wheel_dir is not None:
        subprocess.run([sys.executable, '-m', 'pip', '--python', str(python), 'install', '-q', '--no-deps',
                        '--no-index', '--find-links', str(wheel_dir), 'lmdeploy-pdfix'], check=True)
    return python


def start_once(python: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), '-c', 'pass'], env=env, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--runs', type=int, default=40, help='start-ups per configuration')
    args = parser.parse_args()
    base_env = {key: value for key, value in os.environ.items() if not key.startswith('LMDEPLOY_PDFIX')}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', str(REPO), '-w', str(root / 'wheels')],
                       check=True)
        plain = make_env(root, 'plain', None)
        installed = make_env(root, 'installed', root / 'wheels')
        configs = {
            'not installed': (plain, base_env),
            'installed, toggle off': (installed, base_env),
            'installed, toggle on': (installed, {**base_env, 'LMDEPLOY_PDFIX': '1'}),
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.runs):
            for name, (python, env) in configs.items():
                times[name].append(start_once(python, env))
    baseline = statistics.median(times['not installed'])
    print(f'interpreter start-up, median of {args.runs} runs each (round-robin):')
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f'  {name:<24} {median * 1000:7.1f} ms   ratio to not installed: {median / baseline:.3f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""What a release ships: ``python -m build`` gives an sdist and a wheel, and either installs the start-up hook;
the GPU-free emulation (the test-only ``sim/`` distribution) is not in them.

Built without build isolation (no download), installed with ``--no-deps`` into fresh virtual environments.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOK = 'lmdeploy_pdfix.pth'
EMULATION_MODULES = {'sim', 'lmdeploy_pdfix_sim', 'soak', 'misshape', 'chaos', 'forward', 'hooks', 'faults'}


def run(*args: str | Path, cwd: Path | None = None) -> None:
    result = subprocess.run([str(arg) for arg in args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.fixture(scope='module')
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp('dist')
    source = tmp_path_factory.mktemp('source') / 'lmdeploy-pdfix'
    # build from a copy of the files git knows, so a developer's build/ or egg-info cannot leak in
    files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    run(sys.executable, '-m', 'build', '--no-isolation', '--outdir', out, source)
    return out


def installed_hook(tmp_path: Path, wheel: Path) -> Path:
    """Where ``wheel`` puts the start-up hook in a fresh virtual environment."""
    venv = tmp_path / 'venv'
    run(sys.executable, '-m', 'venv', venv)
    run(venv / 'bin' / 'python', '-m', 'pip', 'install', '-q', '--no-deps', '--no-index', wheel)
    purelib = subprocess.run([venv / 'bin' / 'python', '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
                             capture_output=True, text=True, check=True).stdout.strip()
    return Path(purelib) / HOOK


def test_the_sdist_carries_the_start_up_hook(dist: Path) -> None:
    sdist, = dist.glob('*.tar.gz')
    with tarfile.open(sdist) as archive:
        assert any(name.endswith(f'/{HOOK}') for name in archive.getnames())


@pytest.mark.parametrize('kind', ['wheel', 'sdist'])
def test_installing_puts_the_start_up_hook_at_the_site_packages_root(dist: Path, tmp_path: Path, kind: str) -> None:
    if kind == 'wheel':
        wheel, = dist.glob('*.whl')
    else:  # what `pip install` does with an sdist: build a wheel from it first
        sdist, = dist.glob('*.tar.gz')
        run(sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-build-isolation', '-w', tmp_path, sdist)
        wheel, = tmp_path.glob('*.whl')
    hook = installed_hook(tmp_path, wheel)
    assert hook.is_file()
    assert hook.read_text() == (ROOT / HOOK).read_text()


def test_the_wheel_carries_no_emulation(dist: Path) -> None:
    # the GPU-free cluster replaces the model forward: on a GPU node it would answer made-up text with HTTP 200
    wheel, = dist.glob('*.whl')
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    emulation = [name for name in names if EMULATION_MODULES & {*Path(name).parts, Path(name).stem}]
    assert emulation == [] and 'lmdeploy_pdfix/tools/cli.py' in names


def test_with_only_the_wheel_installed_the_emulation_switch_does_nothing(dist: Path, tmp_path: Path) -> None:
    wheel, = dist.glob('*.whl')
    python = installed_hook(tmp_path, wheel).parents[3] / 'bin' / 'python'
    loaded = subprocess.run(
        [python, '-c', 'import importlib.util, json, sys; print(json.dumps([sorted(sys.modules), '
                       'importlib.util.find_spec("lmdeploy_pdfix_sim") is not None]))'],
        env={'PATH': '/usr/bin:/bin', 'LMDEPLOY_PDFIX': '1', 'LMDEPLOY_PDFIX_SIM': '1'},
        capture_output=True, text=True, check=True)
    modules, emulation_found = json.loads(loaded.stdout)
    assert 'lmdeploy_pdfix._bootstrap' in modules  # the start-up hook ran
    assert [name for name in modules if EMULATION_MODULES & set(name.split('.'))] == []
    assert not emulation_found

"""``lmdeploy-pdfix status``: what it prints for machines is JSON and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmdeploy_pdfix.registry import PATCHES

REPO = Path(__file__).resolve().parent.parent


def test_status_json_is_the_whole_of_stdout_and_names_every_unit() -> None:
    # importing LMDeploy's proxy logs "AIOHTTP_TIMEOUT set to None …" on stdout: `status --json | jq` broke
    env = {**os.environ, 'LMDEPLOY_PDFIX': '1', 'PYTHONPATH': str(REPO)}
    run = subprocess.run([sys.executable, '-m', 'lmdeploy_pdfix.tools.cli', 'status', '--json'], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(run.stdout)
    assert [row['name'] for row in report['patches']] == [spec.name for spec in PATCHES]
    assert {row['state'] for row in report['patches']} == {'applied'}, report['patches']
    assert run.returncode == 0


def test_a_unit_whose_optional_dependency_is_missing_is_not_applicable_not_refused() -> None:
    # Ray is optional for LMDeploy: without it ray_workers_env has nothing to fix, which is no failure of status
    code = ("import sys; sys.modules['ray'] = None\n"  # what an interpreter without Ray finds
            "from lmdeploy_pdfix.tools.cli import main\nraise SystemExit(main(['status', '--json']))")
    env = {**os.environ, 'LMDEPLOY_PDFIX': '1', 'PYTHONPATH': str(REPO)}
    run = subprocess.run([sys.executable, '-c', code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=False)
    rows = {row['name']: row for row in json.loads(run.stdout)['patches']}
    assert rows['ray_workers_env']['state'] == 'not applicable'
    assert rows['ray_workers_env']['reason'].startswith('ray is not installed')
    assert run.returncode == 0


def test_status_says_plainly_what_running_without_a_node_key_leaves_open(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdeploy_pdfix.tools.cli import status_report

    monkeypatch.delenv('LMDEPLOY_PDFIX_NODE_API_KEY', raising=False)
    unkeyed = status_report()['node_key']
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', 'a-key')
    assert unkeyed['set'] is False and any("a node's port" in what for what in unkeyed['leaves_open'])
    assert status_report()['node_key'] == {'set': True, 'leaves_open': []}

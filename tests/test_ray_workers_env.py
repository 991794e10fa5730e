"""Ray workers get the driver's lmdeploy-pdfix switches.

Drives LMDeploy's real ``RayExecutor._init_workers_ray`` (and so its real runtime-env builder) with a
placement group of stand-in bundles; only ``ray.remote`` is replaced, by a recorder of the options each
worker actor would be started with, so no Ray cluster runs.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

SWITCHES = {'LMDEPLOY_PDFIX': '1', 'LMDEPLOY_PDFIX_DISABLE': 'proxy_distserve'}
WORKERS = 2


class RecordingRemote:
    """Stands in for ``ray.remote``: records each actor's options and returns a handle-like object."""

    def __init__(self) -> None:
        self.options: list[dict[str, Any]] = []

    def __call__(self, **options: Any):
        self.options.append(options)
        return lambda actor_class: SimpleNamespace(remote=lambda **kwargs: SimpleNamespace(options=options))


def start_workers(executor: ModuleType, device_str: str, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The ``runtime_env`` of every worker LMDeploy's Ray executor starts for ``WORKERS`` TP ranks."""
    remote = RecordingRemote()
    monkeypatch.setattr(executor.ray, 'remote', remote)
    monkeypatch.setattr(executor, 'get_device_str', lambda: device_str)
    # the executor's own state that _init_workers_ray reads (0.17 names the symm-mem flag _try_symm_mem)
    state = SimpleNamespace(dist_config=SimpleNamespace(attn_tp=WORKERS), _try_symm_mem=False,
                            _needs_symm_mem_device_setup=False)
    placement_group = SimpleNamespace(bundle_specs=[{device_str: 1}] * WORKERS)
    workers = executor.RayExecutor._init_workers_ray(state, placement_group, {})
    assert len(workers) == WORKERS
    return [options['runtime_env'] for options in remote.options]


@pytest.mark.regression
@pytest.mark.parametrize('device_str', ['GPU', 'NPU'])
def test_ray_workers_inherit_the_pdfix_switches(apply_patch, monkeypatch: pytest.MonkeyPatch, device_str: str) -> None:
    executor = apply_patch('ray_workers_env')
    for name, value in SWITCHES.items():
        monkeypatch.setenv(name, value)

    for runtime_env in start_workers(executor, device_str, monkeypatch):
        env_vars = runtime_env['env_vars']
        assert {name: env_vars.get(name) for name in SWITCHES} == SWITCHES
        assert env_vars.items() >= executor._envs.get_all_envs().items()  # LMDeploy's own still forwarded

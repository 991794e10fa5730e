"""Ray workers inherit the lmdeploy-pdfix switches, so the engine-side patches run there too.

With the Ray executor, each remote worker gets the ``runtime_env`` that ``_update_runtime_envs`` builds: the
variables LMDeploy's own ``envs`` module read, and nothing else. ``LMDEPLOY_PDFIX`` and the other
``LMDEPLOY_PDFIX_*`` settings are dropped, so a worker on another node (or under a Ray cluster started
before the switch was set) runs stock LMDeploy beside a patched driver. The wrapper adds every one of them
the driver has. ``_update_runtime_envs`` is the one point both GPU and non-GPU workers go through, in 0.17
and 0.18 alike.
"""

from __future__ import annotations

import os
from types import ModuleType

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.patching import Patch, first_problem, signature_problem

BUILDER = '_update_runtime_envs'


def pdfix_switches() -> dict[str, str]:
    """The lmdeploy-pdfix variables of this process (``LMDEPLOY_PDFIX`` and ``LMDEPLOY_PDFIX_*``)."""
    prefix = settings.TOGGLE + '_'
    return {name: value for name, value in os.environ.items() if name == settings.TOGGLE or name.startswith(prefix)}


def _forwarding_pdfix_switches(original):
    def _update_runtime_envs(runtime_env):
        runtime_env = original(runtime_env)
        runtime_env['env_vars'].update(pdfix_switches())
        return runtime_env

    return _update_runtime_envs


def _builder_unused_problem(module: ModuleType) -> str | None:
    """Why the workers' runtime env may no longer come from ``BUILDER`` (the wrapper would change nothing)."""
    init_workers = getattr(getattr(module, 'RayExecutor', None), '_init_workers_ray', None)
    if init_workers is None:
        return 'RayExecutor._init_workers_ray is missing'
    if BUILDER not in getattr(getattr(init_workers, '__code__', None), 'co_names', ()):
        return f'RayExecutor._init_workers_ray no longer calls {BUILDER}'
    return None


class RayWorkersEnvPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.executor.ray_executor:_update_runtime_envs',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        return first_problem(signature_problem(module, BUILDER, ['runtime_env']), _builder_unused_problem(module))

    def _apply(self, module: ModuleType) -> None:
        # a module global: _init_workers_ray looks it up at each call, so replacing it is enough
        self.wrap(module, BUILDER, _forwarding_pdfix_switches)


PATCH = RayWorkersEnvPatch()

"""GPU-free DistServe cluster: the real LMDeploy serving stack with an emulated model forward.

A test-only distribution (``lmdeploy-pdfix-sim``, installed by ``make test`` and ``make demo``, never by ``pip
install lmdeploy-pdfix``). Its own start-up hook (``lmdeploy_pdfix_sim.pth``) runs :func:`run_from_startup` in
every interpreter, so :func:`activate` runs where ``LMDEPLOY_PDFIX_SIM=1`` (so also in LMDeploy's spawned engine
process), after the shipped package's hook (``.pth`` files run in name order). It only registers post-import
hooks; the substitutions themselves live in ``lmdeploy_pdfix_sim.hooks`` and are imported when their LMDeploy
(or torch) module is.
Standard library only at import time.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

from lmdeploy_pdfix._import_hooks import when_imported
from lmdeploy_pdfix_sim import misshape, settings

# module watched → name of the function in lmdeploy_pdfix_sim.hooks that substitutes in it
_SUBSTITUTIONS = {
    'torch': 'install_cuda_shims',
    'lmdeploy.pytorch.backends.selector': 'substitute_backend_selector',
    'lmdeploy.pytorch.engine.cache_engine': 'substitute_cache_allocation',
    'lmdeploy.pytorch.engine.executor.base': 'substitute_block_count',
    'lmdeploy.pytorch.engine.model_agent.agent': 'substitute_model_agent',
    'lmdeploy.pytorch.disagg.backend.mooncake': 'substitute_mooncake',
    'lmdeploy.pytorch.engine.engine': 'substitute_engine_state',
    'lmdeploy.pytorch.paging.scheduler': 'substitute_migration_schedule',
    'lmdeploy.pytorch.engine.mp_engine.zmq_engine': 'substitute_engine_start',
    'lmdeploy.serve.openai.api_server': 'substitute_api_router',
}

_lock = threading.Lock()
_activated = False


def _substitute(hook_name: str, module: ModuleType) -> None:
    hooks = importlib.import_module('lmdeploy_pdfix_sim.hooks')
    getattr(hooks, hook_name)(module)


def activate() -> None:
    """Register every substitution (idempotent)."""
    global _activated
    with _lock:
        if _activated:
            return
        _activated = True
    misshape.activate()
    for module_name, hook_name in _SUBSTITUTIONS.items():
        when_imported(module_name, lambda module, hook_name=hook_name: _substitute(hook_name, module))


def run_from_startup() -> None:
    try:
        if settings.enabled():
            activate()
    except Exception as exc:
        print(f'lmdeploy-pdfix-sim: start-up hook failed, no emulation: {exc!r}', file=sys.stderr)


__all__ = ['activate', 'run_from_startup']

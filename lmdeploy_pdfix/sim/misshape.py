"""One LMDeploy function made the wrong shape before any unit's guard sees it (issue 10's "refused alone").

A passthrough with another signature stands in for what LMDeploy might rename or reshape upstream: the unit
that checks it must refuse itself (and its dependants with it) while LMDeploy keeps working. The bootstrap
tests misshape in-process; ``LMDEPLOY_PDFIX_SIM_MISSHAPE=module:attribute.path`` (see :func:`misshapen_target`)
does it in every process of a GPU-free cluster, before anything of LMDeploy is imported.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from lmdeploy_pdfix._import_hooks import when_imported

MISSHAPE_ENV = 'LMDEPLOY_PDFIX_SIM_MISSHAPE'

# proxy_distserve declares only its routes, which no guard can misread; it checks this function too
_CHECKED_FUNCTION = {'proxy_distserve': 'lmdeploy.serve.proxy.proxy:NodeManager.get_node_url'}


def misshapen_target(unit: str) -> str:
    """``module:attribute.path`` of the function whose shape ``unit``'s guard checks first."""
    if unit in _CHECKED_FUNCTION:
        return _CHECKED_FUNCTION[unit]
    from lmdeploy_pdfix._bootstrap import load_patch
    from lmdeploy_pdfix.registry import BY_NAME

    return next(entry for entry in load_patch(BY_NAME[unit]).wraps if not entry.endswith('.routes'))


def owner_of(module: ModuleType, path: str) -> tuple[Any, str]:
    *parents, attribute = path.split('.')
    owner: Any = module
    for name in parents:
        owner = getattr(owner, name)
    return owner, attribute


def misshape(module: ModuleType, path: str) -> Any:
    """Put a ``(*args, **kwargs)`` passthrough in place of ``module:path``; returns the passthrough."""
    owner, attribute = owner_of(module, path)
    original = getattr(owner, attribute)

    def misshapen(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    setattr(owner, attribute, misshapen)
    return misshapen


def activate() -> None:
    """Misshape the function the environment names, ahead of every unit's import hook."""
    target = os.environ.get(MISSHAPE_ENV)
    if not target:
        return
    module_name, path = target.split(':')
    when_imported(module_name, lambda module: misshape(module, path), first=True)


__all__ = ['MISSHAPE_ENV', 'activate', 'misshape', 'misshapen_target', 'owner_of']

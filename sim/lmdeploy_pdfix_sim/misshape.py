"""One LMDeploy function made the wrong shape before any unit's guard sees it (issue 10's "refused alone").

A passthrough with another signature stands in for what LMDeploy might rename or reshape upstream: the unit
that checks it must refuse itself (and its dependants with it) while LMDeploy keeps working. The bootstrap
tests misshape in-process; ``LMDEPLOY_PDFIX_SIM_MISSHAPE=module:attribute.path`` (see :func:`misshapen_target`)
does it in every process of a GPU-free cluster, before anything of LMDeploy is imported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from lmdeploy_pdfix._import_hooks import when_imported
from lmdeploy_pdfix_sim import settings

# proxy_distserve and proxy_warmups declare only routes, which no guard can misread; each checks a function too.
# proxy_metrics reads no function of LMDeploy: what would stop it is an upstream proxy serving /metrics itself
# ('app@/metrics': the app already serves that route).
_CHECKED_FUNCTION = {'proxy_distserve': 'lmdeploy.serve.proxy.proxy:NodeManager.get_node_url',
                     'proxy_warmups': 'lmdeploy.serve.proxy.proxy:create_error_response',
                     'proxy_metrics': 'lmdeploy.serve.proxy.proxy:app@/metrics'}


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
    """Put a ``(*args, **kwargs)`` passthrough in place of ``module:path``; returns the passthrough.

    ``app@/route``: the app serves ``GET /route`` already, by the returned endpoint.
    """
    if '@' in path:
        return _served_upstream(module, path)
    owner, attribute = owner_of(module, path)
    original = getattr(owner, attribute)

    def misshapen(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    setattr(owner, attribute, misshapen)
    return misshapen


def _served_upstream(module: ModuleType, path: str) -> Any:
    app_name, route = path.split('@')

    async def served_upstream() -> dict[str, str]:
        return {}

    getattr(module, app_name).add_api_route(route, served_upstream, methods=['GET'])
    return served_upstream


def is_untouched(module: ModuleType, path: str, misshapen: Any) -> bool:
    """Whether what :func:`misshape` put at ``path`` is still all there is (no unit wrapped or joined it)."""
    if '@' in path:
        app_name, route = path.split('@')
        routes = getattr(module, app_name).router.routes
        return [getattr(r, 'endpoint', None) for r in routes if getattr(r, 'path', None) == route] == [misshapen]
    owner, attribute = owner_of(module, path)
    return getattr(owner, attribute) is misshapen


def activate() -> None:
    """Misshape the function the environment names, ahead of every unit's import hook."""
    target = settings.misshapen_target()
    if not target:
        return
    module_name, path = target.split(':')
    when_imported(module_name, lambda module: misshape(module, path), first=True)


__all__ = ['activate', 'is_untouched', 'misshape', 'misshapen_target', 'owner_of']

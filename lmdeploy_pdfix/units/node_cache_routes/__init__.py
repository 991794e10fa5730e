"""A node's DistServe cache routes tell the truth: frees, claims and the audit (defect D15).

LMDeploy's ``/distserve/free_cache`` ends whatever session id it is given and answers success either way;
a running request can be ended by a stale id, and a miss is an "invalid free" error in the log. With this
unit the route releases only a cache the engine's book of preserved caches holds (``engine_sessions``), and
says so: ``released``, ``not_found`` or ``refused``, each definitive. ``POST /distserve/pdfix/claim`` lets a
Decode node confirm a cache before it migrates it, and ``GET /distserve/pdfix/audit`` shows the book. The
handlers are in :mod:`.routes`.

The book lives in the engine process, which runs the same code with the same switches: this unit requires
``engine_sessions`` in its own process, and where that does not apply the node keeps LMDeploy's free and serves
no claims (``status`` and the capability route say so), rather than answering from an empty book.
"""

from __future__ import annotations

from types import ModuleType

from lmdeploy_pdfix.domain.protocol import FREE_PATH
from lmdeploy_pdfix.patching import Patch, signature_problem
from lmdeploy_pdfix.shared.lmdeploy_modules import DISTSERVE_MODULE
from lmdeploy_pdfix.shared.routes import swap_endpoint
from lmdeploy_pdfix.units.node_cache_routes.routes import add_node_routes, free_cache_endpoint


def _adding_cache_routes(original):
    def register(router, server_context):
        original(router, server_context)
        swap_endpoint(router.routes, FREE_PATH, free_cache_endpoint(server_context))
        add_node_routes(router, server_context)

    return register


class NodeCacheRoutesPatch(Patch):
    wraps = (f'{DISTSERVE_MODULE}:register',)

    def shape_problem(self, module: ModuleType) -> str | None:
        return signature_problem(module, 'register', ['router', 'server_context'])

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module, 'register', _adding_cache_routes)


PATCH = NodeCacheRoutesPatch()

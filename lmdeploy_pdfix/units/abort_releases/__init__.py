"""Aborting all of a Prefill node's work also releases the caches it preserved for Decode nodes (issue 12).

``POST /abort_request {"abort_all": true}`` (and ``/sleep``, which discards the KV cache) ends through
``AsyncEngine.stop_all_session``: it aborts the requests the api_server still runs, but a preserved cache
outlives its request, so every cache answered and waiting for its Decode stayed preserved until the orphan
TTL (600 s). After LMDeploy's own abort, every preserved cache no Decode node has claimed is released at
once; a claimed one is being copied right now, and its Decode frees it when the copy ends. A request aborted
while it runs already ends without preserving anything (``engine_sessions``, D4).
"""

from __future__ import annotations

from types import ModuleType

from lmdeploy_pdfix.domain.preserved import ReleaseCause
from lmdeploy_pdfix.patching import Patch, coroutine_problem, first_problem, signature_problem, warn
from lmdeploy_pdfix.shared.node_book import engine_call


def _releasing_preserved_caches(original):
    async def stop_all_session(self):
        await original(self)
        released = await engine_call(self, 'pdfix_release_unclaimed', ReleaseCause.ABORTED.value)
        if released:
            warn(f'aborting all sessions released {len(released)} preserved Prefill cache(s) no Decode had claimed')

    return stop_all_session


class AbortReleasesPatch(Patch):
    wraps = (
        'lmdeploy.serve.core.async_engine:AsyncEngine.stop_all_session',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        engine = getattr(module, 'AsyncEngine', None)
        if engine is None:
            return 'AsyncEngine is missing'
        return first_problem(signature_problem(engine, 'stop_all_session', ['self']),
                             coroutine_problem(engine, 'stop_all_session'))

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.AsyncEngine, 'stop_all_session', _releasing_preserved_caches)


PATCH = AbortReleasesPatch()

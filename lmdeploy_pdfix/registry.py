"""The patches this package knows, by name, with the LMDeploy module each one targets.

Standard library only: the start-up hook reads this table to register import hooks without importing
any patch module (each is imported only once its target has been imported).
"""

from __future__ import annotations

from dataclasses import dataclass

ENTRY_POINT_GROUP = 'lmdeploy_pdfix.patches'


@dataclass(frozen=True)
class PatchSpec:
    name: str
    module: str
    target: str
    summary: str


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        name='serving_cache_owner',
        module='lmdeploy_pdfix.patches.serving',
        target='lmdeploy.serve.openai.api_server',
        summary='Prefill answers to with_cache requests carry cache_session_id, the internal session owning the cache',
    ),
    PatchSpec(
        name='proxy_distserve',
        module='lmdeploy_pdfix.patches.proxy',
        target='lmdeploy.serve.proxy.proxy',
        summary='Proxy DistServe chat/completions migrate, shelve and release by cache_session_id only',
    ),
    PatchSpec(
        name='proxy_shelf',
        module='lmdeploy_pdfix.patches.proxy_conn',
        target='lmdeploy.pytorch.disagg.conn.proxy_conn',
        summary='Unshelving a Prefill session that is not on the shelf is a no-op instead of a KeyError',
    ),
    PatchSpec(
        name='prefill_chunking',
        module='lmdeploy_pdfix.patches.inputs_maker',
        target='lmdeploy.pytorch.engine.inputs_maker',
        summary='Prefill role advances the long-context chunk position, so long prompts finish',
    ),
)

BY_NAME: dict[str, PatchSpec] = {spec.name: spec for spec in PATCHES}

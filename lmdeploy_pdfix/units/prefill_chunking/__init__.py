"""Prefill nodes advance the long-context chunk position (defect D3).

``InputsMakerAsync.update_running_seqs`` returns early on the Prefill role before it steps the
``LongContextChunker``, so a prompt longer than ``max_prefill_token_num`` repeats its first chunk forever.
The wrapper steps the chunker on the Prefill role and leaves every other case to LMDeploy.
"""

from __future__ import annotations

from types import ModuleType

from lmdeploy_pdfix.domain.chunking import prefill_chunk_must_advance
from lmdeploy_pdfix.patching import Patch, first_problem, signature_problem


def _stepping_prefill_chunks(original, prefill_role):
    def update_running_seqs(self, running, inputs):
        if prefill_chunk_must_advance(is_prefill_role=self.config.role == prefill_role,
                                      chunker_active=self.long_context_chunker.enabled(),
                                      forward_was_chunk=inputs is not None and bool(inputs.is_chunk)):
            self.long_context_chunker.update_step(inputs)
            return None
        return original(self, running, inputs)

    return update_running_seqs


class PrefillChunkingPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.inputs_maker:InputsMakerAsync.update_running_seqs',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        maker = getattr(module, 'InputsMakerAsync', None)
        chunker = getattr(module, 'LongContextChunker', None)
        if maker is None or chunker is None:
            return 'InputsMakerAsync or LongContextChunker is missing'
        role = getattr(module, 'EngineRole', None)
        if getattr(role, 'Prefill', None) is None:
            return 'EngineRole.Prefill is missing'
        return first_problem(
            signature_problem(maker, 'update_running_seqs', ['self', 'running', 'inputs']),
            signature_problem(chunker, 'update_step', ['self', 'inputs']),
            signature_problem(chunker, 'enabled', ['self']),
        )

    def _apply(self, module: ModuleType) -> None:
        prefill_role = module.EngineRole.Prefill
        self.wrap(module.InputsMakerAsync, 'update_running_seqs',
                        lambda original: _stepping_prefill_chunks(original, prefill_role))


PATCH = PrefillChunkingPatch()

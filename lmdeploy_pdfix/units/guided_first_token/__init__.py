"""The grammar of a migrated request accepts its first token before the Decode samples (D25, issue 27).

The Prefill's sampler chose the first token under the request's grammar (``response_format``, a required tool
call); the Decode's matcher, created at its first step, has not seen it and forces it again (a JSON answer that
begins ``{{``). The ``decode_first_token`` unit names a migrated sequence's first token in its sampling context;
here, where LMDeploy creates the matcher for such a sequence (``GuidedDecodingManager.get_processors``, in the
process that samples: the engine's, or a worker's), the matcher accepts that token first.
"""

from __future__ import annotations

from types import ModuleType

from lmdeploy_pdfix.domain.protocol import MIGRATED_FIRST_TOKEN_KEY
from lmdeploy_pdfix.patching import Patch, attribute_problem, first_problem, signature_problem


def _grammar_from_first_token(original):
    def get_processors(self, session_ctx, response_formats):
        new = [index for index, context in enumerate(session_ctx)
               if MIGRATED_FIRST_TOKEN_KEY in context
               and context['seq_id'] not in self.processors.get(context['session_id'], {})]
        processors = original(self, session_ctx, response_formats)
        for index in new:
            processor = processors.get(index)
            if processor is not None:
                self.accept_token(processor, int(session_ctx[index][MIGRATED_FIRST_TOKEN_KEY]))
        return processors

    return get_processors


class GuidedFirstTokenPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.guided_process:GuidedDecodingManager.get_processors',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        manager = getattr(module, 'GuidedDecodingManager', None)
        if manager is None:
            return 'GuidedDecodingManager is missing'
        return first_problem(
            attribute_problem(manager, ['processors']),
            signature_problem(manager, 'get_processors', ['self', 'session_ctx', 'response_formats']),
            signature_problem(manager, 'accept_token', ['self', 'processor', 'token']),
        )

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.GuidedDecodingManager, 'get_processors', _grammar_from_first_token)


PATCH = GuidedFirstTokenPatch()

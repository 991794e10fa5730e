"""A Decode node treats the Prefill's first token as the request's first sampled token (D25, issue 27).

LMDeploy's Decode engine emits the migrated first token (``migration_request.remote_token_id``) outside its
sampler and logits processors (``EngineLoop._migration_loop_get_outputs``), as an output that never finishes
the request, then samples its next token as if nothing had been sampled before. So, where a Hybrid node
answers otherwise:

- ``max_tokens: 1`` answers two tokens: the first token never ends a request, whatever its budget. Here a first
  token that exhausts ``max_new_tokens`` (or is one of the request's stop ids) finishes the request at once:
  the Decode stops the sequence before its first step and its output is the final one, so the answer has the
  usage and finish_reason a Hybrid node gives.
- guided decoding (``response_format``, tool calls with ``tool_choice`` required) starts its grammar after the
  first token: a JSON answer begins ``{{``. Here the sampling inputs of a migrated sequence with a grammar name
  its first token in their per-sequence context, which travels from the scheduler to the model agent in
  whichever process samples; the ``guided_first_token`` unit, applied where the agent runs, has the grammar
  matcher accept it before the Decode's first step masks any logits.

Penalties, ``min_new_tokens``, seeded sampling and stop words already count the first token: LMDeploy appends
it to the sequence's generated ids before the Decode's first step.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.domain.protocol import MIGRATED_FIRST_TOKEN_KEY
from lmdeploy_pdfix.patching import Patch, attribute_problem, coroutine_problem, first_problem, signature_problem
from lmdeploy_pdfix.shared.lmdeploy_modules import MESSAGES_MODULE

SAMPLING_MODULE = 'lmdeploy.pytorch.strategies.ar.sampling'


def first_token_ends(msg: Any) -> bool:
    """Whether a migrated sequence's first token, emitted without a Decode step, already ends its request."""
    param = msg.sampling_param
    token = msg.migration_request.remote_token_id
    return param.max_new_tokens - msg.num_new_tokens <= 1 or token in (param.stop_words or ())


class _FinishingOutputs:
    """Stands in for the engine loop's response queue while LMDeploy answers a migration batch: the outputs of
    the sequences whose first token ends them are final, and those sequences stop before any Decode step."""

    def __init__(self, queue: Any, ending: list[Any]) -> None:
        self._queue, self._ending = queue, ending

    def put_nowait(self, outputs: dict[int, Any]) -> None:
        for msg in self._ending:
            out = outputs.get(msg.session_id)
            if out is not None:
                out.finish = True
                msg.state.stop()  # a finished migration would go back to the waiting queue and decode on
        self._queue.put_nowait(outputs)


def _finishing_at_first_token(original):
    async def _migration_loop_get_outputs(self, migration_ready):
        ending = [msg for msg in migration_ready if first_token_ends(msg)]
        if not ending:
            return await original(self, migration_ready)
        queue, self.resp_queue = self.resp_queue, _FinishingOutputs(self.resp_queue, ending)
        try:
            return await original(self, migration_ready)
        finally:
            self.resp_queue = queue

    return _migration_loop_get_outputs


def _naming_first_tokens(original):
    def make_sampling_inputs(self, seqs):
        inputs = original(self, seqs)
        for seq, context in zip(seqs, inputs.session_ctx, strict=True):
            request = seq.migration_request
            if request is not None and not request.is_dummy_prefill and seq.sampling_param.response_format:
                context[MIGRATED_FIRST_TOKEN_KEY] = request.remote_token_id
        return inputs

    return make_sampling_inputs


class DecodeFirstTokenPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.engine_loop:EngineLoop._migration_loop_get_outputs',
        f'{SAMPLING_MODULE}:ARSamplingStrategy.make_sampling_inputs',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        loop = getattr(module, 'EngineLoop', None)
        if loop is None:
            return 'EngineLoop is missing'
        strategy = getattr(importlib.import_module(SAMPLING_MODULE), 'ARSamplingStrategy', None)
        if strategy is None:
            return 'ARSamplingStrategy is missing'
        messages = importlib.import_module(MESSAGES_MODULE)
        return first_problem(
            attribute_problem(loop, ['resp_queue']),
            attribute_problem(messages.SchedulerSequence, ['sampling_param', 'migration_request', 'num_new_tokens',
                                                           'session_id', 'state']),
            attribute_problem(messages.SamplingParam, ['max_new_tokens', 'stop_words', 'response_format']),
            signature_problem(loop, '_migration_loop_get_outputs', ['self', 'migration_ready']),
            coroutine_problem(loop, '_migration_loop_get_outputs'),
            signature_problem(strategy, 'make_sampling_inputs', ['self', 'seqs']),
        )

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.EngineLoop, '_migration_loop_get_outputs', _finishing_at_first_token)
        self.wrap(importlib.import_module(SAMPLING_MODULE).ARSamplingStrategy, 'make_sampling_inputs',
                  _naming_first_tokens)


PATCH = DecodeFirstTokenPatch()

"""A Decode node checks every ``migration_request`` before LMDeploy acts on it (defects D5, D19; #4965).

LMDeploy's chat and completions endpoints migrate whatever block ids a ``migration_request`` names, from
whichever Prefill node it names: a malformed request crashes the engine, and a stale or forged one copies
blocks that belong to another request, which then decodes a wrong text with HTTP 200. With this unit the
endpoint first checks that the request is well formed, comes from a Prefill node this Decode is linked to,
and that the Prefill node confirms the cache (its claim route); a failed check is a 4xx naming the problem.
A request whose Prefill ticket vouches for its owner and blocks (issue 14) goes to the engine at once; the
claim runs meanwhile and the answer waits for it (its refusal stops the request and is the answer).
An answer decoded from a dummy prefill (no KV migrated, D19) is marked ``dummy_prefill``.

The first token's logprobs, which the Prefill's sampler computed, come with that token (the Decode engine emits
it without them), so a client reads the logprobs a Hybrid node gives (D25, issue 27).

The Decode continues exactly the prompt the Prefill computed (D26, issue 27): both nodes render the chat template
and tokenize on their own, and LMDeploy migrates whatever blocks it is given. Where the Prefill names the digest
of its prompt's token ids, the Decode compares it with its own once LMDeploy has tokenized the request
(``AsyncEngine.preprocess``), before the engine allocates anything: a mismatch is a 409 that names the cause
(a chat template or tokenizer skew between the nodes), never an answer continued from another prompt's KV.

The links are noted where LMDeploy makes them (``AsyncEngine.p2p_initialize`` / ``p2p_drop_connect``), and
by the ``link_routes`` unit where it serves those routes itself.
"""

from __future__ import annotations

import contextvars
import importlib
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.domain.protocol import (
    DUMMY_PREFILL_FIELD,
    FirstLogprobs,
    MigrationOrder,
    prompt_digest,
)
from lmdeploy_pdfix.patching import Patch, attribute_problem, coroutine_problem, first_problem, signature_problem
from lmdeploy_pdfix.shared.lmdeploy_modules import ASYNC_ENGINE_MODULE, ENDPOINT_MODULES, ERRORS_MODULE
from lmdeploy_pdfix.shared.node_state import forget_link, record_link
from lmdeploy_pdfix.shared.routes import rewritten_answer, swapping_after_register
from lmdeploy_pdfix.units.decode_migration_checks.checks import answer_once_confirmed, checked_migration

EXCEPTIONS_MODULE = 'lmdeploy.serve.core.exceptions'
PROTOCOL_MODULE = 'lmdeploy.pytorch.disagg.conn.protocol'

# The migration this endpoint call serves, for the checks once LMDeploy has tokenized and generates.
_migration: contextvars.ContextVar[MigrationOrder | None] = contextvars.ContextVar('lmdeploy_pdfix_migration',
                                                                                   default=None)


def _checking_migration(make_error, lmdeploy_parse):
    def make_endpoint(endpoint):
        async def endpoint_checking_migration(*args, **kwargs):
            raw_request = kwargs.get('raw_request')
            if raw_request is None:
                return await endpoint(*args, **kwargs)
            check = await checked_migration(raw_request, make_error, lmdeploy_parse)
            if check.refusal is not None:
                return check.refusal
            token = _migration.set(check.order)
            try:
                if check.confirmation is not None:  # vouched for by its ticket: the claim runs meanwhile
                    return await answer_once_confirmed(endpoint(*args, **kwargs), check.confirmation)
                answer = await endpoint(*args, **kwargs)
            finally:
                _migration.reset(token)
            return rewritten_answer(answer, _with_dummy_mark) if check.dummy else answer

        return endpoint_checking_migration

    return make_endpoint


def _with_dummy_mark(event: dict[str, Any]) -> dict[str, Any]:
    """D19: no KV was migrated, so the text was decoded from uninitialised blocks; say so."""
    return {**event, DUMMY_PREFILL_FIELD: True}


def _migration_checks(server_context: Any):
    make_error = importlib.import_module(ERRORS_MODULE).create_error_response
    model = importlib.import_module(PROTOCOL_MODULE).MigrationRequest
    return _checking_migration(make_error, model.model_validate)


def _checking_prompt(original, request_error, conflict):
    async def preprocess(self, *args, **kwargs):
        prepared = await original(self, *args, **kwargs)
        order = _migration.get()
        expected = None if order is None else order.prompt
        if expected is None or prepared.gen_config.migration_request is None:
            return prepared
        found = prompt_digest(prepared.inputs['input_ids'])
        if found == expected:
            return prepared
        prepared.inputs.clear()
        self.session_mgr.remove(prepared.session)  # as LMDeploy's preprocess does when it refuses a request
        raise request_error(conflict, _skew_message(expected, found))

    return preprocess


def _reporting_first_logprobs(original):
    def generate(self, request, *args, **kwargs):
        outputs = original(self, request, *args, **kwargs)
        order = _migration.get()
        if order is None or order.first_logprobs is None:
            return outputs
        return _with_first_logprobs(outputs, order.first_logprobs)

    return generate


async def _with_first_logprobs(outputs: AsyncIterator[Any], first: FirstLogprobs | None) -> AsyncIterator[Any]:
    """LMDeploy's outputs of a migrated request, the first of them carrying the first token's logprobs.

    The Decode engine emits the Prefill's first token without them, so the logprobs of the request's tokens
    would start at its second token: a client reads them one token off (and LMDeploy's ``return_logprob``
    answer fails looking a token up in the wrong step's logprobs).
    """
    async for output in outputs:
        if first is not None and output.generate_token_len > 0:
            earlier = list(output.logprobs or ())
            if len(earlier) == output.generate_token_len - 1:
                output.logprobs = [first, *earlier]
            first = None
        yield output


def _skew_message(expected: str, found: str) -> str:
    prefill_tokens, decode_tokens = expected.split('-')[0], found.split('-')[0]
    return (f'The Prefill node computed this prompt as {prefill_tokens} tokens, this Decode node renders it as '
            f'{decode_tokens} tokens{" with other token ids" if prefill_tokens == decode_tokens else ""}: the two '
            'nodes render or tokenize prompts differently (another chat template or tokenizer). Serve Prefill and '
            'Decode nodes with the same model, tokenizer and --chat-template.')


def _noting(original, note):
    def p2p_call(self, request):
        result = original(self, request)
        note(request)
        return result

    return p2p_call


class DecodeMigrationChecksPatch(Patch):
    wraps = (
        f'{ASYNC_ENGINE_MODULE}:AsyncEngine.preprocess',
        f'{ASYNC_ENGINE_MODULE}:AsyncEngine.generate',
        f'{ASYNC_ENGINE_MODULE}:AsyncEngine.p2p_initialize',
        f'{ASYNC_ENGINE_MODULE}:AsyncEngine.p2p_drop_connect',
        *(f'{name}:register' for name in ENDPOINT_MODULES),
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        engine = getattr(importlib.import_module(ASYNC_ENGINE_MODULE), 'AsyncEngine', None)
        if engine is None:
            return 'AsyncEngine is missing'
        if not callable(getattr(importlib.import_module(ERRORS_MODULE), 'create_error_response', None)):
            return 'create_error_response is missing'
        exceptions = importlib.import_module(EXCEPTIONS_MODULE)
        if getattr(getattr(exceptions, 'ErrorCode', None), 'REQUEST_CONFLICT', None) is None \
                or not callable(getattr(exceptions, 'RequestError', None)):
            return 'RequestError or ErrorCode.REQUEST_CONFLICT is missing'
        prepared = getattr(importlib.import_module(ASYNC_ENGINE_MODULE), 'PreprocessedRequest', None)
        if prepared is None:
            return 'PreprocessedRequest is missing'
        if not hasattr(getattr(importlib.import_module(PROTOCOL_MODULE), 'MigrationRequest', None), 'model_validate'):
            return 'MigrationRequest (a pydantic model) is missing'
        registers = [signature_problem(importlib.import_module(name), 'register', ['router', 'server_context'])
                     for name in ENDPOINT_MODULES]
        return first_problem(attribute_problem(engine, ['session_mgr']),
                             signature_problem(engine, 'generate', ['self', 'request', 'stream_response']),
                             attribute_problem(prepared, ['session', 'inputs', 'gen_config']),
                             coroutine_problem(engine, 'preprocess'),
                             signature_problem(engine, 'p2p_initialize', ['self', 'init_request']),
                             signature_problem(engine, 'p2p_drop_connect', ['self', 'drop_conn_request']),
                             *registers)

    def _apply(self, module: ModuleType) -> None:
        engine = importlib.import_module(ASYNC_ENGINE_MODULE).AsyncEngine
        exceptions = importlib.import_module(EXCEPTIONS_MODULE)
        self.wrap(engine, 'preprocess', lambda original: _checking_prompt(original, exceptions.RequestError,
                                                                          exceptions.ErrorCode.REQUEST_CONFLICT))
        self.wrap(engine, 'generate', _reporting_first_logprobs)
        self.wrap(engine, 'p2p_initialize', lambda original: _noting(original, record_link))
        self.wrap(engine, 'p2p_drop_connect', lambda original: _noting(original, forget_link))
        for name, path in ENDPOINT_MODULES.items():
            self.wrap(importlib.import_module(name), 'register', swapping_after_register(path, _migration_checks))


PATCH = DecodeMigrationChecksPatch()

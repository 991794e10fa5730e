"""A Decode node checks every ``migration_request`` before LMDeploy acts on it (defects D5, D19; #4965).

LMDeploy's chat and completions endpoints migrate whatever block ids a ``migration_request`` names, from
whichever Prefill node it names: a malformed request crashes the engine, and a stale or forged one copies
blocks that belong to another request, which then decodes a wrong text with HTTP 200. With this unit the
endpoint first checks that the request is well formed, comes from a Prefill node this Decode is linked to,
and that the Prefill node confirms the cache (its claim route); a failed check is a 4xx naming the problem.
A request whose Prefill ticket vouches for its owner and blocks (issue 14) goes to the engine at once; the
claim runs meanwhile and the answer waits for it (its refusal stops the request and is the answer).
An answer decoded from a dummy prefill (no KV migrated, D19) is marked ``dummy_prefill``.

The links are noted where LMDeploy makes them (``AsyncEngine.p2p_initialize`` / ``p2p_drop_connect``), and
by the ``link_routes`` unit where it serves those routes itself.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.patches._node_routes import answer_once_confirmed, checked_migration, forget_link, record_link
from lmdeploy_pdfix.patches._routes import rewritten_answer, swapping_after_register
from lmdeploy_pdfix.patching import Patch, first_problem, signature_problem
from lmdeploy_pdfix.protocol import CHAT_PATH, COMPLETIONS_PATH, DUMMY_PREFILL_FIELD

ENDPOINT_MODULES = {
    'lmdeploy.serve.openai.chat_completions': CHAT_PATH,
    'lmdeploy.serve.openai.endpoints.completions': COMPLETIONS_PATH,
}
ASYNC_ENGINE_MODULE = 'lmdeploy.serve.core.async_engine'
ERRORS_MODULE = 'lmdeploy.serve.openai.errors'
PROTOCOL_MODULE = 'lmdeploy.pytorch.disagg.conn.protocol'


def _checking_migration(make_error, lmdeploy_parse):
    def make_endpoint(endpoint):
        async def endpoint_checking_migration(*args, **kwargs):
            raw_request = kwargs.get('raw_request')
            if raw_request is None:
                return await endpoint(*args, **kwargs)
            check = await checked_migration(raw_request, make_error, lmdeploy_parse)
            if check.refusal is not None:
                return check.refusal
            if check.confirmation is not None:  # vouched for by its ticket: the claim runs meanwhile
                return await answer_once_confirmed(endpoint(*args, **kwargs), check.confirmation)
            answer = await endpoint(*args, **kwargs)
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


def _noting(original, note):
    def p2p_call(self, request):
        result = original(self, request)
        note(request)
        return result

    return p2p_call


class DecodeMigrationChecksPatch(Patch):
    name = 'decode_migration_checks'
    target = 'lmdeploy.serve.openai.api_server'
    wraps = (
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
        if not hasattr(getattr(importlib.import_module(PROTOCOL_MODULE), 'MigrationRequest', None), 'model_validate'):
            return 'MigrationRequest (a pydantic model) is missing'
        registers = [signature_problem(importlib.import_module(name), 'register', ['router', 'server_context'])
                     for name in ENDPOINT_MODULES]
        return first_problem(signature_problem(engine, 'p2p_initialize', ['self', 'init_request']),
                             signature_problem(engine, 'p2p_drop_connect', ['self', 'drop_conn_request']),
                             *registers)

    def _apply(self, module: ModuleType) -> None:
        engine = importlib.import_module(ASYNC_ENGINE_MODULE).AsyncEngine
        self.wrap(engine, 'p2p_initialize', lambda original: _noting(original, record_link))
        self.wrap(engine, 'p2p_drop_connect', lambda original: _noting(original, forget_link))
        for name, path in ENDPOINT_MODULES.items():
            self.wrap(importlib.import_module(name), 'register', swapping_after_register(path, _migration_checks))


PATCH = DecodeMigrationChecksPatch()

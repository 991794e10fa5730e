"""The LMDeploy modules more than one unit reads, each path named once (a unit's own target is in the registry)."""

from __future__ import annotations

from lmdeploy_pdfix.domain.protocol import CHAT_PATH, COMPLETIONS_PATH

API_SERVER_MODULE = 'lmdeploy.serve.openai.api_server'
ASYNC_ENGINE_MODULE = 'lmdeploy.serve.core.async_engine'
DISTSERVE_MODULE = 'lmdeploy.serve.openai.endpoints.distserve'
ENGINE_MODULE = 'lmdeploy.pytorch.engine.engine'
ERRORS_MODULE = 'lmdeploy.serve.openai.errors'
MESSAGES_MODULE = 'lmdeploy.pytorch.messages'
SCHEDULER_MODULE = 'lmdeploy.pytorch.paging.scheduler'
WORKER_MODULE = 'lmdeploy.pytorch.engine.mp_engine.base_worker'  # the engine process's RPC worker
# The modules that register the generation routes, by the route each registers.
ENDPOINT_MODULES = {
    'lmdeploy.serve.openai.chat_completions': CHAT_PATH,
    'lmdeploy.serve.openai.endpoints.completions': COMPLETIONS_PATH,
}

"""The proxy refuses a request its models reject with the 400 a node gives, not FastAPI's 422 (issue 27).

LMDeploy's api_server answers a body that its request models reject (a missing or mistyped field) with a 400
that names the field (``api_server.validation_exception_handler``); its proxy has no such handler, so the same
request answers 422 with FastAPI's error list through the proxy. Here the proxy answers it with the api_server's
own handler. That handler's module is the whole serving stack (about a second and 600 modules to import), so it
is imported at the first such request, not when the proxy starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError

from lmdeploy_pdfix.patching import Patch
from lmdeploy_pdfix.shared.lmdeploy_modules import API_SERVER_MODULE


async def validation_error(request: Any, exc: RequestValidationError) -> Any:
    api_server = importlib.import_module(API_SERVER_MODULE)
    return await api_server.validation_exception_handler(request, exc)


class ProxyValidationPatch(Patch):
    wraps = (
        'lmdeploy.serve.proxy.proxy:app.exception_handlers',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        handlers = getattr(getattr(module, 'app', None), 'exception_handlers', None)
        if not isinstance(handlers, dict):
            return 'the proxy app has no exception handlers'
        if handlers.get(RequestValidationError) is not request_validation_exception_handler:
            return "the proxy app does not answer request validation errors with FastAPI's default handler"
        spec = importlib.util.find_spec(API_SERVER_MODULE)  # found without importing it
        return None if spec is not None else f'{API_SERVER_MODULE} is missing'

    def _apply(self, module: ModuleType) -> None:
        _handle_validation_errors_with(module.app, validation_error)

    def _revert(self, module: ModuleType) -> None:
        _handle_validation_errors_with(module.app, request_validation_exception_handler)


def _handle_validation_errors_with(app: Any, handler: Any) -> None:
    app.exception_handlers[RequestValidationError] = handler
    app.middleware_stack = None  # Starlette reads the handlers when it builds the stack: at its next request


PATCH = ProxyValidationPatch()

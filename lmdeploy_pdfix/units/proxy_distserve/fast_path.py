"""The DistServe relay routes served straight from ASGI (issue 31).

FastAPI's route machinery cost the proxy more CPU per request than the relay itself: LMDeploy's
``validate_json_request`` is a plain function, so FastAPI runs it in a worker thread for every request (a thread
hop each way), and four middlewares wrap every call. This middleware sits inside the operator's (``--api-keys``
is checked before it) and serves a well-formed JSON request to the relay's own endpoint directly. Anything else
(another route, a body that does not parse or validate, a browser's CORS request) goes down LMDeploy's stack as it
came, so its answer is the one FastAPI gives.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Endpoint = Callable[[BaseModel, Request], Awaitable[Any]]


class DistServeFastPath:
    """ASGI middleware: ``routes`` maps a POST path to the request model its body must validate as, and the
    endpoint that answers it; ``serves()`` says whether the proxy relays DistServe at all right now."""

    def __init__(self, app: ASGIApp, routes: dict[str, tuple[type[BaseModel], Endpoint]],
                 serves: Callable[[], bool]) -> None:
        self.app = app
        self.routes = routes
        self.serves = serves

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope['path']) if scope['type'] == 'http' and scope['method'] == 'POST' else None
        if route is None or not _plain_json(scope['headers']) or not self.serves():
            await self.app(scope, receive, send)
            return
        body = await _body(receive)
        replay = _replaying(body, receive)
        request = _validated(route[0], body)
        if request is None:  # FastAPI answers it, with its own 422
            await self.app(scope, replay, send)
            return
        answer = await route[1](request, Request(scope, replay))
        if not isinstance(answer, Response):
            answer = JSONResponse(jsonable_encoder(answer))
        await answer(scope, replay, send)


def _plain_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """A JSON body (as LMDeploy's ``validate_json_request`` requires), and no Origin for CORS to answer."""
    content_type = b''
    for name, value in headers:
        if name == b'origin':
            return False
        if name == b'content-type':
            content_type = value
    return content_type.split(b';', 1)[0].strip().lower() == b'application/json'


async def _body(receive: Receive) -> bytes:
    message = await receive()
    body = message.get('body', b'')
    while message.get('more_body'):
        message = await receive()
        body += message.get('body', b'')
    return body


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then what the client sends next (its disconnect)."""
    pending: list[Message] = [{'type': 'http.request', 'body': body, 'more_body': False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _validated(model: type[BaseModel], body: bytes) -> BaseModel | None:
    """``body`` as ``model``, parsed as FastAPI does (JSON, then the model's Python validation); None if it is not."""
    try:
        return model.model_validate(json.loads(body))
    except (ValueError, ValidationError):
        return None

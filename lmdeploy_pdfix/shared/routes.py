"""Swapping the endpoint of one FastAPI route, keeping its path, methods and dependencies; rewriting an
endpoint's answer, whole or streamed."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute

from lmdeploy_pdfix.domain.protocol import sse_chunk_rewritten
from lmdeploy_pdfix.patching import register_wrapper


def find_post_route(routes: list[Any], path: str) -> APIRoute | None:
    return next((route for route in routes
                 if isinstance(route, APIRoute) and route.path == path and 'POST' in route.methods), None)


def swap_endpoint(routes: list[Any], path: str, make_endpoint: Callable[[Any], Any]) -> APIRoute:
    """Replace the POST route at ``path`` by one serving ``make_endpoint(original_endpoint)``.

    Returns the original route, which :func:`restore_route` puts back.
    """
    route = find_post_route(routes, path)
    if route is None:
        raise LookupError(f'no POST route {path}')
    endpoint = register_wrapper(functools.update_wrapper(make_endpoint(route.endpoint), route.endpoint), route.endpoint)
    replacement = APIRoute(
        route.path,
        endpoint,
        methods=sorted(route.methods),
        dependencies=list(route.dependencies),
        name=route.name,
        tags=route.tags,
        summary=route.summary,
        description=route.description,
        include_in_schema=route.include_in_schema,
        response_class=route.response_class,
        dependency_overrides_provider=route.dependency_overrides_provider,
    )
    routes[routes.index(route)] = replacement
    return route


def swapping_after_register(path: str, endpoint_for: Callable[[Any], Callable[[Any], Any]]):
    """A wrapper maker for a module's ``register(router, server_context)``: once LMDeploy registered its routes,
    the POST route at ``path`` serves ``endpoint_for(server_context)(LMDeploy's endpoint)``."""
    def make_register(original):
        def register(router, server_context):
            original(router, server_context)
            swap_endpoint(router.routes, path, endpoint_for(server_context))

        return register

    return make_register


def restore_route(routes: list[Any], original: APIRoute) -> None:
    """Put ``original`` back in place of the route :func:`swap_endpoint` made from it."""
    for index, route in enumerate(routes):
        if isinstance(route, APIRoute) and getattr(route.endpoint, '__wrapped__', None) is original.endpoint:
            routes[index] = original
            return


def rewritten_answer(response: Any, rewrite_event: Callable[[dict[str, Any]], dict[str, Any]],
                     rewrite_chunk: Callable[[Any], Any] | None = None) -> Any:
    """An endpoint's answer with its JSON body, or every event it streams, passed through ``rewrite_event``.

    ``rewrite_chunk`` stands in for the per-chunk rewrite where a cheaper one knows which chunks to touch.
    """
    if isinstance(response, dict):
        return rewrite_event(response)
    if isinstance(response, StreamingResponse):
        chunk = rewrite_chunk or (lambda chunk: sse_chunk_rewritten(chunk, rewrite_event))
        response.body_iterator = each_transformed(response.body_iterator, chunk)
    return response


async def each_transformed(items: AsyncIterator[Any], transform: Callable[[Any], Any]) -> AsyncIterator[Any]:
    """``items`` through ``transform``; closing this closes ``items`` too (LMDeploy's cleanup relies on it)."""
    try:
        async for item in items:
            yield transform(item)
    finally:
        close = getattr(items, 'aclose', None)
        if close is not None:
            await close()

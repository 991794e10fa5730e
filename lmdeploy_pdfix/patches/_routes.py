"""Swapping the endpoint of one FastAPI route, keeping its path, methods and dependencies."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute

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


def restore_route(routes: list[Any], original: APIRoute) -> None:
    """Put ``original`` back in place of the route :func:`swap_endpoint` made from it."""
    for index, route in enumerate(routes):
        if isinstance(route, APIRoute) and getattr(route.endpoint, '__wrapped__', None) is original.endpoint:
            routes[index] = original
            return

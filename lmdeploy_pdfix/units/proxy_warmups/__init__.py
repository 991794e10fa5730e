"""Warmup storms: the proxy runs one connection warmup at a time and bounds who waits for it (#4972, issue 12).

``POST /distserve/connection_warmup`` connects every Prefill/Decode pair; each call starts its own round of
connects for every pair, and callers pile up with their waiting tasks while a slow or stuck node holds the
handshakes (upstream PR #4980). Calls that come while a warmup runs now share it (LMDeploy's own route runs
once per round), at most ``LMDEPLOY_PDFIX_MAX_LINK_WAITERS`` callers wait for it, and one more is answered 503
at once. A round that failed (a node down) answers 502 with the reason instead of LMDeploy's 500. A warmup
that began before a node registered does not link that node; its first request does.
"""

from __future__ import annotations

from http import HTTPStatus
from types import ModuleType
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.shared_runs import SharedRuns, TooManyWaiting
from lmdeploy_pdfix.patching import Patch, first_problem, signature_problem, warn
from lmdeploy_pdfix.shared.routes import find_post_route, restore_route, swap_endpoint

WARMUP_PATH = '/distserve/connection_warmup'
_ROUND = 'warmup'
ERROR_PARAMETERS = ['status', 'message', 'error_type', 'error_code', 'param']


def _sharing_warmups(module: ModuleType, rounds: SharedRuns):
    def make_endpoint(original):
        async def connection_warmup():
            try:
                return await rounds.join(_ROUND, original)
            except TooManyWaiting as exc:
                return module.create_error_response(HTTPStatus.SERVICE_UNAVAILABLE, f'connection warmup: {exc}')
            except Exception as exc:
                warn(f'a connection warmup failed: {exc!r}')
                return module.create_error_response(HTTPStatus.BAD_GATEWAY, f'connection warmup failed: {exc!r}')

        return connection_warmup

    return make_endpoint


class ProxyWarmupsPatch(Patch):
    wraps = (
        'lmdeploy.serve.proxy.proxy:app.router.routes',
    )

    def __init__(self) -> None:
        super().__init__()
        self._original: Any = None
        self.rounds = SharedRuns(settings.MAX_LINK_WAITERS.value(), 'the connection warmup under way')

    def shape_problem(self, module: ModuleType) -> str | None:
        if not hasattr(module, 'app'):
            return 'app is missing'
        route = find_post_route(module.app.router.routes, WARMUP_PATH)
        if route is None:
            return f'the proxy app does not serve POST {WARMUP_PATH}'
        return first_problem(
            signature_problem(module, 'create_error_response', ERROR_PARAMETERS),
            signature_problem(route, 'endpoint', []),  # ours takes nothing: LMDeploy's must not either
        )

    def _apply(self, module: ModuleType) -> None:
        if self._original is None:
            self._original = swap_endpoint(module.app.router.routes, WARMUP_PATH, _sharing_warmups(module, self.rounds))

    def _revert(self, module: ModuleType) -> None:
        if self._original is not None:
            restore_route(module.app.router.routes, self._original)
            self._original = None


PATCH = ProxyWarmupsPatch()

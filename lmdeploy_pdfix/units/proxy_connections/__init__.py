"""The proxy's Prefill/Decode connection pool: a safe shelf (D12), a connect that cannot hang (D16), one
handshake per link at a time (#4972).

``PDConnectionPool.unshelf_prefill_session`` does ``set.remove``; when two requests shared a shelf key, or a
key was never shelved, the second removal raises ``KeyError`` after the Decode already answered, turning a
finished request into HTTP 500.

``PDConnectionPool.connect`` waits for an event that nobody sets when the link turns Connected between its
``is_connected()`` check and the connection worker taking the request: that request hangs forever. The
wrapper also watches the link itself, and gives up after ``LMDEPLOY_PDFIX_CONNECT_TIMEOUT_S``.

Every ``connect`` of a link also queues its own request and, while a handshake is under way, gets its own
waiting task (upstream #4972): repeated ``/distserve/connection_warmup`` calls against slow or stuck nodes
pile them up until the proxy is OOM-killed. After a failed handshake those waiters wait on the spent event
of the first attempt, spin through their retries and fail while the link comes up. Concurrent connects of
one link now share one attempt; a link already up still costs no request to the nodes; and at most
``LMDEPLOY_PDFIX_MAX_LINK_WAITERS`` callers wait for link set-ups at once, a caller beyond that being refused
at once (its request answers 503) rather than piling up.

A link is set up only between nodes that proved they hold the node key, where there is one: its set-up calls
carry the key.

``PDConnectionPool.drop`` (a Decode removed or re-registering) frees every session shelved on the link, some
of which may still be migrating (D14); it no longer frees them: their relays and the proxy's gc do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.shared_runs import SharedRuns
from lmdeploy_pdfix.patching import Patch, first_problem, signature_problem
from lmdeploy_pdfix.shared.node_client import node_credentials_for


def _tolerating_absent_session(original):
    def unshelf_prefill_session(self, conn_key, session_id):
        with contextlib.suppress(KeyError):  # already unshelved: the shelf is a record, not a claim
            original(self, conn_key, session_id)

    return unshelf_prefill_session


CONNECT_POLL_S = 0.05
CONNECT_TIMEOUT_S = settings.CONNECT_TIMEOUT_S.value()


async def _watched_connect(original: Callable, pool: Any, conn_req: Any) -> None:
    # the session's key goes to both nodes of every link: only to nodes that proved they hold it
    credentials = {**await node_credentials_for(conn_req.p_url), **await node_credentials_for(conn_req.d_url)}
    attempt = asyncio.ensure_future(original(pool, conn_req))
    deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
    try:
        await asyncio.sleep(0)  # the attempt sets the pool up (its session) before its worker sends anything
        _authenticate(pool, credentials)
        while not attempt.done():
            await asyncio.wait({attempt}, timeout=CONNECT_POLL_S)
            if not attempt.done() and pool.is_connected(conn_req.p_url, conn_req.d_url):
                return None  # connected, though nobody told this attempt
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f'PD connection {conn_req.p_url} -> {conn_req.d_url} not up after '
                                   f'{CONNECT_TIMEOUT_S:.0f} s')
        return attempt.result()
    finally:
        attempt.cancel()


def _authenticate(pool: Any, credentials: dict[str, str]) -> None:
    """The link set-up calls (engine_info, p2p_initialize, p2p_connect) carry the operator's node key: LMDeploy
    sends none, so a cluster with --api-keys could not link at all."""
    session = getattr(pool, 'conn_sess', None)
    if session is not None:
        session.headers.update(credentials)


ATTEMPTS = '_pdfix_connect_attempts'  # a pool's attribute: the link set-ups under way, and who waits for them
MAX_LINK_WAITERS = settings.MAX_LINK_WAITERS.value()


def link_attempts(pool: Any) -> SharedRuns:
    attempts = pool.__dict__.get(ATTEMPTS)
    if attempts is None:
        attempts = pool.__dict__[ATTEMPTS] = SharedRuns(MAX_LINK_WAITERS, 'Prefill/Decode link set-ups')
    return attempts


def _one_attempt_per_link(original):
    async def connect(self, conn_req):
        if self.is_connected(conn_req.p_url, conn_req.d_url):
            return None
        # joiners' requests differ in nothing: the proxy sends its own protocol and RDMA config
        return await link_attempts(self).join((conn_req.p_url, conn_req.d_url),
                                              lambda: _watched_connect(original, self, conn_req))

    return connect


def _dropping_without_freeing_in_flight(original):
    def drop(self, pd_key):
        # LMDeploy frees every session shelved on the link (D14), though a restarted Decode on the same URL may
        # still be migrating them: freed blocks can be reused while it copies them. Each
        # request's own relay releases its cache when its Decode fails, and gc collects what it cannot.
        shelved = self.migration_session_shelf.pop(pd_key, None)
        try:
            original(self, pd_key)
        finally:
            if shelved:
                self.migration_session_shelf[pd_key] |= shelved

    return drop


def _dropping_prefill_links(original):
    def dereg_instance(self, endpoint):
        # LMDeploy drops the links of a Decode that leaves or re-registers, never a Prefill's (D14): a Prefill
        # restarted on the same URL kept its stale link, and every migration from it failed.
        if endpoint in self.prefill_endpoints:
            for pd_key in [key for key in self.pool if key[0] == endpoint]:
                self.drop(pd_key)
        original(self, endpoint)

    return dereg_instance


class ProxyConnectionsPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.disagg.conn.proxy_conn:PDConnectionPool.unshelf_prefill_session',
        'lmdeploy.pytorch.disagg.conn.proxy_conn:PDConnectionPool.connect',
        'lmdeploy.pytorch.disagg.conn.proxy_conn:PDConnectionPool.drop',
        'lmdeploy.pytorch.disagg.conn.proxy_conn:PDConnectionPool.dereg_instance',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        pool = getattr(module, 'PDConnectionPool', None)
        if pool is None:
            return 'PDConnectionPool is missing'
        return first_problem(
            signature_problem(pool, 'shelf_prefill_session', ['self', 'conn_key', 'session_id']),
            signature_problem(pool, 'unshelf_prefill_session', ['self', 'conn_key', 'session_id']),
            signature_problem(pool, 'connect', ['self', 'conn_req']),
            signature_problem(pool, 'is_connected', ['self', 'p_url', 'd_url']),
            signature_problem(pool, 'drop', ['self', 'pd_key']),
            signature_problem(pool, 'dereg_instance', ['self', 'endpoint']),
        )

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.PDConnectionPool, 'unshelf_prefill_session', _tolerating_absent_session)
        self.wrap(module.PDConnectionPool, 'connect', _one_attempt_per_link)
        self.wrap(module.PDConnectionPool, 'drop', _dropping_without_freeing_in_flight)
        self.wrap(module.PDConnectionPool, 'dereg_instance', _dropping_prefill_links)


PATCH = ProxyConnectionsPatch()

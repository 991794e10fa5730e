"""One pooled, keep-alive HTTP client per event loop for every call pdfix makes to a node.

A session per call costs a TCP connection (and its teardown) per call, several per request; a pooled one
reuses them. Timeouts are given per call. Connections idle for ``LMDEPLOY_PDFIX_KEEPALIVE_S`` are closed by
us, before uvicorn's own 5 s keep-alive closes them under a call in flight.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
import weakref
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.protocol import (
    FREE_PATH,
    NODE_PROOF_PATH,
    bearer,
    credentials_hint,
    parse_json,
    parse_proof,
    proves_key,
)
from lmdeploy_pdfix.patching import warn

RELEASE_TIMEOUT_S = 10.0
PROOF_TIMEOUT_S = 5.0
PROOF_TTL_S = {True: 300.0, False: 5.0}  # a node that failed is asked again soon: it may be starting
MAX_PROOF_ANSWER_BYTES = 4096
CONNECTION_LIMIT = 512  # per client: far above what one proxy or Decode keeps in flight to its peers

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = weakref.WeakKeyDictionary()


def node_client() -> aiohttp.ClientSession:
    """This event loop's pooled client (made on first use, and again after it was closed)."""
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.closed:
        keepalive_s = settings.KEEPALIVE_S.value()
        connector = aiohttp.TCPConnector(limit=CONNECTION_LIMIT, force_close=not keepalive_s,
                                         keepalive_timeout=keepalive_s or None)
        client = _CLIENTS[loop] = aiohttp.ClientSession(connector=connector, trace_configs=[_noting_reuse()])
    return client


def _noting_reuse() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()

    async def reused(_session: Any, context: Any, _params: Any) -> None:
        if isinstance(context.trace_request_ctx, _Attempt):
            context.trace_request_ctx.reused = True

    trace.on_connection_reuseconn.append(reused)
    return trace


class _Attempt:
    __slots__ = ('reused',)

    def __init__(self) -> None:
        self.reused = False  # sent on a pooled connection


async def node_post(url: str, **kwargs: Any) -> aiohttp.ClientResponse:
    """A POST to a node (use it as ``async with await node_post(...) as response``), sent once more on a new
    connection when the pooled one it went out on turns out closed by the node.

    A node closes an idle connection when its keep-alive runs out (uvicorn's 5 s); a POST sent on it just then
    meets a reset, though the node never read it (RFC 9112 9.3.1.1: aiohttp retries only idempotent methods).
    Under load the proxy's loop can lag the node by the second between our keep-alive and its.
    """
    attempt = _Attempt()
    try:
        return await node_client().post(url, trace_request_ctx=attempt, **kwargs)
    except aiohttp.ClientConnectorError:
        raise  # no connection at all: nothing was pooled
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        if not attempt.reused:
            raise
    return await node_client().post(url, **kwargs)


def not_pooled_after_an_error(response: aiohttp.ClientResponse) -> None:
    """Close ``response``'s connection once its body is read if it answered a 5xx, instead of pooling it:
    uvicorn closes a connection once an unhandled error has answered on it, under the next call. Call it before
    reading the body, as aiohttp pools a connection as soon as its body ends."""
    protocol = getattr(response.connection, 'protocol', None)
    if response.status >= HTTPStatus.INTERNAL_SERVER_ERROR and protocol is not None:
        protocol.force_close()


async def close_node_client() -> None:
    """Close this event loop's client, if it has one (the proxy's shutdown)."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


class UnprovenNodeError(Exception):
    """The node has not proven it holds the node key, so no call carries the key to it."""


class _Proofs:
    """Which nodes proved they hold the node key, asked once per node and again after a while."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[bool, float]] = {}
        self._asking: dict[str, asyncio.Future] = {}

    async def proven(self, url: str, key: str) -> bool:
        known = self._known.get(url)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        asking = self._asking.get(url)
        if asking is None:  # concurrent calls to one node share one challenge
            asking = self._asking[url] = asyncio.ensure_future(self._ask(url, key))
            asking.add_done_callback(lambda _: self._asking.pop(url, None))
        return await asyncio.shield(asking)

    async def _ask(self, url: str, key: str) -> bool:
        nonce = secrets.token_hex(16)
        try:
            resolved = await _resolved(url)
            async with await node_post(url + NODE_PROOF_PATH, json={'nonce': nonce},
                                       timeout=aiohttp.ClientTimeout(total=PROOF_TIMEOUT_S)) as response:
                proof = parse_proof(parse_json(await response.content.read(MAX_PROOF_ANSWER_BYTES)))
            proven = proves_key(proof, key, nonce, url, resolved)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            proven = False
        self._known[url] = (proven, time.monotonic() + PROOF_TTL_S[proven])
        return proven


async def _resolved(url: str) -> list[str]:
    """The IP addresses the host of ``url`` resolves to."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError('no host')
    infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


_PROOFS = _Proofs()


async def node_credentials_for(url: str) -> dict[str, str]:
    """The headers that carry the node key on a call to the node at ``url`` (none without a key); raise
    :class:`UnprovenNodeError` unless that node proved it holds the same key: a node anyone registered, or a URL
    that merely relays to a real node, never receives it."""
    key = settings.NODE_API_KEY.value()
    if key is None:
        return {}
    if not await _PROOFS.proven(url, key):
        raise UnprovenNodeError(f'the node at {url} has not proven it holds {settings.NODE_API_KEY.name} (set the '
                                f'same key on every node; behind NAT also {settings.NODE_ADDRESS.name})')
    return bearer(key)


async def free_prefill_session(p_url: str, owner: int, reason: str) -> bool:
    """Ask the Prefill node to end the session holding ``owner``'s cache; True once it answered 200."""
    from lmdeploy.pytorch.disagg.conn.protocol import DistServeCacheFreeRequest

    free = DistServeCacheFreeRequest(remote_engine_id=p_url, remote_session_id=owner)
    try:
        async with await node_post(f'{p_url}{FREE_PATH}', json=free.model_dump(mode='json'),
                                   headers=await node_credentials_for(p_url),
                                   timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)) as response:
            await response.read()
            if response.status == HTTPStatus.OK:
                return True
            problem = f'HTTP {response.status}{credentials_hint(response.status)}'
    except (aiohttp.ClientError, asyncio.TimeoutError, UnprovenNodeError) as exc:
        problem = repr(exc)
    warn(f'releasing Prefill session {owner} on {p_url} ({reason}) failed: {problem}')
    return False

"""One pooled, keep-alive HTTP client per event loop for every call pdfix makes to a node.

A session per call costs a TCP connection (and its teardown) per call, several per request; a pooled one
reuses them. Timeouts are given per call. Connections idle for ``LMDEPLOY_PDFIX_KEEPALIVE_S`` are closed by
us, before uvicorn's own 5 s keep-alive closes them under a call in flight.
"""

from __future__ import annotations

import asyncio
import weakref
from http import HTTPStatus

import aiohttp

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.patching import warn
from lmdeploy_pdfix.protocol import FREE_PATH, credentials_hint, node_credentials

RELEASE_TIMEOUT_S = 10.0
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
        client = _CLIENTS[loop] = aiohttp.ClientSession(connector=connector)
    return client


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


async def free_prefill_session(p_url: str, owner: int, reason: str) -> bool:
    """Ask the Prefill node to end the session holding ``owner``'s cache; True once it answered 200."""
    from lmdeploy.pytorch.disagg.conn.protocol import DistServeCacheFreeRequest

    free = DistServeCacheFreeRequest(remote_engine_id=p_url, remote_session_id=owner)
    try:
        async with node_client().post(f'{p_url}{FREE_PATH}', json=free.model_dump(mode='json'),
                                      headers=node_credentials(),
                                      timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)) as response:
            await response.read()
            if response.status == HTTPStatus.OK:
                return True
            problem = f'HTTP {response.status}{credentials_hint(response.status)}'
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        problem = repr(exc)
    warn(f'releasing Prefill session {owner} on {p_url} ({reason}) failed: {problem}')
    return False

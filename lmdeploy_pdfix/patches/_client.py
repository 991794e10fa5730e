"""One pooled, keep-alive HTTP client per event loop for every call pdfix makes to a node.

A session per call costs a TCP connection (and its teardown) per call, several per request; a pooled one
reuses them. Timeouts are given per call. Connections idle for ``LMDEPLOY_PDFIX_KEEPALIVE_S`` are closed by
us, before uvicorn's own 5 s keep-alive closes them under a call in flight.
"""

from __future__ import annotations

import asyncio
import weakref

import aiohttp

from lmdeploy_pdfix import settings

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


async def close_node_client() -> None:
    """Close this event loop's client, if it has one (the proxy's shutdown)."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()

"""Every call pdfix makes to a node goes over one pooled client; a pooled connection the node has just closed
costs a POST nothing (a node closes an idle one when its keep-alive runs out, and may do so as we send on it)."""

from __future__ import annotations

import asyncio
import re
import socket
import struct

import aiohttp

from lmdeploy_pdfix.shared.node_client import close_node_client, node_post


class ClosingUnderTheNextRequest:
    """A raw HTTP server that answers the first request of each connection (or none) and closes the connection
    under the next one: the node's keep-alive ran out just as that request was sent."""

    def __init__(self, answers_per_connection: int = 1) -> None:
        self.answers_per_connection = answers_per_connection
        self.answered = 0
        self.received = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served_here = 0
        while True:
            try:
                head = await reader.readuntil(b'\r\n\r\n')
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = re.search(rb'content-length: *(\d+)', head, re.IGNORECASE)
            await reader.readexactly(int(length[1]) if length else 0)
            self.received += 1
            if served_here == self.answers_per_connection:  # a reset, as a socket closed under an unread request
                writer.get_extra_info('socket').setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
                break
            served_here += 1
            self.answered += 1
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}')
            await writer.drain()
        writer.close()


async def posted(node: ClosingUnderTheNextRequest, times: int) -> list[int | str]:
    """The status of each of ``times`` POSTs to ``node`` in turn, or the name of the error it raised."""
    server = await asyncio.start_server(node.handle, '127.0.0.1', 0)
    url = f'http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions'
    outcomes: list[int | str] = []
    try:
        for _ in range(times):
            try:
                async with await node_post(url, json={}) as response:
                    await response.read()
                    outcomes.append(response.status)
            except aiohttp.ClientError as error:
                outcomes.append(type(error).__name__)
    finally:
        await close_node_client()
        server.close()
        await server.wait_closed()
    return outcomes


async def test_a_post_on_a_pooled_connection_the_node_closed_is_sent_again_on_a_new_one() -> None:
    # under load the proxy's loop lagged its node by more than the second between their keep-alives: the relay
    # answered 502 "Connection reset by peer" for a Decode that never read the request
    node = ClosingUnderTheNextRequest()
    assert await posted(node, 3) == [200, 200, 200] and node.answered == 3


async def test_a_post_a_node_resets_on_a_new_connection_is_sent_once() -> None:
    node = ClosingUnderTheNextRequest(answers_per_connection=0)  # nothing was pooled: the node may have read it
    assert await posted(node, 1) == ['ClientOSError'] and node.received == 1

"""Serving a real FastAPI app over HTTP on 127.0.0.1 from a background thread, for in-process tests."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from lmdeploy_pdfix.shared.node_client import close_node_client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@contextmanager
def serving(app, timeout_s: float = 20.0) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning', lifespan='off'))

    async def serve() -> None:
        try:
            await server.serve()
        finally:
            await close_node_client()  # lifespan is off, so the proxy's shutdown hook that closes it never runs

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name=f'uvicorn-{port}', daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f'server on port {port} did not start')
        time.sleep(0.01)
    try:
        yield f'http://127.0.0.1:{port}'
    finally:
        server.should_exit = True
        thread.join(timeout_s)

"""The proxy's real Prefill/Decode connection pool."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.regression
async def test_connect_returns_when_the_link_comes_up_between_check_and_worker(apply_patch) -> None:
    conn = apply_patch('proxy_connections')
    from lmdeploy.pytorch.disagg.messages import PDConnectionMessage

    pool = conn.PDConnectionPool()
    link = ('http://127.0.0.1:1', 'http://127.0.0.1:2')
    pool.pool[link] = conn.PDConnectionState(conn.PDConnectionStatus.Connected, asyncio.Event())
    real_is_connected = pool.is_connected
    first_look = [True]

    def is_connected(p_url: str, d_url: str) -> bool:
        # The link turns Connected just after connect() looked: its first look says "not yet".
        if first_look:
            first_look.pop()
            return False
        return real_is_connected(p_url, d_url)

    pool.is_connected = is_connected
    try:
        await asyncio.wait_for(pool.connect(PDConnectionMessage(p_url=link[0], d_url=link[1])), timeout=5)
    finally:
        await pool.conn_sess.close()


@pytest.mark.regression
def test_unshelving_a_session_twice_is_harmless(apply_patch) -> None:
    conn = apply_patch('proxy_connections')
    pool = conn.PDConnectionPool()
    pool.shelf_prefill_session(('p', 'd'), 7)
    pool.unshelf_prefill_session(('p', 'd'), 7)
    pool.unshelf_prefill_session(('p', 'd'), 7)
    assert pool.migration_session_shelf[('p', 'd')] == set()


@pytest.mark.regression
def test_dropping_a_link_frees_no_session_that_may_still_be_migrating(apply_patch) -> None:
    from tests.servers import serving
    from tests.stand_in_nodes import PrefillBook, prefill_app

    conn = apply_patch('proxy_connections')
    prefill = PrefillBook(retained={7})
    with serving(prefill_app(prefill)) as p_url:
        pool = conn.PDConnectionPool()
        pool.shelf_prefill_session((p_url, 'http://127.0.0.1:1'), 7)
        pool.drop((p_url, 'http://127.0.0.1:1'))  # a Decode re-registering on the same URL
    assert prefill.retained == {7} and prefill.freed == []

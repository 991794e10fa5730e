"""The proxy's real Prefill/Decode connection pool."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

WARMUPS = 30
HANDSHAKE = '/distserve/p2p_initialize'


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


class NodeLog:
    """What a stand-in node was asked; it can hold every request (a slow or stuck node) or fail them."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        self.open = threading.Event()
        self.open.set()
        self.failing = False

    def watch(self, app: FastAPI) -> FastAPI:
        @app.middleware('http')
        async def record(request: Request, call_next):
            self.asked[request.url.path] += 1
            while not self.open.is_set():
                await asyncio.sleep(0.01)
            if self.failing:
                return JSONResponse({'error': 'engine not ready'}, status_code=503)
            return await call_next(request)

        return app

    async def until_asked(self, path: str, times: int = 1) -> None:
        for _ in range(500):
            if self.asked[path] >= times:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f'{path} was asked {self.asked[path]} times, expected {times}')


@contextmanager
def linked_nodes(prefill: NodeLog, decode: NodeLog) -> Iterator[tuple[str, str]]:
    from tests.servers import serving
    from tests.stand_in_nodes import DecodeBook, PrefillBook, decode_app, prefill_app

    with serving(prefill.watch(prefill_app(PrefillBook()))) as p_url, \
            serving(decode.watch(decode_app(DecodeBook(), PrefillBook()))) as d_url:
        try:
            yield p_url, d_url
        finally:
            prefill.open.set()  # a held request would hold up the server's shutdown


def warmups(pool: Any, p_url: str, d_url: str, count: int) -> list[asyncio.Future]:
    """``count`` concurrent /distserve/connection_warmup calls, as the proxy makes them for one P/D pair."""
    from lmdeploy.pytorch.disagg.messages import PDConnectionMessage

    return [asyncio.ensure_future(pool.connect(PDConnectionMessage(p_url=p_url, d_url=d_url)))
            for _ in range(count)]


def pool_tasks(before: set[asyncio.Task], callers: list[asyncio.Future]) -> set[asyncio.Task]:
    return asyncio.all_tasks() - before - set(callers)


@pytest.mark.regression
async def test_repeated_warmups_of_a_stuck_link_share_one_attempt(apply_patch) -> None:
    conn = apply_patch('proxy_connections')
    prefill, decode = NodeLog(), NodeLog()
    prefill.open.clear()  # the handshake's first request hangs, as against a slow or stuck node (#4972)
    with linked_nodes(prefill, decode) as (p_url, d_url):
        pool = conn.PDConnectionPool()
        before = asyncio.all_tasks()
        try:
            first = warmups(pool, p_url, d_url, 1)
            await prefill.until_asked('/distserve/engine_info')
            one_warmup = len(pool_tasks(before, first))
            repeated = first + warmups(pool, p_url, d_url, WARMUPS - 1)
            await asyncio.sleep(0.1)  # the pool takes up every queued request
            all_warmups = len(pool_tasks(before, repeated))
            prefill.open.set()
            await asyncio.wait_for(asyncio.gather(*repeated), timeout=5)
            asked = prefill.asked + decode.asked
            await asyncio.wait_for(asyncio.gather(*warmups(pool, p_url, d_url, WARMUPS)), timeout=5)
        finally:
            await pool.conn_sess.close()
    assert all_warmups == one_warmup, f'{WARMUPS} warmups kept {all_warmups} tasks, one warmup {one_warmup}'
    assert prefill.asked[HANDSHAKE] == decode.asked[HANDSHAKE] == 1
    assert prefill.asked + decode.asked == asked  # warmups of a connected link ask the nodes nothing


@pytest.mark.regression
async def test_concurrent_connects_after_a_failed_handshake_all_connect(apply_patch) -> None:
    conn = apply_patch('proxy_connections')
    prefill, decode = NodeLog(), NodeLog()
    prefill.failing = True  # the first warmup finds the Prefill engine not ready
    with linked_nodes(prefill, decode) as (p_url, d_url):
        pool = conn.PDConnectionPool()
        try:
            with pytest.raises(TimeoutError, match='PDConnection Failure'):
                await asyncio.wait_for(warmups(pool, p_url, d_url, 1)[0], timeout=5)
            prefill.failing = False
            prefill.open.clear()
            callers = warmups(pool, p_url, d_url, WARMUPS)
            await prefill.until_asked('/distserve/engine_info', times=prefill.asked['/distserve/engine_info'] + 1)
            # while the new handshake is under way, nobody gives up on it
            await asyncio.wait(callers, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            prefill.open.set()
            results = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), timeout=5)
        finally:
            await pool.conn_sess.close()
    assert Counter(repr(result) for result in results) == {'None': WARMUPS}
    assert prefill.asked[HANDSHAKE] == decode.asked[HANDSHAKE] == 1


@pytest.mark.regression
async def test_callers_beyond_the_bound_on_link_waiters_are_refused_at_once_and_the_rest_connect(
        apply_patch, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdeploy_pdfix.units import proxy_connections as proxy_conn

    conn = apply_patch('proxy_connections')
    monkeypatch.setattr(proxy_conn, 'MAX_LINK_WAITERS', 3)  # a pool reads it when its first link set-up begins
    prefill, decode = NodeLog(), NodeLog()
    prefill.open.clear()
    with linked_nodes(prefill, decode) as (p_url, d_url):
        pool = conn.PDConnectionPool()
        try:
            callers = warmups(pool, p_url, d_url, 5)
            await prefill.until_asked('/distserve/engine_info')
            refused, _ = await asyncio.wait(callers, timeout=1)
            prefill.open.set()
            results = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), timeout=5)
        finally:
            await pool.conn_sess.close()
    assert len(refused) == 2 and all('already wait' in str(task.exception()) for task in refused)
    assert Counter(type(result).__name__ for result in results) == {'NoneType': 3, 'TooManyWaiting': 2}


@pytest.mark.regression
async def test_warmups_that_come_while_one_runs_share_it_and_callers_beyond_the_bound_get_503(
        distserve, apply_patch, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdeploy_pdfix.units import proxy_warmups as proxy_warmups

    apply_patch('proxy_warmups')
    monkeypatch.setattr(proxy_warmups.PATCH.rounds, 'limit', 4)
    pool = distserve.proxy.node_manager.pd_connection_pool
    gate, connects = threading.Event(), []

    async def stuck_connect(conn_req) -> None:  # a node that holds the handshake
        connects.append(conn_req)
        while not gate.is_set():
            await asyncio.sleep(0.01)

    monkeypatch.setattr(pool, 'connect', stuck_connect)
    calls = [asyncio.ensure_future(distserve.post('/distserve/connection_warmup', {})) for _ in range(6)]
    try:
        early, _ = await asyncio.wait(calls, timeout=2)
    finally:
        gate.set()
    answers = await asyncio.gather(*calls)
    assert [task.result().status_code for task in early] == [503, 503], 'refused at once, while the warmup runs'
    assert sorted(answer.status_code for answer in answers) == [200] * 4 + [503] * 2
    assert len(connects) == 1, f'{len(connects)} connects of the one Prefill/Decode pair'

"""The engines' ZMQ links: what a free releases, how long a send may wait, what re-linking and dropping leave.

Each node is LMDeploy's real ``EngineP2PConnection`` with real ZMQ sockets on 127.0.0.1, linked as the proxy
links a Prefill/Decode pair (``p2p_initialize`` on both sides, then ``p2p_connect`` on both). Behind it is
LMDeploy's ``Engine`` object with a real ``Scheduler`` (a small CPU-sized cache) but without a model: it is
created without ``__init__``, so only the KV transfer engine (``executor.p2p_*``, RDMA) is a stand-in.
A Prefill node's preserved caches are scheduler sessions recorded in the node's book, as the
``engine_sessions`` patch records them when LMDeploy keeps a finished request for its Decode node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.disagg.conn.protocol import (
    DistServeConnectionRequest,
    DistServeDropConnectionRequest,
    DistServeInitRequest,
    DistServeInitResponse,
    MigrationProtocol,
)
from lmdeploy.pytorch.engine.engine import Engine  # first: engine_conn cannot be imported on its own
from lmdeploy.pytorch.messages import SequenceMeta
from lmdeploy.pytorch.paging import Scheduler
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy

from lmdeploy_pdfix.domain.preserved import Verdict
from lmdeploy_pdfix.shared.node_book import book_of
from lmdeploy_pdfix.units import engine_connections as engine_conn_patch

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 64
PREFILL_URL = 'http://127.0.0.1:23001'
DECODE_URL = 'http://127.0.0.1:23002'
OWNER_BASE = 7 << 32  # where this test's owner ids start: any ids of the engine's own would do
SETTLE_S = 2.0  # how long a test waits for a message to cross a link; a healthy link takes milliseconds
SEND_TIMEOUT_S = 0.3


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_batches=8, max_session_len=4096),
                     CacheConfig(max_batches=8, block_size=BLOCK_SIZE, num_cpu_blocks=0,
                                 num_gpu_blocks=NUM_GPU_BLOCKS),
                     seq_meta=SequenceMeta(BLOCK_SIZE, strategy=ARSequenceStrategy()))


class StandInKVTransfer:
    """The executor's RDMA side of a link: nothing to set up without a GPU."""

    def p2p_initialize(self, init_request: DistServeInitRequest) -> list[Any]:
        return []

    def p2p_connect(self, remote_engine_id: str, conn_request: list[Any]) -> None:
        return None


def bare_engine(scheduler: Scheduler) -> Engine:
    """LMDeploy's Engine with a real scheduler and no model (its own end_session, book and all)."""
    engine = Engine.__new__(Engine)
    engine.scheduler = scheduler
    engine.executor = StandInKVTransfer()
    return engine


@dataclass
class Node:
    url: str
    engine: Engine
    conn: Any  # lmdeploy's EngineP2PConnection
    init: dict[str, DistServeInitResponse] = field(default_factory=dict)

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    def add_session(self, session_id: int) -> None:
        self.scheduler.add_session(session_id).add_sequence(np.arange(40))

    def preserve(self, session_id: int) -> None:
        """A finished request LMDeploy keeps for a Decode node, recorded as engine_sessions records it."""
        self.add_session(session_id)
        book_of(self.engine).preserve(session_id, block_ids=[0, 1, 2])


def make_node(conn_module: ModuleType, url: str) -> Node:
    engine = bare_engine(make_scheduler())
    return Node(url, engine, conn_module.EngineP2PConnection(engine))


def initialize(node: Node, peer: Node) -> None:
    config = dict(tp_size=1, ep_size=1, dp_size=1, pp_size=None, dp_rank=0, block_size=BLOCK_SIZE,
                  num_cpu_blocks=0, num_gpu_blocks=NUM_GPU_BLOCKS)
    node.init[peer.url] = node.conn.p2p_initialize(DistServeInitRequest(
        local_engine_id=node.url, local_engine_config=config, remote_engine_id=peer.url,
        remote_engine_config=config, protocol=MigrationProtocol.RDMA))


def connect(node: Node, peer: Node) -> None:
    node.conn.p2p_connect(DistServeConnectionRequest(
        protocol=MigrationProtocol.RDMA, remote_engine_id=peer.url,
        remote_engine_endpoint_info=peer.init[node.url].engine_endpoint_info, remote_kvtransfer_endpoint_info=[]))


def link(prefill: Node, decode: Node) -> None:
    """What the proxy does for a Prefill/Decode pair."""
    initialize(prefill, decode)
    initialize(decode, prefill)
    connect(prefill, decode)
    connect(decode, prefill)


def drop(node: Node, peer: Node) -> dict[str, Any]:
    return node.conn.p2p_drop_connect(DistServeDropConnectionRequest(engine_id=node.url, remote_engine_id=peer.url))


def owner(n: int) -> int:
    return OWNER_BASE + n


async def other_tasks_done() -> None:
    """Test teardown: end what the test started (receive loops, hung sends) before the loop closes."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def eventually(condition: Callable[[], bool], within_s: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.fixture
def conn_module(apply_patch: Callable[[str], ModuleType]) -> ModuleType:
    return apply_patch('engine_connections')


@pytest.fixture
def zmq_contexts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[zmq.asyncio.Context]]:
    """Every ZMQ context the test creates, destroyed at its end: one left open (stock LMDeploy leaks the old
    link's on re-linking) would hang the interpreter's exit in its garbage collection."""
    created: list[zmq.asyncio.Context] = []

    class RecordedContext(zmq.asyncio.Context):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(zmq.asyncio, 'Context', RecordedContext)
    yield created
    destroy(created)


def destroy(contexts: list[zmq.asyncio.Context]) -> None:
    for context in contexts:
        if not context.closed:
            context.destroy(linger=0)


@pytest.fixture
async def pair(conn_module: ModuleType, zmq_contexts: list[zmq.asyncio.Context]) -> AsyncIterator[tuple[Node, Node]]:
    """A Prefill and a Decode node, not linked yet."""
    yield make_node(conn_module, PREFILL_URL), make_node(conn_module, DECODE_URL)
    await other_tasks_done()  # before their sockets close: receive loops, hung sends


@pytest.fixture
def lmdeploy_errors() -> Iterator[list[logging.LogRecord]]:
    """What LMDeploy's logger reports at ERROR or above during the test."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger('lmdeploy')
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# --- what a free releases on the Prefill node (D15) -------------------------------------------------------------

@pytest.mark.regression
async def test_a_free_releases_its_preserved_cache_and_no_other_session(
        pair: tuple[Node, Node], lmdeploy_errors: list[logging.LogRecord]) -> None:
    prefill, decode = pair
    running, preserved, unknown = owner(1), owner(2), owner(3)
    prefill.add_session(running)  # another user's request, still being served
    prefill.preserve(preserved)
    link(prefill, decode)

    for session in (running, unknown, preserved):  # one link keeps order: the last free is handled last
        await asyncio.wait_for(decode.conn.zmq_send(PREFILL_URL, session), SETTLE_S)
    assert await eventually(lambda: preserved not in prefill.scheduler.sessions), 'the preserved cache was kept'

    assert running in prefill.scheduler.sessions, 'a free naming a running request ended it'
    book = book_of(prefill.engine)
    assert book.releases == {'decode_freed': 1}
    assert book.frees == {'not_preserved': 1, 'unknown': 1}
    assert [record.getMessage() for record in lmdeploy_errors] == [], 'a free naming nothing is no error'


async def test_a_cache_freed_over_a_link_is_confirmed_late_only_to_the_decode_node_at_its_other_end(
        pair: tuple[Node, Node]) -> None:
    # a claim that ran alongside the copy may arrive after the free; a ticket replayed to another Decode node
    # must not be confirmed by it, since that node's copy may have read blocks the free gave back
    prefill, decode = pair
    prefill.preserve(owner(1))
    link(prefill, decode)
    await asyncio.wait_for(decode.conn.zmq_send(PREFILL_URL, owner(1)), SETTLE_S)
    assert await eventually(lambda: owner(1) not in prefill.scheduler.sessions)
    book = book_of(prefill.engine)
    assert book.claim(owner(1), [0, 1, 2], 'http://127.0.0.1:23003').verdict is Verdict.NOT_FOUND
    assert book.claim(owner(1), [0, 1, 2], DECODE_URL).verdict is Verdict.CLAIMED


async def test_a_malformed_free_is_skipped_and_the_link_keeps_serving(pair: tuple[Node, Node]) -> None:
    prefill, decode = pair
    prefill.preserve(owner(1))
    link(prefill, decode)
    sender = decode.conn.p2p_sender[PREFILL_URL]

    await sender.send(b'\x80 not json')
    await sender.send_json({'remote_engine_id': PREFILL_URL, 'remote_session_id': 'one'})
    await decode.conn.zmq_send(PREFILL_URL, owner(1))

    assert await eventually(lambda: owner(1) not in prefill.scheduler.sessions)


@pytest.mark.regression
async def test_a_release_that_fails_does_not_end_the_receive_loop(pair: tuple[Node, Node],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = pair
    broken, fine = owner(1), owner(2)
    prefill.preserve(broken)
    prefill.preserve(fine)
    end_session = prefill.engine.end_session

    def failing_once(session_id: int) -> bool:
        if session_id == broken:
            raise RuntimeError('the scheduler refused')
        return end_session(session_id)

    monkeypatch.setattr(prefill.engine, 'end_session', failing_once)
    link(prefill, decode)

    await decode.conn.zmq_send(PREFILL_URL, broken)
    await decode.conn.zmq_send(PREFILL_URL, fine)

    assert await eventually(lambda: fine not in prefill.scheduler.sessions), 'the free after a failed one was lost'


# --- a free nobody takes (D5) -----------------------------------------------------------------------------------

@pytest.mark.regression
async def test_a_free_no_prefill_takes_fails_within_the_send_timeout(pair: tuple[Node, Node],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = pair
    monkeypatch.setattr(engine_conn_patch, 'ZMQ_SEND_TIMEOUT_S', SEND_TIMEOUT_S)
    initialize(decode, prefill)  # the Prefill node never connected (it died, or restarted and is not re-linked)

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r'took no free of its session 5 within 0\.3 s'):
        await asyncio.wait_for(decode.conn.zmq_send(PREFILL_URL, 5), SETTLE_S)
    assert time.monotonic() - started < SETTLE_S


@pytest.mark.regression
async def test_a_free_to_a_dropped_peer_fails_at_once_with_a_clear_error(pair: tuple[Node, Node]) -> None:
    prefill, decode = pair
    link(prefill, decode)
    drop(decode, prefill)

    with pytest.raises(RuntimeError, match='no link to Prefill engine'):
        await asyncio.wait_for(decode.conn.zmq_send(PREFILL_URL, 5), SETTLE_S)


# --- re-linking and dropping (D14) ------------------------------------------------------------------------------

@dataclass
class LinkEnds:
    """What one node holds for one peer."""

    context: Any
    sender: Any
    receiver: Any
    receive_task: asyncio.Task

    def closed(self) -> dict[str, bool]:
        return {'context': self.context.closed, 'sender': self.sender.closed, 'receiver': self.receiver.closed}


def connect_and_catch_receive_task(node: Node, peer: Node) -> LinkEnds:
    before = asyncio.all_tasks()
    connect(node, peer)
    (task,) = asyncio.all_tasks() - before
    conn = node.conn
    return LinkEnds(conn.p2p_conn_ctx[peer.url], conn.p2p_sender[peer.url], conn.p2p_receiver[peer.url], task)


def link_and_catch_prefill_end(prefill: Node, decode: Node) -> LinkEnds:
    initialize(prefill, decode)
    initialize(decode, prefill)
    ends = connect_and_catch_receive_task(prefill, decode)
    connect(decode, prefill)
    return ends


@pytest.mark.regression
async def test_relinking_a_peer_closes_the_old_link_and_keeps_preserved_caches(pair: tuple[Node, Node]) -> None:
    prefill, decode = pair
    prefill.preserve(owner(1))
    prefill.preserve(owner(2))
    old = link_and_catch_prefill_end(prefill, decode)
    tasks_with_one_link = len(asyncio.all_tasks())

    new = link_and_catch_prefill_end(prefill, decode)  # the Decode re-registered: the proxy links the pair anew

    assert await eventually(old.receive_task.done), 'the old link still has a receive loop'
    assert old.closed() == {'context': True, 'sender': True, 'receiver': True}
    assert len(asyncio.all_tasks()) == tasks_with_one_link
    assert not any(new.closed().values())
    assert {owner(1), owner(2)} <= set(prefill.scheduler.sessions), 're-linking freed a preserved cache'
    assert book_of(prefill.engine).releases == {}
    await decode.conn.zmq_send(PREFILL_URL, owner(1))
    assert await eventually(lambda: owner(1) not in prefill.scheduler.sessions), 'the new link does not work'
    assert owner(2) in prefill.scheduler.sessions


@pytest.mark.regression
async def test_dropping_a_link_closes_it_and_ends_its_receive_loop_cleanly(pair: tuple[Node, Node]) -> None:
    prefill, decode = pair
    prefill.preserve(owner(1))
    ends = link_and_catch_prefill_end(prefill, decode)

    assert drop(prefill, decode) == {'success': True}

    assert await eventually(ends.receive_task.done), 'the dropped link still has a receive loop'
    assert ends.receive_task.cancelled() or ends.receive_task.exception() is None, (
        f'the receive loop crashed: {ends.receive_task.exception()!r}')
    assert ends.closed() == {'context': True, 'sender': True, 'receiver': True}
    assert owner(1) in prefill.scheduler.sessions, 'dropping a link freed a preserved cache'


async def test_a_dropped_link_can_be_made_again(pair: tuple[Node, Node]) -> None:
    prefill, decode = pair
    prefill.preserve(owner(1))
    link(prefill, decode)
    drop(prefill, decode)
    drop(decode, prefill)

    link(prefill, decode)
    await asyncio.wait_for(decode.conn.zmq_send(PREFILL_URL, owner(1)), SETTLE_S)

    assert await eventually(lambda: owner(1) not in prefill.scheduler.sessions)

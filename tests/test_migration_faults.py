"""A Decode node whose KV migration fails or hangs fails that one request and goes on serving (D5, #4965, #4971).

These tests run LMDeploy's real ``EngineLoop`` migration loop and response loop (``migration_loop``,
``_migration_loop_process_ready``, ``_migration_loop_get_outputs``, ``send_response_loop``) over its real
``Scheduler`` and ``RequestManager``. A request arrives as ``Engine._add_message`` adds a migration request
(a session, a sequence with its ``migration_request``, the client's ``Response``) and its client waits on
that response, as ``EngineInstance`` does. Only what needs a GPU or a second node is a stand-in: the RDMA
copy (``executor.migrate``), and, except in the last test, the ZMQ link that tells the Prefill node to free
its cache (the last test uses LMDeploy's real link to a real, linked Prefill node).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from lmdeploy.messages import ResponseType
from lmdeploy.pytorch.disagg.config import EngineRole
from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol, MigrationRequest
from lmdeploy.pytorch.engine.request import RequestManager, Response
from lmdeploy.pytorch.messages import MessageStatus, SchedulerSequence

from lmdeploy_pdfix.shared.node_book import book_of
from lmdeploy_pdfix.units import engine_connections as engine_conn_patch
from lmdeploy_pdfix.units import migration_faults as engine_loop_patch
from tests.test_engine_connections import (
    BLOCK_SIZE,
    DECODE_URL,
    NUM_GPU_BLOCKS,
    PREFILL_URL,
    Node,
    bare_engine,
    destroy,
    eventually,
    initialize,
    link,
    make_node,
    make_scheduler,
    other_tasks_done,
    owner,
    zmq_contexts,  # noqa: F401  (a fixture the last test uses)
)

ANSWER_TIMEOUT_S = 2.0  # a healthy stand-in migration answers in milliseconds
MIGRATION_TIMEOUT_S = 0.3
PROMPT_TOKENS = 40
PROMPT_BLOCKS = math.ceil(PROMPT_TOKENS / BLOCK_SIZE)
FIRST_TOKEN = 42


class StandInTransfers:
    """``executor.migrate``: the RDMA copy from one Prefill engine, which may fail, hang or work."""

    def __init__(self) -> None:
        self.failing: dict[str, Exception] = {}
        self.hanging: set[str] = set()
        self.unfinished: list[asyncio.Future] = []  # hanging copies, which the test may let end
        self.posted: list[str] = []
        self.copied: list[str] = []

    async def migrate(self, batch: Any) -> None:
        (remote_engine_id, _block_pairs), = batch.requests
        self.posted.append(remote_engine_id)
        if remote_engine_id in self.failing:
            raise self.failing[remote_engine_id]
        if remote_engine_id in self.hanging:
            # #4971: an awaited future nobody completes
            self.unfinished.append(asyncio.get_running_loop().create_future())
            await self.unfinished[-1]
        self.copied.append(remote_engine_id)


class StandInLink:
    """The Decode node's ZMQ link: records each free it sends to a Prefill node, or fails it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.frees: list[tuple[str, int]] = []
        self.failing: dict[str, Exception] = {}

    async def zmq_send(self, remote_engine_id: str, remote_session_id: int) -> None:
        if remote_engine_id in self.failing:
            raise self.failing[remote_engine_id]
        self.frees.append((remote_engine_id, remote_session_id))


@dataclass
class DecodeNode:
    loop: Any  # lmdeploy's EngineLoop
    transfers: StandInTransfers
    tasks: list[asyncio.Task] = field(default_factory=list)
    next_session: int = 1

    @property
    def scheduler(self) -> Any:
        return self.loop.scheduler

    @property
    def engine(self) -> Any:
        return self.loop.engine_conn.engine

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self.loop.migration_loop()),
                      asyncio.ensure_future(self.loop.send_response_loop())]

    @property
    def migration_loop(self) -> asyncio.Task:
        return self.tasks[0]

    def receive(self, prefill: str, prefill_session: int, *, num_prefill_blocks: int = PROMPT_BLOCKS,
                dummy: bool = False) -> SchedulerSequence:
        """A request the proxy migrates from ``prefill``, added as ``Engine._add_message`` adds it."""
        request = MigrationRequest(protocol=MigrationProtocol.RDMA, remote_engine_id=prefill,
                                   remote_session_id=prefill_session, remote_token_id=FIRST_TOKEN,
                                   remote_block_ids=list(range(num_prefill_blocks)), is_dummy_prefill=dummy)
        session = self.scheduler.add_session(self.next_session)
        self.next_session += 1
        seq = session.add_sequence(np.arange(PROMPT_TOKENS), migration_request=request)
        seq.resp = Response(type=ResponseType.INTERNAL_ENGINE_ERROR, sender_id=0, event=asyncio.Event())
        self.loop.migration_event.set()
        return seq

    async def answer(self, seq: SchedulerSequence) -> Response:
        """What the request's client gets first, as ``EngineInstance`` waits for it."""
        waiting = asyncio.ensure_future(seq.resp.event.wait())
        try:
            await asyncio.wait({waiting, self.migration_loop}, timeout=ANSWER_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if not seq.resp.event.is_set():
            loop = self.migration_loop
            ended = f'the migration loop ended: {loop.exception()!r}' if loop.done() else 'the migration loop hangs'
            pytest.fail(f'session {seq.session_id} got no answer within {ANSWER_TIMEOUT_S} s; {ended}')
        return seq.resp

    async def serve_one_from_each(self, **failing_request: Any) -> tuple[SchedulerSequence, SchedulerSequence,
                                                                         Response, Response]:
        """A request from Prefill a (``failing_request`` shapes it) and a normal one from Prefill b, answered.

        Returns both sequences, then both answers.
        """
        first = self.receive('prefill-a', 11, **failing_request)
        second = self.receive('prefill-b', 12)
        self.start()
        return first, second, await self.answer(first), await self.answer(second)

    def free_blocks(self) -> int:
        return self.scheduler.block_manager.get_num_free_gpu_blocks()


def make_decode_node(loop_module: ModuleType, link: Callable[[Any], Any] = StandInLink) -> DecodeNode:
    scheduler = make_scheduler()
    transfers = StandInTransfers()
    collaborators = dict(req_manager=RequestManager(), scheduler=scheduler, executor=transfers,
                         seq_strategy=None,
                         inputs_maker=SimpleNamespace(has_pending_long_context_chunk=lambda: False),
                         config=loop_module.EngineLoopConfig(role=EngineRole.Decode),
                         engine_conn=link(bare_engine(scheduler)),
                         state_checkpoints=getattr(scheduler, 'state_checkpoints', None))  # 0.18 only
    parameters = inspect.signature(loop_module.EngineLoop).parameters
    loop = loop_module.EngineLoop(**{key: value for key, value in collaborators.items() if key in parameters})
    return DecodeNode(loop, transfers)


def is_answered_with_first_token(resp: Response) -> bool:
    return resp.type == ResponseType.SUCCESS and list(resp.data['token_ids']) == [FIRST_TOKEN]


@pytest.fixture
def loop_module(apply_patch: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setattr(engine_loop_patch, 'MIGRATION_TIMEOUT_S', MIGRATION_TIMEOUT_S)
    monkeypatch.setattr(engine_loop_patch, 'QUARANTINE_S', MIGRATION_TIMEOUT_S)
    return apply_patch('migration_faults')


@pytest.fixture
async def decode(loop_module: ModuleType) -> AsyncIterator[DecodeNode]:
    node = make_decode_node(loop_module)
    yield node
    for unfinished in node.transfers.unfinished:
        unfinished.cancel()
    await other_tasks_done()


FAULTS = {
    'transfer error': lambda node: node.transfers.failing.update({'prefill-a': RuntimeError('RDMA read failed')}),
    'free not sent': lambda node: node.loop.engine_conn.failing.update({'prefill-a': TimeoutError('no peer')}),
}


@pytest.mark.regression
@pytest.mark.parametrize('fault', FAULTS)
async def test_a_failed_migration_fails_its_own_request_only(decode: DecodeNode, fault: str) -> None:
    FAULTS[fault](decode)
    failing, fine, failed, answered = await decode.serve_one_from_each()

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR
    assert 'KV cache migration from Prefill engine prefill-a (session 11) failed' in failed.err_msg
    assert failing.session_id not in decode.scheduler.sessions, 'the failed Decode session was kept'
    assert is_answered_with_first_token(answered)
    assert fine.status == MessageStatus.MIGRATION_DONE
    assert await eventually(lambda: decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS), \
        'only the migrated request holds blocks'
    # the failed migration is over, so its Prefill cache is freed at once (the link allowing)
    assert decode.loop.engine_conn.frees == [('prefill-a', 11)] * (fault == 'transfer error') + [('prefill-b', 12)]
    assert sum(book_of(decode.engine).migration_failures.values()) == 1


@pytest.mark.regression
async def test_the_blocks_of_a_failed_transfer_stay_quarantined_while_peer_workers_may_write(
        decode: DecodeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    # with several workers, one worker's error ends the gather while the others still copy into those blocks
    monkeypatch.setattr(engine_loop_patch, 'QUARANTINE_S', 1.0)
    decode.transfers.failing['prefill-a'] = RuntimeError('RDMA read failed on worker 1')
    failing, _, failed, _ = await decode.serve_one_from_each()

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR
    assert failing.session_id not in decode.scheduler.sessions
    assert decode.free_blocks() == NUM_GPU_BLOCKS - 2 * PROMPT_BLOCKS, 'handed out while a peer may still write'
    assert await eventually(lambda: decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS, within_s=3.0)


@pytest.mark.regression
async def test_a_migration_refused_before_any_copy_returns_its_decode_blocks_at_once(
        decode: DecodeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    # LMDeploy's block-count check refuses it before executor.migrate: nothing can land in its blocks, and
    # pinned for QUARANTINE_S, repeated refusals would leave the Decode without KV
    monkeypatch.setattr(engine_loop_patch, 'QUARANTINE_S', 60.0)
    refused, _, failed, answered = await decode.serve_one_from_each(num_prefill_blocks=PROMPT_BLOCKS + 1)

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR
    assert is_answered_with_first_token(answered)
    assert decode.transfers.posted == ['prefill-b'], 'a copy was posted for the refused request'
    assert refused.session_id not in decode.scheduler.sessions
    assert decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS, 'blocks no copy writes into were quarantined'


@pytest.mark.regression
async def test_the_blocks_of_a_copy_that_ended_are_free_at_once_though_its_free_failed(
        decode: DecodeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    # the copy returned on every worker before the free was sent: nothing writes into its blocks any more
    monkeypatch.setattr(engine_loop_patch, 'QUARANTINE_S', 60.0)
    decode.loop.engine_conn.failing['prefill-a'] = TimeoutError('no peer')
    _, _, failed, answered = await decode.serve_one_from_each()

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR
    assert is_answered_with_first_token(answered)
    assert decode.transfers.copied == ['prefill-a', 'prefill-b']
    assert decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS, 'blocks no copy writes into were quarantined'


@pytest.mark.regression
async def test_a_block_count_mismatch_fails_its_request_only(decode: DecodeNode) -> None:
    # #4965: a hand-made migration_request, or Prefill and Decode with different block sizes
    _, _, failed, answered = await decode.serve_one_from_each(num_prefill_blocks=PROMPT_BLOCKS - 1)

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR
    lmdeploy_says = f'#prefill block ids ({PROMPT_BLOCKS - 1}) must equal to #decode block ids ({PROMPT_BLOCKS})'
    assert lmdeploy_says in failed.err_msg
    assert is_answered_with_first_token(answered)
    assert decode.transfers.copied == ['prefill-b'], 'nothing was copied for the mismatched request'
    assert book_of(decode.engine).migration_failures == {'AssertionError': 1}


@pytest.mark.regression
async def test_the_decode_node_serves_later_requests_after_a_failed_migration(decode: DecodeNode) -> None:
    decode.transfers.failing['prefill-a'] = RuntimeError('RDMA read failed')
    decode.start()
    assert (await decode.answer(decode.receive('prefill-a', 11))).type == ResponseType.INTERNAL_ENGINE_ERROR

    later = [decode.receive('prefill-b', 20 + n) for n in range(3)]

    for seq in later:
        assert is_answered_with_first_token(await decode.answer(seq))
    assert not decode.migration_loop.done()
    assert decode.loop.engine_conn.frees == [('prefill-a', 11), ('prefill-b', 20), ('prefill-b', 21), ('prefill-b', 22)]


@pytest.mark.regression
async def test_a_hung_migration_fails_at_the_deadline_and_its_blocks_wait_for_the_transfer(
        decode: DecodeNode) -> None:
    decode.transfers.hanging.add('prefill-a')
    hung, _, failed, answered = await decode.serve_one_from_each()

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR
    assert 'timeout: not done within 0.3 s' in failed.err_msg
    assert is_answered_with_first_token(answered)
    assert hung.session_id not in decode.scheduler.sessions
    assert book_of(decode.engine).migration_failures == {'timeout': 1}
    # the copy given up on may still write its blocks: nobody else gets them until it ends
    assert decode.free_blocks() == NUM_GPU_BLOCKS - 2 * PROMPT_BLOCKS
    decode.transfers.unfinished[0].set_result(None)
    assert await eventually(lambda: decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS)


@pytest.mark.regression
async def test_a_migration_that_waited_past_the_claim_lease_fails_instead_of_copying(
        decode: DecodeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    # its Prefill held the claimed cache only that long: its blocks may hold other work's KV by now
    monkeypatch.setattr(engine_loop_patch, 'CLAIM_LEASE_S', 5.0)
    late = decode.receive('prefill-a', 11)
    late.arrive_time -= 6.0
    fine = decode.receive('prefill-b', 12)
    decode.start()
    failed, answered = await decode.answer(late), await decode.answer(fine)

    assert failed.type == ResponseType.INTERNAL_ENGINE_ERROR and 'claim_expired' in failed.err_msg
    assert is_answered_with_first_token(answered)
    assert decode.transfers.copied == ['prefill-b'], 'the late request read Prefill blocks'
    assert ('prefill-a', 11) in decode.loop.engine_conn.frees
    assert book_of(decode.engine).migration_failures == {'claim_expired': 1}


async def test_a_dummy_prefill_is_left_to_lmdeploy(decode: DecodeNode) -> None:
    dummy = decode.receive('prefill-a', 11, dummy=True)
    decode.start()

    assert is_answered_with_first_token(await decode.answer(dummy))
    assert decode.transfers.copied == []
    assert decode.loop.engine_conn.frees == []


@pytest.mark.regression
async def test_a_copy_whose_free_no_prefill_takes_is_answered_and_its_cache_freed_over_http(
        apply_patch: Callable[[str], ModuleType], loop_module: ModuleType, monkeypatch: pytest.MonkeyPatch,
        zmq_contexts: list[Any]) -> None:  # noqa: F811
    # the request has its KV once the copy ends: a Prefill link that is gone by then must not fail it (issue 12)
    conn_module = apply_patch('engine_connections')
    monkeypatch.setattr(engine_conn_patch, 'ZMQ_SEND_TIMEOUT_S', MIGRATION_TIMEOUT_S)
    monkeypatch.setattr(engine_loop_patch, 'MIGRATION_TIMEOUT_S', 10 * MIGRATION_TIMEOUT_S)
    freed_over_http: list[tuple[str, int]] = []

    async def free_prefill_session(p_url: str, owner: int, reason: str) -> bool:
        freed_over_http.append((p_url, owner))
        return True

    monkeypatch.setattr('lmdeploy_pdfix.shared.node_client.free_prefill_session', free_prefill_session)
    prefill = make_node(conn_module, PREFILL_URL)
    gone = 'http://127.0.0.1:23003'  # a Prefill node that died: the Decode's link to it has no peer
    decode = make_decode_node(loop_module, link=conn_module.EngineP2PConnection)
    decode_end = Node(DECODE_URL, decode.engine, decode.loop.engine_conn)
    link(prefill, decode_end)
    initialize(decode_end, make_node(conn_module, gone))
    prefill.preserve(owner(12))
    try:
        lost = decode.receive(gone, owner(11))
        fine = decode.receive(PREFILL_URL, owner(12))
        decode.start()

        copied = await decode.answer(lost)
        answered = await decode.answer(fine)

        assert is_answered_with_first_token(copied)
        assert is_answered_with_first_token(answered)
        assert await eventually(lambda: freed_over_http == [(gone, owner(11))]), 'the unsent free was not retried'
        assert await eventually(lambda: owner(12) not in prefill.scheduler.sessions), 'the Prefill cache was kept'
        assert book_of(prefill.engine).releases == {'decode_freed': 1}
        assert book_of(decode.engine).migration_failures == {}
    finally:
        await other_tasks_done()
        destroy(zmq_contexts)  # now: the nodes holding the sockets go with this frame


# --- issue 9: Decode requests aborted around their migration ---------------------------------------------------

def abort(node: DecodeNode, seq: SchedulerSequence) -> None:
    """The Decode client left: LMDeploy stops its session (STOP_SESSION), then ends it (END_SESSION)."""
    node.scheduler.stop_session(seq.session_id)
    node.engine.end_session(seq.session_id)


class SpinWatch:
    """Stops a migration loop that has not yielded for ``limit_s`` (from another thread: it holds the loop)."""

    def __init__(self, node: DecodeNode, limit_s: float = 2.0) -> None:
        self.node, self.limit_s, self.fired = node, limit_s, False
        self._yielded = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if not self._yielded.wait(self.limit_s):
            self.fired = True
            self.node.loop.stop_event.set()  # the spinning loop reads it on every turn, then returns

    async def __aenter__(self) -> SpinWatch:
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._yielded.set()
        self._thread.join()


@pytest.fixture
async def decode_waking(apply_patch: Callable[[str], ModuleType], loop_module: ModuleType) -> AsyncIterator[DecodeNode]:
    """A Decode node whose migration loop also has the ``migration_wakeups`` patch (D20)."""
    apply_patch('migration_wakeups')
    node = make_decode_node(loop_module)
    yield node
    await other_tasks_done()


@pytest.mark.regression
async def test_a_migration_request_aborted_before_its_turn_does_not_make_the_migration_loop_spin(
        decode_waking: DecodeNode) -> None:
    decode = decode_waking
    # D20: the request sets migration_event; its abort takes it out of MIGRATION_WAITING before the loop looks
    gone = decode.receive('prefill-a', 11)
    abort(decode, gone)
    async with SpinWatch(decode) as watch:
        decode.start()
        await asyncio.sleep(0.2)  # the event loop must come back to this test while the Decode idles

    assert not watch.fired, 'the migration loop spun without yielding: the engine process would answer nothing'
    later = decode.receive('prefill-b', 12)
    assert is_answered_with_first_token(await decode.answer(later))


@pytest.mark.regression
async def test_a_request_aborted_during_its_transfer_keeps_its_blocks_until_the_copy_ends(
        decode: DecodeNode) -> None:
    decode.transfers.hanging.add('prefill-a')
    copying = decode.receive('prefill-a', 11)
    decode.start()
    assert await eventually(lambda: decode.transfers.unfinished), 'the transfer did not start'

    abort(decode, copying)
    await asyncio.sleep(0.05)

    assert decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS, \
        'blocks still being written were handed back to the pool'
    next_one = decode.receive('prefill-b', 12)
    assert is_answered_with_first_token(await decode.answer(next_one))
    decode.transfers.unfinished[0].set_result(None)
    assert await eventually(lambda: decode.free_blocks() == NUM_GPU_BLOCKS - PROMPT_BLOCKS), \
        'the aborted request still holds blocks after its copy ended'
    assert copying.resp.type != ResponseType.SUCCESS, 'the aborted request was answered as migrated'


@pytest.mark.regression
async def test_a_request_aborted_while_its_batch_migrates_is_skipped_and_its_prefill_cache_freed(
        decode: DecodeNode) -> None:
    decode.transfers.hanging.add('prefill-a')
    first = decode.receive('prefill-a', 11)
    aborted = decode.receive('prefill-b', 12)  # scheduled in the same batch, migrated after the first
    decode.start()
    assert await eventually(lambda: decode.transfers.unfinished), 'the transfer did not start'

    abort(decode, aborted)
    decode.transfers.unfinished[0].set_result(None)

    assert is_answered_with_first_token(await decode.answer(first))
    assert not decode.migration_loop.done(), 'the migration loop ended'
    assert book_of(decode.engine).migration_failures == {}, 'the aborted request was migrated into no blocks'
    assert book_of(decode.engine).migrations_aborted == 1
    assert decode.transfers.copied == ['prefill-a']
    assert ('prefill-b', 12) in decode.loop.engine_conn.frees, 'the Prefill cache of the aborted request was kept'

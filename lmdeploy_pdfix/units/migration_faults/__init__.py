"""A failing or hanging KV migration fails its own request; the Decode engine keeps serving (D5, #4965, #4971).

``EngineLoop._migration_loop_migrate`` migrates a batch of sequences with no error handling: a block-count
mismatch (its assert), a failing ``executor.migrate`` or a failing ``engine_conn.zmq_send`` ends the engine's
migration task, and a transfer whose future nobody completes (#4971) blocks it forever. Either way the Decode
node takes no migration again while /health stays green.

The wrapper runs LMDeploy's own code for one sequence at a time, under a deadline
(``LMDEPLOY_PDFIX_MIGRATION_TIMEOUT_S``, default 120 s). A sequence whose migration fails or overruns leaves
the batch before LMDeploy activates it: its client gets an engine error, its Decode session ends, the failure
is counted in the node's book, and the rest of the batch and every later one go on. Dummy prefills reach
LMDeploy's code unchanged (it skips them).

A migration ended by a failure frees its Prefill cache over ZMQ, as one that worked does: the Prefill holds a
claimed cache for its Decode until then (issue 11). A copy that ended but whose free could not be sent (the
proxy removed the Prefill node meanwhile, which closes its links) is answered: the request no longer needs that
node, and the free goes over HTTP instead (issue 12). A migration that waited to start longer than the claim
lease (``LMDEPLOY_PDFIX_CLAIM_LEASE_S``, counted from the request's arrival) fails instead of copying blocks the
Prefill may have handed to other work meanwhile.

A Decode request aborted while it waits for or undergoes its migration (its client left: STOP_SESSION, then
END_SESSION) ends cleanly too (issue 9; the loop that never spins after one is `migration_wakeups`, D20):

- Its Decode blocks are pinned for as long as its transfer runs, so an abort in the middle of the copy cannot
  hand them to another request while the copy still writes into them (stock: wrong text, HTTP 200, for the
  request that got them).
- A sequence that is no longer ``MIGRATION_READY`` when its turn comes is not migrated (stock: the block-count
  assert, as its blocks are gone); one aborted during its transfer is not activated and publishes nothing
  ("Cannot publish output after stream completion"). The Prefill cache of a migration that never ran is
  freed at once over LMDeploy's own ZMQ link; the node's book releases it only once, whoever frees it first.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.patching import (
    Patch,
    attribute_problem,
    coroutine_problem,
    first_problem,
    innermost,
    lmdeploy_logger,
    signature_problem,
    warn,
)
from lmdeploy_pdfix.shared.lmdeploy_modules import MESSAGES_MODULE, SCHEDULER_MODULE
from lmdeploy_pdfix.shared.node_book import CacheFreeNotSent, book_of

MIGRATION_TIMEOUT_S = settings.MIGRATION_TIMEOUT_S.value()
CLAIM_LEASE_S = settings.CLAIM_LEASE_S.value()
# how long the blocks of a copy that failed stay out of reuse: no peer worker's copy outlasts a deadline
QUARANTINE_S = MIGRATION_TIMEOUT_S
BLOCK_MANAGER_MODULE = 'lmdeploy.pytorch.paging.block_manager.base_block_manager'

Migrate = Callable[[Any, list[Any]], Awaitable[None]]
Respond = Callable[..., None]

# Transfers given up on but still running: asyncio holds tasks weakly, and their end unpins blocks.
_ABANDONED: set[asyncio.Task] = set()
_FREES_OVER_HTTP: set[asyncio.Task] = set()  # held until done, as asyncio holds tasks weakly


@dataclass(frozen=True)
class MigrationFailure:
    reason: str  # 'timeout' or the exception's class name: the key the node's book counts it under
    detail: str


_NOT_TRIED = MigrationFailure('aborted', 'aborted before its transfer began')


def _migrating_each_alone(original: Migrate, respond: Respond, error_type: Any, ready_status: Any) -> Migrate:
    async def _migration_loop_migrate(self, migration_ready):
        for msg in list(migration_ready):
            failure = await _migrate_one(original, self, msg) if msg.status == ready_status else _NOT_TRIED
            if msg.status != ready_status:  # its client left before or during the transfer
                _aborted(self, msg)
                if failure is not None:  # LMDeploy frees the Prefill cache only after a transfer that worked
                    await _free_prefill_cache(self, msg)
                _leave_batch(migration_ready, msg)
            elif failure is not None:
                _fail(self, msg, failure, respond, error_type)
                await _free_prefill_cache(self, msg)  # the migration is over: the Prefill's hold for it too
                _leave_batch(migration_ready, msg)

    return _migration_loop_migrate


def _aborted(loop: Any, msg: Any) -> None:
    book_of(loop.engine_conn.engine).migration_aborted()
    lmdeploy_logger().info('lmdeploy-pdfix: Decode session %s was aborted around its migration; not answered',
                           msg.session_id)


def _leave_batch(migration_ready: list[Any], msg: Any) -> None:
    """Take ``msg`` out of the batch LMDeploy activates and answers next.

    In place: LMDeploy's caller then activates and answers only what is left in this very list (0.17 and 0.18
    alike), so the ended sequence never reaches MIGRATION_RUNNING or its client a token. By identity:
    sequences are dataclasses, compared field by field.
    """
    migration_ready[:] = [ready for ready in migration_ready if ready is not msg]


async def _free_prefill_cache(loop: Any, msg: Any) -> None:
    """Free the Prefill cache of a migration that failed or will never run, as LMDeploy frees one that ran."""
    request = msg.migration_request
    if request is None or request.is_dummy_prefill:
        return
    try:
        await loop.engine_conn.zmq_send(remote_engine_id=request.remote_engine_id,
                                        remote_session_id=request.remote_session_id)
    except Exception as exc:  # the proxy frees it too, when its request fails; the orphan TTL as a last resort
        warn(f'freeing Prefill session {request.remote_session_id} of ended Decode session {msg.session_id} '
             f'failed: {exc!r}')


async def _migrate_one(original: Migrate, loop: Any, msg: Any) -> MigrationFailure | None:
    """Migrate ``msg`` by LMDeploy's code, its Decode blocks held until the transfer ends; None when it worked."""
    late = _past_claim_lease(msg)
    if late is not None:
        return late
    transfer = asyncio.ensure_future(original(loop, [msg]))
    _hold_blocks_during(loop.scheduler.block_manager, msg, transfer, _copy_code(loop.executor))
    try:
        await asyncio.wait({transfer}, timeout=MIGRATION_TIMEOUT_S)
    except asyncio.CancelledError:  # the engine is stopping
        transfer.cancel()
        raise
    if not transfer.done():
        _ABANDONED.add(transfer)
        return MigrationFailure('timeout', f'not done within {MIGRATION_TIMEOUT_S:g} s '
                                           '(LMDEPLOY_PDFIX_MIGRATION_TIMEOUT_S)')
    if transfer.cancelled():
        return MigrationFailure('cancelled', 'cancelled before it ended (its link was closed by a re-link or a drop?)')
    error = transfer.exception()
    if error is None:
        return None
    if _copy_ended(error):  # the request needs the link no more
        _free_over_http(msg, error)
        return None
    return MigrationFailure(type(error).__name__, str(error) or repr(error))


def _copy_ended(error: BaseException | None) -> bool:
    """Whether a transfer that ended with ``error`` copied its cache: LMDeploy sends the free (whose failure is
    :class:`CacheFreeNotSent`) only after the copy."""
    return error is None or isinstance(error, CacheFreeNotSent)


def _free_over_http(msg: Any, error: CacheFreeNotSent) -> None:
    """Free the Prefill cache of a copied migration through the Prefill node's route, as the proxy does.

    In the background: the migration loop goes on. A Prefill node that is gone answers nothing; its cache went
    with it.
    """
    from lmdeploy_pdfix.shared.node_client import free_prefill_session  # the HTTP stack, only on this rare path

    request = msg.migration_request
    warn(f'Decode session {msg.session_id} copied its cache, but {error}; freeing it over HTTP instead')
    free = free_prefill_session(request.remote_engine_id, request.remote_session_id, 'its ZMQ link was closed')
    task = asyncio.ensure_future(free)
    _FREES_OVER_HTTP.add(task)
    task.add_done_callback(_FREES_OVER_HTTP.discard)


def _past_claim_lease(msg: Any) -> MigrationFailure | None:
    """Why ``msg`` must not start its transfer any more: it waited past what its Prefill holds a claim for."""
    if msg.migration_request is None or msg.migration_request.is_dummy_prefill:
        return None
    waited = time.perf_counter() - msg.arrive_time  # LMDeploy's arrival stamp, on the same clock
    if waited <= CLAIM_LEASE_S:
        return None
    return MigrationFailure('claim_expired', f'it waited {waited:.0f} s to start; its Prefill holds a claimed cache '
                                             f'for {CLAIM_LEASE_S:g} s (LMDEPLOY_PDFIX_CLAIM_LEASE_S)')


def _copy_code(executor: Any) -> CodeType | None:
    """The code of ``executor.migrate``, where LMDeploy starts the copy: its frame is on the traceback of every
    error that comes out of it."""
    migrate = getattr(executor, 'migrate', None)
    return getattr(getattr(migrate, '__func__', migrate), '__code__', None)


def _may_still_write(error: BaseException | None, copy: CodeType | None) -> bool:
    """Whether a transfer that ended with ``error`` may leave a copy still writing into its Decode blocks.

    Only an error that came out of the copy (``executor.migrate``, which posts it to every worker), as its
    traceback shows: one raised before it (the block-count assert, the block table) posted nothing, and one
    raised after it (the free) comes once every worker's copy returned. A copy whose code we cannot find on a
    traceback counts as started.
    """
    if error is None:
        return False
    if copy is None:
        return True
    return any(frame.f_code is copy for frame, _ in traceback.walk_tb(error.__traceback__))


def _hold_blocks_during(block_manager: Any, msg: Any, transfer: asyncio.Future, copy: CodeType | None) -> None:
    """Keep ``msg``'s Decode blocks out of reuse until ``transfer`` really ends, whatever ends ``msg`` first.

    The sequence may be aborted (its client left) or failed (its deadline passed) while the copy still writes
    into its blocks: giving up on the await does not stop an RDMA read already posted (DLSlime waits in a
    worker thread, Ray workers run on). Blocks handed to another request meanwhile would silently corrupt its
    KV. An extra reference (LMDeploy's own pin for asynchronous readers) keeps them allocated; a transfer given
    up on is left to finish rather than cancelled, as its end is the only sign that nothing writes any more.
    A transfer that never ends (#4971: the future is never completed, though the copy is done) keeps its
    blocks: a visible loss of capacity (the book's ``timeout`` count), never wrong text. A copy that ended with
    an error keeps them a migration timeout longer: with several workers, one worker's failure ends the gather
    while its peers may still be writing. A transfer that failed outside its copy returns them at once: a
    quarantine there only pins blocks nothing writes into, and refusals repeated would drain the Decode's KV.
    """
    blocks = msg.logical_blocks.get_real_blocks().copy()  # the sequence's own array is reset when it ends
    block_manager.pin_logical_blocks(blocks)
    session_id = msg.session_id

    def unpin() -> None:
        block_manager.release_logical_blocks(blocks)

    def release(done: asyncio.Future) -> None:
        error = None if done.cancelled() else done.exception()
        quarantined = _may_still_write(error, copy)
        if done in _ABANDONED:
            _ABANDONED.discard(done)
            warn(f'the migration of Decode session {session_id} given up on has ended '
                 f'({repr(error) if error else "no error"}); its {len(blocks)} blocks are free again'
                 + (f' in {QUARANTINE_S:g} s' if quarantined else ''))
        if quarantined:  # a peer worker's copy may still be landing in them
            asyncio.get_running_loop().call_later(QUARANTINE_S, unpin)
        else:
            unpin()

    transfer.add_done_callback(release)


def _fail(loop: Any, msg: Any, failure: MigrationFailure, respond: Respond, error_type: Any) -> None:
    request = msg.migration_request
    remote_engine = getattr(request, 'remote_engine_id', None)
    remote_session = getattr(request, 'remote_session_id', None)
    session_id = msg.session_id
    problem = (f'KV cache migration from Prefill engine {remote_engine} (session {remote_session}) failed: '
               f'{failure.reason}: {failure.detail}')
    respond(loop.req_manager, msg.resp, error_type, err_msg=problem)
    engine = loop.engine_conn.engine
    engine.end_session(session_id)  # its blocks return, or once its copy stops writing (_hold_blocks_during)
    book_of(engine).migration_failed(failure.reason)
    lmdeploy_logger().error('lmdeploy-pdfix: Decode session %s ended with an error: %s', session_id, problem)


def _copy_call_problem(loop: Any) -> str | None:
    """Why the copy may no longer be ``self.executor.migrate``: a failure outside it would free blocks it writes."""
    migrate = innermost(getattr(loop, '_migration_loop_migrate', None))
    if not {'executor', 'migrate'} <= set(getattr(getattr(migrate, '__code__', None), 'co_names', ())):
        return 'EngineLoop._migration_loop_migrate no longer calls executor.migrate'
    return None


class MigrationFaultsPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.engine_loop:EngineLoop._migration_loop_migrate',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        loop = getattr(module, 'EngineLoop', None)
        if loop is None or not callable(getattr(module, 'response_reqs', None)):
            return 'EngineLoop or response_reqs is missing'
        if getattr(getattr(module, 'ResponseType', None), 'INTERNAL_ENGINE_ERROR', None) is None:
            return 'ResponseType.INTERNAL_ENGINE_ERROR is missing'
        if getattr(getattr(module, 'MessageStatus', None), 'MIGRATION_READY', None) is None:
            return 'MessageStatus.MIGRATION_READY is missing'
        block_manager = getattr(importlib.import_module(BLOCK_MANAGER_MODULE), 'BaseBlockManager', None)
        if block_manager is None:
            return 'BaseBlockManager is missing'
        sequence = importlib.import_module(MESSAGES_MODULE).SchedulerSequence
        scheduler = importlib.import_module(SCHEDULER_MODULE).Scheduler
        return first_problem(
            attribute_problem(loop, ['scheduler', 'req_manager', 'engine_conn', 'executor']),
            _copy_call_problem(loop),
            attribute_problem(sequence, ['logical_blocks', 'migration_request', 'status', 'session_id', 'arrive_time']),
            attribute_problem(scheduler, ['block_manager']),
            signature_problem(loop, '_migration_loop_migrate', ['self', 'migration_ready']),
            signature_problem(loop, '_migration_loop_process_ready', ['self', 'migration_ready']),
            coroutine_problem(loop, '_migration_loop_migrate'),
            signature_problem(module, 'response_reqs', ['req_manager', 'resp', 'resp_type', 'data', 'err_msg']),
            signature_problem(block_manager, 'pin_logical_blocks', ['self', 'logical_block_ids']),
            signature_problem(block_manager, 'release_logical_blocks', ['self', 'logical_block_ids']),
        )

    def _apply(self, module: ModuleType) -> None:
        error_type = module.ResponseType.INTERNAL_ENGINE_ERROR
        ready = module.MessageStatus.MIGRATION_READY
        self.wrap(module.EngineLoop, '_migration_loop_migrate',
                        lambda original: _migrating_each_alone(original, module.response_reqs, error_type, ready))


PATCH = MigrationFaultsPatch()

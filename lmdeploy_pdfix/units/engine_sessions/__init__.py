"""Preserved Prefill caches in the engine process: cancel-safe, never evicted, released only as themselves.

LMDeploy keeps a Prefill session whose request asked to preserve its cache: the END_SESSION after the answer
moves it from TO_BE_MIGRATED to STOPPED. Three defects follow, fixed here:

- D4: an END_SESSION for a preserved request that had not finished (the caller was aborted or went away)
  calls ``state.finish()``, which WAITING/READY/STOPPED do not implement: NotImplementedError ends the
  engine loop. Such a request is ended like an ordinary one instead; nobody will ever migrate its cache.
- D6: the scheduler evicts STOPPED sequences first, so a preserved cache can be freed and its blocks handed
  to new work while a Decode node still has to copy them (wrong text, HTTP 200). Preserved sequences are
  taken out of the evictable list; new work waits for blocks instead.
- D15 and orphans: a free may end only a preserved cache (:func:`release_preserved`), a Decode node can
  confirm a cache before migrating it (:func:`claim_preserved`), and a cache nobody takes is reclaimed after
  ``LMDEPLOY_PDFIX_ORPHAN_TTL_S``. The book of preserved caches (:mod:`lmdeploy_pdfix.domain.preserved`) answers
  and counts all of it; the api_server reaches it through three methods added to the engine's RPC worker.

D9 too: a model whose per-sequence state a migration does not copy (linear attention, SSM, DeepSeek-V4's
window state; see :mod:`lmdeploy_pdfix.domain.model_state`) is refused by a Prefill or Decode engine with a clear
error, before anything is built, instead of answering wrongly.
"""

from __future__ import annotations

import asyncio
import importlib
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.domain.model_state import unmigrated_state
from lmdeploy_pdfix.domain.preserved import ReleaseCause, Verdict
from lmdeploy_pdfix.patching import (
    Patch,
    attribute_problem,
    first_problem,
    signature_problem,
    warn,
)
from lmdeploy_pdfix.shared.lmdeploy_modules import MESSAGES_MODULE, SCHEDULER_MODULE, WORKER_MODULE
from lmdeploy_pdfix.shared.node_book import WORKER_METHODS, book_of, preserve, preserved_sequence, release_preserved

CONFIG_MODULE = 'lmdeploy.pytorch.config'

_RECLAIM_INTERVAL_CAP_S = 30.0


def reclaim_orphans(engine: Any) -> list[int]:
    """Release every preserved cache nobody migrated, freed or claimed within the orphan TTL."""
    book = book_of(engine)
    reclaimed = [owner for owner in book.expired()
                 if release_preserved(engine, owner, ReleaseCause.RECLAIMED).verdict is Verdict.RELEASED]
    if reclaimed:
        warn(f'reclaimed {len(reclaimed)} preserved Prefill cache(s) nobody took in time (orphan TTL '
             f'{book.orphan_ttl_s:g} s, claimed ones {book.claim_hold_s:g} s): {reclaimed}')
    return reclaimed


# --- D4: END_SESSION of a preserved request -------------------------------------------------------------------



def _cancel_safe_end_session(original, to_be_migrated, success):
    def _on_end_session(self, reqs, **kwargs):
        for req in reqs:
            _end_one(self, original, req, kwargs, to_be_migrated, success)

    return _on_end_session


def _end_one(engine: Any, original, req: Any, kwargs: dict[str, Any], to_be_migrated: Any, success: Any) -> None:
    session_id = req.data['session_id']
    seq = preserved_sequence(engine.scheduler, session_id)
    book = book_of(engine)
    if seq is None:
        original(engine, [req], **kwargs)
    elif seq.status == to_be_migrated:
        if not book.is_preserved(session_id):  # else a claim that came first booked it
            preserve(engine, book, session_id, seq)
        original(engine, [req], **kwargs)  # LMDeploy keeps it (STOPPED) for the Decode node
    elif book.is_preserved(session_id):
        if req.data.get('response', True):  # a repeated end: the cache stays preserved
            engine._response(req.resp, success)
    else:
        seq.preserve_cache = False  # aborted before its cache was handed out: end it like any request
        original(engine, [req], **kwargs)
        book.cancelled()


# --- D6: preserved caches are not evictable --------------------------------------------------------------------

def _evictable_stopped(stopped: property) -> property:
    def hanging(self):
        return [seq for seq in stopped.fget(self) if not seq.preserve_cache]

    return property(hanging, doc='STOPPED sequences eviction may take: never a preserved Prefill cache')


# --- orphan reclaim ---------------------------------------------------------------------------------------------

def _reclaiming_orphans(original):
    async def async_loop(self):
        reclaimer = asyncio.get_running_loop().create_task(_reclaim_periodically(self))
        try:
            return await original(self)
        finally:
            reclaimer.cancel()

    return async_loop


async def _reclaim_periodically(engine: Any) -> None:
    interval = min(book_of(engine).orphan_ttl_s / 4, _RECLAIM_INTERVAL_CAP_S)
    while True:
        await asyncio.sleep(interval)
        try:
            reclaim_orphans(engine)
        except Exception as exc:  # one bad pass must not end reclamation for good, unlogged
            warn(f'reclaiming orphaned Prefill caches failed, retried in {interval:g} s: {exc!r}')


# --- D9: only plain-KV models are served disaggregated ----------------------------------------------------------

def _refusing_stateful_models(original, hybrid_role, model_config_class):
    def __init__(self, model_path, engine_config=None, trust_remote_code=False, *args, **kwargs):
        role = getattr(engine_config, 'role', hybrid_role)
        if role != hybrid_role:
            _refuse_if_stateful(model_config_class, model_path, engine_config, trust_remote_code, role)
        original(self, model_path, engine_config, trust_remote_code, *args, **kwargs)

    return __init__


def _refuse_if_stateful(model_config_class: Any, model_path: str, engine_config: Any, trust_remote_code: bool,
                        role: Any) -> None:
    # built as the engine builds it: overrides and the device decide which caches a model declares
    config = model_config_class.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                hf_overrides=getattr(engine_config, 'hf_overrides', None),
                                                device_type=getattr(engine_config, 'device_type', 'auto'))
    state = unmigrated_state(config)
    if state is not None:
        raise ValueError(
            f'lmdeploy-pdfix: {model_path} keeps {state}, and DistServe migrates KV blocks only, so a '
            f'{getattr(role, "name", role)} node would answer with the wrong state. Serve this model with '
            '--role Hybrid.')


class EngineSessionsPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.engine:Engine.__init__',
        'lmdeploy.pytorch.engine.engine:Engine._on_end_session',
        'lmdeploy.pytorch.engine.engine:Engine.async_loop',
        'lmdeploy.pytorch.paging.scheduler:Scheduler.hanging',
        'lmdeploy.pytorch.engine.mp_engine.base_worker:EngineWorkerBase.pdfix_release_preserved',
        'lmdeploy.pytorch.engine.mp_engine.base_worker:EngineWorkerBase.pdfix_claim_preserved',
        'lmdeploy.pytorch.engine.mp_engine.base_worker:EngineWorkerBase.pdfix_release_unclaimed',
        'lmdeploy.pytorch.engine.mp_engine.base_worker:EngineWorkerBase.pdfix_audit',
    )

    def __init__(self) -> None:
        super().__init__()
        self._stock_hanging: property | None = None

    def shape_problem(self, module: ModuleType) -> str | None:
        engine = getattr(module, 'Engine', None)
        if engine is None or getattr(module, 'MessageStatus', None) is None:
            return 'Engine or MessageStatus is missing'
        if getattr(module.MessageStatus, 'TO_BE_MIGRATED', None) is None:
            return 'MessageStatus.TO_BE_MIGRATED is missing'
        scheduler = importlib.import_module(SCHEDULER_MODULE).Scheduler
        if not isinstance(vars(scheduler).get('hanging'), property):
            return 'Scheduler.hanging is not a property'
        worker = importlib.import_module(WORKER_MODULE).EngineWorkerBase
        clashes = [name for name in WORKER_METHODS if hasattr(worker, name) and not _is_ours(worker, name)]
        if clashes:
            return f'EngineWorkerBase already has {clashes}'
        messages = importlib.import_module(MESSAGES_MODULE)
        return first_problem(
            attribute_problem(scheduler, ['sessions', 'block_manager']),
            attribute_problem(messages.SchedulerSession, ['sequences']),
            attribute_problem(messages.SchedulerSequence, ['preserve_cache', 'status']),
            attribute_problem(engine, ['scheduler']),
            signature_problem(engine, '_on_end_session', ['self', 'reqs', 'kwargs']),
            signature_problem(engine, '_response', ['self', 'resp', 'resp_type', 'data', 'err_msg']),
            signature_problem(engine, 'end_session', ['self', 'session_id']),
            signature_problem(engine, 'async_loop', ['self']),
            signature_problem(engine, '__init__', ['self', 'model_path', 'engine_config', 'trust_remote_code',
                                                   'speculative_config']),
        )

    def _apply(self, module: ModuleType) -> None:
        engine = module.Engine
        to_be_migrated = module.MessageStatus.TO_BE_MIGRATED
        success = module.ResponseType.SUCCESS
        self.wrap(engine, '_on_end_session',
                        lambda original: _cancel_safe_end_session(original, to_be_migrated, success))
        self.wrap(engine, 'async_loop', _reclaiming_orphans)
        model_config = importlib.import_module(CONFIG_MODULE).ModelConfig
        self.wrap(engine, '__init__',
                        lambda original: _refusing_stateful_models(original, module.EngineRole.Hybrid, model_config))
        scheduler = importlib.import_module(SCHEDULER_MODULE).Scheduler
        if self._stock_hanging is None:
            self._stock_hanging = vars(scheduler)['hanging']
            scheduler.hanging = _evictable_stopped(self._stock_hanging)
        worker = importlib.import_module(WORKER_MODULE).EngineWorkerBase
        for name, method in WORKER_METHODS.items():
            setattr(worker, name, method)

    def _revert(self, module: ModuleType) -> None:
        super()._revert(module)
        if self._stock_hanging is not None:
            importlib.import_module(SCHEDULER_MODULE).Scheduler.hanging = self._stock_hanging
            self._stock_hanging = None
        worker = importlib.import_module(WORKER_MODULE).EngineWorkerBase
        for name in WORKER_METHODS:
            if _is_ours(worker, name):
                delattr(worker, name)


def _is_ours(worker: type, name: str) -> bool:
    return vars(worker).get(name) is WORKER_METHODS.get(name)


PATCH = EngineSessionsPatch()

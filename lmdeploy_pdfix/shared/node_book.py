"""The one :class:`PreservedBook` of each LMDeploy ``Engine``: what the engine-process units do with it, and how an
api_server reaches it (:func:`engine_call`).

Neither the HTTP stack nor a unit is imported here: every engine process imports this module.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.preserved import Answer, PreservedBook, ReleaseCause, Verdict
from lmdeploy_pdfix.patching import unit_applied
from lmdeploy_pdfix.shared.lmdeploy_modules import ENGINE_MODULE

_ATTRIBUTE = '_lmdeploy_pdfix_preserved_book'


def book_of(engine: Any) -> PreservedBook:
    """``engine``'s book of preserved caches, created on first use."""
    book = getattr(engine, _ATTRIBUTE, None)
    if book is None:
        book = PreservedBook(orphan_ttl_s=settings.ORPHAN_TTL_S.value(), claim_hold_s=settings.claim_hold_s())
        setattr(engine, _ATTRIBUTE, book)
    return book


def release_preserved(engine: Any, owner: int, cause: ReleaseCause, by: str | None = None) -> Answer:
    """End ``owner``'s session if, and only if, it is a preserved cache of this engine; ``by``: the Decode node
    that freed it."""
    answer = book_of(engine).release(owner, cause, session_exists=owner in engine.scheduler.sessions, by=by)
    if answer.verdict is Verdict.RELEASED:
        engine.end_session(owner)
    return answer


def claim_preserved(engine: Any, owner: int, block_ids: Sequence[int], decode: str | None = None) -> Answer:
    book = book_of(engine)
    seq = preserved_sequence(engine.scheduler, owner)
    if not book.is_preserved(owner) and seq is not None and seq.status == _to_be_migrated():
        # Its answer is out but its END_SESSION still waits in the engine's queue: a claim may arrive first
        preserve(engine, book, owner, seq)
    return book.claim(owner, block_ids, decode)


def _to_be_migrated() -> Any:
    return importlib.import_module(ENGINE_MODULE).MessageStatus.TO_BE_MIGRATED


def preserve(engine: Any, book: PreservedBook, owner: int, seq: Any) -> None:
    book.preserve(owner, engine.scheduler.block_manager.get_block_table(seq).tolist())


def release_unclaimed(engine: Any, cause: ReleaseCause) -> list[int]:
    """Release every preserved cache no Decode node claimed; a claimed one is being copied, its Decode frees it."""
    return [owner for owner in book_of(engine).unclaimed()
            if release_preserved(engine, owner, cause).verdict is Verdict.RELEASED]


def preserved_sequence(scheduler: Any, session_id: int) -> Any:
    session = scheduler.sessions.get(session_id)
    sequences = list(session.sequences.values()) if session is not None else []
    return sequences[0] if sequences and sequences[0].preserve_cache else None


# --- the RPC surface the api_server calls (methods of the engine process's worker) ------------------------------

def _worker_release_preserved(self, owner: int, cause: str) -> dict[str, str]:
    return release_preserved(self.engine, owner, ReleaseCause(cause)).as_dict()


def _worker_claim_preserved(self, owner: int, block_ids: list[int], decode: str | None = None) -> dict[str, str]:
    return claim_preserved(self.engine, owner, block_ids, decode).as_dict()


def _worker_release_unclaimed(self, cause: str) -> list[int]:
    return release_unclaimed(self.engine, ReleaseCause(cause))


def _worker_audit(self) -> dict[str, Any]:
    return book_of(self.engine).audit()


WORKER_METHODS = {
    'pdfix_release_preserved': _worker_release_preserved,
    'pdfix_claim_preserved': _worker_claim_preserved,
    'pdfix_release_unclaimed': _worker_release_unclaimed,
    'pdfix_audit': _worker_audit,
}


class CacheFreeNotSent(RuntimeError):
    """A Decode node could not tell its Prefill peer to free a migrated cache (over the engines' ZMQ link)."""


async def engine_call(async_engine: Any, method: str, *args: Any) -> Any:
    """Call a method of the engine worker (LMDeploy's or a ``pdfix_*`` one) without blocking the event loop.

    Across the process boundary by the engine's asynchronous RPC when there is one; an in-process engine is
    called directly.
    """
    engine = async_engine.engine
    rpc = getattr(engine, '_collective_rpc_async', None)
    if rpc is not None:
        return await rpc(method, *args)
    if method in WORKER_METHODS:
        return WORKER_METHODS[method](SimpleNamespace(engine=engine), *args)
    return getattr(engine, method)(*args)


async def release_cache(async_engine: Any, owner: int, cause: ReleaseCause) -> None:
    """End ``owner``'s preserved session: through the book when the engine keeps one, else by LMDeploy's end."""
    if engine_book_available():
        await engine_call(async_engine, 'pdfix_release_preserved', owner, cause.value)
    else:
        await engine_call(async_engine, 'end_session', owner)


def engine_book_available() -> bool:
    """Whether the engine keeps a book of preserved caches (the ``engine_sessions`` unit is applied).

    Engine and api_server run the same code with the same switches, so this process's unit state tells
    the engine process's. Without it the node keeps LMDeploy's free_cache and confirms no claims.
    """
    importlib.import_module(ENGINE_MODULE)  # applies engine_sessions here, if it applies at all
    return unit_applied('engine_sessions')

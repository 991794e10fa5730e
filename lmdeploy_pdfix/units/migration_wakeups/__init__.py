"""The Decode migration loop sleeps until the next migration request, also after an aborted one (D20).

LMDeploy sets ``migration_event`` when a migration request arrives and clears it only when a batch is
ready, so a request aborted before the loop scheduled it leaves the event set with nothing waiting, and
``migration_loop`` spins on ``await migration_event.wait()`` without ever yielding: the engine process
answers nothing again, ``/health`` turns 503 and the proxy drops the node. The event is made self-clearing
(it clears as a wait returns), so the loop sleeps until the next migration request.
"""

from __future__ import annotations

import asyncio
from types import ModuleType

from lmdeploy_pdfix.patching import (
    Patch,
    attribute_problem,
    coroutine_problem,
    first_problem,
    warn_once,
)


class _SelfClearingEvent(asyncio.Event):
    """D20: an event that clears as a wait returns, so a wake-up with nothing to do is not seen again."""

    async def wait(self) -> bool:
        await super().wait()
        self.clear()
        return True


def _self_clearing_migration_event(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # LMDeploy sets it after adding a migration request, so a clear after the wait loses no wake-up:
        # the loop then schedules, and sees every request added before the set.
        event = getattr(self, 'migration_event', None)
        if isinstance(event, _SelfClearingEvent):
            return
        if type(event) is not asyncio.Event or event.is_set():
            warn_once('migration_event', f'EngineLoop.migration_event is {event!r}, not a fresh asyncio.Event; the '
                      'migration loop may spin after an aborted migration request (D20)')
            return
        self.migration_event = _SelfClearingEvent()

    return __init__


class MigrationWakeupsPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.engine_loop:EngineLoop.__init__',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        loop = getattr(module, 'EngineLoop', None)
        if loop is None:
            return 'EngineLoop is missing'
        return first_problem(attribute_problem(loop, ['migration_event']),
                             coroutine_problem(loop, 'migration_loop'))

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.EngineLoop, '__init__', _self_clearing_migration_event)


PATCH = MigrationWakeupsPatch()

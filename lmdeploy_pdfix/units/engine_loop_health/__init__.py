"""An engine that stopped making progress says so to its api_server's ``/health`` (issue 12).

LMDeploy's engine health (``Engine.get_health_status``; ``get_local_health_status`` in 0.18) checks the request
loop and the main loop task, and looks for finished tasks in ``EngineLoop.tasks``, where none can be found:
each task removes itself from that set when it ends. A migration loop that was cancelled or returned is
therefore never seen (the Decode takes no migration again while ``/health`` says 200), and a loop stuck in one
step is seen only by the api_server's 90-s scheduler rule, and only while it still holds requests.

The unit keeps a :class:`~lmdeploy_pdfix.domain.loop_health.LoopWatch` per engine loop: how each task the loop
started ended (unless the engine is stopping), and how long the current forward step of the main loop and
the current step of the migration loop have run (``LMDEPLOY_PDFIX_LOOP_STALL_S``; a migration step may also
take the migration timeout of each sequence in it). Its first problem makes the engine report itself not
alive, which LMDeploy's api_server turns into 503 at its next health poll (every second with
``health_polling``). The proxy's heartbeat then drops the node.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from types import ModuleType
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.loop_health import LoopWatch, how_it_ended
from lmdeploy_pdfix.patching import Patch, attribute_problem, coroutine_problem, first_problem, signature_problem

ENGINE_LOOP_MODULE = 'lmdeploy.pytorch.engine.engine_loop'
MAIN, MIGRATION = 'main', 'migration'
MIGRATION_TIMEOUT_S = settings.MIGRATION_TIMEOUT_S.value()  # read once, as migration_faults reads it

_WATCHES: weakref.WeakKeyDictionary[Any, LoopWatch] = weakref.WeakKeyDictionary()


def watch_of(engine_loop: Any) -> LoopWatch:
    watch = _WATCHES.get(engine_loop)
    if watch is None:
        watch = _WATCHES[engine_loop] = LoopWatch(settings.LOOP_STALL_S.value())
    return watch


def _health_method(engine: type) -> str:
    return 'get_local_health_status' if hasattr(engine, 'get_local_health_status') else 'get_health_status'


# --- what the watch learns --------------------------------------------------------------------------------------

def _watching_tasks(original):
    def start(self, event_loop):
        original(self, event_loop)
        watch = watch_of(self)
        for task in list(self.tasks):
            task.add_done_callback(lambda done, loop=self: _task_ended(loop, watch, done))

    return start


def _task_ended(engine_loop: Any, watch: LoopWatch, task: Any) -> None:
    if not engine_loop.stop_event.is_set():  # stopping ends every task: that is no fault
        watch.task_ended(task.get_name(), how_it_ended(task))


def _timing_forward_steps(original):
    async def _main_loop_get_outputs(self, running, forward_inputs):
        with watch_of(self).step(MAIN):
            return await original(self, running, forward_inputs)

    return _main_loop_get_outputs


def _timing_migration_steps(original):
    async def _migration_loop_process_ready(self, migration_ready):
        # each transfer may take its deadline (migration_faults), one after another
        with watch_of(self).step(MIGRATION, MIGRATION_TIMEOUT_S * len(migration_ready)):
            return await original(self, migration_ready)

    return _migration_loop_process_ready


# --- what the engine reports -----------------------------------------------------------------------------------

def _with_loop_problem(engine: Any, status: dict[str, Any]) -> dict[str, Any]:
    engine_loop = getattr(engine, '_engine_loop', None)
    if not status.get('alive') or engine_loop is None:
        return status
    problem = watch_of(engine_loop).problem()
    if problem is None:
        return status
    return dict(alive=False, message=f'lmdeploy-pdfix: {problem}', schedule_metrics=None)


def _reporting_loop_problems(original):
    if inspect.iscoroutinefunction(original):  # 0.17
        async def get_health_status(self):
            return _with_loop_problem(self, await original(self))

        return get_health_status

    def get_local_health_status(self):  # 0.18
        return _with_loop_problem(self, original(self))

    return get_local_health_status


class EngineHealthPatch(Patch):
    @property
    def wraps(self) -> tuple[str, ...]:  # type: ignore[override]
        engine = importlib.import_module(self.target).Engine
        return (
            f'{ENGINE_LOOP_MODULE}:EngineLoop.start',
            f'{ENGINE_LOOP_MODULE}:EngineLoop._main_loop_get_outputs',
            f'{ENGINE_LOOP_MODULE}:EngineLoop._migration_loop_process_ready',
            f'{self.target}:Engine.{_health_method(engine)}',
        )

    def shape_problem(self, module: ModuleType) -> str | None:
        engine = getattr(module, 'Engine', None)
        loop = getattr(importlib.import_module(ENGINE_LOOP_MODULE), 'EngineLoop', None)
        if engine is None or loop is None:
            return 'Engine or EngineLoop is missing'
        return first_problem(
            attribute_problem(engine, ['_engine_loop']),
            attribute_problem(loop, ['tasks', 'stop_event']),
            signature_problem(engine, _health_method(engine), ['self']),
            signature_problem(loop, 'start', ['self', 'event_loop']),
            signature_problem(loop, '_main_loop_get_outputs', ['self', 'running', 'forward_inputs']),
            coroutine_problem(loop, '_main_loop_get_outputs'),
            signature_problem(loop, '_migration_loop_process_ready', ['self', 'migration_ready']),
            coroutine_problem(loop, '_migration_loop_process_ready'),
        )

    def _apply(self, module: ModuleType) -> None:
        loop = importlib.import_module(ENGINE_LOOP_MODULE).EngineLoop
        self.wrap(loop, 'start', _watching_tasks)
        self.wrap(loop, '_main_loop_get_outputs', _timing_forward_steps)
        self.wrap(loop, '_migration_loop_process_ready', _timing_migration_steps)
        self.wrap(module.Engine, _health_method(module.Engine), _reporting_loop_problems)


PATCH = EngineHealthPatch()

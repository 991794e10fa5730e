"""An engine that stopped making progress reports itself not alive, so its node's /health answers 503.

LMDeploy's real ``EngineLoop.start`` starts its loop tasks and LMDeploy's real engine health check judges them;
the loops' bodies are stood in for (no model here). The GPU-free cluster shows the 503 and the proxy dropping
the node (``e2e/test_engine_loop_health.py``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from lmdeploy_pdfix.domain.loop_health import LoopWatch


async def forever() -> None:
    await asyncio.Event().wait()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine_loop(engine_loop_module: ModuleType, role: str = 'Decode') -> Any:
    """An EngineLoop of LMDeploy's with its loop bodies and executor stood in for."""
    from lmdeploy.pytorch.disagg.config import EngineRole

    loop = object.__new__(engine_loop_module.EngineLoop)
    loop.config = SimpleNamespace(role=EngineRole[role])
    loop.executor = SimpleNamespace(start=lambda event: None, wait_tasks=forever)
    loop.forward_event = None
    loop.tasks = set()
    loop.stop_event = asyncio.Event()
    for body in ('preprocess_loop', 'send_response_loop', 'main_loop', 'migration_loop'):
        setattr(loop, body, forever)
    return loop


async def engine_health(engine_module: ModuleType, loop: Any) -> dict[str, Any]:
    """LMDeploy's health check of an engine running ``loop`` (its request loop and main task alive)."""
    engine = object.__new__(engine_module.Engine)
    engine.req_manager = SimpleNamespace(is_loop_alive=lambda: True)
    engine._loop_main = asyncio.ensure_future(forever())
    engine._engine_loop = loop
    engine.scheduler = SimpleNamespace(schedule_metrics='metrics')
    try:
        check = getattr(engine, 'get_local_health_status', None) or engine.get_health_status
        status = check()
        return await status if inspect.isawaitable(status) else status
    finally:
        engine._loop_main.cancel()


@pytest.fixture
def engine_modules(apply_patch: Callable[[str], ModuleType]) -> tuple[ModuleType, ModuleType]:
    engine_module = apply_patch('engine_loop_health')
    return engine_module, importlib.import_module('lmdeploy.pytorch.engine.engine_loop')


@pytest.mark.regression
async def test_a_decode_whose_migration_loop_ended_reports_itself_not_alive(
        engine_modules: tuple[ModuleType, ModuleType]) -> None:
    engine_module, engine_loop_module = engine_modules
    loop = engine_loop(engine_loop_module)
    loop.start(asyncio.get_running_loop())
    assert (await engine_health(engine_module, loop))['alive']
    migration = next(task for task in loop.tasks if task.get_name() == 'MainLoopMigration')
    migration.cancel()
    await asyncio.sleep(0.05)  # the task ends, then its done callbacks run
    status = await engine_health(engine_module, loop)
    for task in loop.tasks:
        task.cancel()
    assert not status['alive'] and 'MainLoopMigration' in status['message'], status


async def test_an_engine_that_is_stopping_is_not_reported_for_its_ended_tasks(
        engine_modules: tuple[ModuleType, ModuleType]) -> None:
    engine_module, engine_loop_module = engine_modules
    loop = engine_loop(engine_loop_module)
    loop.start(asyncio.get_running_loop())
    loop.stop_event.set()
    for task in list(loop.tasks):
        task.cancel()
    await asyncio.sleep(0.05)  # the task ends, then its done callbacks run
    assert (await engine_health(engine_module, loop))['alive']


def test_a_loop_step_that_runs_past_the_stall_limit_is_a_problem_and_its_end_clears_it() -> None:
    clock = Clock()
    watch = LoopWatch(stall_s=3.0, clock=clock)
    watch.step_began('main')
    clock.now = 3.0
    assert watch.problem() is None
    clock.now = 3.5
    assert 'main loop' in (watch.problem() or '')
    watch.step_ended('main')
    assert watch.problem() is None


def test_a_migration_step_may_take_the_migration_timeout_of_each_of_its_sequences() -> None:
    clock = Clock()
    watch = LoopWatch(stall_s=3.0, clock=clock)
    watch.step_began('migration', allowance_s=20.0)
    clock.now = 22.0
    assert watch.problem() is None
    clock.now = 23.5
    assert 'migration loop' in (watch.problem() or '')


@pytest.mark.regression
def test_the_api_server_asks_its_engine_every_second_unless_the_operator_chose_a_poll(
        apply_patch: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    health = apply_patch('health_polling')
    monkeypatch.delenv('LMDEPLOY_HEALTH_POLL_INTERVAL', raising=False)
    assert health.EngineHealthMonitor(None).poll_interval == 1.0
    monkeypatch.setenv('LMDEPLOY_HEALTH_POLL_INTERVAL', '30')
    assert health.EngineHealthMonitor(None).poll_interval == 30.0

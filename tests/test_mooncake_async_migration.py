"""A Mooncake migration with LMDEPLOY_USE_ASYNC_MIGRATION returns once its copy ends (D23).

LMDeploy's real ``MooncakeMigrationManagement.p2p_migrate`` runs against a link whose copy (``_migrate``, the
Mooncake transfers) is stood in for; the GPU-free cluster runs the real transfers (``e2e/test_async_migration``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

COPY_DEADLINE_S = 5.0


class Copies:
    """Stands in for the Mooncake transfers of one link: records the thread each copy ran in."""

    def __init__(self, error: Exception | None = None) -> None:
        self.threads: list[int] = []
        self.error = error

    def __call__(self, assignment: Any) -> None:
        self.threads.append(threading.get_ident())
        if self.error is not None:
            raise self.error


def link(mooncake: ModuleType, copies: Copies) -> Any:
    migration_link = object.__new__(mooncake.MooncakeMigrationManagement)
    migration_link._migrate = copies
    return migration_link


def migrate(mooncake: ModuleType, copies: Copies) -> int:
    """Run one migration on the event loop; returns the loop's thread."""

    async def run() -> int:
        await asyncio.wait_for(link(mooncake, copies).p2p_migrate(object()), COPY_DEADLINE_S)
        return threading.get_ident()

    return asyncio.run(run())


@pytest.fixture
def async_mooncake(apply_patch: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    mooncake = apply_patch('mooncake_async_migration')
    monkeypatch.setattr(mooncake, 'LMDEPLOY_USE_ASYNC_MIGRATION', '1')
    return mooncake


@pytest.mark.regression
def test_an_async_migration_returns_once_its_copy_ends_and_the_copy_runs_off_the_event_loop(
        async_mooncake: ModuleType) -> None:
    copies = Copies()
    loop_thread = migrate(async_mooncake, copies)
    assert len(copies.threads) == 1 and copies.threads[0] != loop_thread


def test_an_async_migration_whose_copy_fails_raises_the_copy_error(async_mooncake: ModuleType) -> None:
    with pytest.raises(RuntimeError, match='Failed to perform sync transfer'):
        migrate(async_mooncake, Copies(RuntimeError('Failed to perform sync transfer: -1')))


def test_without_the_switch_the_copy_runs_as_released_on_the_event_loop(
        apply_patch: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    mooncake = apply_patch('mooncake_async_migration')
    monkeypatch.setattr(mooncake, 'LMDEPLOY_USE_ASYNC_MIGRATION', None)
    copies = Copies()
    loop_thread = migrate(mooncake, copies)
    assert copies.threads == [loop_thread]

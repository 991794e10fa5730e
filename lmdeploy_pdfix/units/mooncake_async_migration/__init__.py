"""Mooncake's asynchronous KV migration completes (D23, upstream #4971; issue 12).

With ``LMDEPLOY_USE_ASYNC_MIGRATION`` set, ``MooncakeMigrationManagement.p2p_migrate`` runs the copy
(``_migrate``) in a thread and then awaits a future it created itself and that nothing ever completes: every
migration hangs after its KV was copied (stock: the Decode request never answers; with ``migration_faults``
every request fails at its deadline, its Decode blocks pinned by a transfer that never ends).

In that mode the wrapper awaits LMDeploy's own ``_migrate`` in the event loop's default thread pool, so the
Decode engine keeps serving while a copy runs, and returns when the copy ends; a failed copy raises, as in
synchronous mode. The switch is read as LMDeploy reads it (its module global, any non-empty value); without it
LMDeploy's synchronous path runs untouched.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.patching import Patch, coroutine_problem, first_problem, signature_problem

SWITCH = 'LMDEPLOY_USE_ASYNC_MIGRATION'


def _completing_async_migration(module: ModuleType):
    def make(original):
        async def p2p_migrate(self, assignment: Any, async_op: bool = False) -> None:
            if not getattr(module, SWITCH):
                return await original(self, assignment, async_op)
            await asyncio.get_running_loop().run_in_executor(None, self._migrate, assignment)
            return None

        return p2p_migrate

    return make


class MooncakeMigrationPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.disagg.backend.mooncake:MooncakeMigrationManagement.p2p_migrate',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        link = getattr(module, 'MooncakeMigrationManagement', None)
        if link is None or not hasattr(module, SWITCH):
            return f'MooncakeMigrationManagement or {SWITCH} is missing'
        return first_problem(
            signature_problem(link, 'p2p_migrate', ['self', 'assignment', 'async_op']),
            coroutine_problem(link, 'p2p_migrate'),
            signature_problem(link, '_migrate', ['self', 'assignment']),
        )

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.MooncakeMigrationManagement, 'p2p_migrate', _completing_async_migration(module))


PATCH = MooncakeMigrationPatch()

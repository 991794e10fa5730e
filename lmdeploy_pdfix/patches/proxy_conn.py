"""Unshelving a Prefill session that is not on the shelf is a no-op (defect D12).

``PDConnectionPool.unshelf_prefill_session`` does ``set.remove``; when two requests shared a shelf key, or a
key was never shelved, the second removal raises ``KeyError`` after the Decode already answered, turning a
finished request into HTTP 500.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

from lmdeploy_pdfix.patching import Patch, first_problem, install_wrapper, remove_wrapper, signature_problem


def _tolerating_absent_session(original):
    def unshelf_prefill_session(self, conn_key, session_id):
        with contextlib.suppress(KeyError):  # already unshelved: the shelf is a record, not a claim
            original(self, conn_key, session_id)

    return unshelf_prefill_session


class ProxyShelfPatch(Patch):
    name = 'proxy_shelf'
    target = 'lmdeploy.pytorch.disagg.conn.proxy_conn'

    def shape_problem(self, module: ModuleType) -> str | None:
        pool = getattr(module, 'PDConnectionPool', None)
        if pool is None:
            return 'PDConnectionPool is missing'
        return first_problem(
            signature_problem(pool, 'shelf_prefill_session', ['self', 'conn_key', 'session_id']),
            signature_problem(pool, 'unshelf_prefill_session', ['self', 'conn_key', 'session_id']),
        )

    def _apply(self, module: ModuleType) -> None:
        install_wrapper(module.PDConnectionPool, 'unshelf_prefill_session', _tolerating_absent_session)

    def _revert(self, module: ModuleType) -> None:
        remove_wrapper(module.PDConnectionPool, 'unshelf_prefill_session')


PATCH = ProxyShelfPatch()

"""Cache owners cannot go stale across a node restart (D14).

LMDeploy numbers an api_server's sessions from 0 again after every restart, so a free or a migration that
names an owner from before the restart (a proxy retry, a queued Decode) ends or copies a session of the
restarted node that merely got the same number. Each session manager numbers its sessions from a fresh
incarnation base instead (:mod:`lmdeploy_pdfix.owner_ids`): an id from before a restart never names a session
after it, and the node's book of preserved caches can tell such an id from an unknown one.
"""

from __future__ import annotations

import itertools
from types import ModuleType

from lmdeploy_pdfix.owner_ids import first_session_id, new_incarnation
from lmdeploy_pdfix.patching import (
    Patch,
    attribute_problem,
    first_problem,
    signature_problem,
)


def _numbering_from_incarnation(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.session_id_generator = itertools.count(first_session_id(new_incarnation()))

    return __init__


class SessionIncarnationsPatch(Patch):
    name = 'session_incarnations'
    target = 'lmdeploy.serve.managers.session_manager'
    wraps = (
        'lmdeploy.serve.managers.session_manager:SessionManager.__init__',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        manager = getattr(module, 'SessionManager', None)
        if manager is None:
            return 'SessionManager is missing'
        return first_problem(signature_problem(manager, '__init__', ['self']),
                             attribute_problem(manager, ['session_id_generator']))

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.SessionManager, '__init__', _numbering_from_incarnation)


PATCH = SessionIncarnationsPatch()

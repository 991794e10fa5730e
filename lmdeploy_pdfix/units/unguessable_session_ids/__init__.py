"""Cache owners are unguessable and never go stale across a node restart (D14, issue 11).

LMDeploy numbers an api_server's sessions 0, 1, 2, … and again from 0 after every restart, so a free or a
migration that names an owner from before the restart (a proxy retry, a queued Decode) ends or copies a session
of the restarted node that merely got the same number, and anyone who saw one owner id can name every other.
Each session manager draws its ids from a keyed permutation with a fresh key instead
(:mod:`lmdeploy_pdfix.domain.owner_ids`), from construction and after every ``clear()``.
"""

from __future__ import annotations

from types import ModuleType

from lmdeploy_pdfix.domain.owner_ids import unguessable_session_ids
from lmdeploy_pdfix.patching import (
    Patch,
    attribute_problem,
    first_problem,
    signature_problem,
)


def _numbering_unguessably(original):
    def numbering(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.session_id_generator = unguessable_session_ids()

    return numbering


class UnguessableSessionIdsPatch(Patch):
    wraps = (
        'lmdeploy.serve.managers.session_manager:SessionManager.__init__',
        'lmdeploy.serve.managers.session_manager:SessionManager.clear',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        manager = getattr(module, 'SessionManager', None)
        if manager is None:
            return 'SessionManager is missing'
        return first_problem(signature_problem(manager, '__init__', ['self']),
                             signature_problem(manager, 'clear', ['self']),
                             attribute_problem(manager, ['session_id_generator']))

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.SessionManager, '__init__', _numbering_unguessably)
        self.wrap(module.SessionManager, 'clear', _numbering_unguessably)


PATCH = UnguessableSessionIdsPatch()

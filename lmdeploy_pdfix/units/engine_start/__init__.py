"""A node's engine process survives its parent leaving the start-up handshake early (D22, issue 12).

``ZMQMPEngine._start_mp_proc`` spawns the engine process and waits, inside ``with mp.Manager()``, until the
child has put its RPC port into the Manager's shared dict. It leaves that block, which shuts the Manager down,
as soon as it sees the port, while the child may still be notifying and releasing the Manager's condition
(``_mp_proc``'s ``with condition:``). On a loaded host the child loses that race: its release meets a closed
Manager (``EOFError``, ``BrokenPipeError``), the engine process dies before it builds the engine, and the
api_server exits with ``RPCServerDeadError``. Every role is hit, DistServe or not.

Once the port is in the shared dict the child has nothing left to tell its parent, so the child's handle on the
condition lets a notify or release fail quietly when the Manager is gone. Everything before the port is
published still fails as it did: a parent that never saw the port must hear of it. ``_mp_proc`` is a
staticmethod that the spawned child finds by name (pickle); the wrapper keeps its name, and the child's own
import hook applies this unit there before the function is looked up.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.patching import Patch, register_wrapper, signature_problem, warn

# what a Manager proxy raises once its Manager has shut down: the connection is closed or refused
MANAGER_GONE = (EOFError, OSError)
_CHILD_ENTRY = '_mp_proc'
_CHILD_PARAMETERS = ['shared_dict', 'condition', 'model_path', 'engine_config', 'log_level', 'speculative_config',
                     'kwargs']


class PortHandshake:
    """The engine child's handle on the parent's Manager condition: after the handshake, a gone Manager is no
    error."""

    def __init__(self, condition: Any) -> None:
        self._condition = condition

    def __enter__(self) -> Any:
        return self._condition.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._quietly(self._condition.__exit__, *exc)

    def notify(self, n: int = 1) -> None:
        self._quietly(self._condition.notify, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._condition, name)

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except MANAGER_GONE as exc:
            warn(f'the api_server left the engine start-up handshake before this engine process did ({exc!r}); '
                 'its RPC port was already published, so the engine goes on')


def _surviving_early_parent(original: Any) -> Any:
    def _mp_proc(shared_dict, condition, *args, **kwargs):
        return original(shared_dict, PortHandshake(condition), *args, **kwargs)

    return _mp_proc


class EngineStartPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.engine.mp_engine.zmq_engine:ZMQMPEngine._mp_proc',
    )

    def __init__(self) -> None:
        super().__init__()
        self._stock_entry: staticmethod | None = None

    def shape_problem(self, module: ModuleType) -> str | None:
        engine = getattr(module, 'ZMQMPEngine', None)
        if engine is None:
            return 'ZMQMPEngine is missing'
        if not isinstance(inspect.getattr_static(engine, _CHILD_ENTRY, None), staticmethod):
            return f'ZMQMPEngine.{_CHILD_ENTRY} is not a staticmethod'
        start = getattr(engine, '_start_mp_proc', None)
        if 'Manager' not in getattr(getattr(start, '__code__', None), 'co_names', ()):
            return 'ZMQMPEngine._start_mp_proc no longer hands the port over through an mp.Manager'
        return signature_problem(engine, _CHILD_ENTRY, _CHILD_PARAMETERS)

    def _apply(self, module: ModuleType) -> None:
        # by hand, not by wrap(): the class holds a staticmethod, and revert must put back that very object
        engine = module.ZMQMPEngine
        if self._stock_entry is None:
            self._stock_entry = inspect.getattr_static(engine, _CHILD_ENTRY)
            original = self._stock_entry.__func__
            # same __module__ and __qualname__: the spawned child finds the entry point by name
            wrapper = functools.update_wrapper(_surviving_early_parent(original), original)
            setattr(engine, _CHILD_ENTRY, staticmethod(register_wrapper(wrapper, original, self.name)))

    def _revert(self, module: ModuleType) -> None:
        if self._stock_entry is not None:
            setattr(module.ZMQMPEngine, _CHILD_ENTRY, self._stock_entry)
            self._stock_entry = None


PATCH = EngineStartPatch()

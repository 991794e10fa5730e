"""Post-import hooks: run a callback once a named module has finished executing.

Standard library only: this module is imported from the interpreter start-up hook, where
``sys.path`` may be incomplete and nothing of LMDeploy may be imported yet.
"""

from __future__ import annotations

import _thread
import sys

# Start-up budget: importlib.abc alone costs ~30 ms (it pulls in importlib.resources), typing ~8 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    ImportCallback = Callable[[ModuleType], None]

_lock = _thread.RLock()
_pending: dict[str, list[ImportCallback]] = {}


def when_imported(module_name: str, callback: ImportCallback, first: bool = False) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported; now if it already is.

    Callbacks run in registration order; ``first`` puts this one ahead of those already registered.
    """
    with _lock:
        module = sys.modules.get(module_name)
        if module is None or _is_initialising(module):
            callbacks = _pending.setdefault(module_name, [])
            callbacks.insert(0 if first else len(callbacks), callback)
            _ensure_finder_installed()
            return
    callback(module)


def _is_initialising(module: ModuleType) -> bool:
    spec = getattr(module, '__spec__', None)
    return bool(spec is not None and getattr(spec, '_initializing', False))


def _run_pending(module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(module.__name__, [])
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:  # a failing hook must never break the target's import
            print(f'lmdeploy-pdfix: post-import hook for {module.__name__} failed: {exc!r}', file=sys.stderr)


class _PostImportLoader:
    """Delegates to the real loader, then fires the hooks of the module it executed."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Restore the real loader first, so reloads and introspection see LMDeploy's own.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_pending(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _PostImportFinder:
    """Wraps the loader of watched modules; every other import passes straight through."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, 'find_spec'):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PostImportLoader(spec.loader)
                return spec
            if spec is not None:
                return spec
        return None


_finder = _PostImportFinder()


def _ensure_finder_installed() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)

"""What the start-up hook runs. Registers import hooks only; never raises, never prints unless broken."""

from __future__ import annotations

import _thread
import importlib
import sys

from lmdeploy_pdfix import settings
from lmdeploy_pdfix._import_hooks import when_imported
from lmdeploy_pdfix.registry import BY_NAME, PATCHES, PatchSpec

TYPE_CHECKING = False  # typing costs ~8 ms of start-up
if TYPE_CHECKING:
    from types import ModuleType

_lock = _thread.allocate_lock()
_installed = False
_waiting: dict[str, list] = {}  # patch name -> applications that wait for it to apply or be refused


def install_patches() -> None:
    """Idempotent: a second call (a second hook, ``install()`` after the .pth) changes nothing."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    disabled = settings.disabled_patches()
    unknown = sorted(disabled - set(BY_NAME))
    if unknown:
        print(f'lmdeploy-pdfix: {settings.DISABLE} names no patch called {", ".join(unknown)} '
              f'(patches: {", ".join(BY_NAME)})', file=sys.stderr)
    for spec in PATCHES:
        if spec.name not in disabled:
            when_imported(spec.target, _applier(spec))


def load_patch(spec: PatchSpec):
    """The patch object of ``spec`` (imports our patch module, which may import LMDeploy)."""
    return importlib.import_module(spec.module).PATCH


def _applier(spec: PatchSpec):
    def apply(module: ModuleType) -> None:
        try:
            apply_when_required(spec, module)
        except Exception as exc:  # the target's import must survive whatever happens here
            print(f'lmdeploy-pdfix: patch {spec.name!r} failed to load, LMDeploy left stock for it: {exc!r}',
                  file=sys.stderr)

    return apply


def apply_when_required(spec: PatchSpec, module: ModuleType) -> None:
    """Apply ``spec``'s patch once every patch it requires is applied in this process; refuse it if one cannot be.

    A requirement whose LMDeploy module is not imported yet is waited for, whatever the import order.
    """
    from lmdeploy_pdfix.patching import PatchState

    patch = load_patch(spec)
    problem = settings.problem_for(spec.name) or requirement_problem(spec)
    if problem is not None:
        patch.refuse(problem)
    else:
        pending = [name for name in spec.requires if load_patch(BY_NAME[name]).state is PatchState.PENDING]
        if pending:
            _waiting.setdefault(pending[0], []).append(lambda: apply_when_required(spec, module))
            return
        patch.apply(module)
    for settled in _waiting.pop(spec.name, []):
        settled()


def requirement_problem(spec: PatchSpec) -> str | None:
    """Why ``spec`` cannot apply because of a patch it requires, or None."""
    disabled = settings.disabled_patches()
    for name in spec.requires:
        if name in disabled:
            return f'requires {name}, which {settings.DISABLE} turns off'
        required = load_patch(BY_NAME[name])
        if required.state.value in ('refused', 'reverted'):
            return f'requires {name}, which is {required.state.value}' + (f': {required.reason}' if required.reason
                                                                          else '')
    return None


def run_from_startup() -> None:
    try:
        if settings.enabled():
            install_patches()
    except Exception as exc:
        print(f'lmdeploy-pdfix: start-up hook failed, LMDeploy left stock: {exc!r}', file=sys.stderr)

"""What the start-up hook runs. Registers import hooks only; never raises, never prints unless broken."""

from __future__ import annotations

import _thread
import importlib
import sys

from lmdeploy_pdfix import settings
from lmdeploy_pdfix._import_hooks import when_imported
from lmdeploy_pdfix.registry import PATCHES, PatchSpec

TYPE_CHECKING = False  # typing costs ~8 ms of start-up
if TYPE_CHECKING:
    from types import ModuleType

_lock = _thread.allocate_lock()
_installed = False


def install_patches() -> None:
    """Idempotent: a second call (a second hook, ``install()`` after the .pth) changes nothing."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    disabled = settings.disabled_patches()
    for spec in PATCHES:
        if spec.name not in disabled:
            when_imported(spec.target, _applier(spec))


def load_patch(spec: PatchSpec):
    """The patch object of ``spec`` (imports our patch module, which may import LMDeploy)."""
    return importlib.import_module(spec.module).PATCH


def _applier(spec: PatchSpec):
    def apply(module: ModuleType) -> None:
        try:
            load_patch(spec).apply(module)
        except Exception as exc:  # the target's import must survive whatever happens here
            print(f'lmdeploy-pdfix: patch {spec.name!r} failed to load, LMDeploy left stock for it: {exc!r}',
                  file=sys.stderr)

    return apply


def run_from_startup() -> None:
    try:
        if settings.enabled():
            install_patches()
        if settings.sim_enabled():
            from lmdeploy_pdfix.sim import activate

            activate()
    except Exception as exc:
        print(f'lmdeploy-pdfix: start-up hook failed, LMDeploy left stock: {exc!r}', file=sys.stderr)

"""Every patch applies, is idempotent, reverts to exactly what LMDeploy had, and applies again."""

from __future__ import annotations

import functools
import importlib

import pytest

from lmdeploy_pdfix._bootstrap import load_patch
from lmdeploy_pdfix.patching import PatchState, install_wrapper, remove_wrapper, wrapped_original
from lmdeploy_pdfix.registry import PATCHES, PatchSpec


def snapshot(module) -> dict[str, object]:
    """Every class attribute and route of the patched module, by identity."""
    seen: dict[str, object] = {}
    for name, value in vars(module).items():
        seen[name] = value
        if isinstance(value, type) and value.__module__ == module.__name__:
            seen.update({f'{name}.{attr}': item for attr, item in vars(value).items()})
    app = getattr(module, 'app', None)
    if app is not None:
        seen['routes'] = list(app.router.routes)
    return seen


def changed(before: dict[str, object], after: dict[str, object]) -> set[str]:
    return {name for name, value in after.items() if before.get(name) is not value and before.get(name) != value}


_ABSENT = object()


def declared(patch) -> dict[str, object]:
    """What each object the patch declares it wraps is now (lists and dicts by content: routes and handlers change
    in place)."""
    seen: dict[str, object] = {}
    for entry in patch.wraps:
        module_name, path = entry.split(':')
        value = importlib.import_module(module_name)
        for name in path.split('.'):
            value = vars(value).get(name, _ABSENT) if isinstance(value, type) else getattr(value, name, _ABSENT)
        seen[entry] = list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
    return seen


@pytest.mark.parametrize('spec', PATCHES, ids=[spec.name for spec in PATCHES])
def test_apply_changes_exactly_what_the_patch_declares_and_revert_restores_it(spec: PatchSpec) -> None:
    module = importlib.import_module(spec.target)
    patch = load_patch(spec)
    assert patch.wraps, f'{spec.name} declares nothing it wraps'
    stock = declared(patch)

    assert patch.apply(module) is PatchState.APPLIED
    patched = declared(patch)
    assert [entry for entry in patch.wraps if patched[entry] == stock[entry]] == [], 'declared but untouched'

    patch.revert()
    assert declared(patch) == stock


@pytest.mark.parametrize('spec', PATCHES, ids=[spec.name for spec in PATCHES])
def test_apply_revert_apply(spec: PatchSpec) -> None:
    module = importlib.import_module(spec.target)
    patch = load_patch(spec)

    def state() -> dict[str, object]:  # the target module, and whatever the patch touches beyond it
        return {**snapshot(module), **declared(patch)}

    stock = state()

    assert patch.apply(module) is PatchState.APPLIED
    patched = state()
    assert patched != stock
    assert patch.apply(module) is PatchState.APPLIED and state() == patched

    assert patch.revert() is PatchState.REVERTED
    assert state() == stock

    assert patch.apply(module) is PatchState.APPLIED
    assert changed(stock, state()) == changed(stock, patched)
    patch.revert()


def test_a_foreign_wrapper_over_ours_is_neither_stripped_nor_mistaken_for_ours() -> None:
    class Owner:
        def method(self) -> str:
            return 'stock'

    install_wrapper(Owner, 'method', lambda original: lambda self: f'ours({original(self)})', 'unit')
    ours = Owner.method

    @functools.wraps(ours)  # copies __dict__ and sets __wrapped__, as profilers and spies do
    def foreign(self) -> str:
        return f'foreign({ours(self)})'

    Owner.method = foreign
    remove_wrapper(Owner, 'method', 'unit')
    assert Owner.method is foreign, 'the foreign layer was stripped'

    install_wrapper(Owner, 'method', lambda original: lambda self: f'ours({original(self)})', 'unit')
    assert wrapped_original(Owner.method) is foreign
    assert Owner().method() == 'ours(foreign(ours(stock)))'


def test_units_wrapping_one_function_come_off_one_at_a_time_in_any_order() -> None:
    class Owner:
        def method(self) -> str:
            return 'stock'

    stock = Owner.method
    for unit in ('a', 'b', 'c'):
        install_wrapper(Owner, 'method', lambda original, unit=unit: lambda self: f'{unit}({original(self)})', unit)
        install_wrapper(Owner, 'method', lambda original: lambda self: 'twice', unit)  # once per unit
    assert Owner().method() == 'c(b(a(stock)))'

    remove_wrapper(Owner, 'method', 'b')
    assert Owner().method() == 'c(a(stock))'
    remove_wrapper(Owner, 'method', 'b')
    assert Owner().method() == 'c(a(stock))'
    remove_wrapper(Owner, 'method', 'c')
    assert Owner().method() == 'a(stock)'
    remove_wrapper(Owner, 'method', 'a')
    assert Owner.method is stock


def _renamed_in_init(module_name: str, cls: str):
    def rename(monkeypatch: pytest.MonkeyPatch) -> None:
        def __init__(self, *args, **kwargs) -> None:  # sets none of the attributes the patch reads
            self.renamed = True

        monkeypatch.setattr(getattr(importlib.import_module(module_name), cls), '__init__', __init__)

    return rename


RENAMED = {
    'proxy_distserve': lambda monkeypatch: monkeypatch.delattr(
        importlib.import_module('lmdeploy.serve.proxy.proxy').node_manager, 'aiotimeout'),
    'migration_faults': _renamed_in_init('lmdeploy.pytorch.engine.engine_loop', 'EngineLoop'),
    'engine_sessions': _renamed_in_init('lmdeploy.pytorch.paging.scheduler', 'Scheduler'),
}


@pytest.mark.parametrize('name', RENAMED)
def test_an_attribute_a_patch_reads_at_run_time_renamed_upstream_is_refused_at_apply(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = next(spec for spec in PATCHES if spec.name == name)
    module = importlib.import_module(spec.target)
    RENAMED[name](monkeypatch)
    patch = load_patch(spec)

    assert patch.apply(module) is PatchState.REFUSED
    assert ' has no ' in patch.reason
    patch.state, patch.reason = PatchState.PENDING, None  # other tests apply it afresh

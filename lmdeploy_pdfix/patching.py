"""Base class of every patch: version and shape guard, idempotent apply, mirror-image revert."""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.compat import lmdeploy_version, unsupported_version_reason


class PatchState(str, enum.Enum):
    PENDING = 'pending'  # its LMDeploy module has not been imported in this process
    APPLIED = 'applied'
    REFUSED = 'refused'
    REVERTED = 'reverted'


class Patch:
    """One correction of one LMDeploy module.

    Each unit's subclass lives in ``lmdeploy_pdfix/units/<name>/``; its ``name`` and ``target`` module come from
    :mod:`lmdeploy_pdfix.registry` by that folder. It implements ``shape_problem`` (why the module does not look
    like the code this patch was written against, or None) and ``_apply``, which wraps through :meth:`wrap` so
    that revert is its mirror image (``_revert`` only where a unit changes more than it wraps). Nothing of
    LMDeploy is touched unless every check passes.
    """

    # Every LMDeploy object this patch wraps, replaces or adds, as 'module:attribute.path'; the lifecycle test
    # checks that apply changes each of them, and revert restores every one.
    wraps: tuple[str, ...] = ()

    def __init__(self) -> None:
        from lmdeploy_pdfix.registry import BY_NAME, UNITS_PACKAGE

        folder = type(self).__module__.removeprefix(f'{UNITS_PACKAGE}.').split('.')[0]
        spec = BY_NAME[folder]  # a KeyError here: a unit outside its folder, or missing from the registry
        self.name, self.target = spec.name, spec.target
        self.state = PatchState.PENDING
        self.reason: str | None = None
        self._module: ModuleType | None = None
        self._wrapped: list[tuple[Any, str]] = []

    def shape_problem(self, module: ModuleType) -> str | None:
        raise NotImplementedError

    def _apply(self, module: ModuleType) -> None:
        raise NotImplementedError

    def _revert(self, module: ModuleType) -> None:
        """Take off every layer :meth:`wrap` put on, last first; a unit that changes more undoes that too."""
        while self._wrapped:
            owner, attribute = self._wrapped.pop()
            remove_wrapper(owner, attribute, self.name)

    def refusal(self, module: ModuleType) -> str | None:
        """Why this patch must not touch ``module``, or None when it may."""
        reason = unsupported_version_reason(lmdeploy_version())
        if reason is None:
            reason = self.shape_problem(module)
        return reason

    def apply(self, module: ModuleType) -> PatchState:
        if self.state is PatchState.APPLIED:
            return self.state
        reason = self.refusal(module)
        if reason is not None:
            self.refuse(reason)
            return self.state
        try:
            self._apply(module)
        except Exception as exc:  # leave LMDeploy stock rather than half-patched
            self._revert_quietly(module)
            self.refuse(f'applying failed: {exc!r}')
            return self.state
        self._module = module
        self.state = PatchState.APPLIED
        self.reason = None
        return self.state

    def revert(self) -> PatchState:
        if self.state is PatchState.APPLIED and self._module is not None:
            self._revert(self._module)
            self.state = PatchState.REVERTED
        return self.state

    def _revert_quietly(self, module: ModuleType) -> None:
        with contextlib.suppress(Exception):  # best effort after a failed apply
            self._revert(module)

    def wrap(self, owner: Any, attribute: str, make_wrapper: Callable[[Any], Any]) -> None:
        """This unit's layer over ``owner.attribute`` (see :func:`install_wrapper`); revert takes it off."""
        install_wrapper(owner, attribute, make_wrapper, self.name)
        self._wrapped.append((owner, attribute))

    def refuse(self, reason: str) -> None:
        """Leave LMDeploy stock for this patch, saying why (logged once)."""
        first_time = self.state is not PatchState.REFUSED
        self.state = PatchState.REFUSED
        self.reason = reason
        if first_time:
            warn(f'patch {self.name!r} not applied, LMDeploy left stock for it: {reason}')


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as LMDeploy's logger would, the first time ``key`` is warned about in this process."""
    if key not in _warned:
        _warned.add(key)
        warn(message)


def warn(message: str) -> None:
    """Log ``message`` as a WARNING of LMDeploy's logger.

    That logger drops a WARNING whose unformatted text it has shown before (its ``FilterDuplicateWarning``), so
    the message is formatted here: two refusals with different reasons are both shown.
    """
    lmdeploy_logger().warning(f'lmdeploy-pdfix: {message}')


def lmdeploy_logger() -> logging.Logger:
    try:
        from lmdeploy.utils import get_logger
    except ImportError:
        return logging.getLogger('lmdeploy')
    return get_logger('lmdeploy')


class _Layer:
    """One wrapper of ours: what it replaced, the unit that put it there, and how to build it again."""

    __slots__ = ('make', 'original', 'unit')

    def __init__(self, original: Any, unit: str, make: Callable[[Any], Any] | None) -> None:
        self.original, self.unit, self.make = original, unit, make


# Our wrappers, each mapped to its layer. A registry, not a marker attribute: functools.wraps copies a
# function's __dict__, so a foreign wrapper put over ours (a profiler, a test's spy) would carry a marker too,
# and removing "our" wrapper would then strip the foreign layer, and installing again be fooled into a no-op.
_LAYERS: weakref.WeakKeyDictionary[Any, _Layer] = weakref.WeakKeyDictionary()


def _layer_of(function: Any) -> _Layer | None:
    try:
        return _LAYERS.get(function)
    except TypeError:  # not weakly referenceable: certainly not ours
        return None


def wrapped_original(function: Any) -> Any:
    """The function a wrapper of ours replaced, or None if ``function`` is not one of our wrappers."""
    layer = _layer_of(function)
    return None if layer is None else layer.original


def innermost(function: Any) -> Any:
    """What lies under every layer of ours on ``function`` (LMDeploy's own, or a foreign layer)."""
    while (layer := _layer_of(function)) is not None:
        function = layer.original
    return function


def register_wrapper(wrapper: Any, original: Any, unit: str = '') -> Any:
    """Record ``wrapper`` as ours, standing in for ``original``; returns ``wrapper``."""
    _LAYERS[wrapper] = _Layer(original, unit, None)
    return wrapper


def _build(original: Any, unit: str, make_wrapper: Callable[[Any], Any]) -> Any:
    wrapper = functools.update_wrapper(make_wrapper(original), original)
    _LAYERS[wrapper] = _Layer(original, unit, make_wrapper)
    return wrapper


def install_wrapper(owner: Any, attribute: str, make_wrapper: Callable[[Any], Any], unit: str) -> None:
    """Put ``make_wrapper(current)`` over ``owner.attribute``, once per unit: units may wrap one function."""
    current = getattr(owner, attribute)
    if _unit_layers(current, unit)[1] is None:
        setattr(owner, attribute, _build(current, unit, make_wrapper))


def remove_wrapper(owner: Any, attribute: str, unit: str) -> None:
    """Take ``unit``'s layer out of ``owner.attribute``; other units' layers above it are built again over
    what lay below it. Nothing happens if the unit has no layer there (or a foreign layer hides it)."""
    above, layer = _unit_layers(getattr(owner, attribute, None), unit)
    if layer is None:
        return
    rebuilt = layer.original
    for other in reversed(above):
        rebuilt = _build(rebuilt, other.unit, other.make)
    setattr(owner, attribute, rebuilt)


def _unit_layers(function: Any, unit: str) -> tuple[list[_Layer], _Layer | None]:
    """The layers of ours over ``unit``'s on ``function``, top first, and ``unit``'s own (None if absent)."""
    above = []
    while (layer := _layer_of(function)) is not None and layer.make is not None:
        if layer.unit == unit:
            return above, layer
        above.append(layer)
        function = layer.original
    return above, None


def signature_problem(owner: Any, attribute: str, parameters: Sequence[str]) -> str | None:
    """Why ``owner.attribute`` is not a callable taking exactly ``parameters``, or None."""
    where = f'{getattr(owner, "__name__", owner)}.{attribute}'
    target = getattr(owner, attribute, None)
    if not callable(target):
        return f'{where} is missing'
    target = innermost(target)
    try:
        found = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return f'{where} has no readable signature'
    if found != list(parameters):
        return f'{where} takes {found}, this patch was written for {list(parameters)}'
    return None


def coroutine_problem(owner: Any, attribute: str) -> str | None:
    """Why ``owner.attribute`` is not a coroutine function (an async wrapper could not stand in), or None."""
    target = getattr(owner, attribute)
    if not inspect.iscoroutinefunction(innermost(target)):
        return f'{owner.__name__}.{attribute} is not a coroutine function'
    return None


def attribute_problem(cls: Any, names: Sequence[str]) -> str | None:
    """Why instances of ``cls`` may lack one of ``names`` that a patch reads at run time, or None.

    An instance attribute cannot be looked up before an instance exists, so it counts as present when it is a
    class attribute or property, a dataclass field, or a name ``__init__`` uses (``self.name = …`` puts it in the
    code's names). A rename upstream is then refused at apply instead of failing on every request.
    """
    init = getattr(cls, '__init__', None)
    code = getattr(innermost(init), '__code__', None)
    known = {*getattr(cls, '__dataclass_fields__', {}), *(code.co_names if code is not None else ())}
    missing = [name for name in names if not hasattr(cls, name) and name not in known]
    return f'{cls.__name__} has no {", ".join(missing)}' if missing else None


def first_problem(*problems: str | None) -> str | None:
    return next((problem for problem in problems if problem is not None), None)


def unit_applied(name: str) -> bool:
    """Whether the unit called ``name`` is applied in this process; asked without importing it (a unit is
    imported once its target is), so that no unit imports another."""
    import sys

    from lmdeploy_pdfix.registry import BY_NAME

    patch = getattr(sys.modules.get(BY_NAME[name].module), 'PATCH', None)
    return getattr(patch, 'state', None) is PatchState.APPLIED


def installation() -> dict[str, Any]:
    """What this process runs, for the audit routes and ``doctor``: versions, and the units applied here."""
    from lmdeploy_pdfix import __version__
    from lmdeploy_pdfix.registry import PATCHES

    applied = [spec.name for spec in PATCHES if unit_applied(spec.name)]
    return {'lmdeploy': lmdeploy_version(), 'lmdeploy_pdfix': __version__, 'units': applied}

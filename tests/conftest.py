"""Shared test machinery.

Regression tests (``@pytest.mark.regression``) specify operator-visible behaviour that stock LMDeploy gets
wrong. They take their patches from the ``apply_patch`` fixture; with ``PDFIX_TESTS_STOCK=1`` that fixture
applies nothing, so the same tests run against stock LMDeploy and must fail there
(``scripts/prove_regressions.py`` checks that every one of them does).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from lmdeploy_pdfix import settings
from lmdeploy_pdfix._bootstrap import load_patch
from lmdeploy_pdfix.registry import BY_NAME

STOCK = os.environ.get('PDFIX_TESTS_STOCK') == '1'


def pytest_configure(config: pytest.Config) -> None:
    if settings.enabled():
        raise pytest.UsageError(f'run the tests with {settings.TOGGLE} unset: each test applies what it needs')


@pytest.fixture
def apply_patch() -> Iterator[Callable[[str], ModuleType]]:
    """``apply_patch(name)`` imports the patch's LMDeploy module, patches it (unless STOCK) and returns it."""
    applied = []

    def apply(name: str) -> ModuleType:
        spec = BY_NAME[name]
        module = importlib.import_module(spec.target)
        if not STOCK:
            patch = load_patch(spec)
            patch.apply(module)
            assert patch.reason is None, patch.reason
            applied.append(patch)
        return module

    yield apply
    for patch in reversed(applied):
        patch.revert()

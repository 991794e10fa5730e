"""One source of truth: the README's tables, the entry points and ``status`` all come from the registry and settings."""

from __future__ import annotations

import sys
from pathlib import Path

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.registry import BY_NAME, PATCHES
from lmdeploy_pdfix.tools.cli import status_report

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'scripts'))
from readme_tables import PATCHES_HEADER, README, SWITCHES_HEADER, patch_rows, switch_rows, table_rows  # noqa: E402


def readme_rows(header: str) -> list[str]:
    lines = README.read_text().split('\n')
    return lines[table_rows(lines, header)]


def test_the_readme_lists_every_switch_as_the_settings_declare_it() -> None:
    assert readme_rows(SWITCHES_HEADER) == switch_rows(), 'run scripts/readme_tables.py'


def test_the_readme_lists_every_patch_as_the_registry_declares_it() -> None:
    assert readme_rows(PATCHES_HEADER) == patch_rows(), 'run scripts/readme_tables.py'


def test_status_reports_every_patch_of_the_registry() -> None:
    assert [row['name'] for row in status_report()['patches']] == [spec.name for spec in PATCHES]


def test_every_requirement_names_a_patch_listed_before_it() -> None:
    order = [spec.name for spec in PATCHES]
    for spec in PATCHES:
        assert all(name in BY_NAME and order.index(name) < order.index(spec.name) for name in spec.requires)


def test_every_switch_tunes_known_patches() -> None:
    assert all(set(setting.patches) <= set(BY_NAME) for setting in settings.NUMBERS)

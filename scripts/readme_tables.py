"""The README's tables of switches and patches, generated from ``settings`` and ``registry``.

``python scripts/readme_tables.py`` rewrites them in README.md; ``tests/test_docs.py`` checks the README holds
exactly these rows.
"""

from __future__ import annotations

from pathlib import Path

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.registry import PATCHES


def switch_rows() -> list[str]:
    rows = [
        f'| `{settings.TOGGLE}=1` | apply the fixes in every Python process of this environment (`.pth` start-up '
        'hook; the spawned engine process inherits it). Unset, empty or `0`: LMDeploy is exactly stock and nothing '
        'of this package is imported |',
        f'| `{settings.DISABLE}=name,name` | leave single patches out (names from `lmdeploy-pdfix status`; a patch '
        'that requires one left out stays stock too; unknown names are reported) |',
    ]
    rows += [f'| `{setting.name}` ({setting.node}, default {setting.default:g}) | {setting.help} |'
             for setting in settings.NUMBERS]
    rows += [f'| `{setting.name}` ({setting.node}, unset by default) | {setting.help} |' for setting in settings.TEXTS]
    rows += [f'| `{setting.name}` ({setting.node}, off by default) | {setting.help} |' for setting in settings.FLAGS]
    return rows


def patch_rows() -> list[str]:
    return [f'| `{spec.name}` | `{spec.target.removeprefix("lmdeploy.")}` | '
            f'{", ".join(f"`{name}`" for name in spec.requires) or "-"} | {spec.summary} |' for spec in PATCHES]


SWITCHES_HEADER = '| variable | effect |'
PATCHES_HEADER = '| name | LMDeploy module | requires | fix |'
README = Path(__file__).resolve().parent.parent / 'README.md'


def table_rows(lines: list[str], header: str) -> slice:
    """Where the rows of the table under ``header`` stand in ``lines``."""
    start = lines.index(header) + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith('|'))
    return slice(start, end)


def main() -> None:
    lines = README.read_text().split('\n')
    for header, rows in ((SWITCHES_HEADER, switch_rows()), (PATCHES_HEADER, patch_rows())):
        lines[table_rows(lines, header)] = rows
    README.write_text('\n'.join(lines))


if __name__ == '__main__':
    main()

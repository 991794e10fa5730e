"""The README's tables of switches and patches, generated from ``settings`` and ``registry``.

``python scripts/readme_tables.py`` prints them; ``tests/test_docs.py`` checks the README holds exactly these rows.
"""

from __future__ import annotations

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
             for setting in settings.DURATIONS]
    return rows


def patch_rows() -> list[str]:
    return [f'| `{spec.name}` | `{spec.target.removeprefix("lmdeploy.")}` | '
            f'{", ".join(f"`{name}`" for name in spec.requires) or "-"} | {spec.summary} |' for spec in PATCHES]


if __name__ == '__main__':
    print('| variable | effect |\n|---|---|')
    print('\n'.join(switch_rows()))
    print('\n| name | LMDeploy module | requires | fix |\n|---|---|---|---|')
    print('\n'.join(patch_rows()))

"""Reading pytest's JUnit report: which tests failed, and why, in one line each."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def outcomes(report: Path) -> dict[str, str | None]:
    """Test id -> the first line of its failure or error, or None where it passed (or was skipped)."""
    return {f"{case.get('classname')}::{case.get('name')}": _problem(case)
            for case in ElementTree.parse(report).getroot().iter('testcase')}


def _problem(case: ElementTree.Element) -> str | None:
    for child in case:
        if child.tag in ('failure', 'error'):
            return (child.get('message') or child.tag).partition('\n')[0]
    return None


def main() -> int:
    """Print the failures of the report named on the command line: the last lines a CI log shows."""
    report = Path(sys.argv[1])
    if not report.exists():
        print(f'\n{report} was not written: pytest broke down before it ended')
        return 1
    failed = {name: why for name, why in outcomes(report).items() if why is not None}
    print(f'\n{len(failed)} failed in {sys.argv[1]}:' if failed else f'\nno failures in {sys.argv[1]}')
    for name, why in failed.items():
        print(f'  FAILED {name}: {why[:300]}')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())

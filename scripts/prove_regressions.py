"""Every regression test must be able to fail: run them against stock LMDeploy and check each one fails.

Runs ``pytest -m regression`` with ``PDFIX_TESTS_STOCK=1`` (no patch applied) and reads the JUnit report.
Prints one line per test and exits non-zero if any regression test passed on stock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def stock_outcomes(extra_args: list[str]) -> dict[str, bool]:
    """Test id -> whether it failed on stock LMDeploy."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / 'stock.xml'
        env = {**os.environ, 'PDFIX_TESTS_STOCK': '1'}
        subprocess.run([sys.executable, '-m', 'pytest', '-m', 'regression and not e2e', '-q', '-p', 'no:cacheprovider',
                        f'--junitxml={report}', *extra_args], env=env, check=False)
        cases = ElementTree.parse(report).getroot().iter('testcase')
        return {f"{case.get('classname')}::{case.get('name')}": any(
            child.tag in ('failure', 'error') for child in case) for case in cases}


def main() -> int:
    outcomes = stock_outcomes(sys.argv[1:])
    passed_on_stock = [name for name, failed in outcomes.items() if not failed]
    print(f'\nregression tests on stock LMDeploy: {len(outcomes) - len(passed_on_stock)} of {len(outcomes)} fail, '
          'as they must')
    for name in passed_on_stock:
        print(f'  PASSED ON STOCK (cannot fail): {name}')
    return 1 if passed_on_stock or not outcomes else 0


if __name__ == '__main__':
    sys.exit(main())

"""Every regression test must be able to fail: run them against stock LMDeploy and check each one fails.

Runs ``pytest -m regression`` with ``PDFIX_TESTS_STOCK=1`` (no patch applied) and reads the JUnit report.
Prints one line per test and exits non-zero if any regression test passed on stock, or if pytest itself broke
down (an internal error or an interrupted run proves nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from junit import outcomes

TESTS_FAILED = 1  # pytest's exit code when every test ran and some failed: the expected outcome here


def stock_outcomes(extra_args: list[str]) -> tuple[int, dict[str, bool]]:
    """pytest's exit code, and test id -> whether it failed on stock LMDeploy."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / 'stock.xml'
        env = {**os.environ, 'PDFIX_TESTS_STOCK': '1'}
        # --tb=no: only outcomes count here, and rendering tracebacks of stock's failures once tripped CPython
        # 3.11's parser ("AST constructor recursion depth mismatch"), which ends the pytest run
        run = subprocess.run([sys.executable, '-m', 'pytest', '-m', 'regression and not e2e', '-q', '--tb=no',
                              '-p', 'no:cacheprovider', f'--junitxml={report}', *extra_args], env=env, check=False)
        return run.returncode, {name: why is not None for name, why in outcomes(report).items()}


def main() -> int:
    returncode, failed_on_stock = stock_outcomes(sys.argv[1:])
    if returncode != TESTS_FAILED:
        print(f'\npytest on stock LMDeploy ended with exit code {returncode}, not {TESTS_FAILED}: '
              'the run proves nothing')
        return 1
    passed_on_stock = [name for name, failed in failed_on_stock.items() if not failed]
    failed = len(failed_on_stock) - len(passed_on_stock)
    print(f'\nregression tests on stock LMDeploy: {failed} of {len(failed_on_stock)} fail, as they must')
    for name in passed_on_stock:
        print(f'  PASSED ON STOCK (cannot fail): {name}')
    return 1 if passed_on_stock or not failed_on_stock else 0


if __name__ == '__main__':
    sys.exit(main())

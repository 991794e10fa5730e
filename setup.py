"""Build glue that setup.cfg cannot express: the start-up hook at the wheel root, and the LMDeploy extra."""

import ast
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # setuptools' isolated build does not put the project on the path

from setup_hooks import build_py_with_startup_hook  # noqa: E402


def lmdeploy_requirement() -> str:
    """LMDEPLOY_REQUIREMENT from lmdeploy_pdfix/compat.py, read without importing the package."""
    tree = ast.parse((HERE / 'lmdeploy_pdfix' / 'compat.py').read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ['LMDEPLOY_REQUIREMENT']:
            return ast.literal_eval(node.value)
    raise RuntimeError('LMDEPLOY_REQUIREMENT not found in lmdeploy_pdfix/compat.py')


setup(
    cmdclass={'build_py': build_py_with_startup_hook(HERE / 'lmdeploy_pdfix.pth')},
    extras_require={'lmdeploy': [lmdeploy_requirement()]},
)

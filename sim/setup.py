"""The emulation's start-up hook at the wheel root, as the shipped package places its own."""

import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # built from this repository only, beside the shipped package

from setup_hooks import build_py_with_startup_hook  # noqa: E402

setup(cmdclass={'build_py': build_py_with_startup_hook(HERE / 'lmdeploy_pdfix_sim.pth')})

"""Build glue that setup.cfg cannot express: the start-up hook at the wheel root, and the LMDeploy extra."""

import ast
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
STARTUP_HOOK = 'lmdeploy_pdfix.pth'


def lmdeploy_requirement() -> str:
    """LMDEPLOY_REQUIREMENT from lmdeploy_pdfix/compat.py, read without importing the package."""
    tree = ast.parse((HERE / 'lmdeploy_pdfix' / 'compat.py').read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ['LMDEPLOY_REQUIREMENT']:
            return ast.literal_eval(node.value)
    raise RuntimeError('LMDEPLOY_REQUIREMENT not found in lmdeploy_pdfix/compat.py')


class BuildWithStartupHook(build_py):
    """Places the .pth next to the package, i.e. at the root of purelib once installed."""

    def run(self):
        super().run()
        self.copy_file(str(HERE / STARTUP_HOOK), str(Path(self.build_lib) / STARTUP_HOOK), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / STARTUP_HOOK)]


setup(
    cmdclass={'build_py': BuildWithStartupHook},
    # plot: `lmdeploy-pdfix soak` draws its samples with matplotlib
    extras_require={'lmdeploy': [lmdeploy_requirement()], 'plot': ['matplotlib']},
)

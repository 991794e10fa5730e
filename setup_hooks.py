"""Build glue shared by this repository's two distributions: a start-up hook (a ``.pth``) at the wheel root."""

from pathlib import Path

from setuptools.command.build_py import build_py


def build_py_with_startup_hook(hook: Path) -> type[build_py]:
    """A ``build_py`` that places ``hook`` next to the package, i.e. at the root of purelib once installed."""

    class BuildWithStartupHook(build_py):
        def run(self):
            super().run()
            self.copy_file(str(hook), str(Path(self.build_lib) / hook.name), preserve_mode=0)

        def get_outputs(self, include_bytecode=True):
            return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / hook.name)]

    return BuildWithStartupHook

"""Fresh LMDeploy imports without a fresh interpreter's cost: children of one warm interpreter.

The warm interpreter imports the third-party modules LMDeploy's own imports spend most of their time in (torch,
transformers, the OpenAI client, FastAPI: about 5 s of CPU) and nothing of LMDeploy or of this package; each case
then runs in a child forked from it, with LMDeploy imported for the first time there. Only for cases that need
nothing of interpreter start-up: the start-up hook's own tests start real interpreters (``run_python``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WARM_MODULES = ('torch', 'transformers', 'openai', 'fastapi', 'aiohttp', 'mmengine', 'uvicorn', 'requests')
SERVER = f"""
import importlib, json, os, sys, traceback
for name in {WARM_MODULES!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
print('ready', flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        out = os.open(job['out'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        status = 0
        try:
            os.chdir(job['cwd'])
            exec(compile(job['code'], '<case>', 'exec'), {{'__name__': '__main__'}})
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, waited = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(waited)), flush=True)
"""


class WarmInterpreter:
    """``run(code, cwd)`` runs ``code`` in a fresh child and returns its exit status and output."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        # started outside the repository, so that the installed package is the one imported
        self._server = subprocess.Popen([sys.executable, '-c', SERVER], env=env, cwd=cwd, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self._server.stdout.readline().strip() == 'ready'

    def run(self, code: str, cwd: Path) -> subprocess.CompletedProcess:
        """What ``python -c code`` started in ``cwd`` would give, its stderr within its stdout."""
        out = cwd / 'case.out'
        self._server.stdin.write(json.dumps({'code': code, 'cwd': str(cwd), 'out': str(out)}) + '\n')
        self._server.stdin.flush()
        status = json.loads(self._server.stdout.readline())
        return subprocess.CompletedProcess(['<forked>'], status, out.read_text(), '')

    def close(self) -> None:
        self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()

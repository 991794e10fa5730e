"""A node's engine process starts even when its api_server leaves the start-up handshake early (D22).

LMDeploy's real ``ZMQMPEngine._mp_proc`` runs in a fresh interpreter, as the spawned engine process does, with
the parent's side played out exactly as the race goes on a loaded host: the parent reads the RPC port and shuts
its Manager down before the child has notified and released the Manager's condition. The engine build that
follows the handshake is stood in for (no model here): reaching it means the engine process lives on.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest

from tests.conftest import STOCK

ENGINE_BUILT = 'the engine process went on to build its engine'

CHILD = f'''
import multiprocessing as mp
import lmdeploy.pytorch.engine as engine_package
from lmdeploy.pytorch.engine.mp_engine import zmq_engine
from lmdeploy_pdfix._bootstrap import load_patch
from lmdeploy_pdfix.registry import BY_NAME

if not {STOCK!r}:
    patch = load_patch(BY_NAME['engine_start'])
    patch.apply(zmq_engine)
    assert patch.reason is None, patch.reason


class EngineBuilt(Exception):
    pass


def build_engine(*args, **kwargs):
    raise EngineBuilt


engine_package.Engine.from_pretrained = build_engine

if __name__ == '__main__':
    manager = mp.Manager()
    condition = manager.Condition()

    class ParentLeavesOnThePort(dict):
        """The api_server's side: it sees the port and leaves ``with mp.Manager()`` at once."""

        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            manager.shutdown()

    try:
        zmq_engine.ZMQMPEngine._mp_proc(ParentLeavesOnThePort(), condition, model_path='no-model')
    except EngineBuilt:
        print({ENGINE_BUILT!r})
    except BaseException as exc:
        print('the engine process died:', repr(exc))
'''


@pytest.mark.regression
def test_an_engine_process_outlives_an_api_server_that_leaves_the_handshake_once_it_has_the_port() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith('LMDEPLOY_PDFIX')}
    run = subprocess.run([sys.executable, '-c', CHILD], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert run.stdout.strip().splitlines()[-1:] == [ENGINE_BUILT], run.stdout + run.stderr[-2000:]


def test_the_spawned_engine_process_finds_the_patched_entry_point_by_name(
        apply_patch: Callable[[str], ModuleType]) -> None:
    zmq_engine = apply_patch('engine_start')
    entry = zmq_engine.ZMQMPEngine._mp_proc
    assert pickle.loads(pickle.dumps(entry)) is entry

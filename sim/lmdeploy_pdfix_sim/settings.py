"""Every switch of the emulation, declared and read here (the shipped package's own are in
:mod:`lmdeploy_pdfix.settings`). The cluster sets them in each node's environment; no operator sets them."""

from __future__ import annotations

import os

from lmdeploy_pdfix.settings import is_truthy

TOGGLE = 'LMDEPLOY_PDFIX_SIM'  # 1: this interpreter is a node of a GPU-free cluster
NUM_BLOCKS = 'LMDEPLOY_PDFIX_SIM_NUM_BLOCKS'  # KV blocks of each node
DROP_KV = 'LMDEPLOY_PDFIX_SIM_DROP_KV'  # 1: a Decode skips the KV copy (a negative control)
RAW_START = 'LMDEPLOY_PDFIX_SIM_RAW_START'  # 1: a stock node starts as LMDeploy's does, race included (D22)
FAULTS = 'LMDEPLOY_PDFIX_SIM_FAULTS'  # the folder where a test drops the faults a node injects
STATE = 'LMDEPLOY_PDFIX_SIM_STATE'  # the file where an engine publishes its scheduler's state
MISSHAPE = 'LMDEPLOY_PDFIX_SIM_MISSHAPE'  # module:attribute.path made the wrong shape before any unit sees it


def enabled() -> bool:
    return is_truthy(os.environ.get(TOGGLE))


def num_blocks() -> int:
    return int(os.environ.get(NUM_BLOCKS, '0') or 0)


def drops_kv() -> bool:
    return is_truthy(os.environ.get(DROP_KV))


def raw_start() -> bool:
    return is_truthy(os.environ.get(RAW_START))


def faults_folder() -> str | None:
    return os.environ.get(FAULTS) or None


def state_file() -> str | None:
    return os.environ.get(STATE) or None


def misshapen_target() -> str | None:
    return os.environ.get(MISSHAPE) or None

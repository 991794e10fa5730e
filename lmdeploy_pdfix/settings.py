"""Environment switches. Standard library only: read at interpreter start-up."""

from __future__ import annotations

import os

TOGGLE = 'LMDEPLOY_PDFIX'
DISABLE = 'LMDEPLOY_PDFIX_DISABLE'
SIM_TOGGLE = 'LMDEPLOY_PDFIX_SIM'

_TRUE = frozenset({'1', 'true', 'yes', 'on'})


def is_truthy(value: str | None) -> bool:
    return (value or '').strip().lower() in _TRUE


def enabled() -> bool:
    """Whether the operator switched the fixes on (``LMDEPLOY_PDFIX=1``)."""
    return is_truthy(os.environ.get(TOGGLE))


def sim_enabled() -> bool:
    """Whether this interpreter belongs to a GPU-free emulated cluster node."""
    return is_truthy(os.environ.get(SIM_TOGGLE))


def disabled_patches() -> frozenset[str]:
    """Patch names the operator opted out of (``LMDEPLOY_PDFIX_DISABLE=name,name``)."""
    raw = os.environ.get(DISABLE, '')
    return frozenset(name.strip() for name in raw.split(',') if name.strip())

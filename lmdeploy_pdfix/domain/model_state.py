"""Which per-sequence state of a model a DistServe migration leaves behind (D9). No patching here.

A migration copies the blocks of the main model's block caches, nothing else (0.17: the one pool of K/V, quant
and ``cache_shapes`` caches; 0.18: every pool of its cache plan, K/V or not). State kept per sequence in state
slots is never registered for migration: linear-attention and SSM state (``states_shapes``; Qwen3-Next, the
Qwen3.5 families, InternS2), and DeepSeek-V4's window and compressor state (``state_cache_specs``). 0.17 keeps
named block caches (``block_cache_specs``: DeepSeek-V3.2's and GLM-DSA's indexer keys) in pools of their own,
which its migration refuses to register only once a Prefill and a Decode try to link.

The rule reads the fields a model config declares, not LMDeploy's version: a field a version lacks is empty.
"""

from __future__ import annotations

from typing import Any


def unmigrated_state(config: Any) -> str | None:
    """What per-sequence state of the model ``config`` describes a migration would not copy, or None."""
    state_caches = [spec.name for spec in getattr(config, 'state_cache_specs', None) or ()]
    if state_caches:
        return f'per-sequence state caches ({", ".join(state_caches)}) kept in state slots'
    if getattr(config, 'states_shapes', None):
        return 'per-sequence linear-attention or SSM state kept in state slots'
    block_caches = [spec.name for spec in getattr(config, 'block_cache_specs', None) or ()]
    if block_caches:
        return (f'named block caches ({", ".join(block_caches)}) in pools of their own, which this LMDeploy '
                'version cannot register for migration')
    return None

"""Engine-side DistServe rules that need no cluster: which models a Prefill or Decode engine may serve (D9),
and that reclaiming orphaned caches goes on whatever one pass meets.

The cluster suite (tests/e2e/test_engine_faults.py) covers what the engine does with preserved caches.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

HYBRID_CONFIG = {
    'architectures': ['Qwen3NextForCausalLM'], 'model_type': 'qwen3_next', 'hidden_size': 256,
    'intermediate_size': 512, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2,
    'head_dim': 64, 'vocab_size': 1000, 'full_attention_interval': 4, 'linear_conv_kernel_dim': 4,
    'linear_key_head_dim': 32, 'linear_value_head_dim': 32, 'linear_num_key_heads': 4,
    'linear_num_value_heads': 8, 'num_experts': 4, 'num_experts_per_tok': 2, 'decoder_sparse_step': 1,
    'moe_intermediate_size': 128, 'shared_expert_intermediate_size': 128, 'max_position_embeddings': 4096,
    'rms_norm_eps': 1e-6, 'rope_theta': 10000, 'torch_dtype': 'float16', 'partial_rotary_factor': 0.25,
    'mlp_only_layers': [], 'norm_topk_prob': True,
}


class ReachedEngineBuild(Exception):
    """The engine went on to check its environment and build its executor (which needs a GPU)."""


def refuse_to_build(*args, **kwargs):
    raise ReachedEngineBuild


@pytest.fixture
def hybrid_model(tmp_path: Path) -> str:
    (tmp_path / 'config.json').write_text(json.dumps(HYBRID_CONFIG))
    return str(tmp_path)


def start_engine(module, model_path: str, role_name: str) -> None:
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.disagg.config import EngineRole

    module.Engine(model_path, PytorchEngineConfig(role=EngineRole[role_name]))


@pytest.mark.regression
@pytest.mark.parametrize('role', ['Prefill', 'Decode'])
def test_a_disaggregated_engine_refuses_a_model_whose_state_is_not_plain_kv(apply_patch, hybrid_model: str,
                                                                            role: str, monkeypatch) -> None:
    module = apply_patch('engine_sessions')
    monkeypatch.setattr(module, 'EngineChecker', refuse_to_build)
    with pytest.raises(ValueError, match=r'DistServe migrates KV blocks only.*--role Hybrid'):
        start_engine(module, hybrid_model, role)


def test_a_hybrid_engine_still_serves_such_a_model(apply_patch, hybrid_model: str, monkeypatch) -> None:
    module = apply_patch('engine_sessions')
    monkeypatch.setattr(module, 'EngineChecker', refuse_to_build)
    with pytest.raises(Exception) as raised:  # it goes on to what needs a GPU here
        start_engine(module, hybrid_model, 'Hybrid')
    assert 'DistServe migrates KV blocks only' not in str(raised.value)


async def test_orphan_reclamation_goes_on_after_a_pass_that_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdeploy_pdfix.patches import engine as engine_sessions
    from lmdeploy_pdfix.preserved import PreservedBook

    passes = []

    def reclaim_orphans(engine) -> list[int]:
        passes.append(engine)
        if len(passes) == 1:
            raise RuntimeError('a scheduler in an unexpected state')
        return []

    monkeypatch.setattr(engine_sessions, 'reclaim_orphans', reclaim_orphans)
    engine = SimpleNamespace()
    monkeypatch.setattr(engine_sessions, 'book_of', lambda engine: PreservedBook(orphan_ttl_s=0.04))
    reclaimer = asyncio.ensure_future(engine_sessions._reclaim_periodically(engine))
    await asyncio.sleep(0.1)
    reclaimer.cancel()
    assert len(passes) >= 2, 'the first failing pass ended reclamation'

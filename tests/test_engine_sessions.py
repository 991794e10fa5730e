"""Engine-side DistServe rules that need no cluster: which models a Prefill or Decode engine may serve (D9),
and that reclaiming orphaned caches goes on whatever one pass meets.

The model families are LMDeploy's own config builders, fed the ``config.json`` of a small model of each
family (no weights). The cluster suite (tests/e2e/test_engine_faults.py) covers what the engine does with
preserved caches.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmdeploy_pdfix.compat import lmdeploy_version
from lmdeploy_pdfix.domain.model_state import unmigrated_state

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
_BASE = {'hidden_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 64,
         'num_hidden_layers': 4, 'vocab_size': 1000, 'bos_token_id': 0, 'eos_token_id': 1, 'torch_dtype': 'float16'}
_LINEAR = {'linear_key_head_dim': 32, 'linear_value_head_dim': 32, 'linear_num_key_heads': 4,
           'linear_num_value_heads': 8, 'linear_conv_kernel_dim': 4}
_TEXT_3_5 = {**_BASE, **_LINEAR, 'layer_types': ['linear_attention'] * 3 + ['full_attention']}
_MLA = {'hidden_size': 256, 'num_attention_heads': 4, 'num_hidden_layers': 4, 'vocab_size': 1000, 'bos_token_id': 0,
        'eos_token_id': 1, 'torch_dtype': 'float16', 'kv_lora_rank': 64, 'qk_rope_head_dim': 16,
        'qk_nope_head_dim': 32, 'v_head_dim': 32, 'q_lora_rank': None}
_INDEXER = {'index_topk': 64, 'index_head_dim': 128, 'index_n_heads': 4}
# one small model of each family LMDeploy ships a config builder for that declares more than plain KV, and controls
FAMILIES = {
    'llama': {**_BASE, 'model_type': 'llama', 'architectures': ['LlamaForCausalLM']},
    'deepseek_v3': {**_MLA, 'model_type': 'deepseek_v3', 'architectures': ['DeepseekV3ForCausalLM']},
    'qwen3_next': HYBRID_CONFIG,
    'qwen3_5': {'model_type': 'qwen3_5', 'architectures': ['Qwen3_5ForConditionalGeneration'],
                'torch_dtype': 'float16', 'text_config': _TEXT_3_5},
    'qwen3_5_moe': {'model_type': 'qwen3_5_moe', 'architectures': ['Qwen3_5MoeForConditionalGeneration'],
                    'torch_dtype': 'float16', 'text_config': {**_TEXT_3_5, 'num_experts': 4}},
    'intern_s2_preview': {'model_type': 'intern_s2_preview', 'architectures': ['Qwen3_5MoeForConditionalGeneration'],
                          'torch_dtype': 'float16', 'text_config': _TEXT_3_5},
    'interns2_mobius': {'model_type': 'interns2_mobius', 'architectures': ['InternS2MobiusForConditionalGeneration'],
                        'torch_dtype': 'float16', 'text_config': _TEXT_3_5},
    'deepseek_v32': {**_MLA, **_INDEXER, 'model_type': 'deepseek_v32', 'architectures': ['DeepseekV32ForCausalLM']},
    'glm_moe_dsa': {**_MLA, **_INDEXER, 'model_type': 'glm_moe_dsa', 'architectures': ['GlmMoeDsaForCausalLM'],
                    'qk_head_dim': 48},
    'deepseek_v4': {'model_type': 'deepseek_v4', 'architectures': ['DeepseekV4ForCausalLM'], 'hidden_size': 256,
                    'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 1, 'head_dim': 512,
                    'vocab_size': 1000, 'bos_token_id': 0, 'eos_token_id': 1, 'torch_dtype': 'float16',
                    'sliding_window': 128, 'index_head_dim': 128,
                    'layer_types': ['sliding_attention', 'compressed_sparse_attention',
                                    'heavily_compressed_attention', 'compressed_sparse_attention'],
                    'compress_rates': {'compressed_sparse_attention': 4, 'heavily_compressed_attention': 128}},
}
_OLD_MIGRATION = lmdeploy_version().startswith('0.17.')  # named block caches in pools it cannot register
PLAIN = ['llama', 'deepseek_v3'] + ([] if _OLD_MIGRATION else ['deepseek_v32', 'glm_moe_dsa'])
NOT_COPIED = [family for family in FAMILIES if family not in PLAIN]
_NESTED_TYPES = ('qwen3_5', 'qwen3_5_moe', 'intern_s2_preview', 'interns2_mobius')


@pytest.fixture
def model_families(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What the families need here besides their config.json: transformers 4.57 does not know the Qwen3.5 types
    (their text_config would stay a dict), and builders ask the GPU whether FlashMLA and bf16 run (none here)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class Nested(PretrainedConfig):
        def __init__(self, text_config=None, **kwargs):
            super().__init__(**kwargs)
            self.text_config = PretrainedConfig(**text_config) if isinstance(text_config, dict) else text_config

    known = [name for name in _NESTED_TYPES if name in CONFIG_MAPPING]
    for name in set(_NESTED_TYPES) - set(known):
        AutoConfig.register(name, type(f'Nested_{name}', (Nested,), {'model_type': name}))
    monkeypatch.setattr('lmdeploy.pytorch.configurations.deepseek_v2.flash_mla_available', lambda: True)
    monkeypatch.setattr('lmdeploy.pytorch.configurations.qwen3_5.is_bf16_supported', lambda *args: False)
    yield
    for name in set(_NESTED_TYPES) - set(known):
        CONFIG_MAPPING._extra_content.pop(name, None)


def model_dir(tmp_path: Path, family: str) -> str:
    (tmp_path / 'config.json').write_text(json.dumps(FAMILIES[family]))
    return str(tmp_path)


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


@pytest.mark.regression
@pytest.mark.parametrize('family', NOT_COPIED)
def test_a_prefill_engine_refuses_every_model_family_whose_state_a_migration_does_not_copy(
        apply_patch, model_families: None, tmp_path: Path, family: str, monkeypatch) -> None:
    module = apply_patch('engine_sessions')
    monkeypatch.setattr(module, 'EngineChecker', refuse_to_build)
    with pytest.raises(ValueError, match=r'DistServe migrates KV blocks only.*--role Hybrid'):
        start_engine(module, model_dir(tmp_path, family), 'Prefill')


@pytest.mark.parametrize('family', FAMILIES)
def test_only_families_whose_every_cache_a_migration_copies_count_as_plain(
        model_families: None, tmp_path: Path, family: str) -> None:
    from lmdeploy.pytorch.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir(tmp_path, family))
    assert (unmigrated_state(config) is None) == (family in PLAIN)


def test_a_hybrid_engine_still_serves_such_a_model(apply_patch, hybrid_model: str, monkeypatch) -> None:
    module = apply_patch('engine_sessions')
    monkeypatch.setattr(module, 'EngineChecker', refuse_to_build)
    with pytest.raises(Exception) as raised:  # it goes on to what needs a GPU here
        start_engine(module, hybrid_model, 'Hybrid')
    assert 'DistServe migrates KV blocks only' not in str(raised.value)


async def test_orphan_reclamation_goes_on_after_a_pass_that_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdeploy_pdfix.domain.preserved import PreservedBook
    from lmdeploy_pdfix.units import engine_sessions as engine_sessions

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


def test_a_claim_that_arrives_before_its_requests_end_session_confirms_the_cache() -> None:
    # The api_server answers the Prefill request before the engine loop takes its END_SESSION; a fast Decode's
    # claim (now sent while the Decode already migrates) must not find "no preserved cache" in that gap.
    import numpy as np

    from lmdeploy_pdfix.domain.preserved import Verdict
    from lmdeploy_pdfix.shared.node_book import book_of, claim_preserved
    from tests.test_engine_connections import bare_engine, make_scheduler

    engine = bare_engine(make_scheduler())
    owner = 41
    seq = engine.scheduler.add_session(owner).add_sequence(np.arange(40))
    engine.scheduler.block_manager.allocate(seq)
    seq.preserve_cache = True
    seq.state.activate()
    seq.state.activate()
    seq.state.finish()  # the prefill is done; LMDeploy keeps it TO_BE_MIGRATED until its END_SESSION
    blocks = engine.scheduler.block_manager.get_block_table(seq).tolist()
    assert claim_preserved(engine, owner, blocks).verdict is Verdict.CLAIMED
    assert book_of(engine).audit()['claimed'] == 1
    assert claim_preserved(engine, owner + 1, blocks).verdict is Verdict.NOT_FOUND

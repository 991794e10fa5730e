"""Which Prefill/Decode pairs can exchange KV caches: the layout each node describes (D28)."""

from __future__ import annotations

from lmdeploy.messages import PytorchEngineConfig
from transformers import LlamaConfig

from lmdeploy_pdfix.domain.kv_layout import kv_layout, layout_differences

MODEL = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    torch_dtype='bfloat16')


def layout(**engine) -> dict:
    return kv_layout('LlamaForCausalLM', MODEL, PytorchEngineConfig(**engine))


def test_a_layout_names_the_model_shape_and_the_cache_settings() -> None:
    assert layout(block_size=32, quant_policy=8, tp=1) == {
        'architecture': 'LlamaForCausalLM', 'num_layers': 2, 'num_kv_heads': 2, 'head_dim': 16, 'block_size': 32,
        'kv_dtype': 'bfloat16', 'quant_policy': 8, 'tp': 1}


def test_an_auto_dtype_is_the_models_own() -> None:
    assert layout_differences(layout(dtype='auto'), layout(dtype='bfloat16')) == []
    assert layout_differences(layout(dtype='auto'), layout(dtype='float16')) == ["kv_dtype 'bfloat16' vs 'float16'"]


def test_pairs_that_differ_are_named_field_by_field() -> None:
    assert layout_differences(layout(block_size=64), layout(block_size=32, quant_policy=4)) == [
        'block_size 64 vs 32', 'quant_policy 0 vs 4']


def test_a_node_that_describes_no_layout_is_not_compared() -> None:
    assert layout_differences(layout(), None) == [] and layout_differences('garbage', layout()) == []


def test_a_hostile_layout_is_named_briefly() -> None:
    hostile = {**layout(), 'block_size': list(range(100_000)), 'kv_dtype': 'x' * 100_000, 'tp': 10 ** 5000}
    found = layout_differences(layout(), hostile)
    assert found == ['block_size 64 vs a list', "kv_dtype 'bfloat16' vs a str", 'tp 1 vs an int']

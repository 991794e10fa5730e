"""Whether a Prefill node's KV blocks can be copied into a Decode node's: what both must agree on (issue 27).

LMDeploy links any Prefill to any Decode and copies blocks byte for byte; the only check is an ``assert`` on the
block count (which ``python -O`` strips). Two nodes that differ in model shape, block size, KV dtype, KV
quantization or tensor parallelism exchange caches neither can read: the Decode answers from garbage, with
HTTP 200. Each node describes its cache layout; the proxy refuses a pair whose layouts differ. Standard library
only, no patching.
"""

from __future__ import annotations

from typing import Any

LAYOUT_FIELDS = ('architecture', 'num_layers', 'num_kv_heads', 'head_dim', 'block_size', 'kv_dtype', 'quant_policy',
                 'tp')
HOW_TO_PAIR = ('serve both roles with the same model, --cache-block-seq-len, --dtype, --quant-policy and --tp')


def kv_layout(architecture: str | None, hf_config: Any, engine_config: Any) -> dict[str, Any]:
    """The layout of a node's KV cache, from its model config and its engine config."""
    text = getattr(hf_config, 'text_config', None) or hf_config
    heads = getattr(text, 'num_attention_heads', None)
    hidden = getattr(text, 'hidden_size', None)
    head_dim = getattr(text, 'head_dim', None) or (hidden // heads if heads and hidden else None)
    dtype = str(getattr(engine_config, 'dtype', 'auto'))
    if dtype == 'auto':  # the engine takes the model's own dtype then
        dtype = str(getattr(text, 'torch_dtype', None) or getattr(hf_config, 'torch_dtype', None))
    return {
        'architecture': architecture,
        'num_layers': getattr(text, 'num_hidden_layers', None),
        'num_kv_heads': getattr(text, 'num_key_value_heads', None) or heads,
        'head_dim': head_dim,
        'block_size': getattr(engine_config, 'block_size', None),
        'kv_dtype': dtype.removeprefix('torch.'),
        'quant_policy': int(getattr(engine_config, 'quant_policy', 0) or 0),
        'tp': getattr(engine_config, 'tp', None),
    }


def layout_differences(prefill: Any, decode: Any) -> list[str]:
    """What differs between two nodes' layouts, as 'field prefill-value vs decode-value'; nothing when either node
    does not describe its layout (an older pdfix, or a node without it: nothing to compare)."""
    if not isinstance(prefill, dict) or not isinstance(decode, dict):
        return []
    return [f'{name} {_shown(prefill.get(name))} vs {_shown(decode.get(name))}'
            for name in LAYOUT_FIELDS if prefill.get(name) != decode.get(name)]


def _shown(value: Any) -> str:
    """``value`` as a refusal names it: a node's answer is hostile until parsed, so only a short scalar is shown."""
    short = (value is None or isinstance(value, (bool, float)) or (isinstance(value, int) and abs(value) < 10 ** 12)
             or (isinstance(value, str) and len(value) <= 40))
    if short:
        return repr(value)
    name = type(value).__name__
    return f'{"an" if name[0] in "aeiou" else "a"} {name}'

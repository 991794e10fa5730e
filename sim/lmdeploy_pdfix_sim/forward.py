"""The emulated forward: writes token signatures into the real KV pool and reads the history back from it.

Mirrors ``lmdeploy_pdfix_sim.model`` exactly (same signature, hash and alphabet), vectorised with torch.
The next token travels to the sampler as a one-hot logit, so LMDeploy's own sampling picks it whatever the
sampling parameters.
"""

from __future__ import annotations

import torch

from lmdeploy_pdfix_sim import model, state

_LOGIT = 1e4
WHITESPACE_IDS = [ord(char) for char in '\t\n\r ']
_MASK32 = (1 << 32) - 1


class SimModel(torch.nn.Module):
    """What the model agent keeps as ``patched_model``: a module without layers (0.18 walks its modules for
    extra cache requests and finds none) and a logits head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size

    def get_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        token_ids = hidden_states[..., 0].to(torch.int64)
        logits = torch.full((*token_ids.shape, self.vocab_size), -_LOGIT, dtype=torch.float32)
        # Whitespace a little less likely than the other unchosen tokens: under a grammar that forbids the chosen
        # token, greedy decoding then takes the next token the grammar allows instead of indenting forever, so a
        # JSON answer ends ('{"a":false}'). Nothing else changes: the chosen token outweighs them all.
        logits[..., WHITESPACE_IDS] -= 1.0
        return logits.scatter_(-1, token_ids[..., None], _LOGIT)

    def get_input_processor(self) -> None:
        return None

    def get_model(self) -> torch.nn.Module:
        return self


def _signatures(token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (token_ids * 1000003 + positions * 7919 + 12345) & _MASK32


def _slots(signatures: torch.Tensor) -> torch.Tensor:
    """[n] signatures → [n, SIG_SLOTS] small integers (exact in fp16/bf16)."""
    parts = [(signatures >> shift) & 255 for shift in (0, 8, 16, 24)]
    parts.append(torch.full_like(signatures, model.SIG_MARK))
    return torch.stack(parts, dim=-1)


def kind(inputs) -> str:
    if inputs.is_decoding:
        return 'decode'
    return 'chunk' if inputs.is_chunk else 'prefill'


def _sequence_step(k_caches: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor,
                   token_ids: torch.Tensor, history: int) -> int:
    """Store the new tokens' signatures, then hash the whole history read back from the pool."""
    first, last = k_caches
    block_size = first.shape[1]
    new_pos = torch.arange(history, history + token_ids.numel(), dtype=torch.int64)
    values = _slots(_signatures(token_ids.to(torch.int64), new_pos)).to(first.dtype)
    for cache in k_caches:
        cache[block_table[new_pos // block_size], new_pos % block_size, 0, :model.SIG_SLOTS] = values

    all_pos = torch.arange(history + token_ids.numel(), dtype=torch.int64)
    blocks, offsets = block_table[all_pos // block_size], all_pos % block_size
    stored = first[blocks, offsets, 0, :model.SIG_SLOTS].to(torch.int64)
    mirrored = last[blocks, offsets, 0, :model.SIG_SLOTS].to(torch.int64)
    state.count('kv_reads', all_pos.numel())
    state.count('kv_unwritten', int((stored[:, 4] != model.SIG_MARK).sum()))
    state.count('kv_layer_mismatch', int((stored != mirrored).any(dim=-1).sum()))

    sigs = stored[:, 0] | (stored[:, 1] << 8) | (stored[:, 2] << 16) | (stored[:, 3] << 24)
    hash_value = int((sigs * (all_pos % 1021 + 1)).sum())
    return model.next_token(hash_value)


@torch.inference_mode()
def run(inputs, cache_engine, hidden_size: int) -> dict:
    """``BaseModelAgent.async_forward``'s result: hidden states carrying each sequence's next token."""
    input_ids = inputs.input_ids.reshape(-1)
    hidden = torch.zeros((1, input_ids.numel(), hidden_size), dtype=torch.float32)
    if inputs.is_dummy:
        return {'hidden_states': hidden}
    state.count(f'forwards_{kind(inputs)}')
    caches = cache_engine.gpu_cache
    k_caches = (caches[0][0], caches[-1][0])
    start = 0
    lengths = zip(inputs.seq_length.tolist(), inputs.history_lengths.tolist(), strict=True)
    for idx, (q_len, history) in enumerate(lengths):
        token = _sequence_step(k_caches, inputs.block_offsets[idx].to(torch.int64), input_ids[start:start + q_len],
                               history)
        hidden[0, start + q_len - 1, 0] = token
        start += q_len
    state.count('tokens', start)
    return {'hidden_states': hidden}

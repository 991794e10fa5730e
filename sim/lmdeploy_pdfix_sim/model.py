"""The emulated model's arithmetic and its tiny model directory.

Tokens are bytes (a byte-level tokenizer with no merges), so an ASCII prompt's token ids are its bytes.
Every token leaves a 32-bit signature in the KV pool; the next token is a hash of all signatures of the
sequence read back from the pool. A client computes the same hash from the token ids alone
(``expected_ids``), so an answer matches only if every KV block of the prompt reached the node that decoded.
Standard library only: clients and tests import this without torch or LMDeploy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# Generated tokens: lowercase letters and space, so the text is plain ASCII and never hits a stop token.
ALPHABET = b'abcdefghijklmnopqrstuvwxyz '
ALPHABET_IDS = tuple(ALPHABET)
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 320
SIG_MARK = 90  # fifth KV slot: tells a written signature from a never-written (zero) or foreign slot
SIG_SLOTS = 5
_POS_PERIOD = 1021
_MASK32 = (1 << 32) - 1

# The tags LMDeploy's reasoning and tool-call parsers look for in a tokenizer's vocabulary (--reasoning-parser,
# --tool-call-parser): with them a node of the emulated model serves either.
TAG_TOKENS = ('<think>', '</think>', '<tool_call>', '</tool_call>')

# Everything after the first message's content is ignored, so chat prompts are predictable.
CHAT_TEMPLATE = '{% for message in messages %}{{ message["content"] }}{% endfor %}'

MODEL_CONFIG = {
    'architectures': ['LlamaForCausalLM'],
    'model_type': 'llama',
    'hidden_size': 64,
    'intermediate_size': 128,
    'num_attention_heads': 4,
    'num_key_value_heads': 2,
    'head_dim': 16,
    'num_hidden_layers': 2,
    'vocab_size': VOCAB_SIZE,
    'max_position_embeddings': 8192,
    'rms_norm_eps': 1e-6,
    'rope_theta': 10000.0,
    'bos_token_id': BOS_ID,
    'eos_token_id': EOS_ID,
    'tie_word_embeddings': False,
    'torch_dtype': 'float16',
}


def signature(token_id: int, position: int) -> int:
    """The 32-bit value the emulated forward stores for ``token_id`` at ``position``."""
    return (token_id * 1000003 + position * 7919 + 12345) & _MASK32


def history_hash(signatures: Sequence[int]) -> int:
    """Position-weighted sum: every stored signature counts, so one missing block changes it."""
    return sum(sig * (pos % _POS_PERIOD + 1) for pos, sig in enumerate(signatures))


def next_token(hash_value: int) -> int:
    return ALPHABET_IDS[hash_value % len(ALPHABET_IDS)]


def prompt_ids(text: str) -> list[int]:
    """Token ids of ``text`` for the byte-level tokenizer (no BOS is added by LMDeploy for it)."""
    return list(text.encode('utf-8'))


def expected_ids(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Token ids the emulated model generates after ``prompt`` (it never stops early)."""
    sigs = [signature(tok, pos) for pos, tok in enumerate(prompt)]
    hash_value = history_hash(sigs)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = next_token(hash_value)
        out.append(tok)
        pos = len(sigs)
        sigs.append(signature(tok, pos))
        hash_value += sigs[-1] * (pos % _POS_PERIOD + 1)
    return out


def expected_text(prompt: Sequence[int], max_tokens: int) -> str:
    """The exact text a correct cluster answers for ``prompt`` with ``max_tokens``."""
    return bytes(expected_ids(prompt, max_tokens)).decode('ascii')


def expected_text_for(text: str, max_tokens: int) -> str:
    """``expected_text`` for a completion prompt, or a chat whose messages concatenate to ``text``."""
    return expected_text(prompt_ids(text), max_tokens)


def _tokenizer_json() -> str:
    """A byte-level BPE without merges: token id == byte value, plus BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(['<s>', '</s>'])
    tok.add_tokens(list(TAG_TOKENS))  # ids 258..: a tag is one token, as in the models the parsers serve
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what ByteLevel uses)."""
    printable = list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1)) + list(
        range(ord('®'), ord('ÿ') + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def ensure_model_dir(path: str | Path) -> Path:
    """Write config.json and the tokenizer files under ``path`` (no weights; idempotent)."""
    root = Path(path)
    marker, tokenizer = root / 'config.json', _tokenizer_json()
    if marker.exists() and json.loads(marker.read_text()) == MODEL_CONFIG \
            and (root / 'tokenizer.json').read_text() == tokenizer:
        return root
    root.mkdir(parents=True, exist_ok=True)
    (root / 'tokenizer.json').write_text(tokenizer)
    tokenizer_config = {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'bos_token': '<s>',
        'eos_token': '</s>',
        'add_bos_token': False,
        'add_eos_token': False,
        'model_max_length': MODEL_CONFIG['max_position_embeddings'],
        'chat_template': CHAT_TEMPLATE,
    }
    (root / 'tokenizer_config.json').write_text(json.dumps(tokenizer_config, indent=1))
    (root / 'special_tokens_map.json').write_text(json.dumps({'bos_token': '<s>', 'eos_token': '</s>'}))
    (root / 'generation_config.json').write_text(json.dumps({'bos_token_id': BOS_ID, 'eos_token_id': EOS_ID}))
    # config.json last: its presence with the current content marks a complete directory.
    marker.write_text(json.dumps(MODEL_CONFIG, indent=1))
    return root

"""Long-context chunk progress on a Prefill node.

LMDeploy splits a prompt longer than ``max_prefill_token_num`` into chunks; after each chunk's forward the
chunker must advance its position, or the next forward repeats the same chunk. A Prefill node never
keeps sequences running for decode, but its chunk position must advance all the same.
"""

from __future__ import annotations

import math


def prefill_chunk_must_advance(*, is_prefill_role: bool, chunker_active: bool, forward_was_chunk: bool) -> bool:
    """Whether a Prefill node must step its chunker after a forward (the step LMDeploy skips there)."""
    return is_prefill_role and chunker_active and forward_was_chunk


def expected_prefill_forwards(prompt_tokens: int, max_prefill_token_num: int) -> int:
    """Forwards a Prefill node needs for one prompt: ceil(L / K), at least one."""
    if prompt_tokens <= 0 or max_prefill_token_num <= 0:
        raise ValueError('prompt_tokens and max_prefill_token_num must be positive')
    return max(1, math.ceil(prompt_tokens / max_prefill_token_num))

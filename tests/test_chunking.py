"""The Prefill chunk-progress rule."""

from __future__ import annotations

import pytest

from lmdeploy_pdfix.domain.chunking import expected_prefill_forwards, prefill_chunk_must_advance


@pytest.mark.parametrize('prompt, limit, forwards', [(1500, 512, 3), (512, 512, 1), (513, 512, 2), (10, 512, 1)])
def test_a_prompt_of_L_tokens_takes_ceil_L_over_K_forwards(prompt: int, limit: int, forwards: int) -> None:
    assert expected_prefill_forwards(prompt, limit) == forwards


def test_only_a_chunk_forward_on_a_prefill_node_with_an_active_chunker_advances() -> None:
    assert prefill_chunk_must_advance(is_prefill_role=True, chunker_active=True, forward_was_chunk=True)
    for flags in ((False, True, True), (True, False, True), (True, True, False)):
        role, active, chunk = flags
        assert not prefill_chunk_must_advance(is_prefill_role=role, chunker_active=active, forward_was_chunk=chunk)


def test_nonsense_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        expected_prefill_forwards(0, 512)

"""Serving a list of prompts through DistServe, one Prefill session per prompt."""

from __future__ import annotations

from lmdeploy_pdfix.domain.batching import merge_completions, split_prompts


def test_each_prompt_becomes_its_own_request_in_order() -> None:
    singles = split_prompts({'model': 'm', 'prompt': ['a', 'b'], 'max_tokens': 4})
    assert singles == [{'model': 'm', 'prompt': 'a', 'max_tokens': 4}, {'model': 'm', 'prompt': 'b', 'max_tokens': 4}]


def test_answers_merge_into_one_choice_per_prompt_with_summed_usage() -> None:
    bodies = [{'id': 'x', 'choices': [{'index': 0, 'text': text}],
               'usage': {'prompt_tokens': 2, 'completion_tokens': 3, 'total_tokens': 5}} for text in ('A', 'B')]
    merged = merge_completions(bodies)
    assert merged['choices'] == [{'index': 0, 'text': 'A'}, {'index': 1, 'text': 'B'}]
    assert merged['usage'] == {'completion_tokens': 6, 'prompt_tokens': 4, 'total_tokens': 10}
    assert merged['id'] == 'x'

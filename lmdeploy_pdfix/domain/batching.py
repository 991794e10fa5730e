"""A completions request with several prompts, served through DistServe as one request per prompt.

One migration request can carry only one Prefill cache, so each prompt gets its own Prefill session, owner
and Decode request; the answers are merged back into the one response the client asked for.
"""

from __future__ import annotations

from typing import Any


def split_prompts(request: dict[str, Any]) -> list[dict[str, Any]]:
    """One single-prompt request per prompt, in order."""
    return [{**request, 'prompt': prompt} for prompt in request['prompt']]


def merge_completions(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One completions response: choice ``i`` is prompt ``i``'s answer, usage is the sum of all."""
    merged = dict(bodies[0])
    merged['choices'] = [{**body['choices'][0], 'index': index} for index, body in enumerate(bodies)]
    usages = [body.get('usage') or {} for body in bodies]
    counts = {key for usage in usages for key, value in usage.items() if isinstance(value, int)}
    merged['usage'] = {key: sum(usage.get(key) or 0 for usage in usages) for key in sorted(counts)}
    return merged

"""Which admitted node a request goes to (issue 30, D29): the one that carries least now; for a Prefill that
caches prefixes, the one whose cache may already hold the prompt's beginning, unless it carries clearly more.

Plain rules, no I/O: the relay says what each node carries and which nodes cache prefixes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

# calls an affine Prefill may carry beyond the least loaded and still be chosen: a prefix hit saves a prefill,
# a queue behind it costs more
AFFINITY_SLACK = 2
PREFIX_CHARS = 256  # how much of a prompt names its prefix: about its first KV blocks
# a node whose KV cache is this full takes a request only when every node is: a new request there waits for
# blocks, or evicts prefixes
KV_FULL = 0.9


def least_loaded(urls: list[str], load: Callable[[str], float]) -> str:
    """The node of ``urls`` that carries least now; among equals, one at random (so idle nodes share the load)."""
    lightest = min(load(url) for url in urls)
    return random.choice([url for url in urls if load(url) == lightest])


def prefix_home(urls: list[str], prefix: str) -> str:
    """The node of ``urls`` that ``prefix`` belongs to (rendezvous hashing: a node that joins or leaves moves only
    the prefixes that belong to it)."""
    return max(urls, key=lambda url: hashlib.blake2b(f'{url}\0{prefix}'.encode(), digest_size=8).digest())


def choose_node(urls: list[str], load: Callable[[str], float], prefix: str | None,
                kv_usage: Callable[[str], float | None]) -> str:
    """The node of ``urls`` a request goes to, among those whose KV cache is not full (all, if every one is):
    its prefix's home while that carries at most ``AFFINITY_SLACK`` more than the least loaded, else the least
    loaded; with no prefix (no prefix caching), the least loaded."""
    urls = [url for url in urls if (kv_usage(url) or 0.0) < KV_FULL] or urls
    lightest = least_loaded(urls, load)
    if prefix is None:
        return lightest
    home = prefix_home(urls, prefix)
    return home if load(home) <= load(lightest) + AFFINITY_SLACK else lightest


def prompt_prefix(request_dict: dict) -> str:
    """What names a request's prefix: the start of its prompt, or of its messages (the system prompt first)."""
    prompt = request_dict.get('prompt')
    return str(prompt if prompt is not None else request_dict.get('messages'))[:PREFIX_CHARS]

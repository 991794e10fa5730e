"""A node's KV cache use, as the proxy reads it from the node's /metrics: anything else is not known, never an
error (issue 30)."""

from __future__ import annotations

import pytest

from lmdeploy_pdfix.domain.protocol import parse_kv_usage


@pytest.mark.parametrize('text, usage', [
    (b'# TYPE lmdeploy:gpu_cache_usage_perc gauge\nlmdeploy:gpu_cache_usage_perc{model_name="m"} 0.25\n', 0.25),
    (b'lmdeploy:gpu_cache_usage_perc 1.0\n', 1.0),
    (b'lmdeploy:gpu_cache_usage_perc 0\n', 0.0),
    (b'', None),
    (b'other_metric 0.5\n', None),
    (b'lmdeploy:gpu_cache_usage_perc_max 0.5\n', None),
    (b'lmdeploy:gpu_cache_usage_perc NaN\n', None),
    (b'lmdeploy:gpu_cache_usage_perc 2.5\n', None),
    (b'lmdeploy:gpu_cache_usage_perc -0.1\n', None),
    (b'lmdeploy:gpu_cache_usage_perc lots\n', None),
    (b'lmdeploy:gpu_cache_usage_perc\n', None),
    (b'\xff\xfe lmdeploy:gpu_cache_usage_perc 0.5', None),
], ids=['labelled', 'full', 'empty cache', 'no text', 'another metric', 'a longer name', 'NaN', 'above 1',
        'below 0', 'a word', 'no value', 'not text'])
def test_a_nodes_kv_cache_use_is_its_lmdeploy_gauge_or_not_known(text: bytes, usage: float | None) -> None:
    assert parse_kv_usage(text) == usage

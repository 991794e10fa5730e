"""Any JSON at all, sent where DistServe control traffic goes, gets an answer below 500 and leaves nothing behind.

Property-based (Hypothesis): arbitrary JSON values, and objects shaped like claims, frees, migration requests
and proxy requests with arbitrary values in their fields, against the real routes of ``test_node_input`` (a
node) and ``test_proxy_distserve`` (the proxy, over real HTTP to stand-in nodes).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmdeploy_pdfix.protocol import CHAT_PATH, CLAIM_PATH, COMPLETIONS_PATH, FREE_PATH
from tests.stand_in_nodes import MODEL, Cluster, audit
from tests.test_node_input import EngineRpc, node_client
from tests.test_serving_owner import FakePrefillEngine

pytestmark = pytest.mark.filterwarnings('ignore::hypothesis.errors.HypothesisWarning')  # the cluster's long repr

FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=12)
ids = st.one_of(st.integers(min_value=-5, max_value=2 ** 64), json_values)
id_lists = st.one_of(st.lists(st.integers(min_value=-2, max_value=2 ** 64), max_size=6), json_values)


def shaped(**fields: st.SearchStrategy) -> st.SearchStrategy:
    """Objects with some of ``fields`` (each of any value its strategy gives) and maybe an unknown key."""
    return st.fixed_dictionaries({}, optional={**fields, 'extra': json_values})


claims = st.one_of(json_values, shaped(owner=ids, block_ids=id_lists))
frees = st.one_of(json_values, shaped(remote_engine_id=json_values, remote_session_id=ids))
migrations = shaped(protocol=st.one_of(st.sampled_from([1, 2, 'RDMA']), json_values), remote_engine_id=json_values,
                    remote_session_id=ids, remote_block_ids=id_lists, remote_token_id=ids,
                    is_dummy_prefill=st.one_of(st.booleans(), json_values))
decode_requests = shaped(prompt=st.one_of(st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3)),
                         n=json_values, migration_request=st.one_of(migrations, json_values))
proxy_requests = shaped(prompt=st.one_of(st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3), json_values),
                        messages=json_values, stream=st.one_of(st.booleans(), json_values), n=json_values,
                        max_tokens=json_values, session_id=json_values)


@pytest.fixture
def node(apply_patch: Callable[[str], ModuleType]) -> Iterator[tuple[Callable[[str, Any], int], EngineRpc]]:
    """``post(path, body) -> status`` on a node running every api_server unit, and its engine's RPC stand-in."""
    apply_patch('engine_sessions')
    apply_patch('node_cache_routes')
    apply_patch('decode_migration_checks')
    apply_patch('serving_cache_owner')
    api_server = apply_patch('link_routes')
    rpc = EngineRpc()

    def post(path: str, body: Any) -> int:
        async def send() -> int:
            engine = FakePrefillEngine()
            engine.engine = SimpleNamespace(_collective_rpc_async=rpc)
            async with await node_client(api_server, engine) as client:
                return (await client.post(path, content=json.dumps(body))).status_code

        return asyncio.run(send())

    yield post, rpc


@FUZZ
@given(body=claims)
def test_any_claim_is_answered_below_500(node, body: Any) -> None:
    post, _ = node
    assert post(CLAIM_PATH, body) < 500


@FUZZ
@given(body=frees)
def test_any_free_is_answered_below_500(node, body: Any) -> None:
    post, _ = node
    assert post(FREE_PATH, body) < 500


@FUZZ
@given(body=decode_requests)
def test_any_migration_request_is_answered_below_500(node, body: Any) -> None:
    post, _ = node
    assert post(COMPLETIONS_PATH, {'model': MODEL, 'max_completion_tokens': 1, 'prompt': 'hi', **body}) < 500


@FUZZ
@given(body=proxy_requests, path=st.sampled_from([COMPLETIONS_PATH, CHAT_PATH]))
def test_any_proxy_request_is_answered_below_500_and_leaves_no_cache(distserve: Cluster, body: Any,
                                                                      path: str) -> None:
    async def send() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(distserve.url + path, json={'model': MODEL, **body})
            return response.status_code, await audit(distserve)

    status, books = asyncio.run(send())
    assert status < 500, body
    assert distserve.prefill.retained == set() and books['open'] == 0, body

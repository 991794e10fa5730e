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

from lmdeploy_pdfix.domain.protocol import (
    CHAT_PATH,
    CLAIM_PATH,
    COMPLETIONS_PATH,
    FREE_PATH,
    NODE_PROOF_PATH,
    TICKET_KEY_PATH,
)
from tests.stand_in_nodes import MODEL, Cluster, audit
from tests.test_node_input import EngineRpc, node_client
from tests.test_serving_cache_owner import FakePrefillEngine

pytestmark = pytest.mark.filterwarnings('ignore::hypothesis.errors.HypothesisWarning')  # the cluster's long repr

FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

unicode_digits = st.text(alphabet=st.characters(categories=['Nd', 'No']), min_size=1, max_size=12)  # superscripts too
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.integers(min_value=2 ** 200, max_value=2 ** 400),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12), unicode_digits)
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=12)
ids = st.one_of(st.integers(min_value=-5, max_value=2 ** 64), json_values)
id_lists = st.one_of(st.lists(st.integers(min_value=-2, max_value=2 ** 64), max_size=6), json_values)


def shaped(**fields: st.SearchStrategy) -> st.SearchStrategy:
    """Objects with some of ``fields`` (each of any value its strategy gives) and maybe an unknown key."""
    return st.fixed_dictionaries({}, optional={**fields, 'extra': json_values})


claims = st.one_of(json_values, shaped(owner=ids, block_ids=id_lists))
frees = st.one_of(json_values, shaped(remote_engine_id=json_values, remote_session_id=ids))
ticket_parts = st.one_of(st.text(max_size=40), unicode_digits, st.integers(min_value=0, max_value=2 ** 80).map(str))
tickets = st.one_of(json_values, st.tuples(st.sampled_from(['v1', 'v2', '']), ticket_parts, ticket_parts,
                                           ticket_parts).map('.'.join))
migrations = shaped(protocol=st.one_of(st.sampled_from([1, 2, 'RDMA']), json_values), remote_engine_id=json_values,
                    remote_session_id=ids, remote_block_ids=id_lists, remote_token_id=ids,
                    is_dummy_prefill=st.one_of(st.booleans(), json_values), cache_ticket=tickets,
                    cache_prompt_digest=st.one_of(ticket_parts, json_values),
                    cache_first_token_logprobs=json_values)
challenges = st.one_of(json_values, shaped(nonce=st.one_of(ticket_parts, json_values)))
# what a header can carry (no control characters, no edge spaces: HTTP strips those), Unicode included
header_texts = st.text(alphabet=st.characters(categories=['L', 'N', 'P', 'S']), max_size=40)
# a key is ASCII: LMDeploy's --api-keys check compares the UTF-8 of a header Starlette decoded as Latin-1
keys = st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1,
                                    max_size=20))
headers = st.one_of(header_texts, st.tuples(st.sampled_from(['Bearer ', 'bearer ', 'Basic ', '']),
                                            header_texts).map(''.join))
decode_requests = shaped(prompt=st.one_of(st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3)),
                         n=json_values, migration_request=st.one_of(migrations, json_values))
proxy_requests = shaped(prompt=st.one_of(st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3), json_values),
                        messages=json_values, stream=st.one_of(st.booleans(), json_values), n=json_values,
                        max_tokens=json_values, session_id=json_values)


@pytest.fixture
def node(apply_patch: Callable[[str], ModuleType]) -> Iterator[tuple[Callable[..., int], EngineRpc]]:
    """``post(path, body, raw=None, authorization=None) -> status`` on a node running every api_server unit, and
    its engine's RPC stand-in."""
    apply_patch('engine_sessions')
    apply_patch('node_cache_routes')
    apply_patch('decode_migration_checks')
    apply_patch('serving_cache_owner')
    api_server = apply_patch('link_routes')
    rpc = EngineRpc()

    def post(path: str, body: Any, raw: bytes | None = None, authorization: str | None = None) -> int:
        async def send() -> int:
            engine = FakePrefillEngine()
            engine.engine = SimpleNamespace(_collective_rpc_async=rpc)
            sent = {} if authorization is None else {'Authorization': authorization.encode()}
            async with await node_client(api_server, engine) as client:
                if path == TICKET_KEY_PATH:
                    return (await client.get(path, headers=sent)).status_code
                content = raw if raw is not None else json.dumps(body)
                return (await client.post(path, content=content, headers=sent)).status_code

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
@given(body=challenges, key=keys)
def test_any_proof_challenge_is_answered_below_500(node, monkeypatch: pytest.MonkeyPatch, body: Any,
                                                   key: str | None) -> None:
    post, _ = node
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', key or '')
    assert post(NODE_PROOF_PATH, body) < 500


@FUZZ
@given(authorization=headers, key=keys)
def test_any_credentials_asking_for_the_ticket_key_are_answered_below_500_and_only_the_key_gets_it(
        node, monkeypatch: pytest.MonkeyPatch, authorization: str, key: str | None) -> None:
    post, _ = node
    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', key or '')
    presents_key = key is not None and authorization[:7].lower() == 'bearer ' and authorization[7:] == key
    assert post(TICKET_KEY_PATH, None, authorization=authorization) == (200 if presents_key else 403)


HOSTILE_BODIES = {'nested 100,000 deep': b'[' * 100_000 + b']' * 100_000,
                  'an object nested 100,000 deep': b'{"a":' * 100_000 + b'1' + b'}' * 100_000,
                  'a 10,000-digit number': b'{"owner": ' + b'9' * 10_000 + b'}',
                  'not UTF-8': b'{"owner": "\xff\xfe"}'}


@pytest.mark.parametrize('path', [CLAIM_PATH, FREE_PATH, NODE_PROOF_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize('raw', HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_a_body_nested_too_deep_huge_or_not_utf8_is_answered_below_500(node, path: str, raw: bytes) -> None:
    post, _ = node
    assert post(path, None, raw=raw) < 500


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

"""A DistServe answer is the answer a Hybrid node gives, for every request option (issue 27).

Each parity cluster is 1 Prefill + 1 Decode behind the DistServe proxy and, beside them, a ``--role Hybrid`` node
of the same model, all serving logprobs, tool calls (``qwen3``) and reasoning (``default``). Every option of
LMDeploy's chat and completions protocols (``tests/parity.py``) goes to the Hybrid node and through the proxy,
streamed and not, and the two answers are compared on status, text, reasoning, tool calls, finish_reason,
logprobs and usage. Stock LMDeploy answers otherwise where :data:`STOCK_DIFFERS` says why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lmdeploy_pdfix.sim import client
from lmdeploy_pdfix.sim.cluster import MODEL_NAME, Cluster, http_json
from tests.e2e.conftest import MODES
from tests.parity import (
    NODE_ARGS,
    NOT_OPTIONS,
    OPTIONS,
    Case,
    answer,
    cases,
    differences,
    options_of,
    post,
    protocol_fields,
    send,
)

pytestmark = pytest.mark.e2e

FIELDS = protocol_fields()
CASES = cases(FIELDS)
CHAT_CASES = [case.id for case in CASES if case.route == 'chat']
# Where stock DistServe answers otherwise than a Hybrid node, by case, and why (D-numbers in docs/defects.md)
STOCK_DIFFERS: dict[str, str] = {
    **{case: 'D1: every chat through the proxy is a 500' for case in CHAT_CASES},
    **{f'completions-{kind}-{option}': 'D25: the first token never ends a request, so max_tokens 1 answers two'
       for kind in ('whole', 'stream') for option in ('max_tokens', 'max_completion_tokens')},
    **{f'completions-{kind}-stop (first token)': 'D8: a first token that stops the answer is a 500'
       for kind in ('whole', 'stream')},
}
# LMDeploy's own streamed completions with logprobs raise ('logprobs is removed') after the first token: a Hybrid
# node's stream breaks off; through DistServe the Decode node raises before its first event, and the proxy relays
# its 500. Neither answers; the statuses differ only in when LMDeploy fails.
LMDEPLOY_FAILS = {'completions-stream-logprobs'}
GUIDED_LOAD, GUIDED_CONCURRENCY = 200, 8
_BOOLEAN_SCHEMA = {'name': 'flag', 'schema': {'type': 'object', 'properties': {'a': {'type': 'boolean'}},
                                              'required': ['a'], 'additionalProperties': False}}


@pytest.fixture(scope='module', params=MODES)
def parity(request: pytest.FixtureRequest, start_cluster: Callable[..., Any]) -> Iterator[tuple[str, Cluster]]:
    """(mode, cluster): one mode's parity cluster at a time (pytest groups this module's tests by mode)."""
    mode = request.param
    with start_cluster(f'parity-{mode}', stock=mode == 'stock', hybrid=1, node_args=NODE_ARGS) as cluster:
        yield mode, cluster


def test_the_cases_cover_every_option_of_lmdeploys_protocol() -> None:
    for route in ('chat', 'completions'):
        assert sorted(FIELDS[route] - options_of(route) - NOT_OPTIONS) == [], route
    assert set(OPTIONS) >= {'n', 'max_tokens', 'response_format json_schema', 'tool_choice required'}


@pytest.mark.parametrize('case', CASES, ids=[case.id for case in CASES])
def test_a_distserve_answer_is_the_answer_a_hybrid_node_gives(parity: tuple[str, Cluster], case: Case) -> None:
    mode, cluster = parity
    hybrid = answer(*send(cluster.hybrid_urls[0], case), case.stream)
    distserve = answer(*send(cluster.proxy_url, case), case.stream)
    found = differences(hybrid, distserve)
    if case.id in LMDEPLOY_FAILS:
        assert hybrid.get('broken_off') and distserve['status'] >= 500, (hybrid, distserve)
    elif mode == 'stock' and case.id in STOCK_DIFFERS:
        assert found, f'stock answers as Hybrid; expected: {STOCK_DIFFERS[case.id]}'
    else:
        assert found == [], found


def test_every_case_leaves_no_prefill_session(parity: tuple[str, Cluster]) -> None:
    mode, cluster = parity
    sessions = cluster.settled_state(cluster.prefill_urls[0])['sessions']
    if mode == 'stock':
        assert sessions > 0  # D2: every completion leaves its preserved Prefill session
    else:
        assert sessions == 0


def _guided_chat(url: str, index: int) -> tuple[int, str]:
    body = {'model': MODEL_NAME, 'messages': [{'role': 'user', 'content': client.prompt_for(index)}],
            'max_tokens': 24, 'temperature': 0, 'enable_thinking': False,
            'response_format': {'type': 'json_schema', 'json_schema': _BOOLEAN_SCHEMA}}
    status, raw = post(f'{url}/v1/chat/completions', body)
    if status != 200 or raw is None:
        return status, repr(raw)
    return status, json.loads(raw)['choices'][0]['message']['content']


def test_a_guided_json_load_answers_the_hybrid_json(parity: tuple[str, Cluster]) -> None:
    mode, cluster = parity
    expected = [_guided_chat(cluster.hybrid_urls[0], index) for index in range(3)]
    assert expected == [(200, '{"a":false}')] * 3, expected  # the grammar's answer whatever the prompt

    def one(index: int) -> tuple[int, str]:
        return _guided_chat(cluster.proxy_url, index)

    with ThreadPoolExecutor(GUIDED_CONCURRENCY) as pool:
        answers = list(pool.map(one, range(GUIDED_LOAD)))
    exact = [json.loads(text) == {'a': False} for status, text in answers if status == 200]
    if mode == 'stock':
        assert sum(exact) == 0, answers[:3]  # D1: every chat is a 500
    else:
        assert (len(exact), sum(exact)) == (GUIDED_LOAD, GUIDED_LOAD), [a for a in answers if a != expected[0]][:3]
        assert cluster.settled_state(cluster.prefill_urls[0])['sessions'] == 0


def test_a_chat_with_n_4_answers_four_choices_and_leaves_nothing(parity: tuple[str, Cluster]) -> None:
    mode, cluster = parity
    for stream in (False, True):
        case = Case('n (4, sampled)', 'chat', stream)
        hybrid = answer(*send(cluster.hybrid_urls[0], case), stream)
        distserve = answer(*send(cluster.proxy_url, case), stream)
        assert len(hybrid['choices']) == 4
        if mode == 'stock':
            assert distserve['status'] == 400  # D18: n > 1 is refused
        else:
            assert differences(hybrid, distserve) == []
    if mode == 'patched':
        assert cluster.settled_state(cluster.prefill_urls[0])['sessions'] == 0
        assert http_json('GET', f'{cluster.proxy_url}/distserve/pdfix/audit')['open'] == 0


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('template', ['base', 'vicuna'])
def test_a_decode_with_another_chat_template_refuses_every_chat_and_serves_completions(
        start_cluster: Callable[..., Any], mode: str, template: str) -> None:
    with start_cluster(f'skew-{template}-{mode}', stock=mode == 'stock',
                       decode_args=('--chat-template', template)) as cluster:
        prefill = cluster.prefill_urls[0]
        chats = [client.request(cluster.proxy_url, 'chat', client.prompt_for(i), timeout_s=30) for i in range(10)]
        completions = [client.request(cluster.proxy_url, 'completions', client.prompt_for(i), timeout_s=30)
                       for i in range(10)]
        sessions = cluster.settled_state(prefill)['sessions']
    if mode == 'stock':
        assert [chat for chat in chats if chat.status >= 400 and 'chat template' in chat.error] == [], chats[:1]
        return
    assert [(chat.status, 'chat template' in chat.error) for chat in chats] == [(409, True)] * 10, chats[:1]
    assert [completion for completion in completions if not completion.ok] == []
    assert sessions == 0

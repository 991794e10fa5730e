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
from pathlib import Path
from typing import Any

import pytest

from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import MODEL_NAME, Cluster, http_json
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
# Where LMDeploy itself fails the request, on a Hybrid node too; DistServe fails it as well, though not always with
# the same status: a Hybrid stream has begun (200, then an error event or a broken stream) where DistServe learns of
# the failure at its Prefill, before any byte, and answers its 5xx.
LMDEPLOY_FAILS = {
    # streamed completions with logprobs raise 'logprobs is removed' after the first token
    'completions-stream-logprobs',
    # logit_bias: its processor is a local function the multi-process engine cannot pickle
    'chat-whole-logit_bias', 'chat-stream-logit_bias',
}
CHAT_CASES = [case.id for case in CASES if case.route == 'chat' and case.id not in LMDEPLOY_FAILS]
# Where stock DistServe answers otherwise than a Hybrid node, by case, and why (D-numbers in docs/defects.md)
STOCK_DIFFERS: dict[str, str] = {
    **{case: 'D1: every chat through the proxy is a 500' for case in CHAT_CASES},
    **{f'completions-{kind}-{option}': 'D25: the first token never ends a request, so max_tokens 1 answers two'
       for kind in ('whole', 'stream') for option in ('max_tokens', 'max_completion_tokens')},
    **{f'completions-{kind}-stop (first token)': 'D8: a first token that stops the answer is a 500'
       for kind in ('whole', 'stream')},
    'completions-stream-logprobs': ("LMDeploy's stream fails after the first token; the stock proxy ends it as if "
                                    'it were whole: 200 with one token'),
}
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
    if mode == 'stock' and case.id in STOCK_DIFFERS:
        assert found, f'stock answers as Hybrid; expected: {STOCK_DIFFERS[case.id]}'
    elif case.id in LMDEPLOY_FAILS:
        assert _failed(hybrid) and _failed(distserve), (hybrid, distserve)
    else:
        assert found == [], found


def _failed(answer: dict[str, Any]) -> bool:
    return answer['status'] >= 500 or bool(answer.get('broken_off') or answer.get('stream_error'))


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
    expected = [_guided_chat(cluster.hybrid_urls[0], index) for index in range(GUIDED_LOAD)]
    assert {json.loads(text)['a'] in (True, False) for status, text in expected} == {True}  # valid, whole JSON

    def one(index: int) -> tuple[int, str]:
        return _guided_chat(cluster.proxy_url, index)

    with ThreadPoolExecutor(GUIDED_CONCURRENCY) as pool:
        answers = list(pool.map(one, range(GUIDED_LOAD)))
    same = [answer == hybrid for answer, hybrid in zip(answers, expected, strict=True)]
    if mode == 'stock':
        assert sum(same) == 0, answers[:3]  # D1: every chat is a 500
    else:
        assert sum(same) == GUIDED_LOAD, [(a, e) for a, e in zip(answers, expected, strict=True) if a != e][:3]
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


# A Decode started with another chat template than its Prefill: one whose prompts still fit the Prefill's block
# count (a short prefix, from a template file), and one whose prompts need more blocks (vicuna's system prompt).
SKEWED_TEMPLATES = {'same-blocks': {'model_name': 'base', 'user': 'Q: ', 'eoh': '\n', 'assistant': 'A: '},
                    'more-blocks': 'vicuna'}


@pytest.mark.parametrize('skew, mode', [('same-blocks', 'stock'), ('same-blocks', 'patched'),
                                        ('more-blocks', 'patched')])  # stock's chats are 500s (D1) either way
def test_a_decode_with_another_chat_template_refuses_every_chat_and_serves_completions(
        start_cluster: Callable[..., Any], tmp_path: Path, mode: str, skew: str) -> None:
    template = SKEWED_TEMPLATES[skew]
    if isinstance(template, dict):
        (tmp_path / 'template.json').write_text(json.dumps(template))
        template = str(tmp_path / 'template.json')
    with start_cluster(f'skew-{skew}-{mode}', stock=mode == 'stock', decode_args=('--chat-template', template)) \
            as cluster:
        chats = [client.request(cluster.proxy_url, 'chat', client.prompt_for(i), timeout_s=30) for i in range(10)]
        completions = [client.request(cluster.proxy_url, 'completions', client.prompt_for(i), timeout_s=30)
                       for i in range(10)]
        sessions = cluster.settled_state(cluster.prefill_urls[0])['sessions']
    if mode == 'stock':  # D1 answers every chat 500 before any skew shows; none names the cause
        assert [chat for chat in chats if 'chat template' in chat.error] == [], chats[:1]
        return
    assert [(chat.status, 'chat template' in chat.error) for chat in chats] == [(409, True)] * 10, chats[:1]
    assert [completion for completion in completions if not completion.ok] == []
    assert sessions == 0

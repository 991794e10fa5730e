"""Requests the Prefill node cannot hand to a Decode as usual: a first token that stops, a list of prompts."""

from __future__ import annotations

import json

import httpx
import pytest

from lmdeploy_pdfix_sim.cluster import Cluster
from lmdeploy_pdfix_sim.model import expected_text_for

pytestmark = pytest.mark.e2e

MODEL = 'pdfix-sim'
MAX_TOKENS = 8


def leaked_sessions(cluster: Cluster, before: dict) -> int:
    return cluster.settled_state(cluster.prefill_urls[0])['sessions'] - before['sessions']


def first_choice(response: httpx.Response, stream: bool) -> dict:
    if not stream:
        return response.json()['choices'][0]
    events = [line[len('data: '):] for line in response.text.splitlines() if line.startswith('data: ')]
    assert events[-1] == '[DONE]', response.text
    return json.loads(events[0])['choices'][0]


@pytest.mark.parametrize('path', ['/v1/completions', '/v1/chat/completions'])
@pytest.mark.parametrize('stream', [False, True], ids=['plain', 'streamed'])
def test_first_token_that_stops_gives_a_finished_answer(cluster: Cluster, mode: str, path: str,
                                                        stream: bool) -> None:
    # D8: a one-token stop word equal to the model's first token ends generation before any token.
    prompt = 'abc'
    stop = expected_text_for(prompt, MAX_TOKENS)[0]
    body = {'model': MODEL, 'max_tokens': MAX_TOKENS, 'stop': [stop], 'stream': stream}
    messages = [{'role': 'user', 'content': prompt}]
    body.update({'prompt': prompt} if path == '/v1/completions' else {'messages': messages})
    before = cluster.settled_state(cluster.prefill_urls[0])
    response = httpx.post(cluster.proxy_url + path, json=body, timeout=30)
    if mode == 'stock':
        assert response.status_code == 500 or 'error' in response.text, response.text
        assert leaked_sessions(cluster, before) == 1
        return
    assert response.status_code == 200, response.text
    choice = first_choice(response, stream)
    text = choice.get('text', (choice.get('message') or choice.get('delta') or {}).get('content'))
    assert (text, choice['finish_reason']) == ('', 'stop')
    assert leaked_sessions(cluster, before) == 0


def test_a_list_of_prompts_answers_each_prompt_in_order(cluster: Cluster, mode: str) -> None:
    # D7: stock shares one migration request between the prompts.
    prompts = ['first prompt', 'second one', 'third']
    before = cluster.settled_state(cluster.prefill_urls[0])
    response = httpx.post(cluster.proxy_url + '/v1/completions',
                          json={'model': MODEL, 'prompt': prompts, 'max_tokens': MAX_TOKENS}, timeout=60)
    if mode == 'stock':
        assert response.status_code != 200 or 'error' in response.text, response.text
        assert leaked_sessions(cluster, before) >= 1
        return
    assert response.status_code == 200, response.text
    choices = response.json()['choices']
    assert [choice['index'] for choice in choices] == [0, 1, 2]
    assert [choice['text'] for choice in choices] == [expected_text_for(p, MAX_TOKENS) for p in prompts]
    assert leaked_sessions(cluster, before) == 0

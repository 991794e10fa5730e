"""The real LMDeploy proxy app, in DistServe mode, over real HTTP to stand-in Prefill and Decode nodes
(the ``distserve`` fixture of ``conftest.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.servers import serving
from tests.stand_in_nodes import (
    BLOCK_IDS,
    FIRST_TOKEN,
    MODEL,
    Cluster,
    DecodeBook,
    PrefillBook,
    audit,
    decode_app,
    decoded_text,
    prefill_app,
)

CHAT = {'model': MODEL, 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 8}
COMPLETION = {'model': MODEL, 'prompt': 'hi', 'max_tokens': 8}


def text_of(response: httpx.Response) -> str:
    choice = response.json()['choices'][0]
    return choice.get('text') or choice.get('message', {}).get('content', '')


@pytest.mark.regression
async def test_chat_through_the_proxy_answers_with_the_decoded_text(distserve: Cluster) -> None:
    response = await distserve.post('/v1/chat/completions', CHAT)
    assert response.status_code == 200, response.text
    owner = distserve.decode.migrations[-1]['remote_session_id']
    assert text_of(response) == decoded_text(owner)


@pytest.mark.regression
@pytest.mark.parametrize('path, body', [('/v1/chat/completions', CHAT), ('/v1/completions', COMPLETION),
                                        ('/v1/completions', {**COMPLETION, 'session_id': 7})],
                         ids=['chat', 'completions', 'completions-with-session-id'])
async def test_decode_migrates_exactly_the_session_the_prefill_named(distserve: Cluster, path: str,
                                                                     body: dict) -> None:
    response = await distserve.post(path, body)
    assert response.status_code == 200, response.text
    migration, = distserve.decode.migrations
    owner, = distserve.prefill.freed
    assert migration['remote_session_id'] == owner
    assert migration['remote_block_ids'] == BLOCK_IDS and migration['remote_token_id'] == FIRST_TOKEN
    assert distserve.prefill.retained == set() and distserve.prefill.invalid_frees == []


async def test_prefill_is_asked_for_one_token_with_its_cache_kept(distserve: Cluster) -> None:
    await distserve.post('/v1/chat/completions', {**CHAT, 'stream': True})
    asked, = distserve.prefill.requests
    assert asked['max_tokens'] == 1 and asked['stream'] is False
    assert asked['with_cache'] is True and asked['preserve_cache'] is True


@pytest.mark.regression
async def test_streamed_chat_relays_the_decode_stream_and_releases_nothing_twice(distserve: Cluster) -> None:
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream('POST', distserve.url + '/v1/chat/completions', json={**CHAT, 'stream': True}) as response:
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line.startswith('data: ')]
    assert events[-1] == 'data: [DONE]'
    words = [json.loads(event[6:])['choices'][0]['text'] for event in events[:-1]]
    assert ' '.join(words) == decoded_text(distserve.decode.migrations[-1]['remote_session_id'])
    assert distserve.prefill.retained == set() and distserve.prefill.invalid_frees == []


@pytest.mark.regression
async def test_the_proxy_reuses_its_connections_to_the_nodes(distserve: Cluster) -> None:
    """A connection per call costs a TCP handshake and teardown on every hop; the proxy keeps a pool instead."""
    assert (await distserve.post('/v1/completions', COMPLETION)).status_code == 200  # links the pair
    distserve.prefill.client_ports.clear()
    distserve.decode.client_ports.clear()
    for i in range(12):
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(distserve.url + '/v1/completions', json={**COMPLETION, 'stream': i % 2 == 1})
        assert response.status_code == 200
    # stock opens 12 each; a pool may open a few: a streamed answer's connection returns to it only once the
    # proxy has read the stream's end, which on a busy host comes after the client's next request (CI saw 3)
    assert len(distserve.prefill.client_ports) <= 4 and len(distserve.decode.client_ports) <= 4
    assert distserve.prefill.retained == set() and distserve.prefill.invalid_frees == []


@pytest.mark.regression
async def test_32_concurrent_mixed_requests_all_succeed_with_their_own_owner(distserve: Cluster) -> None:
    bodies = [(('/v1/chat/completions', CHAT), ('/v1/completions', COMPLETION),
               ('/v1/completions', {**COMPLETION, 'stream': True}))[i % 3] for i in range(32)]
    responses = await asyncio.gather(*(distserve.post(path, body) for path, body in bodies))
    assert [response.status_code for response in responses] == [200] * 32
    owners = [migration['remote_session_id'] for migration in distserve.decode.migrations]
    assert len(set(owners)) == 32
    assert sorted(distserve.prefill.freed) == sorted(owners)
    assert distserve.prefill.retained == set() and distserve.prefill.invalid_frees == []
    nodes = distserve.proxy.node_manager
    assert all(not shelf for shelf in nodes.pd_connection_pool.migration_session_shelf.values())
    assert [nodes.nodes[url].unfinished for url in (distserve.p_url, distserve.d_url)] == [0, 0]


@pytest.mark.regression
@pytest.mark.parametrize('answer', ['no_owner', 'bad_owner'])
async def test_prefill_answer_without_a_valid_owner_gets_a_clear_502(distserve: Cluster, answer: str) -> None:
    distserve.prefill.answer = answer
    response = await distserve.post('/v1/completions', COMPLETION)
    assert response.status_code == 502
    message = response.json()['message']
    assert 'cache_session_id' in message and 'lmdeploy-pdfix' in message
    assert distserve.decode.migrations == []


@pytest.mark.regression
@pytest.mark.parametrize('answer, field', [('no_blocks', 'cache_block_ids'), ('bad_digest', 'cache_prompt_digest'),
                                           ('bad_logprobs', 'cache_first_token_logprobs')])
async def test_prefill_answer_with_owner_but_no_usable_cache_is_refused_and_released(distserve: Cluster, answer: str,
                                                                                     field: str) -> None:
    distserve.prefill.answer = answer
    response = await distserve.post('/v1/chat/completions', CHAT)
    assert response.status_code == 502
    assert field in response.json()['message']
    assert distserve.prefill.retained == set() and len(distserve.prefill.freed) == 1
    assert distserve.decode.migrations == []


@pytest.mark.regression
async def test_prefill_error_is_passed_through_with_its_status_and_message(distserve: Cluster) -> None:
    distserve.prefill.answer = 'error'
    response = await distserve.post('/v1/completions', COMPLETION)
    assert response.status_code == 400
    assert 'prompt too long' in response.json()['message']
    assert distserve.decode.migrations == []


@pytest.mark.regression
async def test_decode_failure_is_reported_and_the_prefill_cache_released(distserve: Cluster) -> None:
    distserve.decode.answer = 'error'
    response = await distserve.post('/v1/chat/completions', CHAT)
    assert response.status_code == 500
    assert 'decode engine failed' in response.json()['message']
    assert distserve.prefill.retained == set() and len(distserve.prefill.freed) == 1


@pytest.mark.regression
async def test_a_relayed_refusal_does_not_reveal_the_internal_owner_id(distserve: Cluster) -> None:
    distserve.decode.answer = 'refuses'
    response = await distserve.post('/v1/chat/completions', CHAT)
    owner = distserve.decode.migrations[0]['remote_session_id']
    assert response.status_code == 404 and 'no preserved cache' in response.json()['message']
    assert str(owner) not in response.text
    assert distserve.prefill.retained == set()


@pytest.mark.regression
async def test_no_decode_node_is_a_503_before_any_prefill_work(distserve: Cluster, admission_wait_s: float) -> None:
    distserve.proxy.node_manager.remove(distserve.d_url)
    response = await distserve.post('/v1/completions', COMPLETION)
    assert response.status_code == 503
    assert 'No Decode node serves model' in response.json()['message']
    assert distserve.prefill.requests == []


@pytest.mark.regression
@pytest.mark.parametrize('body', [{**COMPLETION, 'prompt': []}, {**COMPLETION, 'prompt': ['a', 'b'], 'stream': True}],
                         ids=['empty-batch', 'streamed-batch'])
async def test_requests_distserve_cannot_serve_get_a_400_before_any_prefill_work(distserve: Cluster,
                                                                                 body: dict) -> None:
    response = await distserve.post('/v1/completions', body)
    assert response.status_code == 400
    assert distserve.prefill.requests == []


@pytest.mark.parametrize('body, message', [({**CHAT, 'n': 129}, 'At most 128 choices'),
                                           ({**CHAT, 'n': 2, 'session_id': 7}, 'explicit session_id')],
                         ids=['above-the-cap', 'with-a-session-id'])
async def test_a_chat_with_n_a_hybrid_node_refuses_is_a_400_before_any_prefill_work(distserve: Cluster, body: dict,
                                                                                    message: str) -> None:
    response = await distserve.post('/v1/chat/completions', body)
    assert response.status_code == 400 and message in response.json()['message']
    assert distserve.prefill.requests == []


@pytest.mark.regression
async def test_a_body_the_request_models_reject_is_a_400_naming_the_field_as_a_node_answers_it(
        distserve: Cluster, apply_patch) -> None:
    apply_patch('proxy_validation_errors')
    response = await distserve.post('/v1/chat/completions', {'model': MODEL, 'messages': None, 'max_tokens': 8})
    assert response.status_code == 400, response.text
    assert 'messages' in response.json()['message']
    assert distserve.prefill.requests == []


async def test_completions_with_n_answer_one_choice_as_lmdeploys_completions_endpoint_does(
        distserve: Cluster) -> None:
    response = await distserve.post('/v1/completions', {**COMPLETION, 'n': 2})
    assert response.status_code == 200, response.text
    assert len(response.json()['choices']) == 1
    assert [asked['n'] for asked in distserve.prefill.requests] == [1]  # a node asked for n would refuse to migrate
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_chat_with_n_answers_n_choices_each_decoded_from_its_own_prefill_cache(distserve: Cluster) -> None:
    response = await distserve.post('/v1/chat/completions', {**CHAT, 'n': 3, 'seed': 10})
    assert response.status_code == 200, response.text
    choices = response.json()['choices']
    owners = [migration['remote_session_id'] for migration in distserve.decode.migrations]
    assert [choice['index'] for choice in choices] == [0, 1, 2] and len(set(owners)) == 3
    assert sorted(choice['text'] for choice in choices) == sorted(decoded_text(owner) for owner in owners)
    # each choice is a single-choice request, seeded as a Hybrid node seeds it (seed + index)
    assert sorted((asked['n'], asked['seed']) for asked in distserve.prefill.requests) == [(1, 10), (1, 11), (1, 12)]
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_streamed_chat_with_n_interleaves_the_choices_and_leaves_nothing_open(distserve: Cluster) -> None:
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream('POST', distserve.url + '/v1/chat/completions',
                          json={**CHAT, 'n': 2, 'stream': True}) as response:
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line.startswith('data: ')]
    assert events[-1] == 'data: [DONE]'
    words: dict[int, list[str]] = {0: [], 1: []}
    for event in events[:-1]:
        for choice in json.loads(event[len('data: '):])['choices']:
            words[choice['index']].append(choice['text'])
    owners = [migration['remote_session_id'] for migration in distserve.decode.migrations]
    assert sorted(' '.join(choice) for choice in words.values()) == sorted(decoded_text(owner) for owner in owners)
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_chat_with_n_whose_decode_fails_answers_the_failure_and_releases_every_cache(
        distserve: Cluster) -> None:
    distserve.decode.answer = 'error'
    distserve.prefill.delay_s = 0.1  # the choices reach the Decode together
    distserve.prefill.free_delay_step_s = 0.2  # the choices cancelled by the first failure are still freeing
    response = await distserve.post('/v1/chat/completions', {**CHAT, 'n': 3})
    assert response.status_code == 500 and 'decode engine failed' in response.json()['message']
    assert len(distserve.prefill.requests) == 3 and distserve.prefill.retained == set()
    assert (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_an_unfixed_prefill_node_is_refused_with_the_fix_before_any_work(distserve: Cluster) -> None:
    unfixed = PrefillBook(fixed=False)
    nodes = distserve.proxy.node_manager
    with serving(prefill_app(unfixed)) as unfixed_url:
        nodes.remove(distserve.p_url)
        nodes.add(unfixed_url, distserve.proxy.Status(role=distserve.proxy.EngineRole.Prefill, models=[MODEL]))
        try:
            response = await distserve.post('/v1/chat/completions', CHAT)
        finally:
            nodes.remove(unfixed_url)
    assert response.status_code == 503
    assert 'LMDEPLOY_PDFIX=1' in response.json()['message']
    assert unfixed.requests == [] and distserve.decode.migrations == []


LAYOUT = {'architecture': 'LlamaForCausalLM', 'num_layers': 2, 'num_kv_heads': 2, 'head_dim': 16, 'block_size': 64,
          'kv_dtype': 'float16', 'quant_policy': 0, 'tp': 1}


@pytest.mark.regression
@pytest.mark.parametrize('decode_layout, differs', [({**LAYOUT, 'block_size': 32}, 'block_size 64 vs 32'),
                                                    ({**LAYOUT, 'quant_policy': 8}, 'quant_policy 0 vs 8'),
                                                    ({**LAYOUT, 'kv_dtype': 'bfloat16'}, "kv_dtype 'float16' vs")],
                         ids=['block-size', 'kv-quantization', 'kv-dtype'])
async def test_a_prefill_and_decode_that_cannot_share_kv_are_refused_before_any_work(
        distserve: Cluster, decode_layout: dict, differs: str) -> None:
    prefill, decode = PrefillBook(kv_layout=LAYOUT), DecodeBook(kv_layout=decode_layout)
    nodes = distserve.proxy.node_manager
    with serving(prefill_app(prefill)) as p_url, serving(decode_app(decode, prefill)) as d_url:
        nodes.nodes.clear()
        for url, role in ((p_url, 'Prefill'), (d_url, 'Decode')):
            nodes.add(url, distserve.proxy.Status(role=getattr(distserve.proxy.EngineRole, role), models=[MODEL]))
        try:
            refused = await distserve.post('/v1/completions', COMPLETION)
        finally:
            nodes.nodes.clear()
    assert refused.status_code == 503, refused.text
    message = refused.json()['message']
    assert 'cannot share KV caches' in message and differs in message and '--cache-block-seq-len' in message
    assert prefill.requests == [] and decode.migrations == []


@pytest.mark.regression
async def test_a_prefill_that_refuses_the_proxys_credentials_is_reported_as_such_before_any_work(
        distserve: Cluster) -> None:
    # stock sends no credentials; before issue 11 this 401 read as "enable lmdeploy-pdfix there" (a 503)
    keyed = PrefillBook(probe_status=401)
    nodes = distserve.proxy.node_manager
    with serving(prefill_app(keyed)) as keyed_url:
        nodes.remove(distserve.p_url)
        nodes.add(keyed_url, distserve.proxy.Status(role=distserve.proxy.EngineRole.Prefill, models=[MODEL]))
        try:
            response = await distserve.post('/v1/chat/completions', CHAT)
        finally:
            nodes.remove(keyed_url)
    assert response.status_code == 502
    assert 'refused the credentials' in response.json()['message']
    assert 'LMDEPLOY_PDFIX_NODE_API_KEY' in response.json()['message']
    assert keyed.requests == [] and distserve.decode.migrations == []


NODE_KEY = 'the-operators-node-key'


@pytest.fixture
def node_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The proxy holds a node key; what nodes proved is forgotten before and after (ports are reused)."""
    from lmdeploy_pdfix.shared import node_client as _client

    monkeypatch.setenv('LMDEPLOY_PDFIX_NODE_API_KEY', NODE_KEY)
    _client._PROOFS._known.clear()
    yield NODE_KEY
    _client._PROOFS._known.clear()


async def test_the_node_key_goes_to_nodes_that_prove_they_hold_it(distserve: Cluster, node_key: str) -> None:
    distserve.prefill.node_key = distserve.decode.node_key = node_key
    response = await distserve.post('/v1/chat/completions', CHAT)
    assert response.status_code == 200, response.text
    assert f'Bearer {node_key}' in distserve.prefill.authorizations
    assert f'Bearer {node_key}' in distserve.decode.authorizations


UNPROVEN = {'no proof route': {}, 'another key': {'node_key': 'not-the-key'},
            'a relay of the real Prefill': {'proof_relayed_to': 'prefill'}}


@pytest.mark.parametrize('decode', UNPROVEN.values(), ids=UNPROVEN.keys())
async def test_a_node_that_has_not_proven_it_holds_the_node_key_is_never_sent_it(
        distserve: Cluster, node_key: str, decode: dict[str, str]) -> None:
    # before, a node anyone added at /nodes/add got the key as a Bearer token on the probe and relayed requests
    distserve.prefill.node_key = node_key
    for name, value in decode.items():
        setattr(distserve.decode, name, distserve.p_url if value == 'prefill' else value)
    response = await distserve.post('/v1/chat/completions', CHAT)
    assert response.status_code == 502 and 'has not proven it holds' in response.json()['message']
    assert not any(node_key in sent for sent in distserve.decode.authorizations)
    assert distserve.prefill.requests == [] and distserve.decode.migrations == []


@pytest.mark.regression
async def test_audit_shows_balanced_books_after_successes_and_failures(distserve: Cluster) -> None:
    before = await audit(distserve)
    await distserve.post('/v1/completions', COMPLETION)
    distserve.decode.answer = 'error'
    await distserve.post('/v1/completions', COMPLETION)
    after = await audit(distserve)
    assert after['open'] == 0
    released = {cause: after['releases'].get(cause, 0) - before['releases'].get(cause, 0)
                for cause in ('migrated', 'compensated')}
    assert released == {'migrated': 1, 'compensated': 1}


@pytest.mark.regression
async def test_gc_releases_what_a_failed_compensation_left_behind(distserve: Cluster) -> None:
    distserve.decode.answer = 'error'
    distserve.prefill.free_status = 503
    response = await distserve.post('/v1/chat/completions', CHAT)
    assert response.status_code == 500
    assert len(distserve.prefill.retained) == 1
    assert (await audit(distserve))['open_by_state'] == {'release_failed': 1}

    distserve.prefill.free_status = 200
    async with httpx.AsyncClient(timeout=30) as client:
        gc = await client.post(distserve.url + '/distserve/gc', json={})
    assert gc.status_code == 200, gc.text
    assert gc.json()['released'] == 1
    assert distserve.prefill.retained == set()
    assert (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_batch_of_prompts_answers_one_choice_per_prompt_in_order(distserve: Cluster) -> None:
    prompts = ['a', 'b', 'c']
    response = await distserve.post('/v1/completions', {**COMPLETION, 'prompt': prompts})
    assert response.status_code == 200, response.text
    owners = [distserve.prefill.owner_of_prompt[prompt] for prompt in prompts]
    assert len(set(owners)) == 3  # one Prefill session, one owner per prompt
    choices = response.json()['choices']
    assert [choice['index'] for choice in choices] == [0, 1, 2]
    assert [choice['text'] for choice in choices] == [decoded_text(owner) for owner in owners]
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_prompt_list_above_the_cap_is_a_400_before_any_prefill_work(distserve: Cluster) -> None:
    response = await distserve.post('/v1/completions', {**COMPLETION, 'prompt': ['p'] * 65})
    assert response.status_code == 400 and 'At most 64 prompts' in response.json()['message']
    assert distserve.prefill.requests == []


@pytest.mark.regression
@pytest.mark.parametrize('prompt', [[['p'] * 70], [[1, 2, 3]], [1, 2, 3], ['p', {'role': 'user'}]],
                         ids=['a nested list of prompts', 'a list of token-id lists', 'a list of token ids',
                              'a list with an object'])
async def test_a_prompt_list_whose_prompts_are_not_strings_is_a_400_before_any_prefill_work(
        distserve: Cluster, prompt: list) -> None:
    # a nested list passed the cap as one prompt, and its Prefill kept a cache per inner prompt, owned by nobody
    response = await distserve.post('/v1/completions', {**COMPLETION, 'prompt': prompt})
    assert response.status_code == 400 and 'must be a string' in response.json()['message']
    assert distserve.prefill.requests == []


@pytest.mark.regression
async def test_a_long_prompt_list_is_relayed_a_few_prompts_at_a_time(distserve: Cluster) -> None:
    distserve.prefill.delay_s = 0.05
    response = await distserve.post('/v1/completions', {**COMPLETION, 'prompt': [str(i) for i in range(40)]})
    assert response.status_code == 200 and len(response.json()['choices']) == 40
    assert 1 < distserve.prefill.most_in_flight <= 8, 'one request pinned a Prefill cache per prompt at once'
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_streamed_list_of_one_prompt_streams_that_prompt_and_leaves_nothing_open(distserve: Cluster) -> None:
    request = {**COMPLETION, 'prompt': ['a'], 'stream': True}
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream('POST', distserve.url + '/v1/completions', json=request) as response:
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line.startswith('data: {')]
    owner = distserve.prefill.owner_of_prompt['a']
    assert ' '.join(json.loads(event[len('data: '):])['choices'][0]['text'] for event in events) == decoded_text(owner)
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
@pytest.mark.parametrize('stream', [False, True], ids=['plain', 'streamed'])
async def test_an_answer_finished_at_the_prefill_is_returned_without_a_decode(distserve: Cluster,
                                                                              stream: bool) -> None:
    distserve.prefill.answer = 'finished'
    response = await distserve.post('/v1/completions', {**COMPLETION, 'stream': stream})
    assert response.status_code == 200, response.text
    if stream:
        events = [line for line in response.text.splitlines() if line.startswith('data: ')]
        assert events[-1] == 'data: [DONE]'
        choice = json.loads(events[0][len('data: '):])['choices'][0]
    else:
        choice = response.json()['choices'][0]
        assert 'prefill_finished' not in response.json()
    assert (choice['text'], choice['finish_reason']) == ('', 'stop')
    assert distserve.decode.migrations == []


@pytest.mark.regression
async def test_a_client_that_leaves_during_decode_aborts_it_and_leaves_nothing_behind(distserve: Cluster) -> None:
    distserve.decode.answer = 'slow'
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(timeout=0.5) as client:
            await client.post(distserve.url + '/v1/completions', json=COMPLETION)
    for _ in range(100):  # the proxy notices within its poll interval; the Decode within its own
        if distserve.decode.aborted and not distserve.prefill.retained:
            break
        await asyncio.sleep(0.05)
    assert len(distserve.decode.aborted) == 1
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_client_that_leaves_during_the_prefill_leaves_no_prefill_cache_behind(distserve: Cluster) -> None:
    distserve.prefill.delay_s = 0.6
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(timeout=0.2) as client:
            await client.post(distserve.url + '/v1/completions', json=COMPLETION)
    for _ in range(100):  # the Prefill answers after the client left; the proxy releases what it names
        if distserve.prefill.freed:
            break
        await asyncio.sleep(0.05)
    assert len(distserve.prefill.requests) == 1 and distserve.decode.migrations == []
    assert distserve.prefill.retained == set(), 'the cache the Prefill kept for the departed client leaked'
    assert (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_client_that_leaves_while_the_proxy_releases_after_a_decode_failure_leaves_nothing_behind(
        distserve: Cluster) -> None:
    distserve.decode.answer = 'error'
    distserve.prefill.free_delay_s = 0.8  # the compensating free is under way when the client gives up
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(timeout=0.4) as client:
            await client.post(distserve.url + '/v1/completions', json=COMPLETION)
    for _ in range(100):
        if distserve.prefill.freed:
            break
        await asyncio.sleep(0.05)
    assert distserve.prefill.retained == set(), 'the release was abandoned with the client'
    assert (await audit(distserve))['open'] == 0


@pytest.mark.regression
async def test_a_decode_dying_mid_stream_ends_the_stream_with_an_error_event(distserve: Cluster) -> None:
    distserve.decode.answer = 'dies'
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream('POST', distserve.url + '/v1/chat/completions', json={**CHAT, 'stream': True}) as response:
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line.startswith('data: ')]
    assert events[-1] == 'data: [DONE]'
    assert 'failed mid-stream' in json.loads(events[-2][len('data: '):])['error']['message']
    assert distserve.prefill.retained == set() and (await audit(distserve))['open'] == 0


@pytest.mark.parametrize('path', ['/v1/completions', '/v1/chat/completions'])
@pytest.mark.parametrize('content_type, body', [
    ('text/plain', b'{"model": "m", "prompt": "hi"}'),
    ('application/json', b'{"model": "m", "prompt": '),
    ('application/json', b'[1, 2]'),
    ('application/json', b'{"model": 3, "messages": "hi", "prompt": null}'),
    ('application/json; charset=utf-8', b'{"model": "m", "max_tokens": "many"}'),
], ids=['not json', 'cut short', 'a list', 'wrong types', 'a charset and a bad field'])
async def test_a_request_the_proxy_rejects_gets_the_answer_lmdeploys_own_routes_give(
        distserve: Cluster, path: str, content_type: str, body: bytes) -> None:
    """DistServe requests skip FastAPI's route machinery (issue 31), so what it answers must not change."""
    headers = {'content-type': content_type}
    async with httpx.AsyncClient(timeout=30) as client:
        relayed = await client.post(distserve.url + path, content=body, headers=headers)
        distserve.proxy.node_manager.serving_strategy = distserve.proxy.ServingStrategy.Hybrid
        try:
            routed = await client.post(distserve.url + path, content=body, headers=headers)
        finally:
            distserve.proxy.node_manager.serving_strategy = distserve.proxy.ServingStrategy.DistServe

    assert 400 <= relayed.status_code < 500, relayed.text
    assert (relayed.status_code, relayed.json()) == (routed.status_code, routed.json())
    assert distserve.prefill.requests == []


async def test_a_browsers_request_gets_lmdeploys_cors_headers(distserve: Cluster) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(distserve.url + '/v1/completions', json=COMPLETION,
                                     headers={'origin': 'https://chat.example'})

    assert response.status_code == 200, response.text
    assert response.headers['access-control-allow-origin'] == 'https://chat.example'
    assert text_of(response).startswith(decoded_text('')[:12])

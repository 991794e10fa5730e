"""DistServe failure paths on the real cluster: what the client gets, and that nothing stays behind.

Each failure is provoked from outside (a node killed, a request a node rejects, a client that leaves). For
every path the patched cluster must answer a clear status with an OpenAI-style JSON error, bring the Prefill
node back to its baseline scheduler sessions and free KV blocks within 5 s, keep both engines healthy and
serving the exact expected text, and leave no open record in the proxy's books (``/distserve/pdfix/audit``).
Stock LMDeploy is run through the same steps where it reaches them, to show the defect (D10, D11, D13, D17).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from lmdeploy_pdfix.domain.protocol import FIX_HINT
from lmdeploy_pdfix_sim import client
from lmdeploy_pdfix_sim.cluster import MODEL_NAME, Cluster, prefill_forwards

pytestmark = pytest.mark.e2e

BACK_TO_BASELINE_S = 5.0
STOCK_DECODE_IDLE_S = 30.0  # stock's Decode ends a request nobody reads (by abort or by decoding it all) later
# the holder decodes 3000 tokens (it must outlast the second request); on a busy CI host that took over 60 s
HOLDER_TIMEOUT_S = 300
AUDIT_PATH = '/distserve/pdfix/audit'
GC_PATH = '/distserve/gc'
KINDS = ('completions', 'chat', 'stream')
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------------------------------------- helpers


@dataclass
class Answer:
    status: int  # 0: no answer in time
    body: Any  # parsed JSON, else the text

    @property
    def message(self) -> str:
        """The OpenAI-style error message (``{"message": …, "object": "error"}``), or '' for anything else."""
        return self.body.get('message', '') if isinstance(self.body, dict) else ''


def _answer(status: int, raw: bytes) -> Answer:
    try:
        return Answer(status, json.loads(raw))
    except ValueError:
        return Answer(status, raw.decode(errors='replace'))


def _send(request: urllib.request.Request, timeout_s: float) -> Answer:
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return _answer(response.status, response.read())
    except urllib.error.HTTPError as exc:
        return _answer(exc.code, exc.read())
    except OSError as exc:
        return Answer(0, repr(exc))


def get(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> Answer:
    return _send(urllib.request.Request(url, headers=headers or {}), timeout_s)


def post(url: str, body: dict[str, Any], timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> Answer:
    data = json.dumps(body).encode()
    return _send(urllib.request.Request(url, data=data, method='POST',
                                        headers={'Content-Type': 'application/json', **(headers or {})}), timeout_s)


def ask(cluster: Cluster, kind: str, prompt: str, max_tokens: int = 8, timeout_s: float = 30.0,
        **extra: Any) -> Answer:
    """One request of ``kind`` through the proxy, kept whole (an error body is never cut)."""
    body: dict[str, Any] = {'model': MODEL_NAME, 'max_tokens': max_tokens, **extra}
    if kind == 'completions':
        return post(f'{cluster.proxy_url}/v1/completions', {**body, 'prompt': prompt}, timeout_s)
    body.update(messages=[{'role': 'user', 'content': prompt}], stream=kind == 'stream')
    return post(f'{cluster.proxy_url}/v1/chat/completions', body, timeout_s)


def audit(cluster: Cluster) -> dict[str, Any]:
    answer = get(f'{cluster.proxy_url}{AUDIT_PATH}')
    assert answer.status == 200, answer
    return answer.body


def compensated(cluster: Cluster) -> int:
    return audit(cluster)['releases'].get('compensated', 0)


def idle_key(state: dict[str, Any]) -> tuple[int, int]:
    return state['sessions'], state['free_blocks']


def wait_for_state(cluster: Cluster, url: str, done: Callable[[dict[str, Any]], bool],
                   within_s: float) -> dict[str, Any]:
    """The node's state as soon as ``done(state)``, or the last one seen after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        state = cluster.node_state(url)
        if done(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def assert_prefill_back(cluster: Cluster, baseline: dict[str, Any]) -> None:
    """No preserved session left: the Prefill node's sessions and free blocks are back where they were."""
    want = idle_key(baseline)
    state = wait_for_state(cluster, cluster.prefill_urls[0], lambda s: idle_key(s) == want, BACK_TO_BASELINE_S)
    assert idle_key(state) == want, (
        f'Prefill not back to baseline within {BACK_TO_BASELINE_S} s: {state["sessions_by_status"]}, '
        f'{state["free_blocks"]} free blocks; baseline {want}')


def leaked_on_prefill(cluster: Cluster, baseline: dict[str, Any]) -> int:
    return cluster.settled_state(cluster.prefill_urls[0])['sessions'] - baseline['sessions']


def assert_decode_idle(cluster: Cluster, within_s: float) -> None:
    """No session left on the Decode node (finished or aborted)."""
    state = wait_for_state(cluster, cluster.decode_urls[0], lambda s: s['sessions'] == 0, within_s)
    assert state['sessions'] == 0, f'Decode still holds sessions after {within_s} s: {state["sessions_by_status"]}'


def assert_serving(cluster: Cluster, mode: str) -> None:
    """Both engines healthy, and a normal request answers the exact expected text (stock: completions only)."""
    for url in (*cluster.prefill_urls, *cluster.decode_urls):
        assert get(f'{url}/health').status == 200, url
    kinds = KINDS if mode == 'patched' else ('completions',)  # stock chat is D1 (500)
    for index, kind in enumerate(kinds):
        result = client.request(cluster.proxy_url, kind, client.prompt_for(300 + index), timeout_s=30)
        assert result.ok, result


def assert_books_closed(cluster: Cluster, within_s: float = BACK_TO_BASELINE_S) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while (books := audit(cluster))['open'] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert books['open'] == 0, books
    return books


def wait_until_running_on_decode(cluster: Cluster, within_s: float = 15.0) -> None:
    decode = cluster.decode_urls[0]
    deadline = time.monotonic() + within_s
    while not cluster.node_state(decode)['sessions_by_status'].get('RUNNING'):
        assert time.monotonic() < deadline, 'the long request never reached the Decode node'
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- Prefill rejects


def test_prefill_rejection_reaches_the_client_as_its_4xx(cluster: Cluster, mode: str) -> None:
    prefill = cluster.prefill_urls[0]
    baseline = cluster.settled_state(prefill)
    answers = {kind: ask(cluster, kind, 'a bad parameter', top_p=2.0) for kind in KINDS}
    if mode == 'stock':
        # D10: the proxy indexes the Prefill's error body as an answer: a bare 500, the reason is lost.
        assert {kind: (a.status, a.body) for kind, a in answers.items()} == {
            kind: (500, 'Internal Server Error') for kind in KINDS}
        assert_serving(cluster, mode)
        return
    for kind, answer in answers.items():
        assert answer.status == 400, (kind, answer)
        assert answer.body['object'] == 'error' and answer.body['type'] == 'invalid_request_error', answer
        assert answer.message == f'Prefill node {prefill}: The top_p 2.0 must be in (0, 1].', answer
    assert_prefill_back(cluster, baseline)
    assert audit(cluster)['open'] == 0
    assert_serving(cluster, mode)


# ---------------------------------------------------------------------------------------------- gc


def test_gc_answers_a_report(cluster: Cluster, mode: str) -> None:
    answer = post(f'{cluster.proxy_url}{GC_PATH}', {}, timeout_s=30)
    if mode == 'stock':
        assert (answer.status, answer.body) == (500, 'Internal Server Error')  # D17: NotImplementedError
        return
    assert answer.status == 200, answer
    assert answer.body['released'] == 0 and answer.body['release_failed'] == 0, answer
    assert answer.body['audit']['open'] == 0, answer


# ---------------------------------------------------------------------------------------------- Decode rejects


def test_decode_rejection_releases_the_prefill_cache(cluster: Cluster, mode: str) -> None:
    # The Decode node rejects a user session_id that one of its running requests holds (LMDeploy answers a
    # plain-text 500); the Prefill node, where that session already ended, accepts it.
    session_id = 4242
    baseline = cluster.settled_state(cluster.prefill_urls[0])
    books_before = None if mode == 'stock' else compensated(cluster)
    holder: list[client.Result] = []
    first = threading.Thread(target=lambda: holder.append(client.request(
        cluster.proxy_url, 'completions', 'holds the session', max_tokens=3000, timeout_s=HOLDER_TIMEOUT_S,
        extra={'session_id': session_id})))
    first.start()
    try:
        wait_until_running_on_decode(cluster)
        kinds = ('completions',) if mode == 'stock' else ('completions', 'chat')
        answers = {kind: ask(cluster, kind, 'same session', session_id=session_id) for kind in kinds}
    finally:
        first.join(timeout=HOLDER_TIMEOUT_S)
    assert holder and holder[0].ok, holder
    if mode == 'stock':
        # D10/D11: the proxy cannot parse the Decode's error: 500, and the Prefill session is kept.
        assert (answers['completions'].status, answers['completions'].body) == (500, 'Internal Server Error')
        assert leaked_on_prefill(cluster, baseline) >= 1
        assert_serving(cluster, mode)
        return
    decode = cluster.decode_urls[0]
    for kind, answer in answers.items():
        # the Decode's own status, as OpenAI-style JSON naming the node
        assert answer.status == 500 and answer.body['object'] == 'error', (kind, answer)
        assert answer.message.startswith(f'Decode node {decode}'), (kind, answer)
    assert_prefill_back(cluster, baseline)
    assert compensated(cluster) - books_before == len(answers)
    assert_books_closed(cluster)
    assert_decode_idle(cluster, within_s=BACK_TO_BASELINE_S)
    assert_serving(cluster, mode)


# ---------------------------------------------------------------------------------------------- client leaves


def test_client_disconnecting_mid_stream_ends_both_sides(cluster: Cluster, mode: str) -> None:
    baseline = cluster.settled_state(cluster.prefill_urls[0])
    chat = mode == 'patched'  # stock chat never streams (D1): a completions stream shows stock instead
    # 6000 tokens take the Decode far longer than the 5 s allowed below: only an abort ends it in time.
    status, first_event = client.stream_then_disconnect(cluster.proxy_url, 'leave mid-stream', max_tokens=6000,
                                                        timeout_s=30, chat=chat)
    books_before = None if mode == 'stock' else compensated(cluster)
    assert status == 200 and first_event.startswith('data:'), (status, first_event)
    if mode == 'stock':
        # D2/D13: the migrated Prefill session is never freed. (Stock's Decode ends too, but on a busy host later
        # than the patched one's bound: CI saw it still running after 5 s.)
        assert leaked_on_prefill(cluster, baseline) >= 1
        assert_decode_idle(cluster, within_s=STOCK_DECODE_IDLE_S)
        assert_serving(cluster, mode)
        return
    assert_prefill_back(cluster, baseline)
    assert_decode_idle(cluster, within_s=BACK_TO_BASELINE_S)
    assert_books_closed(cluster)
    assert compensated(cluster) == books_before  # the Decode had taken the cache over: nothing to release
    assert_serving(cluster, mode)


def test_client_giving_up_before_the_answer_leaves_nothing(cluster: Cluster, mode: str) -> None:
    baseline = cluster.settled_state(cluster.prefill_urls[0])
    result = client.request(cluster.proxy_url, 'completions', 'impatient', max_tokens=600, timeout_s=0.3)
    assert result.status == 0, result  # the client gave up before any answer
    if mode == 'stock':
        assert_decode_idle(cluster, within_s=STOCK_DECODE_IDLE_S)  # stock decodes all 600 tokens for nobody
        assert leaked_on_prefill(cluster, baseline) >= 1  # D2
        assert_serving(cluster, mode)
        return
    # The proxy sees the client leave and cancels the relay; closing its connection aborts the Decode.
    assert_decode_idle(cluster, within_s=BACK_TO_BASELINE_S)
    assert_prefill_back(cluster, baseline)
    assert_books_closed(cluster)
    assert_serving(cluster, mode)


# ---------------------------------------------------------------------------------------------- unfixed Prefill


def test_fixed_proxy_refuses_an_unfixed_prefill_before_any_work(mixed_cluster: Cluster) -> None:
    prefill = mixed_cluster.prefill_urls[0]
    before = mixed_cluster.settled_state(prefill)
    answers = {kind: ask(mixed_cluster, kind, 'refused') for kind in KINDS}
    after = mixed_cluster.settled_state(prefill)
    books = audit(mixed_cluster)
    for kind, answer in answers.items():
        assert answer.status == 503 and answer.body['object'] == 'error', (kind, answer)
        assert prefill in answer.message and FIX_HINT in answer.message, (kind, answer)
        assert 'LMDEPLOY_PDFIX=1' in answer.message
    assert prefill_forwards(after) == prefill_forwards(before), (before['counters'], after['counters'])
    assert (after['sessions'], after['free_blocks']) == (0, before['free_blocks'])
    assert books['open'] == 0 and books['releases'] == {}, books


# ---------------------------------------------------------------------------------------------- Decode down
# The stock run leaves its Decode node stopped: the next test's ``cluster`` fixture restarts it.


def test_decode_down_releases_the_prefill_cache_and_recovers(cluster: Cluster, mode: str) -> None:
    decode = cluster.decode_urls[0]
    baseline = cluster.settled_state(cluster.prefill_urls[0])
    books_before = None if mode == 'stock' else compensated(cluster)
    cluster.stop_node(decode)
    assert decode in get(f'{cluster.proxy_url}/nodes/status').body  # the proxy still routes to it
    if mode == 'stock':
        answer = ask(cluster, 'completions', 'nobody decodes')
        # D11: a 200 carrying an error string, and the Prefill session is kept.
        assert answer.status == 200 and 'choices' not in answer.body, answer
        assert answer.body.get('error_code') == 10402, answer
        assert leaked_on_prefill(cluster, baseline) == 1
        return
    with ThreadPoolExecutor(len(KINDS)) as pool:  # each waits for a Decode (D29), then is refused
        answers = dict(zip(KINDS, pool.map(lambda kind: ask(cluster, kind, 'nobody decodes', timeout_s=120), KINDS),
                           strict=True))
    for kind, answer in answers.items():
        assert answer.status == 503 and answer.body['object'] == 'error', (kind, answer)
        # every Decode failed just now, or the heartbeat has removed the dead one meanwhile
        assert re.match(r'(Every Decode node serving|No Decode node serves) model', answer.message), (kind, answer)
    assert_prefill_back(cluster, baseline)
    assert compensated(cluster) - books_before <= len(KINDS)  # none where no Prefill work began
    assert_books_closed(cluster)
    assert get(f'{cluster.prefill_urls[0]}/health').status == 200

    cluster.restart_node(decode)  # same URL; it registers with the proxy again on start-up
    assert_serving(cluster, mode)
    assert_prefill_back(cluster, baseline)
    assert_books_closed(cluster)

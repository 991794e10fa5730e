"""A lost node costs a DistServe client nothing a retry can save (issue 30, D29).

The real proxy app, patched, over real HTTP to stand-in nodes (the ``distserve`` fixture of ``conftest.py``),
beside a registered node whose port nobody listens on: a node that died, or has not come back yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from types import ModuleType
from typing import TypeVar

import httpx
import pytest

from lmdeploy_pdfix.domain.breakers import FIRST_BACKOFF_S, NodeBreakers
from lmdeploy_pdfix.shared.proxy_books import PROXY
from tests.servers import serving
from tests.stand_in_nodes import (
    MODEL,
    Cluster,
    DecodeBook,
    PrefillBook,
    audit,
    decode_app,
    decoded_text,
    prefill_app,
)
from tests.test_proxy_metrics import scrape

pytestmark = [pytest.mark.asyncio, pytest.mark.regression]

T = TypeVar('T')

COMPLETION = {'model': MODEL, 'prompt': 'hello', 'max_tokens': 8}
CHAT = {'model': MODEL, 'messages': [{'role': 'user', 'content': 'hello'}], 'max_tokens': 8}
WORKER_THREADS = 40  # anyio's default limit of threads a Starlette app runs plain functions in


@pytest.fixture(autouse=True)
def fresh_breakers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(PROXY, 'breakers', NodeBreakers())
    yield


def dead_node_url() -> str:
    """The URL of a port nothing listens on: connections to it are refused, as to a node that died."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return f'http://127.0.0.1:{sock.getsockname()[1]}'


@contextlib.contextmanager
def raw_node(on_connection: Callable[[socket.socket], None]) -> Iterator[str]:
    """A node at the socket level: ``on_connection`` takes each connection it accepts, and closes or keeps it.
    Yields its URL."""
    listener = socket.create_server(('127.0.0.1', 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                on_connection(listener.accept()[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{listener.getsockname()[1]}'
    finally:
        done.set()
        thread.join()
        listener.close()


KV_USAGE_READ = b'GET /metrics '


@contextlib.contextmanager
def dropping_node() -> Iterator[tuple[str, list[float]]]:
    """A node that accepts each connection and closes it unanswered (a process dying under its calls); yields its
    URL and the times it was called for a request (the proxy's background reads of its ``/metrics`` are not)."""
    accepted: list[float] = []

    def drop(connection: socket.socket) -> None:
        at = time.monotonic()
        connection.settimeout(1.0)
        with contextlib.suppress(OSError), connection:
            if not connection.recv(len(KV_USAGE_READ), socket.MSG_WAITALL).startswith(KV_USAGE_READ):
                accepted.append(at)

    with raw_node(drop) as url:
        yield url, accepted


@contextlib.contextmanager
def hanging_node() -> Iterator[str]:
    """A node whose process hangs (SIGSTOP, a wedged event loop): it accepts connections and answers nothing, not
    even ``/health``. Yields its URL."""
    held: list[socket.socket] = []
    try:
        with raw_node(held.append) as url:
            yield url
    finally:
        for connection in held:
            connection.close()


@pytest.fixture
def hang_check_s(monkeypatch: pytest.MonkeyPatch) -> float:
    """A call waits 0.3 s on a node before asking its /health, which has 0.5 s to answer."""
    relay = importlib.import_module('lmdeploy_pdfix.units.proxy_distserve.relay')
    monkeypatch.setattr(relay, 'HANG_CHECK_S', 0.3)
    monkeypatch.setattr(relay, 'HEALTH_TIMEOUT_S', 0.5)
    return 0.3 + 0.5


async def within(seconds: float, work: Awaitable[T]) -> T:
    """``work``'s result; a failed test, not a hung suite, when the proxy keeps a call waiting for ever."""
    try:
        return await asyncio.wait_for(work, seconds)
    except asyncio.TimeoutError:
        pytest.fail(f'no answer within {seconds:g} s')


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def decode_dying_with_the_cache(prefill: PrefillBook, like: str) -> Iterator[str]:
    """A Decode that answers everything as the node at ``like`` does, except a decode request: it copies the cache
    (its Prefill frees it) and dies before it answers. Yields its URL."""
    upstream = like.removeprefix('http://').split(':')

    def answer(connection: socket.socket) -> None:
        with connection:
            head, body = _read_request(connection)
            if head.startswith(b'POST /v1/'):
                prefill.free(json.loads(body)['migration_request']['remote_session_id'])
                return  # closed unanswered
            with socket.create_connection((upstream[0], int(upstream[1])), timeout=5) as node:
                head = re.sub(rb'(?i)\r\nconnection:[^\r]*', b'', head) + b'\r\nConnection: close'
                node.sendall(head + b'\r\n\r\n' + body)  # one call a connection: the node then closes
                while chunk := node.recv(65536):
                    connection.sendall(chunk)

    with raw_node(answer) as url:
        yield url


def _read_request(connection: socket.socket) -> tuple[bytes, bytes]:
    connection.settimeout(5)
    data = b''
    while b'\r\n\r\n' not in data and (chunk := connection.recv(65536)):
        data += chunk
    head, _, body = data.partition(b'\r\n\r\n')
    length = re.search(rb'(?i)content-length: *(\d+)', head)
    while length and len(body) < int(length.group(1)) and (chunk := connection.recv(65536)):
        body += chunk
    return head, body


def register(cluster: Cluster, url: str, role: str) -> None:
    proxy = cluster.proxy
    proxy.node_manager.add(url, proxy.Status(role=getattr(proxy.EngineRole, role), models=[MODEL]))


async def answers(cluster: Cluster, count: int, body: dict) -> list[httpx.Response]:
    path = '/v1/chat/completions' if 'messages' in body else '/v1/completions'
    return [await cluster.post(path, body) for _ in range(count)]


def texts(responses: list[httpx.Response]) -> list[str]:
    """Each answer's text, or its status and the start of its body when it is not a 200 with a choice."""
    out = []
    for response in responses:
        try:
            choice = response.json()['choices'][0]
            out.append(choice.get('text') or choice['message']['content'])
        except (ValueError, KeyError, IndexError, TypeError):
            out.append(f'{response.status_code}: {response.text[:120]}')
    return out


@pytest.mark.parametrize('role', ['Prefill', 'Decode'])
@pytest.mark.parametrize('body', [COMPLETION, CHAT], ids=['completions', 'chat'])
async def test_a_dead_node_beside_a_live_one_fails_no_request(distserve: Cluster, role: str, body: dict) -> None:
    register(distserve, dead_node_url(), role)

    responses = await answers(distserve, 12, body)

    assert [response.status_code for response in responses] == [200] * 12, texts(responses)
    assert all(text.startswith(decoded_text('')[:12]) for text in texts(responses)), texts(responses)
    assert distserve.prefill.retained == set()
    assert (await audit(distserve))['open'] == 0


async def test_a_stream_whose_decode_is_dead_is_served_by_another_decode(distserve: Cluster) -> None:
    register(distserve, dead_node_url(), 'Decode')
    streamed = []
    body = {**COMPLETION, 'stream': True}
    for _ in range(12):  # at random, none to the dead Decode: 1 in 4,096
        async with httpx.AsyncClient(timeout=30) as client, \
                client.stream('POST', distserve.url + '/v1/completions', json=body) as response:
            streamed.append((response.status_code, [line async for line in response.aiter_lines() if line]))
    assert [status for status, _ in streamed] == [200] * 12
    assert all(lines[-1] == 'data: [DONE]' and 'error' not in ''.join(lines) for _, lines in streamed), streamed
    assert distserve.prefill.retained == set()


async def test_a_node_that_drops_connections_is_tried_again_only_after_its_back_off(distserve: Cluster) -> None:
    with dropping_node() as (url, accepted):
        register(distserve, url, 'Decode')
        responses = await answers(distserve, 40, COMPLETION)

    assert [response.status_code for response in responses] == [200] * 40, texts(responses)
    assert all(text.startswith(decoded_text('')[:12]) for text in texts(responses)), texts(responses)
    # a try: the calls chosen for the node before its first failure came back, or the one trial after a back-off
    tries = [at for i, at in enumerate(accepted) if i == 0 or at - accepted[i - 1] > FIRST_BACKOFF_S / 2]
    assert tries, 'no request was sent to the dropping node'
    assert all(later - earlier >= FIRST_BACKOFF_S * 0.9 for earlier, later in itertools.pairwise(tries)), accepted
    assert len(accepted) <= len(tries) + 8, accepted  # not one call in two, as a random choice among two gives


async def test_a_decode_that_dies_after_taking_the_cache_costs_its_request_a_new_prefill_not_an_error(
        distserve: Cluster) -> None:
    distserve.decode.confirms = True  # as a Decode with lmdeploy-pdfix: a cache taken by another is refused
    live = distserve.proxy.node_manager.nodes[distserve.d_url]
    with decode_dying_with_the_cache(distserve.prefill, like=distserve.d_url) as dying:
        register(distserve, dying, 'Decode')
        live.unfinished += 1  # busier: the dying Decode is chosen first
        try:
            response = await distserve.post('/v1/completions', COMPLETION)
        finally:
            live.unfinished -= 1

    assert response.status_code == 200, response.text
    assert response.json()['choices'][0]['text'].startswith(decoded_text('')[:12])
    assert len(distserve.prefill.requests) == 2  # the first Prefill's cache went with the dying Decode
    taken = distserve.prefill.freed[0]  # by the dying Decode
    assert distserve.prefill.retained == set()
    assert distserve.prefill.invalid_frees in ([], [taken])  # the proxy cannot know it was taken: a no-op free
    assert (await audit(distserve))['open'] == 0


async def test_a_decode_whose_engine_fails_costs_its_request_a_new_prefill_on_another_pair(
        distserve: Cluster) -> None:
    failing = DecodeBook(answer='error')  # answers 500 "decode engine failed", as a Decode whose engine died
    with serving(decode_app(failing, distserve.prefill)) as url:
        register(distserve, url, 'Decode')
        responses = await answers(distserve, 12, COMPLETION)

    assert [response.status_code for response in responses] == [200] * 12, texts(responses)
    assert failing.migrations, 'no request met the failing Decode'
    assert distserve.prefill.retained == set() and distserve.prefill.invalid_frees == []
    assert (await audit(distserve))['open'] == 0


async def test_with_every_decode_down_a_request_waits_then_gets_503_with_retry_after_and_frees_its_cache(
        distserve: Cluster, admission_wait_s: float) -> None:
    distserve.proxy.node_manager.remove(distserve.d_url)
    register(distserve, dead_node_url(), 'Decode')

    started = asyncio.get_running_loop().time()
    response = await distserve.post('/v1/completions', COMPLETION)
    waited = asyncio.get_running_loop().time() - started

    assert response.status_code == 503, response.text
    assert int(response.headers['Retry-After']) >= 1
    assert 'Decode' in response.json()['message']
    assert waited >= admission_wait_s * 0.9
    assert distserve.prefill.retained == set()
    assert (await audit(distserve))['open'] == 0


async def test_a_request_that_waits_for_a_decode_is_served_once_one_registers(
        distserve: Cluster, admission_wait_s: float) -> None:
    distserve.proxy.node_manager.remove(distserve.d_url)

    async def comes_back() -> None:
        await asyncio.sleep(admission_wait_s / 3)
        distserve.register('Decode')

    response, _ = await asyncio.gather(distserve.post('/v1/completions', COMPLETION), comes_back())

    assert response.status_code == 200, response.text
    assert response.json()['choices'][0]['text'].startswith(decoded_text('')[:12])


async def test_metrics_count_the_calls_sent_elsewhere_the_waits_and_the_nodes_out_of_rotation(
        distserve: Cluster, apply_patch: Callable[[str], ModuleType], admission_wait_s: float) -> None:
    apply_patch('proxy_metrics')
    register(distserve, dead_node_url(), 'Decode')
    await answers(distserve, 12, COMPLETION)
    distserve.proxy.node_manager.remove(distserve.d_url)
    refused = await distserve.post('/v1/completions', COMPLETION)  # only the dead Decode is left

    scraped = await scrape(distserve)

    assert refused.status_code == 503
    assert scraped[('lmdeploy_pdfix_proxy_retries_total', (('cause', 'unreachable'), ('role', 'Decode')))] >= 1
    assert scraped[('lmdeploy_pdfix_proxy_admission_wait_seconds_count',
                    (('outcome', 'refused'), ('role', 'Decode')))] == 1
    # open, or half-open if its back-off ended between the answer and the scrape
    assert sum(scraped[('lmdeploy_pdfix_proxy_node_breakers', (('state', state),))]
               for state in ('open', 'half_open')) == 1


@pytest.mark.parametrize('role', ['Prefill', 'Decode'])
async def test_a_hung_node_beside_a_slow_one_is_given_up_and_the_slow_one_is_waited_for(
        distserve: Cluster, role: str, hang_check_s: float, apply_patch: Callable[[str], ModuleType]) -> None:
    apply_patch('proxy_metrics')
    distserve.prefill.delay_s = 1.0  # longer than a call waits before asking the node whether it answers
    live = distserve.proxy.node_manager.nodes[distserve.p_url if role == 'Prefill' else distserve.d_url]
    with hanging_node() as hung:
        register(distserve, hung, role)
        live.unfinished += 1  # busier: the hung node is chosen first
        try:
            responses = await within(15, answers(distserve, 4, COMPLETION))
        finally:
            live.unfinished -= 1

    assert [response.status_code for response in responses] == [200] * 4, texts(responses)
    assert all(text.startswith(decoded_text('')[:12]) for text in texts(responses)), texts(responses)
    assert hung in (await audit(distserve))['breakers']
    assert distserve.prefill.retained == set()
    assert (await scrape(distserve))[('lmdeploy_pdfix_proxy_retries_total', (('cause', 'hung'), ('role', role)))] >= 1


async def test_a_stream_whose_decode_hangs_after_its_first_event_ends_with_an_error_event(
        distserve: Cluster, hang_check_s: float) -> None:
    distserve.decode.answer = 'hangs'
    async with httpx.AsyncClient(timeout=30) as client:
        async def read() -> list[str]:
            async with client.stream('POST', distserve.url + '/v1/completions',
                                     json={**COMPLETION, 'stream': True}) as response:
                return [line async for line in response.aiter_lines() if line]
        lines = await within(10, read())

    assert json.loads(lines[0].removeprefix('data: '))['choices'][0]['text'] == 'decoded'
    assert 'stopped answering' in json.loads(lines[1].removeprefix('data: '))['error']['message']
    assert lines[-1] == 'data: [DONE]'


async def test_a_node_that_registers_again_is_chosen_at_once_not_after_its_back_off(
        distserve: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.import_module('lmdeploy_pdfix.domain.breakers'), 'FIRST_BACKOFF_S', 600.0)
    PROXY.breakers.failed(distserve.d_url, time.monotonic())  # the only Decode failed a call, and restarted
    assert (await audit(distserve))['breakers'] == {distserve.d_url: 'open'}

    async with httpx.AsyncClient(timeout=30) as client:
        added = await client.post(distserve.url + '/nodes/add',
                                  json={'url': distserve.d_url,
                                        'status': {'role': distserve.proxy.EngineRole.Decode.value, 'models': [MODEL]}})
    response = await within(10, distserve.post('/v1/completions', COMPLETION))

    assert added.status_code == 200, added.text
    assert response.status_code == 200, response.text
    assert (await audit(distserve))['breakers'] == {}


@pytest.fixture
def node_max_in_flight(monkeypatch: pytest.MonkeyPatch) -> int:
    """LMDEPLOY_PDFIX_NODE_MAX_IN_FLIGHT=1 for this test (the relay reads it once, at import)."""
    monkeypatch.setattr(importlib.import_module('lmdeploy_pdfix.units.proxy_distserve.relay'), 'NODE_MAX_IN_FLIGHT', 1)
    return 1


async def test_requests_beyond_a_nodes_limit_wait_for_it_in_turn(
        distserve: Cluster, node_max_in_flight: int, admission_wait_s: float) -> None:
    distserve.prefill.delay_s = 0.2

    responses = await asyncio.gather(*(distserve.post('/v1/completions', COMPLETION) for _ in range(3)))

    assert [response.status_code for response in responses] == [200] * 3, texts(responses)
    assert distserve.prefill.most_in_flight == node_max_in_flight


async def test_a_request_that_finds_every_node_at_its_limit_past_the_wait_gets_429_with_retry_after(
        distserve: Cluster, node_max_in_flight: int, admission_wait_s: float,
        apply_patch: Callable[[str], ModuleType]) -> None:
    apply_patch('proxy_metrics')
    distserve.prefill.delay_s = admission_wait_s * 3
    first = asyncio.ensure_future(distserve.post('/v1/completions', COMPLETION))
    await asyncio.sleep(admission_wait_s / 2)
    second = asyncio.ensure_future(distserve.post('/v1/completions', COMPLETION))
    await asyncio.sleep(admission_wait_s / 2)
    waiting = (await scrape(distserve))[('lmdeploy_pdfix_proxy_waiting_requests', (('role', 'Prefill'),))]
    answers_ = await asyncio.gather(first, second)

    assert waiting == 1
    assert [answer.status_code for answer in answers_] == [200, 429], texts(answers_)
    assert int(answers_[1].headers['Retry-After']) >= 1
    assert 'in flight' in answers_[1].json()['message']
    assert len(distserve.prefill.requests) == 1


DEADLINES = {'the operator\'s': (0.5, None), 'the client\'s': (0.0, '0.5'), 'the operator\'s, shorter': (0.5, '30')}


@pytest.mark.parametrize('operator_s, header', DEADLINES.values(), ids=DEADLINES.keys())
async def test_a_request_past_its_deadline_gets_504_and_frees_its_cache(
        distserve: Cluster, monkeypatch: pytest.MonkeyPatch, operator_s: float, header: str | None) -> None:
    monkeypatch.setattr(importlib.import_module('lmdeploy_pdfix.units.proxy_distserve'), 'REQUEST_DEADLINE_S',
                        operator_s)
    distserve.prefill.delay_s = 2.0
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(distserve.url + '/v1/completions', json=COMPLETION,
                                     headers={'X-Request-Deadline-S': header} if header else {})
    answered_s = time.monotonic() - started
    for _ in range(60):  # the Prefill answers after 2 s; its cache is freed then
        if distserve.prefill.freed:
            break
        await asyncio.sleep(0.1)

    assert response.status_code == 504, response.text
    assert 'deadline (0.5 s)' in response.json()['message']
    assert answered_s < 1.5
    assert distserve.prefill.retained == set() and len(distserve.prefill.freed) == 1
    assert (await audit(distserve))['open'] == 0


@pytest.mark.parametrize('header', ['soon', '-1', '0', 'nan', 'inf', '1e400', '\u0663'.encode(), '9' * 40])
async def test_a_deadline_header_that_is_not_a_number_of_seconds_gets_400_and_reaches_no_node(
        distserve: Cluster, header: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(distserve.url + '/v1/completions', json=COMPLETION,
                                     headers={'X-Request-Deadline-S': header})

    assert response.status_code == 400, response.text
    assert 'x-request-deadline-s must be a number of seconds above 0' in response.json()['message']
    assert distserve.prefill.requests == []


async def test_a_prefill_keeping_caches_for_the_proxys_requests_is_chosen_after_an_idle_one(
        distserve: Cluster) -> None:
    for owner in (1, 2, 3):  # caches the first Prefill keeps until their Decode takes them
        PROXY.ledger.open(owner, distserve.p_url, distserve.d_url)
    idle = PrefillBook()
    with serving(prefill_app(idle)) as url:
        register(distserve, url, 'Prefill')
        responses = await answers(distserve, 12, COMPLETION)  # at random, all 12 to one of two: 1 in 4,096

    assert [response.status_code for response in responses] == [200] * 12, texts(responses)
    assert len(idle.requests) == 12 and distserve.prefill.requests == []


async def test_prompts_that_begin_alike_go_to_one_prefill_that_caches_prefixes_while_it_is_not_much_busier(
        distserve: Cluster) -> None:
    books = [PrefillBook(prefix_caching=True), PrefillBook(prefix_caching=True)]
    distserve.proxy.node_manager.remove(distserve.p_url)
    with serving(prefill_app(books[0])) as first, serving(prefill_app(books[1])) as second:
        register(distserve, first, 'Prefill')
        register(distserve, second, 'Prefill')
        await answers(distserve, 12, COMPLETION)  # each Prefill is asked what it says of itself once it is chosen
        for book in books:
            book.requests.clear()
        system = 'You are a careful assistant. ' * 12  # longer than what names a prefix
        for index in range(12):
            assert (await distserve.post('/v1/completions', {**COMPLETION, 'prompt': f'{system}{index}'})) \
                .status_code == 200
        alike = [len(book.requests) for book in books]
        for book in books:
            book.requests.clear()
        for index in range(16):
            await distserve.post('/v1/completions', {**COMPLETION, 'prompt': f'{index} {system}'})
        unlike = [len(book.requests) for book in books]

    assert sorted(alike) == [0, 12]  # at random, all 12 to one of two: 1 in 2,048
    assert min(unlike) >= 2  # prompts that begin differently spread over both


async def test_a_decode_whose_kv_cache_is_nearly_full_gets_requests_only_when_every_decode_is(
        distserve: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # read again after 0.1 s, not 2 s: an earlier test's reading of this Decode (none) is not kept
    monkeypatch.setattr(importlib.import_module('lmdeploy_pdfix.units.proxy_distserve.relay'), 'KV_USAGE_TTL_S', 0.1)
    distserve.decode.kv_usage = 0.95  # LMDeploy's lmdeploy:gpu_cache_usage_perc at the node's /metrics
    roomy = DecodeBook(kv_usage=0.1)
    with serving(decode_app(roomy, distserve.prefill)) as url:
        register(distserve, url, 'Decode')
        await answers(distserve, 2, COMPLETION)  # the proxy reads each Decode's /metrics in the background
        await asyncio.sleep(0.5)
        roomy.migrations.clear()
        responses = await answers(distserve, 12, COMPLETION)  # at random, all 12 to one of two: 1 in 2,048
        distserve.proxy.node_manager.remove(url)
        alone = await distserve.post('/v1/completions', COMPLETION)  # nearly full, but the only one

    assert [response.status_code for response in responses] == [200] * 12, texts(responses)
    assert len(roomy.migrations) == 12
    assert alone.status_code == 200, alone.text


async def test_completions_answer_while_registrations_of_a_hung_node_hold_every_worker_thread(
        distserve: Cluster) -> None:
    # LMDeploy registers a node given without a status by asking its /v1/models with no timeout, in one of the
    # proxy's 40 worker threads; stock also runs every completion's JSON check in one of them
    held: list[socket.socket] = []
    with raw_node(held.append) as hung_url:
        async with httpx.AsyncClient(timeout=60) as client:
            registrations = [asyncio.ensure_future(client.post(distserve.url + '/nodes/add', json={'url': hung_url}))
                             for _ in range(WORKER_THREADS)]
            try:
                await within(10, until(lambda: len(held) >= WORKER_THREADS))
                chat = await client.post(distserve.url + '/v1/chat/completions', json=CHAT, timeout=5)
                completion = await client.post(distserve.url + '/v1/completions', json=COMPLETION, timeout=5)
            finally:
                for connection in held:
                    connection.close()  # the registrations fail, and give their threads back
                await asyncio.gather(*registrations, return_exceptions=True)

    assert [chat.status_code, completion.status_code] == [200, 200], (chat.text, completion.text)
    assert all(text.startswith(decoded_text('')[:12]) for text in texts([chat, completion]))
    assert (await audit(distserve))['open'] == 0

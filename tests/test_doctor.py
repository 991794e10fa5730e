"""``lmdeploy-pdfix doctor``: whatever a proxy or a node answers, the operator gets a verdict, never a traceback.

Doctor is run as the command an operator types, against a stand-in proxy and stand-in nodes served over real
HTTP on 127.0.0.1 that answer what a hostile or broken peer might: other shapes, other types, numbers no float
holds, JSON nested past any recursion limit, bodies of 50 MiB or without end, bytes that are not HTTP. Exit
status: 0 healthy, 1 problems found, 3 the proxy could not be asked (2 is argparse's usage error).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lmdeploy_pdfix.domain.ledger import OwnerLedger
from lmdeploy_pdfix.domain.preserved import PreservedBook
from lmdeploy_pdfix.domain.protocol import AUDIT_PATH, NODE_PROOF_PATH, node_address, node_proof
from lmdeploy_pdfix.patching import installation
from lmdeploy_pdfix.tools.doctor import doctor
from tests.servers import serving

REPO = Path(__file__).resolve().parent.parent
NODES_PATH = '/nodes/status'
MiB = 1 << 20
HEALTHY, PROBLEMS, COULD_NOT_ASK, USAGE = 0, 1, 3, 2
TIMEOUT_S = 2.0  # doctor's --timeout in these tests

MakeAnswer = Callable[[], Response]


# ---------------------------------------------------------------------------------------------- stand-ins


class StandIns:
    """A stand-in proxy (its routes at /) and stand-in nodes (node NAME's routes at /NAME) on one server."""

    def __init__(self) -> None:
        self.url = ''
        self.answers: dict[str, MakeAnswer] = {}
        self.streamed = 0  # bytes the streamed answers have produced
        self.node_keys: dict[str, str] = {}  # node name: the node key it proves it holds
        self.authorizations: dict[str, str | None] = {}  # path: the Authorization it was last sent

    async def answer(self, request: Request) -> Response:
        path = request.url.path
        self.authorizations[path] = request.headers.get('Authorization')
        name = path.removesuffix(NODE_PROOF_PATH).strip('/')
        if path.endswith(NODE_PROOF_PATH) and name in self.node_keys:
            nonce, address = (await request.json())['nonce'], node_address(*request.scope['server'])
            return JSONResponse({'proof': node_proof(self.node_keys[name], nonce, address)})
        make = self.answers.get(path)
        return make() if make else JSONResponse({'detail': 'Not Found'}, 404)  # as any LMDeploy server

    def node_url(self, name: str) -> str:
        return f'{self.url}/{name}'

    def healthy(self) -> None:
        """A patched proxy with one patched Prefill and one patched Decode node, all well."""
        nodes = {self.node_url('prefill'): node_status(2), self.node_url('decode'): node_status(3)}
        self.answers = {
            NODES_PATH: json_answer(nodes),
            AUDIT_PATH: json_answer(proxy_books()),
            f'/prefill{AUDIT_PATH}': json_answer(node_audit()),
            f'/decode{AUDIT_PATH}': json_answer(node_audit()),
        }

    def stream(self, chunks: Iterator[bytes], pause_s: float = 0.0) -> MakeAnswer:
        async def counted() -> AsyncIterator[bytes]:
            for chunk in chunks:
                self.streamed += len(chunk)
                yield chunk
                await asyncio.sleep(pause_s)

        return lambda: StreamingResponse(counted(), media_type='application/json')


@pytest.fixture(scope='module')
def served() -> Iterator[StandIns]:
    stand_ins = StandIns()
    with serving(Starlette(routes=[Route('/{path:path}', stand_ins.answer, methods=['GET', 'POST'])])) as url:
        stand_ins.url = url
        yield stand_ins


@pytest.fixture
def stand_ins(served: StandIns) -> StandIns:
    served.healthy()
    served.streamed = 0
    served.node_keys, served.authorizations = {}, {}
    return served


def json_answer(value: Any) -> MakeAnswer:
    body = json.dumps(value)  # NaN and Infinity come out as the literals Python's json reads back
    return lambda: Response(body, media_type='application/json')


def raw_answer(body: bytes | str) -> MakeAnswer:
    return lambda: Response(body, media_type='application/json')


def node_status(role: int) -> dict[str, Any]:
    """One node in LMDeploy's /nodes/status (its EngineRole as the number the proxy serializes)."""
    return {'role': role, 'models': ['stand-in'], 'unfinished': 0, 'latency': [], 'speed': None}


def node_audit(**changes: Any) -> dict[str, Any]:
    """What a patched node's audit route answers (the engine's book, the api_server's links and refusals)."""
    return {**PreservedBook().audit(), 'refused_migration_requests': {}, 'linked_peers': [],
            'software': installation(), **changes}


def proxy_books(**changes: Any) -> dict[str, Any]:
    """What a patched proxy's audit route answers."""
    return {**OwnerLedger().audit(time.monotonic()), 'removed_nodes': {}, 'software': installation(), **changes}


def software(**changes: Any) -> dict[str, Any]:
    return {**installation(), **changes}


def deeply_nested(levels: int = 100_000) -> str:
    return '[' * levels + ']' * levels


def endless(chunk: bytes) -> Iterator[bytes]:
    while True:
        yield chunk


def padded(value: dict[str, Any], size: int) -> Iterator[bytes]:
    """``value`` as JSON with a string field of ``size`` bytes, streamed in 64 KiB pieces."""
    head, tail = json.dumps({**value, 'padding': ''}).rsplit('""', 1)
    yield f'{head}"'.encode()
    for _ in range(size // (64 * 1024)):
        yield b'x' * (64 * 1024)
    yield f'"{tail}'.encode()


# ---------------------------------------------------------------------------------------------- running doctor


def run_doctor(proxy_url: str, *extra: str, timeout_s: float = 60,
               node_key: str | None = None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items()
           if name not in ('LMDEPLOY_PDFIX', 'LMDEPLOY_PDFIX_NODE_API_KEY')}
    if node_key is not None:
        env['LMDEPLOY_PDFIX_NODE_API_KEY'] = node_key
    return subprocess.run([sys.executable, '-m', 'lmdeploy_pdfix.tools.cli', 'doctor', '--proxy', proxy_url,
                           '--timeout', str(TIMEOUT_S), *extra], env={**env, 'PYTHONPATH': str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def strict_json(text: str) -> Any:
    """JSON as any parser reads it: NaN and Infinity, which Python's json writes and reads, are not JSON."""
    def refuse(constant: str) -> Any:
        raise ValueError(f'{constant} is not JSON')

    return json.loads(text, parse_constant=refuse)


def table_and_report(proxy_url: str, exit_status: int) -> tuple[str, dict[str, Any]]:
    """Doctor's table and its --json report, each run checked: the exit status, no traceback, pure JSON."""
    table = run_doctor(proxy_url)
    assert 'Traceback' not in table.stderr, table.stderr
    assert table.returncode == exit_status, table.stdout + table.stderr
    as_json = run_doctor(proxy_url, '--json')
    assert 'Traceback' not in as_json.stderr, as_json.stderr
    assert as_json.returncode == exit_status, as_json.stdout + as_json.stderr
    report = strict_json(as_json.stdout)  # stdout is the JSON alone
    assert report['exit_status'] == exit_status
    return table.stdout, report


def row_of(table: str, url: str) -> str:
    row, = (line for line in table.splitlines() if line.strip().startswith(f'{url} '))
    return row


# ---------------------------------------------------------------------------------------------- a healthy cluster


def test_a_healthy_cluster_is_exit_0(stand_ins: StandIns) -> None:
    # the stand-ins answer what patched LMDeploy answers: the hostile cases below differ from it in one answer
    table, report = table_and_report(stand_ins.url, HEALTHY)
    assert 'no problems found' in table
    assert report['problems'] == []
    assert [(row['url'], row['role']) for row in report['nodes']] == [
        (stand_ins.node_url('prefill'), 'Prefill'), (stand_ins.node_url('decode'), 'Decode')]


def test_a_node_the_proxy_skips_after_a_failure_is_named_with_its_breaker_state(stand_ins: StandIns) -> None:
    decode = stand_ins.node_url('decode')
    stand_ins.answers[AUDIT_PATH] = json_answer(proxy_books(breakers={decode: 'open'}))
    table, report = table_and_report(stand_ins.url, HEALTHY)  # it answers again: the next trial puts it back
    assert f'the proxy skips Decode {decode} after a failed call (open)' in table
    assert [row['breaker'] for row in report['nodes']] == [None, 'open']


# ---------------------------------------------------------------------------------------------- hostile nodes


NODE_ANSWERS: dict[str, Callable[[StandIns], MakeAnswer]] = {
    'software is a string': lambda _: json_answer({'software': 'x'}),
    'a list': lambda _: json_answer([]),
    'a number': lambda _: json_answer(1),
    'null': lambda _: json_answer(None),
    'JSON nested 100k levels deep': lambda _: raw_answer(deeply_nested()),
    'not JSON': lambda _: raw_answer(b'<html>502 Bad Gateway</html>'),
    'not UTF-8': lambda _: raw_answer(b'{"software": "\xff\xfe"}'),
    'a count in Unicode digits': lambda _: json_answer(node_audit(preserved='\u0663')),  # int('٣') is 3
    'a count that is a boolean': lambda _: json_answer(node_audit(preserved=True)),
    'a negative count': lambda _: json_answer(node_audit(preserved=-1)),
    'an age no float holds': lambda _: json_answer(node_audit(preserved=1, oldest_age_s=10 ** 400)),
    'an age of NaN': lambda _: json_answer(node_audit(oldest_age_s=float('nan'))),
    'an age of Infinity': lambda _: raw_answer(json.dumps(node_audit()).replace('"oldest_age_s": 0.0',
                                                                                '"oldest_age_s": 1e999')),
    'a version with a terminal escape': lambda _: json_answer(node_audit(software=software(lmdeploy='\x1b[2J0.18'))),
    'units that are not names': lambda _: json_answer(node_audit(software=software(units={'a': [1]}))),
    'software without its version': lambda _: json_answer(node_audit(software={'units': []})),
    'linked peers that are not a list': lambda _: json_answer(node_audit(linked_peers=7)),
    'a 50 MiB answer': lambda stand_ins: stand_ins.stream(padded(node_audit(), 50 * MiB)),
    'an answer without end': lambda stand_ins: stand_ins.stream(endless(b' ' * 65536)),
}


@pytest.mark.parametrize('answer', NODE_ANSWERS.values(), ids=NODE_ANSWERS.keys())
def test_a_node_answering_something_else_is_a_problem_not_a_traceback(
        stand_ins: StandIns, answer: Callable[[StandIns], MakeAnswer]) -> None:
    decode = stand_ins.node_url('decode')
    stand_ins.answers[f'/decode{AUDIT_PATH}'] = answer(stand_ins)
    table, report = table_and_report(stand_ins.url, PROBLEMS)
    assert 'answer not understood' in row_of(table, decode)
    assert 'answer not understood' not in row_of(table, stand_ins.node_url('prefill'))
    assert '\x1b' not in table  # nothing a node says reaches the operator's terminal as it said it
    problem, = report['problems']
    assert problem.startswith(f'Decode {decode}: its answer to {AUDIT_PATH} was not understood ('), problem
    row, = (row for row in report['nodes'] if row['url'] == decode)
    assert row['answered'] and row['not_understood'] and row['lmdeploy_pdfix'] is None


def test_a_huge_answer_is_not_read_past_its_first_mebibyte(stand_ins: StandIns) -> None:
    stand_ins.answers[f'/decode{AUDIT_PATH}'] = stand_ins.stream(padded(node_audit(), 50 * MiB))
    result = run_doctor(stand_ins.url, '--json')
    problem, = strict_json(result.stdout)['problems']
    assert problem.endswith(f'was not understood (over {MiB} bytes)'), problem
    # what the stand-in produced before doctor hung up: its first MiB and what the sockets' buffers held
    assert stand_ins.streamed < 25 * MiB, stand_ins.streamed


def test_a_node_that_drips_its_answer_does_not_answer_within_the_timeout(stand_ins: StandIns) -> None:
    # each byte comes well within the socket timeout: only a limit on the whole answer ends the wait
    stand_ins.answers[f'/decode{AUDIT_PATH}'] = stand_ins.stream(endless(b' '), pause_s=0.05)
    started = time.monotonic()
    _, report = table_and_report(stand_ins.url, PROBLEMS)
    assert time.monotonic() - started < 4 * TIMEOUT_S + 10  # two runs
    assert report['problems'] == [f"Decode {stand_ins.node_url('decode')} does not answer"]


@pytest.fixture
def not_http() -> Iterator[Callable[[bytes], str]]:
    """``serve(reply) -> url``: a TCP server that answers every connection with ``reply``, HTTP or not."""
    servers: list[socket.socket] = []

    def serve(reply: bytes) -> str:
        listener = socket.create_server(('127.0.0.1', 0))
        servers.append(listener)

        def answer_all() -> None:
            with contextlib.suppress(OSError):  # the listener closed: the test ended
                while True:
                    connection, _ = listener.accept()
                    with connection:
                        connection.recv(65536)
                        connection.sendall(reply)

        threading.Thread(target=answer_all, daemon=True).start()
        return f'http://127.0.0.1:{listener.getsockname()[1]}'

    yield serve
    for listener in servers:
        listener.close()


NOT_HTTP = {
    'bytes that are not HTTP': b'garbage\r\n\r\n',
    'more than 100 headers': b'HTTP/1.1 200 OK\r\n' + b'X-Pad: 1\r\n' * 101 + b'\r\n',
    'a chunked body cut short': b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n',
}


@pytest.mark.parametrize('reply', NOT_HTTP.values(), ids=NOT_HTTP.keys())
def test_a_node_that_does_not_speak_http_does_not_answer(stand_ins: StandIns, not_http: Callable[[bytes], str],
                                                         reply: bytes) -> None:
    node = not_http(reply)
    stand_ins.answers[NODES_PATH] = json_answer({node: node_status(3)})
    _, report = table_and_report(stand_ins.url, PROBLEMS)
    assert report['problems'] == [f'Decode {node} does not answer']


def test_a_redirect_is_not_followed(stand_ins: StandIns) -> None:
    # a node names no other place to ask, nor to send the node key to
    stand_ins.answers[f'/decode{AUDIT_PATH}'] = lambda: Response(
        status_code=307, headers={'Location': f"{stand_ins.node_url('prefill')}{AUDIT_PATH}"})
    _, report = table_and_report(stand_ins.url, PROBLEMS)
    assert report['problems'] == [
        f"Decode {stand_ins.node_url('decode')}: its answer to {AUDIT_PATH} was not understood (HTTP 307)"]


def test_a_node_without_pdfix_is_still_named_so(stand_ins: StandIns) -> None:
    del stand_ins.answers[f'/prefill{AUDIT_PATH}']  # stock LMDeploy: no audit route, 404
    _, report = table_and_report(stand_ins.url, PROBLEMS)
    assert report['problems'] == [
        f"Prefill {stand_ins.node_url('prefill')} runs without lmdeploy-pdfix (a Prefill without it leaks one "
        'session per DistServe request); enable lmdeploy-pdfix there (LMDEPLOY_PDFIX=1) and restart it']


# ---------------------------------------------------------------------------------------------- hostile proxies


PROXY_NODE_LISTS: dict[str, Callable[[StandIns], MakeAnswer]] = {
    'HTTP 404': lambda _: lambda: JSONResponse({'detail': 'Not Found'}, 404),
    'false (what LMDeploy answers when its own listing fails)': lambda _: json_answer(False),
    'a list': lambda _: json_answer([]),
    'a number': lambda _: json_answer(1),
    'software is a string': lambda _: json_answer({'software': 'x'}),
    'a node whose status is a string': lambda s: json_answer({s.node_url('decode'): 'x'}),
    'a node whose role is an object': lambda s: json_answer({s.node_url('decode'): {'role': {}}}),
    'a role in Unicode digits': lambda s: json_answer({s.node_url('decode'): {'role': '\u0662'}}),
    'a node port in Unicode digits': lambda s: json_answer({s.url.rsplit(':', 1)[0] + ':\u0668\u0660': node_status(3)}),
    'a node that is a local file': lambda _: json_answer({'file:///etc/passwd#': node_status(3)}),
    'JSON nested 100k levels deep': lambda _: raw_answer(deeply_nested()),
    'not JSON': lambda _: raw_answer(b'<html>502 Bad Gateway</html>'),
    'a 50 MiB answer': lambda s: s.stream(padded({}, 50 * MiB)),
    'an answer dripped without end': lambda s: s.stream(endless(b' '), pause_s=0.05),
}


@pytest.mark.parametrize('answer', PROXY_NODE_LISTS.values(), ids=PROXY_NODE_LISTS.keys())
def test_a_proxy_whose_node_list_is_not_understood_could_not_be_asked(
        stand_ins: StandIns, answer: Callable[[StandIns], MakeAnswer]) -> None:
    stand_ins.answers[NODES_PATH] = answer(stand_ins)
    table, report = table_and_report(stand_ins.url, COULD_NOT_ASK)
    assert f'proxy {stand_ins.url}: could not ask' in table
    assert not report['proxy_answered'] and report['nodes'] == []
    problem, = report['problems']
    assert problem.startswith(f'proxy {stand_ins.url}'), problem
    assert not stand_ins.streamed or stand_ins.streamed < 25 * MiB


def test_could_not_ask_is_its_own_exit_status() -> None:
    with socket.create_server(('127.0.0.1', 0)) as closed:
        nobody = f'http://127.0.0.1:{closed.getsockname()[1]}'
    _, report = table_and_report(nobody, COULD_NOT_ASK)
    assert report['problems'] == [f'proxy {nobody} does not answer: is it an LMDeploy proxy?']
    usage = run_doctor(nobody, '--timeout', 'soon')
    assert usage.returncode == USAGE  # argparse's: a wrong command line is not an unreachable proxy


PROXY_BOOKS: dict[str, MakeAnswer] = {
    'software is a string': json_answer({'software': 'x'}),
    'a list': json_answer([]),
    'JSON nested 100k levels deep': raw_answer(deeply_nested()),
    'removed nodes that are a list': json_answer(proxy_books(removed_nodes=[1])),
    'breakers that are a list': json_answer(proxy_books(breakers=['open'])),
    'a breaker state with a terminal escape': json_answer(proxy_books(breakers={'http://127.0.0.1:1': '\x1b[2J'})),
    'a failed-release count in Unicode digits': json_answer(proxy_books(open_by_state={'release_failed': '\u0663'})),
    'an age no float holds': json_answer(proxy_books(oldest_age_s=10 ** 400)),
    'a version with a terminal escape': json_answer(proxy_books(software=software(lmdeploy_pdfix='\x1b[31m0.1'))),
}


@pytest.mark.parametrize('answer', PROXY_BOOKS.values(), ids=PROXY_BOOKS.keys())
def test_a_proxy_whose_books_are_not_understood_is_a_problem_and_its_nodes_are_still_asked(
        stand_ins: StandIns, answer: MakeAnswer) -> None:
    stand_ins.answers[AUDIT_PATH] = answer
    table, report = table_and_report(stand_ins.url, PROBLEMS)
    assert '\x1b' not in table
    problem, = report['problems']
    assert problem.startswith(f'proxy {stand_ins.url}: its answer to {AUDIT_PATH} was not understood ('), problem
    assert report['proxy_books'] is None
    assert all(row['lmdeploy_pdfix'] for row in report['nodes']) and len(report['nodes']) == 2


# ---------------------------------------------------------------------------------------------- any answer at all


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.integers(min_value=10 ** 300, max_value=10 ** 400), st.floats(),
                    st.text(max_size=12), st.sampled_from(['\u0663', '\x1b[2J', 'http://127.0.0.1:1', '']))
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=12)


def like(healthy: dict[str, Any]) -> st.SearchStrategy:
    """Answers near ``healthy``: one field of any value, any fields of any value, or any JSON at all."""
    one_field = st.tuples(st.sampled_from(sorted(healthy)), json_values).map(lambda pair: {**healthy, pair[0]: pair[1]})
    any_fields = st.fixed_dictionaries({}, optional={name: json_values for name in healthy})
    return st.one_of(st.just(healthy), one_field, any_fields, json_values)


NODE_MARK = 'NODE'  # the stand-in node's URL, known only once it is served


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(node_list=st.one_of(like({NODE_MARK: node_status(2)}), like({NODE_MARK: {'role': 3}})),
       books=like(proxy_books()),
       audit=st.one_of(like(node_audit()), like(software()).map(lambda them: node_audit(software=them))))
def test_any_json_answer_gets_a_verdict_and_pure_json(served: StandIns, node_list: Any, books: Any,
                                                      audit: Any) -> None:
    if isinstance(node_list, dict):
        node_list = {served.node_url('node') if url == NODE_MARK else url: status for url, status in node_list.items()}
    served.answers = {NODES_PATH: json_answer(node_list), AUDIT_PATH: json_answer(books),
                      f'/node{AUDIT_PATH}': json_answer(audit)}
    with contextlib.redirect_stdout(io.StringIO()) as table:
        table_status = doctor(served.url, as_json=False, timeout_s=10)
    with contextlib.redirect_stdout(io.StringIO()) as as_json:
        json_status = doctor(served.url, as_json=True, timeout_s=10)
    report = strict_json(as_json.getvalue())
    assert table_status == json_status == report['exit_status'] in {HEALTHY, PROBLEMS, COULD_NOT_ASK}
    assert (json_status == HEALTHY) == (report['problems'] == [])
    event(f'exit status {json_status}')  # --hypothesis-show-statistics: every verdict is reached
    assert '\x1b' not in table.getvalue()


# ---------------------------------------------------------------------------------------------- the node key


def test_doctor_sends_the_node_key_only_to_nodes_that_prove_they_hold_it(stand_ins: StandIns) -> None:
    # the node list comes from the proxy, where anyone may have added a node: before, each was sent the key
    key = 'the-operators-node-key'
    stand_ins.node_keys = {'prefill': key, 'decode': 'another key'}
    run = run_doctor(stand_ins.url, node_key=key)
    assert run.returncode == HEALTHY, run.stdout + run.stderr
    assert stand_ins.authorizations[f'/prefill{AUDIT_PATH}'] == f'Bearer {key}'
    assert stand_ins.authorizations[f'/decode{AUDIT_PATH}'] is None
    assert stand_ins.authorizations[NODES_PATH] == f'Bearer {key}'  # the proxy the operator named


@pytest.mark.parametrize('timeout', ['nan', 'inf', '0', '-1', '1e308'])
def test_a_timeout_that_is_not_a_number_of_seconds_is_a_usage_error(stand_ins: StandIns, timeout: str) -> None:
    run = run_doctor(stand_ins.url, '--timeout', timeout)
    assert run.returncode == USAGE and 'Traceback' not in run.stderr and '--timeout' in run.stderr


def test_doctor_notes_the_nodes_that_hold_no_node_key_without_calling_it_a_problem(stand_ins: StandIns) -> None:
    stand_ins.answers[f'/decode{AUDIT_PATH}'] = json_answer(node_audit(node_key=False))
    table, report = table_and_report(stand_ins.url, HEALTHY)
    assert "note: 1 node(s) hold no node key: anyone who reaches such a node's port" in table
    assert report['notes'] and 'docs/security.md' in report['notes'][0]
    assert [row['node_key'] for row in report['nodes']] == [None, False]  # the Prefill says nothing of it


# ---------------------------------------------------------------------------------------------- proxy replicas


def replica_of(stand_ins: StandIns, nodes: dict[str, Any]) -> str:
    """A second stand-in proxy over ``nodes`` (its routes at /replica); its URL."""
    stand_ins.answers['/replica' + NODES_PATH] = json_answer(nodes)
    stand_ins.answers['/replica' + AUDIT_PATH] = json_answer(proxy_books())
    return f'{stand_ins.url}/replica'


def test_replicas_that_route_to_the_same_nodes_are_exit_0(stand_ins: StandIns) -> None:
    both = {stand_ins.node_url('prefill'): node_status(2), stand_ins.node_url('decode'): node_status(3)}
    table, report = table_and_report(f'{stand_ins.url},{replica_of(stand_ins, both)}', HEALTHY)

    assert [replica['proxy'] for replica in report['replicas']] == [stand_ins.url, f'{stand_ins.url}/replica']
    assert report['problems'] == []
    assert 'the replicas agree on their nodes' in table


def test_a_node_registered_with_one_replica_only_is_named_with_the_fix(stand_ins: StandIns) -> None:
    prefill_only = {stand_ins.node_url('prefill'): node_status(2)}
    table, report = table_and_report(f'{stand_ins.url},{replica_of(stand_ins, prefill_only)}', PROBLEMS)

    (problem,) = report['problems']
    assert problem.startswith(f"Decode {stand_ins.node_url('decode')} is registered with {stand_ins.url} but not "
                              f'with {stand_ins.url}/replica')
    assert '--proxy-url naming every replica' in problem and problem in table


def test_a_replica_that_does_not_answer_is_exit_3_and_the_others_are_still_examined(stand_ins: StandIns) -> None:
    table, report = table_and_report(f'{stand_ins.url},{stand_ins.url}/gone', COULD_NOT_ASK)

    assert [replica['proxy_answered'] for replica in report['replicas']] == [True, False]
    assert stand_ins.node_url('decode') in table

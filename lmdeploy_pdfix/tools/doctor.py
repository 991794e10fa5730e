"""``lmdeploy-pdfix doctor --proxy URL``: one look at a DistServe cluster, and the problems an operator can act on.

Asks the proxy for its nodes and its books, then every node (those registered and those its heartbeat
removed) for its book of preserved caches, and prints one table. Exit status: 0 healthy, 1 problems found,
3 the proxy could not be asked (it did not answer, or its list of nodes was not understood); 2 is argparse's,
a wrong command line. Nothing a proxy or node answers is trusted: each answer is read up to ``MAX_ANSWER_BYTES``
within the timeout and checked field by field; any other answer is a problem line, never a traceback. The node
key goes to the proxy the operator named, and to a listed node only once it proved it holds the key (anyone may
have added a node to the proxy's list). Only the standard library: it runs wherever the package is installed.
"""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.protocol import (
    AUDIT_PATH,
    MAX_NODE_URL_CHARS,
    NODE_PROOF_PATH,
    bearer,
    node_credentials,
    parse_proof,
    proves_key,
    proxy_urls,
    refused_credentials,
)

NODES_PATH = '/nodes/status'
ROLES = {1: 'Hybrid', 2: 'Prefill', 3: 'Decode'}  # LMDeploy's EngineRole, as its proxy serializes it
ENABLE_HINT = 'enable lmdeploy-pdfix there (LMDEPLOY_PDFIX=1) and restart it'
REPLICAS_HINT = 'start each node with --proxy-url naming every replica, comma-separated'
HEALTHY, PROBLEMS, COULD_NOT_ASK = 0, 1, 3  # not 2: argparse exits 2 on a wrong command line
MAX_ANSWER_BYTES = 1 << 20  # an audit is a few KiB; /nodes/status about 0.5 KiB a node: some 2000 nodes
MAX_NAME_CHARS = 128  # a version, a unit, a state, a cause
MAX_COUNT = 2 ** 63 - 1
MAX_SECONDS = 1e9  # ages and TTLs; also what keeps them formattable as floats

# a field's value and where it is (a jq path, '' the whole answer) -> the value doctor keeps, or NotUnderstood
Check = Callable[[Any, str], Any]


class NotUnderstood(ValueError):
    """An answer of another shape; its message names where, never the answer's text (which may be hostile)."""


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no HTTP answer within the timeout
    body: bytes = b''  # at most MAX_ANSWER_BYTES + 1 bytes: the one more says the answer is larger

    def json(self) -> Any:
        if self.status != 200:
            raise NotUnderstood(f'HTTP {self.status}')
        if len(self.body) > MAX_ANSWER_BYTES:
            raise NotUnderstood(f'over {MAX_ANSWER_BYTES} bytes')
        try:
            return json.loads(self.body)
        except RecursionError:
            raise NotUnderstood('JSON nested too deep') from None
        except ValueError:
            raise NotUnderstood('not JSON') from None


# ---------------------------------------------------------------------------------------------- asking


def ask(url: str, timeout_s: float, credentials: dict[str, str], body: Any = None) -> Answer:
    """A GET of ``url`` (a POST of ``body`` as JSON, if any) that ends within ``timeout_s``, whatever the pace of
    the answer."""
    answers: list[Answer] = []
    # the socket timeout bounds each read, not a peer that drips its answer byte by byte: such a read is left
    # to its daemon thread (which stops at MAX_ANSWER_BYTES) and counts as no answer
    asking = threading.Thread(target=lambda: answers.append(_ask(url, timeout_s, credentials, body)), daemon=True)
    asking.start()
    asking.join(timeout_s)
    return answers[0] if answers else Answer(None)


def _ask(url: str, timeout_s: float, credentials: dict[str, str], body: Any) -> Answer:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={**credentials, 'Content-Type': 'application/json'})
    try:
        with _opener().open(request, timeout=timeout_s) as response:
            return Answer(response.status, response.read(MAX_ANSWER_BYTES + 1))
    except urllib.error.HTTPError as exc:
        exc.close()  # only a 200's body is read
        return Answer(exc.code)
    except (OSError, ValueError, http.client.HTTPException):  # no connection, or bytes that are not HTTP
        return Answer(None)


def _opener() -> urllib.request.OpenerDirector:
    """HTTP(S) only, without the environment's proxies and without redirects: a node names no other place to
    ask, nor to send the node key to."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.UnknownHandler(), urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


# ---------------------------------------------------------------------------------------------- shapes


def _fields(value: Any, where: str, checks: dict[str, Check]) -> dict[str, Any]:
    """The fields doctor reads, each checked (others are ignored: a newer peer may answer more)."""
    answer = _object(value, where)
    for name in checks:
        if name not in answer:
            raise _refused(where, f'has no {name}')
    return {name: check(answer[name], f'{where}.{name}') for name, check in checks.items()}


def _refused(where: str, what: str) -> NotUnderstood:
    return NotUnderstood(f'{_shown(where)} {what}')


def _shown(where: str) -> str:
    return where or 'the answer'


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _refused(where, 'is not an object')
    return value


def _count(value: Any, where: str) -> int:
    # a JSON integer: not a bool (an int to Python), not a string (int('٣') reads Unicode digits)
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise _refused(where, 'is not a count')
    return value


def _seconds(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not 0 <= value <= MAX_SECONDS:  # NaN compares false
        raise _refused(where, 'is not a number of seconds')
    return float(value)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _refused(where, 'is not a list')
    return value


def _length(value: Any, where: str) -> int:
    return len(_list(value, where))


def _printable(value: Any, max_chars: int) -> bool:
    # shown on the operator's terminal: no escapes, no look-alike characters
    return isinstance(value, str) and 0 < len(value) <= max_chars and value.isascii() and value.isprintable()


def _name(value: Any, where: str) -> str:
    if not _printable(value, MAX_NAME_CHARS):
        raise _refused(where, 'is not a name')
    return value


def _node_url(value: Any, where: str) -> str:
    if not (_printable(value, MAX_NODE_URL_CHARS) and _askable(value)):
        raise _refused(where, 'is not a node URL')
    return value


def _askable(url: str) -> bool:
    """An http(s) URL to which doctor appends its paths: not a file: URL, nor one whose query or fragment would
    swallow the path."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # a ValueError where it is not a port
    except ValueError:
        return False
    return parts.scheme in ('http', 'https') and bool(parts.hostname) and port != 0 and not set(' ?#') & set(url)


def _role(value: Any, where: str) -> str:
    if type(value) is not int or value not in ROLES:
        raise _refused(where, 'is not a role')
    return ROLES[value]


def _optional(check: Check) -> Check:
    return lambda value, where: None if value is None else check(value, where)


def _list_of(check: Check) -> Check:
    def checked(value: Any, where: str) -> list[Any]:
        return [check(item, f'{where}[{index}]') for index, item in enumerate(_list(value, where))]

    return checked


def _mapping(key: Check, check: Check) -> Check:
    def checked(value: Any, where: str) -> dict[str, Any]:
        return {key(name, f'a key of {_shown(where)}'): check(item, f'{where}[]')
                for name, item in _object(value, where).items()}

    return checked


def _software(value: Any, where: str) -> dict[str, Any]:
    return _fields(value, where, {'lmdeploy': _optional(_name), 'lmdeploy_pdfix': _name, 'units': _list_of(_name)})


def _listed_role(value: Any, where: str) -> str:
    return _fields(value, where, {'role': _role})['role']


NODE_LIST = _mapping(_node_url, _listed_role)  # LMDeploy's /nodes/status: node URL -> its Status
NODE_AUDIT = {'software': _software, 'preserved': _count, 'oldest_age_s': _seconds, 'orphan_ttl_s': _seconds,
              'linked_peers': _length}
PROXY_BOOKS = {'open': _count, 'open_by_state': _mapping(_name, _count), 'open_by_prefill': _mapping(_node_url, _count),
               'oldest_age_s': _seconds, 'releases': _mapping(_name, _count),
               'owner_rejections': _mapping(_name, _count), 'release_failures': _mapping(_name, _count),
               'removed_nodes': _mapping(_node_url, _optional(_name)), 'software': _software}
BREAKERS = _mapping(_node_url, _name)


# ---------------------------------------------------------------------------------------------- the report


@dataclass
class NodeRow:
    url: str
    role: str
    answered: bool = False
    not_understood: str | None = None  # why its answer was not understood
    lmdeploy: str | None = None
    lmdeploy_pdfix: str | None = None
    units: list[str] = field(default_factory=list)
    preserved: int | None = None
    oldest_age_s: float | None = None
    orphan_ttl_s: float | None = None
    proxy_open_records: int = 0
    links: int | None = None
    removed_by_heartbeat: bool = False
    node_key: bool | None = None  # whether it holds a node key, as it says
    breaker: str | None = None  # the proxy skips it after a failure: open, or half_open (None: closed)


@dataclass
class Report:
    proxy: str
    proxy_answered: bool  # its node list was read: the proxy could be asked
    proxy_software: dict[str, Any] | None
    proxy_books: dict[str, Any] | None
    nodes: list[NodeRow]
    problems: list[str]
    notes: list[str] = field(default_factory=list)  # what an operator should know; no problem (exit status)

    @property
    def exit_status(self) -> int:
        if not self.proxy_answered:
            return COULD_NOT_ASK
        return PROBLEMS if self.problems else HEALTHY

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), 'exit_status': self.exit_status}


def _not_understood(path: str, reason: object) -> str:
    return f'its answer to {path} was not understood ({reason})'


def examine(proxy_url: str, timeout_s: float = 5.0) -> Report:
    proxy_url = proxy_url.rstrip('/')
    # the operator named the proxy: it gets the node key; a node only once it proved it holds the key
    answer = ask(proxy_url + NODES_PATH, timeout_s, node_credentials())
    try:
        nodes = NODE_LIST(answer.json(), '')
    except NotUnderstood as exc:
        problem = (f'proxy {proxy_url} does not answer' if answer.status is None else
                   f'proxy {proxy_url}: {_not_understood(NODES_PATH, exc)}')
        return Report(proxy_url, False, None, None, [], [f'{problem}: is it an LMDeploy proxy?'])
    books, books_problem = _proxy_books(proxy_url, ask(proxy_url + AUDIT_PATH, timeout_s, node_credentials()))
    removed = books['removed_nodes'] if books else {}
    rows = [NodeRow(url, role) for url, role in nodes.items()] + [
        NodeRow(url, role or '?', removed_by_heartbeat=True) for url, role in removed.items()]
    with ThreadPoolExecutor(max(1, min(16, len(rows)))) as pool:
        list(pool.map(lambda row: _ask_node(row, timeout_s), rows))
    for row in rows:
        row.proxy_open_records = books['open_by_prefill'].get(row.url, 0) if books else 0
        row.breaker = books['breakers'].get(row.url) if books else None
    problems = [books_problem] if books_problem else []
    problems += _problems(books, rows)
    return Report(proxy_url, True, books['software'] if books else None, books, rows, problems, _notes(rows))


def _notes(rows: list[NodeRow]) -> list[str]:
    notes = [f'the proxy skips {row.role} {row.url} after a failed call ({row.breaker}): it tries it again '
             'after a back-off, and puts it back once it answers' for row in rows if row.breaker]
    unkeyed = sum(row.node_key is False for row in rows)  # which ones: node_key in the --json rows
    if unkeyed:
        notes.append(f"{unkeyed} node(s) hold no node key: anyone who reaches such a node's port can link it, "
                     'claim and free caches; see docs/security.md')
    return notes


def _proxy_books(proxy_url: str, answer: Answer) -> tuple[dict[str, Any] | None, str | None]:
    """The proxy's books, or None and the problem that says why not."""
    if answer.status == 404:  # a proxy without pdfix has no audit route
        return None, (f'proxy {proxy_url} runs without lmdeploy-pdfix: DistServe chat fails and Prefill sessions '
                      f'leak; {ENABLE_HINT}')
    if answer.status is None:
        return None, f'proxy {proxy_url} does not answer {AUDIT_PATH}'
    try:
        books = _fields(answer.json(), '', PROXY_BOOKS)
        # a proxy of an earlier release names no breakers
        books['breakers'] = BREAKERS(answer.json().get('breakers', {}), 'breakers')
        return books, None
    except NotUnderstood as exc:
        return None, f'proxy {proxy_url}: {_not_understood(AUDIT_PATH, exc)}'


def _proven_credentials(url: str, timeout_s: float) -> dict[str, str]:
    """The node key's headers for the node at ``url`` once it proved it holds the key; none otherwise (the node
    list comes from the proxy, which anyone may have added a node to)."""
    key = settings.NODE_API_KEY.value()
    if key is None:
        return {}
    nonce = secrets.token_hex(16)
    try:
        proof = parse_proof(ask(url + NODE_PROOF_PATH, timeout_s, {}, {'nonce': nonce}).json())
        parts = urllib.parse.urlsplit(url)
        resolved = [info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)]
    except (NotUnderstood, ValueError, OSError):
        return {}
    return bearer(key) if proves_key(proof, key, nonce, url, resolved) else {}


def _ask_node(row: NodeRow, timeout_s: float) -> None:
    credentials = _proven_credentials(row.url, timeout_s)
    answer = ask(row.url + AUDIT_PATH, timeout_s, credentials)
    row.answered = answer.status is not None
    if refused_credentials(answer.status or 0) and settings.NODE_API_KEY.value() and not credentials:
        row.not_understood = f'HTTP {answer.status}: it has not proven it holds {settings.NODE_API_KEY.name}, ' \
                             'so it was not sent the key'
        return
    if answer.status in (None, 404):  # 404: a node without pdfix has no audit route
        return
    try:
        body = answer.json()
        audit = _fields(body, '', NODE_AUDIT)
    except NotUnderstood as exc:
        row.not_understood = str(exc)
        return
    row.node_key = body['node_key'] if isinstance(body.get('node_key'), bool) else None  # an older node: unsaid
    software = audit['software']
    row.lmdeploy, row.lmdeploy_pdfix, row.units = software['lmdeploy'], software['lmdeploy_pdfix'], software['units']
    row.preserved, row.oldest_age_s = audit['preserved'], audit['oldest_age_s']
    row.orphan_ttl_s, row.links = audit['orphan_ttl_s'], audit['linked_peers']


def _problems(books: dict[str, Any] | None, rows: list[NodeRow]) -> list[str]:
    problems = []
    if books and books['open_by_state'].get('release_failed'):
        problems.append(f"proxy: {books['open_by_state']['release_failed']} retained Prefill caches could not be "
                        'released; POST /distserve/gc retries them once their node answers')
    for row in rows:
        problems.extend(_node_problems(row))
    problems.extend(_skew(books, rows))
    return problems


def _node_problems(row: NodeRow) -> list[str]:
    name = f'{row.role} {row.url}'
    if row.removed_by_heartbeat and not row.answered:
        return [f'{name} does not answer; the heartbeat removed it and registers it again once it answers']
    if not row.answered:
        return [f'{name} does not answer']
    if row.not_understood is not None:
        return [f'{name}: {_not_understood(AUDIT_PATH, row.not_understood)}']
    if row.lmdeploy_pdfix is None:
        leak = ' (a Prefill without it leaks one session per DistServe request)' if row.role == 'Prefill' else ''
        return [f'{name} runs without lmdeploy-pdfix{leak}; {ENABLE_HINT}']
    if row.removed_by_heartbeat:
        return [f'{name} answers again but is not registered yet; the next heartbeat registers it']
    if row.preserved and row.orphan_ttl_s and (row.oldest_age_s or 0.0) > row.orphan_ttl_s / 2:
        return [f'{name} holds a preserved cache {row.oldest_age_s:.0f} s old, over half the orphan TTL '
                f'({row.orphan_ttl_s:g} s): its Decode never took it over']
    return []


def _skew(books: dict[str, Any] | None, rows: list[NodeRow]) -> list[str]:
    software = [(name, soft) for name, soft in [('proxy', books['software'] if books else None)]
                + [(row.url, {'lmdeploy': row.lmdeploy, 'lmdeploy_pdfix': row.lmdeploy_pdfix}) for row in rows]
                if soft and soft['lmdeploy_pdfix']]
    problems = []
    for package in ('lmdeploy', 'lmdeploy_pdfix'):
        versions: dict[str, list[str]] = {}
        for name, soft in software:
            versions.setdefault(str(soft[package]), []).append(name)
        if len(versions) > 1:
            found = '; '.join(f'{version} on {", ".join(names)}' for version, names in sorted(versions.items()))
            problems.append(f'version skew of {package}: {found}')
    return problems


# ---------------------------------------------------------------------------------------------- output


def print_table(report: Report) -> None:
    if not report.proxy_answered:
        print(f'proxy {report.proxy}: could not ask')
        for problem in report.problems:
            print(f'  - {problem}')
        return
    software = report.proxy_software or {}
    print(f"proxy {report.proxy}: LMDeploy {software.get('lmdeploy') or '?'}, "
          f"lmdeploy-pdfix {software.get('lmdeploy_pdfix', 'absent')}")
    if report.proxy_books is not None:
        books = report.proxy_books
        states = ', '.join(f'{count} {state}' for state, count in sorted(books['open_by_state'].items()))
        print(f"  open records: {books['open']}{f' ({states})' if states else ''}, "
              f"oldest {books['oldest_age_s']:.1f} s")
    header = ('node', 'role', 'lmdeploy', 'pdfix', 'units', 'preserved', 'oldest_s', 'open', 'links')
    table = [header] + [_cells(row) for row in report.nodes]
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    for line in table:
        print('  ' + '  '.join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    print('problems:' if report.problems else 'no problems found')
    for problem in report.problems:
        print(f'  - {problem}')
    for note in report.notes:
        print(f'note: {note}')


def _cells(row: NodeRow) -> tuple[str, ...]:
    if not row.answered or row.not_understood is not None:
        lmdeploy = '-' if not row.answered else 'answer not understood'
        return (row.url, row.role, lmdeploy, '-', '-', '-', '-', str(row.proxy_open_records), '-')
    oldest = '-' if row.oldest_age_s is None else f'{row.oldest_age_s:.1f}'
    return (row.url, row.role, row.lmdeploy or '?', row.lmdeploy_pdfix or 'absent', str(len(row.units)),
            '-' if row.preserved is None else str(row.preserved), oldest, str(row.proxy_open_records),
            '-' if row.links is None else str(row.links))


def replica_problems(reports: list[Report]) -> list[str]:
    """What proxy replicas over the same nodes disagree on: a node one replica routes to and another does not
    know (it was started with a ``--proxy-url`` that does not name every replica, D30)."""
    asked = [report for report in reports if report.proxy_answered]
    listed: dict[tuple[str, str], set[str]] = {}
    for report in asked:
        for row in report.nodes:
            if not row.removed_by_heartbeat:
                listed.setdefault((row.role, row.url), set()).add(report.proxy)
    problems = []
    for (role, url), proxies in sorted(listed.items()):
        missing = [report.proxy for report in asked if report.proxy not in proxies]
        if missing:
            problems.append(f'{role} {url} is registered with {", ".join(sorted(proxies))} but not with '
                            f'{", ".join(missing)}; {REPLICAS_HINT}')
    return problems


def doctor(proxy_url: str, as_json: bool, timeout_s: float) -> int:
    """Examine the proxy, or each replica of a comma-separated list, and print the verdict; its exit status."""
    reports = [examine(url, timeout_s) for url in proxy_urls(proxy_url) or [proxy_url]]
    if len(reports) == 1:
        (report,) = reports
        if as_json:
            print(json.dumps(report.as_dict(), indent=2))
        else:
            print_table(report)
        return report.exit_status
    problems = replica_problems(reports)
    statuses = [report.exit_status for report in reports] + [PROBLEMS if problems else HEALTHY]
    status = COULD_NOT_ASK if COULD_NOT_ASK in statuses else max(statuses)
    if as_json:
        print(json.dumps({'replicas': [report.as_dict() for report in reports], 'problems': problems,
                          'exit_status': status}, indent=2))
        return status
    for report in reports:
        print_table(report)
    print('across the replicas:' if problems else 'the replicas agree on their nodes')
    for problem in problems:
        print(f'  - {problem}')
    return status

"""``lmdeploy-pdfix doctor --proxy URL``: one look at a DistServe cluster, and the problems an operator can act on.

Asks the proxy for its nodes and its books, then every node (those registered and those its heartbeat
removed) for its book of preserved caches, and prints one table. Exit status: 0 healthy, 1 problems found,
2 the proxy could not be asked. Only the standard library: it runs wherever the package is installed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from lmdeploy_pdfix.protocol import AUDIT_PATH, node_credentials

NODES_PATH = '/nodes/status'
ROLES = {1: 'Hybrid', 2: 'Prefill', 3: 'Decode'}  # LMDeploy's EngineRole, as its proxy serializes it
ENABLE_HINT = 'enable lmdeploy-pdfix there (LMDEPLOY_PDFIX=1) and restart it'
HEALTHY, PROBLEMS, UNREACHABLE = 0, 1, 2


@dataclass
class NodeRow:
    url: str
    role: str
    answered: bool = False
    lmdeploy: str | None = None
    lmdeploy_pdfix: str | None = None
    units: list[str] = field(default_factory=list)
    preserved: int | None = None
    oldest_age_s: float | None = None
    orphan_ttl_s: float | None = None
    proxy_open_records: int = 0
    links: int | None = None
    removed_by_heartbeat: bool = False


@dataclass
class Report:
    proxy: str
    proxy_answered: bool
    proxy_software: dict[str, Any] | None
    proxy_books: dict[str, Any] | None
    nodes: list[NodeRow]
    problems: list[str]

    @property
    def exit_status(self) -> int:
        if not self.proxy_answered:
            return UNREACHABLE
        return PROBLEMS if self.problems else HEALTHY

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), 'exit_status': self.exit_status}


def get_json(url: str, timeout_s: float) -> tuple[int | None, Any]:
    """The HTTP status and JSON body of a GET (None, None when nothing answered; body None when not JSON)."""
    request = urllib.request.Request(url, headers=node_credentials())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError):
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def examine(proxy_url: str, timeout_s: float = 5.0) -> Report:
    proxy_url = proxy_url.rstrip('/')
    status, nodes = get_json(proxy_url + NODES_PATH, timeout_s)
    if status != 200 or not isinstance(nodes, dict):
        problem = 'does not answer' if status is None else f'answered HTTP {status} to {NODES_PATH}'
        return Report(proxy_url, False, None, None, [], [f'proxy {proxy_url} {problem}: is it an LMDeploy proxy?'])
    status, books = get_json(proxy_url + AUDIT_PATH, timeout_s)
    books = books if status == 200 and isinstance(books, dict) else None
    removed = (books or {}).get('removed_nodes') or {}
    rows = [NodeRow(url, ROLES.get((info or {}).get('role'), str((info or {}).get('role')))) for url, info in
            nodes.items()] + [NodeRow(url, role or '?', removed_by_heartbeat=True) for url, role in removed.items()]
    with ThreadPoolExecutor(max(1, min(16, len(rows)))) as pool:
        list(pool.map(lambda row: _ask_node(row, timeout_s), rows))
    for row in rows:
        row.proxy_open_records = ((books or {}).get('open_by_prefill') or {}).get(row.url, 0)
    software = (books or {}).get('software')
    return Report(proxy_url, True, software, books, rows, _problems(proxy_url, books, rows))


def _ask_node(row: NodeRow, timeout_s: float) -> None:
    status, audit = get_json(row.url + AUDIT_PATH, timeout_s)
    row.answered = status is not None
    if status != 200 or not isinstance(audit, dict):
        return
    software = audit.get('software') or {}
    row.lmdeploy, row.lmdeploy_pdfix = software.get('lmdeploy'), software.get('lmdeploy_pdfix')
    row.units = list(software.get('units') or [])
    row.preserved, row.oldest_age_s = audit.get('preserved'), audit.get('oldest_age_s')
    row.orphan_ttl_s = audit.get('orphan_ttl_s')
    row.links = len(audit.get('linked_peers') or [])


def _problems(proxy_url: str, books: dict[str, Any] | None, rows: list[NodeRow]) -> list[str]:
    problems = []
    if books is None:
        problems.append(f'proxy {proxy_url} runs without lmdeploy-pdfix: DistServe chat fails and Prefill '
                        f'sessions leak; {ENABLE_HINT}')
    elif (books.get('open_by_state') or {}).get('release_failed'):
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
    software = [(name, soft) for name, soft in [('proxy', (books or {}).get('software'))]
                + [(row.url, {'lmdeploy': row.lmdeploy, 'lmdeploy_pdfix': row.lmdeploy_pdfix}) for row in rows]
                if soft and soft.get('lmdeploy_pdfix')]
    problems = []
    for package in ('lmdeploy', 'lmdeploy_pdfix'):
        versions: dict[str, list[str]] = {}
        for name, soft in software:
            versions.setdefault(str(soft.get(package)), []).append(name)
        if len(versions) > 1:
            found = '; '.join(f'{version} on {", ".join(names)}' for version, names in sorted(versions.items()))
            problems.append(f'version skew of {package}: {found}')
    return problems


def print_table(report: Report) -> None:
    software = report.proxy_software or {}
    print(f"proxy {report.proxy}: LMDeploy {software.get('lmdeploy', '?')}, "
          f"lmdeploy-pdfix {software.get('lmdeploy_pdfix', 'absent')}")
    if report.proxy_books is not None:
        books = report.proxy_books
        states = ', '.join(f'{count} {state}' for state, count in sorted((books.get('open_by_state') or {}).items()))
        print(f"  open records: {books.get('open', 0)}{f' ({states})' if states else ''}, "
              f"oldest {books.get('oldest_age_s', 0.0):.1f} s")
    header = ('node', 'role', 'lmdeploy', 'pdfix', 'units', 'preserved', 'oldest_s', 'open', 'links')
    table = [header] + [_cells(row) for row in report.nodes]
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    for line in table:
        print('  ' + '  '.join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    print('problems:' if report.problems else 'no problems found')
    for problem in report.problems:
        print(f'  - {problem}')


def _cells(row: NodeRow) -> tuple[str, ...]:
    if not row.answered:
        return (row.url, row.role, '-', '-', '-', '-', '-', str(row.proxy_open_records), '-')
    oldest = '-' if row.oldest_age_s is None else f'{row.oldest_age_s:.1f}'
    return (row.url, row.role, row.lmdeploy or '?', row.lmdeploy_pdfix or 'absent', str(len(row.units)),
            '-' if row.preserved is None else str(row.preserved), oldest, str(row.proxy_open_records),
            '-' if row.links is None else str(row.links))


def doctor(proxy_url: str, as_json: bool, timeout_s: float) -> int:
    report = examine(proxy_url, timeout_s)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print_table(report)
    return report.exit_status

"""What an operator sees of a running cluster: Prometheus ``/metrics`` on the proxy and every node, the Grafana
dashboard over them, and ``lmdeploy-pdfix doctor``.

Real proxy and api_server processes (the GPU-free cluster); the metrics are read with prometheus_client's own
parser, the doctor is run as the command an operator types.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy_pdfix.domain.protocol import CACHE_OWNER_FIELD, FREE_PATH
from lmdeploy_pdfix_sim import client, faults
from lmdeploy_pdfix_sim.cluster import Cluster

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / 'docs' / 'grafana-dashboard.json'
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(f'{url}/metrics', timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {'Content-Type': 'application/json'})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def doctor(cluster: Cluster, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'lmdeploy_pdfix.tools.cli', 'doctor', '--proxy', cluster.proxy_url,
                           *extra], capture_output=True, text=True, timeout=120)


def doctor_json(cluster: Cluster) -> tuple[int, dict[str, Any]]:
    result = doctor(cluster, '--json')
    return result.returncode, json.loads(result.stdout)  # stdout is the JSON alone


# ---------------------------------------------------------------------------------------------- metrics


def test_node_metrics_follow_preserved_caches_claims_and_refusals(patched_cluster: Cluster) -> None:
    prefill, decode = patched_cluster.prefill_urls[0], patched_cluster.decode_urls[0]
    p_before, d_before = scrape(prefill), scrape(decode)
    for index in range(3):
        assert client.request(patched_cluster.proxy_url, client.KINDS[index], client.prompt_for(index)).ok
    status, kept = post(f'{prefill}/v1/completions', client.preserved_prefill_body(7))  # nobody takes this one
    assert status == 200
    bogus = {**client.preserved_prefill_body(8), 'migration_request': {'remote_session_id': 'x'}}
    assert post(f'{decode}/v1/completions', bogus)[0] == 400
    p_held, d_after = scrape(prefill), scrape(decode)
    assert value(p_held, 'lmdeploy_pdfix_engine_book_up') == 1
    assert value(p_held, 'lmdeploy_pdfix_preserved_caches', state='unclaimed') == 1
    assert value(p_held, 'lmdeploy_pdfix_preserved_cache_oldest_age_seconds') > 0
    assert moved(p_before, p_held, 'lmdeploy_pdfix_preserved_cache_releases_total', cause='decode_freed') == 3
    assert moved(p_before, p_held, 'lmdeploy_pdfix_claims_total', verdict='claimed') == 3
    assert moved(d_before, d_after, 'lmdeploy_pdfix_refused_migration_requests_total', reason='Bad Request') == 1

    free = {'remote_engine_id': prefill, 'remote_session_id': kept[CACHE_OWNER_FIELD]}
    assert post(f'{prefill}{FREE_PATH}', free)[1]['status'] == 'released'
    assert post(f'{prefill}{FREE_PATH}', free)[1]['status'] == 'not_found'  # a second free releases nothing
    p_after = scrape(prefill)
    assert value(p_after, 'lmdeploy_pdfix_preserved_caches', state='unclaimed') == 0
    assert moved(p_held, p_after, 'lmdeploy_pdfix_preserved_cache_releases_total', cause='freed') == 1
    assert moved(p_held, p_after, 'lmdeploy_pdfix_frees_not_released_total', reason='unknown') == 1


def test_node_metrics_count_a_failed_migration(patched_cluster: Cluster) -> None:
    decode = patched_cluster.decode_urls[0]
    before = scrape(decode)
    patched_cluster.arm_fault(decode, faults.MIGRATE_ERROR)  # the next KV transfer fails, as a dropped link would
    assert client.request(patched_cluster.proxy_url, 'completions', client.prompt_for(40)).status >= 500
    after = scrape(decode)
    assert moved(before, after, 'lmdeploy_pdfix_migration_failures_total', reason='InjectedFault') == 1
    assert client.request(patched_cluster.proxy_url, 'completions', client.prompt_for(41)).ok


def test_proxy_metrics_count_requests_and_phases_of_the_real_proxy(patched_cluster: Cluster) -> None:
    before = scrape(patched_cluster.proxy_url)
    results = [client.request(patched_cluster.proxy_url, kind, client.prompt_for(20 + i))
               for i, kind in enumerate(client.KINDS)]
    assert all(result.ok for result in results), results
    after = scrape(patched_cluster.proxy_url)
    ok = sum(moved(before, after, 'lmdeploy_pdfix_proxy_requests_total', route=route, outcome='ok')
             for route in ('/v1/chat/completions', '/v1/completions'))
    assert ok == len(client.KINDS)
    for phase in ('probe', 'prefill', 'link', 'decode_first_byte', 'total'):
        assert moved(before, after, 'lmdeploy_pdfix_proxy_phase_seconds_count', phase=phase) == len(client.KINDS)
    assert moved(before, after, 'lmdeploy_pdfix_proxy_releases_total', cause='migrated') == len(client.KINDS)
    assert value(after, 'process_cpu_seconds_total') > 0


def test_every_series_the_dashboard_queries_exists(patched_cluster: Cluster) -> None:
    queried = {name for panel in json.loads(DASHBOARD.read_text())['panels'] for target in panel['targets']
               for name in re.findall(r'\blmdeploy_pdfix_\w+', target['expr'])}
    served = {name for url in [patched_cluster.proxy_url, *patched_cluster.prefill_urls, *patched_cluster.decode_urls]
              for name, _ in scrape(url)}
    assert len(queried) >= 10
    assert queried <= served, sorted(queried - served)


# ---------------------------------------------------------------------------------------------- doctor


def test_doctor_finds_nothing_wrong_with_a_healthy_cluster(patched_cluster: Cluster) -> None:
    result = doctor(patched_cluster)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'no problems found' in result.stdout
    for url in [*patched_cluster.prefill_urls, *patched_cluster.decode_urls]:
        row, = (line for line in result.stdout.splitlines() if url in line)
        assert '0.1.0' in row and 'absent' not in row, row
    status, report = doctor_json(patched_cluster)
    assert status == 0 and report['problems'] == [] and report['exit_status'] == 0
    assert {row['role'] for row in report['nodes']} == {'Prefill', 'Decode'}
    assert all(row['units'] and row['preserved'] is not None for row in report['nodes'])


def test_doctor_names_a_stock_cluster_whose_prefill_leaks(stock_cluster: Cluster) -> None:
    status, report = doctor_json(stock_cluster)
    assert status == 1
    problems = '\n'.join(report['problems'])
    assert 'proxy' in problems and 'runs without lmdeploy-pdfix' in problems
    assert f'Prefill {stock_cluster.prefill_urls[0]} runs without lmdeploy-pdfix (a Prefill without it leaks' \
        in problems


def test_doctor_names_an_unfixed_node_then_a_node_down(mixed_cluster: Cluster) -> None:
    prefill, decode = mixed_cluster.prefill_urls[0], mixed_cluster.decode_urls[0]
    status, report = doctor_json(mixed_cluster)
    assert status == 1
    assert [problem for problem in report['problems'] if prefill in problem] == [
        f'Prefill {prefill} runs without lmdeploy-pdfix (a Prefill without it leaks one session per DistServe '
        'request); enable lmdeploy-pdfix there (LMDEPLOY_PDFIX=1) and restart it']
    assert not any(decode in problem for problem in report['problems'])

    mixed_cluster.stop_node(decode)
    started = time.monotonic()
    result = doctor(mixed_cluster, '--timeout', '3')
    assert time.monotonic() - started < 60
    assert result.returncode == 1
    assert re.search(rf'Decode {re.escape(decode)} does not answer', result.stdout), result.stdout

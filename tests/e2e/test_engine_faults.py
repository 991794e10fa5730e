"""Engine-side DistServe faults on the real cluster, each injected while normal traffic runs.

For every fault the patched cluster must keep both engines healthy, give the faulty request a clear status,
answer every normal request with the exact expected text (0 wrong texts), and end with no Prefill session
left. Stock LMDeploy goes through the same steps to show the defect (D4, D5, D6, D14, D15, D19 and the
orphan that nobody frees). A stock engine a fault killed is restarted after its test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lmdeploy_pdfix.domain.protocol import AUDIT_PATH
from lmdeploy_pdfix_sim import client, faults
from lmdeploy_pdfix_sim.cluster import MODEL_NAME, Cluster
from tests.e2e.conftest import MODES
from tests.e2e.test_failure_paths import Answer, assert_serving, get, post

pytestmark = pytest.mark.e2e

ORPHAN_TTL_S = 3.0
GC_AGE_S = 2.0
NODE_ENV = {'LMDEPLOY_PDFIX_ORPHAN_TTL_S': str(ORPHAN_TTL_S), 'LMDEPLOY_PDFIX_MIGRATION_TIMEOUT_S': '10',
            'LMDEPLOY_PDFIX_GC_AGE_S': str(GC_AGE_S)}
SETTLE_S = 8.0
FREE_PATH = '/distserve/free_cache'
RDMA = 1  # MigrationProtocol.RDMA, what the proxy sends (the sim runs it over Mooncake's TCP transport)


@pytest.fixture(scope='module', params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope='module')
def cluster(mode: str, start_cluster: Callable[..., Any]) -> Iterator[Cluster]:
    with start_cluster(f'engine-faults-{mode}', stock=mode == 'stock', env=NODE_ENV) as started:
        yield started


# ---------------------------------------------------------------------------------------------- helpers


class Traffic:
    """Normal completions through the proxy, one after another, for as long as the ``with`` block runs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.results: list[client.Result] = []
        self.paused = threading.Lock()  # held by a fault that needs the engine to itself for a moment
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        index = 1000
        while not self._stop.is_set():
            index += 1
            with self.paused:
                result = client.request(self.cluster.proxy_url, 'completions', client.prompt_for(index), timeout_s=30)
            self.results.append(result)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def assert_clean(self, allowed_failures: int = 0) -> None:
        """Every answer exact; at most ``allowed_failures`` clear (non-200) failures the fault itself caused."""
        wrong = [r for r in self.results if r.status == 200 and not r.ok]
        failed = [r for r in self.results if r.status != 200]
        assert self.results, 'no traffic ran'
        assert not wrong, f'{len(wrong)} answers with HTTP 200 and the wrong text: {wrong[:3]}'
        assert len(failed) <= allowed_failures, failed[:3]


def preserve_directly(cluster: Cluster, index: int) -> Answer:
    """A Prefill request that keeps its cache, as the proxy sends it, from a proxy that then goes away."""
    answer = post(f'{cluster.prefill_urls[0]}/v1/completions', client.preserved_prefill_body(index))
    assert answer.status == 200, answer
    return answer


def free(cluster: Cluster, owner: int) -> Answer:
    return post(f'{cluster.prefill_urls[0]}{FREE_PATH}',
                {'remote_engine_id': cluster.decode_urls[0], 'remote_session_id': owner})


def node_audit(url: str) -> dict[str, Any]:
    answer = get(f'{url}{AUDIT_PATH}')
    assert answer.status == 200, answer
    return answer.body


def prefill_sessions(cluster: Cluster, expected: int | None = None, within_s: float = SETTLE_S) -> int:
    """The Prefill node's scheduler sessions, once they equal ``expected`` (or after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        sessions = cluster.settled_state(cluster.prefill_urls[0], quiet_s=0.5)['sessions']
        if expected is None or sessions == expected or time.monotonic() > deadline:
            return sessions
        time.sleep(0.2)


def migration_request(cluster: Cluster, owner: int, block_ids: list[int], **overrides: Any) -> dict[str, Any]:
    request = {'protocol': RDMA, 'remote_engine_id': cluster.prefill_urls[0], 'remote_session_id': owner,
               'remote_token_id': 1, 'remote_block_ids': block_ids, **overrides}
    return {'model': MODEL_NAME, 'prompt': client.prompt_for(7), 'max_tokens': 4, 'migration_request': request}


def to_decode(cluster: Cluster, body: dict[str, Any]) -> Answer:
    return post(f'{cluster.decode_urls[0]}/v1/completions', body, timeout_s=30)


def fails_to_serve(cluster: Cluster) -> bool:
    """Stock after a fault: /health may stay green while the engine is gone; normal requests tell."""
    return not any(client.request(cluster.proxy_url, 'completions', client.prompt_for(500 + i), timeout_s=20).ok
                   for i in range(2))


def restart(cluster: Cluster, url: str) -> None:
    cluster.stop_node(url)
    cluster.restart_node(url)


# ---------------------------------------------------------------------------------------------- D4


@pytest.mark.regression
def test_a_preserved_prefill_request_cancelled_in_the_engine_leaves_it_serving(cluster: Cluster, mode: str) -> None:
    prefill = cluster.prefill_urls[0]
    with Traffic(cluster) as traffic:
        time.sleep(0.5)
        with traffic.paused:  # the slow forward must be this test's, not a traffic request's
            cluster.arm_fault(prefill, faults.SLOW_PREFILL, '2')
            busy = threading.Thread(target=post, args=(f'{prefill}/v1/completions', client.preserved_prefill_body(11)))
            busy.start()
            cluster.wait_fault_taken(prefill, faults.SLOW_PREFILL)
            # the next preserved request is in the engine, waiting for the forward; then its caller leaves
            client.drop_preserved_stream(prefill, 12, wait=lambda: time.sleep(0.5))
            busy.join()
        time.sleep(0.5)
    if mode == 'stock':
        # D4: the END_SESSION after the STOP calls finish() on a STOPPED preserved sequence
        assert fails_to_serve(cluster)
        restart(cluster, prefill)
        return
    traffic.assert_clean()
    assert_serving(cluster, mode)
    assert node_audit(prefill)['releases'].get('cancelled', 0) >= 1


# ---------------------------------------------------------------------------------------------- D5, #4965


@pytest.mark.regression
def test_a_migration_request_that_cannot_be_right_is_refused_before_the_decode_engine(cluster: Cluster,
                                                                                    mode: str) -> None:
    if mode == 'stock':
        # D5: a block count that does not match trips an assert in the migration loop; the Decode engine dies
        to_decode(cluster, migration_request(cluster, 424242, [1, 2, 3, 4, 5]))
        assert fails_to_serve(cluster)
        restart(cluster, cluster.decode_urls[0])
        return
    prefill = preserve_directly(cluster, 21).body
    owner, blocks = prefill['cache_session_id'], prefill['cache_block_ids']
    bad = {
        'unknown owner': migration_request(cluster, owner + 10**6, blocks),
        'blocks that are not the owner blocks': migration_request(cluster, owner, [*blocks, max(blocks) + 1]),
        'unlinked Prefill node': migration_request(cluster, owner, blocks, remote_engine_id='http://127.0.0.1:9'),
        'malformed block ids': migration_request(cluster, owner, [-1]),
    }
    with Traffic(cluster) as traffic:
        answers = {case: to_decode(cluster, body) for case, body in bad.items()}
    for case, answer in answers.items():
        assert 400 <= answer.status < 500, (case, answer)
        assert 'migration_request refused' in answer.message, (case, answer)
    traffic.assert_clean()
    assert_serving(cluster, mode)
    assert free(cluster, owner).body['status'] == 'released'
    assert prefill_sessions(cluster, expected=0) == 0


# ---------------------------------------------------------------------------------------------- D5, #4971


@pytest.mark.regression
def test_a_failed_kv_transfer_fails_only_its_own_request(cluster: Cluster, mode: str) -> None:
    decode = cluster.decode_urls[0]
    cluster.arm_fault(decode, faults.MIGRATE_ERROR)
    if mode == 'stock':
        client.request(cluster.proxy_url, 'completions', client.prompt_for(31), timeout_s=20)
        assert fails_to_serve(cluster)  # the migration loop died with the transfer
        restart(cluster, decode)
        return
    with Traffic(cluster) as traffic:
        failed = client.request(cluster.proxy_url, 'completions', client.prompt_for(31), timeout_s=30)
        time.sleep(1.0)
    hit = [r for r in [failed, *traffic.results] if r.status != 200]
    assert len(hit) == 1 and 500 <= hit[0].status < 600, hit  # the one request whose transfer failed
    traffic.assert_clean(allowed_failures=1)
    assert_serving(cluster, mode)
    assert sum(node_audit(decode)['migration_failures'].values()) >= 1
    assert prefill_sessions(cluster, expected=0) == 0


# ---------------------------------------------------------------------------------------------- D15


@pytest.mark.regression
def test_a_free_answers_truthfully_and_ends_only_a_preserved_cache(cluster: Cluster, mode: str) -> None:
    if mode == 'stock':
        assert free(cluster, 987654).body == {'status': 'SUCCESS'}  # D15: "success" for nothing
        return
    owner = preserve_directly(cluster, 41).body['cache_session_id']
    with Traffic(cluster) as traffic:
        unknown = free(cluster, owner + 10**6).body
        released = free(cluster, owner).body
        again = free(cluster, owner).body
    assert (unknown['status'], released['status'], again['status']) == ('not_found', 'released', 'not_found')
    traffic.assert_clean()
    assert node_audit(cluster.prefill_urls[0])['frees_not_released'].get('unknown', 0) >= 2
    assert prefill_sessions(cluster, expected=0) == 0


# ---------------------------------------------------------------------------------------------- D14


@pytest.mark.regression
def test_a_free_issued_before_a_prefill_restart_cannot_end_a_session_after_it(cluster: Cluster,
                                                                            mode: str) -> None:
    prefill = cluster.prefill_urls[0]
    before = [preserve_directly(cluster, 51 + i).body.get('cache_session_id') for i in range(2)]
    restart(cluster, prefill)
    after = preserve_directly(cluster, 53).body.get('cache_session_id')
    # late duplicates of frees for what the previous incarnation issued (stock numbers from 0 again)
    late_ids = before if mode == 'patched' else list(range(8))
    answers = [free(cluster, owner).body for owner in late_ids]
    if mode == 'stock':
        assert prefill_sessions(cluster, expected=0) == 0  # D14: the new session was ended by a stale id
        return
    assert after not in before
    assert {answer['status'] for answer in answers} == {'not_found'}  # as any unknown owner: nothing to learn
    assert prefill_sessions(cluster) == 1  # the session after the restart is intact
    assert free(cluster, after).body['status'] == 'released'
    assert prefill_sessions(cluster, expected=0) == 0


# ---------------------------------------------------------------------------------------------- orphans


@pytest.mark.regression
def test_an_orphaned_cache_is_reclaimed_after_the_ttl_and_refused_to_a_late_decode(cluster: Cluster,
                                                                                 mode: str) -> None:
    assert_serving(cluster, mode)  # also links the pair again after an earlier restart
    baseline = prefill_sessions(cluster)
    answer = preserve_directly(cluster, 61).body
    time.sleep(ORPHAN_TTL_S)
    if mode == 'stock':
        assert prefill_sessions(cluster, expected=baseline, within_s=SETTLE_S) == baseline + 1  # kept forever
        return
    assert prefill_sessions(cluster, expected=baseline) == baseline
    assert node_audit(cluster.prefill_urls[0])['releases'].get('reclaimed', 0) >= 1
    late = to_decode(cluster, migration_request(cluster, answer['cache_session_id'], answer['cache_block_ids']))
    assert late.status == 410 and 'reclaimed' in late.message, late
    assert_serving(cluster, mode)


# ---------------------------------------------------------------------------------------------- claims hold


@pytest.mark.regression
def test_a_migration_held_past_the_orphan_ttl_and_the_gc_age_copies_the_cache_its_claim_confirmed(
        cluster: Cluster, mode: str) -> None:
    assert_serving(cluster, mode)
    decode = cluster.decode_urls[0]
    held_s = ORPHAN_TTL_S + GC_AGE_S + 1
    cluster.arm_fault(decode, faults.SLOW_MIGRATE, str(held_s))  # a busy Decode's queue, say
    prompt = client.prompt_for(71)
    with Traffic(cluster) as traffic, ThreadPoolExecutor(1) as pool:  # new work reuses whatever is freed
        held = pool.submit(client.request, cluster.proxy_url, 'completions', prompt, timeout_s=60)
        cluster.wait_fault_taken(decode, faults.SLOW_MIGRATE)
        time.sleep(ORPHAN_TTL_S + 0.5)  # the orphan TTL passes, and so does the gc age
        gc = post(f'{cluster.proxy_url}/distserve/gc', {}, timeout_s=30)
        for index in range(3):  # Prefill work that takes (and writes) whatever blocks are free now
            post(f'{cluster.prefill_urls[0]}/v1/completions',
                 {'model': MODEL_NAME, 'prompt': client.prompt_for(900 + index, 400), 'max_tokens': 1})
        answer = held.result()
    if mode == 'stock':  # stock frees nothing it could cut short: gc fails (D17), no completions' cache is freed
        assert gc.status == 500 and prefill_sessions(cluster) > 0
        return
    assert answer.status == 200 and answer.ok, answer  # not the KV of whatever reused the blocks
    traffic.assert_clean()
    assert gc.status == 200 and gc.body['audit']['open_by_state'].get('migrating', 0) >= 1, gc  # left alone
    assert prefill_sessions(cluster, expected=0) == 0, 'a cache was left behind'


# ---------------------------------------------------------------------------------------------- node removal


def _registered_roles(cluster: Cluster) -> dict[str, Any]:
    return {url: status['role'] for url, status in get(f'{cluster.proxy_url}/nodes/status').body.items()}


@pytest.mark.regression
def test_a_request_whose_cache_is_being_copied_is_answered_when_the_proxy_removes_its_prefill_node(
        cluster: Cluster, mode: str) -> None:
    # A failed heartbeat or an operator removes the node, and with it its links (issue 12); the request needs
    # the node no more once its copy ends, and its Prefill cache is still freed.
    assert_serving(cluster, mode)
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    role = _registered_roles(cluster)[prefill]
    cluster.arm_fault(decode, faults.SLOW_MIGRATE, '3')
    with ThreadPoolExecutor(1) as pool:
        copying = pool.submit(client.request, cluster.proxy_url, 'completions', client.prompt_for(77), timeout_s=30)
        cluster.wait_fault_taken(decode, faults.SLOW_MIGRATE)
        removed = post(f'{cluster.proxy_url}/nodes/remove', {'url': prefill})
        answer = copying.result()
    sessions_left = prefill_sessions(cluster, expected=0)
    post(f'{cluster.proxy_url}/nodes/add', {'url': prefill, 'status': {'role': role, 'models': [MODEL_NAME]}})
    assert removed.status == 200, removed
    if mode == 'stock':  # 0.18 fails the request (its migration loop dies on the closed link); both keep the cache
        assert not (answer.ok and sessions_left == 0), (answer, sessions_left)
        restart(cluster, decode)
        return
    assert answer.ok, answer
    assert sessions_left == 0, 'the Prefill cache of the copied request was left behind'
    assert_serving(cluster, mode)


# ---------------------------------------------------------------------------------------------- D19


@pytest.mark.regression
def test_a_dummy_prefill_is_refused_unless_the_deployment_allows_it(cluster: Cluster, mode: str) -> None:
    # it decodes from KV blocks no Prefill filled: right after another request, that request's leftovers
    answer = to_decode(cluster, migration_request(cluster, 0, [0], is_dummy_prefill=True))
    if mode == 'patched':
        assert answer.status == 400 and 'LMDEPLOY_PDFIX_ALLOW_DUMMY_PREFILL' in str(answer.body), answer
    else:
        assert answer.status == 200 and answer.body.get('dummy_prefill') is None, answer


# ---------------------------------------------------------------------------------------------- D6

PRESSURE = {'num_blocks': 24, 'requests': 16, 'prompt_length': 300}


@pytest.mark.regression
@pytest.mark.parametrize('engine', ['stock', 'patched'])
def test_preserved_caches_are_not_evicted_under_kv_pressure(engine: str, start_cluster: Callable[..., Any]) -> None:
    # A fixed proxy in both runs, so only the Prefill engine's handling of preserved KV differs. Without the
    # Prefill's book no claim is confirmed, and a Decode that checks refuses every migration (it fails closed):
    # its checks are off too, as on a stock Decode
    env = {} if engine == 'patched' else {'LMDEPLOY_PDFIX_DISABLE': 'engine_sessions,decode_migration_checks'}
    with start_cluster(f'kv-pressure-{engine}', num_blocks=PRESSURE['num_blocks'], env=env) as started:
        def one(index: int) -> client.Result:
            return client.request(started.proxy_url, 'completions',
                                  client.prompt_for(index, PRESSURE['prompt_length']), timeout_s=60)

        with ThreadPoolExecutor(PRESSURE['requests']) as pool:
            results = list(pool.map(one, range(PRESSURE['requests'])))
        wrong = sum(r.status == 200 and not r.ok for r in results)
        if engine == 'stock':
            assert wrong > 0  # D6: evicted preserved blocks were reused before the Decode copied them
            # and no other defect: engine_connections, which requires engine_sessions, is off with it, so
            # every free still releases its session (issue 10: they were all kept)
            assert started.settled_state(started.prefill_urls[0])['sessions'] == 0
            return
        assert wrong == 0 and all(r.ok for r in results), results
        assert started.settled_state(started.prefill_urls[0])['sessions'] == 0

"""The cache-owner rule: how an owner is emitted with a Prefill answer, parsed and validated by the proxy."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from lmdeploy_pdfix.domain.owner_ids import is_owner_id, permuted, single_owner, unguessable_session_ids
from lmdeploy_pdfix.domain.protocol import (
    CACHE_OWNER_FIELD,
    PrefillAnswerError,
    migration_request_problem,
    parse_prefill_answer,
    sse_chunk_with_owner,
    with_owner,
)

ANSWER = {'id': 'chatcmpl-x', 'cache_block_ids': [1, 2], 'remote_token_ids': [9], CACHE_OWNER_FIELD: 5}


def test_owner_is_named_only_on_answers_that_retain_a_cache() -> None:
    assert with_owner({'id': '-1', 'cache_block_ids': [1]}, 5)[CACHE_OWNER_FIELD] == 5
    assert CACHE_OWNER_FIELD not in with_owner({'id': '-1'}, 5)


def test_a_request_that_created_several_sessions_has_no_single_owner() -> None:
    assert single_owner([4]) == 4
    assert single_owner([]) is None and single_owner([4, 5]) is None


@pytest.mark.parametrize('value', [0, 17])
def test_owner_ids_are_non_negative_ints(value: int) -> None:
    assert is_owner_id(value)


@pytest.mark.parametrize('value', [-1, '5', 'chatcmpl-5', True, 1.0, None])
def test_public_ids_and_other_values_are_not_owner_ids(value: object) -> None:
    assert not is_owner_id(value)


def test_stream_chunk_carrying_the_cache_gains_the_owner() -> None:
    chunk = f"data: {json.dumps({'choices': [], 'cache_block_ids': [1]})}\n\n"
    payload = json.loads(sse_chunk_with_owner(chunk, 3)[len('data: '):])
    assert payload[CACHE_OWNER_FIELD] == 3


def test_other_stream_chunks_pass_unchanged() -> None:
    for chunk in ('data: [DONE]\n\n', b'data: {"choices": []}\n\n'):
        assert sse_chunk_with_owner(chunk, 3) == chunk


def test_valid_prefill_answer_names_owner_blocks_and_first_token() -> None:
    answer = parse_prefill_answer(ANSWER)
    assert (answer.owner, answer.block_ids, answer.first_token_id) == (5, [1, 2], 9)


@pytest.mark.parametrize('body, owner', [
    ({k: v for k, v in ANSWER.items() if k != CACHE_OWNER_FIELD}, None),
    ({**ANSWER, CACHE_OWNER_FIELD: 'chatcmpl-x'}, None),
    ({**ANSWER, 'cache_block_ids': []}, 5),
    ({**ANSWER, 'remote_token_ids': []}, 5),
    ('not an object', None),
], ids=['no-owner', 'public-id-as-owner', 'no-blocks', 'no-first-token', 'not-json-object'])
def test_unusable_prefill_answers_are_rejected_keeping_any_owner_for_release(body: object,
                                                                             owner: int | None) -> None:
    with pytest.raises(PrefillAnswerError) as error:
        parse_prefill_answer(body)
    assert error.value.owner == owner


def test_missing_owner_error_says_how_to_fix_it() -> None:
    with pytest.raises(PrefillAnswerError, match='LMDEPLOY_PDFIX=1'):
        parse_prefill_answer({'cache_block_ids': [1], 'remote_token_ids': [1]})


def test_session_ids_are_distinct_owner_ids_below_2_to_the_62() -> None:
    ids = [next(sequence) for sequence in [unguessable_session_ids()] for _ in range(20_000)]
    assert len(set(ids)) == len(ids) and all(is_owner_id(owner) and owner < 2**62 for owner in ids)
    key = bytes(16)
    assert all(0 <= permuted(key, n) < 2**62 for n in (0, 2**31 - 1, 2**31, 2**62 - 1))


def session_ids(manager: Any, count: int = 1_000) -> list[int]:
    return [next(manager.session_id_generator) for _ in range(count)]


@pytest.mark.regression
def test_knowing_one_owner_id_does_not_help_name_another(apply_patch: Callable[[str], ModuleType]) -> None:
    # issue 11: stock numbers 0, 1, 2, …, so one id names its neighbours (and a free of one ends another's cache)
    manager = apply_patch('unguessable_session_ids').SessionManager()
    seen = session_ids(manager)
    gaps = {later - earlier for earlier, later in itertools.pairwise(seen)}
    assert len(gaps) == len(seen) - 1, 'consecutive ids are a fixed step apart'
    assert min(seen) > 2**40, 'ids start from somewhere guessable'


@pytest.mark.regression
def test_a_restarted_or_cleared_session_manager_never_reuses_an_id(apply_patch: Callable[[str], ModuleType]) -> None:
    module = apply_patch('unguessable_session_ids')
    before = session_ids(module.SessionManager())
    cleared = module.SessionManager()
    cleared.clear()
    assert not set(before) & set(session_ids(module.SessionManager())), 'a restart named sessions as before (D14)'
    assert not set(before) & set(session_ids(cleared))


def test_a_migration_request_must_name_an_owner_and_distinct_blocks() -> None:
    assert migration_request_problem(5, [1, 2]) is None
    assert 'not a cache owner' in migration_request_problem('5', [1, 2])
    assert 'non-empty' in migration_request_problem(5, [])
    assert 'twice' in migration_request_problem(5, [1, 1])

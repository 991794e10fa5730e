"""The cache-owner rule: how an owner is emitted with a Prefill answer, parsed and validated by the proxy."""

from __future__ import annotations

import json

import pytest

from lmdeploy_pdfix.owner_ids import first_session_id, incarnation_of, is_owner_id, new_incarnation, single_owner
from lmdeploy_pdfix.protocol import (
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


def test_owner_ids_of_two_incarnations_never_meet() -> None:
    first, second = new_incarnation(), new_incarnation()
    assert incarnation_of(first_session_id(first) + 10**6) == first
    assert first == second or first_session_id(first) + 10**6 != first_session_id(second) + 10**6
    assert first_session_id(2**30 - 1) + 2**32 - 1 < 2**62


def test_a_migration_request_must_name_an_owner_and_distinct_blocks() -> None:
    assert migration_request_problem(5, [1, 2]) is None
    assert 'not a cache owner' in migration_request_problem('5', [1, 2])
    assert 'non-empty' in migration_request_problem(5, [])
    assert 'twice' in migration_request_problem(5, [1, 1])

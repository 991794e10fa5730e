"""A Decode node treats the Prefill's first token as its request's first sampled token (D25, issue 27).

LMDeploy's real ``EngineLoop`` migration and response loops answer migrated requests over its real scheduler
(see ``test_migration_faults``); the grammar is LMDeploy's real ``GuidedDecodingManager`` (xgrammar) over the
GPU-free cluster's tokenizer, fed by its real ``ARSamplingStrategy``.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType

import pytest
from lmdeploy.messages import ResponseType
from lmdeploy.pytorch.messages import MessageStatus

from lmdeploy_pdfix_sim import model
from tests.test_engine_connections import other_tasks_done
from tests.test_migration_faults import FIRST_TOKEN, DecodeNode, make_decode_node

OPEN_BRACE = ord('{')


@pytest.fixture
async def decode(apply_patch: Callable[[str], ModuleType]) -> AsyncIterator[DecodeNode]:
    node = make_decode_node(apply_patch('decode_first_token'))
    yield node
    await other_tasks_done()


@pytest.mark.regression
@pytest.mark.parametrize('budget', ['max_tokens', 'stop id'])
async def test_a_first_token_that_ends_the_request_is_its_final_answer(decode: DecodeNode, budget: str) -> None:
    seq = decode.receive('prefill-a', 11)
    if budget == 'max_tokens':
        seq.sampling_param.max_new_tokens = 1
    else:
        seq.sampling_param.stop_words = [FIRST_TOKEN]
    decode.start()

    answer = await decode.answer(seq)

    assert answer.type == ResponseType.FINISH, 'the first token did not end the request'
    assert list(answer.data['token_ids']) == [FIRST_TOKEN]
    assert seq.status == MessageStatus.STOPPED, 'the Decode would go on decoding it'


async def test_a_request_with_budget_left_decodes_on_after_the_first_token(decode: DecodeNode) -> None:
    seq = decode.receive('prefill-a', 11)
    seq.sampling_param.max_new_tokens = 2
    decode.start()

    answer = await decode.answer(seq)

    assert answer.type == ResponseType.SUCCESS
    assert list(answer.data['token_ids']) == [FIRST_TOKEN]
    assert seq.status == MessageStatus.MIGRATION_DONE  # back to the waiting queue for its next token


@pytest.fixture
def guided(apply_patch: Callable[[str], ModuleType], tmp_path: Path):
    """LMDeploy's grammar manager over the cluster's byte-level tokenizer, and its sampling strategy."""
    from transformers import AutoTokenizer

    apply_patch('decode_first_token')
    apply_patch('guided_first_token')
    tokenizer = AutoTokenizer.from_pretrained(str(model.ensure_model_dir(tmp_path / 'model')))
    manager = importlib.import_module('lmdeploy.pytorch.engine.guided_process').GuidedDecodingManager(
        tokenizer, model.VOCAB_SIZE)
    strategy = importlib.import_module('lmdeploy.pytorch.strategies.ar.sampling').ARSamplingStrategy(0)
    return manager, strategy


def _allowed_next(manager, processor) -> set[int]:
    mask = manager.allocate_batched_bitmap(1)
    manager.fill_bitmap(processor, mask, 0)
    bits = mask[0].tolist()
    return {token for token in range(model.VOCAB_SIZE) if (bits[token // 32] >> (token % 32)) & 1}


@pytest.mark.regression
def test_the_grammar_of_a_migrated_request_has_accepted_its_first_token(guided, monkeypatch) -> None:
    manager, strategy = guided
    node = make_decode_node(importlib.import_module('lmdeploy.pytorch.engine.engine_loop'))
    seq = node.receive('prefill-a', 11)
    seq.migration_request.remote_token_id = OPEN_BRACE  # the Prefill's grammar began the JSON object
    seq.sampling_param.response_format = {'type': 'json_object'}

    inputs = strategy.make_sampling_inputs([seq])
    processor = manager.get_processors(inputs.session_ctx, inputs.response_formats)[0]

    allowed = _allowed_next(manager, processor)
    assert OPEN_BRACE not in allowed, 'the grammar would open the object a second time'
    assert ord('"') in allowed and ord('}') in allowed


def test_a_request_without_a_grammar_or_migration_samples_as_before(guided) -> None:
    manager, strategy = guided
    node = make_decode_node(importlib.import_module('lmdeploy.pytorch.engine.engine_loop'))
    seq = node.receive('prefill-a', 11)
    seq.migration_request = None
    seq.sampling_param.response_format = {'type': 'json_object'}

    inputs = strategy.make_sampling_inputs([seq])
    processor = manager.get_processors(inputs.session_ctx, inputs.response_formats)[0]

    assert OPEN_BRACE in _allowed_next(manager, processor)

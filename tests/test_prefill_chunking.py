"""A Prefill node works through a long prompt chunk by chunk (D3).

These tests drive LMDeploy's real ``InputsMakerAsync`` (patched ``update_running_seqs`` included), its real
``LongContextChunker`` and real ``SchedulerSequence`` objects through the forward loop a Prefill node runs for
one prompt longer than ``max_prefill_token_num``. The chunk inputs are built by the maker's own
``create_model_inputs_long_context`` / ``create_model_inputs``. Only what needs a GPU is faked: the KV block
tables the scheduler would allocate, the executor's device, and the (absent) adapters. The model forward
itself produces nothing these tests read, so it is not run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from lmdeploy.pytorch.disagg.config import EngineRole
from lmdeploy.pytorch.messages import (
    SamplingParam,
    SchedulerSequence,
    SchedulerSession,
    SequenceManager,
    SequenceMeta,
    UpdateTokenMode,
)
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy

from lmdeploy_pdfix.domain.chunking import expected_prefill_forwards

PROMPT_TOKENS = 1500
MAX_PREFILL_TOKEN_NUM = 512
BLOCK_SIZE = 64
# A stock Prefill node repeats its first chunk forever; the loop gives up long before that.
MAX_FORWARDS = 20


class FakeBlockTables:
    """The scheduler's KV block tables: enough logical blocks for every token of each sequence."""

    cache_config = SimpleNamespace(block_size=BLOCK_SIZE, kernel_block_size=BLOCK_SIZE)

    def get_block_tables(self, seqs: list[SchedulerSequence]) -> list[np.ndarray]:
        return [np.arange(math.ceil(seq.num_all_ids / BLOCK_SIZE)) for seq in seqs]


def make_inputs_maker(module: ModuleType, role: EngineRole) -> Any:
    """LMDeploy's ``InputsMakerAsync`` for one engine role, on CPU, with no model behind it."""
    config_fields = {field.name for field in dataclasses.fields(module.InputsMakerConfig)}
    config_values = dict(max_batches=8, max_prefill_token_num=MAX_PREFILL_TOKEN_NUM, role=role,
                         block_size=BLOCK_SIZE, kernel_block_size=BLOCK_SIZE, window_size=-1,
                         enable_prefix_caching=False, prefix_cache_decode_state_interval=0)
    config = module.InputsMakerConfig(**{key: value for key, value in config_values.items() if key in config_fields})
    collaborators = dict(executor=SimpleNamespace(device_type='cpu'),
                         scheduler=FakeBlockTables(),
                         state_checkpoints=None,
                         adapter_manager=SimpleNamespace(num_adapters=lambda: 0),
                         engine_strategy=None,
                         sampling_strategy=None,
                         model_agent_strategy=None,
                         config=config)
    parameters = inspect.signature(module.InputsMakerAsync).parameters
    return module.InputsMakerAsync(**{key: value for key, value in collaborators.items() if key in parameters})


def make_prompt(num_tokens: int, session_id: int = 0) -> SchedulerSequence:
    """A real scheduler sequence holding a fresh prompt, as ``SchedulerSession.add_sequence`` makes it."""
    strategy = ARSequenceStrategy()
    meta = SequenceMeta(block_size=BLOCK_SIZE, strategy=strategy)
    # 0.17 sessions take a SequenceManager, 0.18 sessions the SequenceMeta itself; the sequence reads only
    # ``session.seq_meta`` and ``session.session_id``.
    first_parameter = list(inspect.signature(SchedulerSession).parameters)[1]
    owner = SequenceManager(meta) if first_parameter == 'seq_manager' else meta
    session = SchedulerSession(session_id, owner, None)
    seq = strategy.make_sequence(seq_id=session_id, session=session, sampling_param=SamplingParam())
    seq.update_token_ids(np.arange(num_tokens), mode=UpdateTokenMode.INPUTS)
    return seq


@dataclass
class LongPrefill:
    """What the forward loop did with one long prompt."""

    chunk_starts: list[int]
    chunk_sizes: list[int]
    finished: bool

    @property
    def forwards(self) -> int:
        return len(self.chunk_starts)


def run_long_prefill(maker: Any, seq: SchedulerSequence) -> LongPrefill:
    """The engine loop's forwards for one long prompt, as ``_ForwardInputsTask`` makes them.

    The first forward is ``_schedule_prefill`` admitting a lone long prompt (``set_seq`` and its first chunk), the
    following ones are ``_build_active_chunk``: a non-final chunk is built by ``create_model_inputs_long_context``;
    the final one is a normal prefill flagged ``is_chunk``/``is_last_chunk``, and it releases the chunker. After
    each forward the engine loop calls ``update_running_seqs(running, inputs)``.
    """
    chunker = maker.long_context_chunker
    assert chunker.is_long_context(seq)
    chunker.set_seq(seq)
    running = [seq]
    run = LongPrefill(chunk_starts=[], chunk_sizes=[], finished=False)
    for _ in range(MAX_FORWARDS):
        chunk_size, multimodals = chunker.next_chunk_size()
        is_last_chunk = chunker.is_last_chunk()
        if is_last_chunk:
            inputs = maker.create_model_inputs(running, True)
            inputs.is_chunk = True
            inputs.is_last_chunk = True
            chunker.clear()
        else:
            inputs = maker.create_model_inputs_long_context(seq, chunk_size, multimodals)
        run.chunk_starts.append(int(inputs.history_lengths[0]))
        run.chunk_sizes.append(inputs.max_q_seqlen)
        maker.update_running_seqs(running, inputs)
        if is_last_chunk:
            run.finished = True
            break
    return run


@pytest.fixture
def inputs_maker_module(apply_patch: Callable[[str], ModuleType]) -> ModuleType:
    return apply_patch('prefill_chunking')


@pytest.mark.regression
def test_prefill_node_advances_a_long_prompt_chunk_by_chunk(inputs_maker_module: ModuleType) -> None:
    maker = make_inputs_maker(inputs_maker_module, EngineRole.Prefill)
    seq = make_prompt(PROMPT_TOKENS)

    run = run_long_prefill(maker, seq)

    assert run.chunk_starts[:3] == [0, 512, 1024], f'chunk positions {run.chunk_starts}'
    assert run.finished, f'no last chunk after {run.forwards} forwards'
    assert run.forwards == expected_prefill_forwards(PROMPT_TOKENS, MAX_PREFILL_TOKEN_NUM) == 3
    assert run.chunk_sizes == [512, 512, 476]
    assert not maker.long_context_chunker.enabled()
    assert maker.running_seqs == [], 'a Prefill node keeps nothing running for decode'


@pytest.mark.regression
@pytest.mark.parametrize('reference_role', [EngineRole.Hybrid, EngineRole.Decode], ids=['hybrid', 'decode'])
def test_prefill_node_chunks_a_long_prompt_exactly_as_other_roles_do(inputs_maker_module: ModuleType,
                                                                   reference_role: EngineRole) -> None:
    reference_maker = make_inputs_maker(inputs_maker_module, reference_role)
    reference_seq = make_prompt(PROMPT_TOKENS, session_id=1)
    prefill_maker = make_inputs_maker(inputs_maker_module, EngineRole.Prefill)
    prefill_seq = make_prompt(PROMPT_TOKENS, session_id=2)

    reference = run_long_prefill(reference_maker, reference_seq)
    prefill = run_long_prefill(prefill_maker, prefill_seq)

    # LMDeploy's own behaviour on the other roles: chunks advance, and the finished prompt runs on to decode.
    assert reference.finished
    assert reference.chunk_starts == [0, 512, 1024]
    assert reference_maker.running_seqs == [reference_seq]
    # The Prefill node steps through the same chunks but keeps nothing running.
    assert prefill.chunk_starts == reference.chunk_starts
    assert prefill.chunk_sizes == reference.chunk_sizes
    assert prefill.finished
    assert prefill_maker.running_seqs == []


@pytest.mark.regression
def test_prefill_node_leaves_running_seqs_alone_for_other_forwards_while_long_prompts_advance(
        inputs_maker_module: ModuleType) -> None:
    maker = make_inputs_maker(inputs_maker_module, EngineRole.Prefill)
    already_running = make_prompt(8, session_id=1)
    maker.running_seqs = [already_running]
    short = make_prompt(100, session_id=2)

    short_inputs = maker.create_model_inputs([short], True)
    assert not short_inputs.is_chunk
    maker.update_running_seqs([short], short_inputs)
    maker.update_running_seqs([short], None)

    assert maker.running_seqs == [already_running], 'a plain prefill or decode step changes nothing, as in LMDeploy'
    assert short.num_history_ids == 0

    long = make_prompt(PROMPT_TOKENS, session_id=3)
    run = run_long_prefill(maker, long)
    assert run.chunk_starts == [0, 512, 1024]
    assert run.finished
    assert maker.running_seqs == [already_running]

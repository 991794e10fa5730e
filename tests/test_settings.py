"""Every switch reads as a number within its bounds, or as its default with the problem named; never an exception."""

from __future__ import annotations

import pytest

from lmdeploy_pdfix import settings

ORPHAN = settings.ORPHAN_TTL_S


@pytest.mark.parametrize('raw, value', [(None, 600.0), ('', 600.0), ('30', 30.0), (' 2.5 ', 2.5)])
def test_a_usable_value_is_read(monkeypatch: pytest.MonkeyPatch, raw: str | None, value: float) -> None:
    if raw is None:
        monkeypatch.delenv(ORPHAN.name, raising=False)
    else:
        monkeypatch.setenv(ORPHAN.name, raw)
    assert ORPHAN.value() == value and ORPHAN.problem() is None
    assert settings.problem_for('engine_sessions') is None


@pytest.mark.parametrize('raw, problem', [('10m', "LMDEPLOY_PDFIX_ORPHAN_TTL_S='10m' is not a number of seconds"),
                                          ('0', 'LMDEPLOY_PDFIX_ORPHAN_TTL_S=0 is outside 1..604800 s'),
                                          ('nan', 'LMDEPLOY_PDFIX_ORPHAN_TTL_S=nan is outside 1..604800 s'),
                                          ('-5', 'LMDEPLOY_PDFIX_ORPHAN_TTL_S=-5 is outside 1..604800 s')])
def test_an_unusable_value_reads_as_the_default_and_names_the_problem(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                                      problem: str) -> None:
    monkeypatch.setenv(ORPHAN.name, raw)
    assert ORPHAN.value() == ORPHAN.default
    assert ORPHAN.problem() == problem
    assert settings.problems() == [problem]
    assert settings.problem_for('engine_sessions') == f'{problem}; fix or unset it'
    assert settings.problem_for('proxy_distserve') is None


@pytest.mark.parametrize('raw, problem', [('6.5', "LMDEPLOY_PDFIX_MAX_PROMPTS='6.5' is not a whole number"),
                                          ('0', 'LMDEPLOY_PDFIX_MAX_PROMPTS=0 is outside 1..100000')])
def test_a_count_takes_whole_numbers_only(monkeypatch: pytest.MonkeyPatch, raw: str, problem: str) -> None:
    monkeypatch.setenv(settings.MAX_PROMPTS.name, raw)
    assert settings.MAX_PROMPTS.value() == 64 and settings.MAX_PROMPTS.problem() == problem
    assert settings.problem_for('proxy_distserve') == f'{problem}; fix or unset it'
    monkeypatch.setenv(settings.MAX_PROMPTS.name, '3')
    assert settings.MAX_PROMPTS.value() == 3 and settings.problems() == []

"""The live progress line of ``soak`` and ``sim up``: drawn in place on a terminal, nothing at all when piped."""

from __future__ import annotations

import io
import re
import sys
import time
from pathlib import Path

import pytest

from lmdeploy_pdfix_sim import client, soak
from lmdeploy_pdfix_sim.progress import ProgressLine, live
from lmdeploy_pdfix_sim.soak import LoadProgress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def capable_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('TERM', 'xterm')  # the runner's own TERM must not decide what these tests see


def test_piped_output_gets_nothing_at_all() -> None:
    piped = io.StringIO()
    line = ProgressLine(piped)
    line.update('3/10, 1.0 req/s, 0 errors')
    line.close('10/10, 1.0 req/s, 0 errors')
    assert not line.active
    assert piped.getvalue() == ''


def test_a_dumb_terminal_gets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('TERM', 'dumb')  # Emacs shells, some CI consoles: no cursor control
    terminal = FakeTerminal()
    ProgressLine(terminal).update('3/10')
    assert terminal.getvalue() == ''


def test_a_terminal_sees_one_line_rewritten_in_place_and_ended_with_a_newline() -> None:
    terminal, clock = FakeTerminal(), FakeClock()
    line = ProgressLine(terminal, min_interval_s=0.5, clock=clock)
    line.update('1/10')
    clock.now += 1
    line.update('2/10')
    line.close()
    assert terminal.getvalue() == '\r1/10\x1b[K\r2/10\x1b[K\n'


def test_updates_closer_than_the_interval_are_skipped_but_the_final_text_is_always_shown() -> None:
    terminal, clock = FakeTerminal(), FakeClock()
    line = ProgressLine(terminal, min_interval_s=0.5, clock=clock)
    line.update('1/10')
    clock.now += 0.2
    line.update('2/10')  # too soon: skipped
    clock.now += 0.3
    line.update('3/10')  # 0.5 s after the last drawing
    clock.now += 0.1
    line.close('10/10')
    assert terminal.getvalue() == '\r1/10\x1b[K\r3/10\x1b[K\r10/10\x1b[K\n'


def test_closing_a_line_never_drawn_writes_no_stray_newline() -> None:
    terminal = FakeTerminal()
    ProgressLine(terminal).close()
    assert terminal.getvalue() == ''


def test_live_redraws_while_the_work_runs_and_leaves_the_final_state() -> None:
    terminal = FakeTerminal()
    spawned = [0]
    with live(lambda: f'starting: {spawned[0]}/3 processes spawned', terminal, period_s=0.01):
        spawned[0] = 3
        time.sleep(0.05)  # the work: a few redraw periods
    text = terminal.getvalue()
    assert text.startswith('\rstarting: ')
    assert text.endswith('\rstarting: 3/3 processes spawned\x1b[K\n')
    assert text.count('\n') == 1


def test_live_off_a_terminal_does_not_even_render() -> None:
    renders, piped = [], io.StringIO()

    def render() -> str:
        renders.append(1)
        return 'starting: 0/3 processes spawned'

    with live(render, piped, period_s=0.01):
        time.sleep(0.05)
    assert (piped.getvalue(), renders) == ('', [])


def test_soak_line_shows_done_rate_errors_and_the_latest_prefill_sessions() -> None:
    clock, sessions = FakeClock(), {'now': None}
    load = LoadProgress(4, lambda: sessions['now'], clock=clock)
    clock.now += 2
    load.count(failed=False)
    load.count(failed=True)
    assert load.render() == '2/4, 1.0 req/s, 1 errors'  # no Prefill sampled yet: sessions left out, not 0
    sessions['now'] = 3
    load.count(failed=False)
    load.count(failed=False)
    clock.now += 10  # the load is over: the rate no longer falls with the wall clock
    assert load.render() == '4/4, 2.0 req/s, 1 errors, 3 Prefill sessions'


def _soak_without_a_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    """``soak`` of 5 requests, the 2nd answered wrongly, made up in-process: no cluster, no network."""
    def answer(proxy: str, kind: str, prompt: str, max_tokens: int, timeout_s: float) -> client.Result:
        expected = f'answer to {prompt}'
        return client.Result(kind, 200, 'wrong' if prompt == client.prompt_for(1) else expected, expected, 0.01)

    monkeypatch.setattr(soak, 'discover_nodes', lambda proxy: {})
    monkeypatch.setattr(client, 'request', answer)
    return soak.main(['--proxy', 'http://127.0.0.1:9', '--requests', '5', '--out', str(tmp_path)])


def test_a_piped_soak_prints_its_report_and_nothing_else(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _soak_without_a_cluster(monkeypatch, tmp_path) == 1
    out, err = capsys.readouterr()
    assert '      succeeded: 4' in out
    assert '\r' not in out + err
    assert err == ''


def test_a_soak_on_a_terminal_ends_its_line_with_the_final_counts(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, 'stderr', terminal)
    _soak_without_a_cluster(monkeypatch, tmp_path)
    last_line = terminal.getvalue().rsplit('\r', 1)[-1]
    assert re.fullmatch(r'5/5, [0-9.]+ req/s, 1 errors\x1b\[K\n', last_line), last_line
    assert '\r' not in capsys.readouterr().out  # the report on stdout is as it is when piped

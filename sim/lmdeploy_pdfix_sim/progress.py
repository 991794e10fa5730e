"""A live progress line for long commands (``soak``, ``sim up``), drawn only on a terminal.

Piped or redirected output (CI logs, files, ``--json | jq``) gets nothing at all from it, so logs stay
readable and JSON stays parseable; and it writes to stderr, never stdout. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

CLEAR_TO_END = '\x1b[K'


class ProgressLine:
    """One line rewritten in place (``\\r`` + text + clear-to-end), at most once per ``min_interval_s``.

    ``active`` only when ``stream`` is a terminal that understands the escape (``TERM`` not ``dumb``);
    when inactive every call is a no-op.
    """

    def __init__(self, stream: TextIO | None = None, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = sys.stderr if stream is None else stream  # resolved now: tests and callers swap sys.stderr
        self.min_interval_s = min_interval_s
        self.active = _is_terminal(self.stream)
        self._clock = clock
        self._drawn_at: float | None = None  # None: nothing on the line yet
        self._lock = threading.Lock()  # a background redraw and the closing call must not interleave

    def update(self, text: str) -> None:
        """Show ``text``, unless the line was drawn less than ``min_interval_s`` ago (a terminal need not flicker)."""
        with self._lock:
            now = self._clock()
            if self._drawn_at is None or now - self._drawn_at >= self.min_interval_s:
                self._draw(text, now)

    def close(self, final_text: str | None = None) -> None:
        """Draw ``final_text`` regardless of the rate limit, then end the line so later output starts clean."""
        with self._lock:
            if final_text is not None:
                self._draw(final_text, self._clock())
            if self._drawn_at is not None:
                self.stream.write('\n')
                self.stream.flush()
                self._drawn_at = None

    def _draw(self, text: str, now: float) -> None:
        if not self.active:
            return
        self.stream.write(f'\r{text}{CLEAR_TO_END}')
        self.stream.flush()
        self._drawn_at = now


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, 'isatty', None)
    return bool(isatty and isatty()) and os.environ.get('TERM') != 'dumb'


@contextlib.contextmanager
def live(render: Callable[[], str], stream: TextIO | None = None, period_s: float = 0.5) -> Iterator[ProgressLine]:
    """While the block runs, redraw ``render()`` every ``period_s`` from a background thread; end with a last one.

    The redraw runs on its own so the line keeps moving (elapsed time, a falling rate) while the work is stuck.
    Off a terminal no thread is started and nothing is written.
    """
    line = ProgressLine(stream, period_s)
    if not line.active:
        yield line
        return
    stop = threading.Event()

    def redraw() -> None:
        while True:
            line.update(render())
            if stop.wait(period_s):
                return

    thread = threading.Thread(target=redraw, name='progress-line', daemon=True)
    thread.start()
    try:
        yield line
    finally:
        stop.set()
        thread.join()
        line.close(render())

"""Whether an engine's loops still make progress: the engine side of a truthful ``/health``. No patching here.

LMDeploy's engine runs its work in a few long-lived tasks (the main loop, the migration loop, ...). One that
raises ends the whole engine, which LMDeploy's health check sees; one that is cancelled or returns is dropped
from its task set before any check looks, and a loop stuck in one step is seen only after 90 s, and only
while the api_server still holds requests. The watch records how each task ended and how long the current
step of each loop has run, and names the first problem.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class Step:
    began: float
    allowance_s: float  # how long this step may legitimately run beyond the stall limit


class LoopWatch:

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self._ended: dict[str, str] = {}  # task name -> how it ended
        self._steps: dict[str, Step] = {}  # loop name -> its step under way

    def task_ended(self, name: str, how: str) -> None:
        self._ended.setdefault(name, how)

    def step_began(self, loop: str, allowance_s: float = 0.0) -> None:
        self._steps[loop] = Step(self._clock(), allowance_s)

    def step_ended(self, loop: str) -> None:
        self._steps.pop(loop, None)

    @contextlib.contextmanager
    def step(self, loop: str, allowance_s: float = 0.0) -> Iterator[None]:
        """One step of ``loop``, timed from its start to its end, however it ends."""
        self.step_began(loop, allowance_s)
        try:
            yield
        finally:
            self.step_ended(loop)

    def problem(self) -> str | None:
        """Why the engine no longer makes progress, or None."""
        if self._ended:
            name, how = next(iter(self._ended.items()))
            return f'engine loop task {name} has ended ({how}); the engine no longer runs it'
        now = self._clock()
        for loop, step in self._steps.items():
            ran_s = now - step.began
            if ran_s > self.stall_s + step.allowance_s:
                return (f'one step of the {loop} loop has run {ran_s:.0f} s, beyond '
                        f'{self.stall_s + step.allowance_s:g} s (LMDEPLOY_PDFIX_LOOP_STALL_S)')
        return None


def how_it_ended(task: object) -> str:
    """A finished asyncio task's end, in words: cancelled, returned, or the exception it raised."""
    if task.cancelled():  # type: ignore[attr-defined]
        return 'cancelled'
    error = task.exception()  # type: ignore[attr-defined]
    return 'returned' if error is None else f'raised {error!r}'

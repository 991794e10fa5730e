"""One run of a job per key at a time, shared by every caller that comes while it runs, with a bound on how many
callers may wait (the proxy's link set-ups and warmups, #4972). No patching here.

A caller that leaves does not cancel the run the others wait for. Once a run has ended, the next caller of its
key starts a new one. A caller beyond the bound is refused at once (:class:`TooManyWaiting`) instead of adding
to a pile that grows with the storm: waiting callers are what filled the proxy's memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any


class TooManyWaiting(RuntimeError):
    """The caller was refused: ``limit`` callers already wait."""


class SharedRuns:

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what  # what callers wait for, for the refusal's message
        self.waiting = 0
        self._runs: dict[Hashable, asyncio.Future] = {}

    async def join(self, key: Hashable, start: Callable[[], Awaitable[Any]]) -> Any:
        """The result of ``key``'s run under way, or of one ``start()`` begins now."""
        if self.waiting >= self.limit:
            raise TooManyWaiting(f'{self.waiting} callers already wait for {self.what}; retry later')
        run = self._runs.get(key)
        if run is None or run.done():
            run = self._runs[key] = asyncio.ensure_future(start())
            run.add_done_callback(lambda done: self._forget(key, done))
        self.waiting += 1
        try:
            return await asyncio.shield(run)
        finally:
            self.waiting -= 1

    def _forget(self, key: Hashable, run: asyncio.Future) -> None:
        if self._runs.get(key) is run:
            del self._runs[key]
        if not run.cancelled():
            run.exception()  # retrieved: a failure nobody waited for any more is not logged as never retrieved

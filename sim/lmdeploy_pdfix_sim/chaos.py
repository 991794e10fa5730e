"""Clients as they really behave under load: a reproducible plan of well-behaved and misbehaving requests.

Each request of a chaos run is either a normal one (completions, chat, streamed chat, streamed completions;
its answer must be exactly the emulated model's text) or a client fault drawn at random, so faults overlap
with each other and with normal traffic instead of arriving at a regular beat (a regular beat missed the
Decode wedge and the wrong answers of issue 9):

- ``leaves_at_once``: a streamed completion of 64 tokens whose client closes the socket right after sending,
  so the proxy meets the disconnect anywhere from before the Prefill call to the middle of the migration;
- ``leaves_after_first_chunk``: a streamed chat whose client reads one event and leaves;
- ``leaves_mid_stream``: a streamed completion of 64 tokens whose client leaves after a few events;
- ``gives_up``: a completion whose client times out before any answer;
- ``prefill_rejects``: a request the Prefill node refuses (``top_p`` out of range).

Standard library only, like :mod:`lmdeploy_pdfix_sim.client`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmdeploy_pdfix_sim import client

NORMAL_KINDS = client.KINDS
CLIENT_FAULTS = ('leaves_at_once', 'leaves_after_first_chunk', 'leaves_mid_stream', 'gives_up', 'prefill_rejects')
LONG_TOKENS = 64  # a faulty stream long enough for the client to leave while the Decode still works on it
MID_STREAM_EVENTS = 4


@dataclass(frozen=True)
class Outcome:
    """What became of one request."""

    category: str  # a normal kind or a client fault
    status: int  # HTTP status; 0 when none came back
    exact: bool  # HTTP 200 and exactly the expected text (normal requests only)
    latency_s: float
    error_event: bool = False  # a 200 stream the Decode broke off with an error event

    @property
    def normal(self) -> bool:
        return self.category in NORMAL_KINDS

    @property
    def wrong_text(self) -> bool:
        """HTTP 200, complete, and not the request's own text: the defect no client can detect."""
        return self.normal and self.status == 200 and not self.exact and not self.error_event


def plan(requests: int, fault_rate: float, seed: int, faults: tuple[str, ...] = CLIENT_FAULTS) -> list[str | None]:
    """The client fault (or None) of each request, drawn independently, so faults cluster as they will."""
    rng = random.Random(seed)
    return [rng.choice(faults) if rng.random() < fault_rate else None for _ in range(requests)]


def send(proxy: str, index: int, fault: str | None, max_tokens: int = 8) -> Outcome:
    """Request ``index`` through ``proxy``, as a normal client or with ``fault``."""
    prompt = client.prompt_for(index)
    kind = NORMAL_KINDS[index % len(NORMAL_KINDS)]
    if fault == 'leaves_at_once':
        return Outcome(fault, client.send_then_leave(proxy, 'stream_completions', prompt, LONG_TOKENS), False, 0.0)
    if fault == 'leaves_after_first_chunk':
        status, _ = client.stream_then_disconnect(proxy, prompt, max_tokens=LONG_TOKENS)
        return Outcome(fault, status, False, 0.0)
    if fault == 'leaves_mid_stream':
        status, _ = client.stream_then_disconnect(proxy, prompt, max_tokens=LONG_TOKENS, chat=False,
                                                  events=MID_STREAM_EVENTS)
        return Outcome(fault, status, False, 0.0)
    if fault == 'gives_up':
        result = client.request(proxy, 'completions', prompt, max_tokens=LONG_TOKENS, timeout_s=0.05)
        return Outcome(fault, result.status, False, result.latency_s)
    if fault == 'prefill_rejects':
        result = client.request(proxy, kind, prompt, extra={'top_p': 2.0})
        return Outcome(fault, result.status, False, result.latency_s)
    result = client.request(proxy, kind, prompt, max_tokens)
    return Outcome(kind, result.status, result.ok, result.latency_s, result.error.startswith('stream error'))


class DecodeRestarts(threading.Thread):
    """Kills and restarts the Decode node ``restarts`` times, at random points of the load (drawn from ``seed``).

    ``restart`` stops the node, leaves it down a moment (requests meet a dead Decode) and starts it again.
    """

    def __init__(self, restart: Callable[[], None], restarts: int, total: int, seed: int) -> None:
        super().__init__(name='decode-restarts', daemon=True)
        self.restart = restart
        rng = random.Random(seed + 1)
        self.marks = sorted(rng.randrange(total // 10, total - total // 10 + 1) for _ in range(restarts))
        self.progress = 0  # requests done; the load's threads count it up
        self.downtime_s = 0.0
        self.stopped = threading.Event()  # set when the load ends: never restart a node after that

    def run(self) -> None:
        for mark in self.marks:
            while self.progress < mark:
                if self.stopped.wait(0.2):
                    return
            began = time.monotonic()
            self.restart()
            self.downtime_s += time.monotonic() - began

    def finish(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join()


def run_load(send_one: Callable[[int], Outcome], requests: int, concurrency: int,
             restarts: DecodeRestarts | None = None) -> tuple[list[Outcome], float]:
    """Every request through ``send_one``, ``concurrency`` at a time, while ``restarts`` strikes; (outcomes, s)."""
    lock = threading.Lock()

    def one(index: int) -> Outcome:
        outcome = send_one(index)
        if restarts is not None:
            with lock:
                restarts.progress += 1
        return outcome

    if restarts is not None:
        restarts.start()
    began = time.monotonic()
    try:
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            outcomes = list(pool.map(one, range(requests)))
    finally:
        if restarts is not None:
            restarts.finish()  # before the cluster stops, so no node is restarted behind its back
    return outcomes, time.monotonic() - began


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts an operator reads first: exact answers, wrong texts with HTTP 200, statuses of the rest."""
    normal = [outcome for outcome in outcomes if outcome.normal]
    return {
        'requests': len(outcomes),
        'client_faults': dict(Counter(outcome.category for outcome in outcomes if not outcome.normal)),
        'normal_exact': f'{sum(outcome.exact for outcome in normal)}/{len(normal)}',
        'normal_failed_by_status': dict(Counter(outcome.status for outcome in normal if not outcome.exact)),
        'streams_ended_by_error_event': sum(outcome.error_event for outcome in normal),
        'wrong_text_200': sum(outcome.wrong_text for outcome in outcomes),
    }

"""The DistServe relay: one request through a Prefill node and a Decode node, migrated by cache owner.

Our own handler, built from LMDeploy's public pieces (its node manager, connection pool, protocol models and
error responses). Every exit goes through the owner ledger: migrated, compensated by a release, or left
for gc when even the release failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from types import ModuleType
from typing import Any, TypeVar

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.batching import merge_completions, split_prompts
from lmdeploy_pdfix.domain.breakers import NodeBreakers
from lmdeploy_pdfix.domain.choice import choose_node, prompt_prefix
from lmdeploy_pdfix.domain.kv_layout import HOW_TO_PAIR, layout_differences
from lmdeploy_pdfix.domain.ledger import DuplicateOwnerError, OwnerLedger, OwnerRecord, RecordState, ReleaseCause
from lmdeploy_pdfix.domain.protocol import (
    CACHE_TICKET_FIELD,
    CAPABILITIES_PATH,
    CHAT_PATH,
    CLIENT_CLOSED_REQUEST,
    COMPLETIONS_PATH,
    CREDENTIALS_HINT,
    FIRST_LOGPROBS_FIELD,
    FIX_HINT,
    PREFILL_FINISHED_FIELD,
    PROMPT_DIGEST_FIELD,
    PrefillAnswer,
    PrefillAnswerError,
    first_logprobs_on_wire,
    is_finished_at_prefill,
    parse_json,
    parse_kv_usage,
    parse_prefill_answer,
    refused_credentials,
)
from lmdeploy_pdfix.domain.shared_runs import TooManyWaiting
from lmdeploy_pdfix.patching import lmdeploy_logger
from lmdeploy_pdfix.shared.node_client import (
    UnprovenNodeError,
    free_prefill_session,
    node_client,
    node_credentials_for,
    node_post,
    not_pooled_after_an_error,
)
from lmdeploy_pdfix.shared.proxy_books import RelayObserver

T = TypeVar('T')

FANOUT_MODULE = 'lmdeploy.serve.openai.chat_completions.fanout'  # LMDeploy's collation of n choices
# How long a capability answer is trusted: a fixed node stays fixed for a while; an unfixed one may be
# upgraded any moment, so it is asked again soon.
PROBE_TTL_S = {True: 60.0, False: 5.0}
ADMISSION_WAIT_S = settings.ADMISSION_WAIT_S.value()
RELAY_ATTEMPTS = int(settings.RELAY_ATTEMPTS.value())
NODE_MAX_IN_FLIGHT = int(settings.NODE_MAX_IN_FLIGHT.value())
ADMISSION_POLL_S = 0.1  # how often a waiting request looks for a node again (a breaker's back-off is 1 s or more)
HEALTH_TIMEOUT_S = settings.HEALTH_TIMEOUT_S.value()
# How long a call waits on a node before the node is asked whether it answers at all: a prefill or a generation
# may take minutes, a process that hangs (SIGSTOP, a wedged event loop) never answers its /health either.
HANG_CHECK_S = 5.0


class NodeGoneError(aiohttp.ClientConnectionError):
    """The node chosen for this request left the proxy's node list before it was called."""


class NodeHungError(aiohttp.ClientConnectionError):
    """The node stopped answering while a call waited on it: its /health did not answer either."""


# A call that fails so is safe to send to another node: the node took no work (refused, or reset the connection),
# or it died or hangs, and its caches with it; a Decode that had claimed the cache makes the next Decode's claim
# fail.
UNREACHABLE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, NodeHungError, NodeGoneError)


async def to_the_end(work: Awaitable[T]) -> T:
    """``work``'s result; a cancel that arrives meanwhile is raised only once ``work`` has ended.

    ``asyncio.shield`` alone lets the cancelled caller return at once while ``work`` goes on unseen: LMDeploy's
    fan-out then answered a failed choice before the choices it cancelled had freed their caches.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # raised below, by task.result()
            break
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


async def release(ledger: OwnerLedger, record: OwnerRecord, cause: ReleaseCause, reason: str) -> bool:
    """Free ``record``'s Prefill session and close it; a failed free stays on the books for gc."""
    if await free_prefill_session(record.p_url, record.owner, reason):
        return ledger.close(record, cause)
    ledger.release_failed(record, cause)
    return False


class _Liveness:
    """Whether a node answers at all: one probe of its /health at a time per node, shared by every call waiting
    on it; any HTTP answer will do (a 401 or 503 comes from a process that runs)."""

    def __init__(self) -> None:
        self._probes: dict[str, asyncio.Future[bool]] = {}

    def probe(self, url: str) -> asyncio.Future[bool]:
        probe = self._probes.get(url)
        if probe is None or probe.get_loop() is not asyncio.get_running_loop():
            probe = self._probes[url] = asyncio.ensure_future(self._answers(url))
            probe.add_done_callback(lambda done: self._probes.pop(url) if self._probes.get(url) is done else None)
        return probe

    @staticmethod
    async def _answers(url: str) -> bool:
        try:
            async with node_client().get(url + '/health', timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)):
                return True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False


_liveness = _Liveness()

KV_USAGE_TTL_S = 2.0  # how old a node's KV cache use may be before it is read again
MAX_METRICS_BYTES = 1 << 20  # what is read of a node's /metrics, whatever it sends


class _KvUsage:
    """Each node's KV cache use, from its /metrics (LMDeploy's gauge), read in the background once the last
    reading is older than ``KV_USAGE_TTL_S``: a choice never waits for it. None: not known."""

    def __init__(self) -> None:
        self._read: dict[str, tuple[float | None, float]] = {}
        self._reading: dict[str, asyncio.Task] = {}

    def __call__(self, url: str) -> float | None:
        usage, at = self._read.get(url, (None, -math.inf))
        reading = self._reading.get(url)
        if time.monotonic() - at > KV_USAGE_TTL_S and (
                reading is None or reading.done() or reading.get_loop() is not asyncio.get_running_loop()):
            self._reading[url] = asyncio.ensure_future(self._refresh(url))
        return usage

    async def _refresh(self, url: str) -> None:
        usage = None
        try:
            async with node_client().get(url + '/metrics', headers=await node_credentials_for(url),
                                         timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                if response.status == HTTPStatus.OK:
                    usage = parse_kv_usage(await response.content.read(MAX_METRICS_BYTES))
        except (aiohttp.ClientError, asyncio.TimeoutError, UnprovenNodeError):
            pass
        finally:
            self._read[url] = (usage, time.monotonic())


_kv_usage = _KvUsage()


async def unless_hung(url: str, work: Awaitable[T]) -> T:
    """``work``'s result, or NodeHungError once ``url`` stops answering while ``work`` waits on it (D29)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=HANG_CHECK_S)
            if not done:
                probe = _liveness.probe(url)
                await asyncio.wait((task, probe), return_when=asyncio.FIRST_COMPLETED)
                if not task.done() and not probe.result():
                    raise NodeHungError(f'{url} stopped answering: its /health did not answer within '
                                        f'{HEALTH_TIMEOUT_S:g} s')
            if task.done():
                return task.result()
    finally:
        task.cancel()  # a no-op once it is done; else the call is given up and its connection closed


@dataclass
class _Unreachable:
    """A node could not take the call (D29): the request goes to another node of the role, or waits for one."""

    url: str
    error: Exception | str

    @property
    def cause(self) -> str:
        """What the retry is counted under: gone (left the node list), hung, disconnected, or unreachable."""
        if isinstance(self.error, NodeGoneError):
            return 'gone'
        if isinstance(self.error, NodeHungError):
            return 'hung'
        return 'disconnected' if isinstance(self.error, aiohttp.ServerDisconnectedError) else 'unreachable'


@dataclass
class _StartAgain:
    """The cache cannot be decoded, but the client has no byte yet: the request starts again from a Prefill.

    Either a Decode failed (a 5xx: its engine, or its Prefill, died under the copy), or a Decode refused the cache
    after another Decode of this request failed with it (that one may have claimed, copied or freed it)."""

    answer: JSONResponse
    cause: str  # decode_failed | cache_taken


# what a Decode answers when a cache was claimed by another, has gone, or its ticket was spent
CACHE_TAKEN = frozenset({HTTPStatus.NOT_FOUND, HTTPStatus.CONFLICT, HTTPStatus.GONE})


@dataclass
class _Relay:
    """One DistServe request on its way through a Prefill node and a Decode node."""

    proxy: ModuleType
    path: str
    ledger: OwnerLedger
    credentials: dict[str, str]  # headers of the calls made for the client (see forwarded_credentials)
    observer: RelayObserver
    breakers: NodeBreakers
    deadline: float = 0.0  # until when the request may wait for a node (time.monotonic)
    failed_calls: Counter = field(default_factory=Counter)  # by role: calls that failed at once (see _failed)
    chosen: dict[str, str] = field(default_factory=dict)  # by role: the node chosen and not called yet
    prefix: str | None = None  # what names the prompt's prefix (see domain/choice.py)
    p_url: str = ''
    d_url: str = ''
    record: OwnerRecord | None = None
    _decode_started: float | None = None

    @property
    def nodes(self):
        return self.proxy.node_manager

    owner: int | None = None  # the internal cache owner, once the Prefill named it

    def error(self, status: HTTPStatus | int, message: str) -> JSONResponse:
        if self.owner is not None:  # the client never saw the internal owner id; a relayed node message may name it
            message = re.sub(rf'\b{self.owner}\b', '(the retained cache)', message)
        return self.proxy.create_error_response(status, message)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observer.phase(name, time.perf_counter() - started)

    def decode_started(self) -> None:
        self._decode_started = time.perf_counter()

    def decode_answered(self) -> None:
        """The Decode node's first byte (a whole answer, or a stream's first event) reached the proxy."""
        started, self._decode_started = self._decode_started, None
        if started is not None:
            self.observer.phase('decode_first_byte', time.perf_counter() - started)

    def choose(self, role: str, url: str) -> None:
        """``url`` takes this request's next call for ``role``: it counts as load from now, not only once called."""
        self.unchoose(self.chosen.get(role))
        self.chosen[role] = url
        _CHOSEN[url] += 1

    def unchoose(self, url: str | None) -> None:
        """``url`` is called now, or no longer chosen."""
        for role, chosen in list(self.chosen.items()):
            if chosen == url:
                del self.chosen[role]
                _CHOSEN[url] -= 1
                if not _CHOSEN[url]:
                    del _CHOSEN[url]

    def begin_call(self, url: str) -> float:
        """Count a call to ``url`` in the proxy's books (``pre_call``); pair it with ``nodes.post_call``."""
        self.unchoose(url)
        if url not in self.nodes.nodes:  # removed (heartbeat, re-registration) since it was chosen
            raise NodeGoneError(f'{url} is no longer registered with the proxy')
        return self.nodes.pre_call(url)

    async def post(self, url: str, payload: dict[str, Any]) -> tuple[int, str]:
        """POST to a node and read the whole answer, timed by the proxy's own AIOHTTP_TIMEOUT, given up once the
        node hangs."""
        start = self.begin_call(url)
        try:
            return await unless_hung(url, self._answer(url, payload))
        finally:
            self.nodes.post_call(url, start)

    async def _answer(self, url: str, payload: dict[str, Any]) -> tuple[int, str]:
        async with await node_post(url + self.path, json=payload, headers=self.credentials,
                                   timeout=self.nodes.aiotimeout) as response:
            self.breakers.answered(url)
            not_pooled_after_an_error(response)
            return response.status, await response.text()

    def calls(self, url: str) -> int:
        """The calls the proxy has in flight to ``url``, or is about to make."""
        status = self.nodes.nodes.get(url)
        return (getattr(status, 'unfinished', 0) if status is not None else 0) + _CHOSEN[url]

    def load(self, url: str) -> int:
        """What ``url`` carries now: its calls, and the caches it keeps for the proxy's requests (a Prefill's,
        until its Decode took them)."""
        return self.calls(url) + self.ledger.held(url)

    def hold(self, owner: int) -> None:
        """Open the books on the cache the Prefill node retained for this request."""
        self.owner = owner
        self.record = self.ledger.open(owner, self.p_url, self.d_url)

    async def release(self, reason: str) -> None:
        """Compensate: free the retained Prefill cache, if this request holds one.

        The free runs to its end even if this request is cancelled meanwhile (its client left): the record is
        already taken off the relay, so nothing else would release it.
        """
        record, self.record = self.record, None
        if record is not None:
            await to_the_end(release(self.ledger, record, ReleaseCause.COMPENSATED, reason))

    def migrated(self) -> None:
        """The Decode node took the cache over (it frees the Prefill session itself)."""
        record, self.record = self.record, None
        if record is not None:
            self.ledger.close(record, ReleaseCause.MIGRATED)


# Calls chosen for a node and not made yet, by node: a request's probes run between its choice and its call, so
# requests arriving together would otherwise all see the node idle.
_CHOSEN: Counter[str] = Counter()


class NodeCredentialsRefusedError(Exception):
    """A node answered 401 or 403 to the proxy's own call."""


class _CapabilityProbe:
    """What a node says of itself (whether it names cache owners, its KV layout), asked once per node and
    remembered for a while."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[dict[str, Any], float]] = {}

    async def names_owners(self, url: str) -> bool | _Unreachable:
        """True or False as the node says; why not when it cannot be asked (not remembered)."""
        said = await self.said(url)
        return said if isinstance(said, _Unreachable) else said.get('cache_owner') is True

    def caches_prefixes(self, url: str) -> bool:
        """Whether ``url`` said it caches prefixes, when it was last asked (a node not asked yet: no)."""
        known = self._known.get(url)
        return known is not None and known[0].get('prefix_caching') is True

    async def kv_layout(self, url: str) -> Any:
        """The node's KV layout as it describes it; None when it does not, or cannot be asked."""
        said = await self.said(url)
        return None if isinstance(said, _Unreachable) else said.get('kv_layout')

    async def said(self, url: str) -> dict[str, Any] | _Unreachable:
        """What ``url`` says of itself (``{}``: nothing, a stock node); why not when it cannot be asked."""
        known = self._known.get(url)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        try:
            async with node_client().get(url + CAPABILITIES_PATH, headers=await node_credentials_for(url),
                                         timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                if refused_credentials(response.status):
                    raise NodeCredentialsRefusedError(f'HTTP {response.status}')
                body = parse_json(await response.read()) if response.status == HTTPStatus.OK else {}
        except asyncio.TimeoutError:
            return _Unreachable(url, NodeHungError(f'{url} stopped answering: its capability route did not answer '
                                                   f'within {HEALTH_TIMEOUT_S:g} s'))
        except (aiohttp.ClientError, ValueError, UnprovenNodeError) as exc:
            return _Unreachable(url, exc if isinstance(exc, UNREACHABLE) else
                                f'its capability route did not answer: {exc}')
        said = body if isinstance(body, dict) else {}
        self._known[url] = (said, time.monotonic() + PROBE_TTL_S[said.get('cache_owner') is True])
        return said


_probe = _CapabilityProbe()


async def _refuse_unproven(relay: _Relay) -> JSONResponse | None:
    """Where there is a node key, both nodes must prove they hold it before any call carries it (or the client's
    credentials) to them: a node anyone registered at /nodes/add receives neither."""
    try:
        await node_credentials_for(relay.p_url)
        await node_credentials_for(relay.d_url)
    except UnprovenNodeError as exc:
        return relay.error(HTTPStatus.BAD_GATEWAY, f'{exc}.')
    return None


async def _refuse_unfixed_prefill(relay: _Relay) -> JSONResponse | _Unreachable | None:
    try:
        capable = await _probe.names_owners(relay.p_url)
    except NodeCredentialsRefusedError as exc:
        return relay.error(HTTPStatus.BAD_GATEWAY, f'The Prefill node {relay.p_url} refused the credentials of '
                                                   f'the proxy ({exc}). {CREDENTIALS_HINT}')
    if isinstance(capable, _Unreachable):
        return capable
    if not capable:
        return relay.error(HTTPStatus.SERVICE_UNAVAILABLE,
                           f'The Prefill node {relay.p_url} does not name the owner of the caches it keeps, so '
                           f'DistServe requests through this proxy would leak its sessions. {FIX_HINT}')
    return None


async def _refuse_unreachable_decode(relay: _Relay) -> _Unreachable | None:
    try:
        said = await _probe.said(relay.d_url)
    except NodeCredentialsRefusedError:  # the Decode's own call will say so, with the client's credentials
        return None
    return said if isinstance(said, _Unreachable) else None


async def _refuse_incompatible_pair(relay: _Relay) -> JSONResponse | None:
    """A Prefill and a Decode whose KV caches differ in layout never exchange one (D28): refused before any work."""
    try:  # one after the other: both are remembered almost always, and a gather would cost two tasks a request
        prefill, decode = await _probe.kv_layout(relay.p_url), await _probe.kv_layout(relay.d_url)
    except NodeCredentialsRefusedError:  # the Decode's own call will say so, with the client's credentials
        return None
    differences = layout_differences(prefill, decode)
    if not differences:
        return None
    return relay.error(HTTPStatus.SERVICE_UNAVAILABLE,
                       f'Prefill node {relay.p_url} and Decode node {relay.d_url} cannot share KV caches '
                       f'({"; ".join(differences)}): {HOW_TO_PAIR}.')


async def _choose(relay: _Relay, model: str, role: Any, tried: set[str]) -> str | JSONResponse:
    """A node of ``role`` for this request (D29): the least loaded whose breaker admits it and that is below
    ``NODE_MAX_IN_FLIGHT``, one this request has not tried first; while there is none, the request waits until its
    deadline, then gets 503 (or 429: every node is busy) with Retry-After."""
    url = _admitted(relay, model, role, tried, time.monotonic())
    if not isinstance(url, list):
        return url
    began = time.monotonic()
    relay.observer.waiting(role.name, 1)
    try:
        while not isinstance(url, str) and time.monotonic() < relay.deadline:
            await asyncio.sleep(min(ADMISSION_POLL_S, max(0.0, relay.deadline - time.monotonic())))
            url = _admitted(relay, model, role, tried, time.monotonic())
    finally:
        relay.observer.waiting(role.name, -1)
    now = time.monotonic()
    relay.observer.admission_waited(role.name, now - began, isinstance(url, str))
    return url if isinstance(url, str) else _no_node(relay, model, role.name, url, now)


def _admitted(relay: _Relay, model: str, role: Any, tried: set[str], now: float) -> str | list[str]:
    """The node this request goes to now, admitted; else the nodes serving ``model`` as ``role``."""
    serving = _serving(relay, model, role)
    relay.unchoose(relay.chosen.get(role.name))  # replaced: its load is not this request's any more
    admitted = [url for url in relay.breakers.admissible(serving, now) if not _busy(relay, url)]
    admitted = [url for url in admitted if url not in tried] or admitted
    if not admitted:
        return serving
    caching = role == relay.proxy.EngineRole.Prefill and all(_probe.caches_prefixes(url) for url in admitted)
    url = choose_node(admitted, relay.load, relay.prefix if caching else None, _kv_usage)
    relay.breakers.admit(url, now)
    relay.choose(role.name, url)
    return url


def _busy(relay: _Relay, url: str) -> bool:
    return 0 < NODE_MAX_IN_FLIGHT <= relay.calls(url)


def _all_busy(relay: _Relay, admissible: list[str]) -> bool:
    """Whether ``admissible`` nodes are up, and every one is at its limit of calls in flight."""
    return bool(admissible) and all(_busy(relay, url) for url in admissible)


def _serving(relay: _Relay, model: str, role: Any) -> list[str]:
    return [url for url, status in relay.nodes.get_nodes(role).items() if model in status.models]


def _untried(relay: _Relay, model: str, role: Any, tried: set[str]) -> bool:
    """Whether a node of ``role`` this request has not tried may take it now."""
    return any(url not in tried for url in relay.breakers.admissible(_serving(relay, model, role), time.monotonic()))


def _no_node(relay: _Relay, model: str, role: str, serving: list[str], now: float) -> JSONResponse:
    if not serving:
        answer = relay.error(HTTPStatus.SERVICE_UNAVAILABLE, f'No {role} node serves model {model!r}.')
    elif _all_busy(relay, relay.breakers.admissible(serving, now)):
        answer = relay.error(HTTPStatus.TOO_MANY_REQUESTS,
                             f'Every {role} node serving model {model!r} has {NODE_MAX_IN_FLIGHT} requests in flight '
                             f'({settings.NODE_MAX_IN_FLIGHT.name}); try again shortly.')
    else:
        answer = relay.error(HTTPStatus.SERVICE_UNAVAILABLE,
                             f'Every {role} node serving model {model!r} failed just now; try again shortly.')
    answer.headers['Retry-After'] = str(max(1, math.ceil(relay.breakers.retry_after_s(serving, now))))
    return answer


def _prefill_request(request_dict: dict[str, Any]) -> dict[str, Any]:
    prefill = {**request_dict, 'max_tokens': 1, 'stream': False, 'with_cache': True, 'preserve_cache': True}
    if 'max_completion_tokens' in prefill:
        prefill['max_completion_tokens'] = 1
    if _bans_stop_words_first(request_dict):
        # LMDeploy drops a min_new_tokens above max_new_tokens (1 here): the first token could stop the answer
        prefill['min_new_tokens'] = 1
    return prefill


def _bans_stop_words_first(request_dict: dict[str, Any]) -> bool:
    """Whether the request's min_new_tokens keeps its stop words from its first token, as LMDeploy reads it."""
    least = request_dict.get('min_new_tokens') or 0
    most = request_dict.get('max_completion_tokens') or request_dict.get('max_tokens')
    return isinstance(least, int) and least > 1 and (most is None or least <= most)


def _is_batch(request_dict: dict[str, Any]) -> bool:
    return isinstance(request_dict.get('prompt'), list)


def _choices(request_dict: dict[str, Any]) -> int:
    return request_dict.get('n') or 1


def _unsupported(path: str, request_dict: dict[str, Any]) -> str | None:
    if path == CHAT_PATH and _choices(request_dict) > 1:
        if _choices(request_dict) > settings.MAX_CHOICES.value():
            return (f'At most {settings.MAX_CHOICES.value()} choices (n) per request with the DistServe serving '
                    f'strategy ({settings.MAX_CHOICES.name}).')
        if request_dict.get('session_id') not in (None, -1):
            return 'n > 1 cannot be used with an explicit session_id.'  # as a Hybrid node answers it
    if _is_batch(request_dict) and not request_dict['prompt']:
        return 'The prompt list is empty.'
    if _is_batch(request_dict) and not all(isinstance(prompt, str) for prompt in request_dict['prompt']):
        # a nested list passed the bound below as one prompt while its Prefill kept a cache for each inner one
        return 'Each prompt of a prompt list must be a string.'
    if _is_batch(request_dict) and len(request_dict['prompt']) > settings.MAX_PROMPTS.value():
        return (f'At most {settings.MAX_PROMPTS.value()} prompts per request with the DistServe serving strategy '
                f'({settings.MAX_PROMPTS.name}).')
    if _is_batch(request_dict) and request_dict.get('stream') and len(request_dict['prompt']) > 1:
        return ('Streaming a list of prompts is not supported with the DistServe serving strategy; '
                'use stream=false or send one prompt per request.')
    return None


def _error_message(status: int, text: str) -> str:
    """The message of a node's error answer, whatever shape it has."""
    try:
        body = parse_json(text)
    except ValueError:
        return text.strip()[:500] or HTTPStatus(status).phrase
    if isinstance(body, dict):
        error = body.get('error')
        message = error.get('message') if isinstance(error, dict) else body.get('message') or body.get('text')
        if message:
            return str(message)
    return text.strip()[:500]


def _owner_if_any(text: str) -> int | None:
    try:
        return parse_prefill_answer(parse_json(text)).owner
    except (ValueError, PrefillAnswerError) as exc:
        return getattr(exc, 'owner', None)


@dataclass
class _FinishedAtPrefill:
    """The Prefill node's answer is already complete (first token was a stop token; its session is ended)."""

    body: dict[str, Any]

    def response(self, path: str, stream: bool) -> JSONResponse | StreamingResponse:
        body = {key: value for key, value in self.body.items() if key != PREFILL_FINISHED_FIELD}
        if not stream:
            return JSONResponse(body)
        chunk = {key: body[key] for key in ('id', 'created', 'model') if key in body}
        finish_reason = body['choices'][0].get('finish_reason')
        if path == CHAT_PATH:
            chunk.update(object='chat.completion.chunk', choices=[
                {'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': finish_reason}])
        else:
            chunk.update(object='text_completion', choices=[{'index': 0, 'text': '', 'finish_reason': finish_reason}])
        events = [f'data: {json.dumps(chunk)}\n\n', 'data: [DONE]\n\n']
        return StreamingResponse(iter(events), media_type='text/event-stream')


async def _prefill(relay: _Relay, request_dict: dict[str, Any]
                   ) -> PrefillAnswer | _FinishedAtPrefill | _Unreachable | JSONResponse:
    call = asyncio.ensure_future(relay.post(relay.p_url, _prefill_request(request_dict)))
    try:
        status, text = await asyncio.shield(call)
    except asyncio.CancelledError:
        # The client left while the Prefill node works: the cache its answer will name is nobody's to migrate.
        # Cancelling the call would leave it preserved until the orphan TTL; wait for the answer and release it.
        await to_the_end(_release_when_answered(relay, call))
        raise
    except asyncio.TimeoutError:
        return relay.error(HTTPStatus.GATEWAY_TIMEOUT, f'The Prefill node {relay.p_url} timed out.')
    except UNREACHABLE as exc:
        return _Unreachable(relay.p_url, exc)
    except aiohttp.ClientError as exc:
        return relay.error(HTTPStatus.BAD_GATEWAY, f'The Prefill node {relay.p_url} is unreachable: {exc}')
    if status != HTTPStatus.OK:
        await _release_unusable(relay, _owner_if_any(text), 'Prefill error')
        return relay.error(status, f'Prefill node {relay.p_url}: {_error_message(status, text)}')
    try:
        body = parse_json(text)
        if is_finished_at_prefill(body):
            return _FinishedAtPrefill(body)
        answer = parse_prefill_answer(body)
    except (ValueError, PrefillAnswerError) as exc:
        relay.ledger.reject(type(exc).__name__)
        await _release_unusable(relay, getattr(exc, 'owner', None), 'invalid Prefill answer')
        return relay.error(HTTPStatus.BAD_GATEWAY, f'Prefill node {relay.p_url}: {exc}')
    try:
        relay.hold(answer.owner)
    except DuplicateOwnerError as exc:
        relay.ledger.reject(type(exc).__name__)  # never free it: the open record's request owns that cache
        return relay.error(HTTPStatus.BAD_GATEWAY, f'{exc}; the Prefill node may have restarted.')
    return answer


async def _release_when_answered(relay: _Relay, call: asyncio.Future) -> None:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        _, text = await call
        await _release_unusable(relay, _owner_if_any(text), 'client disconnected during the Prefill')


async def _release_unusable(relay: _Relay, owner: int | None, reason: str) -> None:
    """A Prefill answer that named an owner but cannot be migrated from: free it through the books."""
    if owner is None:
        return
    with contextlib.suppress(DuplicateOwnerError):
        relay.hold(owner)
        await relay.release(reason)


async def _connect(relay: _Relay) -> tuple[HTTPStatus, str] | None:
    """None once the Prefill/Decode link is up, else the status and message of why it is not."""
    pool = relay.nodes.pd_connection_pool
    if pool.is_connected(relay.p_url, relay.d_url):
        return None
    message = relay.proxy.PDConnectionMessage(p_url=relay.p_url, d_url=relay.d_url,
                                              protocol=relay.nodes.migration_protocol,
                                              rdma_config=relay.nodes.rdma_config)
    try:
        await pool.connect(message)
    except TooManyWaiting as exc:
        return HTTPStatus.SERVICE_UNAVAILABLE, f'Prefill {relay.p_url} and Decode {relay.d_url} are not linked: {exc}'
    except Exception as exc:
        return HTTPStatus.BAD_GATEWAY, f'Cannot connect Prefill {relay.p_url} and Decode {relay.d_url}: {exc!r}'
    return None


def _decode_request(relay: _Relay, request_dict: dict[str, Any], answer: PrefillAnswer) -> dict[str, Any]:
    migration = relay.proxy.MigrationRequest(protocol=relay.nodes.migration_protocol,
                                             remote_engine_id=relay.p_url,
                                             remote_session_id=answer.owner,
                                             remote_block_ids=answer.block_ids,
                                             remote_token_id=answer.first_token_id)
    migration_request = migration.model_dump(mode='json')
    if answer.ticket is not None:
        migration_request[CACHE_TICKET_FIELD] = answer.ticket
    if answer.prompt is not None:
        migration_request[PROMPT_DIGEST_FIELD] = answer.prompt
    if answer.first_logprobs is not None:
        migration_request[FIRST_LOGPROBS_FIELD] = first_logprobs_on_wire(answer.first_logprobs)
    return {**request_dict, 'migration_request': migration_request}


async def _decode(relay: _Relay, decode_request: dict[str, Any]) -> Response | _Unreachable:
    try:
        relay.decode_started()
        status, text = await relay.post(relay.d_url, decode_request)
        relay.decode_answered()
        if status == HTTPStatus.OK:
            parse_json(text)  # a 200 that is not JSON is the node's failure, not an answer
    except UNREACHABLE as exc:
        return _Unreachable(relay.d_url, exc)  # the client has no byte yet: another Decode may take the cache
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        await relay.release('Decode failed')
        return relay.error(HTTPStatus.BAD_GATEWAY, f'Decode node {relay.d_url} failed: {exc!r}')
    if status != HTTPStatus.OK:
        await relay.release('Decode error')
        return relay.error(status, f'Decode node {relay.d_url}: {_error_message(status, text)}')
    relay.migrated()
    return Response(text, media_type='application/json')  # as the node wrote it: parsing it again costs CPU only


class _StreamWatch:
    """Ends a stream whose node hangs (D29): after ``HANG_CHECK_S`` without an event the node is asked whether it
    answers at all; if not, the stream's connection is closed, and its read fails.

    A timer per stream, not per event: a long generation costs one check every few seconds."""

    def __init__(self, url: str, response: aiohttp.ClientResponse) -> None:
        self._url, self._response = url, response
        self._loop = asyncio.get_running_loop()
        self._heard = False
        self._probe: asyncio.Future[bool] | None = None
        self._timer = self._loop.call_later(HANG_CHECK_S, self._check)
        self.hung = False

    def heard(self) -> None:
        self._heard = True

    def _check(self) -> None:
        if self._heard:
            self._heard = False
            self._timer = self._loop.call_later(HANG_CHECK_S, self._check)
            return
        self._probe = _liveness.probe(self._url)
        self._probe.add_done_callback(self._probed)

    def _probed(self, probe: asyncio.Future[bool]) -> None:
        self._probe = None
        if probe.result():
            self._timer = self._loop.call_later(HANG_CHECK_S, self._check)
        else:
            self.hung = True
            self._response.close()

    def stop(self) -> None:
        self._timer.cancel()
        if self._probe is not None:
            self._probe.remove_done_callback(self._probed)


class _DecodeStream(StreamingResponse):
    """Relays the Decode node's event stream; whatever ends it, the relay is settled exactly once."""

    def __init__(self, relay: _Relay, response: aiohttp.ClientResponse, settle: Callable[[bool], Any]) -> None:
        self._response, self._settle = response, settle
        self._relay = relay
        self._migrated = False
        self.failed = False  # the Decode failed mid-stream: the client got an error event
        self._settled = False
        super().__init__(self._events(), media_type='text/event-stream')

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            async for event in self._decode_events():
                yield event
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # The Decode died mid-stream: end the client's stream with an error event, as LMDeploy's own do.
            self.failed = True
            error = {'message': f'Decode node {self._relay.d_url} failed mid-stream: {exc!r}',
                     'type': 'server_error', 'code': HTTPStatus.BAD_GATEWAY.value}
            yield f'data: {json.dumps({"error": error})}\n\ndata: [DONE]\n\n'.encode()

    async def _decode_events(self) -> AsyncIterator[bytes]:
        watch = _StreamWatch(self._relay.d_url, self._response)
        try:
            async for event in self._events_watched(watch):
                yield event
        except aiohttp.ClientError:
            if watch.hung:
                raise NodeHungError(f'{self._relay.d_url} stopped answering: its /health did not answer within '
                                    f'{HEALTH_TIMEOUT_S:g} s') from None
            raise
        finally:
            watch.stop()

    async def _events_watched(self, watch: _StreamWatch) -> AsyncIterator[bytes]:
        async for line in self._response.content:
            watch.heard()
            self._relay.decode_answered()
            line = line.strip()
            # The Decode streams tokens only once it copied the cache and freed the Prefill session.
            self._migrated = self._migrated or (line.startswith(b'data: {') and b'"choices"' in line)
            if line == b'data: [DONE]':
                await self.settle()  # before the client sees the end, so the books balance when it does
                yield line + b'\n\n'
                return
            if line:
                yield line + b'\n\n'

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.settle()

    async def close(self) -> None:
        """Settle a stream nobody will read (LMDeploy's fan-out closes the choices it discards this way)."""
        await self.settle()

    async def settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        # a client leaving at the last event cancels the stream task while it settles
        await to_the_end(self._close_and_settle())

    async def _close_and_settle(self) -> None:
        # a stream read to its end is back in the pool already; one cut short is closed, so its node sees the
        # client leave
        self._response.close()
        await self._settle(self._migrated)


async def _decode_stream(relay: _Relay, decode_request: dict[str, Any]
                         ) -> StreamingResponse | JSONResponse | _Unreachable:
    d_url = relay.d_url
    try:
        start = relay.begin_call(d_url)
    except NodeGoneError as exc:
        return _Unreachable(d_url, exc)
    relay.decode_started()

    async def settle(migrated: bool) -> None:
        relay.nodes.post_call(d_url, start)
        if migrated:
            relay.migrated()
        else:
            await relay.release('Decode stream ended before any token')

    try:
        response = await unless_hung(d_url, node_post(d_url + relay.path, json=decode_request,
                                                      headers=relay.credentials, timeout=relay.nodes.aiotimeout))
    except UNREACHABLE as exc:
        relay.nodes.post_call(d_url, start)
        return _Unreachable(d_url, exc)  # no stream has started: another Decode may take the cache
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        await settle(False)
        return relay.error(HTTPStatus.BAD_GATEWAY, f'Decode node {d_url} failed: {exc!r}')
    relay.breakers.answered(d_url)
    not_pooled_after_an_error(response)
    stream = _DecodeStream(relay, response, settle)
    if response.status != HTTPStatus.OK:
        text = await response.text()
        await stream.settle()
        return relay.error(response.status, f'Decode node {relay.d_url}: {_error_message(response.status, text)}')
    return stream


async def relay_distserve(proxy: ModuleType, path: str, ledger: OwnerLedger, breakers: NodeBreakers, request,
                          credentials: dict[str, str], observer: RelayObserver) -> Any:
    """Serve one DistServe chat or completions request: Prefill, migrate by owner, Decode."""
    request_dict = request.model_dump()
    problem = _unsupported(path, request_dict)
    if problem is not None:
        return proxy.create_error_response(HTTPStatus.BAD_REQUEST, problem)

    def new_relay() -> _Relay:
        return _Relay(proxy=proxy, path=path, ledger=ledger, credentials=credentials, observer=observer,
                      breakers=breakers, deadline=time.monotonic() + ADMISSION_WAIT_S)

    if path == CHAT_PATH and _choices(request_dict) > 1:
        return await _relay_choices(new_relay, request, request_dict)
    if path == COMPLETIONS_PATH and _choices(request_dict) > 1:
        request_dict['n'] = 1  # LMDeploy's completions endpoint answers one choice whatever n says
    if not _is_batch(request_dict):
        return await _relay_one(new_relay(), request_dict)
    singles = split_prompts(request_dict)
    if request_dict.get('stream'):  # a list of one prompt (longer ones are refused above): that prompt's stream
        return await _relay_one(new_relay(), singles[0])
    fan_out = asyncio.Semaphore(settings.PROMPTS_IN_FLIGHT)

    async def relay_bounded(single: dict[str, Any]) -> JSONResponse | StreamingResponse:
        async with fan_out:
            return await _relay_one(new_relay(), single)

    answers = await asyncio.gather(*(relay_bounded(single) for single in singles))
    failed = next((answer for answer in answers if answer.status_code != HTTPStatus.OK), None)
    if failed is not None:
        return failed  # every prompt's relay has settled its own cache already
    return JSONResponse(merge_completions([json.loads(answer.body) for answer in answers]))


async def _relay_choices(new_relay: Callable[[], _Relay], request: Any, request_dict: dict[str, Any]) -> Any:
    """A chat with n > 1, answered as a Hybrid node answers it: LMDeploy's own fan-out (one single-choice request
    per choice, choice i seeded with seed + i) collates the choices, each relayed with its own Prefill cache.

    A failed choice is the answer; LMDeploy cancels the others, or closes the streams they opened, and each
    relay then releases what it retained.
    """
    fanout = importlib.import_module(FANOUT_MODULE)

    async def relay_choice(choice_request: Any, _raw_request: Any) -> dict[str, Any] | Any:
        answer = await _relay_one(new_relay(), choice_request.model_dump())
        if isinstance(answer, StreamingResponse) or answer.status_code != HTTPStatus.OK:
            return answer
        return json.loads(answer.body)  # the fan-out collates single-choice answers as dicts

    answer = await fanout.fanout_chat_completions(relay_choice, request, None, request_dict)
    return JSONResponse(answer) if isinstance(answer, dict) else answer


def observed(answer: Any, observer: RelayObserver, route: str, started: float) -> Any:
    """``answer``, reported to ``observer`` once its client has it all: at once, or when its stream ends."""
    if isinstance(answer, StreamingResponse) and answer.status_code == HTTPStatus.OK:
        answer.body_iterator = _reported_at_end(answer, answer.body_iterator, observer, route, started)
    else:
        observer.finished(route, answer.status_code, time.perf_counter() - started)
    return answer


async def _reported_at_end(answer: StreamingResponse, events: AsyncIterator[Any], observer: RelayObserver,
                           route: str, started: float) -> AsyncIterator[Any]:
    status = CLIENT_CLOSED_REQUEST  # unless the stream runs to its end
    try:
        async for event in events:
            yield event
        status = HTTPStatus.BAD_GATEWAY if getattr(answer, 'failed', False) else HTTPStatus.OK
    finally:
        observer.finished(route, status, time.perf_counter() - started)


async def within_deadline(raw_request: Any, work: Awaitable[Any], deadline_s: float | None) -> Any:
    """``work``'s answer; if the client disconnects first (499), or ``deadline_s`` passes before it answers
    (TimeoutError), ``work`` is cancelled, and so releases."""
    task = asyncio.ensure_future(work)
    # waits on the server's disconnect event: polling every in-flight request cost the proxy CPU per second of
    # latency, so its CPU per request grew with load and scale
    left = asyncio.ensure_future(_client_left(raw_request))
    try:
        await asyncio.wait({task, left}, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        if not left.done():  # the client waits for its 504: what the cancel releases is released meanwhile
            _SETTLING.add(settling := asyncio.ensure_future(_settled(task)))
            settling.add_done_callback(_SETTLING.discard)
            raise asyncio.TimeoutError
        await _settled(task)
        return JSONResponse({'error': 'client disconnected'}, status_code=CLIENT_CLOSED_REQUEST)
    finally:
        task.cancel()  # a no-op once it is done; stops it if this handler itself is cancelled
        left.cancel()


_SETTLING: set[asyncio.Future] = set()  # requests cancelled at their deadline, releasing what they retained


async def _settled(cancelled: asyncio.Future) -> None:
    """Wait for a cancelled request to release what it retained."""
    with contextlib.suppress(asyncio.CancelledError):
        answer = await cancelled
        close = getattr(answer, 'close', None)  # a stream it made just before the cancel: nobody reads it
        if close is not None:
            await close()


async def _client_left(raw_request: Any) -> None:
    """Return once the client of ``raw_request`` (whose body was read) has disconnected; never without one."""
    if raw_request is None:
        await asyncio.Event().wait()
    while (await raw_request.receive())['type'] != 'http.disconnect':
        pass


async def _relay_one(relay: _Relay, request_dict: dict[str, Any]) -> JSONResponse | StreamingResponse:
    try:
        return await _relay_steps(relay, request_dict)
    except asyncio.CancelledError:
        # The client left: release what this request retained; closing our connections aborts the Decode.
        await relay.release('client disconnected')
        raise
    except Exception as exc:  # whatever went wrong in here, the retained cache must not outlive the request
        lmdeploy_logger().exception('lmdeploy-pdfix: DistServe relay failed')
        await relay.release(f'proxy error {exc!r}')
        return relay.error(HTTPStatus.INTERNAL_SERVER_ERROR, f'The proxy failed to relay the request: {exc!r}')
    finally:
        for url in list(relay.chosen.values()):  # chosen, never called: refused by a probe, or the request ended
            relay.unchoose(url)


async def _relay_steps(relay: _Relay, request_dict: dict[str, Any]) -> JSONResponse | StreamingResponse:
    """Prefill on one node, then Decode on another; a node that cannot take its call is replaced (D29)."""
    model, roles, tried = request_dict['model'], relay.proxy.EngineRole, set()
    relay.prefix = prompt_prefix(request_dict)
    while True:
        for role in (roles.Prefill, roles.Decode):
            chosen = await _choose(relay, model, role, tried)
            if isinstance(chosen, JSONResponse):
                return chosen
            relay.p_url, relay.d_url = (chosen, relay.d_url) if role == roles.Prefill else (relay.p_url, chosen)
        with relay.phase('probe'):
            refused = (await _refuse_unproven(relay) or await _refuse_unfixed_prefill(relay)
                       or await _refuse_unreachable_decode(relay) or await _refuse_incompatible_pair(relay))
        if refused is None:
            with relay.phase('prefill'):
                refused = await _prefill(relay, request_dict)
        if isinstance(refused, _Unreachable):
            if _failed(relay, refused, tried):
                continue
            return relay.error(HTTPStatus.BAD_GATEWAY, f'The {_role(relay, refused.url)} node {refused.url} is '
                                                      f'unreachable: {refused.error}')
        if isinstance(refused, JSONResponse):
            return refused
        if isinstance(refused, _FinishedAtPrefill):
            return refused.response(relay.path, bool(request_dict.get('stream')))
        migrated = await _migrate(relay, request_dict, refused, tried)
        if not isinstance(migrated, _StartAgain):
            return migrated
        relay.observer.retried('Decode', migrated.cause)
        relay.failed_calls['Decode'] += 1
        if relay.failed_calls['Decode'] >= RELAY_ATTEMPTS:
            return migrated.answer


def _role(relay: _Relay, url: str) -> str:
    return 'Prefill' if url == relay.p_url else 'Decode'


def _failed(relay: _Relay, unreachable: _Unreachable, tried: set[str]) -> bool:
    """Count ``unreachable``'s node as tried by this request, open its breaker unless it merely left, and say
    whether the request may call another node: each role gets ``RELAY_ATTEMPTS`` calls that fail at once; a node
    tried again once its back-off passed (the request waited for it, within its deadline) is not counted again."""
    role = _role(relay, unreachable.url)
    if unreachable.url not in tried or time.monotonic() > relay.deadline:
        relay.failed_calls[role] += 1
    tried.add(unreachable.url)
    if unreachable.cause != 'gone':
        relay.breakers.failed(unreachable.url, time.monotonic())
    relay.observer.retried(role, unreachable.cause)
    return relay.failed_calls[role] < RELAY_ATTEMPTS


async def _migrate(relay: _Relay, request_dict: dict[str, Any], answer: PrefillAnswer,
                   tried: set[str]) -> JSONResponse | StreamingResponse | _StartAgain:
    """Decode from the cache the Prefill retained; a Decode that cannot take the call before the client has a
    byte is replaced by another, with the same cache (its claim and ticket make the migration happen once)."""
    failure: JSONResponse | _Unreachable | None = None
    decode_failed_with_it = False  # a Decode that failed may have claimed, copied or freed the cache
    while True:
        if failure is not None:
            failure = await _another_decode(relay, request_dict['model'], tried)
            if isinstance(failure, JSONResponse):
                break
            if failure is not None:
                if _failed(relay, failure, tried):
                    continue
                break
        with relay.phase('link'):
            unlinked = await _connect(relay)
        if unlinked is not None:  # either node may be at fault: another Decode is tried, no breaker opens
            failure = relay.error(*unlinked)
            tried.add(relay.d_url)
            relay.failed_calls['Decode'] += 1
            if relay.failed_calls['Decode'] < RELAY_ATTEMPTS:
                continue
            break
        relay.record.d_url, relay.record.state = relay.d_url, RecordState.MIGRATING
        decode_request = _decode_request(relay, request_dict, answer)
        failure = await (_decode_stream if request_dict.get('stream') else _decode)(relay, decode_request)
        if isinstance(failure, JSONResponse) and failure.status_code >= HTTPStatus.INTERNAL_SERVER_ERROR:
            tried.update((relay.p_url, relay.d_url))  # either may be at fault: its Prefill may have died under it
            roles = relay.proxy.EngineRole
            if any(_untried(relay, request_dict['model'], role, tried) for role in (roles.Prefill, roles.Decode)):
                return _StartAgain(failure, 'decode_failed')  # released already, as after every failed migration
            return failure  # no other pair: its answer, as a Hybrid node's
        if decode_failed_with_it and isinstance(failure, JSONResponse) and failure.status_code in CACHE_TAKEN:
            return _StartAgain(failure, 'cache_taken')
        if not isinstance(failure, _Unreachable):
            return failure
        decode_failed_with_it = True
        relay.record.state = RecordState.PREFILLED
        if not _failed(relay, failure, tried):
            break
    await relay.release('no Decode node took the cache')
    if isinstance(failure, _Unreachable):
        return relay.error(HTTPStatus.BAD_GATEWAY, f'Decode node {failure.url} failed: {failure.error!r}')
    return failure


async def _another_decode(relay: _Relay, model: str, tried: set[str]) -> JSONResponse | _Unreachable | None:
    """Choose the next Decode for this request's cache: None once one is chosen that may take it."""
    chosen = await _choose(relay, model, relay.proxy.EngineRole.Decode, tried)
    if isinstance(chosen, JSONResponse):
        return chosen
    relay.d_url = chosen
    return (await _refuse_unproven(relay) or await _refuse_unreachable_decode(relay)
            or await _refuse_incompatible_pair(relay))

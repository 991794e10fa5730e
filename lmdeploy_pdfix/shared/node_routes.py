"""The api_server side of a DistServe node: truthful frees, claims, the node audit, migration checks.

The book of preserved caches lives in the engine process; these handlers reach it through the methods the
``engine_sessions`` patch adds to the engine's RPC worker (or directly, for an in-process engine).

- ``POST /distserve/free_cache`` (D15) releases only a preserved cache of this node and always answers 200
  with ``status`` ``released``, ``not_found`` or ``refused`` and a ``detail``: each is definitive, so no
  caller retries it, and unknown ids are counted instead of logged as errors.
- ``POST /distserve/pdfix/claim`` lets a Decode node confirm that the owner still holds exactly those blocks;
  a confirmed cache is safe from the orphan TTL for the claim's lease.
- ``GET /distserve/pdfix/ticket_key``: this Prefill node's ticket key (:mod:`lmdeploy_pdfix.domain.tickets`), for the
  Decode nodes that check the tickets its answers carry; only to a caller presenting the node key (whoever holds
  the ticket key can forge tickets), so without a node key the Decodes confirm every cache by a claim first.
- A Decode node checks every ``migration_request`` (D5, #4965) before LMDeploy sees it: well formed, from a
  Prefill node it is linked to, and either vouched for by the Prefill's ticket (then the claim runs while the
  engine migrates, and the answer waits for it) or confirmed by a claim first. A failed check is a 4xx naming
  the problem, the later claim's included.
- ``GET /distserve/pdfix/audit``: preserved caches by age, releases by cause, frees that released nothing,
  claims, migration failures, and the migration requests this node refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.owner_ids import is_owner_id
from lmdeploy_pdfix.domain.preserved import ReleaseCause, Verdict, remember_recent
from lmdeploy_pdfix.domain.protocol import (
    AUDIT_PATH,
    CLAIM_PATH,
    TICKET_KEY_PATH,
    Claim,
    MigrationOrder,
    MigrationRequestError,
    claim_body,
    credentials_hint,
    parse_claim,
    parse_json,
    parse_migration_request,
    parse_ticket_key,
    presents_node_key,
    ticket_key_answer,
)
from lmdeploy_pdfix.domain.tickets import ExpiredTicketError, StaleTicketError, TicketError, TicketKey, Voucher
from lmdeploy_pdfix.patching import installation, warn
from lmdeploy_pdfix.shared.node_book import engine_book_available, engine_call
from lmdeploy_pdfix.shared.node_client import UnprovenNodeError, node_client, node_credentials_for, node_post

CLAIM_TIMEOUT_S = 10.0
TICKET_KEY_TIMEOUT_S = 5.0
NO_TICKET_KEY_RETRY_S = 5.0  # a Prefill node that gave no key is asked again after this long
SPENT_TICKETS_REMEMBERED = 65536  # a cap: used tickets are forgotten as they expire; about 11 MiB when full
ORPHAN_TTL_S = settings.ORPHAN_TTL_S.value()  # read once, as the engine's book reads it at its start
TICKET_CLOCK_SKEW_S = 60.0  # a Prefill's clock may run this far ahead of its Decode's
_CLAIM_STATUS = {
    Verdict.CLAIMED.value: HTTPStatus.OK,
    Verdict.NOT_FOUND.value: HTTPStatus.NOT_FOUND,
    Verdict.RECLAIMED.value: HTTPStatus.GONE,
    Verdict.REFUSED.value: HTTPStatus.CONFLICT,
}


class NodeBooks:
    """What this api_server process knows besides the engine's book: its links and refused migrations."""

    def __init__(self) -> None:
        self.linked_peers: dict[str, str] = {}  # a linked node: this node, as that link names it
        self.refused_migrations: Counter[str] = Counter()
        self.server_context: Any = None  # LMDeploy's, once its distserve routes are registered
        self.ticket_key = TicketKey.generate()  # this incarnation's, for the caches it preserves as a Prefill


NODE = NodeBooks()


def add_node_routes(router: Any, server_context: Any) -> None:
    """The claim and audit routes; the caller swaps ``/distserve/free_cache`` for :func:`free_cache`."""

    @router.post(CLAIM_PATH)
    async def pdfix_claim(raw_request: Request) -> JSONResponse:
        try:
            claim = parse_claim(parse_json(await raw_request.body()))
        except ValueError as exc:  # not JSON (json's error) or not a claim (ours)
            detail = str(exc) if isinstance(exc, MigrationRequestError) else 'the body is not JSON'
            return JSONResponse({'status': Verdict.REFUSED.value, 'detail': detail}, HTTPStatus.BAD_REQUEST)
        return await _engine_answer(server_context, _CLAIM_STATUS, 'pdfix_claim_preserved', *claim)

    NODE.server_context = server_context

    @router.get(TICKET_KEY_PATH)
    async def pdfix_ticket_key(raw_request: Request) -> JSONResponse:
        if not presents_node_key(raw_request.headers):  # whoever has the key forges tickets
            return JSONResponse({'detail': f'the ticket key is given only to nodes presenting '
                                           f'{settings.NODE_API_KEY.name}; without it a Decode node confirms '
                                           'each cache by a claim first'}, HTTPStatus.FORBIDDEN)
        return JSONResponse(ticket_key_answer(NODE.ticket_key))

    @router.get(AUDIT_PATH)
    async def pdfix_audit() -> dict[str, Any]:
        return {**await node_audit(), 'software': installation(), 'node_key': settings.NODE_API_KEY.value() is not None}


async def node_audit() -> dict[str, Any]:
    """The engine's book of preserved caches, with this api_server's refused migrations and links."""
    engine = await engine_call(NODE.server_context.async_engine, 'pdfix_audit')
    return {**engine, 'refused_migration_requests': dict(NODE.refused_migrations),
            'linked_peers': sorted(NODE.linked_peers)}


async def _engine_answer(server_context: Any, statuses: dict[str, int], method: str, *args: Any) -> JSONResponse:
    """The book's answer to a free or a claim, with the HTTP status of its verdict (200 where ``statuses`` has
    none); 503 when the engine cannot answer: the request is undecided, not refused."""
    try:
        answer = await engine_call(server_context.async_engine, method, *args)
    except Exception as exc:
        warn(f'{method} failed in the engine: {exc!r}')
        return JSONResponse({'status': 'unavailable', 'detail': 'the engine did not answer'},
                            HTTPStatus.SERVICE_UNAVAILABLE)
    return JSONResponse(answer, statuses.get(answer['status'], HTTPStatus.OK))


def free_cache_endpoint(server_context: Any):
    def make_endpoint(endpoint):
        # FastAPI reads the body model from LMDeploy's endpoint: swap_endpoint makes it this one's __wrapped__
        async def free_cache(cache_free_request) -> JSONResponse:
            owner = cache_free_request.remote_session_id
            if not is_owner_id(owner):
                return JSONResponse({'status': Verdict.REFUSED.value, 'detail': 'remote_session_id is not a cache '
                                     'owner (a non-negative 64-bit integer)'}, HTTPStatus.BAD_REQUEST)
            return await _engine_answer(server_context, {}, 'pdfix_release_preserved', owner,
                                        ReleaseCause.FREED.value)

        return free_cache

    return make_endpoint


def record_link(init_request: Any) -> None:
    NODE.linked_peers[init_request.remote_engine_id] = init_request.local_engine_id


def forget_link(drop_request: Any) -> None:
    # LMDeploy's route passes one request, its type hint says a list
    for request in drop_request if isinstance(drop_request, list) else [drop_request]:
        NODE.linked_peers.pop(request.remote_engine_id, None)


def issue_ticket(owner: int, block_ids: list[int]) -> str | None:
    """This Prefill node's ticket for ``owner``'s preserved blocks, valid until the orphan TTL would reclaim them;
    None where the engine keeps no book (no claim could confirm the cache either)."""
    if not engine_book_available():
        return None
    return NODE.ticket_key.issue(owner, block_ids, time.time() + ORPHAN_TTL_S)


@dataclass
class MigrationCheck:
    """What a Decode node's check of a request's ``migration_request`` decided."""

    refusal: JSONResponse | None = None  # the 4xx to answer instead of the endpoint's answer
    dummy: bool = False  # decode from a dummy prefill (D19)
    confirmation: asyncio.Future | None = None  # a claim in flight: its refusal, or None once confirmed
    order: MigrationOrder | None = None  # what the checked migration_request asks for


async def checked_migration(raw_request: Request, error_response,
                            lmdeploy_parse: Callable[[Any], Any]) -> MigrationCheck:
    """Check a Decode request's ``migration_request``, from one parse (Starlette caches the body).

    ``lmdeploy_parse`` is LMDeploy's own model of the request: what it would not parse is a 400 here, not a 500
    in its endpoint.
    """
    body = await raw_request.json()
    try:
        order = parse_migration_request(body)
        if order is not None:
            _parsed_by(lmdeploy_parse, body['migration_request'])
    except MigrationRequestError as exc:
        return MigrationCheck(refusal=_refused(HTTPStatus.BAD_REQUEST, str(exc), error_response))
    if order is None or order.dummy:
        return MigrationCheck(dummy=order is not None)
    if order.prefill not in NODE.linked_peers:
        return MigrationCheck(refusal=_refused(
            HTTPStatus.BAD_REQUEST, f'this Decode node is not linked to Prefill node {order.prefill!r}; '
            'migration requests come from the proxy after it links the pair', error_response))
    try:
        vouched = order.ticket is not None and await _vouched_for(order)
    except _TicketRefused as exc:
        return MigrationCheck(refusal=_refused(exc.status, str(exc), error_response))
    claim = _claim_refusal(order, error_response)
    if not vouched:
        return MigrationCheck(refusal=await claim, order=order)
    return MigrationCheck(confirmation=asyncio.ensure_future(claim), order=order)


async def answer_once_confirmed(work: Awaitable[Any], confirmation: asyncio.Future) -> Any:
    """``work``'s answer (an endpoint's), run while ``confirmation`` (a claim) is in flight; the claim's refusal
    instead, with ``work`` stopped, if it refuses. A stream's first event is awaited before it is answered."""
    task = asyncio.ensure_future(_first_event_read(work))
    try:
        refusal = await confirmation
    except BaseException:
        task.cancel()
        raise
    if refusal is None:
        return await task
    task.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        answer = await task
        if isinstance(answer, StreamingResponse):  # it answered before the cancel: nobody reads it
            events = answer.body_iterator
            await events.__anext__()  # into _after's try, so that closing it closes LMDeploy's stream too
            await events.aclose()
    return refusal


async def _first_event_read(work: Awaitable[Any]) -> Any:
    answer = await work
    if isinstance(answer, StreamingResponse):
        events = answer.body_iterator
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            return answer
        except BaseException:
            await events.aclose()  # LMDeploy's cleanup (the engine request's end) runs on close
            raise
        answer.body_iterator = _after(first, events)
    return answer


async def _after(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


class TicketKeys:
    """The ticket keys of the Prefill nodes this Decode node migrates from, asked of each node once (and again
    after it restarted); a node that gives none is asked again after a while."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[TicketKey | None, float]] = {}
        self._asking: dict[str, asyncio.Future] = {}
        self._spent: OrderedDict[bytes, int] = OrderedDict()  # a used ticket's MAC: its expiry

    def spend(self, voucher: Voucher, now: float) -> bool:
        """Note a verified ticket as used; False if it was already (a cache is migrated once: a second migration
        would copy blocks its first one's free gave back)."""
        self._forget_expired(now)
        if voucher.mac in self._spent:
            return False
        remember_recent(self._spent, voucher.mac, voucher.expires_at, SPENT_TICKETS_REMEMBERED)
        return True

    def _forget_expired(self, now: float) -> None:
        # an expired ticket is refused as expired anyway; the oldest noted expire first (one orphan TTL each)
        while self._spent:
            mac, expires_at = next(iter(self._spent.items()))
            if expires_at >= now:
                return
            del self._spent[mac]

    async def key(self, prefill: str, *, renew: bool = False) -> TicketKey | None:
        known = self._keys.get(prefill)
        if known is not None and not renew and (known[0] is not None or time.monotonic() < known[1]):
            return known[0]
        asking = self._asking.get(prefill)
        if asking is None:  # one request per node at a time: concurrent migrations share its answer
            asking = self._asking[prefill] = asyncio.ensure_future(self._ask(prefill))
            asking.add_done_callback(lambda _: self._asking.pop(prefill, None))
        return await asyncio.shield(asking)

    async def _ask(self, prefill: str) -> TicketKey | None:
        key = None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnprovenNodeError):
            async with node_client().get(f'{prefill}{TICKET_KEY_PATH}', headers=await node_credentials_for(prefill),
                                         timeout=aiohttp.ClientTimeout(total=TICKET_KEY_TIMEOUT_S)) as response:
                if response.status == HTTPStatus.OK:
                    key = parse_ticket_key(await response.json(content_type=None))
        self._keys[prefill] = (key, time.monotonic() + NO_TICKET_KEY_RETRY_S)
        return key


TICKET_KEYS = TicketKeys()


class _TicketRefused(Exception):
    def __init__(self, status: int, problem: str) -> None:
        super().__init__(problem)
        self.status = status


async def _vouched_for(order: MigrationOrder) -> bool:
    """Whether ``order``'s ticket vouches for its owner and blocks (False: no key to check it with, so the claim
    must confirm them first); raise :class:`_TicketRefused` for a ticket that does not."""
    key = await TICKET_KEYS.key(order.prefill)
    for renew in (False, True):
        if key is None:
            return False
        try:
            now = time.time()
            voucher = key.verify(order.ticket, order.owner, order.block_ids, now, ORPHAN_TTL_S + TICKET_CLOCK_SKEW_S)
            if not TICKET_KEYS.spend(voucher, now):
                raise _TicketRefused(HTTPStatus.CONFLICT, 'cache_ticket was already used: a cache migrates once')
            return True
        except StaleTicketError as exc:
            if renew:
                raise _TicketRefused(HTTPStatus.GONE, str(exc)) from None
            key = await TICKET_KEYS.key(order.prefill, renew=True)  # the node may have restarted since
        except ExpiredTicketError as exc:
            raise _TicketRefused(HTTPStatus.GONE, str(exc)) from None
        except TicketError as exc:
            raise _TicketRefused(HTTPStatus.CONFLICT, str(exc)) from None
    return False


def _parsed_by(lmdeploy_parse: Callable[[Any], Any], migration: dict[str, Any]) -> None:
    try:
        lmdeploy_parse(migration)
    except ValueError as exc:  # pydantic's ValidationError: name the first field it refused, briefly
        errors = getattr(exc, 'errors', lambda: [])()
        where = '.'.join(str(part) for part in errors[0]['loc']) if errors else 'migration_request'
        raise MigrationRequestError(f'{where}: {errors[0]["msg"] if errors else "does not parse"}') from None


def _refused(status: int, problem: str, error_response) -> JSONResponse:
    NODE.refused_migrations[HTTPStatus(status).phrase] += 1
    return error_response(status, f'migration_request refused: {problem}')


async def _claim_refusal(order: MigrationOrder, error_response) -> JSONResponse | None:
    claim = Claim(order.owner, order.block_ids, NODE.linked_peers.get(order.prefill))
    status, problem = await _claim(order.prefill, claim)
    return None if problem is None else _refused(status, problem, error_response)


async def _claim(prefill: str, claim: Claim) -> tuple[int, str | None]:
    try:
        async with await node_post(f'{prefill}{CLAIM_PATH}', json=claim_body(claim),
                                   headers=await node_credentials_for(prefill),
                                   timeout=aiohttp.ClientTimeout(total=CLAIM_TIMEOUT_S)) as response:
            status, text = response.status, await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return HTTPStatus.BAD_GATEWAY, f'cannot confirm the cache with Prefill node {prefill}: {exc!r}'
    except UnprovenNodeError as exc:
        return HTTPStatus.BAD_GATEWAY, f'cannot confirm the cache: {exc}'
    body: Any = None
    with contextlib.suppress(ValueError):
        body = parse_json(text)
    verdict = body.get('status') if isinstance(body, dict) else None
    if verdict not in _CLAIM_STATUS or _CLAIM_STATUS[verdict] != status:
        # fails closed: a 404 without a verdict is no Prefill with pdfix (or a URL that is not the node itself),
        # a 401 is refused credentials; never migrate what nobody confirmed
        return (HTTPStatus.BAD_GATEWAY, f'Prefill node {prefill} did not confirm the cache (HTTP {status}, no '
                f'verdict of lmdeploy-pdfix){credentials_hint(status)}')
    if verdict == Verdict.CLAIMED.value:
        return status, None
    return status, f'Prefill node {prefill}: {_short_detail(body.get("detail"), verdict)}'


def _short_detail(detail: Any, verdict: str) -> str:
    """A peer's detail, passed on only as a short string (its verdict otherwise)."""
    return detail[:200] if isinstance(detail, str) and detail else verdict

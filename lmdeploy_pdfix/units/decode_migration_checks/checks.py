"""A Decode node checks every ``migration_request`` (D5, #4965) before LMDeploy sees it: well formed, from a
Prefill node it is linked to, and either vouched for by the Prefill's ticket (then the claim runs while the engine
migrates, and the answer waits for it) or confirmed by a claim first. A failed check is a 4xx naming the problem,
the later claim's included.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmdeploy_pdfix.domain.preserved import Verdict, remember_recent
from lmdeploy_pdfix.domain.protocol import (
    CLAIM_PATH,
    CLAIM_STATUS,
    TICKET_KEY_PATH,
    Claim,
    MigrationOrder,
    MigrationRequestError,
    claim_body,
    credentials_hint,
    parse_json,
    parse_migration_request,
    parse_ticket_key,
)
from lmdeploy_pdfix.domain.tickets import ExpiredTicketError, StaleTicketError, TicketError, TicketKey, Voucher
from lmdeploy_pdfix.shared.node_client import UnprovenNodeError, node_client, node_credentials_for, node_post
from lmdeploy_pdfix.shared.node_state import NODE, ORPHAN_TTL_S

CLAIM_TIMEOUT_S = 10.0
TICKET_KEY_TIMEOUT_S = 5.0
NO_TICKET_KEY_RETRY_S = 5.0  # a Prefill node that gave no key is asked again after this long
SPENT_TICKETS_REMEMBERED = 65536  # a cap: used tickets are forgotten as they expire; about 11 MiB when full
TICKET_CLOCK_SKEW_S = 60.0  # a Prefill's clock may run this far ahead of its Decode's


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
    if verdict not in CLAIM_STATUS or CLAIM_STATUS[verdict] != status:
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

"""What crosses the wire between the proxy and the nodes: paths, field names, and the one validating parse of each.

Both sides import it, so a path or a field is named once. Everything that arrives over the network is checked
here before it is used (:func:`parse_prefill_answer`, :func:`parse_migration_request`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.owner_ids import is_index, is_owner_id
from lmdeploy_pdfix.domain.preserved import Verdict
from lmdeploy_pdfix.domain.tickets import TicketError, TicketKey, ticket_key_id

# LMDeploy's routes the relay serves and calls
CHAT_PATH = '/v1/chat/completions'
COMPLETIONS_PATH = '/v1/completions'
FREE_PATH = '/distserve/free_cache'
GC_PATH = '/distserve/gc'
P2P_INITIALIZE_PATH = '/distserve/p2p_initialize'
P2P_CONNECT_PATH = '/distserve/p2p_connect'
P2P_DROP_CONNECT_PATH = '/distserve/p2p_drop_connect'

CACHE_OWNER_FIELD = 'cache_session_id'
# The Prefill node's ticket for that cache (see :mod:`lmdeploy_pdfix.domain.tickets`); the proxy passes it to the Decode
# node inside ``migration_request``, where LMDeploy's own model ignores it.
CACHE_TICKET_FIELD = 'cache_ticket'

# The prompt a Prefill cache holds, as "<token count>-<digest of its token ids>": the Prefill node names it in its
# answer, the proxy passes it inside ``migration_request``, and the Decode node refuses to continue a cache whose
# prompt is not the one it renders and tokenizes itself (a chat template or tokenizer skew between the nodes).
PROMPT_DIGEST_FIELD = 'cache_prompt_digest'
_PROMPT_DIGEST = re.compile(r'[0-9]{1,9}-[0-9a-f]{32}')
_KEY_ID = re.compile(r'[0-9a-f]{1,32}')  # a ticket key's id, as tickets name it

# The logprobs the Prefill's sampler computed for the first token, as [[token id, logprob], ...] (the sampled
# token and the top ones): the Decode node reports them with that token, as a Hybrid node does.
FIRST_LOGPROBS_FIELD = 'cache_first_token_logprobs'
MAX_FIRST_LOGPROBS = 1025  # the sampled token and at most LMDeploy's 1024 top logprobs

# Inside one Decode node, from its scheduler to the process that samples: the key of a migrated sequence's first
# token in LMDeploy's per-sequence sampling context, for its grammar to accept first (D25).
MIGRATED_FIRST_TOKEN_KEY = 'pdfix_migrated_first_token'

# A Prefill answer that is already the whole answer (the first token was a stop token): nothing to migrate,
# and the Prefill node has already ended the session.
PREFILL_FINISHED_FIELD = 'prefill_finished'

# A node that names cache owners says so here; the proxy asks before it routes DistServe traffic to it.
CAPABILITIES_PATH = '/distserve/pdfix/capabilities'
# A Decode node confirms with the Prefill node that an owner still holds its blocks before it migrates them.
CLAIM_PATH = '/distserve/pdfix/claim'
# the HTTP status of each verdict of a claim: a Decode trusts a verdict only with its own status (fails closed)
CLAIM_STATUS = {
    Verdict.CLAIMED.value: HTTPStatus.OK,
    Verdict.NOT_FOUND.value: HTTPStatus.NOT_FOUND,
    Verdict.RECLAIMED.value: HTTPStatus.GONE,
    Verdict.REFUSED.value: HTTPStatus.CONFLICT,
}
# A Prefill node's ticket key, for the Decode nodes that check its tickets (node credentials required where set).
TICKET_KEY_PATH = '/distserve/pdfix/ticket_key'
# A node proves it holds the node key before anyone sends it the key (see node_proof). Under a prefix LMDeploy's
# --api-keys check leaves open: the one asking has proven nothing yet.
NODE_PROOF_PATH = '/nodes/pdfix_proof'
# The books of the proxy and of each node.
AUDIT_PATH = '/distserve/pdfix/audit'
# A Decode answer decoded from a dummy prefill (no KV was migrated; D19): its text is not a real answer.
DUMMY_PREFILL_FIELD = 'dummy_prefill'

# The proxy's status for a request whose client went away first (nginx's); the client never reads it, the
# proxy's metrics count it as such.
CLIENT_CLOSED_REQUEST = 499
# A client's own deadline for its DistServe request, in seconds from its arrival (at most the operator's)
DEADLINE_HEADER = 'x-request-deadline-s'

MAX_NODE_URL_CHARS = 2048  # a node URL in a request body (a Prefill's engine id, a claiming Decode's)

AUTHORIZATION = 'Authorization'
CREDENTIALS_HINT = (f'Set {settings.NODE_API_KEY.name} on the proxy and every node to a key the nodes accept '
                    '(their --api-keys).')
_NONCE = re.compile(r'[0-9a-f]{32}')
_PROOF = re.compile(r'[0-9a-f]{64}')


def proxy_urls(value: str | None) -> list[str]:
    """The proxy replicas a ``--proxy-url`` names: one URL, or several separated by commas (D30)."""
    return [url.strip().rstrip('/') for url in (value or '').split(',') if url.strip()]


def node_address(host: str, port: int) -> str:
    """``host:port`` as a node proof names an address (an IPv4 address seen through an IPv6 socket as itself)."""
    host = host.removeprefix('::ffff:')
    return f'[{host}]:{port}' if ':' in host else f'{host}:{port}'


def node_proof(key: str, nonce: str, address: str) -> str:
    """A node's proof that it holds ``key``: an HMAC over the asker's ``nonce`` and the address the node was reached
    at. The address keeps a node that merely relays the challenge to a real node from passing: the real node's
    proof names the real node's address, not the relay's."""
    message = f'lmdeploy-pdfix node proof v1|{nonce}|{address}'.encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def proves_key(proof: str, key: str, nonce: str, url: str, resolved: list[str]) -> bool:
    """Whether ``proof`` is the node at ``url``'s proof of ``key`` for ``nonce``: over its host:port as written or
    over one of the addresses the host resolved to (``resolved``, IP addresses)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == 'https' else 80)
    addresses = {node_address(host, port) for host in (parts.hostname or '', *resolved)}
    return any(hmac.compare_digest(proof, node_proof(key, nonce, address)) for address in addresses)


def parse_nonce(body: Any) -> str:
    """The nonce of a proof challenge; raise ValueError."""
    nonce = body.get('nonce') if isinstance(body, dict) else None
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise ValueError('nonce must be 32 lowercase hex digits')
    return nonce


def parse_proof(body: Any) -> str:
    """The proof of a node's answer to a challenge; raise ValueError."""
    proof = body.get('proof') if isinstance(body, dict) else None
    if not isinstance(proof, str) or not _PROOF.fullmatch(proof):
        raise ValueError('not a node proof')
    return proof


# A node's KV cache use, as LMDeploy's api_server serves it at /metrics (a fraction, 0 to 1)
KV_USAGE_METRIC = b'lmdeploy:gpu_cache_usage_perc'


def parse_kv_usage(text: bytes) -> float | None:
    """A node's KV cache use from its Prometheus text: the first sample of ``KV_USAGE_METRIC`` (a fraction from 0 to
    1), or None where there is none that parses."""
    for line in text.splitlines():
        if line.startswith(KV_USAGE_METRIC) and line[len(KV_USAGE_METRIC):][:1] in (b'{', b' '):
            try:
                usage = float(line.rsplit(None, 1)[-1])
            except ValueError:
                return None
            return usage if 0.0 <= usage <= 1.0 else None
    return None


def parse_json(text: str | bytes) -> Any:
    """A peer's JSON; raise ValueError for anything that is not (json's own RecursionError on deep nesting too,
    which would otherwise end the handler in a 500)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError('JSON nested too deeply') from None


def bearer(key: str | None) -> dict[str, str]:
    """The headers that present ``key`` to LMDeploy's ``--api-keys`` check (none without a key)."""
    return {AUTHORIZATION: f'Bearer {key}'} if key else {}


def node_credentials() -> dict[str, str]:
    """Headers of the calls pdfix makes to a node on its own behalf: probe, link set-up, free, claim."""
    return bearer(settings.NODE_API_KEY.value())


def presents_node_key(headers: Any) -> bool:
    """Whether a request's ``Authorization`` is the operator's node key (never, where this node has none)."""
    key = settings.NODE_API_KEY.value()
    scheme, _, presented = (headers.get(AUTHORIZATION) or '').partition(' ')
    if not key or scheme.lower() != 'bearer':
        return False
    # digests: compare_digest refuses non-ASCII text, and equal lengths leak nothing of the key
    return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), hashlib.sha256(key.encode()).digest())


def request_deadline_s(client_headers: Any, most_s: float) -> float | None:
    """The seconds a DistServe request may take until its answer starts: the client's ``X-Request-Deadline-S``
    within the operator's ``most_s`` (0: no limit), or None for none. ValueError for a header that is not a number
    of seconds above 0."""
    raw = client_headers.get(DEADLINE_HEADER) if client_headers is not None else None
    asked = None
    if raw is not None:
        try:
            asked = float(raw) if len(raw) <= 32 and raw.strip().isascii() else math.nan
        except ValueError:
            asked = math.nan
        if not 0 < asked < math.inf:
            raise ValueError(f'{DEADLINE_HEADER} must be a number of seconds above 0')
    limits = [limit for limit in (asked, most_s or None) if limit is not None]
    return min(limits, default=None)


def forwarded_credentials(client_headers: Any) -> dict[str, str]:
    """Headers of a client's request relayed to its nodes: the client's own ``Authorization`` (as LMDeploy's
    Hybrid proxy forwards it), else the operator's node key."""
    value = client_headers.get(AUTHORIZATION) if client_headers is not None else None
    return {AUTHORIZATION: value} if value else node_credentials()


def refused_credentials(status: int) -> bool:
    return status in (401, 403)


def credentials_hint(status: int) -> str:
    """What to add to a report of a node's answer ``status`` to pdfix's own call: how to fix refused credentials."""
    return f'. {CREDENTIALS_HINT}' if refused_credentials(status) else ''


FIX_HINT = ('Enable lmdeploy-pdfix on the Prefill node (pip install lmdeploy-pdfix; LMDEPLOY_PDFIX=1) '
            'and upgrade the proxy and every Prefill node together.')


class PrefillAnswerError(ValueError):
    """A Prefill answer the proxy cannot migrate from; ``owner`` is set where it could still be read."""

    def __init__(self, problem: str, owner: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.owner = owner


@dataclass(frozen=True)
class PrefillAnswer:
    """What a Decode node needs to take over a preserved Prefill cache."""

    owner: int
    block_ids: list[int]
    first_token_id: int
    ticket: str | None = None
    prompt: str | None = None  # its prompt's digest; a Prefill of an older pdfix names none
    first_logprobs: FirstLogprobs | None = None  # where the request asked for logprobs


def is_finished_at_prefill(body: Any) -> bool:
    return isinstance(body, dict) and body.get(PREFILL_FINISHED_FIELD) is True


TicketIssuer = Callable[[int, list[int]], str | None]  # a Prefill's ticket for an owner's blocks


def prompt_digest(token_ids: Sequence[int]) -> str:
    """How a prompt's token ids are named on the wire (``PROMPT_DIGEST_FIELD``)."""
    digest = hashlib.blake2b(json.dumps(list(token_ids)).encode(), digest_size=16).hexdigest()
    return f'{len(token_ids)}-{digest}'


def is_prompt_digest(value: Any) -> bool:
    return isinstance(value, str) and _PROMPT_DIGEST.fullmatch(value) is not None


FirstLogprobs = dict[int, float]  # token id -> logprob, as LMDeploy's outputs carry them


def first_logprobs_on_wire(logprobs: FirstLogprobs) -> list[list[int | float]]:
    return [[token, value] for token, value in logprobs.items()]


def parse_cache_facts(source: dict[str, Any]) -> tuple[str | None, FirstLogprobs | None]:
    """The prompt digest and first-token logprobs in a Prefill answer or a ``migration_request`` (each None when
    absent); raise ``ValueError`` when one is malformed."""
    prompt = source.get(PROMPT_DIGEST_FIELD)
    if prompt is not None and not is_prompt_digest(prompt):
        raise ValueError(f'{PROMPT_DIGEST_FIELD} {_short(prompt)} is not a prompt digest')
    return prompt, _parse_first_logprobs(source.get(FIRST_LOGPROBS_FIELD))


def _parse_first_logprobs(value: Any) -> FirstLogprobs | None:
    if value is None:
        return None
    if not isinstance(value, list) or not 0 < len(value) <= MAX_FIRST_LOGPROBS:
        raise ValueError(f'{FIRST_LOGPROBS_FIELD} is not a list of 1 to {MAX_FIRST_LOGPROBS} pairs')
    bad = next((pair for pair in value if not _is_logprob_pair(pair)), None)
    if bad is not None:
        raise ValueError(f'{FIRST_LOGPROBS_FIELD} holds {_short(bad)}, not a [token id, logprob] pair')
    return {token: float(logprob) for token, logprob in value}


def _is_logprob_pair(pair: Any) -> bool:
    return isinstance(pair, list) and len(pair) == 2 and is_index(pair[0]) and _is_logprob(pair[1])


def _is_logprob(value: Any) -> bool:
    """A float that is a number (JSON carries logprobs as floats; an int is one of bounded size, never a bool)."""
    if isinstance(value, float):
        return not math.isnan(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2 ** 53


def with_owner(body: dict[str, Any], owner: int | None, issue_ticket: TicketIssuer | None = None,
               facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """``body`` with ``cache_session_id`` (and the cache's ticket, if ``issue_ticket`` makes one, and the
    ``facts`` of the cache a Decode needs: its prompt's digest, its first token's logprobs) added when it carries a
    retained cache (``cache_block_ids``)."""
    if owner is not None and 'cache_block_ids' in body:
        body[CACHE_OWNER_FIELD] = owner
        ticket = issue_ticket(owner, body['cache_block_ids']) if issue_ticket is not None else None
        if ticket is not None:
            body[CACHE_TICKET_FIELD] = ticket
        body.update(facts or {})
    return body


def sse_chunk_with_owner(chunk: str | bytes, owner: int | None, issue_ticket: TicketIssuer | None = None,
                         facts: dict[str, Any] | None = None) -> str | bytes:
    """A ``data: {...}`` stream chunk with the owner (and ticket and facts) added if that chunk carries
    ``cache_block_ids``."""
    text = chunk.decode() if isinstance(chunk, bytes) else chunk
    if owner is None or '"cache_block_ids"' not in text:
        return chunk
    return sse_chunk_rewritten(chunk, lambda event: with_owner(event, owner, issue_ticket, facts))


def sse_chunk_rewritten(chunk: str | bytes, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> str | bytes:
    """A stream chunk with every ``data: {...}`` event passed through ``rewrite``; other events unchanged."""
    text = chunk.decode() if isinstance(chunk, bytes) else chunk
    rewritten = '\n\n'.join(_event_rewritten(event, rewrite) for event in text.split('\n\n'))
    return rewritten.encode() if isinstance(chunk, bytes) else rewritten


def _event_rewritten(event: str, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    prefix = 'data: '
    if not event.startswith(prefix):
        return event
    try:
        payload = json.loads(event[len(prefix):])
    except ValueError:
        return event
    if not isinstance(payload, dict):
        return event
    return prefix + json.dumps(rewrite(payload))


def parse_prefill_answer(body: Any) -> PrefillAnswer:
    """Validate a Prefill node's answer to a ``with_cache`` request; raise :class:`PrefillAnswerError`."""
    if not isinstance(body, dict):
        raise PrefillAnswerError(f'the Prefill node answered {type(body).__name__}, not a JSON object')
    if CACHE_OWNER_FIELD not in body:
        raise PrefillAnswerError(f'the Prefill answer has no {CACHE_OWNER_FIELD!r}, so the proxy cannot tell '
                                 f'which Prefill session holds the cache. {FIX_HINT}')
    owner = body[CACHE_OWNER_FIELD]
    if not is_owner_id(owner):
        raise PrefillAnswerError(f'the Prefill answer has an invalid {CACHE_OWNER_FIELD!r}: {owner!r} '
                                 f'(expected a non-negative integer). {FIX_HINT}')
    block_ids = body.get('cache_block_ids')
    if not _is_int_list(block_ids) or not block_ids:
        raise PrefillAnswerError(f'the Prefill answer has no usable cache_block_ids: {block_ids!r}', owner)
    token_ids = body.get('remote_token_ids')
    if not _is_int_list(token_ids) or not token_ids:
        raise PrefillAnswerError(f'the Prefill answer has no first token (remote_token_ids={token_ids!r})', owner)
    try:  # a malformed fact is a check the Decode could not make: fail closed
        prompt, first_logprobs = parse_cache_facts(body)
    except ValueError as exc:
        raise PrefillAnswerError(f'the Prefill answer is unusable: {exc}', owner) from None
    return PrefillAnswer(owner=owner, block_ids=block_ids, first_token_id=token_ids[-1],
                         ticket=_ticket_or_none(body.get(CACHE_TICKET_FIELD)), prompt=prompt,
                         first_logprobs=first_logprobs)


def _ticket_or_none(value: Any) -> str | None:
    """A Prefill answer's ticket if it has the shape of one; the Decode node claims the cache first without."""
    try:
        return parse_ticket(value)
    except MigrationRequestError:
        return None


def parse_ticket(value: Any) -> str | None:
    """A ``cache_ticket`` of the shape tickets have (None when absent); raise :class:`MigrationRequestError`."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise MigrationRequestError(f'{CACHE_TICKET_FIELD} is not a string')
    try:
        ticket_key_id(value)
    except TicketError as exc:
        raise MigrationRequestError(str(exc)) from None
    return value


def ticket_key_answer(key: TicketKey) -> dict[str, str]:
    return {'key_id': key.key_id, 'secret': key.secret.hex()}


def parse_ticket_key(body: Any) -> TicketKey:
    """A Prefill node's answer on :data:`TICKET_KEY_PATH`; raise ValueError if it is not a key."""
    if not isinstance(body, dict) or not isinstance(body.get('key_id'), str) or not isinstance(body.get('secret'), str):
        raise ValueError('not a ticket key')
    secret = bytes.fromhex(body['secret'])
    if len(secret) < 16 or not _KEY_ID.fullmatch(body['key_id']):
        raise ValueError('not a ticket key')
    return TicketKey(key_id=body['key_id'], secret=secret)


def migration_request_problem(owner: Any, block_ids: Any,
                              names: tuple[str, str] = ('remote_session_id', 'remote_block_ids')) -> str | None:
    """Why a migration of ``block_ids`` owned by ``owner`` cannot be right, or None (a short reason)."""
    owner_name, blocks_name = names
    if not is_owner_id(owner):
        return f'{owner_name} {_short(owner)} is not a cache owner (a non-negative 64-bit integer)'
    if not _is_int_list(block_ids) or not block_ids:
        return f'{blocks_name} {_short(block_ids)} is not a non-empty list of block ids'
    if len(set(block_ids)) != len(block_ids):
        return f'{blocks_name} names a block twice'
    return None


class Claim(NamedTuple):
    """A Decode node's claim of a preserved cache: its owner and blocks, and the claiming node as the link between
    the two names it (absent from an older pdfix)."""

    owner: int
    block_ids: list[int]
    decode: str | None


def claim_body(claim: Claim) -> dict[str, Any]:
    return {'owner': claim.owner, 'block_ids': claim.block_ids, 'decode': claim.decode}


def parse_claim(body: Any) -> Claim:
    """A claim, from its JSON body; raise :class:`MigrationRequestError` with a short reason."""
    if not isinstance(body, dict):
        raise MigrationRequestError('a claim is a JSON object with owner and block_ids')
    owner, block_ids, decode = body.get('owner'), body.get('block_ids'), body.get('decode')
    problem = migration_request_problem(owner, block_ids, names=('owner', 'block_ids'))
    if problem is not None:
        raise MigrationRequestError(problem)
    if decode is not None and (not isinstance(decode, str) or not 0 < len(decode) <= MAX_NODE_URL_CHARS):
        raise MigrationRequestError(f'decode {_short(decode)} is not a node URL')
    return Claim(owner, block_ids, decode)


def _short(value: Any, limit: int = 40) -> str:
    """``value``'s repr, cut short: a refusal names what it refused without echoing a huge input."""
    if isinstance(value, (list, dict, str)) and len(value) > limit:
        return f'a {type(value).__name__} of {len(value)}'
    try:
        text = repr(value)
    except ValueError:  # an int of thousands of digits has no repr
        return 'a very large integer'
    return text if len(text) <= limit else f'{text[:limit]}…'


class MigrationRequestError(ValueError):
    """A ``migration_request`` no Decode node may act on; the message says why, briefly."""


@dataclass(frozen=True)
class MigrationOrder:
    """What a Decode request's ``migration_request`` asks for, once validated."""

    prefill: str
    owner: int
    block_ids: list[int]
    dummy: bool  # decode from no migrated KV at all (D19); nothing of a Prefill node is named then
    ticket: str | None = None  # the Prefill node's ticket for the cache, passed on by a pdfix proxy
    prompt: str | None = None  # the digest of the prompt the cache holds, passed on by a pdfix proxy
    first_logprobs: FirstLogprobs | None = None  # the first token's logprobs, passed on by a pdfix proxy


def parse_migration_request(body: Any) -> MigrationOrder | None:
    """The validated ``migration_request`` of a Decode request's JSON ``body``; None when it carries none.

    One parse decides everything: LMDeploy reads the same fields with pydantic's lax types (``"false"`` is
    False to it), so a value that is not exactly of its type is refused here rather than read two ways.
    """
    migration = body.get('migration_request') if isinstance(body, dict) else None
    if migration is None:
        return None
    if not isinstance(migration, dict):
        raise MigrationRequestError('migration_request is not a JSON object')
    prompt = body.get('prompt')
    if (isinstance(prompt, list) and len(prompt) != 1) or body.get('n') not in (None, 1):
        raise MigrationRequestError('a migration_request serves exactly one prompt and one sequence')
    dummy = migration.get('is_dummy_prefill', False)
    if not isinstance(dummy, bool):
        raise MigrationRequestError('is_dummy_prefill must be true or false')
    if dummy:
        if not settings.ALLOW_DUMMY_PREFILL.value():  # blocks no Prefill filled: another request's leftovers
            raise MigrationRequestError(f'is_dummy_prefill is refused on this Decode node (it would decode from KV '
                                        f'blocks no Prefill filled; {settings.ALLOW_DUMMY_PREFILL.name}=1 allows it)')
        return MigrationOrder(prefill='', owner=0, block_ids=[], dummy=True)
    owner, block_ids = migration.get('remote_session_id'), migration.get('remote_block_ids')
    problem = migration_request_problem(owner, block_ids)
    if problem is not None:
        raise MigrationRequestError(problem)
    prefill = migration.get('remote_engine_id')
    if not isinstance(prefill, str) or not 0 < len(prefill) <= MAX_NODE_URL_CHARS:
        raise MigrationRequestError(f'remote_engine_id {_short(prefill)} is not a node URL')
    try:
        prompt, first_logprobs = parse_cache_facts(migration)
    except ValueError as exc:
        raise MigrationRequestError(str(exc)) from None
    return MigrationOrder(prefill=prefill, owner=owner, block_ids=block_ids, dummy=False,
                          ticket=parse_ticket(migration.get(CACHE_TICKET_FIELD)), prompt=prompt,
                          first_logprobs=first_logprobs)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_index(item) for item in value)

"""Every ``LMDEPLOY_PDFIX*`` switch an operator sets, declared once: name, default, bounds, help, the patches it tunes.

Standard library only: read at interpreter start-up. A value that does not parse or lies outside its bounds
never raises where it is read (an engine or event loop): it reads as its default, the bootstrap logs it once,
and the patches it tunes stay stock (:func:`problem_for`). The README's table of switches is checked against
this module by a test. The emulation's switches (``LMDEPLOY_PDFIX_SIM*``) belong to the test-only
``lmdeploy_pdfix_sim`` distribution, not to this package.
"""

from __future__ import annotations

import os

TOGGLE = 'LMDEPLOY_PDFIX'
DISABLE = 'LMDEPLOY_PDFIX_DISABLE'

_TRUE = frozenset({'1', 'true', 'yes', 'on'})


class Number:
    """A numeric switch: a duration in seconds, or a whole count."""

    # a plain class: dataclasses cost milliseconds at every interpreter start-up
    __slots__ = ('default', 'help', 'maximum', 'minimum', 'name', 'node', 'patches', 'whole')

    def __init__(self, name: str, default: float, *, minimum: float, maximum: float, node: str,
                 patches: tuple[str, ...], help: str, whole: bool = False) -> None:
        self.name, self.default, self.minimum, self.maximum = name, default, minimum, maximum
        self.node, self.patches, self.help, self.whole = node, patches, help, whole

    def problem(self) -> str | None:
        """Why the environment's value is unusable, or None (unset is fine: the default)."""
        raw = os.environ.get(self.name, '').strip()
        if not raw:
            return None
        try:
            value = self._parse(raw)
        except ValueError:
            return f'{self.name}={raw!r} is not ' + ('a whole number' if self.whole else 'a number of seconds')
        if not self.minimum <= value <= self.maximum:
            return f'{self.name}={raw} is outside {self.minimum:g}..{self.maximum:g}' + ('' if self.whole else ' s')
        return None

    def value(self) -> float:
        """The environment's value, or the default where it is unset or unusable."""
        if self.problem() is not None or not os.environ.get(self.name, '').strip():
            return self.default
        return self._parse(os.environ[self.name])

    def _parse(self, raw: str) -> float:
        return int(raw) if self.whole else float(raw)


_DAY = 86_400.0
GC_AGE_S = Number(
    'LMDEPLOY_PDFIX_GC_AGE_S', 600.0, minimum=1.0, maximum=7 * _DAY, node='proxy', patches=('proxy_distserve',),
    help='age after which `POST /distserve/gc` releases a retained Prefill cache nobody migrated; well above '
         'the time a migration may sit in a queue')
CONNECT_TIMEOUT_S = Number(
    'LMDEPLOY_PDFIX_CONNECT_TIMEOUT_S', 300.0, minimum=0.1, maximum=_DAY, node='proxy',
    patches=('proxy_connections',), help='how long a request waits for a Prefill/Decode link to come up')
HEALTH_TIMEOUT_S = Number(
    'LMDEPLOY_PDFIX_HEALTH_TIMEOUT_S', 10.0, minimum=0.1, maximum=3600.0, node='proxy',
    patches=('proxy_heartbeat', 'proxy_distserve'),
    help="how long the proxy waits for a node's `/health` (and its capability route): the heartbeat removes a node "
         "that fails it and registers it again once it answers (the heartbeat's period stays LMDeploy's "
         "`LMDEPLOY_CONTROLLER_HEART_BEAT_EXPIRATION`, 90 s); a DistServe call that has waited 5 s on a node that "
         'fails it is given up as hung and goes to another node')
ORPHAN_TTL_S = Number(
    'LMDEPLOY_PDFIX_ORPHAN_TTL_S', 600.0, minimum=1.0, maximum=7 * _DAY, node='Prefill and Decode',
    patches=('engine_sessions', 'decode_migration_checks'),
    help='a preserved Prefill cache no Decode node claimed, and nobody freed, this long after its answer is '
         'reclaimed; a claimed one is held for its lease instead (`LMDEPLOY_PDFIX_CLAIM_LEASE_S`). A Decode node '
         'refuses a cache ticket that claims to live longer (a minute of clock skew allowed): set it alike on both')
CLAIM_LEASE_S = Number(
    'LMDEPLOY_PDFIX_CLAIM_LEASE_S', 600.0, minimum=1.0, maximum=7 * _DAY, node='Prefill and Decode',
    patches=('engine_sessions', 'migration_faults'),
    help='a Decode node starts the migration of a cache it claimed within this long of the request, or fails '
         'the request; the Prefill keeps a claimed cache from the orphan TTL for this long plus the migration '
         'timeout and 30 s; keep it alike on every node and above the 300-480 s a migration may wait in a queue')
MIGRATION_TIMEOUT_S = Number(
    'LMDEPLOY_PDFIX_MIGRATION_TIMEOUT_S', 120.0, minimum=0.1, maximum=_DAY, node='Decode and Prefill',
    patches=('migration_faults', 'engine_sessions'),
    help='a KV transfer not done by then fails its request; its blocks stay pinned until the transfer really ends')
ZMQ_SEND_TIMEOUT_S = Number(
    'LMDEPLOY_PDFIX_ZMQ_SEND_TIMEOUT_S', 10.0, minimum=0.1, maximum=3600.0, node='Decode',
    patches=('engine_connections',),
    help='a free message the Prefill cannot take by then is given up on; the copy has ended, so the request is '
         'answered and its Prefill cache freed over HTTP instead')
LOOP_STALL_S = Number(
    'LMDEPLOY_PDFIX_LOOP_STALL_S', 60.0, minimum=1.0, maximum=_DAY, node='Prefill and Decode',
    patches=('engine_loop_health',),
    help="a node's `/health` answers 503 once one forward step of its engine has run this long, or one migration "
         'step this long plus the migration timeout of each sequence in it: the loop has stopped making progress '
         'while work waits (an engine loop task that ended answers 503 at once)')
HEALTH_POLL_S = Number(
    'LMDEPLOY_PDFIX_HEALTH_POLL_S', 1.0, minimum=0.1, maximum=60.0, node='Prefill and Decode',
    patches=('health_polling',),
    help="how often an api_server asks its engine how it is, for `/health` (LMDeploy's 12 s unless "
         '`LMDEPLOY_HEALTH_POLL_INTERVAL` is set, which then wins)')

KEEPALIVE_S = Number(
    'LMDEPLOY_PDFIX_KEEPALIVE_S', 4.0, minimum=0.0, maximum=4.9, node='proxy and Decode',
    patches=('proxy_distserve', 'decode_migration_checks', 'migration_faults'),
    help="how long a pooled connection to a node stays open idle for the next call (the proxy's relay, "
         "frees and probes, the Decode's claims and its frees over HTTP); keep it below the nodes' "
         "`UVICORN_TIMEOUT_KEEP_ALIVE` (LMDeploy's default 5 s), so a node never closes one under a call; 0 opens "
         "a connection per call")

MAX_LINK_WAITERS = Number(
    'LMDEPLOY_PDFIX_MAX_LINK_WAITERS', 1024, minimum=1, maximum=1_000_000, node='proxy',
    patches=('proxy_connections', 'proxy_warmups'), whole=True,
    help='most callers that may wait at once for Prefill/Decode link set-ups (requests on a cold link, and '
         '`/distserve/connection_warmup` calls, which share one warmup at a time): one more is answered 503 '
         'at once instead of adding to a pile that grows with the storm')

PROMPTS_IN_FLIGHT = 8  # of one request's prompt list: each holds a Prefill cache until its Decode takes it
MAX_PROMPTS = Number(
    'LMDEPLOY_PDFIX_MAX_PROMPTS', 64, minimum=1, maximum=100_000, node='proxy', patches=('proxy_distserve',),
    whole=True, help='most prompts one DistServe completions request may list (400 above it); each holds a Prefill '
                     f'cache until its Decode takes it, and at most {PROMPTS_IN_FLIGHT} of one request are relayed '
                     'at a time')

MAX_CHOICES = Number(
    'LMDEPLOY_PDFIX_MAX_CHOICES', 128, minimum=1, maximum=1024, node='proxy', patches=('proxy_distserve',),
    whole=True, help='most choices (n) one DistServe chat request may ask for (400 above it; a Hybrid node allows '
                     '128); the choices are relayed at once, as a Hybrid node generates them, each holding a '
                     'Prefill cache until its Decode takes it')
ADMISSION_WAIT_S = Number(
    'LMDEPLOY_PDFIX_ADMISSION_WAIT_S', 30.0, minimum=0.0, maximum=3600.0, node='proxy', patches=('proxy_distserve',),
    help='how long a DistServe request waits for a Prefill or Decode node when every node of that role is down or '
         'has just failed (a node that fails a call is skipped, and tried again after 1 s, 2 s, 4 s, then every '
         '5 s); then 503 with `Retry-After`')
RELAY_ATTEMPTS = Number(
    'LMDEPLOY_PDFIX_RELAY_ATTEMPTS', 4, minimum=1, maximum=32, node='proxy', patches=('proxy_distserve',),
    whole=True, help='most calls one DistServe request makes to nodes of one role: a Prefill or Decode node that '
                     'refuses the connection or drops it before answering is replaced by another (a Decode only '
                     'before the client has a byte; a stream that started is never replayed)')
REQUEST_DEADLINE_S = Number(
    'LMDEPLOY_PDFIX_REQUEST_DEADLINE_S', 0.0, minimum=0.0, maximum=_DAY, node='proxy', patches=('proxy_distserve',),
    help='the longest a DistServe request may take until its answer starts (a whole answer, or the first event of '
         'a stream), waits and retries included; then 504, its Prefill cache released. A client may ask for less '
         'with the header `X-Request-Deadline-S`. 0: no limit')
NODE_MAX_IN_FLIGHT = Number(
    'LMDEPLOY_PDFIX_NODE_MAX_IN_FLIGHT', 0, minimum=0, maximum=1_000_000, node='proxy', patches=('proxy_distserve',),
    whole=True, help='most DistServe calls the proxy has in flight to one node; a request finding every node of a '
                     'role at it waits (`LMDEPLOY_PDFIX_ADMISSION_WAIT_S`), then gets 429 with `Retry-After`. '
                     '0: no limit')

NUMBERS: tuple[Number, ...] = (GC_AGE_S, CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S, ORPHAN_TTL_S, CLAIM_LEASE_S,
                               MIGRATION_TIMEOUT_S, ZMQ_SEND_TIMEOUT_S, LOOP_STALL_S, HEALTH_POLL_S, MAX_PROMPTS,
                               MAX_CHOICES, MAX_LINK_WAITERS, KEEPALIVE_S, ADMISSION_WAIT_S, RELAY_ATTEMPTS,
                               REQUEST_DEADLINE_S, NODE_MAX_IN_FLIGHT)

# covers the hop from a Decode's claim to its engine, which counts the lease from the request's arrival
_CLAIM_HOP_MARGIN_S = 30.0


def claim_hold_s() -> float:
    """How long a Prefill holds a claimed cache: its Decode starts the migration within the lease and gives up
    on the transfer a migration timeout later."""
    return CLAIM_LEASE_S.value() + MIGRATION_TIMEOUT_S.value() + _CLAIM_HOP_MARGIN_S


class Text:
    """A text switch (a credential, say): read as it is, never logged."""

    __slots__ = ('help', 'name', 'node')

    def __init__(self, name: str, *, node: str, help: str) -> None:
        self.name, self.node, self.help = name, node, help

    def value(self) -> str | None:
        return os.environ.get(self.name, '').strip() or None


NODE_API_KEY = Text(
    'LMDEPLOY_PDFIX_NODE_API_KEY', node='proxy and every node',
    help="a key the nodes' `--api-keys` accept: the calls pdfix makes on its own behalf (capability probe, link "
         "set-up, frees, the Decode's claims and ticket keys) send it as a Bearer token; requests relayed for a "
         "client send the client's own `Authorization`, as LMDeploy's Hybrid proxy does (this key only when the "
         "client sent none). It goes only to a node that proved it holds the same key (an HMAC over a fresh nonce "
         "and its address), so a node registered by anyone never receives it; unset, node ports are open to "
         "anyone who reaches them (docs/security.md)")
NODE_ADDRESS = Text(
    'LMDEPLOY_PDFIX_NODE_ADDRESS', node='every node',
    help="`host:port` this node is reached at, where that is not the address it listens on (NAT, a container's "
         "port mapping): the address its proof of the node key names. Unset, the local address of each connection")
TEXTS: tuple[Text, ...] = (NODE_API_KEY, NODE_ADDRESS)


class Flag:
    """An on/off switch, off unless set to a true value (1, true, yes, on)."""

    __slots__ = ('help', 'name', 'node')

    def __init__(self, name: str, *, node: str, help: str) -> None:
        self.name, self.node, self.help = name, node, help

    def value(self) -> bool:
        return is_truthy(os.environ.get(self.name))


ALLOW_DUMMY_PREFILL = Flag(
    'LMDEPLOY_PDFIX_ALLOW_DUMMY_PREFILL', node='Decode',
    help="accept a `migration_request` with `is_dummy_prefill: true` (a benchmark's: the Decode decodes from KV "
         "blocks no Prefill filled, so the text is meaningless and may be read from another request's leftovers; "
         "answers are marked `dummy_prefill`). Off, such a request is refused with 400: LMDeploy's proxy never "
         "sends one")
FLAGS: tuple[Flag, ...] = (ALLOW_DUMMY_PREFILL,)


def is_truthy(value: str | None) -> bool:
    return (value or '').strip().lower() in _TRUE


def enabled() -> bool:
    """Whether the operator switched the fixes on (``LMDEPLOY_PDFIX=1``)."""
    return is_truthy(os.environ.get(TOGGLE))


def disabled_patches() -> frozenset[str]:
    """Patch names the operator opted out of (``LMDEPLOY_PDFIX_DISABLE=name,name``)."""
    raw = os.environ.get(DISABLE, '')
    return frozenset(name.strip() for name in raw.split(',') if name.strip())


def problems() -> list[str]:
    """Every unusable value in the environment, one sentence each."""
    return [problem for setting in NUMBERS if (problem := setting.problem()) is not None]


def problem_for(patch: str) -> str | None:
    """Why ``patch`` must stay stock because a switch it reads is unusable, or None."""
    for setting in NUMBERS:
        problem = setting.problem() if patch in setting.patches else None
        if problem is not None:
            return f'{problem}; fix or unset it'
    return None

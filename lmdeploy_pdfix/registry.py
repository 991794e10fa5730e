"""Every unit, declared once: its name (the switch, and its folder ``lmdeploy_pdfix/units/<name>/``), the LMDeploy
module it targets, a summary, and the units it requires. A unit's ``Patch`` reads its name and target from here.

Standard library only: the start-up hook reads this table to register import hooks without importing
any unit (each is imported only once its target has been imported).
"""

from __future__ import annotations

UNITS_PACKAGE = 'lmdeploy_pdfix.units'


class PatchSpec:
    # a plain class: dataclasses or typing.NamedTuple would cost ~10 ms at every interpreter start-up
    __slots__ = ('module', 'name', 'requires', 'summary', 'target')

    def __init__(self, *, name: str, target: str, summary: str, requires: tuple[str, ...] = ()) -> None:
        self.name = name
        self.module = f'{UNITS_PACKAGE}.{name}'
        self.target = target
        self.summary = summary
        self.requires = requires  # patches that must be applied in the same process before this one may apply

    def __repr__(self) -> str:
        return f'PatchSpec({self.name!r} -> {self.target})'


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        name='serving_cache_owner',
        target='lmdeploy.serve.openai.api_server',
        summary=('Prefill answers name the internal session owning their cache (cache_session_id); a first token '
                 'that stops the request answers 200 and ends its session; only a Prefill honours preserve_cache'),
    ),
    PatchSpec(
        name='decode_migration_checks',
        target='lmdeploy.serve.openai.api_server',
        summary=('A Decode node migrates only a well-formed, linked, confirmed migration_request; a dummy prefill '
                 'is refused unless the deployment allows it'),
    ),
    PatchSpec(
        name='unguessable_session_ids',
        target='lmdeploy.serve.managers.session_manager',
        summary=('Session ids are unguessable and new after every restart: no owner id helps name another, and '
                 'one from before a restart never names a session after it'),
    ),
    PatchSpec(
        name='link_routes',
        target='lmdeploy.serve.openai.api_server',
        summary="A node's link routes and frees reach the engine without blocking the node's event loop",
    ),
    PatchSpec(
        name='replica_registration',
        target='lmdeploy.serve.openai.api_server',
        summary='A node started with --proxy-url naming several proxies (comma-separated) registers with each',
    ),
    PatchSpec(
        name='proxy_distserve',
        target='lmdeploy.serve.proxy.proxy',
        summary='DistServe chat/completions migrate and release by cache_session_id only, on every path',
    ),
    PatchSpec(
        name='proxy_metrics',
        target='lmdeploy.serve.proxy.proxy',
        summary=('The proxy serves Prometheus metrics at /metrics: requests by outcome, phase latencies, retained '
                 'caches, releases'),
        requires=('proxy_distserve',),  # it counts what that unit's relay and ledger see
    ),
    PatchSpec(
        name='proxy_heartbeat',
        target='lmdeploy.serve.proxy.proxy',
        summary='The heartbeat asks every node under a timeout and registers a removed node again once it answers',
    ),
    PatchSpec(
        name='proxy_warmups',
        target='lmdeploy.serve.proxy.proxy',
        summary='Connection warmups that come while one runs share it; callers beyond a bound are answered 503',
    ),
    PatchSpec(
        name='proxy_validation_errors',
        target='lmdeploy.serve.proxy.proxy',
        summary="The proxy refuses a request its models reject with the api_server's 400 naming the field, not a 422",
    ),
    PatchSpec(
        name='proxy_connections',
        target='lmdeploy.pytorch.disagg.conn.proxy_conn',
        summary=('Unshelving an absent session is a no-op, not a KeyError; a connect cannot hang on a lost event; '
                 'one set-up per link, with a bound on who waits'),
    ),
    PatchSpec(
        name='prefill_chunking',
        target='lmdeploy.pytorch.engine.inputs_maker',
        summary='Prefill role advances the long-context chunk position, so long prompts finish',
    ),
    PatchSpec(
        name='engine_sessions',
        target='lmdeploy.pytorch.engine.engine',
        summary='Preserved Prefill caches: cancel-safe, never evicted, released only as themselves, reclaimed by TTL',
    ),
    PatchSpec(
        name='node_cache_routes',
        target='lmdeploy.serve.openai.endpoints.distserve',
        summary=('/distserve/free_cache releases only preserved caches and says what it did; claims and the node '
                 'audit'),
        # they answer from the book of preserved caches, which engine_sessions keeps in the engine process (the
        # same code and switches as here): without it they would answer from nothing
        requires=('engine_sessions',),
    ),
    PatchSpec(
        name='abort_releases',
        target='lmdeploy.serve.core.async_engine',
        summary=('Aborting all sessions (abort_all, sleep) also releases every preserved cache no Decode has '
                 'claimed'),
        requires=('engine_sessions',),  # the release runs in the engine's book of preserved caches
    ),
    PatchSpec(
        name='node_metrics',
        target='lmdeploy.serve.openai.api_server',
        summary="A node's /metrics carries its preserved caches, releases, claims, refused and failed migrations",
        requires=('node_cache_routes',),  # it reads the book those routes read, in the engine process
    ),
    PatchSpec(
        name='migration_faults',
        target='lmdeploy.pytorch.engine.engine_loop',
        summary=('A failing or hanging migration fails its own request; an aborted one frees no block still being '
                 'written and is skipped, its Prefill cache freed'),
    ),
    PatchSpec(
        name='migration_wakeups',
        target='lmdeploy.pytorch.engine.engine_loop',
        summary='The Decode migration loop sleeps until the next migration request, never spinning after an abort',
    ),
    PatchSpec(
        name='decode_first_token',
        target='lmdeploy.pytorch.engine.engine_loop',
        summary=("A Decode node's migrated first token counts as its first sampled token: it ends a request whose "
                 'budget it exhausts, and is named to the grammar of a guided request'),
    ),
    PatchSpec(
        name='guided_first_token',
        target='lmdeploy.pytorch.engine.guided_process',
        summary="The grammar of a migrated guided request accepts the Prefill's first token before the Decode samples",
    ),
    PatchSpec(
        name='engine_connections',
        target='lmdeploy.pytorch.disagg.conn.engine_conn',
        summary='ZMQ frees release only preserved caches; sends cannot block forever; re-linking closes the old link',
        # its frees release only what the book of preserved caches holds: without the book they release nothing
        requires=('engine_sessions',),
    ),
    PatchSpec(
        name='engine_loop_health',
        target='lmdeploy.pytorch.engine.engine',
        summary=('An engine whose loop task ended, or whose loop is stuck in one step, reports itself not alive, so '
                 '/health answers 503'),
    ),
    PatchSpec(
        name='health_polling',
        target='lmdeploy.serve.core.health',
        summary="An api_server asks its engine's health every second, so /health turns 503 within a second or two",
    ),
    PatchSpec(
        name='mooncake_async_migration',
        target='lmdeploy.pytorch.disagg.backend.mooncake',
        summary='With LMDEPLOY_USE_ASYNC_MIGRATION, a Mooncake migration returns once its copy ends instead of hanging',
    ),
    PatchSpec(
        name='engine_start',
        target='lmdeploy.pytorch.engine.mp_engine.zmq_engine',
        summary=("A node's engine process survives its api_server leaving the start-up handshake once the RPC "
                 'port is published'),
    ),
    PatchSpec(
        name='ray_workers_env',
        target='lmdeploy.pytorch.engine.executor.ray_executor',
        summary='Ray workers inherit the lmdeploy-pdfix switches, so the engine patches run there too',
    ),
)

BY_NAME: dict[str, PatchSpec] = {spec.name: spec for spec in PATCHES}

"""The engines' ZMQ links: frees release only preserved caches, a send cannot block forever, re-linking is clean.

Each Prefill/Decode pair has a ZMQ link per side (``EngineP2PConnection``): a PUSH socket the Decode node
sends "free this Prefill session" on after it migrated a cache, and a PULL socket with a receive task on the
Prefill node. Three defects, fixed here:

- ``zmq_send`` on a PUSH socket with no peer (the Prefill node died or never connected) waits forever, and
  with it the Decode node's migration loop. It now gives up after ``LMDEPLOY_PDFIX_ZMQ_SEND_TIMEOUT_S``
  (default 10 s) with :class:`CacheFreeNotSent`. The copy has ended by then, so the ``migration_faults`` patch
  answers the request and frees the Prefill cache over HTTP instead.
- The Prefill node's receive loop ends whatever session a message names (D15: running requests included)
  and logs an error for every unknown id. Each message now goes through :func:`release_preserved`: only a
  preserved cache is released; anything else is counted in the node's book and logged at debug level.
- D14: a second ``p2p_initialize`` for a peer (it restarted and the proxy re-links it) replaced LMDeploy's
  sockets but left the old ones, their context and their receive task running; in 0.17 ``p2p_drop_connect``
  never ran the (async) disconnect at all, and in 0.18 the receive task died on its closed socket with a
  traceback. The old link is now closed first, and a drop closes the link: receive task, sockets, context.
  Neither frees any preserved cache: nothing migrated is known from closing a link.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.preserved import ReleaseCause, Verdict
from lmdeploy_pdfix.patching import (
    Patch,
    coroutine_problem,
    first_problem,
    innermost,
    lmdeploy_logger,
    signature_problem,
    warn,
)
from lmdeploy_pdfix.shared.node_book import CacheFreeNotSent, release_preserved

ZMQ_SEND_TIMEOUT_S = settings.ZMQ_SEND_TIMEOUT_S.value()
_RECEIVE_TASKS = '_lmdeploy_pdfix_receive_tasks'
_LINK_ATTRIBUTES = ('p2p_conn_ctx', 'p2p_sender', 'p2p_receiver')

Send = Callable[[Any, str, int], Awaitable[None]]


# --- the Decode side: a free is sent or fails, within a bound ----------------------------------------------------

def _bounded_send(original: Send) -> Send:
    async def zmq_send(self, remote_engine_id, remote_session_id):
        try:
            await asyncio.wait_for(original(self, remote_engine_id, remote_session_id), ZMQ_SEND_TIMEOUT_S)
        except KeyError:  # LMDeploy's lookup of the link's socket: dropped, even just now, or never made
            raise CacheFreeNotSent(f'no link to Prefill engine {remote_engine_id} (dropped, or never made): '
                                   f'its session {remote_session_id} was not freed') from None
        except asyncio.TimeoutError as exc:  # a cancelled pending send is dropped by pyzmq, never sent late
            raise CacheFreeNotSent(
                f'Prefill engine {remote_engine_id} took no free of its session {remote_session_id} within '
                f'{ZMQ_SEND_TIMEOUT_S:g} s (LMDEPLOY_PDFIX_ZMQ_SEND_TIMEOUT_S): it is down or not linked') from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():  # this task itself is cancelled (the engine stops)
                raise
            # pyzmq cancels a pending send when its socket closes: the link was dropped under it
            raise CacheFreeNotSent(f'the link to Prefill engine {remote_engine_id} was closed while the free of its '
                                   f'session {remote_session_id} was sent') from None

    return zmq_send


# --- the Prefill side: each free releases a preserved cache or nothing ------------------------------------------

def _releasing_only_preserved(free_request: Any, invalid: type[Exception]) -> Callable[[Any], Any]:
    def make(_lmdeploy_loop: Callable[[Any, str], Awaitable[None]]) -> Callable[[Any, str], Awaitable[None]]:
        # replaced whole: LMDeploy's loop ends any session a message names
        async def handle_zmq_recv(self, remote_engine_id):
            receiver = self.p2p_receiver.get(remote_engine_id)
            if receiver is None:  # the link was dropped before this task first ran
                return
            with _sole_receive_task(self, remote_engine_id):
                while True:
                    owner = await _next_free(receiver, remote_engine_id, free_request, invalid)
                    if owner is not None:
                        _release(self.engine, remote_engine_id, owner)

        return handle_zmq_recv

    return make


def _receive_tasks(conn: Any) -> dict[str, asyncio.Task]:
    # LMDeploy keeps no handle on the receive task it starts; closing a link needs one
    return conn.__dict__.setdefault(_RECEIVE_TASKS, {})


@contextlib.contextmanager
def _sole_receive_task(conn: Any, remote_engine_id: str) -> Iterator[None]:
    """Register the running task as the link's receive task, ending one an earlier connect started."""
    tasks = _receive_tasks(conn)
    current = asyncio.current_task()
    previous = tasks.get(remote_engine_id)
    if previous is not None and previous is not current:
        previous.cancel()
    tasks[remote_engine_id] = current
    try:
        yield
    finally:
        if tasks.get(remote_engine_id) is current:
            del tasks[remote_engine_id]


async def _next_free(receiver: Any, remote_engine_id: str, free_request: Any, invalid: type[Exception]) -> int | None:
    """The Prefill session the next message asks to free; None for a malformed message (skipped)."""
    try:
        # JSON, then LMDeploy's schema, as LMDeploy validates it
        return free_request.model_validate(await receiver.recv_json()).remote_session_id
    except (ValueError, invalid) as exc:
        warn(f'invalid free request from {remote_engine_id} skipped: {exc}')
        return None


def _release(engine: Any, remote_engine_id: str, owner: int) -> None:
    try:
        answer = release_preserved(engine, owner, ReleaseCause.DECODE_FREED, by=remote_engine_id)
    except Exception:  # one failed release must not end the link's receive loop
        lmdeploy_logger().exception('lmdeploy-pdfix: releasing session %s for %s failed', owner, remote_engine_id)
        return
    if answer.verdict is not Verdict.RELEASED:  # counted by the book; a peer may legitimately free twice
        lmdeploy_logger().debug('lmdeploy-pdfix: free of session %s from %s released nothing: %s',
                                owner, remote_engine_id, answer.detail)


# --- both sides: one live link per peer -------------------------------------------------------------------------

def _closing_the_old_link_first(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def p2p_initialize(self, init_request):
        _close_link(self, init_request.remote_engine_id)
        return original(self, init_request)

    return p2p_initialize


def _closing_the_link(_lmdeploy_drop: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    # replaced whole: 0.17's never awaits its (async) disconnect, 0.18's leaves the receive task to crash
    def p2p_drop_connect(self, drop_conn_request):
        _close_link(self, drop_conn_request.remote_engine_id)
        return {'success': True}  # LMDeploy's answer

    return p2p_drop_connect


def _close_link(conn: Any, remote_engine_id: str) -> None:
    """Close ``conn``'s link to ``remote_engine_id``, if it has one; the engine's sessions are left alone."""
    task = _receive_tasks(conn).pop(remote_engine_id, None)
    if task is not None:
        task.cancel()  # before its socket closes: a receive pending on a closed socket ends in a pyzmq traceback
    for sockets in (conn.p2p_receiver, conn.p2p_sender):
        socket = sockets.pop(remote_engine_id, None)
        if socket is not None:
            # linger 0: a free still queued for a peer that is gone would keep term() waiting forever; the
            # Prefill cache it named is reclaimed by its node's orphan TTL
            socket.close(linger=0)
    context = conn.p2p_conn_ctx.pop(remote_engine_id, None)
    if context is not None:
        context.term()


def _uses_problem(owner: Any, attribute: str, names: tuple[str, ...]) -> str | None:
    """Why ``owner.attribute`` may no longer touch ``names`` (what the wrappers rely on), or None."""
    target = getattr(owner, attribute)
    used = getattr(getattr(innermost(target), '__code__', None), 'co_names', ())
    missing = [name for name in names if name not in used]
    return f'{owner.__name__}.{attribute} no longer uses {missing}' if missing else None


class EngineConnectionsPatch(Patch):
    wraps = (
        'lmdeploy.pytorch.disagg.conn.engine_conn:EngineP2PConnection.zmq_send',
        'lmdeploy.pytorch.disagg.conn.engine_conn:EngineP2PConnection.handle_zmq_recv',
        'lmdeploy.pytorch.disagg.conn.engine_conn:EngineP2PConnection.p2p_initialize',
        'lmdeploy.pytorch.disagg.conn.engine_conn:EngineP2PConnection.p2p_drop_connect',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        conn = getattr(module, 'EngineP2PConnection', None)
        free_request = getattr(module, 'DistServeCacheFreeRequest', None)
        if conn is None or free_request is None or getattr(module, 'ValidationError', None) is None:
            return 'EngineP2PConnection, DistServeCacheFreeRequest or ValidationError is missing'
        if 'remote_session_id' not in getattr(free_request, 'model_fields', {}):
            return 'DistServeCacheFreeRequest has no remote_session_id'
        return first_problem(
            signature_problem(conn, '__init__', ['self', 'engine']),
            signature_problem(conn, 'p2p_initialize', ['self', 'init_request']),
            signature_problem(conn, 'p2p_connect', ['self', 'conn_request']),
            signature_problem(conn, 'p2p_drop_connect', ['self', 'drop_conn_request']),
            signature_problem(conn, 'zmq_send', ['self', 'remote_engine_id', 'remote_session_id']),
            signature_problem(conn, 'handle_zmq_recv', ['self', 'remote_engine_id']),
            coroutine_problem(conn, 'zmq_send'),
            coroutine_problem(conn, 'handle_zmq_recv'),
            _uses_problem(conn, '__init__', _LINK_ATTRIBUTES),
            _uses_problem(conn, 'p2p_initialize', _LINK_ATTRIBUTES),
            _uses_problem(conn, 'p2p_connect', ('p2p_receiver', 'handle_zmq_recv')),
        )

    def _apply(self, module: ModuleType) -> None:
        conn = module.EngineP2PConnection
        self.wrap(conn, 'zmq_send', _bounded_send)
        self.wrap(conn, 'handle_zmq_recv',
                        _releasing_only_preserved(module.DistServeCacheFreeRequest, module.ValidationError))
        self.wrap(conn, 'p2p_initialize', _closing_the_old_link_first)
        self.wrap(conn, 'p2p_drop_connect', _closing_the_link)


PATCH = EngineConnectionsPatch()

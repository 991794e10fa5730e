"""Node state across LMDeploy's process boundary: the engine process publishes, the api_server serves.

The scheduler lives in the spawned engine process, the FastAPI app in its parent. The engine process writes
a small JSON snapshot (scheduler sessions by status, KV blocks, forward and KV-integrity counters) to the
file named by ``LMDEPLOY_PDFIX_SIM_STATE`` a few times a second; ``GET /distserve/pdfix/sim/state`` on the
api_server returns it with both processes' RSS.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from lmdeploy_pdfix_sim import settings

ROUTE = '/distserve/pdfix/sim/state'
PUBLISH_PERIOD_S = 0.1

_counters: collections.Counter[str] = collections.Counter()
_counters_lock = threading.Lock()


def count(name: str, amount: int = 1) -> None:
    with _counters_lock:
        _counters[name] += amount


def rss_bytes(pid: int) -> int | None:
    """Resident set size from /proc (no psutil needed in the node processes)."""
    try:
        for line in Path(f'/proc/{pid}/status').read_text().splitlines():
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _scheduler_view(engine: Any) -> dict[str, Any]:
    scheduler = engine.scheduler
    by_status: collections.Counter[str] = collections.Counter()
    # The engine loop mutates these while we read: copy first, the caller retries on a race.
    sessions = list(scheduler.sessions.values())
    for session in sessions:
        seqs = list(session.sequences.values())
        if not seqs:
            by_status['EMPTY'] += 1
        for seq in seqs:
            by_status[seq.status.name] += 1
    block_manager = scheduler.block_manager
    return {
        'sessions': len(sessions),
        'sessions_by_status': dict(by_status),
        'free_blocks': block_manager.get_num_free_gpu_blocks(),
        'total_blocks': block_manager.num_gpu_blocks,
    }


def snapshot(engine: Any) -> dict[str, Any]:
    with _counters_lock:
        counters = dict(_counters)
    return {
        'engine_pid': os.getpid(),
        'time': time.time(),
        'role': engine.engine_config.role.name,
        **_scheduler_view(engine),
        'counters': counters,
    }


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(f'.{os.getpid()}.tmp')
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _publish_forever(engine: Any, path: Path) -> None:
    published = None
    while True:
        # A dict changed size under us, or the dir vanished at shutdown: try again next period.
        with contextlib.suppress(RuntimeError, OSError):
            state = snapshot(engine)
            if _without_time(state) != published:  # an idle engine writes nothing (a cluster idles for minutes)
                _write_atomically(path, state)
                published = _without_time(state)
        time.sleep(PUBLISH_PERIOD_S)


def _without_time(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key != 'time'}


def start_publisher(engine: Any) -> None:
    """Called in the engine process once the Engine exists; a no-op without a state path."""
    path = settings.state_file()
    if not path:
        return
    thread = threading.Thread(target=_publish_forever, args=(engine, Path(path)), name='pdfix-sim-state',
                              daemon=True)
    thread.start()


def read_endpoint() -> dict[str, Any]:
    """The api_server route: the engine's latest snapshot plus both processes' RSS."""
    path = settings.state_file()
    data: dict[str, Any] = {}
    if path:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            data = {}
    data['api_server_pid'] = os.getpid()
    data['api_server_rss'] = rss_bytes(os.getpid())
    if 'engine_pid' in data:
        data['engine_rss'] = rss_bytes(data['engine_pid'])
    return data

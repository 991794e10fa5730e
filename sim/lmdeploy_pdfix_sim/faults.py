"""One-shot faults a test arms while traffic runs: a file named after the fault in the node's fault folder.

The engine process takes (deletes) the file when it reaches the faulty step, so each file is one fault:
``slow_prefill`` (its content: seconds) stretches the next Prefill forward, as a long prompt would on a GPU;
``migrate_error`` makes the next KV transfer of a Decode node fail, as a dropped RDMA link would;
``slow_migrate`` (its content: seconds) holds the next KV transfer back before it copies anything, as a
migration waiting in a busy Decode's queue would; ``migration_loop_end`` ends a Decode's migration loop task
(cancelled) the next time it schedules, as an escaped cancellation would.
"""

from __future__ import annotations

from pathlib import Path

from lmdeploy_pdfix_sim import settings

SLOW_PREFILL = 'slow_prefill'
MIGRATE_ERROR = 'migrate_error'
SLOW_MIGRATE = 'slow_migrate'
MIGRATION_LOOP_END = 'migration_loop_end'


class InjectedFault(RuntimeError):
    """A fault a test asked for."""


def arm(folder: Path, fault: str, content: str = '') -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / fault).write_text(content)


def take(fault: str) -> str | None:
    """The armed fault's content (and disarm it), or None if ``fault`` is not armed in this node."""
    folder = settings.faults_folder()
    if not folder:
        return None
    path = Path(folder) / fault
    try:
        content = path.read_text()
        path.unlink()
    except FileNotFoundError:
        return None
    return content

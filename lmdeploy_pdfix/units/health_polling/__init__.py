"""An api_server's ``/health`` learns within a second that its engine stopped (issue 12).

``/health`` answers from the snapshot LMDeploy's ``EngineHealthMonitor`` refreshes every 12 s, so a node whose
engine loop died keeps answering 200 for up to 12 s, and the proxy keeps routing to it. The monitor asks the
engine every ``LMDEPLOY_PDFIX_HEALTH_POLL_S`` (1 s) instead: one light RPC. An operator who set LMDeploy's own
``LMDEPLOY_HEALTH_POLL_INTERVAL`` keeps that. A probe still under way when the next is due is not repeated
(LMDeploy skips it), so a slow engine is not asked more often than it answers.
"""

from __future__ import annotations

import os
from types import ModuleType

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.patching import Patch, signature_problem

POLL_INTERVAL_ENV = 'LMDEPLOY_HEALTH_POLL_INTERVAL'  # LMDeploy's own switch (serve/core/health.py)


def _polling_often(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not os.environ.get(POLL_INTERVAL_ENV, '').strip():
            # after LMDeploy's __init__: it warns of a poll at or below the probe timeout, which is fine here
            self.poll_interval = min(self.poll_interval, settings.HEALTH_POLL_S.value())

    return __init__


class HealthPollingPatch(Patch):
    wraps = (
        'lmdeploy.serve.core.health:EngineHealthMonitor.__init__',
    )

    def shape_problem(self, module: ModuleType) -> str | None:
        monitor = getattr(module, 'EngineHealthMonitor', None)
        if monitor is None or getattr(module, 'HEALTH_POLL_INTERVAL', None) != POLL_INTERVAL_ENV:
            return f'EngineHealthMonitor or its {POLL_INTERVAL_ENV} switch is missing'
        code = getattr(getattr(monitor, '_run', None), '__code__', None)
        if code is None or 'poll_interval' not in code.co_names:
            return 'EngineHealthMonitor._run no longer sleeps poll_interval between probes'
        return signature_problem(monitor, '__init__',
                                 ['self', 'async_engine', 'poll_interval', 'probe_timeout', 'unhealthy_after'])

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module.EngineHealthMonitor, '__init__', _polling_often)


PATCH = HealthPollingPatch()

"""A node registers with every proxy replica named in its ``--proxy-url`` (issue 31, D30).

A large deployment runs several proxies behind a load balancer; LMDeploy's api_server registers with one
``--proxy-url`` only (``register_to_proxy`` posts to ``{proxy_url}/nodes/add``), so a second proxy knows no node.
Here ``--proxy-url http://a:8000,http://b:8000`` registers the node with each of them, one after the other, each
as LMDeploy registers it with one; a replica that is down is logged and skipped (its heartbeat takes the node
once it registers again). Replicas share nothing: each releases what it relays.
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

from lmdeploy_pdfix.domain.protocol import proxy_urls
from lmdeploy_pdfix.patching import Patch, signature_problem


def _registering_with_every_replica(original):
    def register_to_proxy(context: Any) -> Any:
        urls = proxy_urls(getattr(context, 'proxy_url', None))
        if len(urls) < 2:
            return original(context)
        for url in urls:  # a copy per replica: the server's own context keeps what the operator gave
            replica = copy.copy(context)
            replica.proxy_url = url
            original(replica)
        return None

    return register_to_proxy


class ReplicaRegistrationPatch(Patch):
    wraps = ('lmdeploy.serve.openai.api_server:register_to_proxy',)

    def shape_problem(self, module: ModuleType) -> str | None:
        return signature_problem(module, 'register_to_proxy', ['context'])

    def _apply(self, module: ModuleType) -> None:
        self.wrap(module, 'register_to_proxy', _registering_with_every_replica)


PATCH = ReplicaRegistrationPatch()

"""Typed application state of the gateway (``web.AppKey``) and the one mutable :class:`GatewayRuntime`.

Everything that can change while the app runs (the upstream client created at start-up, the
discovery loops, a policy swapped by the admin API, the draining flag, the ``/v1/models`` cache,
the upstream tracer) lives on the runtime, because an aiohttp app's own mapping is frozen once it
starts.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.clock import Clock
from router.config import GatewayConfig
from router.errors import UpstreamConnectError
from router.events import Emitter
from router.gateway.background import BackgroundRuns
from router.gateway.middleware import GatewayMiddleware
from router.gateway.response_stores import StoreSupport
from router.model import ReplicaState
from router.policy.base import Policy
from router.policy.prefill import PrefillLedger
from router.store.base import StateStore

if TYPE_CHECKING:
    from router.discovery import Discovery
    from router.gateway.egress import EgressGuard
    from router.gateway.forward import ReplicaClient, UpstreamTracer
    from router.gateway.residency import ResidencyService

__all__ = ["CONFIG_KEY", "EMITTER_KEY", "MIDDLEWARE_KEY", "RUNTIME_KEY", "STORE_KEY", "GatewayRuntime"]


@dataclass(slots=True)
class GatewayRuntime:
    config: GatewayConfig
    store: StateStore
    policy: Policy  # swap atomically by assignment (admin API)
    clock: Clock
    rng: random.Random
    emit: Emitter
    client: ReplicaClient | None = None  # set by the client cleanup_ctx
    tracer: UpstreamTracer | None = None  # client spans + traceparent on every upstream request (tracing on)
    discovery: Discovery | None = None
    egress: EgressGuard | None = None  # replica URLs outside the allowed networks are refused (None = no check)
    residency: ResidencyService | None = None  # exact residency from KV events (kv_events), once started
    response_stores: StoreSupport = field(default_factory=StoreSupport)  # which keep Responses API responses
    background: BackgroundRuns = field(default_factory=BackgroundRuns)  # leases of background responses still running (background.py)
    draining: bool = False  # shutting down: /ready answers 503
    models_body: dict[str, Any] | None = None
    models_at: float = float("-inf")
    in_flight: int = 0  # requests inside this gateway's handlers (graceful shutdown waits on it)
    # this gateway's requests in flight on each (replica, data-parallel rank) it named: a session
    # cached on no rank goes to the least busy one (handlers._dp_rank)
    rank_flights: Counter[tuple[str, int]] = field(default_factory=Counter)
    # the prefill work this gateway's requests without a first token put ahead on each replica
    # (``ClusterSnapshot.prefill_ahead``, policy rule 8)
    prefill: PrefillLedger = field(default_factory=PrefillLedger)

    async def replica_url(self, replica_id: str, state: ReplicaState | None = None) -> str | None:
        """The registered URL of ``replica_id`` (from ``state`` when the caller has it), ``None`` if
        it is not registered; ``UpstreamConnectError`` for a URL outside the allowed networks."""
        url: str | None = None
        if state is not None:
            url = str(state.url)
        else:
            for r in await self.store.replicas():
                if r.id == replica_id:
                    url = r.url
                    break
        if url is not None and self.egress is not None and not await self.egress.allowed(url):
            # a registry entry outside the allowed networks (router/gateway/egress.py): never sent to
            raise UpstreamConnectError(f"replica {replica_id}: its URL is outside the allowed networks")
        return url


CONFIG_KEY = web.AppKey("kvroute_config", GatewayConfig)
STORE_KEY = web.AppKey("kvroute_store", StateStore)
EMITTER_KEY = web.AppKey("kvroute_emitter", Emitter)
RUNTIME_KEY = web.AppKey("kvroute_runtime", GatewayRuntime)
MIDDLEWARE_KEY = web.AppKey("kvroute_middleware", GatewayMiddleware)  # its observers count every response

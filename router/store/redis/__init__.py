"""Redis state store: many gateways, one truth. Same semantics as ``MemoryCore`` (the reference).

Rules:
  1. Every state change is one Lua script (``lua/*.lua``), so it is atomic and costs one round trip:
     snapshot (1) + acquire (1) + release (1) per request (rule 6: acquire + release). Never
     read-then-write from Python.
  2. Every key carries the hash tag ``{prefix}`` (``router.store.keys``): one slot, so the scripts
     work on a single Redis and on Redis Cluster alike.
  3. Times stored in Redis are *fleet* seconds: the injected clock plus a fixed offset to the epoch
     (``time.time() - clock.now()`` at start, or ``epoch_offset_s``), so gateways on different hosts
     agree, and a ``VirtualClock`` still drives every TTL and window in tests. Gateway leases alone
     use Redis's own ``TIME`` (a dead gateway cannot vouch for itself).
  4. In-flight counts live per gateway under a lease refreshed by a heartbeat task every
     ``lease_ttl_s / 3``; readers only sum live gateways, so a SIGKILLed gateway's load vanishes once
     its lease expires, and the next heartbeat of any gateway deletes it.
  5. Redis failures never reach the caller (``map_redis_errors`` is the one boundary). On an error or
     a timeout the store turns *degraded*: it serves from a local ``MemoryCore`` mirror, probes Redis
     with backoff, and on return restores its in-flight counts exactly, replays registry writes and
     republishes the bindings it made meanwhile with compare-and-set.
  6. Fast path (``replica_refresh_s > 0``: the gateway's default via ``make_redis_store``, off in the
     constructor): 2 round trips per request of a session this gateway has seen (acquire + release),
     3 for a session new to it; a decision made on a session another gateway moved meanwhile raises
     ``StaleSessionError`` and is routed again.

Modules, one rule each: ``_wire`` (scripts, the error boundary, fleet time, rows; rules 1-3),
``_leases`` (this gateway's exact in-flight; rule 4), ``_fallback`` (degraded mode and its mirror;
rule 5), ``_fastpath`` (rule 6), ``_registry`` (registry writes), ``_store`` (``RedisStore``: the hot
path, the heartbeat and resync that tie them together).
"""

from __future__ import annotations

from router.store.redis._store import (
    GATEWAY_REPLICA_REFRESH_S,
    REFRESH_ENV,
    RedisStore,
    gateway_refresh_s,
    make_redis_store,
)
from router.store.redis._wire import map_redis_errors

__all__ = [
    "GATEWAY_REPLICA_REFRESH_S",
    "REFRESH_ENV",
    "RedisStore",
    "gateway_refresh_s",
    "make_redis_store",
    "map_redis_errors",
]

"""``make_store(config, clock)``: the embedded ``MemoryStore``, or ``RedisStore`` when the config names
a Redis URL (``kvroute serve --redis redis://...``). The Redis module is imported only then."""

from __future__ import annotations

from typing import Any

from router.clock import Clock
from router.store.base import StateStore, StoreConfig
from router.store.memory import MemoryStore

__all__ = ["make_store"]


def make_store(config: Any, clock: Clock) -> StateStore:
    """``config``: any object with optional ``redis_url``, ``gateway_id`` and ``store`` (whose
    ``to_store_config()`` gives a ``StoreConfig``), e.g. ``router.config.GatewayConfig``."""
    if getattr(config, "redis_url", None):
        from router.store.redis import make_redis_store

        return make_redis_store(config, clock)
    settings = getattr(config, "store", None)
    return MemoryStore(clock, settings.to_store_config() if settings is not None else StoreConfig())

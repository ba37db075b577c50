"""The Redis store's wire: its Lua scripts, the one error boundary, fleet time, and row codecs.

Rules:
  1. Every call to Redis is one Lua script (``RedisWire.eval``): atomic, one round trip, bounded by
     ``op_timeout_s``, counted in ``round_trips_total``.
  2. :func:`map_redis_errors` is the only place where redis-py's exceptions (and the op timeout)
     become ``router.errors.StoreError``.
  3. Times in Redis are fleet seconds: the injected clock plus a fixed offset to the epoch
     (``fleet`` / ``local`` convert; 0 stays 0, "never").
  4. A row is parsed into frozen values; identical spec and engine JSON is parsed once (bounded caches).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, fields
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from router.clock import Clock
from router.errors import StoreError
from router.model import EngineLoad, ReplicaSpec, ReplicaState, ReplicaStatus, SessionState, capacities
from router.store.base import PLAUSIBLE_EVICTION
from router.store.keys import KeySpace

__all__ = ["RedisWire", "map_redis_errors", "spec_json"]

_SCRIPTS = ("acquire", "release", "snapshot", "sessions", "registry", "lease", "republish", "config")
_PARSE_CACHE_MAX = 10_000
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineLoad))
_SPEC_FIELDS = frozenset(f.name for f in fields(ReplicaSpec))


def _load_scripts() -> dict[str, str]:
    lua = resources.files("router.store").joinpath("lua")
    # constants shared with the memory store are defined once, in Python
    consts = f"local PLAUSIBLE_EVICTION = {PLAUSIBLE_EVICTION!r}\n"
    prelude = consts + lua.joinpath("_lib.lua").read_text()
    return {name: prelude + "\n" + lua.joinpath(f"{name}.lua").read_text() for name in _SCRIPTS}


@contextlib.asynccontextmanager
async def map_redis_errors(op: str) -> AsyncIterator[None]:
    """The one boundary where redis-py's (and the timeout's) exceptions become ``StoreError``."""
    try:
        yield
    except (rexc.RedisError, OSError, TimeoutError) as exc:
        raise StoreError(f"redis {op}: {type(exc).__name__}: {exc}") from exc


def spec_json(spec: ReplicaSpec) -> str:
    return json.dumps(asdict(spec), separators=(",", ":"), sort_keys=True)


def _f(x: float) -> str:
    return repr(float(x))


class RedisWire:
    """Scripts, time conversion and row parsing for one store (rules 1-4)."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        keys: KeySpace,
        clock: Clock,
        *,
        epoch_offset_s: float | None,
        op_timeout_s: float,
    ) -> None:
        self.client = client
        self.keys = keys
        self.clock = clock
        self.offset = time.time() - clock.now() if epoch_offset_s is None else epoch_offset_s
        self.op_timeout_s = op_timeout_s
        self.round_trips_total = 0
        self._scripts = {name: client.register_script(src) for name, src in _load_scripts().items()}
        # parsed specs by raw JSON and by replica id (the id entry: the last spec seen or written)
        self.specs: dict[str, ReplicaSpec] = {}
        self._engines: dict[str, EngineLoad] = {}

    # ---- time (rule 3) ------------------------------------------------------------------------------

    def fleet(self, t_local: float) -> str:
        return _f(t_local + self.offset)

    def now(self) -> str:
        return self.fleet(self.clock.now())

    def local(self, t_fleet: str | float) -> float:
        v = float(t_fleet)
        return 0.0 if v == 0.0 else v - self.offset

    # ---- calls (rules 1-2) --------------------------------------------------------------------------

    async def eval(self, name: str, args: list[str | int | float], op: str | None = None) -> Any:
        self.round_trips_total += 1
        async with map_redis_errors(op or name):
            async with asyncio.timeout(self.op_timeout_s):
                return await self._scripts[name](keys=[self.keys.seq], args=[self.keys.base, *args])

    async def command(self, op: str, *args: str | int) -> Any:
        """One plain command (no script): for keys that no script reads."""
        self.round_trips_total += 1
        async with map_redis_errors(op):
            async with asyncio.timeout(self.op_timeout_s):
                return await self.client.execute_command(*args)

    # ---- rows (rule 4) ------------------------------------------------------------------------------

    def spec_of(self, replica_id: str, url: str, model: str) -> ReplicaSpec:
        """The last spec seen for a replica, or a minimal one."""
        return self.specs.get(replica_id) or ReplicaSpec(id=replica_id, url=url, model=model)

    def _spec(self, rid: str, raw: str) -> ReplicaSpec:
        spec = self.specs.get(raw)
        if spec is None:
            # a field this version does not know (a newer gateway or sidecar wrote it) is left out
            spec = ReplicaSpec(**{k: v for k, v in json.loads(raw).items() if k in _SPEC_FIELDS})
            if len(self.specs) > _PARSE_CACHE_MAX:
                self.specs.clear()
            self.specs[raw] = spec
            self.specs[rid] = spec
        return spec

    def _engine(self, raw: str) -> EngineLoad:
        if not raw:
            return EngineLoad()
        eng = self._engines.get(raw)
        if eng is None:
            d = json.loads(raw)
            d["updated_at"] = self.local(d.get("updated_at", 0.0))
            # a figure this version does not know (a newer gateway or sidecar wrote it) is left out
            eng = EngineLoad(**{k: v for k, v in d.items() if k in _ENGINE_FIELDS})
            if len(self._engines) > _PARSE_CACHE_MAX:
                self._engines.clear()
            self._engines[raw] = eng
        return eng

    def engine_json(self, load: EngineLoad) -> str:
        d = asdict(load)
        d["updated_at"] = float(self.fleet(load.updated_at)) if load.updated_at else 0.0
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    def replica_state(self, row: list[Any]) -> ReplicaState:
        rid, spec_raw, status, joined, engine_raw, tw, actctx, nact, nplc, inflight, horizon = row
        spec = self._spec(rid, spec_raw)
        engine = self._engine(engine_raw)
        cap, host = capacities(spec, engine)
        return ReplicaState(
            id=rid,
            url=spec.url,
            status=ReplicaStatus(status),
            joined_at=self.local(joined),
            in_flight=int(inflight),
            engine=engine,
            capacity_tokens=cap,
            host_capacity_tokens=host,
            sessions_active=int(nact),
            active_context_tokens=int(actctx),
            tokens_written=int(tw),
            placed_recent=int(nplc),
            model=spec.model,
            residency_horizon_tokens=int(horizon),
            dp_rank=spec.dp_rank,
        )

    def session_state(self, row: list[Any]) -> SessionState:
        sid, home, ovf, ctx, seen, mark, turns, pl, bpt, ch = row
        per = sorted((str(pl[i]), int(pl[i + 1])) for i in range(0, len(pl), 2))
        return SessionState(
            session_id=sid,
            home=home or None,
            overflow=tuple(ovf.split(",")) if ovf else (),
            in_flight=tuple(per),
            context_tokens=int(ctx),
            last_seen=self.local(seen),
            residency_mark=int(mark),
            turns=int(turns),
            bytes_per_token=float(bpt),
            chains=tuple((k, r) for k, _, r in (kv.partition("=") for kv in ch.split(","))) if ch else (),
        )

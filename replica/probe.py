"""Async probes of the local engine (SGLang or the emulator) plus the pure spec builder.

Rules:
  1. One ``aiohttp.ClientSession`` is passed in; every call has a timeout.
  2. aiohttp/OS errors are mapped here, at one boundary, to :class:`EngineProbeError`.
  3. ``/metrics`` and ``/v1/loads`` are parsed, and read when, as the gateway's discovery does
     (``router.engine_metrics``): one reading of an engine's load for the whole project.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.engine_metrics import (
    LoadReadings,
    MetricsParseError,
    load_from_v1_loads,
    parse_engine_metrics,
    v1_loads_query,
)
from router.errors import KvrouteError
from router.model import EngineLoad, ReplicaSpec

__all__ = ["EngineInfo", "EngineProbe", "EngineProbeError", "build_spec", "engine_info_from"]


class EngineProbeError(KvrouteError):
    """The engine did not answer (in time, or sensibly)."""


@asynccontextmanager
async def _map_errors(what: str) -> AsyncIterator[None]:
    try:
        yield
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise EngineProbeError(f"{what}: {type(exc).__name__}: {exc}") from exc
    except (MetricsParseError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineProbeError(f"{what}: unreadable answer: {exc}") from exc


class EngineProbe:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        health_path: str = "/health",
        dp_rank: int | None = None,
    ) -> None:
        self._dp_rank = dp_rank  # the engine's rank this replica is: its load alone
        self._session = session
        self._base = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._health_path = health_path
        self._readings = LoadReadings()

    async def healthy(self) -> bool:
        """``GET /health`` answered 200 (anything else, or no answer, is unhealthy)."""
        return await self.health() == "ok"

    async def health(self) -> str:
        """``GET /health``: ``"ok"`` (200), ``"failed"`` (another status, or the connection was
        refused/reset) or ``"timeout"`` (no answer in time). SGLang's ``/health`` runs a one-token
        request through the scheduler, so a busy engine answers it late: a timeout alone is not
        proof of death (``Agent._check_health``)."""
        try:
            async with self._session.get(self._base + self._health_path, timeout=self._timeout) as r:
                await r.read()
                return "ok" if r.status == 200 else "failed"
        except TimeoutError:
            return "timeout"
        except (aiohttp.ClientError, OSError):
            return "failed"

    async def _json(self, path: str) -> dict[str, Any]:
        async with _map_errors(path), self._session.get(self._base + path, timeout=self._timeout) as r:
            if r.status != 200:
                raise EngineProbeError(f"{path}: HTTP {r.status}")
            doc = json.loads(await r.read())
        if not isinstance(doc, dict):
            raise EngineProbeError(f"{path}: expected a JSON object")
        return doc

    async def server_info(self) -> dict[str, Any]:
        return await self._json("/server_info")

    async def model_info(self) -> dict[str, Any]:
        return await self._json("/model_info")

    async def load(self, now: float) -> EngineLoad:
        """The engine's load, read as the gateway's discovery reads it (``LoadReadings``):
        ``/v1/loads`` every time, ``/metrics`` now and then for the host tier, and every time
        ``/v1/loads`` gives nothing (an older engine). Raises when neither answers."""
        loads = await self._loads(now)
        if loads is not None and not self._readings.metrics_due(loads):
            return loads
        try:
            metrics: EngineLoad | None = await self._metrics(now)
        except EngineProbeError:
            if loads is None:
                raise
            metrics = None
        load = self._readings.combine(loads, metrics)
        assert load is not None  # one of the two answered
        return load

    async def _metrics(self, now: float) -> EngineLoad:
        async with _map_errors("metrics"):
            async with self._session.get(
                self._base + "/metrics", headers={"Accept": "text/plain"}, timeout=self._timeout
            ) as r:
                if r.status != 200:
                    raise EngineProbeError(f"/metrics: HTTP {r.status} (is --enable-metrics on?)")
                text = (await r.read()).decode("utf-8")
            return parse_engine_metrics(text, now=now, dp_rank=self._dp_rank)

    async def _loads(self, now: float) -> EngineLoad | None:
        """The load from ``/v1/loads``; ``None`` when the engine lacks the route or does not answer it
        sensibly."""
        try:
            async with self._session.get(self._base + "/v1/loads" + v1_loads_query(self._dp_rank), timeout=self._timeout) as r:
                if r.status != 200:
                    return None
                doc = json.loads(await r.read())
                return load_from_v1_loads(doc, now=now, host=self._readings.host, dp_rank=self._dp_rank)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, MetricsParseError):
            return None


# ---- pure ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine says about itself at start-up (from /server_info and /model_info)."""

    model: str
    capacity_tokens: int
    tp_size: int
    hicache: bool
    hicache_ratio: float
    hicache_size_gb: float


def _num(doc: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return default
    return float(v)


def engine_info_from(
    server_info: Mapping[str, Any], model_info: Mapping[str, Any] | None = None
) -> EngineInfo:
    """Read capacity, TP and HiCache settings from SGLang's ``/server_info``.

    ``max_total_num_tokens`` is top level in 0.5.x; older servers put it only in
    ``internal_states[*]`` (one per DP rank, summed here).
    """
    capacity = _num(server_info, "max_total_num_tokens")
    states = server_info.get("internal_states")
    if capacity <= 0 and isinstance(states, list):
        capacity = sum(_num(s, "max_total_num_tokens") for s in states if isinstance(s, Mapping))
    model = ""
    for doc, key in (
        (model_info or {}, "served_model_name"),
        (server_info, "served_model_name"),
        (model_info or {}, "model_path"),
        (server_info, "model_path"),
    ):
        v = doc.get(key)
        if isinstance(v, str) and v:
            model = v
            break
    ratio = _num(server_info, "hicache_ratio")
    return EngineInfo(
        model=model,
        capacity_tokens=max(0, int(capacity)),
        tp_size=max(0, int(_num(server_info, "tp_size"))),
        hicache=bool(server_info.get("enable_hierarchical_cache")),
        hicache_ratio=ratio if ratio > 0 else 2.0,
        hicache_size_gb=_num(server_info, "hicache_size"),
    )


def build_spec(
    *,
    replica_id: str,
    url: str,
    info: EngineInfo,
    load: EngineLoad | None,
    model_override: str = "",
    capacity_override: int = 0,
    host_capacity_override: int = 0,
    source: str = "registry",
    dp_rank: int | None = None,
) -> ReplicaSpec:
    """The registry entry. Capacity: override > engine metrics > /server_info.

    The host tier comes from ``sglang:hicache_host_total_tokens`` when scraped; otherwise, with
    HiCache on, it is estimated as ``hicache_ratio`` x HBM capacity (SGLang's sizing rule when
    ``--hicache-size`` is 0).
    """
    capacity = capacity_override or (load.capacity_tokens if load and load.capacity_tokens else 0)
    capacity = capacity or info.capacity_tokens
    host = host_capacity_override or (load.host_capacity_tokens if load else 0)
    if not host and info.hicache and capacity and info.hicache_size_gb <= 0:
        host = int(capacity * info.hicache_ratio)
    return ReplicaSpec(
        id=replica_id,
        url=url,
        model=model_override or info.model,
        capacity_tokens=capacity,
        host_capacity_tokens=host,
        tp_size=info.tp_size,
        source=source,
        dp_rank=dp_rank,
    )

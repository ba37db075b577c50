"""The no-contention ceiling of a closed-loop workload.

``ceiling_config`` turns a simulation into the same sessions on a fleet where nothing queues and
nothing is evicted: ``CEILING_REPLICAS_PER_LANE`` replicas per lane (a session's parent and its
sub-agents each find an idle replica) with ``CEILING_MEMORY_FACTOR`` times the profile's HBM each,
one gateway, no scale events or failures. Its completed requests are the closed loop's own limit:
what the sessions' think times and each request's own prefill and decode allow, whatever the router
and however many replicas (twice that fleet completes the same within 1 %,
tests/loadtests/test_parity_bench.py). A router's requests are judged against it
(``requests_of_ceiling``) as dispersion is against its floor and CHR against the pooled cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from loadtests.sim.run import SimConfig, run_sim
from loadtests.workloads import SessionSpec

__all__ = ["CEILING_MEMORY_FACTOR", "CEILING_REPLICAS_PER_LANE", "ceiling_config", "run_ceiling", "with_ceiling"]

CEILING_REPLICAS_PER_LANE = 3
CEILING_MEMORY_FACTOR = 20  # ~17 M tokens a replica: more than all of its sessions' contexts


def ceiling_config(cfg: SimConfig) -> SimConfig:
    """``cfg`` on a fleet without contention (module docstring). Closed loops only: with open
    arrivals (``lanes`` 0) every arrival is a request whatever the fleet."""
    if cfg.lanes <= 0:
        raise ValueError("the ceiling is a closed loop's: lanes must be > 0")
    profile = cfg.profile.with_overrides(kv_capacity_tokens=cfg.profile.kv_capacity_tokens * CEILING_MEMORY_FACTOR)
    return replace(cfg, replicas=cfg.lanes * CEILING_REPLICAS_PER_LANE, profile=profile, gateways=1,
                   state_lag_s=0.0, scale=(), failures=(), policy="kv_aware")


def run_ceiling(specs: Sequence[SessionSpec], cfg: SimConfig) -> dict[str, Any]:
    """The ceiling of ``cfg``'s workload: ``requests_ceiling``, ``ttft_p99_ceiling_s``,
    ``e2e_p99_ceiling_s`` and ``ceiling_queue_share`` (its engines' queue share of TTFT: ~0 when the
    fleet is big enough to be a ceiling)."""
    m = run_sim(specs, ceiling_config(cfg)).measures
    return {
        "requests_ceiling": m["requests"],
        "ttft_p99_ceiling_s": m["ttft_p99_s"],
        "e2e_p99_ceiling_s": m["e2e_p99_s"],
        "ceiling_queue_share": m["engine_queue_share"],
    }


def with_ceiling(measures: Mapping[str, Any], ceil: Mapping[str, Any] | None) -> dict[str, Any]:
    """``measures`` plus the ceiling and ``requests_of_ceiling`` (requests / the ceiling's)."""
    if ceil is None:
        return dict(measures)
    out = {**measures, **ceil}
    if measures.get("requests") is not None and ceil["requests_ceiling"]:
        out["requests_of_ceiling"] = measures["requests"] / ceil["requests_ceiling"]
    return out

"""``kvroute bench redis`` runs and reports what it promises (short store-level run; no timing asserts):
3 round trips per request on the default path, 2 (+ background refresh) on the fast path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_redis_store_level_reports_round_trips_and_ratios(redis_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router", "bench", "redis", "--redis", redis_url, "--level", "store",
         "--duration", "0.3", "--concurrency", "1", "4", "--replicas", "3", "--table-inflight", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    doc = json.loads(out.stdout)
    store = doc["store"]
    assert set(store["cases"]) == {"c1", "c4"}
    for case in store["cases"].values():
        redis = case["redis"]
        assert redis["requests"] > 0 and redis["degraded_total"] == 0
        # snapshot + acquire + release; a heartbeat may add a few over the whole run
        assert 3.0 <= redis["round_trips_per_request"] < 3.2
        assert redis["commands_in_scripts_per_request"] > 10
        assert case["latency_ratio_p50"] > 0 and case["memory"]["requests"] > 0
    assert 3.0 <= store["round_trips_per_request"] < 3.2
    for name, case in store["cases"].items():
        c = int(name[1:])
        fast = case["redis_fast"]
        n = fast["requests"]
        assert n > 0 and fast["degraded_total"] == 0 and fast["stale_total"] == 0
        assert fast["refresh_round_trips"] >= 1  # the table was read at least once
        # acquire + release per request; one session read per session new to the gateway (each worker
        # cycles through 4); the lease heartbeat/publish adds at most a couple
        hot = fast["round_trips"] - fast["refresh_round_trips"]
        assert 2 * n <= hot <= 2 * n + 4 * c + 3, fast
        assert fast["session_cache_misses"] <= 4 * c
        assert case["fast_latency_ratio_p50"] > 0
    table = store["table_refresh"]  # what reading the replica table costs Redis (docs/REDIS.md)
    assert table["replicas"] == 3 and table["inflight_held"] == 20 and table["redis_ms_per_whole_read"] > 0 and table["gateway_ms_per_whole_read"] > 0
    assert table["refreshes_per_s"] > 5 and table["partial_refreshes"] == 0  # 3 replicas: read whole
    assert 0 < table["redis_share_per_idle_gateway"] < 1 and table["gateways_to_half_a_redis"] > 0

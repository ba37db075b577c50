"""The connection soak (``loadtests/soak.py``) at a reduced, bounded size with real processes.

The full size (10,000 idle connections + 1,000 active streams) is a benchmark command, not a test:
``python -m loadtests.soak`` (numbers in docs/RELIABILITY.md).
"""

from __future__ import annotations

import pytest

from loadtests.soak import run_soak

pytestmark = pytest.mark.slow


async def test_idle_connections_active_streams_slow_reader_and_pool_bound() -> None:
    out = await run_soak(idle=600, idle_streams=200, active=60, duration_s=2.0, pool_limit=16, pool_burst=80)
    assert out["idle_open"] == {"held": 600, "failed": 0, "open_s": out["idle_open"]["open_s"]}
    act = out["active_phase"]
    assert act["errors"] == 0 and act["completed"] >= 60 and act["idle_still_open"] == 600
    # memory per connection is measured and small (aiohttp keeps a few buffers per connection)
    assert 0 < out["kb_per_connection_all_idle"] < 200
    # a client that reads nothing of a 30 MB stream neither stalls the others nor grows the gateway
    slow = out["slow_reader"]
    assert slow["with"]["errors"] == 0 and slow["with"]["completed"] > 0
    assert slow["gateway_rss_growth_kb"] < 10 * 1024, slow
    assert slow["with"]["e2e_p99_ms"] < 10 * max(slow["without"]["e2e_p99_ms"], 100.0), slow
    pool = out["pool"]
    assert pool["completed"] == 80 and pool["errors"] == 0
    assert 0 < pool["peak_upstream_connections"] <= 16, pool
    assert out["ok"]

"""``bench_hotpath --cpu-clients``: both upstream clients proxy real requests (``kvroute serve`` and an
emulated replica in subprocesses) and the CPU comparison is reported per cell."""

from __future__ import annotations

import pytest

from loadtests.bench_hotpath import run_cpu_clients


@pytest.mark.slow
async def test_cpu_clients_runs_both_clients() -> None:
    doc = await run_cpu_clients(requests=20, concurrencies=(1,))
    assert set(doc["clients"]) == {"raw", "aiohttp"}
    for cells in doc["clients"].values():
        assert set(cells) == {"c1_json", "c1_stream"}
        assert all(c["errors"] == 0 and c["requests"] == 40 for c in cells.values())
        assert all(c["gateway_cpu_us_per_request"] >= 0 for c in cells.values())
    assert set(doc["cpu_aiohttp_over_raw"]) == {"c1_json", "c1_stream"}

"""``kvroute bench`` dispatch and a tiny ``bench overhead`` run (real subprocesses and sockets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.peers import find_binary
from tests.ci import missing

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def test_bench_usage_and_unknown() -> None:
    ok = subprocess.run([KVROUTE, "bench", "--help"], check=False, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "overhead" in ok.stdout and "peers" in ok.stdout
    bad = subprocess.run([KVROUTE, "bench", "nope"], check=False, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


@pytest.mark.slow
def test_tiny_overhead_run(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [KVROUTE, "bench", "overhead", "--duration", "0.4", "--concurrency", "1", "--concurrency", "4",
         "--targets", "kvroute,python-floor", "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "overhead"
    floor = "python floor (no routing)"
    assert set(doc["cells"]) == {"direct", "kvroute kv_aware", floor}
    keys = {"c1_json", "c1_stream", "c1_stream_fresh", "c4_json", "c4_stream", "c4_stream_fresh"}
    for name in ("direct", "kvroute kv_aware", floor):
        assert set(doc["cells"][name]) == keys
        for cell in doc["cells"][name].values():
            assert cell["requests"] > 0 and cell["errors"] == 0
            assert 0 < cell["p50_ms"] <= cell["p99_ms"]
    added = doc["added"]["kvroute kv_aware"]["c1_json"]
    assert set(added) >= {"added_p50_ms", "added_p99_ms", "throughput_ratio_vs_direct"}
    assert 0 < added["throughput_ratio_vs_direct"] < 5
    assert isinstance(added["added_over_python_floor_p50_ms"], float)
    assert "added_over_python_floor_p50_ms" not in doc["added"][floor]["c1_json"]


def test_peers_bench_refuses_the_floor_proxy() -> None:
    bad = subprocess.run(
        [KVROUTE, "bench", "peers", "--targets", "kvroute,python-floor"],
        check=False, capture_output=True, text=True, timeout=30,
    )
    assert bad.returncode == 2 and "unknown targets ['python-floor']" in bad.stderr


@pytest.mark.slow
@pytest.mark.peers
def test_tiny_peers_run(tmp_path: Path) -> None:
    if find_binary("smg") is None:
        missing("smg (sglang-router) not installed: pip install 'kvroute[peers]'")
    proc = subprocess.run(
        [KVROUTE, "bench", "peers", "--targets", "kvroute,sglang-manual", "--replicas", "2", "--duration", "3",
         "--sessions", "6", "--time-scale", "0.05", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "peers.json").read_text())
    assert set(doc["results"]) == {"kvroute kv_aware", "sglang-router manual"}
    for m in doc["results"].values():
        assert m["requests"] > 5 and m["errors"] == 0 and m["chr"] > 0
    assert (tmp_path / "peers_load.png").exists() and (tmp_path / "peers_ttft_cdf.png").exists()

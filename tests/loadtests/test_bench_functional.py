"""``kvroute bench`` dispatch and a tiny ``bench overhead`` run (real subprocesses and sockets)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench_peers import requests_path
from loadtests.peers import find_binary
from tests.ci import missing
from tests.proctree import children, sigterm_when

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def test_bench_usage_and_unknown() -> None:
    ok = subprocess.run([KVROUTE, "bench", "--help"], check=False, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "overhead" in ok.stdout and "peers" in ok.stdout
    bad = subprocess.run([KVROUTE, "bench", "nope"], check=False, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


def _bench_json(tmp_path: Path, args: list[str], timeout: float) -> tuple[dict[str, Any], str]:
    """Run ``kvroute bench ARGS --json F`` to success; its document and its stderr."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [KVROUTE, "bench", *args, "--json", str(out)], check=False, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


@pytest.mark.slow
def test_tiny_overhead_run(tmp_path: Path) -> None:
    doc, _ = _bench_json(
        tmp_path,
        ["overhead", "--duration", "0.4", "--concurrency", "1", "--concurrency", "4",
         "--targets", "kvroute,python-floor", "--fleet", "2"],
        120,
    )
    assert doc["bench"] == "overhead" and doc["fleet"] == 2
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


@pytest.mark.slow
def test_overhead_rounds_rotate_and_take_medians(tmp_path: Path) -> None:
    """``--rounds 2``: every round measures direct and each target afresh, targets rotated; the
    document's figures are medians of each round's own added figures, and the paired counts say
    on how many rounds one kvroute target added less than another."""
    doc, stderr = _bench_json(
        tmp_path,
        ["overhead", "--duration", "0.3", "--concurrency", "1", "--rounds", "2",
         "--targets", "kvroute,kvroute-hash,python-floor"],
        180,
    )
    assert doc["rounds"] == 2 and len(doc["per_round"]) == 2
    kv, kh, floor = "kvroute kv_aware", "kvroute hash", "python floor (no routing)"
    assert list(doc["per_round"][0]["cells"]) == ["direct", kv, kh, floor]
    assert list(doc["per_round"][1]["cells"]) == ["direct", kh, floor, kv]  # rotated by one
    for key in ("c1_json", "c1_stream", "c1_stream_fresh"):
        per = [rd["added"][kv][key]["added_p50_ms"] for rd in doc["per_round"]]
        entry = doc["added"][kv][key]
        assert entry["added_p50_ms"] == pytest.approx(sum(per) / 2)  # the median of two
        assert entry["added_p50_ms_min"] == min(per) and entry["added_p50_ms_max"] == max(per)
        cell = doc["cells"][kv][key]
        assert cell["rounds"] == 2 and cell["errors"] == 0
        assert cell["requests"] == sum(rd["cells"][kv][key]["requests"] for rd in doc["per_round"])
        theirs = [rd["added"][kh][key]["added_p50_ms"] for rd in doc["per_round"]]
        assert doc["paired"][kv][kh][key] == sum(a < b for a, b in zip(per, theirs, strict=True))
    assert set(doc["paired"]) == {kv, kh} and floor not in doc["paired"][kv]
    assert "medians of 2 rounds" in stderr and "rounds where kvroute kv_aware added less" in stderr
    bad = subprocess.run([KVROUTE, "bench", "overhead", "--rounds", "0"], check=False, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "--rounds: at least 1" in bad.stderr


@pytest.mark.slow
def test_tiny_probes_run(tmp_path: Path) -> None:
    doc, _ = _bench_json(
        tmp_path, ["probes", "--replicas", "3", "--spreads", "0,0.8", "--repeat", "1", "--duration", "0.5"], 120
    )
    assert doc["bench"] == "probes" and doc["replicas"] == 3
    assert [r["spread"] for r in doc["runs"]] == [0.0, 0.8]
    for run in doc["runs"]:
        assert run["requests"] > 0 and run["errors"] == 0
        assert 0 < run["p50_ms"] <= run["p99_ms"] <= run["p999_ms"] <= run["max_ms"]
    bad = subprocess.run([KVROUTE, "bench", "probes", "--spreads", "0,2"], check=False, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "--spreads within [0, 0.95]" in bad.stderr


def test_tiny_idle_cpu_probes_run(tmp_path: Path) -> None:
    # two gateways on one Redis read each replica's load and health-check it about once per interval
    # (1 s) between them, not once each (discovery rules 6 and 7), /metrics only every tenth round
    # (rule 4), and each one's CPU is measured
    doc, _ = _bench_json(tmp_path, ["probes", "--idle-cpu", "--replicas", "10", "--gateways", "2",
                                    "--duration", "4", "--warmup", "2"], 180)  # fmt: skip
    assert doc["bench"] == "probes-idle-cpu" and doc["replicas"] == 10
    (run,) = doc["runs"]
    assert run["gateways"] == 2 and len(run["cpu_per_s"]) == 2 and all(c > 0 for c in run["cpu_per_s"])
    assert 0.5 <= run["loads_per_replica_per_s"] <= 1.4, run
    assert run["scrapes_per_replica_per_s"] <= 0.4, run
    assert 0.5 <= run["health_checks_per_replica_per_s"] <= 1.4, run


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
    # every request as the client saw it, one JSON line each (the measured ones come after warm-up)
    for name, m in doc["results"].items():
        lines = requests_path(tmp_path, name).read_text().splitlines()
        rows = [json.loads(x) for x in lines]
        assert len(rows) >= m["requests"] and all(r["ok"] and r["replica"] and r["session_id"] for r in rows)


@pytest.mark.slow
def test_tiny_peers_run_on_emulated_data_parallel_engines(tmp_path: Path) -> None:
    """``--engine-dp 2`` on the emulated fleet: each emulator runs two ranks, each publishing its own
    KV events; kvroute places over the four ranks as replicas (``--replica-dp-ranks 2``), the old
    mode over the two engines (what each is started as: test_kv_events_real_sglang.py)."""
    proc = subprocess.run(
        [KVROUTE, "bench", "peers", "--targets", "kvroute,kvroute-engines", "--engine-dp", "2", "--kv-events",
         "--replicas", "2", "--duration", "3", "--sessions", "6", "--time-scale", "0.05", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "peers.json").read_text())
    assert doc["fleet"] == {"kind": "emulated", "profile": doc["scenario"]["profile"], "dp_size": 2}
    assert doc["scenario"]["dp_size"] == 2
    assert set(doc["results"]) == {"kvroute kv_aware", "kvroute kv_aware (engines as replicas)"}
    for name, m in doc["results"].items():
        assert m["requests"] > 5 and m["errors"] == 0 and m["chr"] > 0, name
        rows = [json.loads(x) for x in requests_path(tmp_path, name).read_text().splitlines()]
        assert {r["replica"] for r in rows} == {"replica-0", "replica-1"}  # the emulators that answered


def test_summarise_seeds_pairs_by_seed() -> None:
    from loadtests.bench_peers import summarise_seeds

    per_seed = {
        7: {"kvroute kv_aware": {"chr": 0.90, "ttft_p99_s": 10.0}, "vllm": {"chr": 0.92, "ttft_p99_s": 12.0}},
        8: {"kvroute kv_aware": {"chr": 0.95, "ttft_p99_s": 14.0}, "vllm": {"chr": 0.91, "ttft_p99_s": 13.0}},
        9: {"kvroute kv_aware": {"chr": 0.93, "ttft_p99_s": 9.0}},  # vllm failed to start on seed 9
    }
    s = summarise_seeds(per_seed)
    assert s["seeds"] == [7, 8, 9] and s["kvroute"] == "kvroute kv_aware"
    ours = s["stats"]["kvroute kv_aware"]["chr"]
    assert ours["n"] == 3 and ours["min"] == 0.90 and ours["max"] == 0.95 and abs(ours["mean"] - (0.90 + 0.95 + 0.93) / 3) < 1e-9
    assert s["stats"]["vllm"]["ttft_p99_s"]["n"] == 2
    # only seeds where both ran are paired; higher CHR and lower TTFT p99 are better
    assert s["kvroute_better_on_seeds"]["vllm"]["chr"] == "1/2"
    assert s["kvroute_better_on_seeds"]["vllm"]["ttft_p99_s"] == "1/2"
    assert s["kvroute_better_on_seeds"]["vllm"]["dispersion"] == "0/0"


@pytest.mark.slow
def test_peers_bench_over_seeds(tmp_path: Path) -> None:
    proc = subprocess.run(
        [KVROUTE, "bench", "peers", "--targets", "kvroute,kvroute-hash", "--seeds", "3,4", "--replicas", "2",
         "--duration", "3", "--sessions", "6", "--time-scale", "0.05", "--out", str(tmp_path),
         "--policy-param", "thicc_threshold=4"],
        check=False, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "peers.json").read_text())
    assert doc["seeds"] == [3, 4] and set(doc["per_seed"]) == {"3", "4"}
    # the policy parameter reached the scenario, whose kvroute_args pass it to `kvroute serve`
    assert doc["per_seed"]["3"]["scenario"]["policy_params"] == ["thicc_threshold=4"]
    for seed in ("3", "4"):
        assert (tmp_path / f"seed-{seed}" / "peers.json").exists()
        assert (tmp_path / f"seed-{seed}" / "peers_load.png").exists()
        for m in doc["per_seed"][seed]["results"].values():
            assert m["requests"] > 5 and m["errors"] == 0
    stats = doc["summary"]["stats"]
    assert set(stats) == {"kvroute kv_aware", "kvroute hash"} and stats["kvroute kv_aware"]["chr"]["n"] == 2
    assert doc["summary"]["kvroute_better_on_seeds"]["kvroute hash"]["chr"].endswith("/2")
    bad = subprocess.run([KVROUTE, "bench", "peers", "--seeds", "3,x"], check=False, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "--seeds" in bad.stderr


@pytest.mark.slow
def test_sigterm_stops_the_fleet_it_started() -> None:
    """SIGTERM to a running bench unwinds its ``finally`` blocks: the emulated fleet it started in
    its own session goes too, rather than being orphaned."""
    proc = subprocess.Popen(
        [KVROUTE, "bench", "overhead", "--duration", "30", "--concurrency", "1", "--targets", "kvroute"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    started: list[float] = []

    def ready() -> bool:  # the fleet is up and the direct cells have run for a second
        if not started and children(proc.pid):
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] >= 1.0

    assert sigterm_when(proc, ready) == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["sweep", "--seeds", "1", "--variant", "w_sessions=1", "--duration", "-5"], "duration_s must be > 0"),
        (["sim", "--duration", "-1"], "--duration must be > 0"),
        (["kv-events", "--sessions", "0"], "must be >= 1"),
        (["kv-events", "--pages", "x"], "comma lists of integers"),
        (["probes", "--idle-cpu", "--gateways", "2,x"], "--gateways: a comma list of integers"),
    ],
    ids=["sweep-duration", "sim-duration", "kv-events-sessions", "kv-events-pages", "probes-gateways"],
)
def test_benches_refuse_bad_arguments_in_one_line(args: list[str], says: str) -> None:
    kvroute = str(Path(sys.executable).parent / "kvroute")
    proc = subprocess.run([kvroute, "bench", *args], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]

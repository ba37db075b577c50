"""``kvroute demo`` through the real console script, as a subprocess (tiny fleet, a few seconds)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.measures import MEASURE_FIELDS
from tests.ci import missing
from tests.proctree import sigterm_when

KVROUTE = str(Path(sys.executable).parent / "kvroute")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [[], ["--no-session-id"], ["--api", "messages"], ["--api", "responses"]],
    ids=["session-ids", "no-session-id", "messages-api", "responses-api"],
)
def test_tiny_demo_writes_both_policies(tmp_path: Path, flags: list[str]) -> None:
    # the clients' variants run kvroute's policy alone (the comparison itself is the default's)
    policies = ["kv_aware", "hash"] if not flags else ["kv_aware"]
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [KVROUTE, "demo", "--replicas", "2", "--duration", "4", "--sessions", "8", "--drain", "2",
         "--time-scale", "0.05", "--json", str(out), "--plots", str(tmp_path), "--policies", ",".join(policies),
         *flags],
        check=False, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(policies) <= set(doc)
    for policy in policies:
        m = doc[policy]
        assert set(MEASURE_FIELDS) <= set(m), set(MEASURE_FIELDS) - set(m)
        assert m["requests"] > 10
        assert m["errors"] == 0
        assert 0.0 < m["chr"] <= 1.0 and m["ideal_chr"] > 0.5
        assert m["dispersion"] is not None and m["ttft_p99_s"] > 0
        # each request carries the gateway's decision (X-Kvroute-Reason): cold prefill splits by it
        assert sum(m["route_reasons"].values()) == m["requests"]
        assert sum(m["cold_prefill_by_route"].values()) == m["cold_prefill_tokens"]
        assert set(m["cold_prefill_by_route"]) <= set(m["route_reasons"])
        assert m["ttft_floor_p99_s"] > 0  # the emulated fleet's time model is known
        # the scenario's no-contention ceiling (loadtests.parity.ceiling), the same for both policies
        assert m["requests_ceiling"] == doc[policies[-1]]["requests_ceiling"] > 10
        assert m["requests_of_ceiling"] == pytest.approx(m["requests"] / m["requests_ceiling"])
    assert doc["_scenario"]["replicas"] == 2 and doc["_scenario"]["policies"] == policies
    assert doc["_scenario"]["session_ids"] == ("--no-session-id" not in flags)  # the clients sent none
    assert doc["_scenario"]["api"] == (flags[1] if "--api" in flags else "chat")
    # not a TTY: plain progress lines and the final comparison
    assert "[kvroute kv_aware]" in proc.stdout and "dispersion" in proc.stdout
    if len(policies) > 1:  # the final comparison names the ceiling
        assert f"complete {doc['kv_aware']['requests_ceiling']} (simulated)" in proc.stdout
    assert (tmp_path / "demo_load.png").stat().st_size > 5000
    assert (tmp_path / "demo_ttft_cdf.png").stat().st_size > 5000


@pytest.mark.slow
def test_sigterm_mid_load_unwinds_the_demo(tmp_path: Path) -> None:
    """SIGTERM while the load runs inside the event loop: the demo's tasks are cancelled and unwind
    (the load driver, the gateway, the emulated fleet), it exits 143, and no child outlives it."""
    log = tmp_path / "demo.out"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [KVROUTE, "demo", "--replicas", "2", "--duration", "60", "--sessions", "8", "--time-scale", "0.05",
             "--policies", "kv_aware", "--no-live"],
            stdout=out, stderr=subprocess.STDOUT,
        )
        # the first progress line: the gateway and the fleet are up and requests are in flight
        rc = sigterm_when(proc, lambda: b"[kvroute kv_aware]" in log.read_bytes())
    assert rc == 128 + signal.SIGTERM, log.read_text()[-2000:]
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--replicas", "0"], "--replicas"),
        (["demo", "--time-scale", "0"], "time_scale must be > 0"),
        (["demo", "--workload", "weka", "--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["demo", "--workload", "weka", "--trace", "/dev/null"], "no sessions in this WEKA trace"),
        (["demo", "--json", "/proc/no/such/dir/out.json"], "cannot write there"),  # refused before the run
        (["demo", "--engine-set", "bogus=1"], "unknown profile field 'bogus'"),
        (["bench", "peers", "--seeds", "1", "--duration", "-1"], "duration_s must be > 0"),
        (["bench", "peers", "--workload", "weka", "--trace", "/nonexistent/trace.jsonl"], "No such file"),
    ],
    ids=["replicas", "time-scale", "trace", "empty-trace", "json-dir", "engine-set", "peers-duration", "peers-trace"],
)
def test_demo_and_peers_refuse_bad_arguments_before_starting_a_fleet(args: list[str], says: str) -> None:
    proc = subprocess.run([KVROUTE, *args], check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_tiny_demo_with_two_gateways_on_redis(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        missing("redis-server not installed")
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [KVROUTE, "demo", "--replicas", "2", "--duration", "3", "--sessions", "6", "--drain", "2",
         "--time-scale", "0.05", "--policies", "kv_aware", "--gateways", "2", "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())["kv_aware"]
    assert m["gateways"] == 2
    assert m["requests"] > 5 and m["errors"] == 0
    assert m["chr"] > 0.3
    # the time spent in the gateways, read from both of them
    assert m["gateway_overhead_source"].endswith("2 gateways)")
    assert 0 < m["gateway_overhead_p50_ms"] <= m["gateway_overhead_p99_ms"]


async def test_engine_settings_reach_the_emulated_fleet_the_floor_and_the_simulator() -> None:
    """``--engine-set FIELD=VALUE`` (demo, bench peers): the emulated replicas run with it (their
    ``/server_info`` says so), the TTFT floor's time model and the simulator's model of the run too."""
    import aiohttp

    from loadtests.demo import DemoScenario
    from loadtests.peers import emulated_fleet
    from loadtests.scenario import sim_config

    scenario = DemoScenario(replicas=2, engine_set=("schedule_policy=lpm", "max_running_requests=7"))
    async with emulated_fleet(2, scenario.emulator_args()) as fleet, aiohttp.ClientSession() as http:
        for url in fleet.urls:
            async with http.get(f"{url}/server_info") as r:
                info = await r.json()
            assert info["schedule_policy"] == "lpm" and info["max_running_requests"] == 7
            assert info["page_size"] == scenario.page_size  # the scenario's own settings still hold
    prof = scenario.replica_profile()
    assert prof is not None and prof.schedule_policy == "lpm" and prof.token_unit == scenario.token_unit
    cfg, _ = sim_config(scenario)
    assert cfg.profile.schedule_policy == "lpm" and cfg.profile.max_running_requests == 7
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        DemoScenario(engine_set=("lpm",)).engine_overrides()


@pytest.mark.parametrize(("cmd", "setting", "says"), [
    (["demo"], "nope=1", "unknown profile field 'nope'"),
    (["bench", "peers"], "schedule_policy=random", "schedule_policy must be one of"),
    (["bench", "peers", "--fleet", "real-sglang"], "schedule_policy=lpm", "real SGLang servers take their own"),
])
def test_bad_engine_settings_are_refused_before_anything_starts(cmd: list[str], setting: str, says: str) -> None:
    proc = subprocess.run([KVROUTE, *cmd, "--engine-set", setting], check=False, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]

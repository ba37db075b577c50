from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.measures import MEASURE_FIELDS
from loadtests.sim.cli import cli_main


def test_cli_synthetic_writes_measures_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    details = tmp_path / "details.json"
    rc = cli_main(
        [
            "--workload",
            "synthetic",
            "--replicas",
            "4",
            "--policies",
            "kv_aware,hash,round_robin",
            "--sessions",
            "60",
            "--lanes",
            "24",
            "--duration",
            "90",
            "--warmup",
            "20",
            "--synthetic",
            "turns_median=12",
            "--scale-up",
            "45:5",
            "--seed",
            "2",
            "--variant",
            "kv_t5=kv_aware:thicc_threshold=5,w_sessions=1",
            "--json",
            str(out),
            "--details",
            str(details),
            "--quiet",
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert list(data) == ["hash", "kv_aware", "kv_t5", "round_robin"]
    for m in data.values():
        assert set(m) == {*MEASURE_FIELDS, "route_reasons"}
        assert m["requests"] > 50 and m["errors"] == 0
        assert 0.0 < m["chr"] <= m["ideal_chr"] <= 1.0
        # every request of the window counted once by its decision's reason, as the live driver
        # counts kvroute's X-Kvroute-Reason header
        assert sum(m["route_reasons"].values()) == m["requests"]
        # the routing loss splits exactly over the decisions that placed the requests
        assert set(m["routing_loss_by_route"]) <= set(m["route_reasons"])
        assert sum(m["routing_loss_by_route"].values()) == pytest.approx(m["routing_loss"])
        assert sum(m["cold_prefill_by_route"].values()) == m["cold_prefill_tokens"]
        # each request alone on an idle replica with the pooled cache's hit: below what queueing gives
        assert 0.0 < m["ttft_floor_p99_s"] < m["ttft_p99_s"]
        # the engines' queue (as the live driver reads it from /metrics): part of the engines' TTFT
        assert 0.0 < m["engine_queue_share"] < 1.0
        assert 0.0 < m["engine_queue_mean_s"] and 0.0 < m["engine_queue_p99_s"]
    assert data["kv_aware"]["sessions_moved_by_scaleup"] == 0
    assert {"placed_new", "affinity"} <= set(data["kv_aware"]["route_reasons"])
    assert set(data["round_robin"]["route_reasons"]) == {"round_robin"}
    d = json.loads(details.read_text())
    assert d["lanes"] == 24 and d["runs"]["kv_aware"]["stats"]["replicas_final"] == 5
    assert d["policy_params"]["kv_t5"]["thicc_threshold"] == 5 and d["policy_params"]["kv_aware"]["thicc_threshold"] != 5
    assert sum(d["runs"]["hash"]["load_histogram"].values()) > 0


def test_ceiling_adds_what_the_closed_loop_allows_to_every_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ceiling``: the same sessions on a fleet without contention; each policy's requests as a
    fraction of that fleet's, which a crowded fleet (2 replicas, 16 lanes) stays below."""
    out = tmp_path / "sim.json"
    argv = ["--replicas", "2", "--policies", "kv_aware,hash", "--sessions", "40", "--lanes", "16",
            "--duration", "120", "--warmup", "20", "--seed", "3", "--json", str(out)]  # fmt: skip
    assert cli_main([*argv, "--ceiling"]) == 0
    err = capsys.readouterr().err
    assert "ceiling (no contention, 48 replicas)" in err and "req/ceil" in err
    data = json.loads(out.read_text())
    ceiling = data["kv_aware"]["requests_ceiling"]
    assert ceiling == data["hash"]["requests_ceiling"]
    for m in data.values():
        assert m["requests_of_ceiling"] == pytest.approx(m["requests"] / ceiling)
        assert m["requests_of_ceiling"] < 1.0
        assert m["ceiling_queue_share"] < 0.05 < m["engine_queue_share"]
    # without the flag the policies' own measures are the same, with no ceiling in them
    assert cli_main([*argv, "--quiet"]) == 0
    plain = json.loads(out.read_text())
    assert "requests_ceiling" not in plain["kv_aware"]
    assert plain["kv_aware"]["requests"] == data["kv_aware"]["requests"]
    with pytest.raises(SystemExit):
        cli_main(["--workload", "mooncake", "--ceiling", "--json", str(out)])  # open arrivals: lanes 0
    assert "--ceiling" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["--policies", "nope", "--json", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--scale-up", "abc", "--json", str(tmp_path / "x.json")])
    assert cli_main(["--synthetic", "bogus=1", "--json", str(tmp_path / "x.json"), "--quiet"]) == 2
    assert cli_main(["--variant", "v=kv_aware:nope=1", "--json", str(tmp_path / "x.json"), "--quiet"]) == 2
    with pytest.raises(SystemExit):
        cli_main(["--variant", "hash=hash:", "--json", str(tmp_path / "x.json")])  # label clash
    for bad in (["--duration", "-5"], ["--warmup", "-1"], ["--state-lag-s", "-1"]):
        with pytest.raises(SystemExit) as exc:
            cli_main([*bad, "--replicas", "2", "--json", str(tmp_path / "x.json")])
        assert exc.value.code == 2, bad
        assert "kvroute sim: error:" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_console_script_replays_mooncake(tmp_path: Path) -> None:
    out = tmp_path / "mc.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "router",
            "sim",
            "--workload",
            "mooncake",
            "--sessions",
            "400",
            "--replicas",
            "4",
            "--policies",
            "kv_aware,hash",
            "--duration",
            "400",
            "--warmup",
            "60",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvroute sim" in proc.stderr  # the table
    data = json.loads(out.read_text())
    assert set(data) == {"kv_aware", "hash"}
    for m in data.values():
        assert m["requests"] > 100
        assert m["ideal_chr"] is not None and 0.0 < m["ideal_chr"] < 0.9  # chat: far less reuse than agents


def _tiny(out: Path, *extra: str) -> list[str]:
    return [
        "--workload", "synthetic", "--replicas", "4", "--policies", "kv_aware,hash,least_loaded",
        "--sessions", "40", "--lanes", "16", "--duration", "60", "--warmup", "10", "--seed", "3",
        "--gateways", "2", "--state-lag-s", "0.1", "--json", str(out), "--quiet", *extra,
    ]  # fmt: skip


def test_jobs_give_the_same_json_as_one_process(tmp_path: Path) -> None:
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert cli_main(_tiny(one, "--jobs", "1")) == 0
    assert cli_main(_tiny(two, "--jobs", "2")) == 0
    assert one.read_text() == two.read_text()
    assert list(json.loads(two.read_text())) == ["hash", "kv_aware", "least_loaded"]
    with pytest.raises(SystemExit):
        cli_main(_tiny(tmp_path / "x.json", "--jobs", "0"))


def test_bench_sim_reports_cost_and_measures_of_a_tiny_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.bench import cli_main as bench_main

    out = tmp_path / "bench.json"
    argv = ["sim", "--replicas", "6", "--duration", "40", "--warmup", "10", "--gateways", "2",
            "--state-lag-s", "0.1", "--jobs", "2", "--json", str(out)]  # fmt: skip
    assert bench_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert printed == data
    assert data["replicas"] == 6 and data["gateways"] == 2 and data["jobs"] == 2
    assert "--replicas 6" in data["command"] and "--jobs 2" in data["command"]
    assert 0 < data["wall_s"] < 120 and 0 < data["cpu_s"]
    assert 20 < data["peak_rss_mb"] < 4000
    assert set(data["policies"]) == {"kv_aware", "hash"}
    for m in data["policies"].values():
        assert m["requests"] > 20
        assert 0.0 < m["chr"] <= m["ideal_chr"] <= 1.0
        assert m["ttft_p99_s"] > 0 and m["dispersion"] >= 0
        assert 0 <= m["dispersion_between"] <= m["dispersion"] and m["dispersion_floor"] is not None
        assert isinstance(m["cold_prefill_by_cause"], dict)


def test_cli_says_when_lanes_ran_out_of_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool the run empties (10 sessions, 8 lanes, 600 s): the table names each policy's spent lanes,
    so nobody reads its requests as the policy's alone."""
    out = tmp_path / "sim.json"
    argv = ["--replicas", "2", "--policies", "kv_aware,hash", "--sessions", "10", "--lanes", "8",
            "--synthetic", "turns_median=3", "--duration", "600", "--warmup", "10", "--seed", "1",
            "--json", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    assert all(m["lanes_spent"] >= 1 for m in data.values())
    err = " ".join(capsys.readouterr().err.split())
    assert "lanes out of sessions before the window ended: kv_aware" in err and "hash" in err

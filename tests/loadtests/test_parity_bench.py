"""``kvroute bench parity``: the live side as the median of repeated runs, and one tiny real run
(a live fleet of emulated replicas behind ``kvroute serve``, real subprocesses and sockets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.parity import compare, median_measures, rankings

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def test_median_measures_takes_each_numeric_measure_s_median_and_the_rest_from_the_median_run() -> None:
    runs = [
        {"chr": 0.90, "ttft_p99_s": 30.0, "requests": 100, "route_reasons": {"affinity": 1}},
        {"chr": 0.93, "ttft_p99_s": 10.0, "requests": 300, "route_reasons": {"affinity": 3}},
        {"chr": 0.92, "ttft_p99_s": 20.0, "requests": 200, "route_reasons": {"affinity": 2}, "dispersion": None},
    ]
    m = median_measures(runs)
    assert m["chr"] == 0.92 and m["ttft_p99_s"] == 20.0 and m["requests"] == 200
    assert m["route_reasons"] == {"affinity": 2}  # from the run with the median CHR
    assert m["dispersion"] is None  # no run reports it


def test_median_measures_of_an_even_count_averages_the_middle_two() -> None:
    m = median_measures([{"chr": 0.90, "requests": 100}, {"chr": 0.94, "requests": 300}])
    assert m["chr"] == pytest.approx(0.92) and m["requests"] == 200
    with pytest.raises(ValueError):
        median_measures([])


def test_a_median_inside_the_bounds_can_hide_no_run_outside_them() -> None:
    sim = {"chr": 0.915, "dispersion": 1.8, "ttft_p99_s": 12.0}
    runs = [{"chr": c, "dispersion": 1.8, "ttft_p99_s": 12.0} for c in (0.917, 0.924, 0.927)]
    assert compare(sim, median_measures(runs))["chr_ok"] is True
    assert [compare(sim, r)["chr_ok"] for r in runs] == [True, True, False]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--repeats", "0"), ("--sim-draws", "-1"), ("--gateways", "0"), ("--time-scale", "0"), ("--gateway-assign", "x")],
)
def test_parity_rejects_bad_counts_and_scales(flag: str, value: str) -> None:
    proc = subprocess.run([KVROUTE, "bench", "parity", flag, value], check=False, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr


def _row(policy: str, sim: dict[str, float], live: dict[str, float]) -> dict[str, object]:
    return {"workload": "synthetic", "seed": 1, "policy": policy, "sim": sim, "live": live}


def test_rankings_say_whether_the_simulator_orders_the_policies_as_the_live_gateway_does() -> None:
    rows = [
        _row("kv_aware", {"chr": 0.92, "ttft_p99_s": 12.0, "requests": 300}, {"chr": 0.93, "ttft_p99_s": 14.0, "requests": 310}),
        _row("hash", {"chr": 0.90, "ttft_p99_s": 20.0, "requests": 250}, {"chr": 0.91, "ttft_p99_s": 13.0, "requests": 260}),
        _row("random", {"chr": 0.50, "ttft_p99_s": 30.0, "requests": 200}, {"chr": 0.52, "ttft_p99_s": 31.0, "requests": 190}),
    ]  # fmt: skip
    by = {r["measure"]: r for r in rankings(rows)}
    assert by["chr"]["sim"] == by["chr"]["live"] == ["kv_aware", "hash", "random"] and by["chr"]["agree"]
    assert by["requests"]["agree"]  # more is better: the same order both sides
    assert by["ttft_p99_s"]["sim"] == ["kv_aware", "hash", "random"]  # less is better
    assert by["ttft_p99_s"]["live"] == ["hash", "kv_aware", "random"] and not by["ttft_p99_s"]["agree"]
    # a measure one side does not report cannot agree
    assert by["dispersion"]["sim"] == [] and not by["dispersion"]["agree"]
    # groups are per workload and seed
    other = [dict(r, seed=2) for r in rows[:2]]
    assert {(r["seed"], r["measure"]) for r in rankings(rows + other)} >= {(1, "chr"), (2, "chr")}


def test_parity_rejects_an_unknown_policy() -> None:
    proc = subprocess.run([KVROUTE, "bench", "parity", "--policies", "kv_aware,nope"], check=False,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--policies" in proc.stderr and "nope" in proc.stderr


@pytest.mark.slow
def test_a_tiny_parity_run_of_two_policies_runs_each_both_ways_and_ranks_them(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    argv = [KVROUTE, "bench", "parity", "--workload", "synthetic", "--seeds", "1", "--duration", "6",
            "--policies", "kv_aware,hash", "--sim-draws", "3", "--log-dir", str(tmp_path / "logs"),
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["policies"] == ["kv_aware", "hash"] and doc["sim_draws"] == 3
    hash_row = doc["rows"][1]
    # three simulations on the one live fleet's names: hash draws nothing at random, so all agree
    assert len(hash_row["sim_runs"]) == 3 and hash_row["sim_runs"][0] == hash_row["sim_runs"][1] == hash_row["sim_runs"][2]
    assert [r["policy"] for r in doc["rows"]] == ["kv_aware", "hash"]
    for r in doc["rows"]:
        assert r["sim"]["requests"] > 0 and r["live"]["requests"] > 0 and r["live"]["errors"] == 0
        # each policy's live gateway says so in its routing reasons: hash routes by the hash alone
        reasons = set(r["live"]["route_reasons"])
        assert reasons == {"hash"} if r["policy"] == "hash" else "hash" not in reasons, reasons
    assert {x["measure"] for x in doc["rankings"]} == {"chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion"}
    assert all(sorted(x["sim"]) == sorted(x["live"]) == ["hash", "kv_aware"] for x in doc["rankings"])
    assert (tmp_path / "logs" / "synthetic-1-kv_aware").is_dir() and (tmp_path / "logs" / "synthetic-1-hash").is_dir()


@pytest.mark.slow
def test_a_tiny_parity_run_compares_the_simulator_with_each_live_run_and_their_median(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    argv = [KVROUTE, "bench", "parity", "--workload", "synthetic", "--seeds", "1", "--duration", "6",
            "--repeats", "2", "--log-dir", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["repeats"] == 2 and len(doc["rows"]) == 1
    row = doc["rows"][0]
    assert row["workload"] == "synthetic" and row["seed"] == 1
    assert len(row["live_runs"]) == 2 and all(r["requests"] > 0 and r["errors"] == 0 for r in row["live_runs"])
    # each live run keeps its fleet's replica ids, and has its own simulation on them
    assert all(len(r["replica_ids"]) == 8 and all(x.startswith("127.0.0.1:") for x in r["replica_ids"])
               for r in row["live_runs"])  # fmt: skip
    assert row["live"] == {k: v for k, v in median_measures(row["live_runs"]).items() if k != "replica_ids"}
    assert len(row["sim_runs"]) == 2 and row["sim"] == median_measures(row["sim_runs"])
    assert row["sim"]["requests"] > 0
    assert 0 <= row["runs_within_bounds"] <= 2
    assert isinstance(row["within_bounds"], bool)
    assert row["checks"]["chr_abs_diff"] == pytest.approx(abs(row["sim"]["chr"] - row["live"]["chr"]))
    assert (tmp_path / "logs" / "synthetic-1-run1").is_dir() and (tmp_path / "logs" / "synthetic-1-run2").is_dir()


@pytest.mark.slow
def test_a_parity_run_with_two_gateways_on_a_slower_fleet_shares_redis_live_and_lags_their_tables_in_the_model(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    argv = [KVROUTE, "bench", "parity", "--workload", "synthetic", "--seeds", "1", "--duration", "6",
            "--gateways", "2", "--gateway-assign", "sticky", "--time-scale", "0.2", "--log-dir", str(tmp_path / "logs"),
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["gateways"] == 2 and doc["gateway_assign"] == "sticky" and doc["time_scale"] == 0.2
    assert len(doc["rows"]) == 1
    row = doc["rows"][0]
    assert row["live"]["requests"] > 0 and row["live"]["errors"] == 0 and row["sim"]["requests"] > 0
    logs = sorted(p.name for p in (tmp_path / "logs" / "synthetic-1").iterdir())
    assert any("redis" in n for n in logs), logs  # the live gateways shared a fresh Redis
    assert sum(1 for n in logs if "gw0" in n) == sum(1 for n in logs if "gw1" in n) == 1, logs


def test_the_simulators_gateways_re_read_the_replica_table_as_often_as_the_live_ones() -> None:
    """With several gateways each live one re-reads the others' in-flight counts from Redis every
    ``GATEWAY_REPLICA_REFRESH_S`` of modelled time (``kvroute_env`` scales it to the fleet's clock):
    the simulator's model of the run has as many gateways, with that state lag."""
    from loadtests.scenario import demo_scenario, sim_config
    from router.config import load_config
    from router.store.redis import GATEWAY_REPLICA_REFRESH_S, gateway_refresh_s

    one = demo_scenario(workload_kind="synthetic", time_scale=0.1)
    cfg, _ = sim_config(one)
    assert cfg.gateways == 1 and cfg.state_lag_s == 0.0
    four = demo_scenario(workload_kind="synthetic", time_scale=0.1, gateways=4)
    cfg, _ = sim_config(four)
    assert cfg.gateways == 4 and cfg.state_lag_s == GATEWAY_REPLICA_REFRESH_S
    assert cfg.gateway_assign == "random"  # the live round robin is per request too
    sidecars = demo_scenario(workload_kind="synthetic", gateways=4, gateway_assign="sticky")
    assert sim_config(sidecars)[0].gateway_assign == "sticky"  # the same hash of the session id
    env = four.kvroute_env()
    gateway = load_config(["--port", "0", *four.kvroute_args()], env)
    assert gateway_refresh_s(gateway, env) == pytest.approx(GATEWAY_REPLICA_REFRESH_S * 0.1)


def test_the_ceiling_is_a_fleet_without_contention_that_bounds_the_real_fleets_requests() -> None:
    """``ceiling``: the same sessions on a fleet where nothing queues and nothing is evicted complete
    more requests than the scenario's own fleet, and a fleet twice its size adds nothing (it is the
    closed loop's limit, not a bigger fleet's)."""
    from dataclasses import replace

    from loadtests.demo import DemoScenario
    from loadtests.parity import run_sim_for
    from loadtests.scenario import ceiling, sim_config
    from loadtests.sim.ceiling import ceiling_config, with_ceiling
    from loadtests.sim.run import run_sim

    sc = DemoScenario(replicas=2, sessions=12, duration_s=20.0, seed=3)
    ceil = ceiling(sc)
    assert ceil is not None
    fleet = run_sim_for(sc)
    assert fleet["engine_queue_share"] > 0.1  # two replicas for twelve coding sessions: they queue
    assert ceil["requests_ceiling"] > fleet["requests"]
    assert ceil["ceiling_queue_share"] < 0.05
    assert ceil["ttft_p99_ceiling_s"] < fleet["ttft_p99_s"]
    base, specs = sim_config(sc)
    cfg = ceiling_config(base)
    assert cfg.replicas == 36 and cfg.profile.kv_capacity_tokens > 10 * 850_000
    bigger = run_sim(specs, replace(cfg, replicas=2 * cfg.replicas)).measures
    assert abs(bigger["requests"] - ceil["requests_ceiling"]) <= 0.01 * ceil["requests_ceiling"]

    m = with_ceiling({"requests": 50, "chr": 0.9}, ceil)
    assert m["requests_of_ceiling"] == pytest.approx(50 / ceil["requests_ceiling"])
    assert m["chr"] == 0.9 and m["requests_ceiling"] == ceil["requests_ceiling"]
    assert with_ceiling({"requests": 50}, None) == {"requests": 50}
    # extra emulator flags may change the time model: no ceiling rather than a wrong one
    assert ceiling(replace(sc, extra_emulator_args=("--set", "max_running_requests=2"))) is None
    with pytest.raises(ValueError, match="closed loop"):  # open arrivals: every arrival is a request anyway
        ceiling_config(replace(base, lanes=0, striped_lanes=False))


def test_the_simulator_names_its_replicas_as_the_live_fleet_and_draws_tie_breaks_per_repeat() -> None:
    """Hash placement depends on the replicas' names, so parity simulates each live run on that run's
    ``host:port`` ids; ``draw`` gives the policy's random choices another stream."""
    from loadtests.demo import DemoScenario
    from loadtests.parity import run_sim_for

    sc = DemoScenario(replicas=3, sessions=9, duration_s=8.0, seed=3)
    ids = ("127.0.0.1:41234", "127.0.0.1:41235", "127.0.0.1:41236")
    base = run_sim_for(sc, "hash")
    named = run_sim_for(sc, "hash", ids)
    assert named["requests"] > 0 and named != base  # other names, other placement
    assert run_sim_for(sc, "hash", ids) == named  # deterministic for given names and draw
    assert run_sim_for(sc, "hash", ids, draw=1) == named  # hash draws nothing at random
    draws = [run_sim_for(sc, "random", ids, draw=d) for d in range(3)]
    assert len({repr(m) for m in draws}) > 1  # random placement: each draw its own

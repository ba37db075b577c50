from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loadtests.bench import cli_main as bench_main
from loadtests.demo import DemoScenario
from loadtests.parity import WORKLOADS, sim_config
from loadtests.sweep import MEASURES, paired


def test_paired_differences_standard_error_and_lower_count() -> None:
    base = [dict.fromkeys(MEASURES, 1.0), dict.fromkeys(MEASURES, 2.0)]
    var = [dict.fromkeys(MEASURES, 0.0), dict.fromkeys(MEASURES, 4.0)]  # differences -1 and +2
    out = paired(base, var)
    assert out["chr"]["mean"] == pytest.approx(0.5)
    assert out["chr"]["se"] == pytest.approx(1.5)  # stdev 2.1213 / sqrt 2
    assert out["chr"]["lower_on"] == 1


def test_sweep_runs_the_simulated_bench_and_the_default_as_a_variant_changes_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sweep", "--workload", "synthetic", "--seeds", "1,2", "--duration", "10",
            "--variant", "thicc_threshold=3", "--variant", "hard_bound_min=1,thicc_threshold=1"]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["seeds"] == [1, 2] and doc["workload"] == "synthetic"
    assert doc["default"]["requests"] > 0
    same = doc["variants"]["thicc_threshold=3"]  # the default value: identical runs
    assert all(same[k]["mean"] == 0 and same[k]["se"] == 0 for k in MEASURES)
    other = doc["variants"]["hard_bound_min=1,thicc_threshold=1"]
    assert any(other[k]["mean"] != 0 for k in MEASURES)


def test_sweep_rejects_an_unknown_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["sweep", "--seeds", "1", "--duration", "5", "--variant", "nope=1"]) == 2
    assert "nope" in capsys.readouterr().err


def test_the_kv_bound_weka_replay_is_the_same_trace_without_the_host_tier() -> None:
    def fleet(name: str) -> tuple[int, int, int]:
        w = WORKLOADS[name]
        sc = replace(
            DemoScenario(), workload_kind=w["workload_kind"], sessions=w["sessions"], host_tier=w["host_tier"]
        )
        cfg, specs = sim_config(sc)
        return cfg.profile.host_capacity_tokens, cfg.profile.capacity_tokens, len(specs)

    host, hbm, n = fleet("weka")
    assert host > 0
    assert fleet("weka-kv") == (0, hbm, n)

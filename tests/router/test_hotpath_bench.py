"""``loadtests/bench_hotpath.py``: the micro-benchmark measures what it says and prints JSON."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from loadtests.bench_hotpath import PHASES, cli_main, compare_overhead, run_cell
from loadtests.soak import cpu_s


def test_known_sessions_route_by_affinity_new_ones_are_placed() -> None:
    known = run_cell(8, True, requests=60, sessions=10)
    new = run_cell(8, False, requests=60, sessions=10)
    assert set(known["phases_us"]) == set(PHASES)
    assert all(known["phases_us"][p]["mean"] > 0 for p in PHASES)
    # 10 placements to bind the pool, everything after is affinity; new sessions are all placed
    assert known["reasons"] == {"placed_new": 10, "affinity": 60 + 60}
    assert set(new["reasons"]) == {"placed_new"}
    assert known["total_us"]["p50"] <= known["total_us"]["p99"]


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--replicas", "8", "--requests", "20", "--sessions", "5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench"] == "hotpath"
    assert [(c["replicas"], c["session"]) for c in doc["cells"]] == [(8, "known"), (8, "new")]


def _doc(added_p50: float, rps: float, ratio: float) -> dict[str, Any]:
    name = "kvroute kv_aware"
    return {
        "added": {
            name: {
                "c1_json": {
                    "added_p50_ms": added_p50,
                    "added_p99_ms": 1.0,
                    "throughput_ratio_vs_direct": ratio,
                }
            }
        },
        "cells": {name: {"c1_json": {"req_per_s": rps}}},
    }


def test_compare_gives_after_over_before_ratios() -> None:
    out = compare_overhead(_doc(0.8, 1000, 0.3), _doc(0.4, 1500, 0.45))
    assert out["c1_json"]["added_p50_after_over_before"] == 0.5
    assert out["c1_json"]["thr_vs_direct_after_over_before"] == 1.5
    with pytest.raises(ValueError):
        compare_overhead({"added": {}}, _doc(0.4, 1500, 0.45))


def test_proc_cpu_counts_this_process() -> None:
    before = cpu_s(os.getpid())
    x = 0
    while cpu_s(os.getpid()) - before < 0.05:
        x += sum(range(1000))
    assert x > 0

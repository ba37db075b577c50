"""The SGLang /metrics parser against a sample exposition of SGLang 0.5.23 (fixtures/)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from router.engine_metrics import (
    METRICS_EVERY,
    LoadReadings,
    MetricsParseError,
    load_from_v1_loads,
    parse_engine_metrics,
    scrape_values,
)
from router.model import EngineLoad

SAMPLE = (Path(__file__).parent / "fixtures" / "sglang_metrics_0.5.23.txt").read_text()

LABELS = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0"'


def test_sample_exposition() -> None:
    load = parse_engine_metrics(SAMPLE, now=12.5)
    assert load == EngineLoad(
        running=12,
        queued=3,
        kv_util=0.41,
        capacity_tokens=446744,
        host_used_tokens=512000,
        host_capacity_tokens=0,  # family absent from the sample
        cache_hit_rate=0.6421,
        gen_throughput=812.37,
        updated_at=12.5,
    )


def test_help_text_is_irrelevant() -> None:
    old_style = "\n".join(
        "# HELP " + line.split()[2] + " Multiprocess metric" if line.startswith("# HELP") else line
        for line in SAMPLE.splitlines()
    )
    assert parse_engine_metrics(old_style) == parse_engine_metrics(SAMPLE)
    no_comments = "\n".join(line for line in SAMPLE.splitlines() if not line.startswith("#"))
    assert parse_engine_metrics(no_comments).running == 12


def test_missing_families_and_empty_text() -> None:
    assert parse_engine_metrics("") == EngineLoad()
    only_queue = f"sglang:num_queue_reqs{{{LABELS}}} 4.0\n"
    assert parse_engine_metrics(only_queue, now=1.0) == EngineLoad(queued=4, updated_at=1.0)


def test_nan_is_skipped() -> None:
    text = (
        "# TYPE sglang:token_usage gauge\n"
        f'sglang:token_usage{{{LABELS},tp_rank="0"}} NaN\n'
        f'sglang:num_running_reqs{{{LABELS},tp_rank="0"}} NaN\n'
        f'sglang:num_running_reqs{{{LABELS},dp_rank="1",tp_rank="0"}} 2.0\n'
    )
    load = parse_engine_metrics(text)
    assert load.kv_util == 0.0
    assert load.running == 2


def test_dp_ranks_sum_running_and_max_usage() -> None:
    text = "".join(
        f'sglang:num_running_reqs{{dp_rank="{dp}",{LABELS},tp_rank="0"}} {run}\n'
        f'sglang:num_queue_reqs{{dp_rank="{dp}",{LABELS},tp_rank="0"}} {q}\n'
        f'sglang:token_usage{{dp_rank="{dp}",{LABELS},tp_rank="0"}} {u}\n'
        f'sglang:max_total_num_tokens{{dp_rank="{dp}",{LABELS},tp_rank="0"}} 1000.0\n'
        for dp, run, q, u in [(0, 5.0, 1.0, 0.2), (1, 7.0, 2.0, 0.9), (2, 1.0, 0.0, 0.5)]
    )
    load = parse_engine_metrics(text)
    assert (load.running, load.queued, load.kv_util, load.capacity_tokens) == (13, 3, 0.9, 3000)
    # a replica that is one rank of the engine (rule 6): that rank's figures, and those of no rank
    one = parse_engine_metrics(text + f"sglang:gen_throughput{{{LABELS}}} 4.0\n", dp_rank=1)
    assert (one.running, one.queued, one.kv_util, one.capacity_tokens, one.gen_throughput) == (7, 2, 0.9, 1000, 4.0)
    assert parse_engine_metrics(text, dp_rank=5) == EngineLoad()  # a rank the engine lacks: nothing


def test_rank_copies_and_pid_labels_are_not_double_counted() -> None:
    # --enable-metrics-for-all-schedulers: every TP rank reports the same figure
    text = "".join(f'sglang:num_running_reqs{{{LABELS},tp_rank="{tp}"}} 6.0\n' for tp in range(4))
    text += f'sglang:num_queue_reqs{{{LABELS},pid="100",tp_rank="0"}} 2.0\n'
    text += f'sglang:num_queue_reqs{{{LABELS},pid="101",tp_rank="0"}} 3.0\n'
    load = parse_engine_metrics(text)
    assert load.running == 6
    assert load.queued == 3


FIXTURES = Path(__file__).parent / "fixtures"


def test_a_real_tp2_engine_counts_its_pool_once() -> None:
    """``/metrics`` and ``/v1/loads`` of a real SGLang 0.5.23 with ``--tp-size 2`` (CPU, the tiny
    model, a 3,000-token pool), taken while it ran two requests and queued a third: every TP rank
    reports ``max_total_num_tokens`` of the one pool they share, rank 0 the rest. Summed, the copies
    would double the capacity the policy divides working sets by."""
    text = (FIXTURES / "sglang_metrics_0.5.23_tp2.txt").read_text()
    assert text.count('sglang:max_total_num_tokens{') == 2 and 'tp_rank="1"' in text
    metrics = parse_engine_metrics(text, now=1.0)
    assert (metrics.capacity_tokens, metrics.running, metrics.queued, metrics.kv_util) == (3000, 2, 1, 0.41)
    loads = load_from_v1_loads(json.loads((FIXTURES / "sglang_v1_loads_0.5.23_tp2.json").read_text()), now=1.0)
    assert (loads.capacity_tokens, loads.running, loads.queued, loads.waiting_uncached_tokens) == (3000, 2, 1, 409)


def test_priority_total_series_only() -> None:
    text = (
        f'sglang:num_queue_reqs{{{LABELS},priority="",tp_rank="0"}} 5.0\n'
        f'sglang:num_queue_reqs{{{LABELS},priority="1",tp_rank="0"}} 2.0\n'
        f'sglang:num_queue_reqs{{{LABELS},priority="2",tp_rank="0"}} 3.0\n'
    )
    assert parse_engine_metrics(text).queued == 5


def test_underscore_names_from_openmetrics() -> None:
    text = 'sglang_num_running_reqs{dp_rank="0"} 9\nsglang_token_usage{dp_rank="0"} 0.25\n'
    load = parse_engine_metrics(text)
    assert (load.running, load.kv_util) == (9, 0.25)


def test_other_prefixes_ignored() -> None:
    text = "vllm:num_requests_running 40\nnum_running_reqs 40\n"
    assert parse_engine_metrics(text) == EngineLoad()


def test_garbage_raises_our_error() -> None:
    with pytest.raises(MetricsParseError):
        parse_engine_metrics("sglang:num_running_reqs{broken 1\n")


def test_scrape_values_subset() -> None:
    assert scrape_values(SAMPLE, ["num_running_reqs"]) == {"num_running_reqs": 12.0}


def test_unwanted_families_do_not_reach_the_parser_but_garbage_still_fails() -> None:
    histogram = "".join(
        f'sglang:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} 3.0\n' for le in (0.1, 1, "+Inf")
    )
    text = "# HELP anything at all\n" + histogram + "  sglang:num_running_reqs 7\n"
    assert parse_engine_metrics(text).running == 7
    for garbage in ("<html><body>502 Bad Gateway</body></html>\n", histogram + "{} 1\n"):
        with pytest.raises(MetricsParseError):
            parse_engine_metrics(garbage)


LOADS = json.loads((Path(__file__).parent / "fixtures" / "sglang_v1_loads_0.5.23.json").read_text())


def test_a_load_from_v1_loads_alone() -> None:
    """A real SGLang 0.5.23 ``/v1/loads`` (idle) gives every figure ``/metrics`` does but the host
    tier's, taken from an earlier ``/metrics`` reading; DP ranks combine as ``/metrics``' do."""
    assert load_from_v1_loads(LOADS, now=7.0) == EngineLoad(
        capacity_tokens=40_000, cache_hit_rate=0.944, updated_at=7.0
    )
    host = EngineLoad(running=9, host_used_tokens=5, host_capacity_tokens=80_000)
    rank = {"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.5, "max_total_num_tokens": 1000,
            "cache_hit_rate": 0.25, "gen_throughput": 10.5, "num_waiting_uncached_tokens": 300}  # fmt: skip
    two = {"loads": [rank, dict(rank, token_usage=0.75, cache_hit_rate=0.5)]}
    assert load_from_v1_loads(two, now=1.0, host=host) == EngineLoad(
        running=4, queued=2, kv_util=0.75, capacity_tokens=2000, host_used_tokens=5, host_capacity_tokens=80_000,
        cache_hit_rate=0.5, gen_throughput=21.0, waiting_uncached_tokens=600, dp_ranks=2, updated_at=1.0,
    )  # fmt: skip
    # a replica that is one rank: that rank's entry alone, whether or not the engine filtered
    ranked = {"loads": [dict(rank, dp_rank=0), dict(rank, dp_rank=1, num_running_reqs=5, token_usage=0.75)]}
    assert load_from_v1_loads(ranked, now=1.0, dp_rank=1) == EngineLoad(
        running=5, queued=1, kv_util=0.75, capacity_tokens=1000, cache_hit_rate=0.25, gen_throughput=10.5,
        waiting_uncached_tokens=300, dp_ranks=1, updated_at=1.0,
    )  # fmt: skip
    with pytest.raises(MetricsParseError, match="rank 2"):
        load_from_v1_loads(ranked, dp_rank=2)
    with pytest.raises(MetricsParseError, match="rank 1"):  # true is no rank number
        load_from_v1_loads({"loads": [dict(rank, dp_rank=True)]}, dp_rank=1)
    # nonsense in a figure counts as absent; negative and over-one values are clamped
    odd = {"loads": [{"num_running_reqs": 1, "num_waiting_reqs": "x", "token_usage": 3.0, "gen_throughput": -1}]}
    assert load_from_v1_loads(odd) == EngineLoad(running=1, kv_util=1.0)


@pytest.mark.parametrize(
    "doc",
    [[], {"loads": {}}, {"loads": [1]}, {"nope": []}, {"loads": []}, {"loads": [{"num_waiting_reqs": 1}]}, {"loads": [{"num_running_reqs": True}]},
     {"loads": [{"num_running_reqs": 1}, {}]}, {"loads": [{"num_running_reqs": float("nan")}]}, None],
)  # fmt: skip
def test_a_v1_loads_answer_without_running_requests_is_no_load(doc: object) -> None:
    with pytest.raises(MetricsParseError):
        load_from_v1_loads(doc)


def test_load_readings_read_metrics_first_then_every_tenth_time_and_whenever_v1_loads_fails() -> None:
    r = LoadReadings()
    loads = EngineLoad(running=3, waiting_uncached_tokens=7)
    metrics = EngineLoad(running=2, host_used_tokens=5, host_capacity_tokens=50)
    assert r.host is None and r.metrics_due(loads)  # the first reading
    assert r.combine(loads, metrics) == replace(loads, host_used_tokens=5, host_capacity_tokens=50)
    assert r.host == metrics
    due = [r.metrics_due(loads) for _ in range(2 * METRICS_EVERY)]
    # due at the tenth, and again each time until a /metrics reading is combined
    assert due == [False] * (METRICS_EVERY - 1) + [True] * (METRICS_EVERY + 1)
    r.combine(loads, metrics)
    assert not r.metrics_due(loads) and r.metrics_due(None)  # /v1/loads gave nothing: /metrics at once
    assert r.combine(None, metrics) == metrics and r.combine(loads, None) == loads  # each alone
    assert r.combine(None, None) is None

"""The emulator's fast exposition is prometheus_client's, byte for byte, whatever changes between scrapes."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.exposition import generate_latest

from replica.emulator.metrics import ReplicaMetrics
from replica.emulator.timemodel import EngineLoad
from router.engine_metrics import parse_engine_metrics

_LOAD = EngineLoad(
    running=3, queued=1, used_tokens=5000, capacity_tokens=8192, token_usage=0.61, evictable_tokens=1200,
    host_used_tokens=700, host_total_tokens=16384, cache_hit_rate=0.93, gen_throughput=812.5,
    spec_accept_length=2.0, waiting_tokens=4096, decode_sum_seq_lens=30000,
)  # fmt: skip


@pytest.mark.parametrize("hicache", [False, True])
def test_render_matches_generate_latest_as_values_and_labels_change(hicache: bool) -> None:
    load = [_LOAD]
    m = ReplicaMetrics("emulated/m", [lambda: load[0]], hicache)
    steps = [
        lambda: None,
        lambda: m.ttft["true"].observe(0.35),
        lambda: m.e2e["false"].observe(1e9),  # past the last bucket: +Inf only
        lambda: m.prompt_tokens.__setitem__("true", 123_456_789),
        lambda: m.http_active.__setitem__(("/v1/chat/completions", "POST"), 2),  # a new label set
        lambda: m.http_active.__setitem__(("/generate", "POST"), 1),
        lambda: m.http_active.pop(("/v1/chat/completions", "POST")),  # and one gone
        lambda: load.__setitem__(0, dataclasses.replace(_LOAD, gen_throughput=float("inf"), running=0)),
        lambda: load.__setitem__(0, dataclasses.replace(_LOAD, cache_hit_rate=float("nan"))),
    ]
    for step in steps:
        step()
        assert m.render() == generate_latest(m.registry)
        assert m.render() == generate_latest(m.registry)  # the cached layout, reused
    assert b'sglang:http_requests_active{endpoint="/generate",method="POST"} 1.0' in m.render()
    assert b"/v1/chat/completions" not in m.render()
    assert (b"sglang:hicache_host_total_tokens" in m.render()) is hicache


def test_every_tp_rank_reports_the_pool_once_and_the_gateway_counts_it_once() -> None:
    """As a real SGLang 0.5.23 with ``--tp-size 2`` (tests/router/fixtures/sglang_metrics_0.5.23_tp2.txt):
    ``max_total_num_tokens`` once per TP rank, every other scheduler gauge from rank 0 only."""
    text = ReplicaMetrics("emulated/m", [lambda: _LOAD], False, tp_size=4).render().decode()
    pool = [ln for ln in text.splitlines() if ln.startswith("sglang:max_total_num_tokens{")]
    assert [ln.split('tp_rank="')[1][0] for ln in pool] == ["0", "1", "2", "3"]
    assert all(ln.endswith(" 8192.0") for ln in pool)
    assert text.count("sglang:num_running_reqs{") == 1
    assert parse_engine_metrics(text).capacity_tokens == 8192

"""Pure pieces of the live driver and the report: load parsing, running stats, plots, tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.live import (
    FleetKv,
    HomeChanges,
    LiveStats,
    LoadConfig,
    _load_from_metrics,
    _load_from_state,
    _Run,
)
from loadtests.report import comparison_table, load_values, plot_load, plot_ttft_cdf, replica_means


def test_load_from_state_shapes() -> None:
    assert _load_from_state({"running": 3, "queued": 2}) == 5
    assert _load_from_state({"load": {"num_running_reqs": 4, "num_queue_reqs": 1}}) == 5
    assert _load_from_state({"in_flight": 7, "running": 1}) == 7
    with pytest.raises(TypeError):
        _load_from_state([1, 2])


def test_load_from_metrics_sums_running_and_queued() -> None:
    text = (
        "# HELP sglang:num_running_reqs x\n"
        'sglang:num_running_reqs{model_name="m",engine_type="unified"} 3.0\n'
        'sglang:num_queue_reqs{model_name="m",engine_type="unified"} 2.0\n'
        'sglang:token_usage{model_name="m"} 0.5\n'
    )
    assert _load_from_metrics(text) == 5


def test_live_stats_dispersion_and_quantiles() -> None:
    st = LiveStats()
    st.add_loads([2, 2, 2, 2])
    assert st.dispersion == 0.0
    st = LiveStats()
    st.add_loads([0, 4])  # mean 2, variance 4 -> 2.0
    assert st.dispersion == pytest.approx(2.0)
    st.ttfts = [0.1 * i for i in range(1, 101)]
    assert st.ttft_quantile(0.5) == pytest.approx(5.1)
    st.input_tokens, st.cached_tokens, st.ideal_cached_tokens = 100, 80, 90
    assert (st.chr, st.ideal_chr) == (0.8, 0.9)


def test_load_config_validates() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        LoadConfig(url="http://x", time_scale=0)
    with pytest.raises(ValueError, match="token_unit"):
        LoadConfig(url="http://x", token_unit=0)


def test_plots_and_table(tmp_path: Path) -> None:
    samples = [(0.0, (1, 3)), (1.0, (2, 2)), (2.0, (0, 4))]
    assert load_values(samples) == [1, 3, 2, 2, 0, 4]
    assert replica_means(samples) == [1.0, 3.0]
    p1 = plot_load({"a": samples, "b": [(0.0, (2, 2))]}, tmp_path / "load.png")
    p2 = plot_ttft_cdf({"a": [0.1, 0.2, 5.0], "b": [0.3]}, tmp_path / "cdf.png")
    for p in (p1, p2):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 5000
    table = comparison_table({"kv_aware": {"chr": 0.9, "affinity_breaks": {"evicted": 2}}, "hash": {"chr": 0.5}})
    assert [c.header for c in table.columns] == ["measure", "kv_aware", "hash"]
    assert "0.900" in list(table.columns[1].cells)
    assert table.caption is None
    # a router whose lanes ran out of sessions is named under the table: its requests measure the pool too
    spent = comparison_table({"kvroute": {"requests": 90, "lanes_spent": 3}, "peer": {"requests": 95, "lanes_spent": 0}})
    assert isinstance(spent.caption, str)
    assert spent.caption.startswith("lanes out of sessions before the window ended: kvroute 3. ")
    assert "3" in list(spent.columns[1].cells) and "0" in list(spent.columns[2].cells)


def test_histogram_quantiles_interpolate_within_buckets() -> None:
    from loadtests.report import histogram_quantiles

    text = (
        "# TYPE x_seconds histogram\n"
        'x_seconds_bucket{route="a",le="0.001"} 40.0\n'
        'x_seconds_bucket{route="a",le="0.002"} 80.0\n'
        'x_seconds_bucket{route="a",le="+Inf"} 80.0\n'
        'x_seconds_bucket{route="b",le="0.001"} 10.0\n'
        'x_seconds_bucket{route="b",le="0.002"} 19.0\n'
        'x_seconds_bucket{route="b",le="+Inf"} 20.0\n'
        "x_seconds_count 100.0\nx_seconds_sum 0.1\n"
    )
    p50, p90, p999 = histogram_quantiles(text, "x_seconds", (0.5, 0.9, 0.999))
    assert p50 == pytest.approx(0.001)  # 50 of 100 at or below 1 ms
    assert p90 == pytest.approx(0.001 + 0.001 * (90 - 50) / (99 - 50))
    assert p999 == pytest.approx(0.002)  # the +Inf bucket reports its lower bound
    assert histogram_quantiles(text, "missing", (0.5,)) == [None]


def test_demo_scenario_workloads() -> None:
    from loadtests.demo import DemoScenario
    from loadtests.workloads import turn_inputs

    syn = DemoScenario(sessions=3, session_pool_factor=2).workload()
    assert len(syn) == 6
    assert syn == DemoScenario(sessions=3, session_pool_factor=2).workload()  # deterministic for a seed
    weka = DemoScenario(sessions=2, session_pool_factor=2, workload_kind="weka").workload()
    assert 1 <= len(weka) <= 4
    window = DemoScenario().duration_s / DemoScenario().time_scale * DemoScenario().start_spread_frac
    assert all(0 <= s.start_s <= window for s in weka)
    assert all(x <= 250_000 for s in weka for chain in s.walk() for x in turn_inputs(chain))
    # Mooncake's chat sessions: the whole trace in a seeded order (short sessions: a lane runs many)
    mc = DemoScenario(workload_kind="mooncake", seed=3).workload()
    assert len(mc) > 7_000 and all(s.source == "mooncake" for s in mc)
    assert [s.session_id for s in mc] != [s.session_id for s in DemoScenario(workload_kind="mooncake", seed=4).workload()]
    assert all(0 <= s.start_s <= window for s in mc)
    assert max(s.turns[0].input_tokens for s in mc) > 100_000  # some open with a giant prompt
    with pytest.raises(ValueError, match="unknown workload"):
        DemoScenario(workload_kind="nope").workload()
    from router.policy.params import PolicyParams

    args = DemoScenario(token_unit=100).kvroute_args()
    # token parameters scaled to emulated tokens
    assert f"default_capacity_tokens={PolicyParams().default_capacity_tokens // 100}" in args
    # durations scaled to the fleet's clock: at time_scale 0.1, 120 modelled s are 12 wall s
    fast = DemoScenario(time_scale=0.1)
    assert f"fresh_window_s={PolicyParams().fresh_window_s * 0.1:g}" in fast.kvroute_args()
    env = fast.kvroute_env()
    assert env["KVROUTE_STORE__ACTIVE_WINDOW_S"] == "6" and env["KVROUTE_STORE__RAMP_WINDOW_S"] == "1"
    assert env["KVROUTE_HEALTH__SCRAPE_INTERVAL_S"] == "0.1"
    # and the gateway takes them: the same settings through kvroute's own config loader
    from router.config import load_config

    cfg = load_config(["--port", "0", *fast.kvroute_args()], env)
    assert cfg.store.active_window_s == 6.0 and cfg.health.scrape_interval_s == 0.1
    assert cfg.policy_params_obj().fresh_window_s == 12.0


def test_the_pool_is_sized_in_the_drivers_tokens() -> None:
    """A real engine counts its KV in its own tokenizer's tokens, more of them than the driver's
    (4 bytes each): the pooled bound's cache is resized by the ratio the engines' usage shows, so it
    holds what the fleet's KV holds, not that many driver tokens."""
    run = _Run(LoadConfig(url="http://127.0.0.1:9"), None, LiveStats(), FleetKv(1, 1000, 0))  # type: ignore[arg-type]
    assert run.pooled is not None and run.token_ratio() is None
    first, second = list(range(400)), list(range(10_000, 10_400))

    def first_kept() -> int:
        run.pooled.insert(first)
        run.pooled.insert(second)  # 800 tokens: both fit a 1,000-token pool, not a 333-token one
        return run.pooled.hit(first, 401)

    assert first_kept() == 400
    run._learn_token_ratio(3_000, 1_000)  # the engines counted 3 of their tokens per driver token
    assert run.token_ratio() == 3.0
    assert first_kept() == 0  # the pool is now a third of what /server_info said, in driver tokens
    run._learn_token_ratio(3_030, 1_000)  # the running ratio moves by 0.5 %: no second resize
    assert run.token_ratio() == 3.015 and run.pool_ratio == 3.0


async def test_the_fleet_kv_counts_every_data_parallel_rank() -> None:
    """SGLang's ``/server_info`` gives one data-parallel rank's pool (a real ``--dp-size 2`` engine
    started with a 3,000-token pool reports 3,000): the pooled bound is sized on all of them."""
    import aiohttp
    from aiohttp import web

    from loadtests.live import _fleet_kv
    from loadtests.procs import free_port

    infos = {"/a": {"page_size": 16, "max_total_num_tokens": 3000, "dp_size": 2, "enable_hierarchical_cache": True,
                    "hicache_ratio": 2},
             "/b": {"page_size": 16, "max_total_num_tokens": 1000, "dp_size": 1},
             "/c": {"page_size": 16, "max_total_num_tokens": 500}}  # fmt: skip

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(infos["/" + request.match_info["name"]])

    app = web.Application()
    app.router.add_get("/{name}/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            kv = await _fleet_kv(http, [f"http://127.0.0.1:{port}/{n}" for n in "abc"])
    finally:
        await runner.cleanup()
    assert kv == FleetKv(page_size=16, capacity_tokens=2 * 3000 + 1000 + 500, host_capacity_tokens=2 * 6000)


def test_a_workload_gets_its_own_token_unit_unless_one_is_given() -> None:
    from loadtests.scenario import demo_scenario

    assert demo_scenario(workload_kind="mooncake").token_unit == 32
    assert demo_scenario(workload_kind="mooncake", token_unit=100).token_unit == 100
    assert demo_scenario(workload_kind="mooncake", token_unit=None).token_unit == 32  # a flag left unset
    assert demo_scenario(workload_kind="weka").token_unit == demo_scenario().token_unit == 100


def _ideal_hits(unit: int, sessions: int) -> tuple[float, float]:
    """(the simulator's, the live driver's) hit rate of one infinite cache over the first Mooncake
    sessions of the bench's scenario at ``unit`` model tokens per emulated token."""
    from dataclasses import replace

    from loadtests.parity import WORKLOADS, ideal_hits_by_kind
    from loadtests.scenario import demo_scenario

    sc = replace(demo_scenario(**WORKLOADS["mooncake"], seed=1), token_unit=unit)
    kinds = ideal_hits_by_kind(sc, sessions).values()
    total = sum(k[1] for k in kinds)
    return sum(k[2] for k in kinds) / total, sum(k[3] for k in kinds) / total


def test_the_live_driver_renders_mooncake_as_the_simulator_names_it() -> None:
    # Mooncake's sessions share one 512-token block. At 100 model tokens per emulated token the chat
    # template's common markers stood for ~1,800 shared tokens: the driver's ideal was 0.04-0.05 above
    sim, live = _ideal_hits(32, 400)
    assert abs(sim - live) <= 0.01, (sim, live)
    sim, live = _ideal_hits(100, 400)
    assert live - sim > 0.025, (sim, live)


# (session, replica, main, route reason, counted as a move): kvroute names its reason on every
# response; the peers name none
_KVROUTE_TURNS = [
    ("s", "r1", True, "placed_new", False),
    ("s", "r1", True, "affinity", False),
    ("s", "r2", True, "queue_spill", False),  # rule 8: this request only, the session stays bound
    ("s", "r1", True, "affinity", False),  # back home after a spill: no move either
    ("s", "r3", False, "thicc_split", False),  # a sub-agent on an overflow
    ("s", "r3", False, "thicc_split", False),  # its conversation followed there
    ("s", "r2", True, "retry", False),
    ("s", "r1", True, "affinity", False),
    ("s", "r4", True, "placed_evicted", True),  # its cache was gone: a new home
    ("s", "r4", False, "affinity", False),
    ("s", "r5", True, "reassigned_overload", True),
    ("t", "r5", True, "placed_new", False),  # another session's first request
    ("t", "r1", True, "reassigned_gone", True),
]
_PEER_TURNS = [
    ("s", "r1", True, None, False),
    ("s", "r2", False, None, False),  # a sub-agent elsewhere: the main conversation's replica counts
    ("s", "r1", True, None, False),
    ("s", "r2", True, None, True),
    ("t", "r2", True, None, False),
]
# kvroute's baselines name a reason but bind nothing: counted as the peers are
_BASELINE_TURNS = [(sid, rep, main, None if reason is None else "random", want) for sid, rep, main, reason, want in _PEER_TURNS]


@pytest.mark.parametrize(
    "turns", [_KVROUTE_TURNS, _PEER_TURNS, _BASELINE_TURNS], ids=["kvroute", "peer", "kvroute-baseline"]
)
def test_a_move_is_a_change_of_home_as_the_simulator_counts_it(
    turns: list[tuple[str, str, bool, str | None, bool]],
) -> None:
    """A request that leaves home for itself only (rule 8's spill, an overflow, a retry) is no move,
    nor is the turn back home: live had counted each spill twice (WEKA seed 7: 64 moves live against
    the simulator's 2)."""
    homes = HomeChanges()
    got = [homes.moved(sid, rep, main=main, reason=reason) for sid, rep, main, reason, _ in turns]
    assert got == [want for *_, want in turns]

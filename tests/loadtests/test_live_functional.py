"""The live driver against a real emulated replica over real sockets."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from loadtests.live import LoadConfig, engine_queue_from_metrics, run_load
from loadtests.measures import MEASURE_FIELDS
from loadtests.peers import emulated_fleet
from loadtests.workloads import SessionSpec, Turn, sticky_gateway
from replica.emulator.profiles import get_profile
from replica.emulator.runner import running_emulators, start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig

UNIT = 100


def _config(time_scale: float) -> EmulatorConfig:
    profile = get_profile("kimi-k2.6-b200-tp4").with_overrides(token_unit=UNIT, page_size=4)
    return EmulatorConfig(profile=profile, time_scale=time_scale)


def _session(sid: str, start_s: float, turns: int, parallel_at: int | None = None) -> SessionSpec:
    ts = tuple(
        Turn(
            new_tokens=8_000 if k == 0 else 1_500,
            output_tokens=300,
            think_s=0.0 if k == 0 else 0.5,
            parallel=3 if k == parallel_at else 1,
        )
        for k in range(turns)
    )
    return SessionSpec(session_id=sid, start_s=start_s, shared_prefix_tokens=20_000, turns=ts)


async def test_cached_tokens_grow_across_turns_and_measures_are_complete() -> None:
    async with running_emulators(1, config=_config(0.01)) as reps:
        url = reps[0].url
        sessions = [_session("alpha", 0.0, 5), _session("beta", 20.0, 4, parallel_at=2)]
        cfg = LoadConfig(
            url=url, replica_urls=(url,), time_scale=0.01, token_unit=UNIT, duration_s=20.0,
            # the run lasts ~0.25 s of wall time and a request ~5 ms: sample often enough to see one
            sample_interval_s=0.002, drain_s=5.0,
        )
        result = await run_load(sessions, cfg)
    m = result.measures
    assert set(MEASURE_FIELDS) <= set(m)
    assert m["time_unit"] == "modelled_s" and m["token_unit"] == UNIT
    assert m["errors"] == 0 and m["censored"] == 0
    assert m["requests"] == 5 + 4 + 2  # beta's turn 2 is sent three times at once
    # the engine's own histograms, read at the start (no warm-up) and after the run
    assert 0.0 <= m["engine_queue_share"] <= 1.0
    assert 0.0 <= m["engine_queue_mean_s"] <= m["engine_queue_p99_s"] + 1e-9

    by_session: dict[str, list] = {}
    for o in sorted(result.outcomes, key=lambda o: o.t_start):
        by_session.setdefault(o.session_id, []).append(o)
    alpha = [o for o in by_session["alpha"] if not o.side]
    assert alpha[0].cached_tokens == 0  # cold replica
    cached = [o.cached_tokens for o in alpha]
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    for o in alpha[1:]:
        # a warm continuation on a replica with room for everything hits exactly the ideal: its
        # previous prompt up to the closing marker, in whole pages (4 emulated tokens, read from the
        # replica's /server_info)
        assert o.cached_tokens == o.ideal_cached_tokens > 0
        assert o.ideal_cached_tokens % (4 * UNIT) == 0
        assert o.input_tokens > o.cached_tokens
    beta = by_session["beta"]
    # beta starts after alpha sent the shared prefix: its first turn hits the shared 20k tokens
    assert 18_000 <= beta[0].cached_tokens <= 23_000  # + a few chat-template tokens
    assert beta[0].cached_tokens == beta[0].ideal_cached_tokens
    assert sum(o.side for o in beta) == 2
    assert all(o.replica == "replica-0" for o in result.outcomes)
    assert m["chr"] > 0.5 and m["ideal_chr"] >= m["chr"] - 0.02
    assert m["ttft_p50_s"] > 0 and m["e2e_p99_s"] >= m["ttft_p99_s"]
    # load sampled from the replica itself: something was in flight at some sample
    assert result.load_samples and max(max(loads) for _, loads in result.load_samples) >= 1


async def test_duration_bounds_the_run_and_fresh_connections_work() -> None:
    async with running_emulators(1, config=_config(0.01)) as reps:
        url = reps[0].url
        cfg = LoadConfig(
            url=url, replica_urls=(url,), time_scale=0.01, token_unit=UNIT, duration_s=1.0,
            fresh_connections=True, drain_s=2.0,
        )
        # far more turns than fit in one second of wall time
        result = await run_load([_session("long", 0.0, 500)], cfg)
    m = result.measures
    assert 1 <= m["requests"] < 500
    assert m["errors"] == 0
    assert m["wall_s"] < 1.0 + 2.0 + 1.0


async def test_errors_are_counted_not_raised() -> None:
    cfg = LoadConfig(url="http://127.0.0.1:9", time_scale=0.01, token_unit=UNIT, duration_s=1.0, drain_s=1.0)
    result = await run_load([_session("x", 0.0, 2)], cfg)
    assert result.measures["errors"] == result.measures["requests"] >= 1
    assert all(not o.ok and o.error for o in result.outcomes)


@pytest.mark.parametrize("stream", [False])
async def test_non_streaming_mode(stream: bool) -> None:
    async with running_emulators(1, config=_config(0.01)) as reps:
        url = reps[0].url
        cfg = LoadConfig(url=url, replica_urls=(url,), time_scale=0.01, token_unit=UNIT, duration_s=10.0,
                         stream=stream)
        result = await run_load([_session("ns", 0.0, 3)], cfg)
    assert result.measures["requests"] == 3 and result.measures["errors"] == 0
    assert result.outcomes[-1].cached_tokens > 0


@pytest.mark.parametrize("assign", ["round_robin", "sticky"])
async def test_with_several_gateways_requests_go_round_robin_or_a_sessions_to_one(assign: str) -> None:
    """Two emulators stand in for two gateways (each names itself in its replies): round robin
    spreads a session's requests over both, sticky sends all of a session's to one of them (a
    client pod's sidecar), chosen by its id as the simulator chooses."""
    async with running_emulators(2, config=_config(0.01)) as reps:
        cfg = LoadConfig(url=reps[0].url, extra_urls=(reps[1].url,), time_scale=0.01, token_unit=UNIT,
                         duration_s=20.0, gateway_assign=assign)  # fmt: skip
        result = await run_load([_session(f"s{i}", 0.0, 4) for i in range(6)], cfg)
    m = result.measures
    assert m["requests"] == 24 and m["errors"] == 0 and m["gateway_assign"] == assign
    served: dict[str, set[str | None]] = {}
    for o in result.outcomes:
        served.setdefault(o.session_id, set()).add(o.replica)
    names = {r for rs in served.values() for r in rs}
    assert names == {"replica-0", "replica-1"}
    if assign == "sticky":
        assert all(rs == {f"replica-{sticky_gateway(sid, 2)}"} for sid, rs in served.items()), served
    else:
        assert any(len(rs) == 2 for rs in served.values()), served
    with pytest.raises(ValueError, match="gateway_assign"):
        LoadConfig(url=reps[0].url, gateway_assign="random")


async def test_lanes_keep_a_fixed_number_of_sessions_alive() -> None:
    async with running_emulators(1, config=_config(0.01)) as reps:
        url = reps[0].url
        cfg = LoadConfig(url=url, replica_urls=(url,), time_scale=0.01, token_unit=UNIT, duration_s=20.0,
                         lanes=2)
        sessions = [_session(f"s{i}", 0.0, 3) for i in range(5)]
        result = await run_load(sessions, cfg)
    assert result.measures["requests"] == 15 and result.measures["errors"] == 0
    # both lanes ran out of sessions long before the window ended (as the simulator counts them)
    assert result.measures["lanes_spent"] == 2
    spans = {}
    for o in result.outcomes:
        lo, hi = spans.get(o.session_id, (o.t_start, o.t_start + o.e2e_s))
        spans[o.session_id] = (min(lo, o.t_start), max(hi, o.t_start + o.e2e_s))
    assert len(spans) == 5
    # never more than two sessions active at once
    for t in sorted(lo for lo, _ in spans.values()):
        assert sum(lo <= t < hi for lo, hi in spans.values()) <= 2
    # a lane runs its sessions in order: s2 starts after s0 ended
    assert spans["s2"][0] >= spans["s0"][1]


@pytest.mark.slow
async def test_kvroute_load_cli_against_an_emulated_fleet(tmp_path: Path) -> None:
    import asyncio
    import json

    out = tmp_path / "load.json"
    args = ["--time-scale", "0.02", "--token-unit", str(UNIT), "--set", "page_size=4"]
    async with emulated_fleet(2, args, log_dir=tmp_path) as fleet:
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "kvroute"), "load", "--url", fleet.urls[0],
            "--replica-url", fleet.urls[0], "--replica-url", fleet.urls[1], "--sessions", "4", "--lanes", "4",
            "--duration", "2", "--time-scale", "0.02", "--token-unit", str(UNIT), "--json", str(out),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    m = json.loads(out.read_text())
    assert json.loads(stdout) == m
    assert set(MEASURE_FIELDS) <= set(m)
    assert m["requests"] > 4 and m["errors"] == 0 and m["chr"] > 0
    assert m["dispersion"] is not None  # sampled from both replicas (one of them never gets traffic)
    assert m["p_load_le1"] > 0


@pytest.mark.parametrize(
    ("args", "rc", "says"),
    [
        (["--url", "notaurl"], 2, "--url: expected http://host:port"),
        (["--sessions", "0"], 2, "--sessions must be >= 1"),
        (["--duration", "-1"], 2, "duration_s must be > 0"),
        (["--time-scale", "0"], 2, "time_scale must be > 0"),
        (["--workload", "weka", "--trace", "/nonexistent/trace.jsonl"], 2, "No such file"),
        (["--json", "/nonexistent/dir/out.json"], 2, "--json: no such directory"),
        ([], 1, "every request failed"),  # nothing listens on the port: not a measurement
        # many sessions: some start as the run stops, outside the measured window; they were in the
        # count by kind but not in the count of failures ("every request failed (56: ... 59)")
        (["--sessions", "5000"], 1, "every request failed"),
    ],
    ids=["url", "sessions", "duration", "time-scale", "trace", "json-dir", "all-failed", "all-failed-many"],
)
async def test_kvroute_load_cli_refuses_bad_input_without_a_traceback(args: list[str], rc: int, says: str) -> None:
    import asyncio
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    argv = ["--url", dead, "--duration", "1", "--no-progress", *args]
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "kvroute"), "load", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    err = stderr.decode()
    assert proc.returncode == rc, err[-2000:]
    assert says in err and "Traceback" not in err, err[-2000:]
    if rc == 1:  # one count: the failures by kind add up to the failures (were 70 vs 71)
        import re

        (line,) = [x for x in err.splitlines() if "every request failed" in x]
        m = re.fullmatch(r"kvroute load: every request failed \((\d+): (.+)\)", line)
        assert m is not None, line
        kinds = [kind.rsplit(" ", 1) for kind in m.group(2).split(", ")]
        assert sum(int(n) for _, n in kinds) == int(m.group(1)) > 0, line


async def test_engine_queue_sums_replicas_and_refuses_what_lacks_the_histogram() -> None:
    """The fleet's reading is the sum of each replica's ``/metrics``; an exposition without SGLang's
    queue-time histogram (a server that is not an engine) gives None, never zeros."""
    async with running_emulators(2, config=_config(0.01)) as reps:
        url = reps[0].url
        cfg = LoadConfig(url=url, replica_urls=(url,), time_scale=0.01, token_unit=UNIT, duration_s=5.0, drain_s=5.0)
        await run_load([_session("alpha", 0.0, 3)], cfg)
        async with aiohttp.ClientSession() as s:
            texts = [await (await s.get(f"{r.url}/metrics")).text() for r in reps]
    one = engine_queue_from_metrics(texts[:1])
    both = engine_queue_from_metrics(texts)
    assert one is not None and both is not None
    assert one.queue_count == 3 and both.queue_count == 3  # the second replica served nothing
    assert dict(both.buckets)[float("inf")] == 3 and both.ttft_count == 3
    assert both.queue_sum == pytest.approx(one.queue_sum)
    assert engine_queue_from_metrics([texts[0], generate_latest(CollectorRegistry()).decode()]) is None
    with pytest.raises(ValueError):
        engine_queue_from_metrics(["not { a metric exposition"])


@pytest.mark.parametrize("flag", [[], ["--no-session-id"]], ids=["session-id", "no-session-id"])
async def test_kvroute_load_sends_session_ids_unless_told_not_to(tmp_path: Path, flag: list[str]) -> None:
    """``--no-session-id`` drives a gateway as a plain OpenAI client would: no session header, so
    the gateway keys every request by its conversation's prompt (rule 7), and a session's turns
    still find their cache."""
    import asyncio
    import json

    from router.clock import SystemClock
    from router.gateway.serve import start_gateway
    from router.model import KeySource
    from router.policy import make_policy
    from router.store.memory import MemoryStore
    from tests.loadtests.test_parity_functional import RecordingPolicy
    from tests.router.conftest import fast_config

    out = tmp_path / "load.json"
    reps = await start_emulators(2, config=_config(0.02))
    try:
        cfg = fast_config([r.url for r in reps])
        clock = SystemClock()
        policy = RecordingPolicy(make_policy("kv_aware"))
        gw = await start_gateway(cfg, MemoryStore(clock, cfg.store.to_store_config()), policy=policy, clock=clock)
        try:
            proc = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).parent / "kvroute"), "load", "--url", gw.url, "--sessions", "3",
                "--lanes", "3", "--duration", "3", "--time-scale", "0.02", "--token-unit", str(UNIT),
                "--json", str(out), "--no-progress", *flag,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
        finally:
            await gw.close()
    finally:
        await stop_emulators(reps)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    m = json.loads(out.read_text())
    assert m["requests"] >= 6 and m["errors"] == 0 and m["chr"] > 0.3
    sources = {req.key_source for req, _, _ in policy.calls}
    keys = {req.session_key for req, _, _ in policy.calls}
    if flag:
        assert sources == {KeySource.PREFIX} and all(k is not None and k.startswith("p") for k in keys)
    else:
        assert sources == {KeySource.HEADER} and not any(k is not None and k.startswith("p") for k in keys)
    assert len(keys) >= 3  # a key per session (each synthetic session's main chain is one conversation)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
async def test_messages_and_responses_apis_are_measured_as_chat_is(stream: bool) -> None:
    """``api="messages"`` (Claude Code's /v1/messages) and ``api="responses"`` (Codex's
    /v1/responses): the same sessions give the same prompt, cached and output tokens turn by turn as
    chat completions, read from each API's usage (the Responses API's model name from /v1/models)."""
    runs = {}
    for api in ("chat", "messages", "responses"):
        async with running_emulators(1, config=_config(0.01)) as reps:
            url = reps[0].url
            cfg = LoadConfig(url=url, replica_urls=(url,), time_scale=0.01, token_unit=UNIT, duration_s=20.0,
                             drain_s=5.0, stream=stream, api=api)  # fmt: skip
            runs[api] = await run_load([_session("alpha", 0.0, 4)], cfg)
    for run in runs.values():
        assert run.measures["errors"] == 0 and run.measures["requests"] == 4
    turns = {api: sorted(r.outcomes, key=lambda o: o.t_start) for api, r in runs.items()}
    for api in ("messages", "responses"):
        assert [(o.input_tokens, o.cached_tokens, o.output_tokens) for o in turns[api]] == [
            (o.input_tokens, o.cached_tokens, o.output_tokens) for o in turns["chat"]
        ], api
        assert turns[api][0].cached_tokens == 0 and turns[api][-1].cached_tokens > 0
        assert all(o.ttft_s is not None and o.ttft_s > 0 for o in turns[api])

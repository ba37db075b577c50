"""The emulator with SGLang's ``--dp-size``: several schedulers behind one port, each its own engine,
radix cache, KV-event publisher, ``/v1/loads`` entry and ``dp_rank`` metric labels. Each behaviour
here was read off a real SGLang 0.5.23 ``--dp-size 2`` engine on this machine (6 Dec 2026; the real
engine's own checks are in tests/router/test_kv_events_real_sglang.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from loadtests.real_sglang import kv_events_config
from replica.emulator.cli import build_config, parser
from replica.emulator.profiles import get_profile
from replica.emulator.runner import Running, start_emulators, stop_emulators
from replica.emulator.server import DP_RANK_HEADER, EmulatorConfig
from router.engine_metrics import load_from_v1_loads, parse_engine_metrics
from tests.router.conftest import fast_config, wait_for
from tests.router.test_gateway_kv_events_functional import gateway

PROFILE = get_profile("small-test").with_overrides(kv_capacity_tokens=4096, host_capacity_tokens=0)


async def _serve(dp_size: int, kv: str | None = None, time_scale: float = 0.002) -> list[Running]:
    cfg = EmulatorConfig(profile=PROFILE, time_scale=time_scale, dp_size=dp_size, kv_events_config=kv)
    return await start_emulators(1, config=cfg)


@pytest.fixture
async def dp2() -> AsyncIterator[Running]:
    reps = await _serve(2)
    try:
        yield reps[0]
    finally:
        await stop_emulators(reps)


async def _chat(
    http: aiohttp.ClientSession, url: str, msgs: list[dict[str, str]], **headers: str
) -> tuple[int, dict[str, Any]]:
    body = {"model": "m", "messages": msgs, "max_tokens": 4, "return_meta_info": True}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _conversation(http: aiohttp.ClientSession, url: str, tag: str, turns: int, **headers: str) -> list[tuple[int, int, int]]:
    """(rank, cached, prompt tokens) of each turn of one conversation."""
    msgs = [{"role": "user", "content": f"conversation {tag} on a data-parallel engine " * 8}]
    out = []
    for t in range(turns):
        status, d = await _chat(http, url, msgs, **headers)
        assert status == 200, d
        u, meta = d["usage"], d["choices"][0]["meta_info"]
        out.append((meta["dp_rank"], u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]))
        msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"turn {t}"}]  # fmt: skip
    return out


async def test_unnamed_requests_go_round_robin_and_a_named_rank_keeps_its_cache(dp2: Running) -> None:
    """SGLang's default ``round_robin``: a conversation's turns alternate between the ranks, so a
    turn finds only what the turn before the last stored there (the real engine: 0 / 180, 0 / 204,
    187 / 230 ...); named to one rank, every turn finds the one before it."""
    async with aiohttp.ClientSession() as http:
        free = await _conversation(http, dp2.url, "free", 4)
        assert [r for r, _, _ in free] == [0, 1, 0, 1]
        assert free[1][1] == 0  # its rank never saw the first turn
        assert free[2][1] < free[1][2] and free[2][1] >= free[0][2] - PROFILE.page_size
        pinned = await _conversation(http, dp2.url, "pinned", 4, **{DP_RANK_HEADER: "1"})
        assert [r for r, _, _ in pinned] == [1, 1, 1, 1]
        for (_, _, prev), (_, cached, _) in itertools.pairwise(pinned):
            assert cached >= prev - PROFILE.page_size  # the whole previous prompt, to its last page
        body = {"text": "native " * 40, "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 1}
        for _ in range(2):
            async with http.post(dp2.url + "/generate", json=body) as r:
                meta = (await r.json())["meta_info"]
        assert meta["dp_rank"] == 1 and meta["cached_tokens"] > 0
        async with http.get(dp2.url + "/_emulator/state") as r:
            st = await r.json()
        assert st["dp_size"] == 2 and [x["dp_rank"] for x in st["ranks"]] == [0, 1]
        assert st["ranks"][1]["cache"]["admitted"] > st["ranks"][0]["cache"]["admitted"]


async def test_a_rank_the_engine_lacks_is_refused_as_sglang_refuses_it(dp2: Running) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        status, d = await _chat(http, dp2.url, msgs, **{DP_RANK_HEADER: "2"})
        assert (status, d["message"], d["type"]) == (400, "routed_dp_rank=2 out of range [0, 2)", "BadRequestError")
        status, d = await _chat(http, dp2.url, msgs, **{DP_RANK_HEADER: "x"})
        assert (status, d["message"], d["type"]) == (
            400, "Invalid X-Data-Parallel-Rank header: must be an integer, got 'x'", "400")  # fmt: skip
        # the header wins over the body on the OpenAI routes
        body = {"model": "m", "messages": msgs, "max_tokens": 2, "routed_dp_rank": 7, "return_meta_info": True}
        async with http.post(dp2.url + "/v1/chat/completions", json=body, headers={DP_RANK_HEADER: "0"}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["meta_info"]["dp_rank"] == 0
        gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": -1}
        async with http.post(dp2.url + "/generate", json=gen) as r:
            assert (r.status, await r.json()) == (400, {"error": {"message": "routed_dp_rank=-1 out of range [0, 2)"}})
        async with http.post(dp2.url + "/generate", json={**gen, "stream": True}) as r:
            assert r.status == 200  # a streamed /generate has answered before the tokenizer manager checks
            assert await r.text() == (
                'data: {"error":{"message":"routed_dp_rank=-1 out of range [0, 2)","type":"invalid_request_error",'
                '"code":400,"retryable":false}}\n\ndata: [DONE]\n\n'
            )
        async with http.post(dp2.url + "/generate", json={**gen, "routed_dp_rank": "x"}) as r:
            assert r.status == 400 and "routed_dp_rank" in (await r.json())["message"]
        async with http.get(dp2.url + "/_emulator/state") as r:
            assert (await r.json())["requests_served"] == 1  # nothing refused ran
    reps = await _serve(1)
    try:
        async with aiohttp.ClientSession() as http:
            assert (await _chat(http, reps[0].url, msgs, **{DP_RANK_HEADER: "0"}))[0] == 200  # ignored without DP
            status, d = await _chat(http, reps[0].url, msgs, **{DP_RANK_HEADER: "1"})
            assert (status, d["message"]) == (400, "routed_dp_rank=1 out of range [0, 1)")
    finally:
        await stop_emulators(reps)


@pytest.fixture
async def dp2_slow() -> AsyncIterator[Running]:
    # a 2,000-token reply runs ~9 s here; at dp2's time scale a 3 s stall of a busy CI machine let it
    # finish before the last check that needs it running (reproduced with a sleep before that check)
    reps = await _serve(2, time_scale=0.5)
    try:
        yield reps[0]
    finally:
        await stop_emulators(reps)


async def test_each_rank_reports_its_own_load_as_sglang_does(dp2_slow: Running) -> None:
    """``/v1/loads`` has an entry per rank (``?dp_rank=R`` filters; a rank the engine lacks lists
    nothing), ``/metrics`` labels the scheduler's series by ``dp_rank`` and not the request series,
    ``/server_info`` gives one rank's pool and a state per rank; what kvroute's discovery reads off
    them is each rank's own figures."""
    dp2 = dp2_slow
    slow = {"model": "m", "messages": [{"role": "user", "content": "long " * 30}], "max_tokens": 2000}
    async with aiohttp.ClientSession() as http:
        task = asyncio.ensure_future(http.post(dp2.url + "/v1/chat/completions", json=slow, headers={DP_RANK_HEADER: "1"}))
        try:
            async def running_on_1() -> bool:
                async with http.get(dp2.url + "/v1/loads?include=core") as r:
                    loads = (await r.json())["loads"]
                return [(x["dp_rank"], x["num_running_reqs"]) for x in loads] == [(0, 0), (1, 1)]

            await wait_for(running_on_1, 10)
            async with http.get(dp2.url + "/v1/loads?include=core&dp_rank=1") as r:
                one = await r.json()
            assert [x["dp_rank"] for x in one["loads"]] == [1]
            assert load_from_v1_loads(one, now=1.0, dp_rank=1).running == 1
            assert load_from_v1_loads(one, now=1.0, dp_rank=1).capacity_tokens == PROFILE.capacity_tokens
            async with http.get(dp2.url + "/v1/loads?dp_rank=2") as r:
                assert (await r.json())["loads"] == []
            async with http.get(dp2.url + "/v1/loads?format=prometheus") as r:
                prom = await r.text()
            assert '# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="0"} 0\n' \
                'sglang_num_running_reqs{dp_rank="1"} 1\n' in prom
            async with http.get(dp2.url + "/metrics") as r:
                text = await r.text()
            assert [parse_engine_metrics(text, dp_rank=r).running for r in (0, 1)] == [0, 1]
            assert parse_engine_metrics(text, dp_rank=1).capacity_tokens == PROFILE.capacity_tokens
            running = [ln for ln in text.splitlines() if ln.startswith("sglang:num_running_reqs{")]
            assert [ln.split("{")[1].split(",")[0] for ln in running] == ['dp_rank="0"', 'dp_rank="1"']
            assert all("dp_rank" not in ln for ln in text.splitlines() if ln.startswith("sglang:num_requests_total"))
            async with http.get(dp2.url + "/server_info") as r:
                info = await r.json()
            assert (info["dp_size"], info["max_total_num_tokens"], len(info["internal_states"])) == (
                2, PROFILE.capacity_tokens, 2)  # fmt: skip
            async with http.get(dp2.url + "/flush_cache") as r:
                assert r.status == 400  # a request is running on a rank
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_each_rank_is_a_replica_of_the_gateway_with_its_own_events() -> None:
    """What ``kvroute bench peers --engine-dp 2`` runs on emulated engines: the gateway with
    ``--replica-dp-ranks 2`` follows each rank's publisher (port + rank), reads each rank's load,
    and every turn of a session finds the one before it cached on its rank alone (the real engine:
    ``test_each_rank_of_a_data_parallel_engine_is_a_replica_of_its_own``)."""
    kv = kv_events_config(2)
    reps = await _serve(2, kv)
    try:
        engine = f"127.0.0.1:{reps[0].port}"
        units = [f"{engine}-dp0", f"{engine}-dp1"]
        cfg = fast_config([reps[0].url], admin_insecure=True, kv_events={"refresh_s": 0.2}, replica_dp_ranks=2)
        async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
            svc = gw.runtime.residency
            assert svc is not None and svc.manager is not None

            async def read() -> bool:
                rs = (await gw.store.snapshot(None)).replicas
                return [(r.id, r.dp_rank, r.capacity_tokens, r.status.value) for r in rs] == [
                    (units[0], 0, PROFILE.capacity_tokens, "active"), (units[1], 1, PROFILE.capacity_tokens, "active")]  # fmt: skip

            await wait_for(read, 15)
            base = json.loads(kv)["endpoint"].rpartition(":")[2]
            stats = svc.manager.stats()
            assert [stats[u]["endpoint"] for u in units] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{int(base) + 1}"]

            def holding(sid: str) -> list[str]:
                return [u for u in units if svc.manager.index.ranks(u)[0].resident_tokens(sid)]

            placed: dict[str, str] = {}
            for i in range(6):
                sid = f"emu-rank-{i}"
                msgs = [{"role": "user", "content": f"session {i} on one rank " * 12}]
                last = None
                for turn in range(3):
                    body = {"model": "m", "messages": msgs, "max_tokens": 8}
                    async with http.post(gw.url + "/v1/chat/completions", json=body,
                                         headers={"Modal-Session-Id": sid}) as r:  # fmt: skip
                        assert r.status == 200, await r.text()
                        where = r.headers["X-Kvroute-Replica"]
                        d = await r.json()
                    assert placed.setdefault(sid, where) == where
                    if last is not None:
                        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] >= last - PROFILE.page_size
                    last = d["usage"]["prompt_tokens"]
                    msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                            {"role": "user", "content": f"step {turn}"}]  # fmt: skip
                    await wait_for(lambda sid=sid: holding(sid) != [], 10)  # type: ignore[misc]
                    assert holding(sid) == [where]
            assert set(placed.values()) == set(units)
            # native /generate reads its rank from the body: the gateway puts its replica's rank there
            for turn in range(2):
                body = {"text": "a native session " * 20, "sampling_params": {"max_new_tokens": 4}}
                async with http.post(gw.url + "/generate", json=body, headers={"Modal-Session-Id": "native"}) as r:
                    assert r.status == 200, await r.text()
                    where = r.headers["X-Kvroute-Replica"]
                    meta = (await r.json())["meta_info"]
                assert meta["dp_rank"] == units.index(where)
                assert placed.setdefault("native", where) == where, r.headers.get("X-Kvroute-Reason")
                if turn:
                    assert meta["cached_tokens"] >= meta["prompt_tokens"] - PROFILE.page_size
            assert not gw.runtime.rank_flights
    finally:
        await stop_emulators(reps)


@pytest.mark.parametrize(
    ("kv", "error"),
    [
        ('{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*"}', "ports must be numbers"),
        ('{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}', "at least 2 apart"),
    ],
)
def test_ranks_need_a_port_each_for_their_events(kv: str, error: str) -> None:
    """Rank r publishes on port + r: a free port (``*``) or replay ports inside that range would
    make subscribers read the wrong rank or collide."""
    with pytest.raises(ValueError, match=error):
        build_config(parser().parse_args(["--dp-size", "2", "--kv-events-config", kv]))
    with pytest.raises(ValueError, match="dp_size must be 1-64"):
        build_config(parser().parse_args(["--dp-size", "0"]))
    ok = build_config(parser().parse_args(
        ["--dp-size", "2", "--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5559"}']
    ))  # fmt: skip
    assert ok.dp_size == 2

"""An engine with several data-parallel ranks (each its own radix cache; SGLang ``--dp-size``): the
gateway names the session's rank in SGLang's ``X-Data-Parallel-Rank`` header, so a session's turns
meet their cache instead of the engine's round robin (against a real ``--dp-size 2`` engine:
docs/REAL_SGLANG.md §4)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from router.gateway.handlers import DP_RANK_HEADER
from router.policy.hashing import hrw_slot
from tests.router.conftest import FakeReplica, wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": {"model": "m", "prompt": "hi"}, "/generate": {"text": "hi"}}


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str) -> None:
    async with s.post(url, data=json.dumps(body), headers={"Content-Type": "application/json", **headers}) as r:
        await r.read()
        assert r.status == 200


async def _serve(gateway_factory: Any, replica: FakeReplica, ranks: int) -> Any:
    replica.state.loads, replica.state.dp_ranks = True, ranks
    gw = await gateway_factory([replica.url])

    async def known() -> bool:
        return [r.engine.dp_ranks for r in (await gw.store.snapshot(None)).replicas] == [ranks]

    await wait_for(known, 10)
    return gw


def _ranks(replica: FakeReplica) -> list[tuple[str | None, str, list[str]]]:
    """(session, route, ranks named) of every request the replica saw: in the header, or on native
    ``/generate`` (which reads no header) in the body's ``routed_dp_rank``."""
    out = []
    for r in replica.state.requests:
        named = r["headers"].getall(DP_RANK_HEADER, [])
        if r["path"] == "/generate":
            assert named == []
            rank = json.loads(r["body"]).get("routed_dp_rank")
            named = [] if rank is None else [str(rank)]
        out.append((r["headers"].get("Modal-Session-Id"), r["path"], named))
    return out


async def test_each_session_keeps_one_rank_and_sessions_spread_over_the_ranks(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    dp, single = await fake_replicas(2)
    gw_dp, gw_single = await _serve(gateway_factory, dp, 4), await _serve(gateway_factory, single, 1)
    via_dp, via_single = str(gw_dp.url), str(gw_single.url)
    sessions = [f"sess-{i}" for i in range(16)]
    async with aiohttp.ClientSession() as s:
        for _turn in range(2):
            for sid in sessions:
                for route, body in ROUTES.items():
                    await _post(s, via_dp + route, body, **{"Modal-Session-Id": sid})
                    await _post(s, via_single + route, body, **{"Modal-Session-Id": sid})
        await _post(s, via_dp + "/v1/chat/completions", CHAT, **{"Modal-Session-Id": "mine", DP_RANK_HEADER: "3"})
        await _post(s, via_dp + "/generate", {"text": "hi", "routed_dp_rank": 3}, **{"Modal-Session-Id": "mine-native"})
    seen = _ranks(dp)
    for sid, route, ranks in seen:
        if sid in ("mine", "mine-native"):
            assert ranks == ["3"]  # a client that names a rank keeps it, alone
        else:  # every turn of a session on every route (native /generate in its body): its own rank
            assert ranks == [str(hrw_slot(str(sid), 4))], (sid, route, ranks)
    assert len({ranks[0] for sid, _, ranks in seen if ranks and sid != "mine"}) == 4  # 16 sessions use all 4
    assert all(ranks == [] for _, _, ranks in _ranks(single))  # one rank: nothing to name
    assert len(seen) == len(_ranks(single)) + 2 == 2 * len(sessions) * len(ROUTES) + 2
    assert not gw_dp.runtime.rank_flights  # every request named to a rank was counted back


async def test_with_replica_dp_ranks_each_rank_is_a_replica_placed_by_the_policy(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    """``replica_dp_ranks`` 4: the engine is four replicas, ``host:port-dp0`` .. ``-dp3``, each reading
    its own rank's load (``/v1/loads?dp_rank=R``); the policy places sessions over them and every
    request of a session names its replica's rank."""
    (replica,) = await fake_replicas(1)
    replica.state.loads, replica.state.dp_ranks, replica.state.active = True, 4, 3
    gw = await gateway_factory([replica.url], replica_dp_ranks=4)
    engine = replica.url.removeprefix("http://")
    units = [f"{engine}-dp{r}" for r in range(4)]

    async def read() -> bool:
        reps = (await gw.store.snapshot(None)).replicas
        return [(r.id, r.dp_rank, r.engine.dp_ranks, r.engine.running, r.status.value) for r in reps] == [
            (units[0], 0, 1, 3, "active"), (units[1], 1, 1, 0, "active"), (units[2], 2, 1, 0, "active"),
            (units[3], 3, 1, 0, "active")]  # fmt: skip

    await wait_for(read, 10)  # rank 0's running requests are rank 0's alone
    assert {q for q in replica.state.loads_at if "dp_rank" in q} == {f"include=core&dp_rank={r}" for r in range(4)}
    sessions = [f"unit-{i}" for i in range(12)]
    placed: dict[str, set[str]] = {}
    async with aiohttp.ClientSession() as s:
        for _turn in range(2):
            for sid in sessions:
                for route, body in ROUTES.items():
                    async with s.post(str(gw.url) + route, json=body, headers={"Modal-Session-Id": sid}) as r:
                        await r.read()
                        assert r.status == 200
                        placed.setdefault(sid, set()).add(r.headers["X-Kvroute-Replica"])
    assert all(len(v) == 1 for v in placed.values()), placed  # one replica (rank) per session
    home = {sid: units.index(next(iter(v))) for sid, v in placed.items()}
    for sid, route, ranks in _ranks(replica):
        assert ranks == [str(home[str(sid)])], (sid, route, ranks)  # /generate: in its body
    assert len(set(home.values())) > 1, home  # the policy spreads them, by each rank's own load
    assert not gw.runtime.rank_flights


async def test_a_rank_the_engine_does_not_have_is_kept_out_of_service_until_it_has_it(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    """``replica_dp_ranks`` 3 in front of an engine of 2 ranks (discovery rule 9): SGLang would refuse
    every request named to rank 2, so that replica never becomes ACTIVE and takes no request; when the
    engine has the rank it comes in, when it loses it again it goes DOWN, and it comes back."""
    (replica,) = await fake_replicas(1)
    replica.state.loads, replica.state.dp_ranks = True, 2
    gw = await gateway_factory([replica.url], replica_dp_ranks=3)
    engine = replica.url.removeprefix("http://")

    async def statuses() -> dict[str, str]:
        return {r.id.removeprefix(engine + "-"): r.status.value for r in (await gw.store.snapshot(None)).replicas}

    async def are(want: dict[str, str]) -> bool:
        return await statuses() == want

    await wait_for(lambda: are({"dp0": "active", "dp1": "active", "dp2": "joining"}), 10)
    await asyncio.sleep(0.5)  # many health and scrape rounds (50 ms each)
    assert await statuses() == {"dp0": "active", "dp1": "active", "dp2": "joining"}
    async with aiohttp.ClientSession() as s:
        for i in range(12):
            await _post(s, str(gw.url) + "/v1/chat/completions", CHAT, **{"Modal-Session-Id": f"r{i}"})
    assert {tuple(ranks) for _, _, ranks in _ranks(replica)} <= {("0",), ("1",)}
    replica.state.dp_ranks = 3
    await wait_for(lambda: are({"dp0": "active", "dp1": "active", "dp2": "active"}), 10)
    replica.state.dp_ranks = 2
    await wait_for(lambda: are({"dp0": "active", "dp1": "active", "dp2": "down"}), 10)
    replica.state.dp_ranks = 3
    await wait_for(lambda: are({"dp0": "active", "dp1": "active", "dp2": "active"}), 10)


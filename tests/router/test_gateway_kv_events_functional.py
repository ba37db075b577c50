"""The gateway with exact residency (router/gateway/residency.py): it subscribes to the emulators that
publish KV events, forwards the session id so the engine names the session on its blocks, fills
``SessionState.resident_tokens`` in its snapshots, and shows ``residency_source`` per replica; with
Redis, one gateway publishes what it sees and another reads it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from replica.emulator.profiles import get_profile
from replica.emulator.runner import Running, start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.clock import SystemClock
from router.config import GatewayConfig
from router.gateway.forward import DP_RANK_FIELD, DP_RANK_FIELDS, with_first_field
from router.gateway.residency import with_session_id
from router.gateway.serve import RunningGateway, make_store, start_gateway
from router.observability.surface import operator_surface_from_config
from router.store.memory import MemoryStore
from tests.router.conftest import fast_config, wait_for

KV = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})


def _rank(body: bytes) -> bytes:
    return with_first_field(body, DP_RANK_FIELD, 2, DP_RANK_FIELDS)


def _sid(body: bytes) -> bytes:
    return with_session_id(body, "s1")


@pytest.mark.parametrize(
    ("splice", "body", "want"),
    [
        (_sid, b'{"a":1}', b'{"session_id":"s1","a":1}'),
        (_sid, b'  {\n "a":1}', b'  {"session_id":"s1",\n "a":1}'),
        (_sid, b"{}", b'{"session_id":"s1"}'),
        (_sid, b"{ }", b'{"session_id":"s1" }'),
        (_sid, b'{"session_id":"mine","a":1}', b'{"session_id":"mine","a":1}'),  # the client's own wins
        (_sid, b'{"session_params":{"id":"x"}}', b'{"session_params":{"id":"x"}}'),  # SGLang refuses both
        (_sid, b"[1,2]", b"[1,2]"),
        (_sid, b"", b""),
        # native /generate's data-parallel rank (router/gateway/handlers.py)
        (_rank, b'{"text":"hi"}', b'{"routed_dp_rank":2,"text":"hi"}'),
        (_rank, b'\r\n {\t"text":"hi"}', b'\r\n {"routed_dp_rank":2,\t"text":"hi"}'),
        (_rank, b"{\n}", b'{"routed_dp_rank":2\n}'),
        (_rank, b'{"text":"hi","routed_dp_rank":0}', b'{"text":"hi","routed_dp_rank":0}'),  # the client's own
        (_rank, b'{"data_parallel_rank":1}', b'{"data_parallel_rank":1}'),  # or its deprecated alias
        (_rank, b'{"text":"say \\"routed_dp_rank\\""}', b'{"routed_dp_rank":2,"text":"say \\"routed_dp_rank\\""}'),
        (_rank, b'{"x":{"routed_dp_rank":1}}', b'{"x":{"routed_dp_rank":1}}'),  # nested: only costs the pin
        (_rank, b'["routed_dp_rank"]', b'["routed_dp_rank"]'),
        (_rank, b"\xef\xbb\xbf{}", b"\xef\xbb\xbf{}"),  # not an object to SGLang either
        (_rank, b"   ", b"   "),
    ],
)
def test_a_field_is_spliced_first_into_a_json_object_only(
    splice: Callable[[bytes], bytes], body: bytes, want: bytes
) -> None:
    out = splice(body)
    assert out == want
    if out != body:  # what was added is the one field, first, and the rest is the client's
        field = {"session_id": "s1"} if splice is _sid else {"routed_dp_rank": 2}
        assert json.loads(out) == {**field, **json.loads(body)} and next(iter(json.loads(out))) == next(iter(field))


def test_with_session_id_escapes() -> None:
    assert json.loads(with_session_id(b'{"x":1}', 'a"b\\c'))["session_id"] == 'a"b\\c'


@pytest.fixture
async def kv_emulators() -> AsyncIterator[list[Running]]:
    prof = get_profile("small-test").with_overrides(kv_capacity_tokens=2048, host_capacity_tokens=0)
    reps = await start_emulators(2, config=EmulatorConfig(profile=prof, time_scale=0.002, kv_events_config=KV))
    try:
        yield reps
    finally:
        await stop_emulators(reps)


@contextlib.asynccontextmanager
async def gateway(cfg: GatewayConfig, store: Any = None) -> AsyncIterator[RunningGateway]:
    clock = SystemClock()
    surface = operator_surface_from_config(cfg)
    gw = await start_gateway(
        cfg,
        store if store is not None else MemoryStore(clock, cfg.store.to_store_config()),
        clock=clock,
        rng=random.Random(7),
        extra_setup=[surface.setup],
    )
    try:
        yield gw
    finally:
        await gw.close()


async def chat(http: aiohttp.ClientSession, url: str, sid: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "emulated/small-test", "messages": msgs, "max_tokens": 8}
    async with http.post(url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]


def synced(gw: RunningGateway, reps: list[Running]) -> bool:
    """Every emulator's published batches have been applied by the gateway's subscribers."""
    svc = gw.runtime.residency
    assert svc is not None and svc.manager is not None
    st = svc.manager.stats()
    for rep in reps:
        rid = rep.url.removeprefix("http://")
        pub = rep.replica.kv_publisher
        assert pub is not None
        if rid not in st or st[rid]["ranks"][0]["last_seq"] != pub.stats()["next_seq"] - 1:
            return False
    return True


async def five_turns(
    http: aiohttp.ClientSession, gw: RunningGateway, reps: list[Running], msgs: list[dict[str, str]],
    extra: dict[str, Any], headers: dict[str, str],
) -> tuple[list[str], list[int], set[str]]:
    """One conversation of five chat turns through ``gw``, each waiting for the engines' events:
    the reasons the gateway gave, the cached tokens each turn found, and the replicas it used."""
    reasons: list[str] = []
    cached: list[int] = []
    replicas: set[str] = set()
    for i in range(5):
        body = {"model": "emulated/small-test", "messages": msgs, "max_tokens": 8, **extra}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            d = await r.json()
            reasons.append(r.headers["X-Kvroute-Reason"])
            replicas.add(r.headers["X-Kvroute-Replica"])
        cached.append(d["usage"]["prompt_tokens_details"]["cached_tokens"])
        await wait_for(lambda: synced(gw, reps))
        msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"and then {i} " * 6}]  # fmt: skip
    return reasons, cached, replicas


async def test_gateway_subscribes_forwards_and_fills_snapshots(kv_emulators: list[Running]) -> None:
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        store = gw.store
        await wait_for(lambda: gw.runtime.residency is not None and len(gw.runtime.residency.manager.subscribed()) == 2)
        await wait_for(lambda: all(gw.runtime.residency.view.source(u.removeprefix("http://")) == "events" for u in urls))
        async with http.get(gw.url + "/admin/stats") as r:
            stats = await r.json()
        assert {v["residency_source"] for v in stats["replicas"]} == {"events"}
        # the same on /metrics, for alerts on a replica that falls back to the estimate
        ids = {u.removeprefix("http://") for u in urls}
        samples = await metric_samples(http, gw)
        assert {k[1] for k, v in samples.items() if k[0] == "kvroute_replica_residency_source" and v == 1} == {
            (("replica", i), ("source", "events")) for i in ids
        }
        for i in ids:
            assert samples[("kvroute_kv_events_connected", (("replica", i),))] == 1
            assert samples[("kvroute_kv_events_total", (("kind", "syncs"), ("replica", i)))] >= 1
            assert samples[("kvroute_kv_events_total", (("kind", "replay_failures"), ("replica", i)))] == 0

        msgs = [{"role": "user", "content": "explain the radix cache " * 12}]
        d = await chat(http, gw.url, "sess-1", msgs)
        for i in range(4):
            await wait_for(lambda: synced(gw, kv_emulators))
            snap = await store.snapshot("sess-1")
            assert snap.session is not None and snap.session.home is not None
            resident = snap.session.resident_tokens
            assert resident is not None and resident > 0  # the engine named the session: the gateway forwarded it
            assert snap.session.resident_on == ((snap.session.home, resident),)
            msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"and then {i} " * 6}]
            d = await chat(http, gw.url, "sess-1", msgs)
            assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == resident
        # the last turn's events arrive asynchronously: compare the two views once they are in
        await wait_for(lambda: synced(gw, kv_emulators))
        async with http.get(gw.url + "/admin/sessions/sess-1") as r:
            sess = await r.json()
        assert sess["resident_exact"]["home_tokens"] == (await store.snapshot("sess-1")).session.resident_tokens  # type: ignore[union-attr]
        # a session nobody has seen: 0 on a complete replica, and the emulators saw the injected id
        snap = await store.snapshot("never-seen")
        assert snap.session is None
        home = next(r for r in kv_emulators if r.url.removeprefix("http://") == sess["home"])
        assert "sess-1" in home.replica.sessions


async def test_requests_without_a_session_id_keep_their_cache_by_exact_residency(kv_emulators: list[Running]) -> None:
    """A client that sends no session id: the gateway keys its conversation by the prompt (rule 7)
    and names that key on the engine's blocks too, so exact residency knows the conversation is
    resident and every later turn goes home. (Unnamed, the key had no blocks on a complete replica,
    read as a cache that is gone: every turn was re-placed as evicted.)"""
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        await wait_for(lambda: all(gw.runtime.residency.view.source(u.removeprefix("http://")) == "events" for u in urls))
        msgs = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "task 7"},
                {"role": "user", "content": "explain the radix cache " * 12}]  # fmt: skip
        reasons, cached, replicas = await five_turns(http, gw, kv_emulators, msgs, {}, {})
        assert reasons == ["placed_new"] + ["affinity"] * 4, reasons
        assert len(replicas) == 1 and all(c > 0 for c in cached[1:]), cached
        sessions = [s for r in kv_emulators for s in r.replica.sessions]
        assert len(sessions) == 1 and sessions[0].startswith("p")  # the engine saw the prefix key


async def test_a_body_that_names_its_own_session_id_keeps_its_cache_by_exact_residency(kv_emulators: list[Running]) -> None:
    """A client that speaks SGLang's dialect names its session in the body (``session_id``) and sends
    no header. The engine names the blocks by that id, so the gateway keys the session by it too:
    exact residency finds the session resident and every later turn goes home. (Keyed by the prompt
    instead, the key had no blocks on a complete replica, read as a cache that is gone: every turn
    was re-placed as evicted.)"""
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        await wait_for(lambda: all(gw.runtime.residency.view.source(u.removeprefix("http://")) == "events" for u in urls))
        msgs = [{"role": "user", "content": "explain the radix cache " * 12}]
        reasons, cached, _ = await five_turns(http, gw, kv_emulators, msgs, {"session_id": "agent-42"}, {})
        assert reasons == ["placed_new"] + ["affinity"] * 4, reasons
        assert all(c > 0 for c in cached[1:]), cached
        snap = await gw.store.snapshot("agent-42")
        assert snap.session is not None and snap.session.resident_tokens is not None and snap.session.resident_tokens > 0
        assert [s for r in kv_emulators for s in r.replica.sessions] == ["agent-42"]


async def test_a_header_session_whose_body_names_another_session_id_reads_residency_under_the_body_id(
    kv_emulators: list[Running],
) -> None:
    """A client names the agent session in a header and each conversation in the body's
    ``session_id`` (SGLang's field). The engine names the blocks by the body's id, so the gateway
    reads exact residency under it: the conversation is resident at home and every turn goes there.
    (Read under the header's id, which the engine never saw, the cache looked gone on a complete
    replica: every later turn was re-placed as evicted.)"""
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        await wait_for(lambda: all(gw.runtime.residency.view.source(u.removeprefix("http://")) == "events" for u in urls))
        msgs = [{"role": "user", "content": "explain the radix cache " * 12}]
        reasons, cached, _ = await five_turns(http, gw, kv_emulators, msgs, {"session_id": "conv-a"}, {"Modal-Session-Id": "agent-1"})
        assert reasons == ["placed_new"] + ["affinity"] * 4, reasons
        assert all(c > 0 for c in cached[1:]), cached
        assert [s for r in kv_emulators for s in r.replica.sessions] == ["conv-a"]
        # the store keys the session by the header; the engine knows only the body's id
        assert (await gw.store.snapshot("agent-1")).session is not None


async def metric_samples(
    http: aiohttp.ClientSession, gw: RunningGateway
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on the gateway's ``/metrics``, by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def residency_outcomes(http: aiohttp.ClientSession, gw: RunningGateway) -> dict[tuple[str, str], float]:
    """``kvroute_residency_outcomes_total`` by (residency, found)."""
    return {
        (dict(labels)["residency"], dict(labels)["found"]): v
        for (name, labels), v in (await metric_samples(http, gw)).items()
        if name == "kvroute_residency_outcomes_total"
    }


@pytest.mark.parametrize("events", [True, False], ids=["events", "estimate"])
async def test_each_turn_sent_home_is_judged_by_the_residency_that_sent_it(
    kv_emulators: list[Running], events: bool
) -> None:
    """A turn sent home for its cache is checked against the engine's ``cached_tokens`` and counted
    by the residency the decision went by. A cache flushed behind the gateway's back: the events see
    it go (the next turn is placed afresh, nothing to judge); the estimate does not, sends the turn
    home and counts it missed."""
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2} if events else {"mode": "off"})
    residency = "events" if events else "estimate"
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        if events:
            await wait_for(lambda: all(gw.runtime.residency.view.source(u.removeprefix("http://")) == "events" for u in urls))
        conv = Conversation(http, gw, kv_emulators if events else None)
        await conv.turns(5)
        assert conv.reasons == ["placed_new"] + ["affinity"] * 4, conv.reasons
        assert await residency_outcomes(http, gw) == {(residency, "true"): 4.0}

        home = next(r for r in kv_emulators if r.url.removeprefix("http://") in conv.replicas)
        async with http.post(home.url + "/flush_cache") as r:
            assert r.status == 200
        if events:
            await wait_for(lambda: synced(gw, kv_emulators))
        await conv.turns(2)
        outcomes = await residency_outcomes(http, gw)
        if events:
            assert conv.reasons[5:] == ["placed_evicted", "affinity"], conv.reasons
            assert outcomes == {("events", "true"): 5.0}, outcomes
        else:
            assert conv.reasons[5:] == ["affinity", "affinity"] and conv.cached[5] == 0, (conv.reasons, conv.cached)
            assert outcomes == {("estimate", "true"): 5.0, ("estimate", "false"): 1.0}, outcomes
        async with http.get(gw.url + "/admin/stats") as r:  # the operator sees the same counts
            shown = (await r.json())["fleet"]["residency_outcomes"]
        want = {f"{res}_{'found' if found == 'true' else 'missed'}": int(n) for (res, found), n in outcomes.items()}
        assert shown["total"] == shown["window"] == want, shown


async def test_a_turn_sent_before_the_last_ones_events_arrive_goes_home(kv_emulators: list[Running]) -> None:
    """An engine publishes a turn's stores after it answers, and a coding agent can send the next
    turn at once (a quick tool call). That turn must find its cache at home: before the events name
    the session there, its home reads unknown (residency rule 8), not an exact 0 read as evicted,
    which placed it afresh and threw the cache away."""
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        await wait_for(lambda: all(gw.runtime.residency.view.source(u.removeprefix("http://")) == "events" for u in urls))
        for rep in kv_emulators:
            assert rep.replica.kv_publisher is not None
            rep.replica.kv_publisher.lag_s = 2.0  # a whole test's turns come before their events
        conv = Conversation(http, gw, None)
        await conv.turns(3)
        assert conv.reasons == ["placed_new", "affinity", "affinity"], conv.reasons
        assert len(conv.replicas) == 1 and min(conv.cached[1:]) > 0, conv.cached
        snap = await gw.store.snapshot("s-1")
        assert snap.session is not None and snap.session.resident_tokens is None  # unknown, not 0
        await wait_for(lambda: synced(gw, kv_emulators))  # once they are in, the answer is exact again
        snap = await gw.store.snapshot("s-1")
        assert snap.session is not None and (snap.session.resident_tokens or 0) > 0


async def test_a_restarted_gateway_finds_sessions_whose_history_outran_the_replay_buffer() -> None:
    """An engine that has served a while no longer holds its events from sequence 0 (SGLang keeps
    its last ``buffer_steps`` batches), so a restarted gateway's mirror is incomplete and the
    sessions' token counts are unknown. Each session's last turn stored its blocks within the
    buffer, below blocks the gateway never saw: a radix cache evicts leaves first, so while that
    last block is resident all of the session's context is, and its next turn goes there
    (``placed_resident`` on ``tip_on``) and finds its cache."""
    buffer = 12
    kv = json.dumps({**json.loads(KV), "buffer_steps": buffer})
    prof = get_profile("small-test").with_overrides(kv_capacity_tokens=4096, host_capacity_tokens=0)
    reps = await start_emulators(2, config=EmulatorConfig(profile=prof, time_scale=0.002, kv_events_config=kv))
    urls = [r.url for r in reps]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})
    pubs = [r.replica.kv_publisher for r in reps]
    assert all(p is not None for p in pubs)

    def next_seq() -> list[int]:
        return [p.stats()["next_seq"] for p in pubs if p is not None]

    sessions = {f"b{i}": [{"role": "user", "content": f"task {i}: " + f"part{i} of the plan " * 8}] for i in range(6)}
    homes: dict[str, str] = {}
    try:
        async with aiohttp.ClientSession() as http:
            async with gateway(cfg) as first:
                rounds = 0
                while rounds < 3 or min(next_seq()) <= 2 * buffer:  # seq 0 is long gone from the buffer
                    rounds += 1
                    before = next_seq()
                    for sid, msgs in sessions.items():
                        body = {"model": "emulated/small-test", "messages": msgs, "max_tokens": 2}
                        async with http.post(first.url + "/v1/chat/completions", json=body,
                                             headers={"Modal-Session-Id": sid}) as r:  # fmt: skip
                            assert r.status == 200, await r.text()
                            homes[sid] = r.headers["X-Kvroute-Replica"]
                            msgs += [{"role": "assistant", "content": (await r.json())["choices"][0]["message"]["content"]},
                                     {"role": "user", "content": f"round {rounds} " * 4}]  # fmt: skip
                    assert rounds < 12, next_seq()
                # every session's last turn is within what the engines still replay
                assert all(n - b < buffer for n, b in zip(next_seq(), before, strict=True)), (before, next_seq())
                await wait_for(lambda: synced(first, reps))
            assert len(set(homes.values())) == 2

            async with gateway(cfg) as second:
                svc = second.runtime.residency
                assert svc is not None
                assert {svc.view.source(u.removeprefix("http://")) for u in urls} == {"estimate"}  # incomplete
                for sid, msgs in sessions.items():
                    assert (await second.store.session(sid)) is None
                    snap = await second.store.snapshot(sid)
                    assert snap.session is not None and snap.session.tip_on == (homes[sid],), (sid, snap.session)
                    body = {"model": "emulated/small-test", "messages": msgs, "max_tokens": 2}
                    async with http.post(second.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                        assert r.status == 200, await r.text()
                        went, reason = r.headers["X-Kvroute-Replica"], r.headers["X-Kvroute-Reason"]
                        usage = (await r.json())["usage"]
                    assert (went, reason) == (homes[sid], "placed_resident"), (sid, went, reason)
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // 2, usage
    finally:
        await stop_emulators(reps)


class Conversation:
    """One session's growing chat through ``gw``; with ``reps`` each turn waits for their events."""

    def __init__(self, http: aiohttp.ClientSession, gw: RunningGateway, reps: list[Running] | None) -> None:
        self.http, self.gw, self.reps = http, gw, reps
        self.msgs = [{"role": "user", "content": "explain the radix cache " * 12}]
        self.reasons: list[str] = []
        self.cached: list[int] = []
        self.replicas: set[str] = set()

    async def turns(self, n: int) -> None:
        for _ in range(n):
            body = {"model": "emulated/small-test", "messages": self.msgs, "max_tokens": 8}
            url = self.gw.url + "/v1/chat/completions"
            async with self.http.post(url, json=body, headers={"Modal-Session-Id": "s-1"}) as r:
                assert r.status == 200, await r.text()
                d = await r.json()
                self.reasons.append(r.headers["X-Kvroute-Reason"])
                self.replicas.add(r.headers["X-Kvroute-Replica"])
            self.cached.append(d["usage"]["prompt_tokens_details"]["cached_tokens"])
            if self.reps is not None:
                await wait_for(self.synced)
            self.msgs = [*self.msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"and then {len(self.reasons)} " * 6}]  # fmt: skip

    def synced(self) -> bool:
        return self.reps is not None and synced(self.gw, self.reps)


async def test_gateway_without_events_stays_off(emulators_plain: list[Running]) -> None:
    cfg = fast_config([r.url for r in emulators_plain], admin_insecure=True, kv_events={"refresh_s": 0.1})
    async with gateway(cfg) as gw, aiohttp.ClientSession() as http:
        d = await chat(http, gw.url, "s", [{"role": "user", "content": "hello"}])
        assert d["usage"]["prompt_tokens"] > 0
        snap = await gw.store.snapshot("s")
        assert snap.session is not None and snap.session.resident_tokens is None and snap.session.resident_on == ()
        async with http.get(gw.url + "/admin/stats") as r:
            assert {v["residency_source"] for v in (await r.json())["replicas"]} == {"off"}
        # no session id was added to the bodies: nobody follows these replicas' events
        assert all(not r.replica.sessions or r.replica.sessions == {"s"} for r in emulators_plain)


@pytest.fixture
async def emulators_plain() -> AsyncIterator[list[Running]]:
    reps = await start_emulators(1, config=EmulatorConfig(profile=get_profile("small-test"), time_scale=0.002))
    try:
        yield reps
    finally:
        await stop_emulators(reps)


async def test_kv_events_off_does_not_subscribe(kv_emulators: list[Running]) -> None:
    cfg = fast_config([r.url for r in kv_emulators], kv_events={"mode": "off"})
    async with gateway(cfg) as gw:
        assert gw.runtime.residency is None


async def test_one_gateway_publishes_another_reads_through_redis(kv_emulators: list[Running], redis_url: str) -> None:
    urls = [r.url for r in kv_emulators]
    clock = SystemClock()
    cfg_a = fast_config(urls, redis_url=redis_url, gateway_id="gw-a",
                        kv_events={"refresh_s": 0.2, "publish": True, "flush_s": 0.02})
    cfg_b = fast_config(urls, redis_url=redis_url, gateway_id="gw-b", admin_insecure=True,
                        kv_events={"mode": "redis"})
    async with gateway(cfg_a, make_store(cfg_a, clock)) as a, gateway(cfg_b, make_store(cfg_b, clock)) as b, \
            aiohttp.ClientSession() as http:
        await wait_for(lambda: a.runtime.residency is not None and len(a.runtime.residency.manager.subscribed()) == 2)
        msgs = [{"role": "user", "content": "shared through redis " * 10}]
        await chat(http, a.url, "sess-r", msgs)
        await wait_for(lambda: synced(a, kv_emulators))
        sa = (await a.store.snapshot("sess-r")).session
        assert sa is not None and sa.resident_tokens
        want = sa.resident_tokens

        async def b_sees() -> bool:
            sb = (await b.store.snapshot("sess-r")).session
            return sb is not None and sb.resident_tokens == want

        for _ in range(500):
            if await b_sees():
                break
            await asyncio.sleep(0.01)
        assert await b_sees()
        bsvc = b.runtime.residency
        assert bsvc is not None and bsvc.mode == "redis"
        # the other replica's mirror reaches Redis when gw-a's subscriber has replayed it, which on a
        # loaded machine can come after the session's: wait for it (bounded), then it must be exact
        for _ in range(500):
            if {bsvc.view.source(u.removeprefix("http://")) for u in urls} == {"events"}:
                break
            await asyncio.sleep(0.01)
        assert {bsvc.view.source(u.removeprefix("http://")) for u in urls} == {"events"}
        async with http.get(b.url + "/admin/stats") as r:
            body = await r.json()
        assert all("residency_source" in v for v in body["replicas"])


async def test_a_restarted_gateway_sends_each_session_back_to_its_cache(kv_emulators: list[Running]) -> None:
    """A gateway on embedded state forgets every session when it restarts; the engines do not. The
    new gateway replays their KV events from the start, and each session's next turn goes where its
    cache is (``placed_resident``) and finds it there, instead of being placed by load (where half
    of them would meet a cold replica)."""
    urls = [r.url for r in kv_emulators]
    cfg = fast_config(urls, admin_insecure=True, kv_events={"refresh_s": 0.2})

    def events_everywhere(gw: RunningGateway) -> bool:
        svc = gw.runtime.residency
        return svc is not None and all(svc.view.source(u.removeprefix("http://")) == "events" for u in urls)

    sessions = {f"r{i}": [{"role": "user", "content": f"task {i}: " + f"part{i} of the plan " * 10}] for i in range(6)}
    homes: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        async with gateway(cfg) as first:
            await wait_for(lambda: events_everywhere(first))
            for sid, msgs in sessions.items():
                body = {"model": "emulated/small-test", "messages": msgs, "max_tokens": 8}
                async with http.post(first.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                    assert r.status == 200, await r.text()
                    homes[sid] = r.headers["X-Kvroute-Replica"]
                    msgs += [{"role": "assistant", "content": (await r.json())["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "go on"}]  # fmt: skip
            await wait_for(lambda: synced(first, kv_emulators))
        assert len(set(homes.values())) == 2  # the sessions were spread over both replicas

        async with gateway(cfg) as second:  # a fresh embedded store: no session is known
            # no waiting here: a gateway serves only once the engines' replays are in, or clients
            # that retry as it comes up would meet it blind and be placed by load
            assert events_everywhere(second)
            async with http.get(second.url + "/admin/kv-events") as r:  # what the operator sees of it
                assert r.status == 200
                kv = await r.json()
            ids = {u.removeprefix("http://") for u in urls}
            assert kv["mode"] == "auto" and set(kv["replicas"]) == set(kv["subscribers"]) == ids, kv
            assert all(v["source"] == "events" for v in kv["replicas"].values()), kv
            ranks = [rank for sub in kv["subscribers"].values() for rank in sub["ranks"]]
            assert all(rk["connected"] and rk["rebuilds"] == 1 and rk["replay_failures"] == 0 for rk in ranks), kv
            for sid, msgs in sessions.items():
                assert (await second.store.session(sid)) is None
                body = {"model": "emulated/small-test", "messages": msgs, "max_tokens": 8}
                async with http.post(second.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                    assert r.status == 200, await r.text()
                    went, reason = r.headers["X-Kvroute-Replica"], r.headers["X-Kvroute-Reason"]
                    cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (went, reason) == (homes[sid], "placed_resident"), (sid, went, reason)
                assert cached > 0
                assert (await second.store.session(sid)).home == went  # type: ignore[union-attr]

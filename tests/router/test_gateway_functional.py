"""The gateway over real sockets in front of scriptable SGLang-like replicas (``FakeReplica``).

Covers relay fidelity on all three routes, stickiness, thicc splits, scale-up, failover before the
first byte, mid-stream breaks, client disconnects, limits and readiness.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest

from router.events import RequestFinished, RequestRouted, UpstreamRetry
from router.model import Reason, ReplicaSpec, ReplicaStatus
from tests.router.conftest import EventLog, wait_for

ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]


def _body(route: str, stream: bool, text: str = "hello") -> bytes:
    if route == "/v1/chat/completions":
        obj: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    elif route == "/v1/completions":
        obj = {"model": "m", "prompt": text}
    else:
        obj = {"text": text, "sampling_params": {"max_new_tokens": 3}}
    obj["stream"] = stream
    if stream and route != "/generate":
        obj["stream_options"] = {"include_usage": True}
    # odd spacing on purpose: the gateway must forward these exact bytes
    return json.dumps(obj, indent=1).encode()


async def _post(
    s: aiohttp.ClientSession, url: str, body: bytes, sid: str | None = None, **headers: str
) -> tuple[int, bytes, Any]:
    hdrs = {"Content-Type": "application/json", **headers}
    if sid is not None:
        hdrs["Modal-Session-Id"] = sid
    async with s.post(url, data=body, headers=hdrs) as r:
        return r.status, await r.read(), r.headers


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ROUTES)
async def test_relay_is_byte_identical(
    fake_replicas: Any, gateway_factory: Any, route: str, stream: bool
) -> None:
    via, direct = await fake_replicas(2)
    gw = await gateway_factory([via.url])
    body = _body(route, stream)
    async with aiohttp.ClientSession() as s:
        st_gw, got, hdrs = await _post(s, gw.url + route, body, "sess-1")
        st_direct, want, direct_hdrs = await _post(
            s, direct.url + route, body, **{"x-smg-routing-key": "sess-1"}
        )
    assert st_gw == st_direct == 200
    assert got == want
    assert hdrs["Content-Type"] == direct_hdrs["Content-Type"]
    assert hdrs["X-Kvroute-Replica"] == via.id
    assert hdrs["X-Kvroute-Reason"] == Reason.PLACED_NEW.value
    assert len(hdrs["X-Request-Id"]) == 32
    seen = via.state.requests[-1]
    assert seen["body"] == body  # not re-serialised
    assert seen["headers"]["x-smg-routing-key"] == "sess-1"
    assert seen["headers"]["X-Request-Id"] == hdrs["X-Request-Id"]
    if stream:
        assert got.endswith(b"data: [DONE]\n\n")


async def test_learns_usage_without_changing_the_stream(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    log = EventLog()
    gw = await gateway_factory([rep.url], hooks=(log,))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            status, _, _ = await _post(
                s, gw.url + "/v1/chat/completions", _body("/v1/chat/completions", True), "s-usage"
            )
            assert status == 200
    await _finished(log, 2)
    fin = log.of(RequestFinished)
    assert [f.ok for f in fin] == [True, True]
    prompt = len(_body("/v1/chat/completions", True)) // 4
    assert fin[0].prompt_tokens == prompt and fin[0].cached_tokens == 0 and fin[0].completion_tokens == 3
    assert fin[1].cached_tokens == prompt  # the fake caches per routing key
    assert not fin[1].usage_estimated and fin[1].stream
    assert fin[1].overhead_s >= 0 and fin[1].ttft_s is not None and fin[1].e2e_s >= fin[1].ttft_s
    sess = await gw.store.session("s-usage")
    assert sess is not None and sess.context_tokens == prompt + 3 and sess.turns == 2


async def test_request_id_reaches_logs_and_events(fake_replicas: Any, gateway_factory: Any) -> None:
    from router.observability.logging import current_request_id

    (rep,) = await fake_replicas(1)
    seen: list[tuple[str, str | None]] = []

    def hook(event: Any) -> None:
        if isinstance(event, RequestRouted):
            seen.append((event.request_id, current_request_id()))

    gw = await gateway_factory([rep.url], hooks=(hook,))
    async with aiohttp.ClientSession() as s:
        _, _, h = await _post(
            s, gw.url + "/generate", _body("/generate", False), "rid", **{"X-Request-Id": "abc-123"}
        )
        _, _, h2 = await _post(
            s, gw.url + "/generate", _body("/generate", False), "rid", **{"X-Request-Id": "bad id!"}
        )
    assert h["X-Request-Id"] == "abc-123"
    assert h2["X-Request-Id"] != "bad id!" and len(h2["X-Request-Id"]) == 32
    assert seen == [("abc-123", "abc-123"), (h2["X-Request-Id"], h2["X-Request-Id"])]
    assert current_request_id() is None


async def test_stream_without_usage_estimates_prompt(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    log = EventLog()
    gw = await gateway_factory([rep.url], hooks=(log,))
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "stream": True}
    ).encode()
    async with aiohttp.ClientSession() as s:
        status, got, _ = await _post(s, gw.url + "/v1/chat/completions", body, "s-est")
    assert status == 200 and b'"usage"' not in got
    await _finished(log, 1)
    (fin,) = log.of(RequestFinished)
    assert fin.usage_estimated and fin.prompt_tokens == len(body) // 4 and fin.cached_tokens is None


async def test_session_sticks_and_sessions_spread(fake_replicas: Any, gateway_factory: Any) -> None:
    reps = await fake_replicas(3)
    gw = await gateway_factory([r.url for r in reps])
    homes: dict[str, set[str]] = {}
    async with aiohttp.ClientSession() as s:
        for turn in range(4):
            for i in range(6):
                sid = f"sess-{i}"
                status, _, hdrs = await _post(
                    s, gw.url + "/generate", _body("/generate", False, "t" * (50 + turn)), sid
                )
                assert status == 200
                homes.setdefault(sid, set()).add(hdrs["X-Kvroute-Replica"])
    assert all(len(h) == 1 for h in homes.values()), homes
    per_replica = Counter(next(iter(h)) for h in homes.values())
    # 6 sessions on 3 replicas: spread, and no replica above the bounded-load cap ceil(1.25 * 2) = 3
    assert len(per_replica) >= 2 and max(per_replica.values()) <= 3


async def test_thicc_session_splits_and_collapses_back(fake_replicas: Any, gateway_factory: Any) -> None:
    reps = await fake_replicas(3)
    for r in reps:
        r.state.first_delay_s = 0.4
    gw = await gateway_factory([r.url for r in reps], policy_params={"thicc_threshold": 2})
    async with aiohttp.ClientSession() as s:
        _, _, first = await _post(s, gw.url + "/generate", _body("/generate", False), "thicc")
        home = first["X-Kvroute-Replica"]
        results = await asyncio.gather(
            *(_post(s, gw.url + "/generate", _body("/generate", False), "thicc") for _ in range(5))
        )
        used = Counter(h["X-Kvroute-Replica"] for _, _, h in results)
        reasons = Counter(h["X-Kvroute-Reason"] for _, _, h in results)
        assert all(st == 200 for st, _, _ in results)
        assert len(used) >= 2 and used[home] >= 2
        assert reasons[Reason.THICC_SPLIT.value] >= 1
        # concurrency gone: the next turn goes home again
        _, _, after = await _post(s, gw.url + "/generate", _body("/generate", False), "thicc")
    assert after["X-Kvroute-Replica"] == home
    assert after["X-Kvroute-Reason"] == Reason.AFFINITY.value


async def test_new_replica_gets_only_new_sessions(fake_replicas: Any, gateway_factory: Any) -> None:
    reps = await fake_replicas(2)
    gw = await gateway_factory([r.url for r in reps])
    homes: dict[str, str] = {}
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            _, _, h = await _post(s, gw.url + "/generate", _body("/generate", False), f"old-{i}")
            homes[f"old-{i}"] = h["X-Kvroute-Replica"]
        (new,) = await fake_replicas(1)
        await gw.store.upsert_replica(ReplicaSpec(id=new.id, url=new.url))
        await wait_for(lambda: _status(gw, new.id, ReplicaStatus.ACTIVE))
        for i in range(6):
            _, _, h = await _post(s, gw.url + "/generate", _body("/generate", False), f"old-{i}")
            assert h["X-Kvroute-Replica"] == homes[f"old-{i}"]
        placed = Counter()
        for i in range(4):
            _, _, h = await _post(s, gw.url + "/generate", _body("/generate", False), f"new-{i}")
            placed[h["X-Kvroute-Replica"]] += 1
    assert placed[new.id] >= 1
    assert not new.state.requests or all(
        r["headers"]["x-smg-routing-key"].startswith("new-") for r in new.state.requests
    )


async def _finished(log: EventLog, n: int) -> None:
    await wait_for(lambda: len(log.of(RequestFinished)) >= n)


async def _status(gw: Any, rid: str, want: ReplicaStatus) -> bool:
    return any(r.id == rid and r.status is want for r in await gw.store.replicas())


async def test_dead_replica_is_skipped_with_retry(fake_replicas: Any, gateway_factory: Any) -> None:
    live, dead = await fake_replicas(2)
    dead_url, dead_id = dead.url, dead.id
    log = EventLog()
    gw = await gateway_factory(
        [live.url, dead_url], hooks=(log,), health={"health_interval_s": 30.0, "scrape_interval_s": 30.0}
    )
    await dead.stop()  # both ACTIVE after the first round; now one refuses connections
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            status, _, h = await _post(
                s, gw.url + "/v1/completions", _body("/v1/completions", False), f"d-{i}"
            )
            assert status == 200 and h["X-Kvroute-Replica"] == live.id
    retries = log.of(UpstreamRetry)
    assert retries and all(r.replica_id == dead_id and r.error == "upstream_connect_error" for r in retries)
    assert await _status(gw, dead_id, ReplicaStatus.DOWN)  # passive ejection on connect error
    assert all(r.in_flight == 0 for r in await gw.store.replicas())


async def test_503_before_first_byte_is_retried(fake_replicas: Any, gateway_factory: Any) -> None:
    reps = await fake_replicas(3)
    log = EventLog()
    gw = await gateway_factory([r.url for r in reps], hooks=(log,))
    async with aiohttp.ClientSession() as s:
        _, _, h = await _post(
            s, gw.url + "/v1/chat/completions", _body("/v1/chat/completions", False), "r503"
        )
        home = next(r for r in reps if r.id == h["X-Kvroute-Replica"])
        healthy = next(r for r in reps if r is not home)
        for r in reps:
            if r is not healthy:
                r.state.fail_status = 503  # the session's home and one more answer 503 before any byte
        log.events.clear()
        status, body, h = await _post(
            s, gw.url + "/v1/chat/completions", _body("/v1/chat/completions", True), "r503"
        )
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert h["X-Kvroute-Replica"] == healthy.id
    await wait_for(lambda: any(f.retries for f in log.of(RequestFinished)))
    fin = log.of(RequestFinished)[-1]
    retries = log.of(UpstreamRetry)
    assert fin.ok and fin.retries == len(retries) >= 1
    assert retries[0].replica_id == home.id
    assert {r.error for r in retries} == {"upstream_status"}
    assert len(log.of(RequestRouted)) == fin.retries + 1
    assert all(r.in_flight == 0 for r in await gw.store.replicas())


async def test_retries_exhausted_passes_last_5xx_through(fake_replicas: Any, gateway_factory: Any) -> None:
    a, b = await fake_replicas(2)
    a.state.fail_status = 503
    b.state.fail_status = 500
    gw = await gateway_factory([a.url, b.url], max_retries=1)
    async with aiohttp.ClientSession() as s:
        status, body, h = await _post(s, gw.url + "/generate", _body("/generate", False), "x")
        assert status in (500, 503)  # the last replica's own answer, relayed unchanged
        assert json.loads(body)["message"] == "overloaded"
        assert len(a.state.requests) + len(b.state.requests) == 2
        gw1 = await gateway_factory([a.url], max_retries=3)
        status, body, h = await _post(s, gw1.url + "/generate", _body("/generate", False), "x")
        assert status == 503 and h["X-Kvroute-Replica"] == a.id  # ran out of replicas before retries
    dead = await gateway_factory(
        ["http://127.0.0.1:9"],
        max_retries=1,
        health={"eject_on_connect_errors": 0, "health_interval_s": 30.0},
    )
    await dead.store.set_status("127.0.0.1:9", ReplicaStatus.ACTIVE)
    async with aiohttp.ClientSession() as s:
        status, body, _ = await _post(s, dead.url + "/generate", _body("/generate", False), "x")
    assert status == 502
    _assert_openai_error(body, "upstream_connect_error")


async def test_mid_stream_break_gives_error_event(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    a.state.break_after = 2
    log = EventLog()
    gw = await gateway_factory([a.url], hooks=(log,))
    async with aiohttp.ClientSession() as s:
        status, body, _ = await _post(
            s, gw.url + "/v1/chat/completions", _body("/v1/chat/completions", True), "brk"
        )
    assert status == 200
    events = [e for e in body.decode().split("\n\n") if e]
    assert len(events) == 4  # two relayed chunks, the error, [DONE]
    err = json.loads(events[2].removeprefix("data: "))
    assert err["error"]["type"] == "upstream_error" and err["error"]["code"] == 502
    assert events[3] == "data: [DONE]"
    await _finished(log, 1)
    (fin,) = log.of(RequestFinished)
    assert not fin.ok and fin.retries == 0 and fin.error == "upstream_stream_broken"
    assert all(r.in_flight == 0 for r in await gw.store.replicas())


async def test_non_stream_break_cuts_the_connection(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    a.state.break_json = True
    log = EventLog()
    gw = await gateway_factory([a.url], hooks=(log,))
    async with aiohttp.ClientSession() as s:
        async with s.post(
            gw.url + "/v1/chat/completions",
            data=_body("/v1/chat/completions", False),
            headers={"Modal-Session-Id": "cut"},
        ) as r:
            assert r.status == 200  # already sent when the replica broke
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()  # truncated, never silently short
        # the gateway still serves on new connections
        a.state.break_json = False
        status, _, _ = await _post(
            s, gw.url + "/v1/chat/completions", _body("/v1/chat/completions", False), "cut"
        )
        assert status == 200
    await _finished(log, 2)
    first = log.of(RequestFinished)[0]
    assert not first.ok and first.error == "upstream_stream_broken" and first.retries == 0
    await wait_for(lambda: _in_flight_zero(gw))


async def test_timeouts_first_byte_retried_idle_read_ends_stream(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    slow, fast = await fake_replicas(2)
    log = EventLog()
    gw = await gateway_factory(
        [slow.url, fast.url], hooks=(log,), timeouts={"first_byte_s": 0.3, "idle_read_s": 0.3}
    )
    async with aiohttp.ClientSession() as s:
        _, _, h = await _post(s, gw.url + "/generate", _body("/generate", True), "slow")
        home = slow if h["X-Kvroute-Replica"] == slow.id else fast
        other = fast if home is slow else slow
        home.state.first_delay_s = 2.0  # "prefill" longer than first_byte_s: retried elsewhere
        status, body, h = await _post(s, gw.url + "/generate", _body("/generate", True), "slow")
        assert status == 200 and h["X-Kvroute-Replica"] == other.id and body.endswith(b"data: [DONE]\n\n")
        assert [r.error for r in log.of(UpstreamRetry)] == ["upstream_timeout"]
        home.state.first_delay_s = 0.0
        for r in (slow, fast):
            r.state.chunks, r.state.chunk_delay_s = 5, 1.0  # a stall mid-stream: idle_read_s
        status, body, _ = await _post(s, gw.url + "/generate", _body("/generate", True), "slow2")
    assert status == 200
    events = [e for e in body.decode().split("\n\n") if e]
    assert len(events) == 3  # one relayed chunk, the timeout error, [DONE]
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == 504
    assert events[-1] == "data: [DONE]"
    await wait_for(lambda: _in_flight_zero(gw))


async def test_client_disconnect_releases_load_and_aborts_upstream(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    (a,) = await fake_replicas(1)
    a.state.first_delay_s = 3.0
    log = EventLog()
    gw = await gateway_factory([a.url], hooks=(log,))
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(_post(s, gw.url + "/generate", _body("/generate", False), "gone"))
        await wait_for(lambda: a.state.active == 1)
        assert (await gw.store.replicas())[0].in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: a.state.aborted == 1, timeout_s=2.0)  # well before the 3 s "prefill" ends
    await wait_for(lambda: _in_flight_zero(gw))
    await wait_for(lambda: bool(log.of(RequestFinished)))
    (fin,) = log.of(RequestFinished)
    assert fin.client_disconnected and not fin.ok
    assert a.state.completed == 0


async def test_client_disconnect_mid_stream(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    a.state.chunks, a.state.chunk_delay_s = 50, 0.05
    gw = await gateway_factory([a.url])
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/completions",
            data=_body("/v1/completions", True),
            headers={"Modal-Session-Id": "ms"},
        ) as r,
    ):
        await r.content.readline()
        r.close()
    await wait_for(lambda: a.state.aborted == 1, timeout_s=2.0)
    await wait_for(lambda: _in_flight_zero(gw))
    assert a.state.completed == 0


async def _in_flight_zero(gw: Any) -> bool:
    reps = await gw.store.replicas()
    return all(r.in_flight == 0 for r in reps) and gw.runtime.in_flight == 0


# ---- limits and errors ----------------------------------------------------------------------------


def _assert_openai_error(body: bytes, code: str) -> None:
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["code"] == code


async def test_limits_and_errors(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    gw = await gateway_factory([a.url], limits={"max_body_bytes": 1000, "max_session_id_len": 16})
    url = gw.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        status, body, h = await _post(s, url, b"x" * 2000, "ok-id")
        assert status == 413
        _assert_openai_error(body, "payload_too_large")
        assert h["X-Request-Id"]

        async def chunked() -> Any:
            for _ in range(20):
                yield b"y" * 100

        async with s.post(url, data=chunked(), headers={"Modal-Session-Id": "ok"}) as r:
            assert r.status == 413
            _assert_openai_error(await r.read(), "payload_too_large")

        status, body, _ = await _post(s, url, _body("/v1/chat/completions", False), "x" * 17)
        assert status == 400
        _assert_openai_error(body, "bad_request")
        assert "Modal-Session-Id" in json.loads(body)["error"]["message"]
        status, body, _ = await _post(s, url, _body("/v1/chat/completions", False), "bad id!")
        assert status == 400
        status, body, _ = await _post(s, url, b"{not json")  # no session: the body must be parsed
        assert status == 400
        _assert_openai_error(body, "bad_request")
        status, body, _ = await _post(s, url, b"[1, 2]")
        assert status == 400
        status, body, _ = await _post(s, gw.url + "/v1/nothing", b"{}")
        assert status == 404
        _assert_openai_error(body, "not_found")
        async with s.get(url) as r:
            assert r.status == 405
            _assert_openai_error(await r.read(), "method_not_allowed")
        async with s.post(url, data=b"{}", headers={"X-Big": "z" * 20000}) as r:
            assert 400 <= r.status < 500
    assert a.state.requests == []  # none of these reached the replica
    async with aiohttp.ClientSession() as s:
        # 12 kB header: over aiohttp's default 8190, under our configured 16 KiB -> served
        status, _, _ = await _post(
            s, url, _body("/v1/chat/completions", False), "ok", **{"X-Big": "z" * 12000}
        )
        assert status == 200


async def test_no_session_uses_prefix_key(fake_replicas: Any, gateway_factory: Any) -> None:
    reps = await fake_replicas(3)
    log = EventLog()
    gw = await gateway_factory([r.url for r in reps], hooks=(log,))
    system = "You are a coding agent. " * 200
    async with aiohttp.ClientSession() as s:
        used = set()
        for i in range(4):
            body = json.dumps(
                {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": "fix the bug " * 100},
                        {"role": "assistant", "content": f"turn {i}"},
                    ],
                }
            ).encode()
            status, _, h = await _post(s, gw.url + "/v1/chat/completions", body)
            assert status == 200
            used.add(h["X-Kvroute-Replica"])
    assert len(used) == 1  # a shared prefix lands together
    assert {e.key_source.value for e in log.of(RequestRouted)} == {"prefix"}
    assert all("x-smg-routing-key" not in r["headers"] for rep in reps for r in rep.state.requests)


async def test_ready_and_health(fake_replicas: Any, gateway_factory: Any) -> None:
    empty = await gateway_factory([])
    async with aiohttp.ClientSession() as s:
        async with s.get(empty.url + "/ready") as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_replica"
        async with s.get(empty.url + "/health") as r:
            assert r.status == 200
        status, body, _ = await _post(s, empty.url + "/generate", _body("/generate", False), "s")
        assert status == 503
        _assert_openai_error(body, "no_replica")
        (a,) = await fake_replicas(1)
        gw = await gateway_factory([a.url])
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 200 and (await r.json())["active_replicas"] == 1
        async with s.get(gw.url + "/v1/models") as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == ["moonshotai/Kimi-K2.6"]
        a.state.health_status = 503
        await wait_for(lambda: _status(gw, a.id, ReplicaStatus.DOWN))
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 503
        a.state.health_status = 200
        await wait_for(lambda: _status(gw, a.id, ReplicaStatus.ACTIVE))


async def test_a_replica_id_with_a_line_break_never_reaches_the_head(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([])
    # a registry entry (a sidecar's, in Redis) whose id would split the head as a decision header
    await gw.store.upsert_replica(ReplicaSpec(id="evil\r\nSet-Cookie: a=b", url=rep.url), ReplicaStatus.ACTIVE)
    async with aiohttp.ClientSession() as s:
        status, body, h = await _post(s, gw.url + "/v1/chat/completions", _body("/v1/chat/completions", False), "s1")
    assert status == 200 and json.loads(body)["choices"]
    assert "Set-Cookie" not in h and "X-Kvroute-Replica" not in h
    assert h["X-Kvroute-Reason"] == "placed_new"  # the other decision header is intact


async def test_decision_headers_can_be_turned_off(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    gw = await gateway_factory([a.url], decision_headers=False, routing_key_header="")
    async with aiohttp.ClientSession() as s:
        status, _, h = await _post(
            s, gw.url + "/generate", _body("/generate", False), "s", **{"X-Request-Id": "client-chosen-id"}
        )
    assert status == 200
    assert "X-Kvroute-Replica" not in h and "X-Kvroute-Reason" not in h
    assert h["X-Request-Id"] == "client-chosen-id"
    assert "x-smg-routing-key" not in a.state.requests[-1]["headers"]


async def test_two_gateways_share_state_through_redis(fake_replicas: Any, redis_url: str) -> None:
    """``redis_url`` in the config: start_gateway builds and starts the Redis store, and closes it."""
    from router.gateway.serve import start_gateway
    from tests.router.conftest import fast_config

    reps = await fake_replicas(3)
    gws = [
        await start_gateway(fast_config([r.url for r in reps], redis_url=redis_url, gateway_id=f"gw{i}"))
        for i in range(2)
    ]
    try:
        assert all(gw.owns_store for gw in gws)
        async with aiohttp.ClientSession() as s:
            homes = set()
            for turn in range(3):
                for gw in gws:  # alternate gateways: one session, one home
                    status, _, h = await _post(
                        s, gw.url + "/generate", _body("/generate", False, f"t{turn}"), "shared"
                    )
                    assert status == 200
                    homes.add(h["X-Kvroute-Replica"])
        assert len(homes) == 1
        # the last response reaches the client before its gateway's release lands in Redis
        for _ in range(500):
            sess = await gws[1].store.session("shared")
            if sess is not None and sess.turns == 6:
                break
            await asyncio.sleep(0.01)
        assert sess is not None and sess.home in homes and sess.turns == 6
        await wait_for(lambda: _in_flight_zero(gws[0]))
    finally:
        for gw in gws:
            await gw.close()


async def test_hop_by_hop_headers_are_not_forwarded(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    gw = await gateway_factory([a.url])
    async with aiohttp.ClientSession() as s:
        status, _, _ = await _post(
            s,
            gw.url + "/generate",
            _body("/generate", False),
            "hop",
            **{
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "1",
                "Keep-Alive": "timeout=5",
                "Proxy-Authorization": "Basic eA==",
                "TE": "trailers",
                "X-End-To-End": "yes",
                "Host": "evil.example:1",
            },
        )
    assert status == 200
    seen = a.state.requests[-1]["headers"]
    for name in ("X-Hop", "Keep-Alive", "Proxy-Authorization", "TE"):
        assert name not in seen, name
    assert seen["X-End-To-End"] == "yes"
    assert seen["Host"] == f"127.0.0.1:{a.port}"  # the registered replica, never the client's Host
    assert seen["X-Forwarded-For"] == "127.0.0.1"


async def test_nothing_is_added_to_the_request(fake_replicas: Any, gateway_factory: Any) -> None:
    (a,) = await fake_replicas(1)
    gw = await gateway_factory([a.url])
    async with (
        aiohttp.ClientSession(skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept")) as s,
        s.post(
            gw.url + "/generate",
            data=_body("/generate", False),
            headers={"Modal-Session-Id": "bare"},
            skip_auto_headers=("Content-Type",),
        ) as r,
    ):
        assert r.status == 200
        await r.read()
    seen = a.state.requests[-1]["headers"]
    assert "Content-Type" not in seen and "Accept-Encoding" not in seen and "User-Agent" not in seen
    assert seen["Content-Length"] == str(len(_body("/generate", False)))


async def test_session_moved_by_another_gateway_to_a_dead_home_is_rerouted(
    fake_replicas: Any, redis_url: str
) -> None:
    """Fast Redis path: gateway 1 still believes the session lives on X; gateway 2 moved it to Y, and
    Y went down. Gateway 1's acquire is refused as stale (nothing applied); it must decide again on
    the fresh state (home Y is gone -> reassign) instead of excluding X, which left nothing but the
    dead Y and answered 503."""
    from router.gateway.serve import start_gateway
    from router.model import BindSession, Completion, RouteDecision, RouteRequest
    from tests.router.conftest import fast_config

    reps = await fake_replicas(2)
    health = {"health_interval_s": 30.0, "scrape_interval_s": 30.0}  # statuses stay as the test sets them
    gws = [
        await start_gateway(
            fast_config(
                [r.url for r in reps],
                redis_url=redis_url,
                gateway_id=f"stale{i}",
                health=health,
                store={"replica_refresh_s": 0.05, "key_prefix": "stale"},
            )
        )
        for i in range(2)
    ]
    try:
        assert all(getattr(gw.store, "fast", False) for gw in gws)
        async with aiohttp.ClientSession() as s:
            status, _, h = await _post(s, gws[0].url + "/generate", _body("/generate", False, "t0"), "moved")
            assert status == 200
            x = h["X-Kvroute-Replica"]
            y = next(r.id for r in reps if r.id != x)
            await wait_for(lambda: _in_flight_zero(gws[0]))  # its release (and session cache) done
            # gateway 2 moves the session to Y (compare-and-set on X), then Y goes down
            lease = await gws[1].store.acquire(
                RouteDecision(
                    y, Reason.REASSIGNED_OVERLOAD, (BindSession("moved", y, x, Reason.REASSIGNED_OVERLOAD),)
                ),
                RouteRequest("moved"),
            )
            assert lease.replica_id == y
            await gws[1].store.release(
                lease, Completion(ok=True, prompt_tokens=10, cached_tokens=0, completion_tokens=1)
            )
            await gws[1].store.set_status(y, ReplicaStatus.DOWN)
            await asyncio.sleep(0.2)  # gateway 1's replica table sees Y down; its session cache still says X
            status, body, h = await _post(
                s, gws[0].url + "/generate", _body("/generate", False, "t1"), "moved"
            )
            assert status == 200, body
            assert h["X-Kvroute-Replica"] == x
            assert gws[0].store.stats()["stale_total"] == 1  # the stale decision was refused once
        sess = await gws[1].store.session("moved")
        assert sess is not None and sess.home == x
    finally:
        for gw in gws:
            await gw.close()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses/resp_1/input_items", "/flush_cache"])
async def test_routes_it_does_not_proxy_are_a_clear_404(fake_replicas: Any, gateway_factory: Any, path: str) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, json={"capacity_of_str_len": 1000}) as r:
        assert r.status == 404
        doc = await r.json()
    assert doc["error"]["code"] == "not_found" and f"unknown route: POST {path}" in doc["error"]["message"]
    assert rep.state.requests == []  # nothing reached the replica

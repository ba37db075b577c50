"""kvroute in front of real SGLang 0.5.23 servers (issue 21, item 2): what the engine sends reaches
the client unchanged, usage is learnt from the real engine, affinity gives real radix hits, the real
load reports reach the snapshot, the sidecar registers a real engine, and nothing is lost on drain,
disconnect or an engine killed mid-stream."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import uuid
from typing import Any

import aiohttp
import pytest

from loadtests.real_sglang import RealServer, get_json, stop_real_server
from router.events import AffinityBroken, RequestFinished
from router.gateway.serve import start_gateway
from router.model import ReplicaStatus
from router.observability.metrics import GatewayMetrics
from tests.real_sglang.conftest import POOL_TOKENS
from tests.router.conftest import EventLog, fast_config, wait_for

PY = sys.executable
# the engines are real and busy on one core each: give discovery SGLang's pace, not a fake's
REAL_HEALTH = {"health_interval_s": 30.0, "scrape_interval_s": 30.0}
REAL_TIMEOUTS = {"first_byte_s": 60.0, "idle_read_s": 60.0, "probe_s": 5.0}


def _text(n_words: int, salt: str) -> str:
    return " ".join(f"{salt}{i % 53} value_{i} = compute({i});" for i in range(n_words))


def _request(route: str, stream: bool, text: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    if route == "/v1/chat/completions":
        doc: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": text}],
                               "max_tokens": max_tokens}
    elif route == "/v1/completions":
        doc = {"model": "tiny", "prompt": text, "max_tokens": max_tokens}
    else:
        doc = {"text": text, "sampling_params": {"max_new_tokens": max_tokens, **extra.pop("sampling", {})}}
    doc["stream"] = stream
    doc.update(extra)
    return doc


async def _post(
    s: aiohttp.ClientSession, url: str, doc: dict[str, Any], sid: str | None = None
) -> tuple[int, bytes, Any]:
    headers = {"Content-Type": "application/json"}
    if sid is not None:
        headers["Modal-Session-Id"] = sid
    # odd spacing on purpose: the gateway forwards these bytes as they are
    async with s.post(url, data=json.dumps(doc, indent=1).encode(), headers=headers) as r:
        return r.status, await r.read(), r.headers


ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_engine_bytes_reach_the_client_unchanged(
    fleet: list[RealServer], recording_proxy: Any, gateway_factory: Any, stream: bool
) -> None:
    """Unstreamed bodies are byte-identical to the engine's; streams carry the engine's SSE events
    unchanged, ``[DONE]`` included."""
    proxy = await recording_proxy(fleet[0].port)
    gw = await gateway_factory([proxy.url], health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    async with aiohttp.ClientSession() as s:
        for route in ROUTES:
            status, body, headers = await _post(
                s, gw.url + route, _request(route, stream, _text(20, route[-4:])), "bytes"
            )
            assert status == 200, body
            engine = [b for h, b in proxy.responses() if h.startswith("HTTP/1.1 200")]
            assert engine and engine[-1] == body, route  # the last response the engine sent is ours
            if stream:
                assert headers["Content-Type"].startswith("text/event-stream")
                events = body.split(b"\n\n")
                assert events[-2:] == [b"data: [DONE]", b""], events[-3:]
                assert all(e.startswith(b"data: ") for e in events[:-1])
            else:
                json.loads(body)


async def test_usage_is_learnt_and_the_second_turn_is_a_radix_hit(
    fleet: list[RealServer], redis_url: str
) -> None:
    """Through the gateway (sessions in a real Redis) turn 2 of a session goes home and the engine
    reports >= 90 % of turn 1's prompt cached; kvroute records the engine's own usage figures. A
    session forced elsewhere (its home drained) shows 0 cached there and is counted as a break."""
    log = EventLog()
    gw = await start_gateway(
        fast_config([s.url for s in fleet], redis_url=redis_url, health=REAL_HEALTH, timeouts=REAL_TIMEOUTS),
        hooks=(log,),
    )
    salt = uuid.uuid4().hex[:6]
    url = gw.url + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as s:
            history = [{"role": "user", "content": _text(60, salt)}]
            usages = []
            homes = []
            for turn in range(3):
                doc = {"model": "tiny", "messages": history, "max_tokens": 8}
                status, body, headers = await _post(s, url, doc, f"radix-{salt}")
                assert status == 200, body
                answer = json.loads(body)
                usages.append(answer["usage"])
                homes.append(headers["X-Kvroute-Replica"])
                history = [
                    *history,
                    {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": _text(10, f"{salt}t{turn}")},
                ]
            assert len(set(homes)) == 1, homes
            first = usages[0]["prompt_tokens"]
            assert first > 300 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
            for prev, u in itertools.pairwise(usages):
                assert u["prompt_tokens_details"]["cached_tokens"] >= 0.9 * prev["prompt_tokens"], usages
            # kvroute learnt exactly what the engine reported
            await wait_for(lambda: len(log.of(RequestFinished)) == 3)
            fins = log.of(RequestFinished)
            assert [(f.prompt_tokens, f.cached_tokens) for f in fins] == [
                (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]) for u in usages
            ]
            assert not any(f.usage_estimated for f in fins)
            assert not log.of(AffinityBroken)

            # force the session elsewhere: drain its home; the next turn lands cold on the other engine
            await gw.store.set_status(homes[0], ReplicaStatus.DRAINING)  # what POST /admin/.../drain does
            status, body, headers = await _post(
                s, url, {"model": "tiny", "messages": history, "max_tokens": 8}, f"radix-{salt}"
            )
            assert status == 200 and headers["X-Kvroute-Replica"] != homes[0]
            assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_for(lambda: bool(log.of(AffinityBroken)))
            (brk,) = log.of(AffinityBroken)
            assert brk.cached_tokens == 0 and brk.expected_cached_tokens > 300
            assert brk.reason.value in {"replica_gone", "draining"}, brk.reason
    finally:
        await gw.close()


async def test_n_choices_of_a_real_chat_turn_grow_the_context_by_one(
    fleet: list[RealServer], redis_url: str
) -> None:
    """SGLang's usage for ``n`` choices counts the prompt once and the tokens of all n; the session's
    context (in a real Redis) grows by one choice's, the one the client goes on with."""
    log = EventLog()
    gw = await start_gateway(
        fast_config([s.url for s in fleet], redis_url=redis_url, health=REAL_HEALTH, timeouts=REAL_TIMEOUTS),
        hooks=(log,),
    )
    salt = uuid.uuid4().hex[:6]
    try:
        async with aiohttp.ClientSession() as s:
            for i, stream in enumerate((False, True)):
                extra: dict[str, Any] = {"n": 3, "ignore_eos": True}
                if stream:
                    extra["stream_options"] = {"include_usage": True}
                doc = _request("/v1/chat/completions", stream, _text(40, f"{salt}{i}"), 4, **extra)
                status, body, _ = await _post(s, gw.url + "/v1/chat/completions", doc, f"n3-{salt}-{i}")
                assert status == 200, body
        await wait_for(lambda: len(log.of(RequestFinished)) == 2)
        for i, fin in enumerate(log.of(RequestFinished)):
            assert fin.ok and fin.completion_tokens == 12 and fin.prompt_tokens, fin
            sess = await gw.store.session(f"n3-{salt}-{i}")
            assert sess is not None and sess.context_tokens == fin.prompt_tokens + 4
    finally:
        await gw.close()


async def test_real_metrics_and_loads_reach_the_snapshot(fleet: list[RealServer], gateway_factory: Any) -> None:
    """The real ``/metrics`` and ``/v1/loads`` are parsed: capacity, running, queued, token usage and
    waiting uncached tokens of a busy engine reach the gateway's snapshot."""
    target = fleet[0]
    gw = await gateway_factory(
        [target.url], health={"health_interval_s": 30.0, "scrape_interval_s": 0.2}, timeouts=REAL_TIMEOUTS
    )
    await wait_for(lambda: _engine(gw), timeout_s=10)
    eng = await _engine(gw)
    assert eng.capacity_tokens == POOL_TOKENS and eng.running == 0 and eng.queued == 0

    seen: dict[str, float] = {"running": 0, "queued": 0, "kv_util": 0.0, "waiting_uncached_tokens": 0}

    async def watch() -> None:
        while True:
            e = await _engine(gw)
            if e is not None:
                for k, v in seen.items():
                    seen[k] = max(v, getattr(e, k))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            # a burst of long prompts (~2.3k tokens each, ~14k in all: more than the 12k pool) to one
            # engine: some run, the rest wait (uncached) in its queue
            docs = [
                {"text": _text(180, f"q{i}{uuid.uuid4().hex[:4]}"),
                 "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
                for i in range(6)
            ]
            results = await asyncio.gather(*(_post(s, target.url + "/generate", d) for d in docs))
        assert all(st == 200 for st, _, _ in results), [b[:300] for _, b, _ in results]
    finally:
        await asyncio.sleep(0.5)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    assert seen["running"] >= 1 and seen["kv_util"] > 0, seen
    assert seen["queued"] >= 1 and seen["waiting_uncached_tokens"] > 0, seen


async def _engine(gw: Any) -> Any:
    reps = await gw.store.replicas()
    e = reps[0].engine
    return e if e.updated_at > 0 else None


async def test_sidecar_registers_a_real_engine(fleet: list[RealServer], redis_url: str) -> None:
    """``kvroute sidecar`` reads the real ``/server_info`` and registers the engine with its real
    capacity and model, then heartbeats its real load."""
    from router.store.redis import RedisStore

    target = fleet[1]
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "router.cli", "sidecar", "--engine-url", target.url, "--redis", redis_url,
        "--listen-host", "127.0.0.1", "--listen-port", "0", "--heartbeat-interval", "0.5",
        "--health-interval", "2", "--probe-timeout", "5",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )
    store = RedisStore.from_url(redis_url, gateway_id="test-reader")
    try:

        async def registered() -> Any:
            reps = await store.replicas()
            return reps[0] if reps and reps[0].engine.updated_at > 0 else None

        await wait_for(registered, timeout_s=30)
        rep = await registered()
        info = get_json(target.url + "/server_info")
        assert rep.url == target.url and rep.capacity_tokens == info["max_total_num_tokens"] == POOL_TOKENS
        assert rep.model == info["served_model_name"]
        assert rep.engine.capacity_tokens == POOL_TOKENS
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await store.close()


async def test_sigterm_drain_loses_no_real_stream(fleet: list[RealServer]) -> None:
    """SIGTERM to ``kvroute serve`` with real streams in flight: every stream ends complete
    (``finish_reason`` length, ``[DONE]``), then the gateway exits 0."""
    args = [PY, "-m", "router", "serve", "--host", "127.0.0.1", "--port", "0",
            "--set", "health.health_interval_s=30", "--set", "timeouts.shutdown_s=60"]
    for s in fleet:
        args += ["--replica", s.url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env
    )
    drain: asyncio.Task[None] | None = None
    try:
        url = await _listening(proc)
        drain = asyncio.create_task(_drain(proc))  # a pipe nobody reads blocks the gateway's logging
        n = 4
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

            async def stream(i: int, started: asyncio.Event) -> bytes:
                doc = _request("/v1/completions", True, _text(30, f"drain{i}"), max_tokens=300, ignore_eos=True)
                async with s.post(url + "/v1/completions", json=doc, headers={"Modal-Session-Id": f"d{i}"}) as r:
                    assert r.status == 200
                    first = await r.content.readline()
                    started.set()
                    return first + await r.read()

            events = [asyncio.Event() for _ in range(n)]
            tasks = [asyncio.create_task(stream(i, events[i])) for i in range(n)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            proc.send_signal(signal.SIGTERM)
            bodies = await asyncio.gather(*tasks)
        for body in bodies:
            chunks = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
            assert body.endswith(b"data: [DONE]\n\n")
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == 300
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if drain is not None:
            await asyncio.gather(drain, return_exceptions=True)


async def _listening(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
        assert line, "kvroute serve exited before listening"
        if "kvroute gateway listening on http://" in line:
            return line.rsplit(" ", 1)[1].strip()


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    while await proc.stderr.readline():
        pass


async def test_client_disconnect_aborts_the_request_on_the_engine(
    fleet: list[RealServer], gateway_factory: Any
) -> None:
    target = fleet[0]
    gw = await gateway_factory([target.url], health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    doc = _request("/v1/chat/completions", True, _text(20, "gone"), max_tokens=4000, ignore_eos=True)
    async with aiohttp.ClientSession() as s, s.post(
        gw.url + "/v1/chat/completions", json=doc, headers={"Modal-Session-Id": "gone"}
    ) as r:
        assert r.status == 200
        for _ in range(3):
            await r.content.readline()
        await wait_for(lambda: _running(target) == 1, timeout_s=5)  # /v1/loads lags a few 100 ms
        r.close()  # the client goes away mid-stream
    # without an abort 4000 tokens take ~20 s on one core; the engine drops it at once
    await wait_for(lambda: _running(target) == 0, timeout_s=5)
    await wait_for(lambda: _in_flight_zero(gw), timeout_s=5)


def _running(s: RealServer) -> int:
    return int(sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in get_json(s.url + "/v1/loads")["loads"]))


async def _in_flight_zero(gw: Any) -> bool:
    return all(r.in_flight == 0 for r in await gw.store.replicas()) and gw.runtime.in_flight == 0


async def test_engine_killed_mid_stream_gives_an_sse_error_event(victim: RealServer, gateway_factory: Any) -> None:
    """A real engine killed (SIGKILL, its whole process group) mid-stream: the client's stream ends
    with an SSE error event, never silently, and no load is left behind."""
    try:
        gw = await gateway_factory([victim.url], health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
        doc = _request("/v1/chat/completions", True, _text(20, "kill"), max_tokens=4000, ignore_eos=True)
        async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/chat/completions", json=doc, headers={"Modal-Session-Id": "kill"}
        ) as r:
            assert r.status == 200
            for _ in range(3):
                assert (await r.content.readline()).startswith((b"data: ", b"\n"))
            os.killpg(victim.proc.pid, signal.SIGKILL)
            rest = await asyncio.wait_for(r.read(), 60)
        events = [e.strip() for e in rest.split(b"\n\n") if e.strip()]
        # the gateway's error event, then its [DONE] so that OpenAI clients stop reading
        assert events[-1] == b"data: [DONE]", events[-3:]
        err = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert err["code"] == 502 and "failed mid-stream" in err["message"], err
        await wait_for(lambda: _in_flight_zero(gw), timeout_s=5)
    finally:
        stop_real_server(victim)


async def test_a_busy_real_engine_is_not_ejected_and_a_down_one_is_still_tried(
    fleet: list[RealServer], gateway_factory: Any
) -> None:
    """Both live findings, on a real engine. SGLang's /health takes >= 1 s (a one-token request
    through the scheduler after a 1 s sleep), so with a 0.5 s probe every probe times out: while
    requests keep being answered the replica stays ACTIVE (it used to be ejected again and again).
    Silent for ``stall_after_s`` it goes DOWN, and a client is still served (panic routing), not
    refused with 503 ``no_replica``."""
    target = fleet[0]
    metrics = GatewayMetrics()
    gw = await gateway_factory(
        [target.url],
        hooks=(metrics,),
        health={"health_interval_s": 0.3, "scrape_interval_s": 1.0, "unhealthy_threshold": 2,
                "stall_after_s": 3.0},
        timeouts={**REAL_TIMEOUTS, "probe_s": 0.5},
    )
    discovery = gw.runtime.discovery
    assert discovery is not None
    # a 0.5 s probe never sees SGLang's /health answer, so the first good check that activates a
    # joining replica never comes: take it as activated earlier (as with the default 2 s probe)
    for r in await gw.store.replicas():
        await gw.store.set_status(r.id, ReplicaStatus.ACTIVE)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        loop = asyncio.get_running_loop()
        end = loop.time() + 6.0
        n = 0
        while loop.time() < end:  # ~6 s of requests, one after another
            status, body, _ = await _post(
                s, gw.url + "/generate", _request("/generate", False, _text(40, f"busy{n}"), max_tokens=16)
            )
            assert status == 200, body
            assert await _status(gw, ReplicaStatus.ACTIVE)
            n += 1
        assert discovery.health_busy >= 5 and discovery.health_failures == 0, (n, discovery.health_busy)
        # silence: probes keep timing out and nothing else shows the engine alive
        await wait_for(lambda: _status(gw, ReplicaStatus.DOWN), timeout_s=10)
        status, body, _ = await _post(s, gw.url + "/v1/completions", _request("/v1/completions", False, "hi"))
        assert status == 200, body
        assert (metrics.registry.get_sample_value("kvroute_panic_routes_total") or 0) >= 1


async def _status(gw: Any, want: ReplicaStatus) -> bool:
    return all(r.status is want for r in await gw.store.replicas())


async def test_empty_generate_input_is_refused_before_it_can_kill_the_engine(
    fleet: list[RealServer], gateway_factory: Any
) -> None:
    """SGLang 0.5.23 exits on ``/generate`` with ``{"text": ""}`` (its scheduler fails to reshape 0
    elements); the gateway's retry of the dropped connection took a second engine down with it. The
    gateway answers 400 itself, and the engines keep serving."""
    gw = await gateway_factory([r.url for r in fleet], health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    async with aiohttp.ClientSession() as s:
        for doc in ({"text": ""}, {"text": "", "stream": True}, {"input_ids": []}):
            status, body, _ = await _post(s, gw.url + "/generate", doc)
            assert status == 400, body
            assert json.loads(body)["error"]["code"] == "bad_request"
        for r in fleet:
            assert get_json(r.url + "/get_model_info")  # alive
        status, body, _ = await _post(s, gw.url + "/generate", _request("/generate", False, "still here"))
        assert status == 200, body


async def test_engine_sessions_stay_on_the_engine_that_opened_them(fleet: list[RealServer], redis_url: str) -> None:
    """SGLang's ``/open_session`` through two gateways sharing a real Redis: each session's turns
    (``session_params`` with the previous turn's ``rid``) reach the engine that opened it, whichever
    gateway they pass and whatever session header they carry, and continue its request tree there;
    a duplicate open, a closed session and an unknown one are refused before any engine."""
    urls = [s.url for s in fleet]
    gws = [
        await start_gateway(
            fast_config(urls, redis_url=redis_url, gateway_id=f"es{i}", health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
        )
        for i in range(2)
    ]
    salt = uuid.uuid4().hex[:6]
    try:
        async with aiohttp.ClientSession() as s:
            opened: list[tuple[str, str]] = []
            for i in range(4):
                body: dict[str, Any] = {"capacity_of_str_len": 65536}
                if i % 2 == 0:  # half name their session, half let the gateway name it
                    body["session_id"] = f"es-{salt}-{i}"
                async with s.post(gws[i % 2].url + "/open_session", json=body) as r:
                    assert r.status == 200, await r.text()
                    sid = await r.json()
                    opened.append((sid, r.headers["X-Kvroute-Replica"]))
                assert sid == body.get("session_id", sid) and len(sid) >= 8
            again = {"capacity_of_str_len": 8, "session_id": opened[0][0]}
            async with s.post(gws[1].url + "/open_session", json=again) as r:
                assert r.status == 400 and "already open" in (await r.json())["error"]["message"]
            for n, (sid, home) in enumerate(opened):
                rid, before = None, 0
                for turn in range(3):
                    params: dict[str, Any] = {"id": sid} if rid is None else {"id": sid, "rid": rid}
                    text = _text(20, f"{salt}{n}{turn}")
                    doc = _request("/generate", False, text, 4, session_params=params, sampling={"ignore_eos": True})
                    # another session's header: the policy alone would place this request afresh
                    other = f"other-{salt}-{n}-{turn}"
                    status, body, h = await _post(s, gws[turn % 2].url + "/generate", doc, other)
                    assert status == 200, body
                    assert (h["X-Kvroute-Replica"], h["X-Kvroute-Reason"]) == (home, "pinned")
                    unbound = await gws[0].store.session(other)
                    assert unbound is None or unbound.home is None  # the pin decided, not the header
                    meta = json.loads(body)["meta_info"]
                    if rid is not None:  # the engine prepended the turn before: its tree is there
                        assert meta["prompt_tokens"] > before and meta["cached_tokens"] >= before - 1, meta
                    rid, before = meta["id"], meta["prompt_tokens"] + meta["completion_tokens"]
            sid, _ = opened[0]
            async with s.post(gws[1].url + "/close_session", json={"session_id": sid}) as r:
                assert r.status == 200
            for path, doc in (
                ("/generate", _request("/generate", False, "x y z", 2, session_params={"id": sid})),
                ("/close_session", {"session_id": sid}),
                ("/generate", _request("/generate", True, "x y z", 2, session_params={"id": f"never-{salt}"})),
            ):
                status, body, _ = await _post(s, gws[0].url + path, doc)
                assert status == 404, body
                assert json.loads(body)["error"]["code"] == "not_found"
    finally:
        for gw in gws:
            await gw.close()


def _messages_reply(body: bytes, stream: bool) -> tuple[str, int]:
    """The assistant's text and ``output_tokens`` of a /v1/messages answer (Anthropic's shape,
    streamed or not)."""
    if not stream:
        doc = json.loads(body)
        text = "".join(b["text"] for b in doc["content"] if b.get("type") == "text")
        return text, doc["usage"]["output_tokens"]
    out, output_tokens = [], -1
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            ev = json.loads(line[6:])
            if ev.get("type") == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                out.append(ev["delta"]["text"])
            elif ev.get("type") == "message_delta":
                output_tokens = ev["usage"]["output_tokens"]
    return "".join(out), output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_anthropic_messages_go_home_and_teach_the_context(
    fleet: list[RealServer], gateway_factory: Any, stream: bool
) -> None:
    """Anthropic's Messages API (what Claude Code speaks), served by SGLang's ``/v1/messages``: a
    session's turns go home and hit the engine's radix cache, and kvroute learns the prompt as the
    engine counts it (``input_tokens`` + ``cache_read_input_tokens``); ``count_tokens`` teaches
    nothing."""
    log = EventLog()
    gw = await gateway_factory([s.url for s in fleet], hooks=(log,), health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    salt = uuid.uuid4().hex[:6]
    sid = f"claude-{salt}-{stream}"
    system = [{"type": "text", "text": _text(40, f"sys{salt}")}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": _text(30, salt)}]
    homes, outputs = [], []
    async with aiohttp.ClientSession() as s:
        for turn in range(3):
            doc = {"model": "tiny", "max_tokens": 4, "system": system, "messages": msgs, "stream": stream}
            status, body, h = await _post(s, gw.url + "/v1/messages", doc, sid)
            assert status == 200, body
            homes.append(h["X-Kvroute-Replica"])
            reply, output_tokens = _messages_reply(body, stream)
            outputs.append(output_tokens)  # the sampled model may end its turn before max_tokens
            msgs = [*msgs, {"role": "assistant", "content": reply},
                    {"role": "user", "content": _text(8, f"{salt}{turn}")}]  # fmt: skip
        count = {"model": "tiny", "system": system, "messages": msgs}
        status, body, _ = await _post(s, gw.url + "/v1/messages/count_tokens", count, sid)
        assert status == 200 and json.loads(body)["input_tokens"] > 0, body
    await wait_for(lambda: len(log.of(RequestFinished)) == 4)
    fins = log.of(RequestFinished)
    turns, counted = fins[:3], fins[3]
    assert len(set(homes)) == 1
    assert all(f.ok and f.prompt_tokens and not f.usage_estimated for f in turns)
    assert [f.completion_tokens for f in turns] == outputs and all(1 <= n <= 4 for n in outputs)
    for prev, fin in itertools.pairwise(turns):
        assert fin.prompt_tokens > prev.prompt_tokens and fin.cached_tokens >= 0.9 * prev.prompt_tokens, fin
    assert counted.ok and counted.prompt_tokens is None  # nothing generated, nothing learnt
    sess = await gw.store.session(sid)
    assert sess is not None and sess.context_tokens == turns[-1].prompt_tokens + outputs[-1] and sess.turns == 3


def _responses_reply(body: bytes, stream: bool) -> tuple[str, int]:
    """The assistant's text and ``output_tokens`` of a /v1/responses answer (streamed or not)."""
    if not stream:
        doc = json.loads(body)
        parts = [p for item in doc["output"] if item.get("type") == "message" for p in item["content"]]
        return "".join(p.get("text", "") for p in parts), doc["usage"]["output_tokens"]
    out, output_tokens = [], -1
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            ev = json.loads(line[6:])
            if ev["type"] == "response.output_text.delta":
                out.append(ev["delta"])
            elif ev["type"] in ("response.completed", "response.incomplete"):
                output_tokens = ev["response"]["usage"]["output_tokens"]
    return "".join(out), output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_responses_api_goes_home_and_teaches_the_context(
    fleet: list[RealServer], gateway_factory: Any, stream: bool
) -> None:
    """OpenAI's Responses API (what Codex speaks), served by SGLang's ``/v1/responses`` without a
    response store: a session named by Codex's ``session_id`` header goes home and hits the radix
    cache, kvroute learns the prompt as the engine counts it (``input_tokens``, the cached part in
    its details); a client without a header is named by its ``prompt_cache_key``."""
    log = EventLog()
    gw = await gateway_factory([s.url for s in fleet], hooks=(log,), health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    salt = uuid.uuid4().hex[:6]
    sid = f"codex-{salt}-{stream}"
    homes, outputs = [], []
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models") as r:  # SGLang's Responses API checks the model's name
            model = (await r.json())["data"][0]["id"]
        items: list[dict[str, Any]] = [{"role": "user", "content": _text(30, salt)}]
        for turn in range(3):
            doc = {"model": model, "instructions": _text(40, f"sys{salt}"), "input": items, "max_output_tokens": 4,
                   "store": False, "stream": stream, "temperature": 0}  # fmt: skip
            async with s.post(gw.url + "/v1/responses", json=doc, headers={"session_id": sid}) as r:
                body = await r.read()
                assert r.status == 200, body
                homes.append(r.headers["X-Kvroute-Replica"])
            reply, output_tokens = _responses_reply(body, stream)
            outputs.append(output_tokens)  # the model may end its answer before max_output_tokens
            items = [*items, {"role": "assistant", "content": reply},
                     {"role": "user", "content": _text(8, f"{salt}{turn}")}]  # fmt: skip
        keyed = {"model": model, "input": _text(20, f"k{salt}"), "max_output_tokens": 2,
                 "prompt_cache_key": f"pck-{sid}"}  # fmt: skip
        async with s.post(gw.url + "/v1/responses", json=keyed) as r:
            assert r.status == 200, await r.read()
    await wait_for(lambda: len(log.of(RequestFinished)) == 4)
    fins = log.of(RequestFinished)
    turns = fins[:3]
    assert len(set(homes)) == 1
    assert all(f.ok and f.session_id == sid and f.prompt_tokens and not f.usage_estimated for f in turns)
    assert [f.completion_tokens for f in turns] == outputs and all(1 <= n <= 4 for n in outputs)
    for prev, fin in itertools.pairwise(turns):
        assert fin.prompt_tokens > prev.prompt_tokens and fin.cached_tokens >= 0.9 * prev.prompt_tokens, fin
    sess = await gw.store.session(sid)
    assert sess is not None and sess.context_tokens == turns[-1].prompt_tokens + outputs[-1] and sess.turns == 3
    assert fins[3].ok and fins[3].session_id == f"pck-{sid}"


def _response_id(body: bytes, stream: bool) -> str:
    """A /v1/responses answer's id: the unstreamed body's, or the stream's ``response.created``."""
    if not stream:
        return str(json.loads(body)["id"])
    first = next(line for line in body.decode().splitlines() if line.startswith("data: "))
    return str(json.loads(first[6:])["response"]["id"])


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_stored_responses_are_found_where_they_were_stored(
    fleet: list[RealServer], gateway_factory: Any, stream: bool
) -> None:
    """Engines started with ``--enable-response-store`` keep each response. A request continuing one
    (``previous_response_id``) goes to the engine that stored it, even when its session's home has
    moved (the policy alone sends it elsewhere, where the engine answers 404), and finds its whole
    conversation cached there; GET and cancel of a stored response reach it too. A response asked
    not to be stored is not pinned, and one whose engine left the fleet is a clean 404."""
    log = EventLog()
    gw = await gateway_factory([s.url for s in fleet], hooks=(log,), health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    salt = uuid.uuid4().hex[:6]
    sid = f"stored-{salt}-{stream}"
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def respond(doc: dict[str, Any], **headers: str) -> tuple[int, bytes, str]:
            doc = {"model": model, "max_output_tokens": 4, "stream": stream, "temperature": 0, **doc}
            async with s.post(gw.url + "/v1/responses", json=doc, headers={"session_id": sid, **headers}) as r:
                where = r.headers.get("X-Kvroute-Replica", "")
                if "previous_response_id" in doc and r.status == 200:
                    assert r.headers["X-Kvroute-Reason"] == "pinned"
                return r.status, await r.read(), where

        instructions = _text(40, f"sys{salt}")  # not carried over by previous_response_id: sent again
        status, body, home = await respond({"instructions": instructions, "input": _text(30, salt)})
        assert status == 200, body
        first_id = _response_id(body, stream)
        other = next(u.removeprefix("http://") for u in (x.url for x in fleet) if not u.endswith(home.split(":")[-1]))
        await gw.store.set_status(home, ReplicaStatus.DRAINING)  # the session's next turn moves away

        cont = {"instructions": instructions, "input": _text(8, f"{salt}a"), "previous_response_id": first_id}
        status, body, went = await respond(cont)
        assert status == 200, body
        assert went == home  # where the response is, not where the session now goes
        second_id = _response_id(body, stream)
        status, body, moved = await respond({"input": _text(20, f"{salt}b"), "store": False})
        assert status == 200 and moved == other, body  # a turn without one goes where the policy says

        async with s.get(f"{gw.url}/v1/responses/{first_id}") as r:
            assert r.status == 200 and (await r.json())["id"] == first_id
            assert r.headers["X-Request-Id"]
        async with s.post(f"{gw.url}/v1/responses/{second_id}/cancel") as r:
            doc = await r.json()  # a finished response: returned as it is
            assert r.status == 200 and doc["id"] == second_id and doc["status"] in ("completed", "incomplete")
        unstored = _response_id(body, stream)
        for rid, code in ((unstored, 404), ("resp_" + "0" * 32, 404), ("nope", 400)):
            async with s.get(f"{gw.url}/v1/responses/{rid}") as r:
                assert r.status == code, (rid, await r.read())

        await gw.store.remove_replica(home)  # the engine that stored them leaves, and they with it
        status, body, _ = await respond({"input": "again", "previous_response_id": second_id})
        assert status == 404 and b"left the fleet" in body, body
        async with s.get(f"{gw.url}/v1/responses/{first_id}") as r:
            assert r.status == 404
    await wait_for(lambda: len(log.of(RequestFinished)) == 4)
    first, cont, _, gone = log.of(RequestFinished)
    assert gone.status == 404 and not gone.ok
    # the engine prepended the stored conversation: nearly all of the first prompt came from cache
    assert cont.ok and cont.prompt_tokens > first.prompt_tokens and cont.cached_tokens >= 0.9 * first.prompt_tokens


async def test_a_background_response_counts_on_its_engine_until_it_has_run(
    fleet: list[RealServer], gateway_factory: Any
) -> None:
    """SGLang answers ``"background": true`` with ``queued`` and runs the request afterwards: the
    gateway keeps it in flight on that engine until a read of the response finds it finished, then
    learns the session's context from the final usage (router/gateway/background.py)."""
    health = {**REAL_HEALTH, "scrape_interval_s": 0.5}  # the cadence of the reads
    gw = await gateway_factory([s.url for s in fleet], health=health, timeouts=REAL_TIMEOUTS)
    sid = f"bg-{uuid.uuid4().hex[:6]}"

    async def in_flight() -> int:
        return sum(r.in_flight for r in await gw.store.replicas())

    async def idle() -> bool:
        return await in_flight() == 0

    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        doc = {"model": model, "temperature": 0, "input": _text(60, sid), "max_output_tokens": 24, "background": True}
        async with s.post(gw.url + "/v1/responses", json=doc, headers={"Modal-Session-Id": sid}) as r:
            queued = await r.json()
            assert r.status == 200 and queued["status"] == "queued", queued
        assert await in_flight() == 1  # answered, still counted: the engine runs it now
        final = queued
        for _ in range(300):
            async with s.get(f"{gw.url}/v1/responses/{queued['id']}") as r:
                final = await r.json()
            if final["status"] not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.1)
        assert final["status"] in ("completed", "incomplete"), final
    await wait_for(idle)
    session = await gw.store.session(sid)
    assert session is not None
    assert session.context_tokens == final["usage"]["input_tokens"] + final["usage"]["output_tokens"]


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_warm_handoff_prefills_a_draining_engines_session_on_its_next_home(
    fleet: list[RealServer], api: str
) -> None:
    """``--warm-handoff`` on Claude Code's and Codex's APIs against real engines: once a session's
    home drains, its last prompt is sent with one output token to the engine its next turn will use
    (a Responses warm-up not stored), so that turn finds its context cached there."""
    from router.handoff import HANDOFF_KEY, HandoffConfig, handoff_setup

    log = EventLog()
    cfg = fast_config([s.url for s in fleet], health=REAL_HEALTH, timeouts=REAL_TIMEOUTS)
    gw = await start_gateway(cfg, hooks=(log,), extra_setup=[handoff_setup(HandoffConfig(interval_s=0.1))])
    salt = uuid.uuid4().hex[:6]
    sid = f"handoff-{api}-{salt}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            system, msgs = _text(40, f"sys{salt}"), [{"role": "user", "content": _text(30, salt)}]

            async def turn() -> str:
                if api == "messages":
                    route = "/v1/messages"
                    doc = {"model": model, "system": system, "messages": msgs, "max_tokens": 4, "stream": True}
                else:
                    route = "/v1/responses"
                    doc = {"model": model, "instructions": system, "input": msgs, "max_output_tokens": 4,
                           "stream": True, "temperature": 0}  # fmt: skip
                async with s.post(gw.url + route, json=doc, headers={"Modal-Session-Id": sid}) as r:
                    body = await r.read()
                    assert r.status == 200, body
                    home = r.headers["X-Kvroute-Replica"]
                reply = (_messages_reply if api == "messages" else _responses_reply)(body, True)[0]
                msgs.extend([{"role": "assistant", "content": reply}, {"role": "user", "content": _text(8, salt)}])
                return home

            home = await turn()
            await gw.store.set_status(home, ReplicaStatus.DRAINING)
            manager = gw.app[HANDOFF_KEY]
            await wait_for(lambda: manager.stats.sent + manager.stats.failed >= 1, timeout_s=60)
            assert manager.stats.failed == 0, manager.stats
            moved = await turn()
        await wait_for(lambda: len(log.of(RequestFinished)) == 2)
        first, second = log.of(RequestFinished)
        assert moved != home and second.replica_id == moved
        # the warm-up prefilled the first turn's whole prompt there, before this turn came
        assert second.cached_tokens is not None and second.cached_tokens >= 0.9 * first.prompt_tokens, (first, second)
        assert (manager.stats.helped, manager.stats.not_helped, manager.stats.missed) == (1, 0, 0), manager.stats
    finally:
        await gw.close()

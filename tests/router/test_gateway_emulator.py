"""The gateway in front of the project's SGLang-compatible emulator (``replica.emulator``).

Relay fidelity against SGLang's real wire format (modulo ids and timestamps), the emulator's own
fault knobs (``POST /_emulator/faults``), the engine's prefix cache seen through ``cached_tokens``,
and engine-side aborts when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from replica.emulator.profiles import get_profile
from replica.emulator.runner import Running, start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from replica.emulator.timemodel import alone_ttft_s
from router.events import RequestFinished, UpstreamRetry
from router.model import PinKind
from tests.router.conftest import EventLog, wait_for

_VOLATILE = re.compile(
    rb'"(id|rid|created|e2e_latency|response_sent_to_client_ts|request_received_ts|request_finished_ts|'
    rb"queue_time|forward_entry_time|prefill_finished_time|first_token_latency|api_server_dispatch_finish_ts|"
    rb'decode_throughput|timestamp)":("[^"]*"|[-0-9.e+]+|null)'
)


def _normalise(raw: bytes) -> bytes:
    return _VOLATILE.sub(rb'"\1":X', raw)


@pytest.fixture
async def emulators() -> AsyncIterator[Any]:
    started: list[Running] = []

    async def make(n: int, **cfg: Any) -> list[Running]:
        config = EmulatorConfig(**{"profile": get_profile("small-test"), "time_scale": 0.002, **cfg})
        reps = await start_emulators(n, config=config, first_index=len(started))
        started.extend(reps)
        return reps

    yield make
    await stop_emulators(started)


def _chat(text: str, stream: bool, max_tokens: int = 8) -> bytes:
    obj: dict[str, Any] = {
        "model": "emulated/small-test",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
        "rid": "fixed-rid-1",
    }
    if stream:
        obj["stream_options"] = {"include_usage": True}
    return json.dumps(obj).encode()


BODIES = {
    "/v1/chat/completions": _chat,
    "/v1/completions": lambda text, stream: json.dumps(
        {
            "model": "emulated/small-test",
            "prompt": text,
            "max_tokens": 8,
            "stream": stream,
            "rid": "fixed-rid-1",
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
    ).encode(),
    "/generate": lambda text, stream: json.dumps(
        {"text": text, "sampling_params": {"max_new_tokens": 8}, "stream": stream, "rid": "fixed-rid-1"}
    ).encode(),
}


async def _post(s: aiohttp.ClientSession, url: str, body: bytes, sid: str | None) -> tuple[int, bytes, Any]:
    headers = {"Content-Type": "application/json"}
    if sid:
        headers["Modal-Session-Id"] = sid
    async with s.post(url, data=body, headers=headers) as r:
        return r.status, await r.read(), r.headers


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", list(BODIES))
async def test_relay_matches_direct_modulo_ids(
    emulators: Any, gateway_factory: Any, route: str, stream: bool
) -> None:
    via, direct = await emulators(2)
    gw = await gateway_factory([via.url])
    body = BODIES[route]("Explain the bug in this function. " * 20, stream)
    async with aiohttp.ClientSession() as s:
        st1, got, h1 = await _post(s, gw.url + route, body, "emu-1")
        st2, want, h2 = await _post(s, direct.url + route, body, None)
    assert st1 == st2 == 200
    assert h1["Content-Type"] == h2["Content-Type"]
    assert h1["X-Emulator-Replica"] == via.name  # the replica's own headers pass through
    if not stream:
        assert _normalise(got) == _normalise(want)
        return
    # Chunk boundaries follow the emulator's decode steps as its event loop wakes up, which differ
    # between two runs on a loaded machine (a late wake-up sends two steps in one chunk), so the
    # streams are compared as SSE: well-formed events, the same generated text, and the same final
    # event (finish / usage / meta_info) modulo ids and timestamps. Byte-for-byte relay of a fixed
    # chunk sequence is pinned by test_gateway_functional.py's scripted replica.
    got_events, want_events = _sse_events(got), _sse_events(want)
    assert got.endswith(b"data: [DONE]\n\n") and got_events
    assert _final(got_events[-1]) == _final(want_events[-1])
    assert _sse_text(route, got_events) == _sse_text(route, want_events)


def _final(event: bytes) -> Any:
    """The last event without what depends on time or chunking (SGLang stamps the send time on the
    first chunk only, so a one-chunk stream carries it on its last event too)."""
    doc = json.loads(_normalise(event).replace(b":X", b':"X"'))
    if isinstance(doc.get("meta_info"), dict):
        doc["meta_info"].pop("response_sent_to_client_ts", None)
    return doc


def _sse_events(raw: bytes) -> list[bytes]:
    events = [e for e in raw.split(b"\n\n") if e]
    assert events and events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events)
    return [e[len(b"data: ") :] for e in events[:-1]]


def _sse_text(route: str, events: list[bytes]) -> str:
    docs = [json.loads(e) for e in events]
    if route == "/generate":  # cumulative text: the last event has it all
        return str(docs[-1]["text"])
    out = []
    for d in docs:
        for c in d.get("choices") or []:
            piece = c.get("text") if route == "/v1/completions" else (c.get("delta") or {}).get("content")
            out.append(piece or "")
    return "".join(out)


async def test_cached_tokens_learned_across_turns(emulators: Any, gateway_factory: Any) -> None:
    reps = await emulators(2)
    log = EventLog()
    gw = await gateway_factory([r.url for r in reps], hooks=(log,))
    history = "You are a coding agent working on a repository. " * 30
    async with aiohttp.ClientSession() as s:
        for turn in range(3):
            history += f" Turn {turn}: run the tests and fix what fails."
            status, _, _ = await _post(s, gw.url + "/v1/chat/completions", _chat(history, True, 4), "agent-1")
            assert status == 200
    await wait_for(lambda: len(log.of(RequestFinished)) == 3)
    fin = log.of(RequestFinished)
    assert len({f.replica_id for f in fin}) == 1
    assert fin[0].cached_tokens == 0
    assert all(
        f.cached_tokens and f.cached_tokens >= 0.8 * f0.prompt_tokens
        for f, f0 in zip(fin[1:], fin[:-1], strict=True)
    )
    assert not any(f.breaks for f in fin)
    sess = await gw.store.session("agent-1")
    assert (
        sess is not None
        and sess.turns == 3
        and sess.context_tokens == fin[-1].prompt_tokens + fin[-1].completion_tokens
    )


async def _set_faults(s: aiohttp.ClientSession, rep: Running, **faults: Any) -> None:
    async with s.post(rep.url + "/_emulator/faults", json=faults) as r:
        assert r.status == 200


async def _state(s: aiohttp.ClientSession, rep: Running) -> dict[str, Any]:
    async with s.get(rep.url + "/_emulator/state") as r:
        return dict(await r.json())


async def test_emulator_faults_retry_and_break(emulators: Any, gateway_factory: Any) -> None:
    a, b = await emulators(2)
    log = EventLog()
    gw = await gateway_factory([a.url, b.url], hooks=(log,))
    async with aiohttp.ClientSession() as s:
        _, _, h = await _post(s, gw.url + "/generate", BODIES["/generate"]("hello " * 50, False), "f-1")
        home = a if h["X-Kvroute-Replica"].endswith(f":{a.port}") else b
        other = b if home is a else a
        await _set_faults(s, home, status=503, count=1)
        status, _, h = await _post(s, gw.url + "/generate", BODIES["/generate"]("hello " * 50, True), "f-1")
        assert status == 200 and h["X-Kvroute-Replica"].endswith(f":{other.port}")
        assert [r.error for r in log.of(UpstreamRetry)] == ["upstream_status"]

        for rep in (a, b):
            await _set_faults(s, rep, break_after_chunks=2, count=1)
        body = BODIES["/v1/chat/completions"]("x " * 40, True)
        status, raw, h = await _post(s, gw.url + "/v1/chat/completions", body, "f-2")
        assert status == 200
        events = [e for e in raw.decode().split("\n\n") if e]
        assert len(events) == 4  # two relayed chunks, then the gateway's error event and [DONE]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 502
        assert events[-1] == "data: [DONE]"
        await wait_for(lambda: all(r.in_flight == 0 for r in gw.runtime.store.core.replicas()))


async def test_disconnect_aborts_in_the_engine(emulators: Any, gateway_factory: Any) -> None:
    (rep,) = await emulators(1, time_scale=0.05)
    gw = await gateway_factory([rep.url])
    async with aiohttp.ClientSession() as s:
        async with s.post(
            gw.url + "/generate",
            headers={"Modal-Session-Id": "bye"},
            data=BODIES["/generate"]("long " * 200, True).replace(
                b'"max_new_tokens": 8', b'"max_new_tokens": 12000'  # ~2.7 s of wall: no CI stall ends it first
            ),
        ) as r:
            assert r.status == 200
            await r.content.readline()
            r.close()
        await wait_for(lambda: _aborted(s, rep), timeout_s=5)
    await wait_for(lambda: all(x.in_flight == 0 for x in gw.runtime.store.core.replicas()))


async def _aborted(s: aiohttp.ClientSession, rep: Running) -> bool:
    st = await _state(s, rep)
    return bool(st["requests_aborted"] == 1 and st["in_flight"] == 0)


def _agent_chat(system: str, task: str, history: str, max_tokens: int) -> bytes:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": task + history}]
    return json.dumps({"model": "emulated/small-test", "messages": msgs, "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": False}).encode()  # fmt: skip


async def test_a_sub_agent_continues_where_its_own_context_is(emulators: Any, gateway_factory: Any) -> None:
    """A thicc session (three requests in flight at home) sends a sub-agent's first turn to an
    overflow replica; once home has room again, the sub-agent's next turn still goes there, where its
    own context is cached (``RouteRequest.chain_key`` from the body), while the parent stays home."""
    reps = await emulators(3, time_scale=1.0)
    gw = await gateway_factory([r.url for r in reps])
    parent_sys, sub_sys = "You are a coding agent. " * 40, "You are a search sub-agent. " * 20
    parent = _agent_chat(parent_sys, "Fix the failing test in foo.py. ", "history " * 300, 60)
    async with aiohttp.ClientSession() as s:
        url = gw.url + "/v1/chat/completions"
        status, _, h = await _post(s, url, parent, "thicc-1")
        assert status == 200
        home = h["X-Kvroute-Replica"]
        # three of the parent's requests in flight at home, then the sub-agent's first turn
        held = [asyncio.create_task(_post(s, url, parent, "thicc-1")) for _ in range(3)]
        await wait_for(lambda: gw.runtime.store.core.session("thicc-1").in_flight_total == 3)  # type: ignore[union-attr]
        sub1 = _agent_chat(sub_sys, "Find every caller of bar(). ", "found " * 200, 4)
        status, _, h = await _post(s, url, sub1, "thicc-1")
        assert status == 200 and h["X-Kvroute-Reason"] == "thicc_split"
        overflow = h["X-Kvroute-Replica"]
        assert overflow != home
        assert all(r[0] == 200 for r in await asyncio.gather(*held))
        # home is idle now; the sub-agent's next turn extends its own context, which is on the overflow
        sub2 = _agent_chat(sub_sys, "Find every caller of bar(). ", "found " * 200 + "more " * 50, 4)
        status, raw, h = await _post(s, url, sub2, "thicc-1")
        assert status == 200 and h["X-Kvroute-Replica"] == overflow
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.5 * json.loads(raw)["usage"]["prompt_tokens"]
        # the parent's next turn is still at home
        status, _, h = await _post(s, url, _agent_chat(parent_sys, "Fix the failing test in foo.py. ",
                                                       "history " * 330, 4), "thicc-1")  # fmt: skip
        assert status == 200 and h["X-Kvroute-Replica"] == home


async def test_a_prompt_the_engine_refuses_in_stream_is_a_failure_and_teaches_nothing(
    emulators: Any, gateway_factory: Any
) -> None:
    # SGLang 0.5.23 answers a streamed prompt over max_req_input_len with 200, an error event and a
    # usage chunk of prompt_tokens 1 (the emulator does the same, checked against the real engine):
    # the gateway relays it unchanged, counts the request failed and learns no context of 1 token
    (rep,) = await emulators(1)
    log = EventLog()
    gw = await gateway_factory([rep.url], hooks=(log,))
    short = "fix the failing test in module_x.py please. " * 20
    async with aiohttp.ClientSession() as s:
        status, _, _ = await _post(s, gw.url + "/v1/chat/completions", _chat(short, True, 4), "big-1")
        assert status == 200
        long = "fix the failing test in module_x.py please. " * 800  # ~8,800 tokens: over 8,186
        status, body, _ = await _post(s, gw.url + "/v1/chat/completions", _chat(long, True, 4), "big-1")
    assert status == 200
    assert b'data: {"error": {' in body and body.endswith(b"data: [DONE]\n\n"), body[-300:]
    await wait_for(lambda: len(log.of(RequestFinished)) == 2)
    first, refused = log.of(RequestFinished)
    assert first.ok and refused.status == 200 and not refused.ok
    assert refused.error == "upstream_error_event" and refused.prompt_tokens is None
    sess = await gw.store.session("big-1")
    assert sess is not None and sess.context_tokens == first.prompt_tokens + first.completion_tokens


async def test_parallel_samples_of_one_generate_prompt_count_the_prompt_once(
    emulators: Any, gateway_factory: Any
) -> None:
    # /generate with sampling_params.n > 1 answers a list, one object per sequence, each with the whole
    # prompt's counts (SGLang 0.5.23; the emulator does the same, checked against the real engine): the
    # gateway learns the prompt once, not n times (which made the session's bytes per token n x small)
    (rep,) = await emulators(1)
    log = EventLog()
    gw = await gateway_factory([rep.url], hooks=(log,))
    text = "explain the failing assertion in test_parser.py. " * 20
    async with aiohttp.ClientSession() as s:
        for n in (1, 3):
            body = {"text": text, "sampling_params": {"max_new_tokens": 4, "n": n, "ignore_eos": True}}
            status, raw, _ = await _post(s, gw.url + "/generate", json.dumps(body).encode(), f"par-{n}")
            assert status == 200, raw
    await wait_for(lambda: len(log.of(RequestFinished)) == 2)
    single, par = log.of(RequestFinished)
    docs = json.loads(raw)
    assert isinstance(docs, list) and len(docs) == 3
    assert par.prompt_tokens == single.prompt_tokens == docs[0]["meta_info"]["prompt_tokens"]
    assert par.cached_tokens == docs[0]["meta_info"]["cached_tokens"]
    assert par.completion_tokens == 12  # every sequence's tokens were generated
    one, three = await gw.store.session("par-1"), await gw.store.session("par-3")
    assert one is not None and three is not None
    assert three.bytes_per_token == pytest.approx(one.bytes_per_token, rel=0.05)
    # the conversation goes on from one of the three sequences: its context grows by one's tokens
    assert three.context_tokens == one.context_tokens == single.prompt_tokens + 4



async def test_a_generate_stream_of_n_sequences_counts_its_last_sequence_once(
    emulators: Any, gateway_factory: Any
) -> None:
    # a /generate stream's chunks carry each sequence's own counts: the last one is one sequence's
    (rep,) = await emulators(1)
    gw = await gateway_factory([rep.url])
    text = "explain the failing assertion in test_parser.py. " * 20
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "n": 3, "ignore_eos": True}, "stream": True}
    async with aiohttp.ClientSession() as s:
        status, raw, _ = await _post(s, gw.url + "/generate", json.dumps(body).encode(), "gen-stream-3")
        assert status == 200, raw
    last = json.loads([ln for ln in raw.decode().splitlines() if ln.startswith("data: {")][-1][6:])["meta_info"]
    assert last["completion_tokens"] == 4
    sess = await gw.store.session("gen-stream-3")
    assert sess is not None and sess.context_tokens == last["prompt_tokens"] + 4

@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_of_a_chat_turn_grow_the_context_by_one(
    emulators: Any, gateway_factory: Any, stream: bool
) -> None:
    # the OpenAI routes' usage counts the prompt once and the tokens of all n choices (SGLang 0.5.23,
    # checked on the CPU engine: n=3 of 8 tokens each gave completion_tokens 24); the client goes on
    # with one choice, so the session's context is the prompt and one choice's share
    (rep,) = await emulators(1)
    log = EventLog()
    gw = await gateway_factory([rep.url], hooks=(log,))
    msgs = [{"role": "user", "content": "why does the parser reject this input? " * 20}]
    async with aiohttp.ClientSession() as s:
        for n in (1, 3):
            body: dict[str, Any] = {"model": "m", "messages": msgs, "max_tokens": 4, "n": n, "ignore_eos": True}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            status, raw, _ = await _post(s, gw.url + "/v1/chat/completions", json.dumps(body).encode(), f"chat-n{n}")
            assert status == 200, raw
    await wait_for(lambda: len(log.of(RequestFinished)) == 2)
    single, par = log.of(RequestFinished)
    assert par.prompt_tokens == single.prompt_tokens and par.completion_tokens == 12
    one, three = await gw.store.session("chat-n1"), await gw.store.session("chat-n3")
    assert one is not None and three is not None
    assert three.context_tokens == one.context_tokens == single.prompt_tokens + 4


def _in_session(sid: str, text: str, stream: bool = False, rid: str | None = None) -> bytes:
    params = {"id": sid} if rid is None else {"id": sid, "rid": rid}
    doc = {"text": text, "sampling_params": {"max_new_tokens": 4}, "stream": stream, "session_params": params}
    return json.dumps(doc).encode()


async def test_engine_sessions_are_pinned_and_never_tried_elsewhere(emulators: Any, gateway_factory: Any) -> None:
    """SGLang's engine sessions through the gateway (router/gateway/engine_sessions.py): bad opens are
    refused with a 400, an open is pinned to the replica that answered, its turns go there only (a
    failure there is not retried elsewhere, where the session does not exist), and a session whose
    replica left, that was closed or that nobody opened is a 404 that reaches no replica."""
    a, b = await emulators(2)
    log = EventLog()
    gw = await gateway_factory([a.url, b.url], hooks=(log,))
    store = gw.runtime.store
    json_ct = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        for raw, why in (
            (b"{", "not valid JSON"),
            (b"[1]", "must be a JSON object"),
            (b'{"capacity_of_str_len": 9, "session_id": 5}', "session_id must be a non-empty string"),
            (json.dumps({"capacity_of_str_len": 9, "session_id": "s" * 300}).encode(), "longer than"),
        ):
            async with s.post(gw.url + "/open_session", data=raw, headers=json_ct) as r:
                assert r.status == 400 and why in (await r.json())["error"]["message"]
        async with s.get(gw.url + "/close_session", data=b"{}", headers=json_ct) as r:
            assert r.status == 400 and "session_id" in (await r.json())["error"]["message"]
        assert log.of(RequestFinished) == []  # refused before any replica

        async with s.post(gw.url + "/open_session", json={"capacity_of_str_len": 4096}) as r:
            assert r.status == 200
            sid, home_id = await r.json(), r.headers["X-Kvroute-Replica"]
        assert isinstance(sid, str) and len(sid) == 32  # named by the gateway, as SGLang would name it
        assert await store.pinned(PinKind.ENGINE_SESSION, sid) == home_id
        home = a if home_id.endswith(f":{a.port}") else b
        async with s.get(gw.url + "/open_session", json={"capacity_of_str_len": 1, "session_id": sid}) as r:
            assert r.status == 400 and "already open" in (await r.json())["error"]["message"]

        rid = None
        for turn, stream in enumerate((False, True, False)):
            status, raw, h = await _post(s, gw.url + "/generate", _in_session(sid, f"turn {turn} " * 30, stream, rid), None)
            assert status == 200, raw
            assert (h["X-Kvroute-Replica"], h["X-Kvroute-Reason"]) == (home_id, "pinned")
            if not stream:
                rid = json.loads(raw)["meta_info"]["id"]
        await _set_faults(s, home, status=503, count=1)
        status, raw, _ = await _post(s, gw.url + "/generate", _in_session(sid, "again " * 30), None)
        assert status == 503 and log.of(UpstreamRetry) == []  # relayed, not retried on the other replica
        status, raw, _ = await _post(s, gw.url + "/generate", _in_session(sid, "once more " * 30), None)
        assert status == 200, raw

        async with s.post(gw.url + "/close_session", json={"session_id": sid}) as r:
            assert r.status == 200
        assert await store.pinned(PinKind.ENGINE_SESSION, sid) is None
        async with s.post(gw.url + "/open_session", json={"capacity_of_str_len": 64, "session_id": "kept"}) as r:
            assert r.status == 200
            kept_home = r.headers["X-Kvroute-Replica"]
        await store.remove_replica(kept_home)
        served = len(log.of(RequestFinished))
        for body, why in (
            (_in_session("kept", "left " * 20), "which left the fleet"),
            (_in_session("kept", "left " * 20), "is not open behind this gateway"),  # the pin went with it
            (_in_session(sid, "closed " * 20), "is not open behind this gateway"),
            (_in_session("nobody-opened-it", "x", stream=True), "is not open behind this gateway"),
        ):
            status, raw, _ = await _post(s, gw.url + "/generate", body, None)
            assert status == 404 and why in json.loads(raw)["error"]["message"], raw
        assert all(not f.ok and f.replica_id is None for f in log.of(RequestFinished)[served:])
        await wait_for(lambda: all(r.in_flight == 0 for r in store.core.replicas()))


async def _two_turns(
    s: aiohttp.ClientSession, url: str, doc: dict[str, Any], field: str, convo: list[dict[str, Any]],
    headers: dict[str, str],
) -> tuple[list[str], dict[str, Any], list[dict[str, Any]]]:
    """A coding agent's cold unstreamed turn, then a streamed one with the reply appended (``field``
    holds the conversation): the replicas that answered, the first turn's usage, the conversation
    for a next turn."""
    homes: list[str] = []
    usage: dict[str, Any] = {}
    for turn, stream in enumerate((False, True)):
        async with s.post(url, json={**doc, field: convo, "stream": stream}, headers=headers) as r:
            assert r.status == 200
            homes.append(r.headers["X-Kvroute-Replica"])
            raw = await r.read()
        if not stream:
            usage = json.loads(raw)["usage"]
        convo = [*convo, {"role": "assistant", "content": "done " * 8}, {"role": "user", "content": f"next {turn}"}]
    return homes, usage, convo


async def _broken_stream(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], home: Running,
    *, after_chunks: int,
) -> list[str]:
    """The SSE frames a client gets when ``home`` cuts the stream after ``after_chunks`` chunks."""
    await _set_faults(s, home, break_after_chunks=after_chunks, count=1)
    async with s.post(url, json=body, headers=headers) as r:
        assert r.status == 200
        return [e for e in (await r.read()).decode().split("\n\n") if e]


async def test_anthropic_messages_through_the_gateway(emulators: Any, gateway_factory: Any) -> None:
    """Claude Code's traffic: /v1/messages with its X-Claude-Code-Session-Id header goes home, is
    learnt from Anthropic's usage, and a stream the replica breaks ends with Anthropic's error event."""
    a, b = await emulators(2)
    log = EventLog()
    gw = await gateway_factory([a.url, b.url], hooks=(log,))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "refactor the parser " * 40}]
    doc: dict[str, Any] = {"model": "emulated/small-test", "max_tokens": 8, "system": "You are a coder. " * 30}
    headers = {"X-Claude-Code-Session-Id": "cc-1"}
    async with aiohttp.ClientSession() as s:
        homes, usage, msgs = await _two_turns(s, gw.url + "/v1/messages", doc, "messages", msgs, headers)
        assert usage["input_tokens"] > 0 and "cache_read_input_tokens" not in usage  # a cold first turn
        await wait_for(lambda: len(log.of(RequestFinished)) == 2)
        first, second = log.of(RequestFinished)
        assert homes[0] == homes[1] and first.session_id == second.session_id == "cc-1"
        assert first.ok and second.ok and first.cached_tokens == 0
        # the first prompt, cached in whole pages, is a hit at home
        assert second.cached_tokens is not None and second.cached_tokens >= 0.9 * first.prompt_tokens
        sess = await gw.runtime.store.session("cc-1")
        assert sess is not None and sess.context_tokens == second.prompt_tokens + second.completion_tokens

        home = a if homes[0].endswith(f":{a.port}") else b
        body = {**doc, "messages": msgs, "stream": True}
        events = await _broken_stream(s, gw.url + "/v1/messages", body, headers, home, after_chunks=2)
    name, data = events[-1].split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: "))["type"] == "error"
    assert not any("[DONE]" in e for e in events)
    await wait_for(lambda: all(r.in_flight == 0 for r in gw.runtime.store.core.replicas()))


async def test_responses_api_through_the_gateway(emulators: Any, gateway_factory: Any) -> None:
    """Codex's traffic: /v1/responses with its ``session_id`` header goes home and is learnt from the
    Responses API's usage; TTFT counts from the first event after the two sent before the prefill;
    a stream the replica breaks ends with the API's error event, numbered after the relayed ones,
    unless it broke before its first token: then it is retried on another replica."""
    a, b = await emulators(2, time_scale=1.0)  # wall = modelled: a cold prefill takes its modelled time
    log = EventLog()
    gw = await gateway_factory([a.url, b.url], hooks=(log,))
    items: list[dict[str, Any]] = [{"role": "user", "content": "refactor the parser " * 40}]
    headers = {"session_id": "codex-1"}
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        doc: dict[str, Any] = {"model": model, "max_output_tokens": 10, "instructions": "You are a coder. " * 30,
                               "store": False}  # fmt: skip
        homes, usage, items = await _two_turns(s, gw.url + "/v1/responses", doc, "input", items, headers)
        assert usage["input_tokens"] > 0 and usage["input_tokens_details"]["cached_tokens"] == 0
        await wait_for(lambda: len(log.of(RequestFinished)) == 2)
        first, second = log.of(RequestFinished)
        assert homes[0] == homes[1] and first.session_id == second.session_id == "codex-1"
        assert first.ok and second.ok and first.cached_tokens == 0 and second.completion_tokens == 8
        assert second.cached_tokens is not None and second.cached_tokens >= 0.9 * first.prompt_tokens
        sess = await gw.runtime.store.session("codex-1")
        assert sess is not None and sess.context_tokens == second.prompt_tokens + second.completion_tokens
        cold = {**doc, "input": "write the scheduler " * 600, "stream": True}
        async with s.post(gw.url + "/v1/responses", json=cold, headers={"session_id": "codex-cold"}) as r:
            raw = await r.read()
            assert r.status == 200, raw
        await wait_for(lambda: len(log.of(RequestFinished)) == 3)
        fin = log.of(RequestFinished)[2]
        # the first token waits for the prefill; the two events sent before it do not
        floor = alone_ttft_s(get_profile("small-test"), fin.prompt_tokens, 0)
        assert fin.prompt_tokens > 3000 and fin.ttft_s is not None and fin.ttft_s >= 0.9 * floor, (fin, floor)

        home = a if homes[0].endswith(f":{a.port}") else b
        body = {**doc, "input": items, "stream": True}
        events = await _broken_stream(s, gw.url + "/v1/responses", body, headers, home, after_chunks=3)
    name, data = events[-1].split("\n")
    err = json.loads(data.removeprefix("data: "))
    assert name == "event: error" and err["type"] == "error" and err["code"] == "upstream_error"
    relayed = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events[:-1]]
    assert [ev["sequence_number"] for ev in relayed] == list(range(len(relayed))) and err["sequence_number"] == len(relayed)

    # cut after the two events sent before the prefill: they were held, so the request is retried
    # elsewhere and the client gets one whole stream
    async with aiohttp.ClientSession() as s:
        events = await _broken_stream(s, gw.url + "/v1/responses", body, headers, home, after_chunks=2)
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.incomplete", names
    whole = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert [ev["sequence_number"] for ev in whole] == list(range(len(whole)))
    await wait_for(lambda: len(log.of(RequestFinished)) == 5)
    retried = log.of(RequestFinished)[4]
    assert retried.ok and retried.retries == 1 and retried.replica_id != log.of(RequestFinished)[3].replica_id
    await wait_for(lambda: all(r.in_flight == 0 for r in gw.runtime.store.core.replicas()))

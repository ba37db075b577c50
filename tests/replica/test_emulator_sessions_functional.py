"""SGLang's engine sessions on the emulator, over real sockets: ``/open_session``, ``/close_session``
and ``/generate`` with ``session_params`` (what SGLang 0.5.23 answers, measured with curl)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp

from replica.emulator.runner import Running
from tests.replica.conftest import EmuFactory
from tests.replica.test_emulator_server_functional import sse_events, wait_for

DUPLICATE = (
    b'{"error":{"message":"Failed to open the session. Check if a session with the same id is still open."}}'
)
STREAMING = (
    b'{"error":{"message":"Streaming sessions are disabled. '
    b'Please relaunch with --enable-streaming-session."}}'
)
PAGE_1 = {"profile_overrides": {"page_size": 1}}  # cached_tokens exact to the token


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, data: bytes | None = None
) -> tuple[int, str, bytes]:
    async with http.request(method, url, json=body if data is None else None, data=data) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


async def open_session(http: aiohttp.ClientSession, emu: Running, **body: Any) -> str:
    status, _, raw = await call(
        http, "POST", f"{emu.url}/open_session", {"capacity_of_str_len": 1000, **body}
    )
    assert status == 200, raw
    sid: str = json.loads(raw)
    return sid


async def generate(
    http: aiohttp.ClientSession, emu: Running, text: str, max_new: int, **body: Any
) -> dict[str, Any]:
    status, _, raw = await call(
        http,
        "POST",
        f"{emu.url}/generate",
        {"text": text, "sampling_params": {"max_new_tokens": max_new}, **body},
    )
    assert status == 200, raw
    doc: dict[str, Any] = json.loads(raw)
    return doc


def is_validation_error(raw: bytes) -> bool:
    doc = json.loads(raw)
    return list(doc) == ["object", "message", "type", "param", "code"] and (
        doc["object"],
        doc["type"],
        doc["param"],
        doc["code"],
    ) == ("error", "Bad Request", None, 400)


# ---- /open_session and /close_session --------------------------------------------------------------


async def test_open_session_with_and_without_id(emu: Running, http: aiohttp.ClientSession) -> None:
    status, ctype, raw = await call(http, "POST", f"{emu.url}/open_session", {"capacity_of_str_len": 100})
    assert (status, ctype) == (200, "application/json")
    assert re.fullmatch(rb'"[0-9a-f]{32}"', raw), raw  # the engine's uuid4().hex
    assert await call(
        http, "POST", f"{emu.url}/open_session", {"capacity_of_str_len": 100, "session_id": "s1"}
    ) == (200, "application/json", b'"s1"')
    # GET takes the same JSON body
    assert await call(
        http, "GET", f"{emu.url}/open_session", {"capacity_of_str_len": 1, "session_id": "s2"}
    ) == (200, "application/json", b'"s2"')
    async with http.get(f"{emu.url}/_emulator/state") as r:
        assert (await r.json())["engine_sessions_open"] == 3


async def test_open_session_refusals(emu: Running, http: aiohttp.ClientSession) -> None:
    url = f"{emu.url}/open_session"
    await open_session(http, emu, session_id="dup")
    assert await call(http, "POST", url, {"capacity_of_str_len": 1, "session_id": "dup"}) == (
        400,
        "application/json",
        DUPLICATE,
    )
    assert await call(http, "POST", url, {"capacity_of_str_len": 1, "streaming": True}) == (
        400,
        "application/json",
        STREAMING,
    )
    for body, data in (
        ({"session_id": "x"}, None),
        (None, b"{not json"),
        ({"capacity_of_str_len": "many"}, None),
        ({"capacity_of_str_len": 1, "timeout": "soon"}, None),
    ):
        status, _, raw = await call(http, "POST", url, body, data)
        assert status == 400 and is_validation_error(raw), (body, data, raw)
    # none of the refused ones opened a session ("x" can still be opened)
    assert await open_session(http, emu, session_id="x") == "x"


async def test_close_session(emu: Running, http: aiohttp.ClientSession) -> None:
    await open_session(http, emu, session_id="c")
    for method, sid in (("POST", "c"), ("POST", "c"), ("GET", "never-opened")):
        async with http.request(method, f"{emu.url}/close_session", json={"session_id": sid}) as r:
            assert (r.status, r.headers["Content-Length"], await r.read()) == (200, "0", b"")
    status, _, raw = await call(http, "POST", f"{emu.url}/close_session", {})
    assert status == 400 and is_validation_error(raw)
    # closed: like an unknown session, and the id can be opened again
    status, _, raw = await call(
        http, "POST", f"{emu.url}/generate", {"text": "hi", "session_params": {"id": "c"}}
    )
    assert (status, raw) == (400, b'{"error":{"message":"Invalid request: session id c does not exist"}}')
    assert await open_session(http, emu, session_id="c") == "c"


# ---- /generate with session_params -----------------------------------------------------------------


async def test_generate_in_unknown_session(emu: Running, http: aiohttp.ClientSession) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "session_params": {"id": "ghost"}}
    assert await call(http, "POST", f"{emu.url}/generate", body) == (
        400,
        "application/json",
        b'{"error":{"message":"Invalid request: session id ghost does not exist"}}',
    )
    status, ctype, raw = await call(http, "POST", f"{emu.url}/generate", {**body, "stream": True})
    assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
    events = sse_events(raw)
    assert len(events) == 2 and events[1] == b"[DONE]"
    meta = json.loads(events[0])["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "Invalid request: session id ghost does not exist",
        "status_code": 400,
        "err_type": "BadRequestError",
    }
    # SGLang runs a one-token stand-in prompt and sends its one output token
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (1, 1, 0)
    assert (await (await http.get(f"{emu.url}/_emulator/state")).json())["requests_served"] == 0


async def test_open_session_without_rid_is_a_plain_request(emu: Running, http: aiohttp.ClientSession) -> None:
    sid = await open_session(http, emu)
    doc = await generate(http, emu, "hello there my friend", 4, session_params={"id": sid})
    # 21 bytes: 6 tokens, the session adds nothing
    assert (doc["meta_info"]["prompt_tokens"], doc["meta_info"]["completion_tokens"]) == (6, 4)


async def test_rid_continues_prompt_plus_output(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, **PAGE_1) as (emu,):
        sid = await open_session(http, emu, session_id="conv")
        first = (await generate(http, emu, "hello there my friend", 4, session_params={"id": sid}))[
            "meta_info"
        ]
        assert (first["prompt_tokens"], first["completion_tokens"], first["cached_tokens"]) == (6, 4, 0)
        second = (await generate(http, emu, " and more", 5, session_params={"id": sid, "rid": first["id"]}))[
            "meta_info"
        ]
        # previous prompt 6 + previous output 4 + " and more" 3; the previous prompt and output are
        # cached but the output's last token, whose KV was never computed (as in SGLang: 10 + 4 - 1)
        assert (second["prompt_tokens"], second["cached_tokens"]) == (6 + 4 + 3, 6 + 4 - 1)
        # streamed, and a continuation of a continuation
        status, _, raw = await call(
            http,
            "POST",
            f"{emu.url}/generate",
            {
                "text": "!",
                "stream": True,
                "sampling_params": {"max_new_tokens": 2},
                "session_params": {"id": sid, "rid": second["id"]},
            },
        )
        assert status == 200
        third = json.loads(sse_events(raw)[-2])["meta_info"]
        assert (third["prompt_tokens"], third["cached_tokens"]) == (13 + 5 + 1, 13 + 5 - 1)
        # without rid: a new branch from the root, the session's history is not in it
        fresh = (await generate(http, emu, "hello there my friend", 1, session_params={"id": sid}))[
            "meta_info"
        ]
        assert (fresh["prompt_tokens"], fresh["cached_tokens"]) == (6, 5)


async def test_offset_and_drop_previous_output(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, **PAGE_1) as (emu,):
        sid = await open_session(http, emu)
        first = (await generate(http, emu, "0123456789abcdef", 8, session_params={"id": sid}))["meta_info"]
        assert (first["prompt_tokens"], first["completion_tokens"]) == (4, 8)
        cases: list[tuple[dict[str, Any], int, int]] = [
            ({"drop_previous_output": True}, 4 + 1, 4),  # the output left out, the prompt cached
            ({"offset": 2}, 2 + 1, 2),  # the first 2 tokens of the history kept
            ({"offset": -3}, 4 + 8 - 3 + 1, 4 + 8 - 3),  # a Python slice: all but the last 3
            ({"offset": 6, "drop_previous_output": True}, 4 + 1, 4),  # the cut is of the shorter history
        ]
        for params, prompt, cached in cases:
            meta = (
                await generate(http, emu, "new!", 1, session_params={"id": sid, "rid": first["id"], **params})
            )["meta_info"]
            assert (meta["prompt_tokens"], meta["cached_tokens"]) == (prompt, cached), params


async def test_rid_refusals_and_replace(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0) as (emu,):
        sid = await open_session(http, emu)
        url = f"{emu.url}/generate"
        assert await call(http, "POST", url, {"text": "x", "session_params": {"id": sid, "rid": "nope"}}) == (
            400,
            "application/json",
            b'{"error":{"message":"Invalid request session id"}}',
        )
        running = asyncio.create_task(
            call(
                http,
                "POST",
                url,
                {
                    "text": "abcd" * 10,
                    "rid": "long",
                    "sampling_params": {"max_new_tokens": 5000},
                    "session_params": {"id": sid},
                },
            )
        )

        async def decoding() -> bool:
            async with http.get(f"{emu.url}/_emulator/state") as r:
                return bool((await r.json())["load"]["running"] == 1)

        await wait_for(decoding)
        await asyncio.sleep(0.1)  # a few decode steps: some output exists
        assert await call(http, "POST", url, {"text": "x", "session_params": {"id": sid, "rid": "long"}}) == (
            400,
            "application/json",
            b'{"error":{"message":"Session request is appending to a request that hasn\'t finished."}}',
        )
        # replace aborts it and continues from the output it had
        doc = await generate(http, emu, "more", 1, session_params={"id": sid, "rid": "long", "replace": True})
        status, _, raw = await running
        aborted = json.loads(raw)["meta_info"]
        assert status == 200 and aborted["finish_reason"]["type"] == "abort"
        # the history is the prompt (10) and the output the aborted request ended with
        assert 0 < aborted["completion_tokens"] < 5000
        assert doc["meta_info"]["prompt_tokens"] == 10 + aborted["completion_tokens"] + 1


async def test_session_times_out(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    # time_scale 0.05: a 20-second (modelled) timeout is 1 s of wall time
    async with emulators(1, time_scale=0.05) as (emu,):
        t0 = time.monotonic()
        sid = await open_session(http, emu, timeout=20.0)
        await generate(http, emu, "still here", 1, session_params={"id": sid})  # used: the timeout restarts
        used = time.monotonic()
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}, "session_params": {"id": sid}}

        async def expired() -> bool:
            return (await call(http, "POST", f"{emu.url}/generate", body))[0] == 400

        async def reaped() -> bool:
            async with http.get(f"{emu.url}/_emulator/state") as r:
                return bool((await r.json())["engine_sessions_open"] == 0)

        await wait_for(reaped, timeout=5.0)
        assert time.monotonic() - used >= 0.95, "closed before its timeout"
        assert time.monotonic() - t0 < 4.0
        assert await expired()
        assert await open_session(http, emu, session_id=sid) == sid  # the id is free again


async def test_session_params_with_session_id_is_refused(emu: Running, http: aiohttp.ClientSession) -> None:
    sid = await open_session(http, emu)
    body = {"text": "x", "session_id": "s", "session_params": {"id": sid}}
    assert await call(http, "POST", f"{emu.url}/generate", body) == (
        400,
        "application/json",
        b'{"error":{"message":"session_id and session_params cannot both be set."}}',
    )
    status, _, raw = await call(http, "POST", f"{emu.url}/generate", {**body, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert json.loads(events[0])["error"]["message"] == "session_id and session_params cannot both be set."
    assert events[1:] == [b"[DONE]"]


async def test_openai_routes_ignore_session_params(emu: Running, http: aiohttp.ClientSession) -> None:
    for path, body in (
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ):
        status, _, raw = await call(
            http,
            "POST",
            f"{emu.url}{path}",
            {**body, "max_tokens": 2, "session_params": {"id": "ghost", "rid": "r"}},
        )
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 2

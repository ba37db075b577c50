"""The emulator's engine sessions against the real engine: the same ``/open_session``,
``/close_session`` and ``/generate`` ``session_params`` calls go to a real SGLang 0.5.23 and to the
emulator; statuses, content types and body shapes must agree (token counts are each server's own:
the continuation arithmetic is checked on each by its own counts)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

import aiohttp

from loadtests.real_sglang import RealServer
from replica.emulator.runner import running_emulators
from tests.real_sglang.test_emulator_fidelity import emulator_config

Outcome = dict[str, Any]


async def _call(
    s: aiohttp.ClientSession, method: str, url: str, body: Any = None, data: bytes | None = None
) -> tuple[int, str, bytes]:
    async with s.request(method, url, json=body if data is None else None, data=data) as r:
        return r.status, r.headers.get("Content-Type", "").split(";")[0], await r.read()


def _error_shape(raw: bytes) -> Any:
    """The error body with its message kept where SGLang's text is reproduced, else its keys."""
    doc = json.loads(raw)
    if isinstance(doc.get("error"), dict):
        return {"error": doc["error"]}
    return {"keys": list(doc), "type": doc.get("type"), "code": doc.get("code")}  # a validation error


def _stream_shape(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for e in raw.split(b"\n\n"):
        if not e:
            continue
        if e == b"data: [DONE]":
            out.append("[DONE]")
            continue
        d = json.loads(e.removeprefix(b"data: "))
        m = d.get("meta_info", {})
        out.append(
            {
                "finish_reason": m.get("finish_reason"),
                "prompt_tokens": m.get("prompt_tokens"),
                "has completion_tokens": isinstance(m.get("completion_tokens"), int),
                "keys": sorted(d),
            }
        )
    return out


async def session_calls(base: str, tag: str) -> tuple[Outcome, dict[str, int]]:
    """The calls, as shapes (compared between the servers), and token counts (checked on each).
    ``tag`` makes the session ids ones no other test uses (the real fleet is shared)."""
    got: Outcome = {}
    counts: dict[str, int] = {}
    sid, ghost, timed = f"fidelity-{tag}", f"ghost-{tag}", f"timed-{tag}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        status, ctype, raw = await _call(s, "POST", base + "/open_session", {"capacity_of_str_len": 1000})
        got["open, no id"] = (status, ctype, bool(re.fullmatch(rb'"[0-9a-f]{32}"', raw)))
        await _call(s, "POST", base + "/close_session", {"session_id": json.loads(raw)})
        status, ctype, raw = await _call(
            s, "GET", base + "/open_session", {"capacity_of_str_len": 1000, "session_id": sid}
        )
        got["open, id (GET)"] = (status, ctype, raw == json.dumps(sid).encode())
        for case, body, data in (
            ("open, duplicate", {"capacity_of_str_len": 1, "session_id": sid}, None),
            ("open, no capacity_of_str_len", {"session_id": ghost}, None),
            ("open, not JSON", None, b"{not json"),
            ("open, streaming", {"capacity_of_str_len": 1, "session_id": ghost, "streaming": True}, None),
        ):
            status, ctype, raw = await _call(s, "POST", base + "/open_session", body, data)
            got[case] = (status, ctype, _error_shape(raw))
        status, _, raw = await _call(s, "POST", base + "/close_session", {})
        got["close, no session_id"] = (status, _error_shape(raw))
        status, _, raw = await _call(s, "POST", base + "/close_session", {"session_id": ghost})
        got["close, unknown"] = (status, raw)

        gen = {"sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}}
        got |= await _refused_generates(s, base, {**gen, "text": "hello"}, ghost, "unknown session")

        # the new text's own token count, by each server's tokenizer (a plain request)
        new = " and more"
        status, _, raw = await _call(s, "POST", base + "/generate", {**gen, "text": new})
        counts["new"] = json.loads(raw)["meta_info"]["prompt_tokens"]
        status, _, raw = await _call(
            s,
            "POST",
            base + "/generate",
            {**gen, "text": "hello there my friend", "session_params": {"id": sid}},
        )
        first = json.loads(raw)["meta_info"]
        got["generate, open session, no rid"] = (status, sorted(json.loads(raw)))
        counts |= {"first prompt": first["prompt_tokens"], "first completion": first["completion_tokens"]}
        status, _, raw = await _call(
            s,
            "POST",
            base + "/generate",
            {**gen, "text": new, "session_params": {"id": sid, "rid": first["id"]}},
        )
        second = json.loads(raw)["meta_info"]
        got["generate, rid continuation"] = (status, sorted(json.loads(raw)))
        counts |= {
            "second prompt": second["prompt_tokens"],
            "second cached": second["cached_tokens"],
            "second completion": second["completion_tokens"],
        }
        status, ctype, raw = await _call(
            s,
            "POST",
            base + "/generate",
            {**gen, "text": new, "stream": True, "session_params": {"id": sid, "rid": second["id"]}},
        )
        shapes = _stream_shape(raw)
        got["generate, rid continuation, streamed"] = (status, ctype, shapes[-1], shapes[-2]["finish_reason"])
        counts["third prompt"] = shapes[-2]["prompt_tokens"]
        status, _, raw = await _call(
            s,
            "POST",
            base + "/generate",
            {**gen, "text": new, "session_params": {"id": sid, "rid": "no-such-rid"}},
        )
        got["generate, unknown rid"] = (status, _error_shape(raw))
        status, _, raw = await _call(
            s,
            "POST",
            base + "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "session_params": {"id": ghost},
            },
        )
        got["chat ignores session_params"] = (status, json.loads(raw).get("object"))

        status, _, raw = await _call(s, "POST", base + "/close_session", {"session_id": sid})
        got["close, open"] = (status, raw)
        got |= await _refused_generates(s, base, {**gen, "text": "x"}, sid, "closed session")

        # a session unused for its timeout is closed (SGLang sweeps once a second; the emulator's
        # timeout is in modelled seconds, 100x faster here)
        await _call(
            s, "POST", base + "/open_session", {"capacity_of_str_len": 1, "session_id": timed, "timeout": 1.0}
        )
        await asyncio.sleep(2.5)
        status, _, raw = await _call(
            s, "POST", base + "/generate", {**gen, "text": "x", "session_params": {"id": timed}}
        )
        got["generate, timed-out session"] = (status, _error_shape(raw))
    return got, counts


async def _refused_generates(
    s: aiohttp.ClientSession, base: str, doc: dict[str, Any], sid: str, what: str
) -> dict[str, Any]:
    """A /generate in a session the engine does not hold, unstreamed and streamed: status, content
    type and the error's (or the stream's) shape."""
    got: dict[str, Any] = {}
    for stream in (False, True):
        status, ctype, raw = await _call(
            s, "POST", base + "/generate", {**doc, "stream": stream, "session_params": {"id": sid}}
        )
        got[f"generate, {what}, stream={stream}"] = (status, ctype, _stream_shape(raw) if stream else _error_shape(raw))
    return got


def _check_counts(name: str, c: dict[str, int]) -> None:
    assert c["second prompt"] == c["first prompt"] + c["first completion"] + c["new"], (name, c)
    assert c["third prompt"] == c["second prompt"] + c["second completion"] + c["new"], (name, c)
    # the previous prompt and output are cached but the output's last token (never computed)
    assert c["second cached"] == c["first prompt"] + c["first completion"] - 1, (name, c)


async def test_session_fidelity(fleet: list[RealServer]) -> None:
    tag = uuid.uuid4().hex[:8]
    real, real_counts = await session_calls(fleet[0].url, tag)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu, emu_counts = await session_calls(emu_rep.url, tag)
    rows = {k: {"real": real.get(k), "emulator": emu.get(k)} for k in real}
    print(
        json.dumps(
            {"calls": rows, "real counts": real_counts, "emulator counts": emu_counts}, indent=1, default=str
        )
    )
    # the real engine behaves as measured (guards against a fleet set up otherwise)
    assert real["open, duplicate"][0] == 400 and real["generate, rid continuation"][0] == 200, real
    _check_counts("real", real_counts)
    _check_counts("emulator", emu_counts)
    bad = {k: v for k, v in rows.items() if v["real"] != v["emulator"]}
    assert not bad, json.dumps(bad, indent=1, default=str)

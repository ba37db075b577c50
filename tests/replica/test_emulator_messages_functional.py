"""The emulator's Anthropic Messages API over real sockets: SSE framing, event order, usage
arithmetic against the chat route, the second turn's cache hit, errors (shapes checked against real
SGLang in tests/real_sglang/test_messages_fidelity.py)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from replica.emulator.anthropic import to_chat
from replica.emulator.runner import Running
from replica.emulator.tokenizer import encode_text, render_chat
from tests.replica.conftest import EmuFactory

U1 = [{"role": "user", "content": "Write a function that adds two numbers, in Python please."}]
LONG = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "abcd" * 20_000}]}
TOOL = {"name": "get_weather", "input_schema": {"properties": {"city": {"type": "string"}}}}


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, bytes]:
    async with http.post(url, json=body) as r:
        return r.status, r.headers["Content-Type"], await r.read()


def events(raw: bytes) -> list[dict[str, Any]]:
    """Split an Anthropic SSE body exactly as framed: ``event: T\\ndata: {compact JSON}\\n\\n``."""
    assert raw.endswith(b"\n\n")
    out = []
    for frame in raw[:-2].split(b"\n\n"):
        head, data = frame.split(b"\n")
        doc = json.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + doc["type"].encode()
        assert json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() == data.removeprefix(b"data: ")
        out.append(doc)
    return out


def prompt_tokens(body: dict[str, Any]) -> int:
    chat = to_chat(body)
    return encode_text(render_chat(chat["messages"], chat.get("tools"))).num_tokens


async def test_messages_response_shape_and_usage(emu: Running, http: aiohttp.ClientSession) -> None:
    body = {"model": "claude-x", "max_tokens": 5, "messages": U1}
    status, ctype, raw = await post(http, f"{emu.url}/v1/messages", body)
    assert (status, ctype) == (200, "application/json")
    doc = json.loads(raw)
    assert list(doc) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert doc["id"].startswith("msg_") and doc["type"] == "message" and doc["role"] == "assistant"
    assert doc["model"] == "claude-x" and doc["stop_reason"] == "max_tokens"
    [block] = doc["content"]
    assert list(block) == ["type", "text"] and block["type"] == "text" and len(block["text"]) == 5 * 4
    # a cold cache: no cache_read_input_tokens at all, and the prompt is the chat route's
    p = prompt_tokens(body)
    assert doc["usage"] == {"input_tokens": p, "output_tokens": 5}
    status, _, raw = await post(http, f"{emu.url}/v1/chat/completions", {"messages": U1, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] == p


async def test_messages_second_turn_reads_the_cache(emu: Running, http: aiohttp.ClientSession) -> None:
    page = emu.replica.config.page_size
    _, _, raw = await post(http, f"{emu.url}/v1/messages", {"model": "m", "max_tokens": 8, "messages": U1})
    first = json.loads(raw)
    u2 = [*U1, {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "Add type hints."}]
    body = {"model": "m", "max_tokens": 4, "messages": u2}
    _, _, raw = await post(http, f"{emu.url}/v1/messages", body)
    usage = json.loads(raw)["usage"]
    assert list(usage) == ["input_tokens", "output_tokens", "cache_read_input_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_tokens(body)
    # turn 1's prompt and answer, in whole pages (its answer's last token was never computed)
    p1 = first["usage"]["input_tokens"]
    assert usage["cache_read_input_tokens"] == (p1 + 8 - 1) // page * page
    # the same conversation through the chat route hits the blocks the messages request cached
    _, _, raw = await post(http, f"{emu.url}/v1/chat/completions", {"messages": to_chat(body)["messages"],
                                                                    "max_tokens": 1})
    chat_usage = json.loads(raw)["usage"]
    assert chat_usage["prompt_tokens"] == prompt_tokens(body)
    assert chat_usage["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens(body) + 4 - 1) // page * page


async def test_messages_stream_events(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, min_chunk_interval_s=0.0) as (emu,):
        body = {"model": "m", "max_tokens": 6, "stream": True, "system": "Be terse.", "messages": U1}
        status, ctype, raw = await post(http, f"{emu.url}/v1/messages", body)
    assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
    evs = events(raw)
    types = [e["type"] for e in evs]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = evs[2:-3]
    assert len(deltas) >= 2 and all(e["type"] == "content_block_delta" for e in deltas)  # one per decode step
    start = evs[0]["message"]
    assert list(start) == ["id", "type", "role", "content", "model", "usage"] and start["content"] == []
    assert start["usage"] == {"input_tokens": prompt_tokens(body), "output_tokens": 0}  # cold
    assert evs[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(e["index"] == 0 and list(e["delta"]) == ["type", "text"] and e["delta"]["type"] == "text_delta"
               for e in deltas)
    assert len("".join(e["delta"]["text"] for e in deltas)) == 6 * 4
    assert evs[-3:] == [
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 6}},
        {"type": "message_stop"},
    ]


async def test_messages_stream_second_turn_reports_cache_read(emu: Running, http: aiohttp.ClientSession) -> None:
    body = {"model": "m", "max_tokens": 3, "messages": U1, "stream": True}
    await post(http, f"{emu.url}/v1/messages", body)
    _, _, raw = await post(http, f"{emu.url}/v1/messages", body)
    usage = events(raw)[0]["message"]["usage"]
    assert list(usage) == ["input_tokens", "output_tokens", "cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] > 0 and usage["output_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_tokens(body)


async def test_messages_without_cache_report(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, enable_cache_report=False) as (emu,):
        body = {"model": "m", "max_tokens": 2, "messages": U1}
        await post(http, f"{emu.url}/v1/messages", body)
        _, _, raw = await post(http, f"{emu.url}/v1/messages", body)
    assert json.loads(raw)["usage"] == {"input_tokens": prompt_tokens(body), "output_tokens": 2}


async def test_count_tokens_is_the_rendered_prompt(emu: Running, http: aiohttp.ClientSession) -> None:
    body = {"model": "m", "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tools": [TOOL], "messages": U1}
    status, ctype, raw = await post(http, f"{emu.url}/v1/messages/count_tokens", body)
    assert (status, ctype) == (200, "application/json")
    assert json.loads(raw) == {"input_tokens": prompt_tokens({**body, "max_tokens": 1})}
    _, _, raw = await post(http, f"{emu.url}/v1/messages", {**body, "max_tokens": 2})
    usage = json.loads(raw)["usage"]
    assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) == prompt_tokens({**body, "max_tokens": 1})
    # no context check: a prompt over the context length is counted
    long = {"model": "m", "messages": [{"role": "user", "content": "abcd" * 20_000}]}
    _, _, raw = await post(http, f"{emu.url}/v1/messages/count_tokens", long)
    assert json.loads(raw)["input_tokens"] > emu.replica.config.profile.max_context_tokens


def _error(status: int, type_: str, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"type": "error", "error": {"type": type_, "message": message}}


async def test_messages_errors(emu: Running, http: aiohttp.ClientSession) -> None:
    url = f"{emu.url}/v1/messages"
    cases: list[tuple[Any, tuple[int, dict[str, Any]]]] = [
        ({"model": "m", "messages": U1}, _error(400, "invalid_request_error", "max_tokens: Field required")),
        ({"model": "m", "max_tokens": 1, "messages": "hi"},
         _error(400, "invalid_request_error", "messages: Input should be a valid list")),
        ({"model": "m", "max_tokens": 1, "messages": []},
         _error(400, "invalid_request_error", "Messages cannot be empty.")),
        ({"model": "m", "max_tokens": 1, "messages": U1, "temperature": -1},
         _error(400, "BadRequestError", "temperature must be a non-negative finite number, got -1.0.")),
        (LONG, _error(400, "BadRequestError", f"The input ({prompt_tokens(LONG)} tokens) is longer than the "
                      "model's context length (16384 tokens).")),
        ({"model": "m", "max_tokens": 100_000, "messages": U1}, _error(
            400, "invalid_request_error",
            "max_completion_tokens is too large: 100000.This model supports at most 16384 completion tokens.")),
    ]
    for body, want in cases:
        async with http.post(url, json=body) as r:
            assert (r.status, await r.json()) == want, body
    async with http.post(url, data=b"{}", headers={"Content-Type": "text/plain"}) as r:
        assert (r.status, await r.json()) == _error(
            400, "invalid_request_error", "header.content-type: Unsupported Media Type: Only 'application/json' is allowed")


async def test_messages_errors_once_streaming(emu: Running, http: aiohttp.ClientSession) -> None:
    """The tokenizer's and the scheduler's refusals come after SGLang has started the stream."""
    for words in (20_000, 8_500):  # over the context length; over the scheduler's input bound
        body = {"model": "m", "max_tokens": 1, "stream": True,
                "messages": [{"role": "user", "content": "abcd" * words}]}
        status, ctype, raw = await post(http, f"{emu.url}/v1/messages", body)
        assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
        start, err, stop = events(raw)
        assert start["type"] == "message_start" and start["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0}
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert f"({prompt_tokens(body)} tokens)" in err["error"]["message"]
        assert stop == {"type": "message_stop"}


async def test_messages_fault_status(emu: Running, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{emu.url}/_emulator/faults", json={"status": 503, "count": 1}) as r:
        assert r.status == 200
    async with http.post(f"{emu.url}/v1/messages", json={"model": "m", "max_tokens": 1, "messages": U1}) as r:
        assert (r.status, await r.json()) == _error(503, "overloaded_error", "Internal server error")

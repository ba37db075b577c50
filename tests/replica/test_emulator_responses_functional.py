"""The emulator's OpenAI Responses API over real sockets: the prompt is the equivalent chat
request's and shares its cache blocks, usage arithmetic, SSE framing and event order, errors (shapes
checked against real SGLang in tests/real_sglang/test_responses_fidelity.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from replica.emulator.runner import Running
from replica.emulator.server import max_req_input_len
from replica.emulator.tokenizer import encode_text, render_chat
from tests.agent_requests import CODEX_INPUT
from tests.replica.conftest import EmuFactory

Q = "Write a function that adds two numbers, in Python please."
FN = {"type": "function", "name": "get_weather", "description": "The weather", "strict": False,
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_FN = {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                            "parameters": FN["parameters"], "strict": False}}
KEYS = [
    "id", "object", "created_at", "model", "output", "status", "usage", "parallel_tool_calls", "tool_choice", "tools",
    "error", "incomplete_details", "instructions", "max_output_tokens", "previous_response_id", "reasoning", "store",
    "temperature", "text", "top_p", "truncation", "user", "metadata",
]


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, bytes]:
    async with http.post(url, json=body) as r:
        return r.status, r.headers["Content-Type"], await r.read()


def events(raw: bytes) -> list[dict[str, Any]]:
    """Split a Responses SSE body exactly as framed: ``event: T\\ndata: {compact JSON}\\n\\n``,
    numbered from 0."""
    assert raw.endswith(b"\n\n")
    out = []
    for i, frame in enumerate(raw[:-2].split(b"\n\n")):
        head, data = frame.split(b"\n")
        doc = json.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + doc["type"].encode() and doc["sequence_number"] == i
        assert json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() == data.removeprefix(b"data: ")
        out.append(doc)
    return out


def prompt_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    return encode_text(render_chat(messages, tools)).num_tokens


async def chat_usage(http: aiohttp.ClientSession, emu: Running, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": 1, **({"tools": tools} if tools else {})}
    status, _, raw = await post(http, f"{emu.url}/v1/chat/completions", body)
    assert status == 200, raw
    return dict(json.loads(raw)["usage"])


async def test_response_shape_and_usage(emu: Running, http: aiohttp.ClientSession) -> None:
    model = emu.replica.config.model_name
    body = {"model": model, "input": Q, "instructions": "Be terse.", "max_output_tokens": 6}
    status, ctype, raw = await post(http, f"{emu.url}/v1/responses", body)
    assert (status, ctype) == (200, "application/json")
    doc = json.loads(raw)
    assert list(doc) == KEYS
    assert doc["id"].startswith("resp_") and len(doc["id"]) == 5 + 32 and doc["object"] == "response"
    assert doc["model"] == model and doc["status"] == "incomplete"
    assert doc["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = doc["output"]
    assert item["id"].startswith("msg_") and item["phase"] == "final_answer" and item["status"] == "completed"
    [part] = item["content"]
    assert list(part) == ["annotations", "text", "type", "logprobs"] and len(part["text"]) == 4 * 4
    # SGLang keeps two tokens of headroom: 6 allowed, 4 written; the prompt is the chat route's
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": Q}]
    p = prompt_tokens(messages)
    assert doc["usage"] == {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + 4}
    assert (await chat_usage(http, emu, messages))["prompt_tokens"] == p


async def test_second_turn_reads_the_cache_the_chat_route_shares(emu: Running, http: aiohttp.ClientSession) -> None:
    page = emu.replica.config.page_size
    model = emu.replica.config.model_name
    url = f"{emu.url}/v1/responses"
    _, _, raw = await post(http, url, {"model": model, "input": Q, "max_output_tokens": 10, "store": False})
    first = json.loads(raw)
    answer = first["output"][0]
    u2 = [{"role": "user", "content": Q}, {**answer, "id": "msg_replayed"},
          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add type hints."}]}]
    _, _, raw = await post(http, url, {"model": model, "input": u2, "max_output_tokens": 6, "store": False})
    usage = json.loads(raw)["usage"]
    # the equivalent chat conversation: the replayed item keeps its phase, its parts become text parts
    chat = [{"role": "user", "content": Q},
            {"role": "assistant", "content": [{"type": "text", "text": answer["content"][0]["text"]}],
             "phase": "final_answer"},
            {"role": "user", "content": [{"type": "text", "text": "Add type hints."}]}]
    p1, p2 = first["usage"]["input_tokens"], prompt_tokens(chat)
    assert usage["input_tokens"] == p2 and usage["total_tokens"] == p2 + 4
    # turn 1's prompt and answer, in whole pages (its answer's last token was never computed)
    assert usage["input_tokens_details"]["cached_tokens"] == (p1 + 8 - 1) // page * page > 0
    # the same conversation on the chat route hits the blocks the Responses turn cached
    cu = await chat_usage(http, emu, chat)
    assert cu["prompt_tokens"] == p2 and cu["prompt_tokens_details"]["cached_tokens"] == (p2 + 4 - 1) // page * page


async def test_codex_shaped_request(emu: Running, http: aiohttp.ClientSession) -> None:
    """What Codex CLI sends: instructions, a developer message, reasoning, a function call and its
    output, function and built-in tools, store false, reasoning and include, a prompt cache key."""
    body = {
        "model": emu.replica.config.model_name, "instructions": "You are Codex.", "store": False, "stream": False,
        "input": CODEX_INPUT,
        "tools": [FN, {"type": "local_shell"}, {"type": "web_search"}], "tool_choice": "auto",
        "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1", "max_output_tokens": 5,
    }
    status, _, raw = await post(http, f"{emu.url}/v1/responses", body)
    assert status == 200, raw
    doc = json.loads(raw)
    chat = [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": [{"type": "text", "text": "Developer instructions:\nsandbox: on"}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "reasoning_content": "look it up", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert doc["usage"]["input_tokens"] == prompt_tokens(chat, [CHAT_FN])
    assert (await chat_usage(http, emu, chat, [CHAT_FN]))["prompt_tokens"] == doc["usage"]["input_tokens"]
    assert doc["usage"]["output_tokens"] == 3 and doc["store"] is False and doc["parallel_tool_calls"] is False
    assert doc["reasoning"] == {"effort": "medium", "summary": None} and doc["tool_choice"] == "auto"
    assert [t["type"] for t in doc["tools"]] == ["function", "local_shell", "web_search"]


async def test_without_max_output_tokens_it_completes(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, default_max_tokens=7) as (emu,):
        _, _, raw = await post(http, f"{emu.url}/v1/responses", {"model": emu.replica.config.model_name, "input": Q})
    doc = json.loads(raw)
    assert doc["status"] == "completed" and doc["incomplete_details"] is None and doc["max_output_tokens"] is None
    assert doc["usage"]["output_tokens"] == 7 and len(doc["output"][0]["content"][0]["text"]) == 7 * 4


async def test_stream_events(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, min_chunk_interval_s=0.0) as (emu,):
        model = emu.replica.config.model_name
        body = {"model": model, "input": Q, "max_output_tokens": 8, "stream": True, "temperature": 0}
        status, ctype, raw = await post(http, f"{emu.url}/v1/responses", body)
    assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
    assert b"[DONE]" not in raw
    evs = events(raw)
    types = [e["type"] for e in evs]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = evs[4:-4]
    assert len(deltas) >= 2 and all(e["type"] == "response.output_text.delta" for e in deltas)  # one per decode step
    # whole tokens (4 bytes each); the prefill's token comes alone unless a loaded event loop let
    # the next decode steps catch up before the chunk went out (seen once in CI: 5 tokens)
    assert all(e["delta"] and len(e["delta"]) % 4 == 0 for e in deltas)
    text = "".join(e["delta"] for e in deltas)
    assert len(text) == 6 * 4 and evs[-4]["text"] == text
    start = evs[0]["response"]
    assert list(evs[0]) == ["type", "response", "sequence_number"] and list(start) == KEYS
    assert (start["status"], start["output"], start["usage"], start["text"]) == ("in_progress", [], None, None)
    assert start["temperature"] == 0.0 and evs[1]["response"] == start
    item_id = evs[2]["item"]["id"]
    assert evs[2]["item"] == {"id": item_id, "content": [], "role": "assistant", "status": "in_progress",
                              "type": "message", "phase": "final_answer"}
    assert all(e["item_id"] == item_id for e in evs[3:-2]) and evs[-2]["item"]["id"] == item_id
    final = evs[-1]["response"]
    assert final["id"] == start["id"] and final["status"] == "incomplete" and final["output"] == [evs[-2]["item"]]
    p = prompt_tokens([{"role": "user", "content": Q}])
    assert final["usage"]["input_tokens"] == p and final["usage"]["output_tokens"] == 6
    assert final["usage"]["total_tokens"] == p + 6 and final["text"] == {"format": {"type": "text"}}


async def timed_events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, list[float]]:
    """Each event type's arrival times (monotonic seconds), as the client reads them."""
    got: dict[str, list[float]] = {}
    buf = b""
    async with http.post(url, json=body) as r:
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                got.setdefault(frame.split(b"\n")[0].removeprefix(b"event: ").decode(), []).append(time.monotonic())
    return got


async def test_offered_tools_hold_the_message_to_the_end(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    """With a function tool on offer SGLang learns a message's phase only at the end (a tool call
    might follow it), so it sends the message's events then, all at once; built-in tools alone, or
    ``tool_choice`` none, stream as the tokens come. (Decode here: ~0.2 s wall for 20 tokens.)"""
    async with emulators(1, time_scale=2.0, min_chunk_interval_s=0.0) as (emu,):
        base = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 22, "stream": True}
        for extra, held in (({"tools": [FN]}, True), ({"tools": [{"type": "web_search"}]}, False),
                            ({"tools": [FN], "tool_choice": "none"}, False)):
            t = await timed_events(http, f"{emu.url}/v1/responses", {**base, **extra})
            start, added = t["response.in_progress"][0], t["response.output_item.added"][0]
            first, last = t["response.output_text.delta"][0], t["response.output_text.delta"][-1]
            assert len(t["response.output_text.delta"]) >= 2, t
            if held:  # nothing of the message until the answer is complete, then all of it
                assert added - start > 3 * (t["response.incomplete"][0] - added), (extra, t)
            else:  # the first token comes soon, the rest one decode step at a time
                assert last - first > 3 * (first - start), (extra, t)


async def test_stream_of_an_empty_answer(emu: Running, http: aiohttp.ClientSession) -> None:
    """``max_output_tokens`` 2 leaves nothing to write: no item at all, streamed or not."""
    body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 2}
    _, _, raw = await post(http, f"{emu.url}/v1/responses", {**body, "stream": True})
    evs = events(raw)
    assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.incomplete"]
    assert evs[-1]["response"]["output"] == [] and evs[-1]["response"]["usage"]["output_tokens"] == 0
    _, _, raw = await post(http, f"{emu.url}/v1/responses", body)
    doc = json.loads(raw)
    assert (doc["output"], doc["status"], doc["text"]) == ([], "incomplete", None)


async def test_cached_tokens_without_cache_report(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    """SGLang's Responses serving reports the cache whatever ``--enable-cache-report`` says."""
    async with emulators(1, enable_cache_report=False) as (emu,):
        body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 3}
        await post(http, f"{emu.url}/v1/responses", body)
        _, _, raw = await post(http, f"{emu.url}/v1/responses", body)
    assert json.loads(raw)["usage"]["input_tokens_details"]["cached_tokens"] > 0


async def test_logprobs_on_request(emu: Running, http: aiohttp.ClientSession) -> None:
    body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 5, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    _, _, raw = await post(http, f"{emu.url}/v1/responses", body)
    part = json.loads(raw)["output"][0]["content"][0]
    assert len(part["logprobs"]) == 3 and "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
    for lp in part["logprobs"]:
        assert list(lp) == ["token", "bytes", "logprob", "top_logprobs"] and lp["bytes"] == list(lp["token"].encode())
        assert len(lp["top_logprobs"]) == 2 and list(lp["top_logprobs"][0]) == ["token", "bytes", "logprob"]


def _err(message: str, status: int = 400, type_: str = "invalid_request_error",
         param: str | None = None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": type_, "param": param, "code": status}}


async def test_errors(emu: Running, http: aiohttp.ClientSession) -> None:
    model = emu.replica.config.model_name
    url = f"{emu.url}/v1/responses"
    limit = emu.replica.config.profile.max_context_tokens
    long = "abcd" * 20_000
    p_long = prompt_tokens([{"role": "user", "content": long}])
    store = ("Response store is disabled. Stateful Responses require --enable-response-store on a standalone "
             "server; response storage is unavailable in PD mode.")
    cases: list[tuple[Any, tuple[int, dict[str, Any]]]] = [
        ({"model": "gpt-5", "input": "hi"}, _err("The model 'gpt-5' does not exist", 404, param="model")),
        ({"model": model, "input": []}, _err(
            "Cannot apply chat template to an empty conversation. Provide at least one message. None")),
        ({"model": model, "input": "hi", "previous_response_id": "resp_1"}, _err(store, param="previous_response_id")),
        ({"model": model, "input": "hi", "background": True}, _err(store, param="background")),
        ({"model": model, "input": "hi", "max_output_tokens": 1}, _err("max_new_tokens must be at least 0, got -1.")),
        ({"model": model, "input": "hi", "temperature": -1},
         _err("temperature must be a non-negative finite number, got -1.0.")),
        ({"model": model, "input": long, "max_output_tokens": 4},
         _err(f"The input ({p_long} tokens) is longer than the model's context length ({limit} tokens).")),
        ({"model": model, "input": "hi", "max_output_tokens": 100_000}, _err(
            f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a "
            f"total of {prompt_tokens([{'role': 'user', 'content': 'hi'}]) + 99_998} tokens: "
            f"{prompt_tokens([{'role': 'user', 'content': 'hi'}])} tokens from the input messages and 99998 tokens "
            "for the completion. Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit.")),
        ({"model": model, "input": [{"type": "local_shell_call", "call_id": "c"}]},
         _err("Unsupported Responses API input item type: 'local_shell_call' None")),
        ({"model": model, "input": "hi", "stream": True, "include": ["message.output_text.logprobs"]},
         _err("logprobs are not supported in streaming mode", param="logprobs")),
    ]
    for body, want in cases:
        async with http.post(url, json=body) as r:
            assert (r.status, await r.json()) == want, body
    # FastAPI's validation: 400 "Bad Request", the error dicts in the message
    for body, loc in (({"model": model}, "('body', 'input')"), ({"model": model, "input": "hi", "tools": [
            {"type": "function"}]}, "('body', 'tools', 0)"), ([1], "('body',)")):
        async with http.post(url, json=body) as r:
            doc = await r.json()
        assert r.status == 400 and doc["error"]["type"] == "Bad Request" and doc["error"]["code"] == 400
        assert f"'loc': {loc}" in doc["error"]["message"].split("\n")[1], doc
    async with http.post(url, data=b'{"model":', headers={"Content-Type": "application/json"}) as r:
        doc = await r.json()
    assert r.status == 400 and "'loc': ('body', 9), 'msg': 'JSON decode error'" in doc["error"]["message"]
    async with http.post(url, data=b"{}", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 400 and (await r.json())["error"]["message"].startswith(
            "1 validation error:\n  {'loc': ['header', 'content-type']")
    # no response store: retrieving or cancelling one is refused the same way
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
        async with http.request(method, emu.url + path) as r:
            assert (r.status, await r.json()) == _err(store, param="response_id")


async def test_errors_once_streaming(emu: Running, http: aiohttp.ClientSession) -> None:
    """The engine's refusals come after SGLang has started the stream: ``response.failed``; a
    scheduler refusal after the answer of the one-token stand-in prompt SGLang ran instead."""
    model = emu.replica.config.model_name
    cap = max_req_input_len(emu.replica.config.profile)
    tokenizer = "abcd" * 20_000
    scheduler = "abcd" * (cap - prompt_tokens([{"role": "user", "content": ""}]))
    assert prompt_tokens([{"role": "user", "content": scheduler}]) == cap
    for text, kinds, usage in (
        (tokenizer, [], None),
        (scheduler, ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"],
         {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
          "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}),
    ):
        body = {"model": model, "input": text, "max_output_tokens": 4, "stream": True}
        status, ctype, raw = await post(http, f"{emu.url}/v1/responses", body)
        assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
        evs = events(raw)
        assert [e["type"] for e in evs] == ["response.created", "response.in_progress", *kinds, "response.failed"]
        failed = evs[-1]["response"]
        assert failed["status"] == "failed" and failed["usage"] == usage and failed["incomplete_details"] is None
        assert failed["error"]["code"] == "server_error"
        assert f"({prompt_tokens([{'role': 'user', 'content': text}])} tokens)" in failed["error"]["message"]


async def test_fault_status(emu: Running, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{emu.url}/_emulator/faults", json={"status": 503, "count": 1}) as r:
        assert r.status == 200
    body = {"model": emu.replica.config.model_name, "input": "hi", "max_output_tokens": 3}
    async with http.post(f"{emu.url}/v1/responses", json=body) as r:
        assert (r.status, await r.json()) == _err("Emulated fault", 503, "Service Unavailable")

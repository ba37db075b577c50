"""The emulator's Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) against
the real engine: the same calls go to a real SGLang 0.5.23 and to the emulator; statuses, content
types, key sets, SSE event sequences and error bodies must agree (text and token counts are each
server's own: the usage arithmetic is checked on each by its own chat route and count_tokens)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from loadtests.real_sglang import RealServer
from replica.emulator.runner import running_emulators
from tests.agent_requests import sse_events
from tests.real_sglang.test_emulator_fidelity import emulator_config

Outcome = dict[str, Any]
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, bytes]:
    async with s.post(url, json=body) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


def _usage_total(u: dict[str, Any]) -> int:
    return int(u["input_tokens"]) + int(u.get("cache_read_input_tokens", 0))


def _shape(status: int, ctype: str, raw: bytes) -> tuple[Outcome, dict[str, Any]]:
    """(what is compared between the servers, the usage seen)."""
    if not ctype.startswith("text/event-stream"):
        doc = json.loads(raw)
        if doc.get("type") == "error":
            return {"status": status, "ctype": ctype, "error type": doc["error"]["type"]}, {}
        return {
            "status": status, "ctype": ctype, "keys": list(doc), "content": [b["type"] for b in doc["content"]],
            "stop_reason": doc["stop_reason"], "usage keys": list(doc["usage"]),
        }, doc["usage"]
    evs = sse_events(raw)
    types: list[str] = []
    for name, data in evs:
        assert data["type"] == name, (name, data)
        if not (name == "content_block_delta" and types[-1:] == ["content_block_delta..."]):
            types.append(name + "..." if name == "content_block_delta" else name)  # deltas: one or more
    start = evs[0][1]["message"]
    got: Outcome = {"status": status, "ctype": ctype, "events": types, "start keys": list(start)}
    usage: dict[str, Any] = {"start": start["usage"]}
    got["start usage keys"] = list(start["usage"])
    for name, data in evs:
        if name == "message_delta":
            got |= {"delta": list(data["delta"]), "stop_reason": data["delta"]["stop_reason"],
                    "delta usage": list(data["usage"])}
            usage["output_tokens"] = data["usage"]["output_tokens"]
        elif name == "error":
            got["error"] = data["error"]["type"]
        elif name == "content_block_start":
            got["block"] = data["content_block"]
    return got, usage


async def messages_calls(base: str) -> tuple[Outcome, list[str]]:
    """The calls as shapes, and the usage arithmetic's failures on this server (empty: all held)."""
    got: Outcome = {}
    bad: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def chat_prompt(messages: list[dict[str, Any]]) -> int:
            status, _, raw = await _post(s, base + "/v1/chat/completions",
                                         {"model": "m", "messages": messages, "max_tokens": 1})
            assert status == 200, raw
            return int(json.loads(raw)["usage"]["prompt_tokens"])

        async def count(body: dict[str, Any]) -> int:
            status, _, raw = await _post(s, base + "/v1/messages/count_tokens", body)
            assert status == 200, raw
            return int(json.loads(raw)["input_tokens"])

        async def call(case: str, body: dict[str, Any], prompt: int | None = None) -> dict[str, Any]:
            # greedy unless the case samples: the Messages API has no ignore_eos, and the real model's
            # near-uniform dummy weights sample one of its 2 EOS ids (of 2,048) about once per 250
            # four-token answers
            body = {"temperature": 0, **body}
            status, ctype, raw = await _post(s, base + "/v1/messages", body)
            shape, usage = _shape(status, ctype, raw)
            got[case] = shape
            u = usage.get("start", usage)
            if prompt is not None and _usage_total(u) != prompt:
                bad.append(f"{case}: usage {u} does not add up to the prompt's {prompt} tokens")
            if body.get("stream") and "error" not in shape and usage.get("output_tokens") != body["max_tokens"]:
                bad.append(f"{case}: output_tokens {usage.get('output_tokens')} != max_tokens")
            return {**usage, "raw": raw}

        u1 = [{"role": "user", "content": "Write a function that adds two numbers, in Python please."}]
        first = await call("turn 1 (cold)", {"model": "m", "max_tokens": 4, "messages": u1})
        p1 = await chat_prompt(u1)
        if _usage_total(first) != p1:
            bad.append(f"turn 1: {first} vs chat prompt {p1}")
        if await count({"model": "m", "messages": u1}) != p1:
            bad.append("count_tokens != the chat route's prompt tokens")
        await call("turn 1, streamed", {"model": "m", "max_tokens": 4, "stream": True, "messages": u1}, p1)
        status, ctype, raw = await _post(s, base + "/v1/messages/count_tokens", {"model": "m", "messages": u1})
        got["count_tokens"] = (status, ctype, list(json.loads(raw)))

        reply = json.loads(first["raw"])["content"][0]["text"]
        u2 = [*u1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Now add type hints."}]
        second = await call("turn 2", {"model": "m", "max_tokens": 4, "messages": u2}, None)
        if _usage_total(second) != await chat_prompt(u2):
            bad.append(f"turn 2: {second} does not add up to the chat prompt")
        if not second.get("cache_read_input_tokens"):
            bad.append(f"turn 2: no cache_read_input_tokens in {second}")
        u3 = [*u2, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
              {"role": "user", "content": [{"type": "text", "text": "And a docstring."}]}]
        third = await call("turn 3, streamed", {"model": "m", "max_tokens": 4, "stream": True, "messages": u3},
                           await chat_prompt([*u2, {"role": "assistant", "content": "ok"},
                                              {"role": "user", "content": "And a docstring."}]))
        if not third["start"].get("cache_read_input_tokens"):
            bad.append(f"turn 3: no cache_read_input_tokens in {third['start']}")

        sys_chat = [{"role": "system", "content": "You are terse.\nYou write Python."}, *u1]
        p_sys = await chat_prompt(sys_chat)
        await call("system string", {"model": "m", "max_tokens": 3, "system": "You are terse.\nYou write Python.",
                                     "messages": u1}, p_sys)
        blocks = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "You write Python."}]
        await call("system blocks, streamed",
                   {"model": "m", "max_tokens": 3, "stream": True, "system": blocks, "messages": u1}, p_sys)

        tool_body = {"model": "m", "max_tokens": 3, "tools": [TOOL], "messages": [
            {"role": "user", "content": "What is the weather in Paris?"}]}
        p_tool = await count(tool_body)
        await call("tool", tool_body, p_tool)
        await call("tool, streamed", {**tool_body, "stream": True}, p_tool)
        history = {**tool_body, "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {
                "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ], "temperature": 0.5, "top_p": 0.9, "top_k": 1, "stop_sequences": ["<no-such-stop>"], "metadata": {"user_id": "u"}}
        # the sampling fields are converted, yet top_k 1 keeps the answer greedy, and the stop
        # sequence is one the model cannot write: the emulator never stops early, and a sampled
        # "\n\n" from the real model ended its answer with end_turn in one CI run
        await call("tool_use and tool_result history", history, await count(history))

        # errors: the messages are SGLang's own where the emulator reproduces them; token counts in
        # the context error differ by tokenizer, so only its type is compared
        long = [{"role": "user", "content": "hello " * 10_000}]
        for case, body in (
            ("context too long", {"model": "m", "max_tokens": 4, "messages": long}),
            ("context too long, streamed", {"model": "m", "max_tokens": 4, "stream": True, "messages": long}),
        ):
            await call(case, body)
        for case, path, body in (
            ("missing max_tokens", "", {"model": "m", "messages": u1}),
            ("messages not a list", "", {"model": "m", "max_tokens": 4, "messages": "hi"}),
            ("max_tokens 0", "", {"model": "m", "max_tokens": 0, "messages": u1}),
            ("no messages", "", {"model": "m", "max_tokens": 4, "messages": []}),
            ("bad role", "", {"model": "m", "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}),
            ("bad block", "", {"model": "m", "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "video"}]}]}),
            ("tool without schema", "", {**tool_body, "tools": [{"name": "x"}]}),
            ("thinking", "", {"model": "m", "max_tokens": 4, "messages": u1,
                              "thinking": {"type": "enabled", "budget_tokens": 2048}}),
            ("not an object", "", [1]),
            ("count_tokens, no model", "/count_tokens", {"messages": u1}),
            ("count_tokens, no messages", "/count_tokens", {"model": "m", "messages": []}),
        ):
            status, ctype, raw = await _post(s, base + "/v1/messages" + path, body)
            got[case] = (status, ctype, json.loads(raw))
        async with s.post(base + "/v1/messages", data=b'{"model":', headers={"Content-Type": "application/json"}) as r:
            got["bad JSON"] = (r.status, await r.json())
        async with s.post(base + "/v1/messages", data=b"{}", headers={"Content-Type": "text/plain"}) as r:
            got["not JSON content type"] = (r.status, await r.json())
    return got, bad


async def test_messages_fidelity(fleet: list[RealServer]) -> None:
    real, real_bad = await messages_calls(fleet[0].url)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu, emu_bad = await messages_calls(emu_rep.url)
    rows = {k: {"real": real.get(k), "emulator": emu.get(k)} for k in real}
    print(json.dumps({"calls": rows, "real arithmetic": real_bad, "emulator arithmetic": emu_bad}, indent=1,
                     default=str))
    # the real engine behaves as measured (guards against a fleet set up otherwise)
    assert real["turn 1 (cold)"]["status"] == 200 and real["missing max_tokens"][0] == 400, real
    assert not real_bad and not emu_bad, (real_bad, emu_bad)
    diff = {k: v for k, v in rows.items() if v["real"] != v["emulator"]}
    assert not diff, json.dumps(diff, indent=1, default=str)

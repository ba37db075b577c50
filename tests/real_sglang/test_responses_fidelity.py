"""The emulator's OpenAI Responses API (``/v1/responses``) against the real engine: the same calls go
to a real SGLang 0.5.23 and to the emulator; statuses, content types, key orders, item and event
sequences, the echoed request settings, usage keys and error bodies must agree (text and token counts
are each server's own: the usage arithmetic is checked on each by its own chat route).

The real servers run with ``--enable-response-store`` (tests/real_sglang/conftest.py), the emulator
with ``enable_response_store``: stored responses, ``previous_response_id`` continuations, GET and
cancel, ``background`` are compared too. (Without the store both refuse them with the same 400s:
the emulator's side is tests/replica/test_emulator_responses_functional.py::test_errors.)

Every call is greedy (``temperature`` 0): the real model's near-uniform dummy weights sample one of
its 2 EOS ids (of 2,048) about once per 250 four-token answers, and a greedy answer to a fixed prompt
is the same every run. Sampled text is never compared."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp

from loadtests.real_sglang import RealServer
from replica.emulator.runner import running_emulators
from tests.agent_requests import CODEX_INPUT, sse_events
from tests.real_sglang.test_emulator_fidelity import emulator_config

Outcome = dict[str, Any]
Q = "Write a function that adds two numbers, in Python please."
FN = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": False,
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_FN = {"type": "function", "function": {"name": FN["name"], "description": FN["description"],
                                            "parameters": FN["parameters"], "strict": False}}
# what the response echoes of the request, compared as values (ids, times, the model path and the
# sampled output are each server's own)
_OWN = ("id", "created_at", "model", "output", "usage", "error")


def _ids(text: str) -> str:
    """Response ids blanked (each server makes its own)."""
    return re.sub(r"resp_[0-9a-f]{32}", "resp_<id>", text)


def _message_key(message: str) -> str:
    """What of an error message is compared: FastAPI's first error without its input (the real
    server names its source file, and inputs may name the model), else the whole message with
    response ids and token counts blanked (each server makes its own ids and counts its own tokens)."""
    if re.match(r"\d+ validation errors?:\n", message):
        return message.split("\n")[1].split(", 'input':")[0]
    return re.sub(r"\d+", "N", _ids(message))


def _logprobs_shape(lps: list[dict[str, Any]] | None) -> Any:
    if lps is None:
        return None
    return {"tokens": len(lps), "keys": sorted({json.dumps(list(lp)) for lp in lps}),
            "alternatives": sorted({len(lp["top_logprobs"]) for lp in lps})}


def _item_shape(item: dict[str, Any]) -> dict[str, Any]:
    return {"keys": list(item), **{k: item[k] for k in ("type", "role", "status", "phase")},
            "content": [{"keys": list(p), "type": p["type"], "logprobs": _logprobs_shape(p["logprobs"])}
                        for p in item["content"]]}


def _doc_shape(doc: dict[str, Any]) -> dict[str, Any]:
    usage = doc["usage"]
    error = doc["error"]
    return {
        "keys": list(doc), **{k: v for k, v in doc.items() if k not in _OWN},
        "previous_response_id": None if doc["previous_response_id"] is None else _ids(doc["previous_response_id"]),
        "output": [_item_shape(i) for i in doc["output"]],
        "usage": None if usage is None else {k: list(v) if isinstance(v, dict) else v for k, v in usage.items()
                                             if k not in ("input_tokens", "total_tokens")},
        "error": None if error is None else {**error, "message": _message_key(error["message"])},
    }


def _shape(status: int, ctype: str, raw: bytes) -> tuple[Outcome, list[dict[str, Any]], list[str]]:
    """(what is compared between the servers, the responses seen (the last is the final one), the
    stream's own inconsistencies)."""
    got: Outcome = {"http": status, "ctype": ctype}
    if not ctype.startswith("text/event-stream"):
        doc = json.loads(raw)
        if "error" in doc and "object" not in doc:
            e = doc["error"]
            return got | {"keys": list(e), "type": e["type"], "param": e["param"], "code": e["code"],
                          "message": _message_key(e["message"])}, [], []
        return got | _doc_shape(doc), [doc], []
    evs = sse_events(raw)
    bad = [f"event {name} carries type {data['type']}" for name, data in evs if data["type"] != name]
    if [d["sequence_number"] for _, d in evs] != list(range(len(evs))):
        bad.append("sequence numbers are not 0, 1, 2 ...")
    types: list[str] = []
    for name, _ in evs:
        if not (name == "response.output_text.delta" and types[-1:] == [name + "..."]):
            types.append(name + "..." if name == "response.output_text.delta" else name)  # deltas: one or more
    got |= {"events": types, "event keys": {name: list(data) for name, data in evs}}
    docs = [data["response"] for _, data in evs if "response" in data]
    got["lifecycle"] = [_doc_shape(d) for d in docs]
    deltas = "".join(data["delta"] for name, data in evs if name == "response.output_text.delta")
    done = [data["text"] for name, data in evs if name == "response.output_text.done"]
    final = docs[-1]["output"]
    if done != ([deltas] if deltas else []) or [i["content"][0]["text"] for i in final] != done:
        bad.append(f"deltas {deltas!r}, done {done}, final output {final} disagree")
    return got, docs, bad


async def responses_calls(base: str) -> tuple[Outcome, list[str]]:
    """The calls as shapes, and the usage arithmetic's failures on this server (empty: all held)."""
    got: Outcome = {}
    bad: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.get(base + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def post(path: str, body: Any) -> tuple[int, str, bytes]:
            async with s.post(base + path, json=body) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.read()

        async def stored(case: str, response_id: str, cancel: bool = False) -> dict[str, Any]:
            """GET (or cancel) of a stored response: its shape compared, the response returned."""
            method, path = ("POST", f"/v1/responses/{response_id}/cancel") if cancel else (
                "GET", f"/v1/responses/{response_id}")
            async with s.request(method, base + path) as r:
                status, ctype, raw = r.status, r.headers.get("Content-Type", ""), await r.read()
            got[case] = _shape(status, ctype, raw)[0]
            return dict(json.loads(raw)) if status == 200 else {}

        async def chat_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
            body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0,
                    **({"tools": tools} if tools else {})}
            status, _, raw = await post("/v1/chat/completions", body)
            assert status == 200, raw
            return int(json.loads(raw)["usage"]["prompt_tokens"])

        async def call(case: str, body: dict[str, Any], prompt: int | None = None) -> dict[str, Any]:
            """The final response (or {} for an error); ``prompt``: what ``input_tokens`` must be."""
            body = {"model": model, "temperature": 0, **body}
            shape, docs, stream_bad = _shape(*(await post("/v1/responses", body)))
            got[case] = shape
            bad.extend(f"{case}: {b}" for b in stream_bad)
            final = docs[-1] if docs else {}
            u = final.get("usage")
            if u is not None:
                if u["total_tokens"] != u["input_tokens"] + u["output_tokens"]:
                    bad.append(f"{case}: usage {u} does not add up")
                if prompt is not None and u["input_tokens"] != prompt:
                    bad.append(f"{case}: input_tokens {u['input_tokens']} != the chat route's prompt {prompt}")
                mot = body.get("max_output_tokens")
                if final["status"] == "incomplete" and u["output_tokens"] != mot - 2:
                    bad.append(f"{case}: output_tokens {u['output_tokens']} != max_output_tokens - 2")
            return final

        # a conversation: cold, then each later turn reads the cache of the one before
        system = "You are terse."
        c1 = [{"role": "system", "content": system}, {"role": "user", "content": Q}]
        p1 = await chat_prompt(c1)
        first = await call("turn 1 (cold)", {"instructions": system, "input": Q, "max_output_tokens": 6}, p1)
        first_streamed = await call("turn 1, streamed", {"instructions": system, "input": Q, "max_output_tokens": 6,
                                                         "stream": True}, p1)
        answer = first["output"][0]
        u2 = [{"role": "user", "content": Q}, answer,  # the output item replayed as it came (id, status, phase)
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now add type hints."}]}]
        c2 = [*c1, {"role": "assistant", "content": [{"type": "text", "text": answer["content"][0]["text"]}],
                    "phase": "final_answer"}, {"role": "user", "content": [{"type": "text", "text": "Now add type hints."}]}]
        second = await call("turn 2", {"instructions": system, "input": u2, "max_output_tokens": 5, "store": False},
                            await chat_prompt(c2))
        if not second.get("usage", {}).get("input_tokens_details", {}).get("cached_tokens"):
            bad.append(f"turn 2: nothing cached in {second.get('usage')}")
        u3 = [*u2, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And a docstring."}]
        c3 = [*c2, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And a docstring."}]
        third = await call("turn 3, streamed", {"instructions": system, "input": u3, "max_output_tokens": 5,
                                                "stream": True}, await chat_prompt(c3))
        if not third.get("usage", {}).get("input_tokens_details", {}).get("cached_tokens"):
            bad.append(f"turn 3: nothing cached in {third.get('usage')}")

        # the response store: each response was kept (store defaults to true), as the POST answered it
        # (streamed: as its last event carried it); a cancel of a finished one changes nothing
        for case, doc in (("GET turn 1", first), ("GET turn 1, streamed", first_streamed)):
            if await stored(case, doc["id"]) != doc:
                bad.append(f"{case}: not the response answered")
        if await stored("cancel turn 1 (finished)", first["id"], cancel=True) != first:
            bad.append("cancel turn 1 (finished): not the response as it was")
        # continuations: the stored conversation (inputs and outputs, earlier instructions left out) +
        # the new input, after this request's instructions; the earlier turn is a cache hit
        def said(doc: dict[str, Any]) -> dict[str, Any]:
            return {"role": "assistant", "content": [{"type": "text", "text": doc["output"][0]["content"][0]["text"]}],
                    "phase": "final_answer"}

        k2 = [*c1, said(first), {"role": "user", "content": "Now add type hints."}]
        cont2 = await call("continued turn 2", {"instructions": system, "input": "Now add type hints.",
                                                "max_output_tokens": 5, "previous_response_id": first["id"]},
                           await chat_prompt(k2))
        k3 = [*k2, said(cont2), {"role": "user", "content": "And a docstring."}]
        cont3 = await call("continued turn 3, streamed", {
            "instructions": system, "input": [{"role": "user", "content": "And a docstring."}], "max_output_tokens": 5,
            "stream": True, "previous_response_id": cont2.get("id")}, await chat_prompt(k3))
        k4 = [{"role": "system", "content": "Other."}, *k3[1:], said(cont3), {"role": "user", "content": "Thanks."}]
        await call("continued turn 4, other instructions", {
            "instructions": "Other.", "input": "Thanks.", "max_output_tokens": 4, "previous_response_id": cont3.get("id")},
            await chat_prompt(k4))
        for case, doc in (("continued turn 2", cont2), ("continued turn 3, streamed", cont3)):
            if not doc.get("usage", {}).get("input_tokens_details", {}).get("cached_tokens"):
                bad.append(f"{case}: nothing cached in {doc.get('usage')}")
            elif await stored(f"GET {case}", doc["id"]) != doc:
                bad.append(f"GET {case}: not the response answered")
        unstored = await call("not stored", {"input": Q, "max_output_tokens": 4, "store": False})
        await stored("GET of a response not stored", unstored["id"])
        # background: answered at once (queued), then run; GET shows it until it ends
        bg = {"model": model, "temperature": 0, "instructions": system, "input": Q, "max_output_tokens": 12,
              "background": True}
        for case, body in (("background", bg), ("background, refused by the engine", {**bg, "max_output_tokens": 1})):
            status, ctype, raw = await post("/v1/responses", body)
            got[case] = _shape(status, ctype, raw)[0]
            queued = json.loads(raw)
            seen, final = await _until_done(s, base, queued["id"])
            got[f"{case}: when done"] = _shape(200, "application/json", json.dumps(final).encode())[0]
            if seen[-1] in ("queued", "in_progress") or any(st not in ("queued", "in_progress") for st in seen[:-1]):
                bad.append(f"{case}: statuses {seen}")
            same = ("id", "created_at", "model", "instructions", "max_output_tokens", "store", "temperature")
            if {k: final[k] for k in same} != {k: queued[k] for k in same}:
                bad.append(f"{case}: {final} is not the queued {queued} run")
            u = final["usage"]
            if u is not None and (u["input_tokens"] != p1 or u["output_tokens"] != body["max_output_tokens"] - 2):
                bad.append(f"{case}: usage {u}, prompt {p1}")
        await call("background, streamed", {"instructions": system, "input": Q, "max_output_tokens": 6,
                                            "background": True, "stream": True}, p1)

        # what Codex CLI sends: developer message, reasoning, a call and its output, function and built-in
        # tools, store false, reasoning settings, include, a prompt cache key (which SGLang ignores)
        codex = {
            "instructions": "You are a coding agent.", "store": False, "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1", "max_output_tokens": 5,
            "tools": [FN, {"type": "local_shell"}, {"type": "web_search"}],
            "input": CODEX_INPUT,
        }
        codex_chat = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "system", "content": [{"type": "text", "text": "Developer instructions:\nsandbox: on"}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "reasoning_content": "look it up", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        p_codex = await chat_prompt(codex_chat, [CHAT_FN])
        await call("codex", codex, p_codex)
        await call("codex, streamed", {**codex, "stream": True}, p_codex)
        # a message of one phase and a call of none are two assistant turns, a reasoning item folds in
        turns = [{"role": "user", "content": "Weather in Paris?"},
                 {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
                 {"type": "message", "role": "assistant", "phase": "commentary",
                  "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
                 {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sun"}]}]
        turns_chat = [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "reasoning_content": "think", "phase": "commentary",
                       "content": [{"type": "text", "text": "Let me look."}]},
                      {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
        await call("phases and merged turns", {"input": turns, "tools": [FN], "max_output_tokens": 4},
                   await chat_prompt(turns_chat, [CHAT_FN]))
        # the request's settings echoed back
        await call("settings echoed", {
            "input": Q, "max_output_tokens": 4, "top_p": 0.5, "user": "u", "metadata": {"a": "b"},
            "truncation": "auto", "text": {"verbosity": "low"}, "reasoning": {"effort": "xhigh"}, "store": None,
            "tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search", "extra": 1}]})
        # two tokens of headroom: nothing left to write, no item at all
        await call("max_output_tokens 2", {"input": Q, "max_output_tokens": 2})
        await call("max_output_tokens 2, streamed", {"input": Q, "max_output_tokens": 2, "stream": True})
        await call("logprobs", {"input": Q, "max_output_tokens": 4, "include": ["message.output_text.logprobs"]})

        # the engine's refusals: unstreamed a 400, streamed response.failed (a scheduler refusal after
        # the answer of the one-token stand-in prompt it ran)
        long = "hello " * 10_000
        near = await _at_scheduler_bound(s, base, model)
        for case, body in (
            ("context too long", {"input": long, "max_output_tokens": 4}),
            ("context too long, streamed", {"input": long, "max_output_tokens": 4, "stream": True}),
            ("over the scheduler's input bound", {"input": near, "max_output_tokens": 4}),
            ("over the scheduler's input bound, streamed", {"input": near, "max_output_tokens": 4, "stream": True}),
            ("max_output_tokens 1", {"input": Q, "max_output_tokens": 1}),
            ("max_output_tokens 1, streamed", {"input": Q, "max_output_tokens": 1, "stream": True}),
            ("temperature -1", {"input": Q, "max_output_tokens": 4, "temperature": -1}),
            ("max_output_tokens over the context", {"input": Q, "max_output_tokens": 100_000}),
        ):
            await call(case, body)
        # refused before the engine: the serving layer, the store, the conversion, pydantic, FastAPI
        plain = {"input": Q, "max_output_tokens": 4}
        for case, body in (
            ("unknown model", {**plain, "model": "gpt-5"}),
            ("previous_response_id unknown", {**plain, "previous_response_id": "resp_0123"}),
            ("previous_response_id unknown, streamed", {**plain, "previous_response_id": "resp_0123", "stream": True}),
            ("previous_response_id not a response id", {**plain, "previous_response_id": "nope"}),
            ("previous_response_id and an unknown model", {**plain, "previous_response_id": "nope", "model": "gpt-5"}),
            ("background without store", {**plain, "background": True, "store": False, "model": "gpt-5"}),
            ("shell tool", {**plain, "tools": [{"type": "shell"}]}),
            ("required without tools", {**plain, "tool_choice": "required"}),
            ("undeclared named tool", {**plain, "tools": [FN], "tool_choice": {"type": "function", "name": "g"}}),
            ("logprobs streamed", {**plain, "stream": True, "include": ["message.output_text.logprobs"]}),
            ("empty input", {**plain, "input": []}),
            ("only an empty reasoning item", {**plain, "input": [{"type": "reasoning", "summary": []}]}),
            ("unsupported item", {**plain, "input": [{"type": "local_shell_call", "call_id": "c", "action": {}}]}),
            ("message without role", {**plain, "input": [{"content": "hi"}]}),
            ("no model", {**plain, "model": None}),
        ):
            await call(case, body)
        for case, body in (
            ("missing input", {"instructions": "x"}),
            ("input a number", {"input": 5}),
            ("bad tool type", {"input": "hi", "tools": [{"type": "nope"}]}),
            ("function tool without name", {"input": "hi", "tools": [{"type": "function"}]}),
            ("bad include", {"input": "hi", "include": ["nope"]}),
            ("stream not a bool", {"input": "hi", "stream": "maybe"}),
            ("not an object", [1]),
        ):
            got[case] = _shape(*(await post("/v1/responses", body)))[0]
        async with s.post(base + "/v1/responses", data=b'{"model":', headers={"Content-Type": "application/json"}) as r:
            got["bad JSON"] = (r.status, _message_key((await r.json())["error"]["message"]).split(", 'ctx'")[0])
        async with s.post(base + "/v1/responses", data=b"{}", headers={"Content-Type": "text/plain"}) as r:
            got["not JSON content type"] = (r.status, await r.json())
        for method, path in (("GET", "/v1/responses/resp_0123"), ("POST", "/v1/responses/resp_0123/cancel"),
                             ("GET", "/v1/responses/nope"), ("POST", "/v1/responses/nope/cancel"),
                             ("GET", "/v1/responses/resp"), ("DELETE", f"/v1/responses/{first['id']}"),
                             ("GET", f"/v1/responses/{first['id']}/input_items")):
            async with s.request(method, base + path) as r:
                got[f"{method} {_ids(path)}"] = (r.status, r.headers.get("Content-Type"), await r.json())
    return got, bad


async def _until_done(s: aiohttp.ClientSession, base: str, response_id: str) -> tuple[list[str], dict[str, Any]]:
    """The distinct statuses GET shows of a background response, polled until it ends, and its end."""
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        async with s.get(f"{base}/v1/responses/{response_id}") as r:
            assert r.status == 200, await r.read()
            doc = await r.json()
        if not seen or seen[-1] != doc["status"]:
            seen.append(doc["status"])
        if doc["status"] not in ("queued", "in_progress"):
            return seen, dict(doc)
        await asyncio.sleep(0.02)
    raise AssertionError(f"{response_id} on {base} still {seen}")


async def _at_scheduler_bound(s: aiohttp.ClientSession, base: str, model: str) -> str:
    """A user message whose prompt is at the scheduler's input bound (``max_req_input_len``) or a few
    tokens over, under the context length: the tokenizer lets it through, the scheduler refuses it.
    Found on each server with its own tokenizer (``/v1/tokenize`` renders the chat template)."""
    async with s.get(base + "/server_info") as r:
        info = await r.json()
    lo, hi = info["max_req_input_len"], info["context_length"]

    async def tokens(text: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        async with s.post(base + "/v1/tokenize", json=body) as r:
            return int((await r.json())["count"])

    t100, t1000 = await tokens("hello " * 100), await tokens("hello " * 1000)
    per = (t1000 - t100) / 900
    n = 100 + int((lo - t100) / per)
    for words in range(max(0, n - 8), n + 8):
        for tail in ("", "a", "ab"):
            text = "hello " * words + tail
            if lo <= await tokens(text) < hi:
                return text
    raise AssertionError(f"no prompt in [{lo}, {hi}) tokens on {base}")


async def test_responses_fidelity(fleet: list[RealServer]) -> None:
    real, real_bad = await responses_calls(fleet[0].url)
    async with running_emulators(1, config=emulator_config(enable_response_store=True)) as (emu_rep,):
        emu, emu_bad = await responses_calls(emu_rep.url)
    rows = {k: {"real": real.get(k), "emulator": emu.get(k)} for k in real}
    print(json.dumps({"calls": rows, "real arithmetic": real_bad, "emulator arithmetic": emu_bad}, indent=1,
                     default=str))
    # the real engine behaves as measured (guards against a fleet set up otherwise)
    assert real["turn 1 (cold)"]["http"] == 200 and real["turn 1 (cold)"]["usage"]["output_tokens"] == 4, real
    assert real["unknown model"]["http"] == 404 and real["missing input"]["http"] == 400, real
    assert real["GET turn 1"]["http"] == 200 and real["background"]["status"] == "queued", real  # the store is on
    assert not real_bad and not emu_bad, (real_bad, emu_bad)
    diff = {k: v for k, v in rows.items() if v["real"] != v["emulator"]}
    assert not diff, json.dumps(diff, indent=1, default=str)

"""The emulator over real sockets: SGLang bytes, field names, cache behaviour, metrics, faults."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from replica.emulator.metrics import E2E_BUCKETS, TTFT_BUCKETS
from replica.emulator.runner import Running
from tests.replica.conftest import EmuFactory

CHAT_CHUNK_KEYS = ["id", "object", "created", "model", "choices"]
CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "matched_stop"]
META_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
             "completion_tokens", "cached_tokens"]


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body exactly as framed: every event is b"data: ..." terminated by a blank line."""
    assert raw.endswith(b"\n\n")
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    events = parts[:-1]
    for ev in events:
        assert ev.startswith(b"data: "), ev[:40]
        assert b"\n" not in ev
    return [ev[len(b"data: ") :] for ev in events]


def compact(payload: bytes) -> Any:
    obj = json.loads(payload)
    assert json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() == payload  # no spaces
    return obj


def chat_body(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"model": "moonshotai/Kimi-K2.6", "messages": messages, **kw}


async def post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with http.post(url, json=body, **kw) as r:
        raw = await r.read()
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = raw
        return r.status, doc, r


async def state(http: aiohttp.ClientSession, emu: Running) -> dict[str, Any]:
    async with http.get(f"{emu.url}/_emulator/state") as r:
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


# ---- SSE framing and field names -------------------------------------------------------------


async def test_chat_stream_bytes_and_fields(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0, min_chunk_interval_s=0.0) as (emu,):
        body = chat_body([{"role": "user", "content": "hello " * 40}], max_tokens=6, stream=True,
                         stream_options={"include_usage": True})
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            assert r.headers["X-Emulator-Replica"] == "replica-0"
            raw = await r.read()
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [compact(e) for e in events[:-1]]
    first, *content, finish, usage = chunks
    assert list(first) == CHAT_CHUNK_KEYS and first["object"] == "chat.completion.chunk"
    assert first["model"] == "moonshotai/Kimi-K2.6"  # echoed
    assert len(first["id"]) == 32 and int(first["id"], 16) >= 0  # bare uuid hex, no chatcmpl- prefix
    assert list(first["choices"][0]) == CHOICE_KEYS
    assert first["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert len(content) >= 2  # one chunk per decode step (2 tokens/step in small-test)
    for c in content:
        assert list(c["choices"][0]["delta"]) == ["reasoning_content", "content"]
        assert c["choices"][0]["finish_reason"] is None and c["id"] == first["id"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert len(text.encode()) == 6 * 4
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["matched_stop"] is None
    assert usage["choices"] == [] and list(usage["usage"]) == [
        "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "reasoning_tokens",
        "completion_tokens_details"]
    assert usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chat_stream_without_usage_and_default_include(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1) as (emu,):
        body = chat_body([{"role": "user", "content": "x"}], max_tokens=3, stream=True)
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            chunks = [json.loads(e) for e in sse_events(await r.read())[:-1]]
        assert all("usage" not in c for c in chunks)
    async with emulators(1, stream_response_default_include_usage=True) as (emu,):
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            chunks = [json.loads(e) for e in sse_events(await r.read())[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_generate_stream_is_cumulative_with_meta_info(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0, min_chunk_interval_s=0.0) as (emu,):
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                "stream": True, "rid": "req-001"}
        async with http.post(f"{emu.url}/generate", json=body) as r:
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            events = sse_events(await r.read())
    assert events[-1] == b"[DONE]"
    chunks = [compact(e) for e in events[:-1]]
    assert len(chunks) >= 2
    for prev, cur in itertools.pairwise(chunks):
        assert cur["text"].startswith(prev["text"]) and cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    for c in chunks:
        assert list(c) == ["text", "output_ids", "meta_info"]
        assert list(c["meta_info"])[: len(META_KEYS)] == META_KEYS
        assert c["meta_info"]["id"] == "req-001" and c["meta_info"]["dp_rank"] is None
        assert len(c["output_ids"]) == c["meta_info"]["completion_tokens"]
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert all(c["meta_info"]["finish_reason"] is None and "e2e_latency" not in c["meta_info"] for c in chunks[:-1])
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 6} and last["e2e_latency"] > 0
    assert last["spec_accept_length"] > 1 and last["spec_verify_ct"] >= 1


async def test_generate_nonstream_and_input_ids(emu: Running, http: aiohttp.ClientSession) -> None:
    status, doc, _ = await post(http, f"{emu.url}/generate",
                                {"input_ids": [1, 450, 7483, 310, 3444, 338], "sampling_params": {"max_new_tokens": 4},
                                 "return_prompt_token_ids": True})
    assert status == 200
    assert doc["meta_info"]["prompt_tokens"] == 6 and doc["prompt_token_ids"] == [1, 450, 7483, 310, 3444, 338]
    assert len(doc["output_ids"]) == 4 and doc["meta_info"]["completion_tokens"] == 4
    status, doc, _ = await post(http, f"{emu.url}/generate", {"text": "hi"})  # default max_new_tokens 128
    assert status == 200 and doc["meta_info"]["completion_tokens"] == 128
    assert doc["meta_info"]["finish_reason"] == {"type": "stop", "matched": 163586}


async def test_completions_stream_and_nonstream(emu: Running, http: aiohttp.ClientSession) -> None:
    body = {"model": "m", "prompt": "Say hello world", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{emu.url}/v1/completions", json=body) as r:
        events = sse_events(await r.read())
    chunks = [compact(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]"
    for c in chunks[:-1]:
        assert c["object"] == "text_completion" and c["usage"] is None
        assert list(c["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "matched_stop"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and "completion_tokens_details" not in chunks[-1]["usage"]
    status, doc, _ = await post(http, f"{emu.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 200 and doc["usage"]["prompt_tokens"] == 3 and doc["choices"][0]["finish_reason"] == "length"
    assert doc["metadata"] == {"weight_version": "default", "weight_versions": [{"version": "default", "start": 0, "end": doc["usage"]["completion_tokens"]}]}


# ---- n choices and logprobs (shapes checked against real SGLang in tests/real_sglang) ----------


async def test_n_choices_share_the_prompt_and_usage_counts_it_once(emu: Running, http: aiohttp.ClientSession) -> None:
    ids = list(range(100, 300))
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    status, one, _ = await post(http, f"{emu.url}/v1/chat/completions", {**base, "input_ids": ids})
    assert status == 200
    status, three, _ = await post(http, f"{emu.url}/v1/chat/completions", {**base, "input_ids": ids[::-1], "n": 3})
    assert status == 200
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert all(len(c["message"]["content"]) == 16 for c in three["choices"])  # 4 tokens each, of their own
    u = three["usage"]
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"] == 200
    assert u["completion_tokens"] == 12 and u["total_tokens"] == 212
    # the warm-up request cached the prompt: each sequence recomputes only the tail
    assert 200 - emu.replica.config.profile.page_size <= u["prompt_tokens_details"]["cached_tokens"] < 200


async def test_n_choices_stream_each_with_its_id_role_and_finish(
    emulators: EmuFactory, http: aiohttp.ClientSession
) -> None:
    async with emulators(1, time_scale=0.05, min_chunk_interval_s=0.0) as (emu,):
        body = {"model": "m", "messages": [{"role": "user", "content": "go " * 50}], "max_tokens": 5, "n": 2,
                "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            events = sse_events(await r.read())
    assert events[-1] == b"[DONE]"
    chunks = [compact(e) for e in events[:-1]]
    *body_chunks, usage = chunks
    text: dict[int, str] = {0: "", 1: ""}
    ids: dict[int, set[str]] = {0: set(), 1: set()}
    roles, finishes = [], []
    for c in body_chunks:
        (ch,) = c["choices"]
        if ch["finish_reason"] is not None:
            finishes.append(ch["index"])
            continue
        ids[ch["index"]].add(c["id"])
        roles += [ch["index"]] if "role" in ch["delta"] else []
        text[ch["index"]] += ch["delta"].get("content") or ""
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    # each sequence's own 5 tokens (their filler may coincide, as greedy samples of one prompt do)
    assert all(len(t) == 20 for t in text.values())
    assert all(len(v) == 1 for v in ids.values()) and ids[0] != ids[1]  # one id per sequence
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10


async def test_logprobs_spell_the_output_and_repeat_per_request(emu: Running, http: aiohttp.ClientSession) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 3, "rid": "lp-1"}
    status, doc, _ = await post(http, f"{emu.url}/v1/chat/completions", chat)
    assert status == 200
    (choice,) = doc["choices"]
    content = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        assert t["bytes"] == list(t["token"].encode()) and t["logprob"] < 0
        tops = [a["logprob"] for a in t["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(v < 0 for v in tops)
    await post(http, f"{emu.url}/flush_cache", {})
    _, again, _ = await post(http, f"{emu.url}/v1/chat/completions", chat)
    assert again["choices"][0]["logprobs"] == choice["logprobs"]  # deterministic per request id

    status, doc, _ = await post(http, f"{emu.url}/v1/completions",
                                {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2})
    lp = doc["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == doc["choices"][0]["text"] and lp["text_offset"] == [-1, -1, -1]
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2, 2]

    status, doc, _ = await post(http, f"{emu.url}/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                                               "sampling_params": {"max_new_tokens": 3}})
    meta = doc["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == doc["output_ids"]
    assert meta["output_token_logprobs_length"] == 3 and "output_top_logprobs" not in meta


# ---- cache behaviour through HTTP ------------------------------------------------------------


async def test_cached_tokens_grow_across_session_turns_and_zero_when_cold(
    emulators: EmuFactory, http: aiohttp.ClientSession
) -> None:
    async with emulators(2) as (a, b):
        msgs = [{"role": "system", "content": "You are a coding agent. " * 20},
                {"role": "user", "content": "read file main.py " * 30}]
        cached: list[int] = []
        prompts: list[int] = []
        for turn in range(4):
            status, doc, _ = await post(http, f"{a.url}/v1/chat/completions",
                                        chat_body(msgs, max_tokens=12, session_id="s1"),
                                        headers={"x-smg-routing-key": "s1"})
            assert status == 200
            cached.append(doc["usage"]["prompt_tokens_details"]["cached_tokens"])
            prompts.append(doc["usage"]["prompt_tokens"])
            msgs += [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"turn {turn}: now fix the bug in line {turn * 7} " * 5}]
        assert cached[0] == 0
        assert cached[1] > 0 and cached[1] < cached[2] < cached[3]
        # the generated answer was cached too: the hit covers more than the previous prompt's full blocks
        assert cached[2] > (prompts[1] // 16 - 1) * 16
        assert all(c <= p for c, p in zip(cached, prompts, strict=True))
        # the same conversation on a cold replica: nothing cached
        status, doc, _ = await post(http, f"{b.url}/v1/chat/completions", chat_body(msgs, max_tokens=4))
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        st = await state(http, a)
        assert st["sessions_seen"] == 1 and st["requests_served"] == 4
        # native meta_info and sglext details on request
        status, doc, _ = await post(http, f"{a.url}/v1/chat/completions",
                                    chat_body(msgs, max_tokens=2, return_meta_info=True,
                                              return_cached_tokens_details=True))
        meta = doc["choices"][0]["meta_info"]
        assert meta["cached_tokens"] == doc["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert meta["cached_tokens_details"] == doc["sglext"]["cached_tokens_details"]


async def test_host_tier_hits_reported(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1) as (emu,):
        a = "A" * 4 * 3000
        s1, _, _ = await post(http, f"{emu.url}/generate", {"text": a, "sampling_params": {"max_new_tokens": 2}})
        assert s1 == 200
        for i in range(3):  # 3 x 3000 tokens through an 8192-token pool: a is demoted to host
            await post(http, f"{emu.url}/generate", {"text": str(i) * 4 * 3000, "sampling_params": {"max_new_tokens": 2}})
        s2, d2, _ = await post(http, f"{emu.url}/generate", {"text": a + "tail", "sampling_params": {"max_new_tokens": 2}})
        assert s2 == 200
        det = d2["meta_info"]["cached_tokens_details"]
        assert det["host"] > 0 and det["device"] + det["host"] == d2["meta_info"]["cached_tokens"] >= 2990
        async with http.get(f"{emu.url}/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        by_source = {s.labels["cache_source"]: s.value for s in fams["sglang:cached_tokens"].samples}
        assert by_source["host"] == det["host"]
        host_used = fams["sglang:hicache_host_used_tokens"].samples[0].value
        assert host_used > 0


async def test_flush_cache(emu: Running, http: aiohttp.ClientSession) -> None:
    text = "flush me " * 100
    await post(http, f"{emu.url}/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
    _, d, _ = await post(http, f"{emu.url}/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert d["meta_info"]["cached_tokens"] > 0
    async with http.post(f"{emu.url}/flush_cache") as r:
        assert r.status == 200 and (await r.text()).startswith("Cache flushed.")
    _, d, _ = await post(http, f"{emu.url}/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert d["meta_info"]["cached_tokens"] == 0 and "cached_tokens_details" not in d["meta_info"]


# ---- metrics and info endpoints --------------------------------------------------------------

GATEWAY_SCRAPE = [
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:num_used_tokens",
    "sglang:max_total_num_tokens", "sglang:kv_evictable_tokens", "sglang:cache_hit_rate", "sglang:gen_throughput",
    "sglang:spec_accept_length", "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
]


async def test_metrics_parse_and_names(emu: Running, http: aiohttp.ClientSession) -> None:
    for stream in (False, True):
        body = chat_body([{"role": "user", "content": "metrics " * 50}], max_tokens=5, stream=stream)
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            await r.read()
    async with http.get(f"{emu.url}/metrics", headers={"Accept": "text/plain"}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await r.text()
    assert "_created" not in text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in GATEWAY_SCRAPE:
        assert fams[name].type == "gauge", name
        assert fams[name].samples[0].labels == {"engine_type": "unified", "model_name": "emulated/small-test",
                                                "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"}
    assert fams["sglang:max_total_num_tokens"].samples[0].value == 8192
    assert fams["sglang:hicache_host_total_tokens"].samples[0].value == 16384
    assert fams["sglang:spec_accept_length"].samples[0].value == 2.0
    for name in ("sglang:prompt_tokens", "sglang:generation_tokens", "sglang:num_requests"):
        assert fams[name].type == "counter"
        vals = {s.labels["is_streaming"]: s.value for s in fams[name].samples if s.name.endswith("_total")}
        assert vals["true"] > 0 and vals["false"] > 0
    gen = {s.labels["is_streaming"]: s.value for s in fams["sglang:generation_tokens"].samples}
    assert gen == {"true": 5.0, "false": 5.0}
    for name, bounds in (("sglang:time_to_first_token_seconds", TTFT_BUCKETS),
                         ("sglang:e2e_request_latency_seconds", E2E_BUCKETS)):
        fam = fams[name]
        assert fam.type == "histogram"
        les = [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket") and s.labels["is_streaming"] == "true"]
        assert les == [repr(float(b)) for b in bounds] + ["+Inf"]
        count = [s.value for s in fam.samples if s.name.endswith("_count") and s.labels["is_streaming"] == "true"]
        assert count == [1.0]
    assert "sglang:cached_tokens_total{cache_source=\"device\"" in text


async def test_info_endpoints(emu: Running, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{emu.url}/server_info") as r:
        si = await r.json()
    for key, want in (("max_total_num_tokens", 8192), ("max_running_requests", 4), ("page_size", 16),
                      ("tp_size", 1), ("version", "0.5.23"), ("frontend", "python")):
        assert si[key] == want, key
    assert si["internal_states"][0]["avg_spec_accept_length"] == 2.0
    async with http.get(f"{emu.url}/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "emulated/small-test"
    assert models["data"][0]["owned_by"] == "sglang"
    async with http.get(f"{emu.url}/v1/models/nope") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    async with http.get(f"{emu.url}/model_info") as r:
        assert (await r.json())["model_path"] == "emulated/small-test"
    async with http.get(f"{emu.url}/v1/loads") as r:
        loads = await r.json()
    ld = loads["loads"][0]
    assert ld["max_total_num_tokens"] == 8192 and ld["num_running_reqs"] == 0 and ld["dp_rank"] == 0
    assert "memory" in ld and "queues" in ld and "speculative" in ld
    async with http.get(f"{emu.url}/v1/loads?include=core") as r:
        assert "memory" not in (await r.json())["loads"][0]
    async with http.get(f"{emu.url}/v1/loads?format=prometheus") as r:
        assert '# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="0"} 0\n' in await r.text()  # as SGLang: ints as ints
    async with http.get(f"{emu.url}/get_load") as r:
        assert r.status == 404  # as SGLang 0.5.23 (tests/real_sglang checks it against the real one)
    for path in ("/health", "/health_generate", "/ready"):
        async with http.get(f"{emu.url}{path}") as r:
            assert r.status == 200 and await r.read() == b"", path


async def test_metrics_and_v1_loads_report_the_same_load(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    """A gateway reads the load from ``/v1/loads`` and ``/metrics`` only now and then (discovery rule
    4), so the two must agree, as they do on SGLang (one scheduler's figures): running and queued
    requests, KV use, capacity and hit rate, read back to back on a busy replica."""
    from router.engine_metrics import load_from_v1_loads, parse_engine_metrics

    async with emulators(1, time_scale=2.0) as (rep,):  # slow: the figures hold still between reads
        msgs = [{"role": "user", "content": "a prompt long enough to hold some KV " * 20}]
        sent = [asyncio.create_task(post(http, f"{rep.url}/v1/chat/completions", chat_body(msgs, max_tokens=400)))
                for _ in range(6)]  # fmt: skip
        try:
            for _ in range(100):
                async with http.get(f"{rep.url}/v1/loads?include=core") as r:
                    loads = load_from_v1_loads(await r.json())
                if loads.running == 4 and loads.queued == 2:  # small-test runs 4 at once
                    break
                await asyncio.sleep(0.05)
            async with http.get(f"{rep.url}/metrics", headers={"Accept": "text/plain"}) as r:
                metrics = parse_engine_metrics(await r.text())
        finally:
            for t in sent:
                t.cancel()
            await asyncio.gather(*sent, return_exceptions=True)
    assert (loads.running, loads.queued) == (4, 2), loads
    assert (metrics.running, metrics.queued) == (4, 2) and metrics.capacity_tokens == loads.capacity_tokens == 8192
    assert metrics.kv_util > 0 and abs(metrics.kv_util - loads.kv_util) < 0.02, (metrics, loads)
    assert metrics.cache_hit_rate == pytest.approx(loads.cache_hit_rate, abs=1e-6)


async def test_tokenize_detokenize(emu: Running, http: aiohttp.ClientSession) -> None:
    msgs = [{"role": "user", "content": "tokenize me please"}]
    _, tok, _ = await post(http, f"{emu.url}/tokenize", {"model": "m", "messages": msgs})
    _, chat, _ = await post(http, f"{emu.url}/v1/chat/completions", chat_body(msgs, max_tokens=1))
    assert tok["count"] == len(tok["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == 16384
    _, tok2, _ = await post(http, f"{emu.url}/v1/tokenize", {"prompt": "hello world"})
    _, det, _ = await post(http, f"{emu.url}/detokenize", {"tokens": tok2["tokens"]})
    assert det == {"text": "hello world"}


# ---- errors ------------------------------------------------------------------------------------


async def test_errors_are_sglang_shaped(emu: Running, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{emu.url}/v1/chat/completions", data=b"{not json",
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = await r.json()
    # FastAPI's validation handler names the type by the status phrase (real SGLang 0.5.23)
    assert err["object"] == "error" and err["code"] == 400 and err["type"] == "Bad Request"
    async with http.post(f"{emu.url}/v1/chat/completions", data=b"{}", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 400
    status, err, _ = await post(http, f"{emu.url}/v1/chat/completions", {"messages": []})
    assert status == 400 and "messages" in err["message"]
    status, err, _ = await post(http, f"{emu.url}/v1/chat/completions",
                                chat_body([{"role": "user", "content": "x" * 4 * 17000}], max_tokens=10))
    assert status == 400 and "context length" in err["message"]
    status, err, _ = await post(http, f"{emu.url}/generate", {"text": "x", "sampling_params": {"foo": 1}})
    assert status == 400 and isinstance(err["error"], str) and err["error"].startswith("unknown field `foo`")
    status, err, _ = await post(http, f"{emu.url}/generate", {"sampling_params": {}})
    assert status == 400 and "message" in err["error"]
    status, err, _ = await post(http, f"{emu.url}/generate", {"input_ids": [1, -5]})
    assert status == 400
    status, err, _ = await post(http, f"{emu.url}/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and err["object"] == "error"
    async with http.get(f"{emu.url}/nope") as r:
        assert r.status == 404
    # the sampling values SamplingParams.verify refuses, printed as the engine holds them
    status, err, _ = await post(http, f"{emu.url}/v1/chat/completions", {**chat_body([{"role": "user", "content": "x"}]), "temperature": -1})
    assert (status, err["type"], err["message"]) == (
        400, "BadRequestError", "temperature must be a non-negative finite number, got -1.0.")
    status, err, _ = await post(http, f"{emu.url}/generate", {"text": "x", "sampling_params": {"top_p": 2}})
    assert (status, err) == (400, {"error": {"message": "top_p must be in (0, 1], got 2."}})
    status, err, _ = await post(http, f"{emu.url}/v1/chat/completions",
                                chat_body([{"role": "wizard", "content": "x"}]))
    assert status == 400 and err["type"] == "Bad Request"
    status, err, _ = await post(http, f"{emu.url}/generate", {"text": "x", "stream": "yes"})
    assert (status, err) == (400, {"error": 'invalid type: string "yes", expected a boolean'})
    st = await state(http, emu)
    assert st["running"] == 0 and st["requests_served"] == 0


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}, {"role": []}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": {"a": 1}, "content": "x"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}"),
        ("/v1/completions", b'{"prompt": "x", "top_p": -1' + b"0" * 400 + b"}"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}'),
        ("/generate", b'{"text": "x", "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}"),
        ("/generate", b'{"text": "x", "sampling_params": {"top_k": [1]}}'),
    ],
    ids=["list-role", "dict-role", "huge-temperature", "huge-top-p", "inf-max-tokens", "generate-huge", "generate-list"],
)
async def test_hostile_values_get_a_client_error_not_a_500(
    emu: Running, http: aiohttp.ClientSession, route: str, raw: bytes
) -> None:
    async with http.post(f"{emu.url}{route}", data=raw, headers={"Content-Type": "application/json"}) as r:
        body = await r.read()
        assert r.status < 500, (r.status, body[:300])


async def test_generate_prefers_input_ids_over_text(emu: Running, http: aiohttp.ClientSession) -> None:
    """SGLang tokenizes ``text`` only when no ``input_ids`` came: the ids are the prompt."""
    body = {"text": "a much longer text than two tokens", "input_ids": [11, 12], "sampling_params": {"max_new_tokens": 1}}
    status, doc, _ = await post(http, f"{emu.url}/generate", body)
    assert status == 200 and doc["meta_info"]["prompt_tokens"] == 2


# ---- disconnect, abort, faults ---------------------------------------------------------------


async def wait_for(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_client_disconnect_aborts_stream(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0) as (emu,):
        body = chat_body([{"role": "user", "content": "long answer please"}], max_tokens=3000, stream=True)
        r = await http.post(f"{emu.url}/v1/chat/completions", json=body)
        await r.content.readuntil(b"\n\n")
        assert (await state(http, emu))["running"] == 1
        r.close()  # drop the connection mid-stream

        async def aborted() -> bool:
            st = await state(http, emu)
            return bool(st["running"] == 0 and st["requests_aborted"] == 1)

        await wait_for(aborted)
        assert emu.replica.cache.stats().reserved_tokens == 0


async def test_client_disconnect_aborts_nonstream(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0) as (emu,):
        body = chat_body([{"role": "user", "content": "long answer please"}], max_tokens=3000)
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(f"{emu.url}/v1/chat/completions", json=body,
                                 timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                await r.read()

        async def aborted() -> bool:
            st = await state(http, emu)
            return bool(st["running"] == 0 and st["requests_aborted"] == 1)

        await wait_for(aborted)


async def test_abort_request_endpoint(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0) as (emu,):
        task = asyncio.create_task(post(http, f"{emu.url}/generate",
                                        {"text": "abc", "rid": "victim", "sampling_params": {"max_new_tokens": 5000}}))
        await wait_for(lambda: _running(http, emu, 1))
        async with http.post(f"{emu.url}/abort_request", json={"rid": "victim"}) as r:
            assert r.status == 200
        status, doc, _ = await task
        assert status == 200 and doc["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < doc["meta_info"]["completion_tokens"] < 5000


async def _running(http: aiohttp.ClientSession, emu: Running, n: int) -> bool:
    return bool((await state(http, emu))["running"] == n)


async def test_fault_status_with_count_then_recovers(emu: Running, http: aiohttp.ClientSession) -> None:
    status, f, _ = await post(http, f"{emu.url}/_emulator/faults", {"status": 503, "count": 1})
    assert status == 200 and f["status"] == 503
    status, err, _ = await post(http, f"{emu.url}/v1/chat/completions", chat_body([{"role": "user", "content": "a"}]))
    assert status == 503 and err["code"] == 503
    status, _, _ = await post(http, f"{emu.url}/v1/chat/completions", chat_body([{"role": "user", "content": "a"}],
                                                                                 max_tokens=1))
    assert status == 200
    status, _, _ = await post(http, f"{emu.url}/_emulator/faults", {"health_status": 503})
    async with http.get(f"{emu.url}/health") as r:
        assert r.status == 503
    async with http.delete(f"{emu.url}/_emulator/faults") as r:
        assert r.status == 200
    async with http.get(f"{emu.url}/health") as r:
        assert r.status == 200
    status, err, _ = await post(http, f"{emu.url}/_emulator/faults", {"bogus": 1})
    assert status == 400


async def test_fault_hang(emu: Running, http: aiohttp.ClientSession) -> None:
    await post(http, f"{emu.url}/_emulator/faults", {"hang": True})
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(f"{emu.url}/v1/chat/completions", json=chat_body([{"role": "user", "content": "a"}]),
                             timeout=aiohttp.ClientTimeout(total=0.3)) as r:
            await r.read()
    assert time.monotonic() - t0 >= 0.29
    assert (await state(http, emu))["running"] == 0  # a hung request never reached the engine


async def test_fault_break_after_chunks(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0, min_chunk_interval_s=0.0) as (emu,):
        await post(http, f"{emu.url}/_emulator/faults", {"break_after_chunks": 2})
        got = b""
        # long enough (~9 s modelled) that a stalled event loop cannot let it finish before the break:
        # 50 tokens took 0.23 s, and a CI stall of that much left nothing to abort
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(f"{emu.url}/v1/chat/completions",
                                 json=chat_body([{"role": "user", "content": "a"}], max_tokens=2000, stream=True)) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    got += chunk
        assert got.count(b"data: ") == 2 and b"[DONE]" not in got

        async def aborted() -> bool:
            return bool((await state(http, emu))["requests_aborted"] == 1)

        await wait_for(aborted)
        assert (await state(http, emu))["requests_served"] == 0


async def test_fault_slow_factor(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=0.2) as (emu,):
        body = {"text": "x" * 400, "sampling_params": {"max_new_tokens": 20}}
        t0 = time.monotonic()
        await post(http, f"{emu.url}/generate", body | {"rid": "fast"})
        fast = time.monotonic() - t0
        await post(http, f"{emu.url}/_emulator/faults", {"slow_factor": 5})
        t0 = time.monotonic()
        status, doc, _ = await post(http, f"{emu.url}/generate", body | {"rid": "slow", "text": "y" * 400})
        slow = time.monotonic() - t0
        assert status == 200 and slow > 2.5 * fast  # modelled the same (both cold), 5x slower on the wall
        assert doc["meta_info"]["e2e_latency"] < 0.5  # modelled time did not change, only its wall pace


async def test_token_unit_scales_reported_capacity(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, profile_overrides={"token_unit": 4}) as (emu,):
        async with http.get(f"{emu.url}/server_info") as r:
            si = await r.json()
        assert si["max_total_num_tokens"] == 8192 // 4 and si["context_length"] == 16384 // 4
        assert si["emulator"]["token_unit"] == 4
        status, doc, _ = await post(http, f"{emu.url}/generate", {"text": "u" * 400, "sampling_params": {"max_new_tokens": 3}})
        assert status == 200 and doc["meta_info"]["prompt_tokens"] == 100  # counts stay in emulated tokens
        async with http.get(f"{emu.url}/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        assert fams["sglang:max_total_num_tokens"].samples[0].value == 2048


async def test_fault_break_nonstream_closes_connection(emu: Running, http: aiohttp.ClientSession) -> None:
    await post(http, f"{emu.url}/_emulator/faults", {"break_after_chunks": 0, "count": 1})
    with pytest.raises(aiohttp.ClientError):
        await post(http, f"{emu.url}/v1/chat/completions", chat_body([{"role": "user", "content": "a"}], max_tokens=2))
    status, _, _ = await post(http, f"{emu.url}/v1/chat/completions",
                              chat_body([{"role": "user", "content": "a"}], max_tokens=2))
    assert status == 200  # count=1: the fault is gone
    st = await state(http, emu)
    assert st["requests_served"] == 1 and st["faults"]["break_after_chunks"] is None


async def test_api_key_guards_data_plane_not_health(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, api_key="sk-test") as (emu,):
        body = chat_body([{"role": "user", "content": "a"}], max_tokens=1)
        status, err, _ = await post(http, f"{emu.url}/v1/chat/completions", body)
        assert status == 401 and err == {"error": "Unauthorized"}
        status, _, _ = await post(http, f"{emu.url}/v1/chat/completions", body,
                                  headers={"Authorization": "Bearer sk-test"})
        assert status == 200
        for path in ("/health", "/metrics"):
            async with http.get(f"{emu.url}{path}") as r:
                assert r.status == 200


async def test_zero_max_tokens_and_abort_mid_stream(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, time_scale=1.0) as (emu,):
        body = chat_body([{"role": "user", "content": "a"}], max_tokens=0, stream=True)
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            chunks = [json.loads(e) for e in sse_events(await r.read())[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == ["length"]
        body = chat_body([{"role": "user", "content": "b"}], max_tokens=5000, stream=True, rid="victim")
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
            await r.content.readuntil(b"\n\n")
            async with http.post(f"{emu.url}/abort_request", json={"rid": "victim"}) as a:
                assert a.status == 200
            rest = sse_events(await r.read())
        finals = [json.loads(e) for e in rest[:-1]]
        assert rest[-1] == b"[DONE]" and finals[-1]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.slow
async def test_default_profile_ttft_over_http(http: aiohttp.ClientSession) -> None:
    """Cold 100k-token prefill and a warm +700-token continuation, default profile, 5x faster."""
    from replica.emulator.profiles import get_profile
    from replica.emulator.runner import running_emulators
    from replica.emulator.server import EmulatorConfig

    cfg = EmulatorConfig(profile=get_profile("kimi-k2.6-b200-tp4"), time_scale=0.2)
    async with running_emulators(1, config=cfg) as (emu,):
        msgs = [{"role": "user", "content": "c" * 400_000}]
        ttft: list[float] = []
        for turn in range(2):
            t0 = time.monotonic()
            async with http.post(f"{emu.url}/v1/chat/completions",
                                 json=chat_body(msgs, max_tokens=4, stream=True, stream_options={"include_usage": True})) as r:
                await r.content.readuntil(b"\n\n")
                ttft.append(time.monotonic() - t0)
                events = sse_events(await r.read())
            usage = json.loads(events[-2])["usage"]
            assert usage["prompt_tokens"] >= 100_000 + 700 * turn
            answer = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                             for e in events[:-2] if json.loads(e)["choices"])
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "d" * 2800}]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 99_900  # whole pages of the first turn
        assert 4.0 * 0.2 < ttft[0] < 7.0 * 0.2 + 0.3  # cold: 4–7 modelled seconds
        assert ttft[1] < 0.09 * 0.2 + 0.1  # warm: 50–90 ms modelled
        async with http.get(f"{emu.url}/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        sums = {s.labels["is_streaming"]: s.value for s in fams["sglang:time_to_first_token_seconds"].samples
                if s.name.endswith("_sum")}
        assert 4.0 + 0.05 < sums["true"] < 7.0 + 0.09  # histograms are in modelled seconds


async def test_get_load_older_shapes_on_request(emulators: Any, http: aiohttp.ClientSession) -> None:
    """/get_load is gone in SGLang 0.5.23 (404, the default); the older shapes stay available for
    peers whose power_of_two still polls it."""
    async with emulators(1, get_load_format="sglang") as (rep,):
        async with http.get(f"{rep.url}/get_load") as r:
            gl = await r.json()
        assert isinstance(gl, list) and set(gl[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    async with emulators(1, get_load_format="vllm") as (rep,), http.get(f"{rep.url}/get_load") as r:
        assert await r.json() == {"load": 0}


async def test_queue_time_histogram_counts_the_wait_for_a_slot(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    """``sglang:queue_time_seconds`` (SGLang's scheduler histogram, scheduler labels): one observation
    per request at its first forward; with one slot, the second request waits for the first to end."""
    async with emulators(1, profile_overrides={"max_running_requests": 1}) as (emu,):
        bodies = [chat_body([{"role": "user", "content": f"question {i}"}], max_tokens=4000) for i in range(2)]
        await asyncio.gather(*(http.post(f"{emu.url}/v1/chat/completions", json=b) for b in bodies))
        async with http.get(f"{emu.url}/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
    fam = fams["sglang:queue_time_seconds"]
    assert fam.type == "histogram"
    by = {s.name.removeprefix("sglang:queue_time_seconds"): s for s in fam.samples if "le" not in s.labels}
    assert by["_count"].value == 2.0
    assert by["_count"].labels == {"engine_type": "unified", "model_name": "emulated/small-test",
                                   "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"}
    e2e = {s.labels["is_streaming"]: s.value for s in fams["sglang:e2e_request_latency_seconds"].samples
           if s.name.endswith("_sum")}
    # the second waited for the first's run r (modelled seconds): e2e sum = r + (wait + r), wait ≈ r;
    # runs long enough (~1 s of wall each) that the second request arriving late on a busy machine
    # still finds the first running (at 1,000 tokens a CI run saw it arrive after the first ended)
    assert 0.25 * e2e["false"] <= by["_sum"].value <= 0.5 * e2e["false"]
    les = [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")]
    assert les[:-1] == sorted(les[:-1]) and les[0] == 0.0 and les[-1] == float("inf")


async def test_completions_top_logprobs_are_distinct_tokens(emu: Running, http: aiohttp.ClientSession) -> None:
    """``/v1/completions`` keys each position's alternatives by token: like an engine's top-k they
    must be distinct, or two collapse into one entry (a CI run's fidelity check saw a size 1 for 2)."""
    for k in range(3):
        status, doc, _ = await post(http, f"{emu.url}/v1/completions",
                                    {"model": "m", "prompt": [5, 6, 7, k], "max_tokens": 200, "logprobs": 3})
        assert status == 200
        assert [len(t) for t in doc["choices"][0]["logprobs"]["top_logprobs"]] == [3] * 200

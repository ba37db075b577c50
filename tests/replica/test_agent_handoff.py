"""Warm hand-off of a draining replica's sessions (router/handoff.py): pure parts, then the gateway
(real sockets) in front of emulated replicas (a real ``kvroute emulate`` process)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.clock import VirtualClock
from router.gateway.forward import usage_from_json
from router.handoff import HANDOFF_KEY, HandoffConfig, HandoffManager, PromptBook, handoff_setup, warmup_body
from router.model import (
    BindSession,
    Completion,
    Reason,
    ReplicaSpec,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
)
from router.store.memory import MemoryStore

MODEL = "moonshotai/Kimi-K2.6"


def test_warmup_body_openai_routes() -> None:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 500,
            "max_completion_tokens": 500,
            "min_tokens": 10,
            "n": 3,
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
    ).encode()
    doc = json.loads(warmup_body("/v1/chat/completions", body) or b"")
    assert doc["stream"] is False and "stream_options" not in doc and "min_tokens" not in doc
    assert doc["max_tokens"] == 1 and doc["max_completion_tokens"] == 1 and doc["n"] == 1
    assert doc["messages"] == [{"role": "user", "content": "hi"}] and doc["tools"]  # the prefix stays


def test_warmup_body_generate_and_garbage() -> None:
    body = json.dumps(
        {"text": "abc", "stream": True, "sampling_params": {"max_new_tokens": 64, "min_new_tokens": 4}}
    )
    doc = json.loads(warmup_body("/generate", body.encode()) or b"")
    assert doc["stream"] is False and doc["text"] == "abc"
    assert doc["sampling_params"] == {"max_new_tokens": 1, "n": 1}
    assert warmup_body("/v1/completions", b"not json") is None
    assert warmup_body("/v1/completions", b"[1, 2]") is None


def test_warmup_body_messages_and_responses() -> None:
    """Claude Code's and Codex's APIs: one output token, not streamed; a Responses warm-up is not
    stored (nobody will ask for it) and not run in the background."""
    msgs = {"model": "m", "system": "be terse", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4096,
            "stream": True, "thinking": {"type": "enabled", "budget_tokens": 2048}, "tools": [{"name": "f"}]}  # fmt: skip
    doc = json.loads(warmup_body("/v1/messages", json.dumps(msgs).encode()) or b"")
    assert doc == {**msgs, "max_tokens": 1, "stream": False}
    resp = {"model": "m", "input": [{"role": "user", "content": "hi"}], "instructions": "be terse",
            "max_output_tokens": 900, "stream": True, "background": True}  # fmt: skip
    doc = json.loads(warmup_body("/v1/responses", json.dumps(resp).encode()) or b"")
    assert doc == {**resp, "max_output_tokens": 3, "stream": False, "store": False, "background": False}


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/responses", {"model": "m", "input": "go on", "previous_response_id": "resp_1"}),  # stored on the old one
        ("/generate", {"text": "abc", "session_params": {"id": "es1", "rid": "r1"}}),  # an engine session
    ],
)
def test_a_prompt_that_names_what_lives_on_the_old_replica_is_not_warmed(route: str, body: dict[str, Any]) -> None:
    assert warmup_body(route, json.dumps(body).encode()) is None


async def test_a_session_that_cannot_be_warmed_is_counted_once() -> None:
    """Sessions on a draining replica with no prompt here, or one that cannot run elsewhere: skipped
    and counted once while they stay there, not at every scan."""
    store = MemoryStore(VirtualClock())
    for rid in ("r1", "r2"):
        await store.upsert_replica(ReplicaSpec(id=rid, url=f"http://{rid}"), ReplicaStatus.ACTIVE)
    for sid in ("no-prompt", "unwarmable"):
        d = RouteDecision("r1", Reason.PLACED_NEW, effects=(BindSession(sid, "r1", None, Reason.PLACED_NEW),))
        await store.release(await store.acquire(d, RouteRequest(sid)), Completion(ok=True, prompt_tokens=100))
    await store.set_status("r1", ReplicaStatus.DRAINING)
    book = PromptBook(max_sessions=10, max_bytes=1 << 20)
    book.record("unwarmable", "r1", "/v1/completions", b"not json")
    manager = HandoffManager(runtime=type("Runtime", (), {"store": store})(), book=book)
    for _ in range(3):
        await manager.scan_once()
    assert (manager.stats.skipped_no_prompt, manager.stats.skipped_unwarmable, manager.stats.sent) == (1, 1, 0)
    await store.set_status("r1", ReplicaStatus.ACTIVE)
    await manager.scan_once()  # off the draining home: forgotten, counted again if it drains again
    await store.set_status("r1", ReplicaStatus.DRAINING)
    await manager.scan_once()
    assert (manager.stats.skipped_no_prompt, manager.stats.skipped_unwarmable) == (2, 2)


def test_prompt_book_is_bounded_and_keeps_the_latest() -> None:
    book = PromptBook(max_sessions=2, max_bytes=10)
    book.record("a", "r1", "/v1/completions", b"1")
    book.record("b", "r1", "/v1/completions", b"2")
    book.record("a", "r2", "/v1/completions", b"3")  # a is now the most recent
    book.record("c", "r1", "/v1/completions", b"4")  # b goes
    assert book.get("b") is None and len(book) == 2
    got = book.get("a")
    assert got is not None and (got.replica_id, got.body) == ("r2", b"3")
    book.record("d", "r1", "/v1/completions", b"x" * 11)  # too big: not kept
    book.record("e", "r1", "/v1/models", b"1")  # not an inference route
    assert book.get("d") is None and book.get("e") is None


# ---- with the gateway ------------------------------------------------------------------------------


@pytest.fixture
def emulators() -> Iterator[list[str]]:
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "emulate",
            "--replicas",
            "3",
            "--base-port",
            "0",
            "--time-scale",
            "1.0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert p.stdout is not None
        urls = [p.stdout.readline().decode().strip() for _ in range(3)]
        assert all(u.startswith("http://127.0.0.1:") for u in urls), urls
        yield urls
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


async def _gateway(urls: list[str], handoff: bool) -> Any:
    from router.config import load_config
    from router.gateway.serve import start_gateway
    from router.observability.surface import operator_surface_from_config

    argv = ["--host", "127.0.0.1", "--port", "0", "--seed", "3"]
    for u in urls:
        argv += ["--replica", u]
    argv += ["--set", "health.health_interval_s=0.2", "--set", "health.scrape_interval_s=0.2"]
    cfg = load_config(argv, {})
    setup = [operator_surface_from_config(cfg).setup]  # /metrics, as `kvroute serve --warm-handoff` has it
    if handoff:
        setup.append(handoff_setup(HandoffConfig(interval_s=0.1)))
    return await start_gateway(cfg, extra_setup=setup)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _turn(
    http: aiohttp.ClientSession, gw: str, sid: str, messages: list[dict[str, str]], api: str = "chat"
) -> dict[str, Any]:
    """One turn on ``api``: chat (OpenAI), messages (Anthropic: Claude Code), responses (Codex)."""
    if api == "messages":
        system = [m["content"] for m in messages if m["role"] == "system"]
        route, body = "/v1/messages", {"model": MODEL, "system": system[0], "max_tokens": 8,
                                       "messages": [m for m in messages if m["role"] != "system"]}  # fmt: skip
    elif api == "responses":
        route, body = "/v1/responses", {"model": MODEL, "input": messages, "max_output_tokens": 8}
    else:
        route, body = "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8, "ignore_eos": True}
    async with http.post(gw + route, json=body, headers={"Modal-Session-Id": sid}) as r:
        assert r.status == 200, await r.text()
        usage = usage_from_json(await r.json())
        assert usage is not None and usage.prompt_tokens is not None and usage.cached_tokens is not None
        return {
            "replica": r.headers["X-Kvroute-Replica"],
            "reason": r.headers["X-Kvroute-Reason"],
            "prompt": usage.prompt_tokens,
            "cached": usage.cached_tokens,
        }


async def _drain_and_next_turn(
    http: aiohttp.ClientSession, urls: list[str], handoff: bool, api: str = "chat"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
    gw = await _gateway(urls, handoff)
    try:
        sessions = {
            f"h{i}": [{"role": "system", "content": " ".join(f"s{i}w{j}" for j in range(3000))}]
            for i in range(6)
        }
        first: dict[str, dict[str, Any]] = {}
        for sid, msgs in sessions.items():
            msgs.append({"role": "user", "content": "turn 1"})
            first[sid] = await _turn(http, gw.url, sid, msgs, api)
            msgs.append({"role": "assistant", "content": "done 1"})
        victim = Counter(t["replica"] for t in first.values()).most_common(1)[0][0]
        moved = [sid for sid, t in first.items() if t["replica"] == victim]
        await gw.store.set_status(victim, ReplicaStatus.DRAINING)
        if handoff:
            manager = gw.app[HANDOFF_KEY]
            deadline = time.monotonic() + 30
            while manager.stats.sent + manager.stats.failed < len(moved):
                assert time.monotonic() < deadline, manager.stats
                await asyncio.sleep(0.05)
        else:
            await asyncio.sleep(0.5)
        second = []
        for sid in moved:
            sessions[sid].append({"role": "user", "content": "turn 2"})
            second.append({**await _turn(http, gw.url, sid, sessions[sid], api), "sid": sid, "victim": victim})
        if handoff:  # what the operator sees of it
            async with http.get(gw.url + "/metrics") as r:
                text = await r.text()
            exported = {
                s.labels["outcome"]: int(s.value)
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name == "kvroute_handoffs_total"
            }
            assert exported == gw.app[HANDOFF_KEY].stats.to_dict()
        return [first[s] for s in moved], second, gw.app[HANDOFF_KEY].stats if handoff else None
    finally:
        await gw.close()


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_warm_handoff_makes_the_next_turn_hit_the_cache(
    emulators: list[str], http: aiohttp.ClientSession, api: str
) -> None:
    before, after, stats = await _drain_and_next_turn(http, emulators, handoff=True, api=api)
    assert after, "the drained replica had sessions"
    for b, a in zip(before, after, strict=True):
        assert a["replica"] != a["victim"]
        # the whole previous prompt (the prefix of this turn) was already in the new replica's cache
        assert a["cached"] >= 0.9 * b["prompt"], (a, b)
    assert stats.helped == len(after) and stats.not_helped == 0 and stats.missed == 0
    assert stats.sent == len(after) and stats.failed == 0


async def test_without_handoff_the_moved_turn_is_cold(
    emulators: list[str], http: aiohttp.ClientSession
) -> None:
    before, after, _ = await _drain_and_next_turn(http, emulators, handoff=False)
    assert after
    for b, a in zip(before, after, strict=True):
        assert a["replica"] != a["victim"]
        assert a["cached"] < 0.5 * b["prompt"], (a, b)  # re-prefilled from scratch

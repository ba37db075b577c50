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

from router.handoff import HANDOFF_KEY, HandoffConfig, PromptBook, _usage, handoff_setup, warmup_body
from router.model import ReplicaStatus

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


def test_usage_parsing() -> None:
    openai = {
        "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}, "completion_tokens": 1}
    }
    assert _usage(json.dumps(openai).encode()) == (10, 8, 1)
    native = {"meta_info": {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 1}}
    assert _usage(json.dumps(native).encode()) == (5, 0, 1)
    assert _usage(b"{}") == (None, None, None) and _usage(b"x") == (None, None, None)


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

    argv = ["--host", "127.0.0.1", "--port", "0", "--seed", "3"]
    for u in urls:
        argv += ["--replica", u]
    argv += ["--set", "health.health_interval_s=0.2", "--set", "health.scrape_interval_s=0.2"]
    cfg = load_config(argv, {})
    setup = [handoff_setup(HandoffConfig(interval_s=0.1))] if handoff else []
    return await start_gateway(cfg, extra_setup=setup)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _turn(
    http: aiohttp.ClientSession, gw: str, sid: str, messages: list[dict[str, str]]
) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "ignore_eos": True}
    async with http.post(gw + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
        assert r.status == 200, await r.text()
        doc = await r.json()
        return {
            "replica": r.headers["X-Kvroute-Replica"],
            "reason": r.headers["X-Kvroute-Reason"],
            "prompt": doc["usage"]["prompt_tokens"],
            "cached": doc["usage"]["prompt_tokens_details"]["cached_tokens"],
        }


async def _drain_and_next_turn(
    http: aiohttp.ClientSession, urls: list[str], handoff: bool
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
            first[sid] = await _turn(http, gw.url, sid, msgs)
            msgs.append({"role": "assistant", "content": "done 1"})
        victim = Counter(t["replica"] for t in first.values()).most_common(1)[0][0]
        moved = [sid for sid, t in first.items() if t["replica"] == victim]
        await gw.store.set_status(victim, ReplicaStatus.DRAINING)
        if handoff:
            manager = gw.app[HANDOFF_KEY]
            deadline = time.monotonic() + 30
            while manager.stats.sent < len(moved):
                assert time.monotonic() < deadline, manager.stats
                await asyncio.sleep(0.05)
        else:
            await asyncio.sleep(0.5)
        second = []
        for sid in moved:
            sessions[sid].append({"role": "user", "content": "turn 2"})
            second.append({**await _turn(http, gw.url, sid, sessions[sid]), "sid": sid, "victim": victim})
        return [first[s] for s in moved], second, gw.app[HANDOFF_KEY].stats if handoff else None
    finally:
        await gw.close()


async def test_warm_handoff_makes_the_next_turn_hit_the_cache(
    emulators: list[str], http: aiohttp.ClientSession
) -> None:
    before, after, stats = await _drain_and_next_turn(http, emulators, handoff=True)
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

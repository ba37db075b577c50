"""Functional: ``kvroute sidecar --kv-events`` follows its emulated engine's KV events (real
processes, real ZMQ, a real redis-server) and shares the engine's exact residency through Redis,
where a gateway's mirror (``kv_events.mode: redis``) reads it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from router.residency import EVENTS
from router.store.residency import RedisResidencyMirror
from tests.replica.test_agent_functional import Procs, _readline, _rid, _until, procs, start_sidecar

__all__ = ["procs"]  # fixture shared with the sidecar tests

pytestmark = pytest.mark.slow

KV = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})


@contextlib.asynccontextmanager
async def mirror(redis_url: str) -> AsyncIterator[RedisResidencyMirror]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    m = RedisResidencyMirror(client, block_ms=100)
    m.start()
    try:
        yield m
    finally:
        await m.close()
        await client.aclose()


async def test_sidecar_shares_the_engines_residency(procs: Procs, redis_url: str) -> None:
    emu = procs.start(["emulate", "--replicas", "1", "--profile", "small-test", "--time-scale", "0.01",
                       "--kv-events-config", KV])
    url = await _readline(emu)
    await start_sidecar(procs, url, redis_url, "--kv-events")
    rid = _rid(url)
    async with mirror(redis_url) as m, aiohttp.ClientSession() as http:
        await _until(lambda: m.source(rid) == EVENTS, 30, "the sidecar's residency for the replica")

        async def turn(msgs: list[dict[str, str]]) -> dict[str, Any]:
            body = {"messages": msgs, "max_tokens": 8, "session_id": "side-1"}
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                return await r.json()  # type: ignore[no-any-return]

        msgs = [{"role": "user", "content": "through the sidecar " * 20}]
        d = await turn(msgs)
        # the prompt and its 8-token answer, in whole 16-token pages (the small-test profile)
        want = (d["usage"]["prompt_tokens"] + 8) // 16 * 16
        await _until(lambda: (m.resident_tokens(rid, "side-1") or 0) >= want, 20, "the session's residency")
        resident = m.resident_tokens(rid, "side-1")
        msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                {"role": "user", "content": "next"}]
        d = await turn(msgs)
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == resident

"""SGLang engine sessions opened through several gateways of one Redis (real redis-server, emulated
engines behind TCP proxies that add latency, so that opens overlap): an id is reserved before its
open is forwarded, so of two opens racing through two gateways exactly one reaches an engine; an
open that fails or gets no answer frees its id; a request naming an id still being opened is a 404."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from loadtests.tcp_proxy import TcpProxy
from replica.emulator.profiles import get_profile
from replica.emulator.runner import start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.clock import SystemClock
from router.config import GatewayConfig
from router.gateway.engine_sessions import OPENING
from router.gateway.serve import RunningGateway, make_store, start_gateway
from router.model import PinKind
from tests.router.conftest import fast_config

LATENCY_S = 0.3  # each way, per chunk: an open takes at least 0.6 s through a proxy


@contextlib.asynccontextmanager
async def _gateway(cfg: GatewayConfig) -> AsyncIterator[RunningGateway]:
    clock = SystemClock()
    gw = await start_gateway(cfg, make_store(cfg, clock), clock=clock, rng=random.Random(7))
    try:
        yield gw
    finally:
        await gw.close()


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_racing_opens_of_one_id_through_two_gateways_open_it_once(redis_url: str) -> None:
    reps = await start_emulators(2, config=EmulatorConfig(profile=get_profile("small-test"), time_scale=0.002))
    proxies = [await TcpProxy("127.0.0.1", r.port, latency_s=LATENCY_S).start() for r in reps]
    try:
        urls = [f"http://{p.url_host_port}" for p in proxies]
        health = {"health_interval_s": 5.0, "scrape_interval_s": 5.0}  # the probes wait on the proxies too
        cfg_a = fast_config(urls, redis_url=redis_url, gateway_id="gw-a", health=health)
        cfg_b = fast_config(urls, redis_url=redis_url, gateway_id="gw-b", health=health)
        async with _gateway(cfg_a) as a, _gateway(cfg_b) as b, aiohttp.ClientSession() as s:
            open_body = {"capacity_of_str_len": 4096, "session_id": "agent-7"}

            async def use_while_opening() -> tuple[int, Any]:
                # once the id is reserved, and while its open is still on its way to the engine
                async with asyncio.timeout(10):
                    while await a.store.pinned(PinKind.ENGINE_SESSION, "agent-7") != OPENING:
                        await asyncio.sleep(0.005)
                return await _post(s, b.url + "/generate", {"text": "too soon", "session_params": {"id": "agent-7"}})

            (st_a, body_a), (st_b, body_b), (st_early, body_early) = await asyncio.gather(
                _post(s, a.url + "/open_session", open_body),
                _post(s, b.url + "/open_session", open_body),
                use_while_opening(),
            )
            assert sorted((st_a, st_b)) == [200, 400], (body_a, body_b)
            refused = body_b if st_b == 400 else body_a
            assert "already open" in refused["error"]["message"]
            assert sum("agent-7" in r.replica.engine_sessions for r in reps) == 1  # opened on one engine
            assert st_early == 404 and "still being opened" in body_early["error"]["message"], body_early
            pinned = await a.store.pinned(PinKind.ENGINE_SESSION, "agent-7")
            assert pinned is not None and pinned == await b.store.pinned(PinKind.ENGINE_SESSION, "agent-7")

            # an open the engine refuses frees its id: the next open of it goes through
            st, body = await _post(s, a.url + "/open_session", {"capacity_of_str_len": 64, "session_id": "x-1",
                                                                 "streaming": True})  # fmt: skip
            assert st == 400 and "Streaming sessions are disabled" in body["error"]["message"]
            assert await a.store.pinned(PinKind.ENGINE_SESSION, "x-1") is None
            # so does one that no engine answers
            for p in proxies:
                p.refuse = True
                p.cut_all()  # the gateways' pooled connections too
            st, body = await _post(s, b.url + "/open_session", {"capacity_of_str_len": 64, "session_id": "x-1"})
            assert st >= 500, body
            assert await a.store.pinned(PinKind.ENGINE_SESSION, "x-1") is None
            for p in proxies:
                p.refuse = False
            st, body = await _post(s, b.url + "/open_session", {"capacity_of_str_len": 64, "session_id": "x-1"})
            assert (st, body) == (200, "x-1")
    finally:
        for p in proxies:
            await p.close()
        await stop_emulators(reps)

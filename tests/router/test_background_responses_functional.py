"""Background Responses (``"background": true``) keep their load until their engine has run them
(``router/gateway/background.py``): an emulated engine with SGLang's response store answers
``queued`` at once and runs the request afterwards; the gateway counts it in flight on that replica
until the run ends, is cancelled, the replica leaves or the gateway stops, and learns the final usage."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from replica.emulator.profiles import get_profile
from replica.emulator.runner import Running, start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.clock import SystemClock
from router.gateway.serve import RunningGateway, make_store, start_gateway
from tests.router.conftest import fast_config, wait_for

MODEL = "emulated/small-test"


@pytest.fixture
async def engine() -> AsyncIterator[Running]:
    # real time: a run of 150 output tokens decodes for about 1.5 s
    (rep,) = await start_emulators(
        1, config=EmulatorConfig(profile=get_profile("small-test"), time_scale=1.0, enable_response_store=True)
    )
    try:
        yield rep
    finally:
        await stop_emulators([rep])


async def _in_flight(gw: RunningGateway) -> int:
    return sum(r.in_flight for r in await gw.store.replicas())


async def _start(s: aiohttp.ClientSession, gw: RunningGateway, session: str, tokens: int = 150) -> str:
    doc = {"model": MODEL, "input": "explain the build " * 40, "max_output_tokens": tokens, "background": True}
    async with s.post(gw.url + "/v1/responses", json=doc, headers={"Modal-Session-Id": session}) as r:
        body = await r.json()
        assert r.status == 200 and body["status"] == "queued", body
        return str(body["id"])


async def _status(s: aiohttp.ClientSession, gw: RunningGateway, rid: str) -> dict[str, Any]:
    async with s.get(f"{gw.url}/v1/responses/{rid}") as r:
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


async def test_a_background_response_counts_in_flight_until_its_engine_has_run_it(
    engine: Running, gateway_factory: Any
) -> None:
    gw = await gateway_factory([engine.url])
    async with aiohttp.ClientSession() as s:
        rid = await _start(s, gw, "bg-1")
        # the answer is back, the engine is running it: its load is still there
        assert await _in_flight(gw) == 1
        async with s.get(gw.url + "/health") as r:
            assert (await r.json())["background_responses"] == 1 and (await r.json())["in_flight"] == 0
        assert (await _status(s, gw, rid))["status"] in ("queued", "in_progress")
        assert await _in_flight(gw) == 1
        deadline = time.monotonic() + 20
        while (final := await _status(s, gw, rid))["status"] in ("queued", "in_progress"):
            assert time.monotonic() < deadline, "the background run never ended"
            await asyncio.sleep(0.05)
        assert final["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens reached
        await wait_for(lambda: _in_flight_is(gw, 0))
    # what the run did is learnt from the final response, not from the queued answer's estimate
    usage = final["usage"]
    session = await gw.store.session("bg-1")
    assert session is not None and session.home is not None
    assert session.context_tokens == usage["input_tokens"] + usage["output_tokens"]


async def _in_flight_is(gw: RunningGateway, n: int) -> bool:
    return await _in_flight(gw) == n


async def test_a_cancelled_a_forgotten_and_an_unfinished_background_response_leave_no_load(
    engine: Running, gateway_factory: Any
) -> None:
    """Cancelled: released at the next read. The replica leaves the registry: released. The gateway
    stops with a run still going: released, so no lease outlives the gateway."""
    gw = await gateway_factory([engine.url])
    async with aiohttp.ClientSession() as s:
        cancelled = await _start(s, gw, "bg-c", tokens=400)
        kept = await _start(s, gw, "bg-k", tokens=400)
        assert await _in_flight(gw) == 2
        async with s.post(f"{gw.url}/v1/responses/{cancelled}/cancel") as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"
        await wait_for(lambda: _in_flight_is(gw, 1))
        session = await gw.store.session("bg-c")
        assert session is not None and session.context_tokens == 0  # nothing learnt from a cancelled run
    assert (await _status_of(gw, kept)) in ("queued", "in_progress")
    await gw.close()
    assert gw.store.core.leases() == ()

    gw = await gateway_factory([engine.url])
    async with aiohttp.ClientSession() as s:
        kept = await _start(s, gw, "bg-r", tokens=400)
        assert await _in_flight(gw) == 1
        (replica,) = await gw.store.replicas()
        await gw.store.remove_replica(replica.id)  # as DELETE /admin/replicas/{id} does
        assert len(gw.runtime.background) == 1
        await wait_for(lambda: not gw.runtime.background)  # the next read finds the replica gone
        assert gw.store.core.leases() == ()
        assert (await _status_of_engine(engine, kept)) == "in_progress"  # released, though still running


async def _status_of(gw: RunningGateway, rid: str) -> str:
    async with aiohttp.ClientSession() as s:
        return str((await _status(s, gw, rid))["status"])


async def _status_of_engine(engine: Running, rid: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{engine.url}/v1/responses/{rid}") as r:
        return str((await r.json())["status"])


async def test_a_background_run_through_one_gateway_counts_for_every_gateway_of_the_store(
    engine: Running, redis_url: str
) -> None:
    """Two gateways on one Redis: the run's load, held by the gateway that relayed its answer,
    is in the other's view too, and a cancel through the other ends it for both."""
    gws = []
    try:
        for gid in ("gw-a", "gw-b"):
            cfg = fast_config([engine.url], redis_url=redis_url, gateway_id=gid)
            clock = SystemClock()
            gws.append(await start_gateway(cfg, make_store(cfg, clock), clock=clock, rng=random.Random(7)))
        a, b = gws
        async with aiohttp.ClientSession() as s:
            rid = await _start(s, a, "bg-shared", tokens=400)
            await wait_for(lambda: _in_flight_is(b, 1))
            async with s.post(f"{b.url}/v1/responses/{rid}/cancel") as r:
                assert r.status == 200 and (await r.json())["status"] == "cancelled"
            await wait_for(lambda: _in_flight_is(a, 0))
            await wait_for(lambda: _in_flight_is(b, 0))
            assert not a.runtime.background
    finally:
        for gw in gws:
            await gw.close()

"""Stored Responses API responses behind several gateways: emulated engines with SGLang's
``--enable-response-store``, two gateways sharing a real Redis. A response stored through one
gateway is found through the other: its continuation, ``GET`` and ``cancel`` reach the engine that
stored it (``router/gateway/stored_responses.py``)."""

from __future__ import annotations

import contextlib
import functools
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from replica.emulator.profiles import get_profile
from replica.emulator.runner import start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.clock import SystemClock
from router.config import GatewayConfig
from router.events import RequestFinished
from router.gateway.serve import RunningGateway, make_store, start_gateway
from router.model import PinKind, ReplicaStatus
from tests.router.conftest import EventLog, fast_config, wait_for

MODEL = "emulated/small-test"


@contextlib.asynccontextmanager
async def _gateway(cfg: GatewayConfig, log: EventLog) -> AsyncIterator[RunningGateway]:
    clock = SystemClock()
    gw = await start_gateway(cfg, make_store(cfg, clock), clock=clock, rng=random.Random(7), hooks=(log,))
    try:
        yield gw
    finally:
        await gw.close()


def _response_id(raw: bytes, stream: bool) -> str:
    if not stream:
        return str(json.loads(raw)["id"])
    first = next(line for line in raw.decode().splitlines() if line.startswith("data: "))
    return str(json.loads(first[6:])["response"]["id"])


async def test_a_response_stored_through_one_gateway_is_found_through_another(redis_url: str) -> None:
    reps = await start_emulators(
        2, config=EmulatorConfig(profile=get_profile("small-test"), time_scale=0.002, enable_response_store=True)
    )
    urls = [r.url for r in reps]
    log = EventLog()
    try:
        async with (
            _gateway(fast_config(urls, redis_url=redis_url, gateway_id="gw-a"), log) as a,
            _gateway(fast_config(urls, redis_url=redis_url, gateway_id="gw-b"), log) as b,
            aiohttp.ClientSession() as s,
        ):

            async def respond(gw: RunningGateway, doc: dict[str, Any], stream: bool) -> tuple[int, bytes, str, str]:
                doc = {"model": MODEL, "max_output_tokens": 10, "instructions": "You are a coder. " * 30,
                       "stream": stream, **doc}  # fmt: skip
                async with s.post(gw.url + "/v1/responses", json=doc, headers={"session_id": "codex-r"}) as r:
                    return r.status, await r.read(), r.headers["X-Kvroute-Replica"], r.headers["X-Kvroute-Reason"]

            status, raw, home, _ = await respond(a, {"input": "refactor the parser " * 40}, stream=True)
            assert status == 200, raw
            first_id = _response_id(raw, stream=True)
            await b.store.set_status(home, ReplicaStatus.DRAINING)  # the session's next turn moves away

            cont = {"input": "now the tests", "previous_response_id": first_id}
            status, raw, went, why = await respond(b, cont, stream=False)
            # to the engine that stored it, via the other gateway
            assert status == 200 and (went, why) == (home, "pinned"), raw
            status, raw, moved, why = await respond(b, {"input": "something else", "store": False}, stream=False)
            # the policy's own choice, for a turn without one
            assert status == 200 and moved != home and why == "reassigned_draining", raw
            unstored = _response_id(raw, stream=False)

            async with s.get(f"{b.url}/v1/responses/{first_id}") as r:
                assert r.status == 200 and (await r.json())["id"] == first_id
            async with s.get(f"{a.url}/v1/responses/{unstored}") as r:
                assert r.status == 404  # asked not to be stored: never pinned
                assert "not found" in (await r.json())["error"]["message"]
        await wait_for(lambda: len(log.of(RequestFinished)) == 3)
        first, second, _ = log.of(RequestFinished)
        # the engine prepended the stored conversation, which its radix cache still held
        assert second.ok and second.prompt_tokens > first.prompt_tokens
        assert second.cached_tokens is not None and second.cached_tokens >= 0.9 * first.prompt_tokens
    finally:
        await stop_emulators(reps)


def _known(gw: RunningGateway, replica_id: str) -> bool:
    return gw.runtime.response_stores.keeps(replica_id, gw.runtime.clock.now()) is not None


async def _two_responses_pins(gw: RunningGateway) -> tuple[str, list[str | None], bool | None]:
    """Two Responses requests of one session through ``gw``, the second once the gateway has read
    whether the replica keeps responses: (the replica, each response's pin, what was read)."""
    stores = gw.runtime.response_stores
    ids, rid = [], ""
    async with aiohttp.ClientSession() as s:
        for turn in range(2):
            doc = {"model": MODEL, "input": f"turn {turn} " * 20, "max_output_tokens": 4}
            async with s.post(gw.url + "/v1/responses", json=doc, headers={"session_id": "one"}) as r:
                assert r.status == 200
                ids.append((await r.json())["id"])
                rid = r.headers["X-Kvroute-Replica"]
            if turn == 0:  # read after the first response
                await wait_for(functools.partial(_known, gw, rid))
    return rid, [await gw.store.pinned(PinKind.RESPONSE, i) for i in ids], stores.keeps(rid, gw.runtime.clock.now())


async def test_no_pins_in_front_of_engines_that_keep_nothing(gateway_factory: Any) -> None:
    """SGLang's default keeps no response: once the gateway has read that from a replica's
    ``/server_info`` (after the first response it relayed from it), its responses are not pinned,
    so a fleet without the store pays no pin per request. Replicas that keep responses are pinned."""
    plain = await start_emulators(1, config=EmulatorConfig(profile=get_profile("small-test"), time_scale=0.002))
    keeping = await start_emulators(
        1,
        config=EmulatorConfig(profile=get_profile("small-test"), time_scale=0.002, enable_response_store=True),
        first_index=1,
    )
    try:
        # the first response, sent before the gateway knew, is pinned either way; the second only if kept
        rid, pins, keeps = await _two_responses_pins(await gateway_factory([plain[0].url]))
        assert keeps is False and pins == [rid, None]
        rid, pins, keeps = await _two_responses_pins(await gateway_factory([keeping[0].url]))
        assert keeps is True and pins == [rid, rid]
    finally:
        await stop_emulators(plain + keeping)

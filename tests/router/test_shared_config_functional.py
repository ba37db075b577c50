"""``PATCH /admin/config`` through one gateway reaches every gateway of the same Redis (real
``kvroute serve`` processes, a real redis-server): a gateway per client pod is tuned once, a gateway
started later routes with the patched config too, and a store that cannot take the change refuses
it (503) without changing anything."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from loadtests.redis_server import RedisServer
from replica.emulator.runner import running_emulators
from replica.emulator.server import EmulatorConfig
from tests.gateway_proc import serve_gateway

pytestmark = pytest.mark.slow

TOKEN = {"Authorization": "Bearer shared-config-token"}
ENV = {"KVROUTE_ADMIN_TOKEN": "shared-config-token"}


async def _config(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/admin/config", headers=TOKEN) as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]


async def _eventually(s: aiohttp.ClientSession, url: str, key: str, want: Any, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while (await _config(s, url))["params"][key] != want:
            await asyncio.sleep(0.1)


async def test_a_patch_through_one_gateway_reaches_every_gateway_of_the_store(redis_url: str) -> None:
    async with running_emulators(1, config=EmulatorConfig(time_scale=0.001)) as reps:
        args = ("--replica", reps[0].url, "--redis", redis_url)
        async with serve_gateway(*args, env=ENV) as a, serve_gateway(*args, env=ENV) as b, aiohttp.ClientSession() as s:
            assert (await _config(s, b.url))["params"]["thicc_threshold"] == 3  # the default
            async with s.patch(a.url + "/admin/config", json={"params": {"thicc_threshold": 6}}, headers=TOKEN) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            assert body["params"]["thicc_threshold"] == 6 and body["shared_generation"] == 1
            await _eventually(s, b.url, "thicc_threshold", 6)
            assert (await _config(s, b.url))["shared_generation"] == 1
            # a bad change is refused where it is made and shared nowhere
            async with s.patch(b.url + "/admin/config", json={"params": {"thicc_threshold": -1}}, headers=TOKEN) as r:
                assert r.status == 400
            async with serve_gateway(*args, env=ENV) as c:  # started after the patch: follows it
                await _eventually(s, c.url, "thicc_threshold", 6)
            async with s.patch(b.url + "/admin/config", json={"params": {"w_sessions": 0.5}}, headers=TOKEN) as r:
                assert r.status == 200
            await _eventually(s, a.url, "w_sessions", 0.5)
            assert (await _config(s, a.url))["params"]["thicc_threshold"] == 6  # the whole config travels


async def test_a_change_the_store_cannot_take_changes_nothing(redis_killable: RedisServer) -> None:
    async with running_emulators(1, config=EmulatorConfig(time_scale=0.001)) as reps:
        args = ("--replica", reps[0].url, "--redis", redis_killable.url)
        async with serve_gateway(*args, env=ENV) as a, aiohttp.ClientSession() as s:
            redis_killable.kill()
            async with s.patch(a.url + "/admin/config", json={"params": {"thicc_threshold": 6}}, headers=TOKEN) as r:
                assert r.status == 503, await r.text()
                assert (await r.json())["error"]["code"] == "store_unavailable"
            assert (await _config(s, a.url))["params"]["thicc_threshold"] == 3

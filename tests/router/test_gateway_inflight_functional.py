"""In-flight accounting of the live gateway when a replica is removed and registered again mid-request.

A replica deleted through the admin API (or gone from the registry) and registered again under the
same id is a new registration starting at 0 in flight. The requests still running on the old one
must not release into the new count: four new requests running on the replica were shown as 0
in flight (load-aware routing then sees an idle replica) once four old ones finished.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from router.model import ReplicaSpec, ReplicaStatus

CHAT = "/v1/chat/completions"


async def test_requests_of_a_removed_replica_do_not_release_into_its_new_registration(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    store = gw.store
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()

    async def in_flight() -> int:
        (st,) = [r for r in await store.replicas() if r.id == rep.id]
        return st.in_flight

    async with aiohttp.ClientSession() as s:

        async def one(sid: str) -> int:
            h = {"Content-Type": "application/json", "Modal-Session-Id": sid}
            async with s.post(gw.url + CHAT, data=body, headers=h) as r:
                await r.read()
                return r.status

        rep.state.first_delay_s = 0.6
        old = [asyncio.create_task(one(f"old{i}")) for i in range(4)]
        await asyncio.sleep(0.3)
        assert await in_flight() == 4
        await store.remove_replica(rep.id)
        await store.upsert_replica(ReplicaSpec(id=rep.id, url=rep.url), ReplicaStatus.ACTIVE)
        rep.state.first_delay_s = 1.5
        new = [asyncio.create_task(one(f"new{i}")) for i in range(4)]
        await asyncio.sleep(0.2)
        assert await in_flight() == 4  # the new registration counts only its own requests
        assert await asyncio.gather(*old) == [200] * 4
        assert await in_flight() == 4, "the old requests released into the new registration"
        assert await asyncio.gather(*new) == [200] * 4
        assert await in_flight() == 0

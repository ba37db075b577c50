"""The gateway relays a replica's answer byte for byte (JSON and SSE), through a real gateway in front
of a scripted replica, and keeps its upstream connection alive across requests."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from router.gateway.upstream import ReplicaHttpClient


@pytest.mark.parametrize("stream", [False, True])
async def test_gateway_relays_the_same_bytes(fake_replicas: Any, gateway_factory: Any, stream: bool) -> None:
    via, direct = await fake_replicas(2)
    # health probes share the pool: none after the first round, so what is counted is the requests'
    gw = await gateway_factory([via.url], health={"health_interval_s": 60.0, "scrape_interval_s": 60.0})
    assert isinstance(gw.runtime.client, ReplicaHttpClient)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":%s}' % (
        b"true" if stream else b"false"
    )
    opened = []
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # the second request rides a pooled connection
            opened.append(gw.runtime.client.connections_opened)
            async with s.post(
                gw.url + "/v1/chat/completions", data=body, headers={"Modal-Session-Id": "k"}
            ) as r:
                assert r.status == 200
                got = await r.read()
            async with s.post(
                direct.url + "/v1/chat/completions", data=body, headers={"x-smg-routing-key": "k"}
            ) as r:
                want = await r.read()
            assert got == want
    assert via.state.requests[-1]["body"] == body
    assert gw.runtime.client.connections_opened == opened[1] <= opened[0] + 1

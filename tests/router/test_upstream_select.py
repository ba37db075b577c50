"""``upstream.client``: which upstream client a gateway uses, set by flag, env or file, and both
clients relaying the same bytes through a real gateway in front of a scripted replica."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from router.config import load_config
from router.errors import ConfigError
from router.gateway.forward import AiohttpReplicaClient
from router.gateway.upstream_raw import RawReplicaClient


def test_config_key_flag_and_env() -> None:
    assert load_config([]).upstream.client == "raw"
    assert load_config(["--upstream-client", "aiohttp"]).upstream.client == "aiohttp"
    assert load_config([], {"KVROUTE_UPSTREAM__CLIENT": "aiohttp"}).upstream.client == "aiohttp"
    assert load_config(["--set", "upstream.client=aiohttp"]).upstream.client == "aiohttp"
    # the flag wins over the environment
    env = {"KVROUTE_UPSTREAM__CLIENT": "aiohttp"}
    assert load_config(["--upstream-client", "raw"], env).upstream.client == "raw"
    with pytest.raises(ConfigError, match="upstream.client"):
        load_config([], {"KVROUTE_UPSTREAM__CLIENT": "curl"})


@pytest.mark.parametrize(("choice", "kind"), [("raw", RawReplicaClient), ("aiohttp", AiohttpReplicaClient)])
@pytest.mark.parametrize("stream", [False, True])
async def test_both_clients_relay_the_same_bytes(
    fake_replicas: Any, gateway_factory: Any, choice: str, kind: type, stream: bool
) -> None:
    via, direct = await fake_replicas(2)
    gw = await gateway_factory([via.url], upstream={"client": choice})
    assert isinstance(gw.runtime.client, kind)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":%s}' % (
        b"true" if stream else b"false"
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # the second request rides a pooled connection
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
    if isinstance(gw.runtime.client, RawReplicaClient):
        assert gw.runtime.client.connections_opened == 1

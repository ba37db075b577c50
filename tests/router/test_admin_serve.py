"""``kvroute serve`` as a real subprocess mounts the operator surface: admin with the token from
``KVROUTE_ADMIN_TOKEN``, 404 without one, ``/metrics`` always."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from replica.emulator.runner import running_emulators
from replica.emulator.server import EmulatorConfig
from tests.gateway_proc import serve_gateway
from tests.router.test_metrics_functional import stack_factory

__all__ = ["stack_factory"]  # fixture shared with the metrics tests

pytestmark = pytest.mark.slow


async def test_serve_mounts_admin_and_metrics() -> None:
    async with (
        running_emulators(1, config=EmulatorConfig(time_scale=0.001)) as reps,
        serve_gateway("--replica", reps[0].url, env={"KVROUTE_ADMIN_TOKEN": "proc-token"}) as gw,
        aiohttp.ClientSession() as s,
    ):
        async with s.get(gw.url + "/admin/stats") as r:
            assert r.status == 401
        async with s.get(gw.url + "/admin/stats", headers={"Authorization": "Bearer proc-token"}) as r:
            assert r.status == 200
            body = await r.json()
        assert [rep["url"] for rep in body["replicas"]] == [reps[0].url]
        async with s.get(gw.url + "/metrics") as r:
            assert r.status == 200 and "kvroute_replica_in_flight_requests" in await r.text()


async def test_serve_without_token_disables_admin() -> None:
    async with (
        running_emulators(1, config=EmulatorConfig(time_scale=0.001)) as reps,
        serve_gateway("--replica", reps[0].url, env={}) as gw,
        aiohttp.ClientSession() as s,
    ):
        async with s.get(gw.url + "/admin/config", headers={"Authorization": "Bearer anything"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "not_found"
        async with s.get(gw.url + "/metrics") as r:
            assert r.status == 200


async def test_admin_on_its_own_port(stack_factory: Any) -> None:
    st = await stack_factory(1, admin_port=0)
    admin_url = st.surface.admin_url
    assert admin_url is not None and admin_url != st.gateway.url
    hdr = {"Authorization": "Bearer metrics-admin-token"}
    async with aiohttp.ClientSession() as s:
        async with s.get(admin_url + "/admin/stats", headers=hdr) as r:
            assert r.status == 200 and len((await r.json())["replicas"]) == 1
        async with s.get(admin_url + "/admin/stats") as r:
            assert r.status == 401
        async with s.get(st.gateway.url + "/admin/stats", headers=hdr) as r:
            assert r.status == 404  # not on the data-plane port
        async with s.get(st.gateway.url + "/metrics") as r:
            assert r.status == 200

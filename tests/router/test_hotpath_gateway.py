"""Behaviour kept (or fixed) by the hot-path work: no cookie jar in the upstream client, load released
when a client leaves during a slow ``release``, one-pass header filtering, uvloop selection."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from router.clock import SystemClock
from router.eventloop import event_loop_factory
from router.gateway.forward import (
    filter_headers,
    filter_request_headers,
    request_drop_set,
)
from router.gateway.middleware import _RequestIds
from router.gateway.serve import start_gateway
from router.model import Completion, Lease
from router.store.memory import MemoryStore
from tests.router.conftest import fast_config, wait_for


class _Upstream:
    """A minimal replica: sets a cookie, reports the Cookie header it got, can stall."""

    def __init__(self) -> None:
        self.cookies_seen: list[str | None] = []
        self.delay_s = 0.0
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(self.app)
        self.url = ""

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.cookies_seen.append(request.headers.get("Cookie"))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        resp = web.json_response({"usage": {"prompt_tokens": 10, "completion_tokens": 2}})
        resp.set_cookie("replica_affinity", "secret-of-client-a")
        return resp

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        # a host name, not an IP: aiohttp's default cookie jar ignores cookies from IP hosts
        self.url = f"http://localhost:{self.runner.addresses[0][1]}"


@pytest.fixture
async def upstream() -> AsyncIterator[_Upstream]:
    u = _Upstream()
    await u.start()
    yield u
    await u.runner.cleanup()


async def test_replica_cookies_are_relayed_never_replayed(upstream: _Upstream) -> None:
    cfg = fast_config([upstream.url])
    gw = await start_gateway(cfg, clock=SystemClock(), rng=random.Random(1))
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
            for sid in ("client-a", "client-b"):
                async with s.post(
                    gw.url + "/v1/chat/completions", data=b'{"model":"m"}', headers={"Modal-Session-Id": sid}
                ) as r:
                    assert r.status == 200
                    assert "replica_affinity=secret-of-client-a" in r.headers.get("Set-Cookie", "")
    finally:
        await gw.close()
    # client b's request must not carry what the replica told client a
    assert upstream.cookies_seen == [None, None]


class _SlowReleaseStore(MemoryStore):
    """A store whose ``release`` suspends (like Redis): the gateway must shield it."""

    never_suspends = False

    def __init__(self) -> None:
        super().__init__(SystemClock())
        self.released = 0

    async def release(self, lease: Lease, completion: Completion) -> None:
        await asyncio.sleep(0.2)
        await super().release(lease, completion)
        self.released += 1


async def test_suspending_release_survives_client_disconnect(upstream: _Upstream) -> None:
    upstream.delay_s = 0.3
    store = _SlowReleaseStore()
    cfg = fast_config([upstream.url])
    gw = await start_gateway(cfg, store, clock=SystemClock(), rng=random.Random(1))
    try:
        async with aiohttp.ClientSession() as s:

            async def call() -> Any:
                async with s.post(gw.url + "/v1/chat/completions", data=b'{"model":"m"}') as r:
                    return await r.read()

            task = asyncio.create_task(call())
            await wait_for(lambda: len(upstream.cookies_seen) == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await wait_for(lambda: store.released == 1, timeout_s=3.0)
        assert all(r.in_flight == 0 for r in await store.replicas())
        await wait_for(lambda: gw.runtime.in_flight == 0)
    finally:
        await gw.close()


def _reference_filter(headers: list[tuple[str, str]], extra: set[str]) -> list[tuple[str, str]]:
    """The former algorithm: Connection tokens collected first, hop-by-hop and Connection-named
    headers dropped, then a second pass dropping the gateway's own names."""
    named: set[str] = set()
    for k, v in headers:
        if k.lower() == "connection":
            named.update(t.strip().lower() for t in v.split(",") if t.strip())
    drop = request_drop_set()
    first = [(k, v) for k, v in headers if k.lower() not in drop and k.lower() not in named]
    return [(k, v) for k, v in first if k.lower() not in extra]


_NAMES = st.sampled_from(
    [
        "Connection",
        "connection",
        "Keep-Alive",
        "X-Foo",
        "x-foo",
        "Host",
        "Content-Length",
        "TE",
        "Authorization",
        "X-Request-Id",
        "X-Forwarded-For",
        "Accept",
        "Upgrade",
        "x-bar",
        "Expect",
    ]
)
_VALUES = st.sampled_from(["close", "x-foo", "X-Bar, keep-alive", " , ", "a", "upgrade,x-request-id", ""])


@given(headers=st.lists(st.tuples(_NAMES, _VALUES), max_size=12))
def test_one_pass_filter_equals_two_passes(headers: list[tuple[str, str]]) -> None:
    extra = {"x-request-id", "x-forwarded-for"}
    assert filter_headers(headers, request_drop_set(extra)) == _reference_filter(headers, extra)
    assert filter_headers(headers, request_drop_set()) == filter_request_headers(headers)


def test_uvloop_is_used_unless_opted_out() -> None:
    import uvloop  # a dependency on Linux
    assert event_loop_factory({}) is uvloop.new_event_loop
    assert event_loop_factory({"KVROUTE_NO_UVLOOP": "1"}) is None
    assert event_loop_factory({"KVROUTE_NO_UVLOOP": "0"}) is uvloop.new_event_loop


async def test_fresh_request_ids_are_unique_hex(upstream: _Upstream) -> None:
    ids = _RequestIds()
    first = [ids.next() for _ in range(1000)]
    assert len(set(first)) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in first)
    ids.reseed()  # what a forked child does
    assert ids.next()[:16] != first[0][:16]
    cfg = fast_config([upstream.url])
    gw = await start_gateway(cfg, clock=SystemClock(), rng=random.Random(1))
    try:
        seen = []
        async with aiohttp.ClientSession() as s:
            for given in ("", "", "client-id.1"):
                hdrs = {"X-Request-Id": given} if given else {}
                async with s.post(gw.url + "/v1/chat/completions", data=b"{}", headers=hdrs) as r:
                    assert r.status == 200
                    seen.append(r.headers["X-Request-Id"])
        assert seen[0] != seen[1] and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in seen[:2])
        assert seen[2] == "client-id.1"
    finally:
        await gw.close()


def test_memory_store_subclasses_are_shielded_unless_they_opt_in() -> None:
    class Plain(MemoryStore):
        pass

    class OptIn(MemoryStore):
        never_suspends = True

    assert MemoryStore.never_suspends and OptIn.never_suspends
    assert not Plain.never_suspends and not _SlowReleaseStore.never_suspends

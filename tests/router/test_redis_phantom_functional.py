"""No phantom load and no leaked keys on the shared-state path, against real processes: a real
redis-server (``redis_url``), ``kvroute emulate`` and ``kvroute serve --redis`` subprocesses.

- a gateway SIGKILLed mid-request and restarted under the same ``--gateway-id`` (deploy/ sets it to
  the pod's name, which survives a container restart) must not adopt its predecessor's counts;
- a request that ends while Redis is unreachable (and Redis keeps its data) must not stay counted
  in flight on its session after the resync;
- the home index of expired sessions must not grow without bound, and no key is left without a TTL
  beyond the fleet's fixed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import redis.asyncio as aioredis

from loadtests.peers import _readiness_check, _wait_ready, emulated_fleet
from loadtests.procs import RunningProcess, free_port, start_process, stop_process

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "phantom-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
P = "{kvroute}:"

pytestmark = pytest.mark.slow


def _body(max_tokens: int, stream: bool) -> bytes:
    doc: dict[str, Any] = {
        "model": "x",
        "messages": [{"role": "user", "content": "hello there, tell me something long"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return json.dumps(doc).encode()


async def _gateway(log_dir: Path, redis_url: str, replica: str, gid: str, *sets: str) -> RunningProcess:
    port = free_port()
    argv = [sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--redis", redis_url, "--replica", replica, "--gateway-id", gid, "--admin-token", TOKEN]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    p = await start_process(f"{gid}-{port}", argv, log_dir=log_dir, env={"PYTHONPATH": str(ROOT)})
    p.url = f"http://127.0.0.1:{port}"
    await _wait_ready(p, _readiness_check(p.url, 1, "kvroute"), 60.0)
    return p


class Fleet:
    """One emulated replica (small profile, real time), the gateways a test starts (stopped at the
    end), a Redis client and an HTTP session."""

    def __init__(self, log_dir: Path, replica: str, r: aioredis.Redis, http: aiohttp.ClientSession) -> None:
        self.log_dir = log_dir
        self.replica = replica
        self.r = r
        self.http = http
        self.gateways: list[RunningProcess] = []


@contextlib.asynccontextmanager
async def _fleet(redis_url: str) -> AsyncIterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="kvroute-phantom-") as tmp:
        r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        async with (
            contextlib.aclosing(r),
            emulated_fleet(1, ("--profile", "small-test", "--time-scale", "1"), log_dir=Path(tmp)) as emus,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        ):
            fleet = Fleet(Path(tmp), emus.urls[0], r, http)
            try:
                yield fleet
            finally:
                for g in fleet.gateways:
                    await stop_process(g, grace_s=5)


async def _session_in_flight(http: aiohttp.ClientSession, gw: str, sid: str) -> int:
    async with http.get(f"{gw}/admin/sessions/{sid}", headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return int((await r.json())["in_flight_total"])


async def _replica_in_flight(http: aiohttp.ClientSession, gw: str) -> int:
    async with http.get(f"{gw}/admin/replicas", headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return sum(int(x["in_flight"]) for x in (await r.json())["replicas"])


async def _in_flight_fields(r: aioredis.Redis, sid: str) -> list[str]:
    """The session's ``f:<gateway>|<replica>`` fields (``r`` decodes responses)."""
    return [f for f in cast(list[str], await r.hkeys(P + "s:" + sid)) if f.startswith("f:")]


async def _until_in_flight_in_redis(r: aioredis.Redis, sid: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _in_flight_fields(r, sid):
        assert time.monotonic() < deadline, "the request never showed up in flight"
        await asyncio.sleep(0.02)


async def _post(http: aiohttp.ClientSession, gw: str, sid: str, max_tokens: int, stream: bool) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Modal-Session-Id": sid}
    async with http.post(f"{gw}/v1/chat/completions", data=_body(max_tokens, stream), headers=headers) as resp:
        return resp.status, await resp.read()


async def test_gateway_restarted_under_the_same_id_leaves_no_phantom_session_load(redis_url: str) -> None:
    sid = "restart-same-id"
    async with _fleet(redis_url) as f:
        r, http, log_dir, replica, gateways = f.r, f.http, f.log_dir, f.replica, f.gateways
        lease = "store.lease_ttl_s=2"
        gateways.append(await _gateway(log_dir, redis_url, replica, "gw-pod-0", lease))
        # a long stream (several seconds on the emulator) is in flight when the gateway is killed
        long = asyncio.create_task(_post(http, gateways[0].url, sid, 1500, True))
        await _until_in_flight_in_redis(r, sid)
        os.killpg(gateways[0].proc.pid, signal.SIGKILL)
        await gateways[0].proc.wait()
        with contextlib.suppress(aiohttp.ClientError):
            await long
        # the container restarts: same pod name, so same gateway id
        gateways.append(await _gateway(log_dir, redis_url, replica, "gw-pod-0", lease))
        gw = gateways[1].url
        deadline = time.monotonic() + 12  # the dead process's lease (2 s) expires well within this
        while (n := await _session_in_flight(http, gw, sid)) != 0:
            assert time.monotonic() < deadline, (
                f"session still counts {n} in flight: {await r.hgetall(P + 's:' + sid)}"
            )
            await asyncio.sleep(0.2)
        # the session's next turns through the restarted gateway leave it at 0, not at 1
        for _ in range(2):
            status, _ = await _post(http, gw, sid, 4, False)
            assert status == 200
        assert await _session_in_flight(http, gw, sid) == 0
        assert await _replica_in_flight(http, gw) == 0
        assert await _in_flight_fields(r, sid) == []


async def test_request_ending_during_a_redis_outage_leaves_no_phantom_session_load(redis_url: str) -> None:
    sid = "ends-while-redis-away"
    async with _fleet(redis_url) as f:
        r, http, log_dir, replica, gateways = f.r, f.http, f.log_dir, f.replica, f.gateways
        gateways.append(await _gateway(log_dir, redis_url, replica, "gw-outage", "store.lease_ttl_s=2"))
        gw = gateways[0].url
        req = asyncio.create_task(_post(http, gw, sid, 400, True))  # ~2 s on the emulator
        await _until_in_flight_in_redis(r, sid)
        # Redis stalls for 3.5 s and keeps its data: the gateway degrades (its refresh times out
        # after 0.5 s), the request ends meanwhile and is released locally
        await r.execute_command("CLIENT", "PAUSE", "3500", "ALL")  # type: ignore[no-untyped-call]
        status, body = await req
        assert status == 200 and b"[DONE]" in body
        deadline = time.monotonic() + 15
        while True:
            async with http.get(f"{gw}/admin/stats", headers=AUTH) as resp:
                stats = await resp.text()
            async with http.get(f"{gw}/metrics", headers={"Accept": "text/plain"}) as resp:
                metrics = await resp.text()
            if "\nkvroute_store_degraded 0" in "\n" + metrics and "kvroute_store_degradations_total 1" in metrics:
                break
            assert time.monotonic() < deadline, stats[:2000]
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + 5
        while (n := await _session_in_flight(http, gw, sid)) != 0:
            assert time.monotonic() < deadline, (
                f"session still counts {n} in flight: {await r.hgetall(P + 's:' + sid)}"
            )
            await asyncio.sleep(0.2)
        assert await _replica_in_flight(http, gw) == 0


async def test_home_index_of_expired_sessions_does_not_grow_and_no_key_leaks(redis_url: str) -> None:
    async with _fleet(redis_url) as f:
        r, http, log_dir, replica, gateways = f.r, f.http, f.log_dir, f.replica, f.gateways
        gateways.append(await _gateway(log_dir, redis_url, replica, "gw-keys", "store.session_ttl_s=1"))
        gw = gateways[0].url
        for i in range(30):
            status, _ = await _post(http, gw, f"short-lived-{i}", 2, False)
            assert status == 200
        rid = replica.removeprefix("http://")
        home = P + "home:" + rid
        assert await r.zcard(home) > 0
        # no admin view is read: only the gateway's own traffic (its replica-table refresh) runs
        deadline = time.monotonic() + 6
        while (n := await r.zcard(home)) != 0:
            assert time.monotonic() < deadline, f"{n} expired sessions still indexed in {home}"
            await asyncio.sleep(0.2)
        assert not [k async for k in r.scan_iter(P + "s:*")]
        fixed = {P + x for x in ("seq", "replicas", "gw", "t0", "health", f"r:{rid}", f"act:{rid}", f"actx:{rid}", f"plc:{rid}")}
        no_ttl = [k async for k in r.scan_iter(P + "*") if await r.pttl(k) == -1 and k not in fixed]
        assert no_ttl == [], no_ttl

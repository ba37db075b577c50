"""Operator-surface defects found by review, each against a real ``kvroute serve`` subprocess
(emulated replicas on 127.0.0.1; Redis and headless Chromium where the defect needs them).

- config errors at start-up must not print the Redis password or the admin token;
- the admin API answers 400, never 500, to JSON numbers Python cannot turn into a float (or parse);
- a non-UTF-8 ``Authorization``/``Cookie`` on ``/admin`` is a 401, not an unauthenticated 500;
- ``POST /admin/replicas`` refuses port 0 (it used to take over the ``host:80`` entry);
- with Redis and a widened ``limits.session_id_pattern``, a non-UTF-8 session id is a 400, not a 500;
- a credential in an ``Authorization`` header without a scheme is redacted from the parser's error log;
- the dashboard's ``?interval=`` cannot make it poll ``/admin/stats`` in a tight loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtests.redis_server import RedisServer, redis_server_binary
from replica.emulator.runner import running_emulators
from replica.emulator.server import EmulatorConfig
from tests.gateway_proc import Serve, clean_env, serve_gateway

pytestmark = pytest.mark.slow

TOKEN = "review-ADMIN-token-7f3a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = "/v1/chat/completions"
CHROMIUM = os.environ.get("KVROUTE_CHROMIUM", "/usr/bin/chromium")


def _serve(*args: str, env: dict[str, str] | None = None) -> contextlib.AbstractAsyncContextManager[Serve]:
    return serve_gateway(*args, env={"KVROUTE_ADMIN_TOKEN": TOKEN, **(env or {})})


async def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# ---- start-up errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "secret", "key"),
    [
        (["--redis", "redis//:redisPW-s3cr3t@10.0.0.9:6379/0"], "redisPW-s3cr3t", "redis_url"),
        (["--redis", "http://user:redisPW-s3cr3t@10.0.0.9:6379"], "redisPW-s3cr3t", "redis_url"),
        (["--set", "admin_token=918273645546372819"], "918273645546372819", "admin_token"),
    ],
    ids=["redis-no-scheme", "redis-wrong-scheme", "numeric-admin-token"],
)
async def test_config_errors_never_print_secrets(args: list[str], secret: str, key: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "serve", "--port", "0", *args,
        env=clean_env({}), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    text = (out + err).decode()
    assert key in text  # the message still names the bad key ...
    assert secret not in text  # ... but not the credential


# ---- the admin API against a live gateway ---------------------------------------------------------


@pytest.fixture
async def gateway() -> AsyncIterator[Serve]:
    async with (
        running_emulators(1, config=EmulatorConfig(time_scale=0.001)) as reps,
        _serve("--replica", reps[0].url) as gw,
    ):
        yield gw


async def test_admin_huge_json_numbers_are_400_not_500(gateway: Serve) -> None:
    big = "1" * 400  # an int float() cannot hold
    huge = "1" * 5000  # over Python's int-parsing digit limit
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(gateway.url + "/admin/config") as r:
            before = await r.json()
        for path, method, body in [
            ("/admin/config", "PATCH", f'{{"params":{{"hard_bound_factor":{big}}}}}'),
            ("/admin/config", "PATCH", f'{{"params":{{"thicc_threshold":{big}}}}}'),
            ("/admin/config", "PATCH", f'{{"params":{{"thicc_threshold":{huge}}}}}'),
            ("/admin/replicas", "POST", f'{{"url":"http://127.0.0.1:9","capacity_tokens":{huge}}}'),
        ]:
            async with s.request(method, gateway.url + path, data=body) as r:
                assert r.status == 400, (path, body[:60], r.status, await r.text())
                err = (await r.json())["error"]
                assert err["code"] == "bad_request"
        async with s.get(gateway.url + "/admin/config") as r:
            assert await r.json() == before  # nothing changed
    assert '"level":"error"' not in gateway.logs()


async def test_admin_non_utf8_credentials_are_401_not_500(gateway: Serve) -> None:
    for header in (b"Authorization: Bearer \xff\xfe", b"Cookie: kvroute_admin=\xff\xfe"):
        req = b"GET /admin/stats HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nConnection: close\r\n\r\n"
        status, body = await _raw(gateway.url, req)
        assert status == 401, (header, status, body)
        assert json.loads(body)["error"]["code"] == "unauthorized"
    assert '"level":"error"' not in gateway.logs()


async def test_replica_url_with_port_zero_is_refused(gateway: Serve) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.post(
            gateway.url + "/admin/replicas", json={"url": "http://127.0.0.1:80", "capacity_tokens": 5}
        ) as r:
            assert r.status == 201
        async with s.post(gateway.url + "/admin/replicas", json={"url": "http://127.0.0.1:0"}) as r:
            assert r.status == 400, await r.text()
            assert "port" in (await r.json())["error"]["message"]
        async with s.get(gateway.url + "/admin/replicas") as r:
            reps = {x["id"]: x for x in (await r.json())["replicas"]}
        # the entry of host:80 is untouched (port 0 used to map to the id host:80 and replace it)
        assert reps["127.0.0.1:80"]["url"] == "http://127.0.0.1:80"
        assert reps["127.0.0.1:80"]["capacity_tokens"] == 5


async def test_credential_without_scheme_is_redacted_from_parser_errors(gateway: Serve) -> None:
    secret = "sk-live-REVIEW-9c1d"
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: " + secret.encode() + b"\x01x\r\nConnection: close\r\n\r\n"
    )
    status, _ = await _raw(gateway.url, req)
    assert status == 400
    await asyncio.sleep(0.3)
    logs = gateway.logs()
    assert "Invalid header value char" in logs  # the parser's error was logged ...
    assert secret not in logs  # ... without the credential


# ---- Redis + a widened session id pattern -----------------------------------------------------------


async def test_non_utf8_session_id_is_400_with_redis() -> None:
    if redis_server_binary() is None:
        pytest.fail("redis-server is not installed")
    redis = RedisServer()
    await asyncio.to_thread(redis.start)
    try:
        async with (
            running_emulators(1, config=EmulatorConfig(time_scale=0.001)) as reps,
            _serve(
                "--replica", reps[0].url, "--redis", redis.url, "--set", "limits.session_id_pattern=^.+$"
            ) as gw,  # fmt: skip
        ):
            body = json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            )
            last = ""
            async with aiohttp.ClientSession() as s:
                for _ in range(100):
                    hdrs = {"Modal-Session-Id": "ok-1", "Content-Type": "application/json"}
                    async with s.post(gw.url + CHAT, data=body, headers=hdrs) as r:
                        last = f"{r.status} {await r.text()}"
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.1)
            assert last.startswith("200"), last
            req = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Modal-Session-Id: \xff\xfe\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n" + body.encode()
            )  # fmt: skip
            status, resp = await _raw(gw.url, req)
            assert status == 400, (status, resp)
            assert "Modal-Session-Id" in json.loads(resp)["error"]["message"]
            assert '"level":"error"' not in gw.logs()
    finally:
        redis.cleanup()


# ---- the dashboard in a real browser ----------------------------------------------------------------


async def _polls(page: Any) -> int:
    return int(await page.locator("body").get_attribute("data-polls") or 0)


@pytest.mark.parametrize("interval", ["abc", "3000000000"])
async def test_dashboard_interval_cannot_cause_a_tight_poll_loop(gateway: Serve, interval: str) -> None:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.fail(f"chromium not found at {CHROMIUM}")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            page = await browser.new_page()
            stats_requests: list[str] = []
            page.on("request", lambda r: stats_requests.append(r.url) if "/admin/stats" in r.url else None)
            await page.goto(f"{gateway.url}/admin/ui?token={TOKEN}&interval={interval}")
            assert page.url.endswith(f"/admin/ui?interval={interval}")  # token gone from the URL
            for _ in range(100):
                if await _polls(page) >= 1:
                    break
                await asyncio.sleep(0.1)
            assert await _polls(page) >= 1
            await asyncio.sleep(2.0)
            # an unusable interval falls back to the default (2 s): a handful of polls, not hundreds
            assert len(stats_requests) <= 4, len(stats_requests)
        finally:
            await browser.close()

"""``kvroute serve`` as a real process: start-up, config errors, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from typing import Any

import aiohttp
import pytest

PY = sys.executable


async def _spawn(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    full_env.update(env or {})
    return await asyncio.create_subprocess_exec(
        PY,
        "-m",
        "router",
        "serve",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
    )


async def _url(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    async with asyncio.timeout(20):
        while True:
            line = (await proc.stderr.readline()).decode()
            if not line:
                raise AssertionError("gateway exited before listening")
            if (
                "listening on http://" in line
                and "kvroute gateway listening" in line
                and line.startswith("kvroute")
            ):
                return line.rsplit(" ", 1)[1].strip()


async def test_bad_config_exits_2_naming_the_key() -> None:
    proc = await _spawn("--port", "0", env={"KVROUTE_LIMITS__MAX_BODY_BYTES": "zero"})
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"limits.max_body_bytes" in err and b"KVROUTE_LIMITS__MAX_BODY_BYTES" in err
    proc = await _spawn("--port", "0", "--policy", "nope")
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2 and b"policy" in err


async def test_help_lists_every_registered_policy() -> None:
    """--policy's help is generated from the registry (sticky_least_loaded was missing)."""
    from router.policy.registry import POLICIES

    proc = await _spawn("--help")
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    text = " ".join(out.decode().split())  # argparse wraps the help
    choices = text.split("--policy POLICY ", 1)[1].split(" --policy-param", 1)[0]
    assert choices.startswith("kv_aware (default)"), choices
    listed = {c.strip().removesuffix(" (default)") for c in choices.split(",")}
    assert listed == set(POLICIES), choices


def _closed_port() -> int:
    """A port nothing listens on (a gateway that did start would find no Redis there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://:pw@127.0.0.1:99999/x", b"bad port"),  # was: ValueError traceback, exit 1
        ("redis://127.0.0.1:{port}/x", b"database must be a number"),  # was: started, silently db 0
        ("redis://:pw@127.0.0.1:{port}/x", b"database must be a number"),
    ],
)
async def test_a_bad_redis_url_is_a_one_line_error_exit_2(url: str, problem: bytes) -> None:
    """docs/CONFIG.md: every config mistake is a one-line error and exit 2, never its password (the
    sidecar's check, router.store.url.check_redis_url)."""
    proc = await _spawn("--port", "0", "--redis", url.format(port=_closed_port()))
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:  # the old code started serving
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2, err.decode()[-2000:]
    assert b"Traceback" not in err and b"pw" not in out + err
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvroute serve:") and "redis_url" in lines[0], lines
    assert problem in err


@pytest.mark.slow
async def test_serve_routes_and_drains_on_sigterm(fake_replicas: Any) -> None:
    (rep,) = await fake_replicas(1)
    rep.state.chunks, rep.state.chunk_delay_s = 10, 0.1  # a 1 s stream
    proc = await _spawn(
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--replica",
        rep.url,
        "--set",
        "health.health_interval_s=0.1",
        "--access-log",
        "--log-level",
        "debug",
    )
    try:
        url = await _url(proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/ready") as r:
                assert r.status == 200
            async with s.post(
                url + "/generate?api_key=sk-secret-456",
                data=b'{"text":"hi"}',
                headers={"Modal-Session-Id": "sig", "Authorization": "Bearer sk-secret-123"},
            ) as r:
                assert r.status == 200 and (await r.read()).startswith(b"{")
            assert rep.state.requests[-1]["headers"]["Authorization"] == "Bearer sk-secret-123"  # end to end
            body = b'{"text":"hi","stream":true}'
            async with s.post(url + "/generate", data=body, headers={"Modal-Session-Id": "sig"}) as r:
                assert r.status == 200 and r.headers["X-Kvroute-Replica"] == rep.id
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)  # in flight: must be allowed to finish
                rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") == 10
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert rep.state.completed == 2 and rep.state.aborted == 0
        assert proc.stderr is not None
        logs = (await proc.stderr.read()).decode()
        assert "POST /generate" in logs  # the access log ran ...
        assert "sk-secret" not in logs  # ... and no credential reached a log line
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_a_new_gateway_takes_the_port_beside_the_old_one_with_reuse_port(fake_replicas: Any) -> None:
    """``--reuse-port``: the next gateway binds the port while the old one still serves; on SIGTERM
    the old one stops accepting, finishes what it has, and ends each keep-alive connection with its
    answer (``Connection: close``), so its clients' next requests reach the new gateway: no
    connection refused during a restart."""
    from loadtests.procs import free_port

    (rep,) = await fake_replicas(1)
    rep.state.chunks, rep.state.chunk_delay_s = 10, 0.1  # a 1 s stream keeps the old one draining
    port = str(free_port())
    common = ["--host", "127.0.0.1", "--port", port, "--replica", rep.url, "--reuse-port",
              "--set", "health.health_interval_s=0.1"]  # fmt: skip
    old = await _spawn(*common, "--gateway-id", "gw-old")
    new: asyncio.subprocess.Process | None = None
    try:
        url = await _url(old)

        async def gateway_id(s: aiohttp.ClientSession) -> tuple[str, str | None]:  # and the connection
            async with s.get(url + "/health") as r:
                assert r.status == 200
                return (await r.json())["gateway_id"], r.headers.get("Connection")

        # one keep-alive connection each, both made before the new gateway exists: both to the old
        kept = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        streaming = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with kept, streaming:
            assert await gateway_id(kept) == await gateway_id(streaming) == ("gw-old", None)
            new = await _spawn(*common, "--gateway-id", "gw-new")
            assert await _url(new) == url  # bound beside the old one
            body = b'{"text":"hi","stream":true}'
            async with streaming.post(url + "/generate", data=body, headers={"Modal-Session-Id": "h"}) as r:
                assert r.status == 200
                await r.content.readline()
                old.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)  # it has closed its listener and is draining
                # the old gateway still answers on the connection it holds, and closes it
                assert await gateway_id(kept) == ("gw-old", "close")
                # the next request needs a new connection: only the new gateway accepts any more
                assert await gateway_id(kept) == ("gw-new", None)
                rest = await r.read()
            assert rest.endswith(b"data: [DONE]\n\n")  # the stream under way finished on the old one
        assert await asyncio.wait_for(old.wait(), 20) == 0
    finally:
        for p in (old, new):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()

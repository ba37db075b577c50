"""Functional, from a review of the replica sidecar: real ``kvroute sidecar`` processes, a real
redis-server, and a stand-in engine on a real socket.

- an engine whose ``/health`` and ``/metrics`` answer late (near the probe timeout) does not make
  the replica drop out of the registry: the entry stays live the whole time and load still arrives;
- a bad ``--redis`` URL (port out of range, a database that is not a number, a wrong scheme) is a
  one-line configuration error, exit 2, that never shows the URL's password.

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from redis.asyncio import Redis

from loadtests.procs import read_line
from router.store.keys import KeySpace
from tests.replica.test_agent_functional import Procs, procs

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["procs"]  # fixture shared with the sidecar tests

PY = sys.executable
MODEL = "slow-model"


# ---- a slow engine ---------------------------------------------------------------------------------


class SlowEngine:
    """SGLang's probe routes on a real socket; ``/health`` and ``/metrics`` answer after ``delay_s``.

    ``/metrics`` reports the number of scrapes so far as the running requests, so every load report
    that reaches the registry differs from the one before it.
    """

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.scrapes = 0

    async def _health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay_s)
        return web.Response(text="")

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        n = self.scrapes
        await asyncio.sleep(self.delay_s)
        text = (
            "# TYPE sglang:num_running_reqs gauge\n"
            f'sglang:num_running_reqs{{model_name="{MODEL}"}} {n}\n'
            "# TYPE sglang:max_total_num_tokens gauge\n"
            f'sglang:max_total_num_tokens{{model_name="{MODEL}"}} 100000\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"served_model_name": MODEL, "max_total_num_tokens": 100000, "tp_size": 1})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"served_model_name": MODEL})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/model_info", self._model_info)
        return app


@pytest.fixture
async def slow_engine() -> AsyncIterator[tuple[SlowEngine, str]]:
    engine = SlowEngine()
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _entry(r: Redis, keys: KeySpace, rid: str) -> tuple[bool, str]:
    """Whether the replica's registry entry is live (listed, not past its expiry), and its engine
    load document (``""`` until the first report)."""
    async with r.pipeline(transaction=True) as p:
        p.sismember(keys.replicas, rid)
        p.hmget(keys.replica(rid), "exp", "engine")
        member, (exp, engine) = await p.execute()
    live = bool(member) and exp is not None and float(exp) >= time.time()
    return live, (engine or b"").decode()


# ---- 1. a slow engine stays registered -------------------------------------------------------------


@pytest.mark.slow
async def test_a_slow_engine_stays_in_the_registry_and_keeps_reporting_load(
    slow_engine: tuple[SlowEngine, str], redis_url: str, procs: Procs
) -> None:
    engine, engine_url = slow_engine
    rid = engine_url.removeprefix("http://")
    keys = KeySpace()
    p = procs.start(
        ["sidecar", "--engine-url", engine_url, "--redis", redis_url,
         "--listen-host", "127.0.0.1", "--listen-port", "0",
         # the defaults that matter: a 5 s TTL equal to the probe timeout, a beat every second
         "--heartbeat-interval", "1", "--replica-ttl", "5", "--probe-timeout", "5",
         "--health-interval", "2", "--drain-grace", "0.3", "--drain-timeout", "20"],
    )  # fmt: skip
    doc = json.loads(await read_line(p.stdout, 60.0))
    assert doc["event"] == "listening"
    procs.drain(p)
    r = Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 30.0
        while not (await _entry(r, keys, rid))[1]:
            assert time.monotonic() < deadline, "the sidecar did not register the engine"
            await asyncio.sleep(0.1)

        # health and load now answer 3.5 s late: inside the 5 s probe timeout, yet together longer
        # than the registry entry's 5 s TTL
        engine.delay_s = 3.5
        slow_since = time.monotonic()
        _, before = await _entry(r, keys, rid)
        missing: list[float] = []
        reports: set[str] = set()
        while (t := time.monotonic() - slow_since) < 15.0:
            live, load = await _entry(r, keys, rid)
            if not live:
                missing.append(round(t, 1))
            if load and load != before:
                reports.add(load)
            await asyncio.sleep(0.1)
        assert not missing, f"the registry entry was gone (or expired) at {missing[:10]} s"
        assert len(reports) >= 2, f"load reports during the slow phase: {len(reports)}"

        p.send_signal(signal.SIGTERM)  # outstanding probes are cancelled: exits within a few seconds
        exit_by = time.monotonic() + 20.0
        while p.poll() is None:
            assert time.monotonic() < exit_by, "the sidecar did not exit after SIGTERM"
            await asyncio.sleep(0.1)
        assert p.returncode == 0
        assert not (await _entry(r, keys, rid))[0]
    finally:
        await r.aclose()


# ---- 2. a bad --redis URL --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://h:99999/0", "port"),
        ("redis://user:secret@h:99999/0", "port"),
        ("redis://h:6379/x", "database"),
        ("redis://user:secret@h:6379/x", "database"),
        ("http://user:secret@h/0", "redis://"),
    ],
)
def test_a_bad_redis_url_is_a_one_line_error_without_the_password(url: str, problem: str) -> None:
    out = subprocess.run(
        [PY, "-m", "router.cli", "sidecar", "--redis", url, "--engine-url", "http://127.0.0.1:9",
         "--listen-host", "127.0.0.1", "--listen-port", "0", "--engine-wait-timeout", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    both = out.stdout + out.stderr
    assert "secret" not in both
    assert "Traceback" not in both
    assert out.returncode == 2, both[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "--redis" in lines[0]
    assert problem in lines[0], lines[0]

"""The real peer routers (``smg launch`` from PyPI sglang-router, and vllm-router) in front of two
emulated replicas: they register them, stream through them, and sessions stick and hit the cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from loadtests.procs import free_port
from replica.emulator.runner import Running, running_emulators
from tests.ci import missing
from tests.replica.conftest import small_config

pytestmark = [pytest.mark.peers, pytest.mark.slow]


def _binary(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return shutil.which(name) or (str(local) if local.exists() else None)


# peer -> (binary, policy argv, sticky header): the flags and the header each router is sticky on
PEERS = {
    "smg": ("smg", ["launch", "--log-level", "warn", "--policy", "manual", "--shutdown-grace-period-secs", "1"],
            "X-SMG-Routing-Key"),
    "vllm-router": ("vllm-router", ["--log-level", "warning", "--policy", "consistent_hash",
                                    "--worker-startup-check-interval", "1"], "x-session-id"),
}


@contextlib.asynccontextmanager
async def peer_router(kind: str, reps: list[Running], tmp_path: Path) -> AsyncIterator[str]:
    name, args, _ = PEERS[kind]
    binary = _binary(name)
    if binary is None:
        missing(f"{name} is not on PATH (pip install 'kvroute[peers]')")
    port, prom = free_port(), free_port()
    log_path = tmp_path / f"{kind}.log"
    log = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary, *args, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(prom), "--worker-urls", *[r.url for r in reps],
        stdout=log, stderr=log, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(f"{url}/readiness") as r:
                        if r.status == 200 and (await r.json()).get("healthy_workers") == len(reps):
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline or proc.returncode is not None:
                    pytest.fail(f"{kind} did not become ready: " + log_path.read_text()[-2000:])
                await asyncio.sleep(0.2)
        yield url
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def stream_chat(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], header: str, key: str
) -> tuple[str, str, int]:
    """One streamed chat completion; returns (replica name, text, cached tokens from the usage chunk)."""
    body = {"model": "emulated/small-test", "messages": messages, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={header: key}) as r:
        assert r.status == 200, await r.text()
        replica = r.headers["X-Emulator-Replica"]
        raw = await r.read()
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 8 and len(text.encode()) == 32
    return replica, text, usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("kind", sorted(PEERS))
async def test_peer_routes_streams_to_emulators_and_sessions_hit_cache(kind: str, tmp_path: Path) -> None:
    header = PEERS[kind][2]
    async with running_emulators(2, config=small_config(time_scale=0.02)) as reps, \
            peer_router(kind, reps, tmp_path) as url:
        # new connection per request: smg adds ~40 ms to streams on reused keep-alive connections
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=30)) as http:
            seen: dict[str, set[str]] = {}
            # at least 12 sessions, and more (up to 64) until both replicas have one: how evenly a
            # consistent-hash ring splits the keys depends on the workers' URLs (free ports)
            for s in range(64):
                if s >= 12 and len(set().union(*seen.values())) == 2:
                    break
                key = f"session-{s}"
                msgs = [{"role": "system", "content": f"[{key}] You are a coding agent. " * 10},
                        {"role": "user", "content": f"task {s}: " + "edit the file " * 30}]
                cached: list[int] = []
                for _turn in range(3):
                    replica, text, c = await stream_chat(http, url, msgs, header, key)
                    seen.setdefault(key, set()).add(replica)
                    cached.append(c)
                    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then? " * 5}]
                assert cached[0] == 0 and 0 < cached[1] < cached[2], cached
            assert all(len(v) == 1 for v in seen.values())  # sticky on the session key
            assert len(set().union(*seen.values())) == 2  # and both replicas got sessions
        assert sum(r.replica.served for r in reps) == 3 * len(seen)

"""Fixtures for the gateway tests: a small scriptable SGLang-like replica (``FakeReplica``) and a
helper that starts a real gateway on a free port in front of replicas.

``FakeReplica`` is a real HTTP server (aiohttp on 127.0.0.1, port 0) speaking the SGLang wire format
of SGLang's OpenAI routes (compact JSON, ``data: ...\\n\\n`` events, ``data: [DONE]``), with exact
fault knobs the gateway tests need: answer 5xx before the first byte, cut a stream after N events,
delay chunks, fail health checks, and count requests the client aborted. The replica emulator
(``replica.emulator``) is exercised by the functional tests that need its cache and time model.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.clock import SystemClock
from router.config import GatewayConfig
from router.gateway.serve import RunningGateway, start_gateway
from router.model import ReplicaStatus
from router.store.memory import MemoryStore

MODEL = "moonshotai/Kimi-K2.6"


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


@dataclass
class FakeReplicaState:
    name: str
    chunks: int = 3  # content chunks per streamed response
    chunk_delay_s: float = 0.0
    first_delay_s: float = 0.0  # "prefill" time before the first byte
    fail_status: int = 0  # answer this status (before any byte) to inference requests
    fail_times: int = 0  # ... this many times (0 = always while fail_status is set)
    break_after: int = -1  # cut the connection after this many SSE events (-1 = never)
    health_status: int = 200
    break_json: bool = False  # non-stream: declare the full Content-Length, send half, cut the connection
    cache_report: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    active: int = 0
    completed: int = 0
    seen_tokens: dict[str, int] = field(default_factory=dict)  # routing key -> prompt tokens cached
    metrics_delay_s: float = 0.0  # before answering /metrics
    health_delay_s: float = 0.0  # before answering /health (a busy SGLang answers it late)
    scraped_at: list[float] = field(default_factory=list)  # loop time of each /metrics request
    checked_at: list[float] = field(default_factory=list)  # ... and of each /health request
    host_used_tokens: int = 0  # /metrics' HiCache host tier (only /metrics has it)
    loads: bool = False  # serve /v1/loads (SGLang 0.5.x); without it 404, as an older engine
    loads_at: list[str] = field(default_factory=list)  # the query string of each /v1/loads request
    dp_ranks: int = 1  # /v1/loads entries: data-parallel schedulers


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.state = FakeReplicaState(name=name)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.port = 0

    # ---- helpers ---------------------------------------------------------------------------------

    def _tokens(self, request: web.Request, body: bytes) -> tuple[int, int]:
        prompt = max(1, len(body) // 4)
        key = request.headers.get("x-smg-routing-key", "")
        cached = min(self.state.seen_tokens.get(key, 0), prompt) if key else 0
        if key:
            self.state.seen_tokens[key] = prompt + 2 * self.state.chunks
        return prompt, cached

    def _usage(self, prompt: int, cached: int, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if self.state.cache_report else None,
            "reasoning_tokens": 0,
        }

    # ---- handlers ----------------------------------------------------------------------------------

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        st = self.state
        raw = await request.read()
        st.requests.append({"path": request.path, "headers": request.headers.copy(), "body": raw})
        if st.fail_status:
            fail = st.fail_status
            if st.fail_times > 0:
                st.fail_times -= 1
                if st.fail_times == 0:
                    st.fail_status = 0
            return web.json_response(
                {
                    "object": "error",
                    "message": "overloaded",
                    "type": "ServiceUnavailable",
                    "param": None,
                    "code": fail,
                },
                status=fail,
            )
        body = json.loads(raw)
        prompt, cached = self._tokens(request, raw)
        st.active += 1
        try:
            if st.first_delay_s:
                await asyncio.sleep(st.first_delay_s)
            if body.get("stream"):
                return await self._stream(request, body, prompt, cached)
            await asyncio.sleep(st.chunk_delay_s * st.chunks)
            full = self._full(request.path, body, prompt, cached).encode()
            if st.break_json:
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                resp.content_length = len(full)
                await resp.prepare(request)
                await resp.write(full[: len(full) // 2])
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.abort()
                return resp
            st.completed += 1
            return web.Response(body=full, content_type="application/json")
        except asyncio.CancelledError:
            st.aborted += 1
            raise
        finally:
            st.active -= 1

    def _full(self, path: str, body: dict[str, Any], prompt: int, cached: int) -> str:
        n = self.state.chunks
        text = "".join(f" tok{i}" for i in range(n))
        if path == "/generate":
            return _dump(
                {
                    "text": text,
                    "output_ids": list(range(n)),
                    "meta_info": {
                        "id": "rid-1",
                        "finish_reason": {"type": "length", "length": n},
                        "prompt_tokens": prompt,
                        "weight_version": "default",
                        "num_retractions": 0,
                        "reasoning_tokens": 0,
                        "completion_tokens": n,
                        "cached_tokens": cached,
                        "dp_rank": None,
                        "e2e_latency": 0.01,
                    },
                }
            )
        if path == "/v1/completions":
            return _dump(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "created": 1767225600,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": "length",
                            "matched_stop": None,
                        }
                    ],
                    "usage": self._usage(prompt, cached, n),
                    "metadata": {"weight_version": "default"},
                }
            )
        return _dump(
            {
                "id": "chat-1",
                "object": "chat.completion",
                "created": 1767225600,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "reasoning_content": None},
                        "logprobs": None,
                        "finish_reason": "length",
                        "matched_stop": None,
                    }
                ],
                "usage": self._usage(prompt, cached, n),
                "metadata": {"weight_version": "default"},
            }
        )

    def _events(self, path: str, body: dict[str, Any], prompt: int, cached: int) -> list[str]:
        n = self.state.chunks
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        out: list[str] = []
        if path == "/generate":
            for i in range(n):
                meta = {
                    "id": "rid-1",
                    "finish_reason": None if i < n - 1 else {"type": "length", "length": n},
                    "prompt_tokens": prompt,
                    "completion_tokens": i + 1,
                    "cached_tokens": cached,
                }
                out.append(
                    _dump(
                        {
                            "text": "".join(f" tok{j}" for j in range(i + 1)),
                            "output_ids": list(range(i + 1)),
                            "meta_info": meta,
                        }
                    )
                )
            return out
        if path == "/v1/completions":
            for i in range(n):
                out.append(
                    _dump(
                        {
                            "id": "cmpl-1",
                            "object": "text_completion",
                            "created": 1767225600,
                            "model": MODEL,
                            "choices": [
                                {
                                    "index": 0,
                                    "text": f" tok{i}",
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "matched_stop": None,
                                }
                            ],
                            "usage": None,
                        }
                    )
                )
        else:
            for i in range(n):
                out.append(
                    _dump(
                        {
                            "id": "chat-1",
                            "object": "chat.completion.chunk",
                            "created": 1767225600,
                            "model": MODEL,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"reasoning_content": None, "content": f" tok{i}"},
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "matched_stop": None,
                                }
                            ],
                        }
                    )
                )
        if include_usage:
            out.append(
                _dump(
                    {
                        "id": "x-1",
                        "object": "chunk",
                        "created": 1767225600,
                        "model": MODEL,
                        "choices": [],
                        "usage": self._usage(prompt, cached, n),
                    }
                )
            )
        return out

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: int, cached: int
    ) -> web.StreamResponse:
        st = self.state
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "X-Replica-Name": st.name}
        )
        await resp.prepare(request)
        for i, ev in enumerate(self._events(request.path, body, prompt, cached)):
            if st.break_after >= 0 and i >= st.break_after:
                assert request.transport is not None
                request.transport.abort()  # an engine crash mid-stream
                return resp
            await resp.write(f"data: {ev}\n\n".encode())
            if st.chunk_delay_s:
                await asyncio.sleep(st.chunk_delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        st.completed += 1
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        self.state.checked_at.append(asyncio.get_running_loop().time())
        if self.state.health_delay_s:
            await asyncio.sleep(self.state.health_delay_s)
        return web.Response(status=self.state.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.state.scraped_at.append(asyncio.get_running_loop().time())
        if self.state.metrics_delay_s:
            await asyncio.sleep(self.state.metrics_delay_s)
        labels = f'engine_type="unified",model_name="{MODEL}",tp_rank="0"'
        text = (
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{labels}}} {float(self.state.active)}\n"
            f"sglang:num_queue_reqs{{{labels}}} 0.0\n"
            f"sglang:token_usage{{{labels}}} 0.1\n"
            f"sglang:max_total_num_tokens{{{labels}}} 850000.0\n"
            f"sglang:hicache_host_used_tokens{{{labels}}} {float(self.state.host_used_tokens)}\n"
            f"sglang:hicache_host_total_tokens{{{labels}}} 1700000.0\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _loads(self, request: web.Request) -> web.Response:
        if not self.state.loads:
            raise web.HTTPNotFound()
        self.state.loads_at.append(request.query_string)
        rank = {"dp_rank": 0, "num_running_reqs": self.state.active, "num_waiting_reqs": 2,
                "num_waiting_uncached_tokens": 4096, "max_total_num_tokens": 850000, "token_usage": 0.25,
                "gen_throughput": 100.0, "cache_hit_rate": 0.5}  # fmt: skip
        ranks = [dict(rank, dp_rank=i, num_running_reqs=self.state.active if i == 0 else 0) for i in range(self.state.dp_ranks)]
        if "dp_rank" in request.query:  # SGLang's own filter
            ranks = [r for r in ranks if str(r["dp_rank"]) == request.query["dp_rank"]]
        return web.json_response({"version": "0.5.23", "loads": ranks})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL,
                        "object": "model",
                        "created": 1,
                        "owned_by": "sglang",
                        "root": MODEL,
                        "parent": None,
                        "max_model_len": 262144,
                    }
                ],
            }
        )

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses"):
            app.router.add_post(path, self._inference)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, max_field_size=65536)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def id(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def fake_replicas() -> AsyncIterator[Callable[[int], Awaitable[list[FakeReplica]]]]:
    started: list[FakeReplica] = []

    async def make(n: int) -> list[FakeReplica]:
        out = []
        for i in range(n):
            r = FakeReplica(f"r{len(started)}")
            await r.start()
            started.append(r)
            out.append(r)
        return out

    yield make
    for r in started:
        await r.stop()


class EventLog:
    """A hook that keeps every event (tests read it)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, event: Any) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


async def wait_for(cond: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Poll ``cond`` (sync or async) until truthy; fail the test after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def fast_config(replicas: list[str], **overrides: Any) -> GatewayConfig:
    """A gateway config for tests: free port, fast health checks, short timeouts."""
    base: dict[str, Any] = {
        "port": 0,
        "replicas": replicas,
        "health": {
            "scrape_interval_s": 0.05,
            "health_interval_s": 0.05,
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
        },
        "timeouts": {
            "connect_s": 1.0,
            "first_byte_s": 5.0,
            "idle_read_s": 5.0,
            "probe_s": 1.0,
            "shutdown_s": 2.0,
        },
        "gateway_id": "test-gw",
        "seed": 7,
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return GatewayConfig(**base)


async def rerun_start_up_probes(gw: RunningGateway, timeout_s: float = 10.0, *, all_join: bool = False) -> None:
    """A test with a long health interval leans on the start-up round, but a probe that ran past its
    timeout on a loaded machine leaves its replica JOINING for the whole interval. While a JOINING
    replica answers ``/health`` with 200 (``all_join``: while any is JOINING), run the next rounds now,
    for at most ``timeout_s`` (a replica the rounds keep JOINING for a reason of their own is left so)."""
    discovery = gw.runtime.discovery
    if discovery is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def answers(s: aiohttp.ClientSession, url: str) -> bool:
        try:
            async with s.get(url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as s:
        while loop.time() < deadline:
            joining = [r for r in await gw.store.replicas() if r.status is ReplicaStatus.JOINING]
            if not [r for r in joining if all_join or await answers(s, r.url)]:
                return
            await discovery.check_health_once()
            await discovery.scrape_once()
            await asyncio.sleep(0.1)


@pytest.fixture
async def gateway_factory() -> AsyncIterator[Callable[..., Awaitable[RunningGateway]]]:
    running: list[RunningGateway] = []

    async def make(replicas: list[str], hooks: tuple[Any, ...] = (), **overrides: Any) -> RunningGateway:
        cfg = fast_config(replicas, **overrides)
        clock = SystemClock()
        gw = await start_gateway(
            cfg,
            MemoryStore(clock, cfg.store.to_store_config()),
            clock=clock,
            rng=random.Random(cfg.seed),
            hooks=hooks,
        )
        running.append(gw)
        if cfg.health.health_interval_s >= 5.0:
            await rerun_start_up_probes(gw)
        return gw

    yield make
    for gw in running:
        await gw.close()

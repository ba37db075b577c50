"""Closed-loop live load driver for any OpenAI-compatible URL (kvroute, a peer router, one replica).

``kvroute load --url URL --replica-url R1 --replica-url R2 ... --json out.json``

Theory of operation:
  * Each :class:`~loadtests.workloads.SessionSpec` becomes one asyncio task that starts at its
    ``start_s`` and runs its turns closed-loop: think (``think_s``), send the turn's request, wait for
    the whole response, repeat. Branches (sub-agents) run as concurrent tasks with their own transcript
    but the parent's session id; a turn with ``parallel = k`` sends k requests at once (thicc).
  * Time is scaled like the emulator's: wall seconds = modelled seconds x ``time_scale``. Every time
    in the output JSON is in *modelled* seconds (``"time_unit": "modelled_s"``), i.e. wall / time_scale.
  * Sizes are scaled by ``token_unit``: each emulated token (4 bytes of prompt text) stands for
    ``token_unit`` model tokens. Token counts in the JSON are model tokens (emulated x token_unit).
  * Requests are chat completions, ``stream: true`` with ``stream_options.include_usage``, ``max_tokens``
    = the turn's output. TTFT = first SSE ``data:`` event; cached tokens come from the usage chunk.
    With ``api="messages"`` they are Anthropic Messages API requests (``/v1/messages``, what Claude
    Code sends: the system prompt top-level), their usage read from ``message_start`` and
    ``message_delta`` (``input_tokens`` + ``cache_read_input_tokens`` is the prompt). With
    ``api="responses"`` they are OpenAI Responses API requests (``/v1/responses``, what Codex sends:
    ``instructions`` + ``input``, ``store: false``, the served model's name, which SGLang checks), their
    usage read from the last event; TTFT is the first event after ``response.created`` and
    ``response.in_progress``, which SGLang sends before the prefill.
  * The session id goes in ``Modal-Session-Id``, ``x-session-id`` and ``X-SMG-Routing-Key`` so kvroute
    and both peer routers see it.
  * Per-replica load is sampled every ``sample_interval_s`` (wall) FROM THE REPLICAS (``/_emulator/state``,
    a real SGLang's ``/v1/loads``, else ``/metrics``: running + queued), never from the router under test.
  * Ideal cached tokens: one infinite prefix cache holds every prompt whose turn finished, tokenized and
    paged as the emulator does (``loadtests.ideal``; page size ``page_size`` if given, else what the
    first replica's ``/server_info`` reports, else 1). A continuation's ideal is what its previous prompt
    shares with it in whole pages, a first turn's the shared system prefix once any turn sent it.
  * The run stops issuing requests at ``duration_s`` (wall) or ``max_requests``; in-flight requests get
    ``drain_s`` to finish, the rest are cancelled and counted as ``censored`` (not errors).
  * The engines' own queue-time and TTFT histograms (``/metrics``) are read when the warm-up ends and
    after the drain, summed over replicas: ``engine_queue_*`` (``loadtests.measures``); None when a
    replica does not answer or does not report them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.ideal import InfiniteCache, PooledCache
from loadtests.measures import EngineQueue
from loadtests.textgen import Conversation, emulated_tokens
from loadtests.workloads import SessionSpec, conversation_starts, sticky_gateway, turn_inputs, turn_overlaps
from replica.emulator.profiles import Profile
from replica.emulator.timemodel import alone_ttft_s
from router.eventloop import run as run_on_loop
from router.model import Reason

__all__ = [
    "DEFAULT_SESSION_HEADERS",
    "GATEWAY_ASSIGN",
    "HomeChanges",
    "LiveStats",
    "LoadConfig",
    "LoadResult",
    "LoadSampler",
    "Outcome",
    "cli_main",
    "rendered_turns",
    "run_load",
]

DEFAULT_SESSION_HEADERS: tuple[str, ...] = ("Modal-Session-Id", "x-session-id", "X-SMG-Routing-Key")
_REPLICA_HEADERS = ("X-Emulator-Replica", "X-Kvroute-Replica")
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
# a Responses API stream's lifecycle events, sent before the prefill: no token yet
_BEFORE_FIRST_TOKEN = (b'data: {"type":"response.created"', b'data: {"type":"response.in_progress"')


GATEWAY_ASSIGN = ("round_robin", "sticky")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to drive one run. Wall-clock knobs end in ``_s`` and are wall seconds unless named ``modelled``."""

    url: str  # base URL, e.g. http://127.0.0.1:8000 (the driver posts to {url}/v1/chat/completions)
    extra_urls: tuple[str, ...] = ()  # more gateways: (url, *extra_urls), chosen by ``gateway_assign``
    # "round_robin": request by request, as behind a Service; "sticky": a session's requests to one
    # gateway (``workloads.sticky_gateway``, the simulator's pick too), as a client pod's sidecar
    gateway_assign: str = "round_robin"
    replica_urls: tuple[str, ...] = ()  # where to sample per-replica load (the emulated replicas)
    model: str = "default"
    time_scale: float = 1.0  # wall = modelled x time_scale (same knob as the emulator)
    token_unit: int = 1  # each emulated token stands for this many model tokens
    duration_s: float = 60.0  # wall seconds of issuing requests
    max_requests: int | None = None
    lanes: int | None = None  # keep this many sessions alive: a lane starts its next session when one ends
    warmup_s: float = 0.0  # wall seconds excluded from load samples and request measures
    drain_s: float = 10.0  # wall seconds in-flight requests get after the end
    sample_interval_s: float = 0.25  # wall seconds between load samples
    fresh_connections: bool = False  # one TCP connection per request (sglang-router's keep-alive SSE delay)
    max_think_modelled_s: float = 120.0  # cap on a single think time (heavy tails would idle a short run)
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS
    request_timeout_s: float = 600.0
    stream: bool = True
    api: str = "chat"  # "chat" (/v1/chat/completions), "messages" (Anthropic's) or "responses" (OpenAI's)
    break_tolerance: float = 0.95  # cached < tolerance x ideal counts as an affinity break
    # emulated tokens per cache page of the replicas, for the ideal; None: the first replica's
    # /server_info says (1 if it does not answer)
    page_size: int | None = None
    # the replicas' time model (an emulated fleet's profile, token_unit included), for each request's
    # no-queueing TTFT floor (``ttft_floor_p99_s``); None: unknown (a real engine), no floor
    floor_profile: Profile | None = None

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.token_unit < 1:
            raise ValueError(f"token_unit must be >= 1, got {self.token_unit}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.lanes is not None and self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if self.sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.gateway_assign not in GATEWAY_ASSIGN:
            raise ValueError(f"gateway_assign must be one of {GATEWAY_ASSIGN}, got {self.gateway_assign!r}")


_Ctx = tuple[str, int, int, bool, int | None]
"""(session id, ideal cached emulated tokens, prompt emulated tokens, continuation, pooled cached
emulated tokens or None): what the driver knows of a request before it is sent."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it (times in modelled seconds since the run started)."""

    session_id: str
    replica: str | None
    t_start: float
    ttft_s: float | None
    e2e_s: float | None
    input_tokens: int  # model tokens (usage x token_unit; estimate if no usage)
    cached_tokens: int
    output_tokens: int
    ideal_cached_tokens: int
    ok: bool
    break_reason: str | None
    pooled_cached_tokens: int | None = None  # one shared LRU of the fleet's KV (model tokens)
    status: int = 0
    error: str | None = None
    side: bool = False  # an extra concurrent request of a thicc turn
    route_reason: str | None = None  # X-Kvroute-Reason when the router is kvroute


@dataclass(slots=True)
class LiveStats:
    """Running figures for a live view; updated by the driver, read by the demo/progress bar."""

    started: int = 0
    finished: int = 0
    errors: int = 0
    in_flight: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    last_loads: tuple[int, ...] = ()
    replica_names: tuple[str, ...] = ()
    load_n: int = 0
    load_sum: float = 0.0
    load_sumsq: float = 0.0
    elapsed_s: float = 0.0  # wall

    @property
    def chr(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def ideal_chr(self) -> float:
        return self.ideal_cached_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def dispersion(self) -> float:
        if self.load_n == 0 or self.load_sum == 0:
            return 0.0
        mean = self.load_sum / self.load_n
        var = self.load_sumsq / self.load_n - mean * mean
        return max(var, 0.0) / mean

    def ttft_quantile(self, q: float) -> float:
        if not self.ttfts:
            return 0.0
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def add_loads(self, loads: Sequence[int]) -> None:
        for x in loads:
            self.load_n += 1
            self.load_sum += x
            self.load_sumsq += x * x


@dataclass(frozen=True, slots=True)
class LoadResult:
    measures: dict[str, Any]  # loadtests/measures.py fields (+ run metadata)
    outcomes: tuple[Outcome, ...]
    load_samples: tuple[tuple[float, tuple[int, ...]], ...]  # (modelled t, per-replica in-flight)
    replica_names: tuple[str, ...]


# ---- load sampling (from the replicas, never the router) ------------------------------------------


def _load_from_state(doc: Any) -> int:
    """running + queued from an emulator ``/_emulator/state`` document (tolerant of its shape)."""
    if not isinstance(doc, dict):
        raise TypeError("state is not an object")
    for key in ("in_flight", "num_in_flight"):
        if isinstance(doc.get(key), int):
            return int(doc[key])
    inner = doc.get("load")
    load: dict[str, Any] = inner if isinstance(inner, dict) else doc
    running = load.get("running", load.get("num_running_reqs", 0))
    queued = load.get("queued", load.get("num_queue_reqs", load.get("waiting", 0)))
    return int(running or 0) + int(queued or 0)


def _load_from_loads(doc: Any) -> int:
    """running + waiting summed over the DP ranks of a SGLang ``/v1/loads`` document."""
    ranks = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(ranks, list):
        raise TypeError("not a /v1/loads document")
    return sum(int(r.get("num_running_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in ranks)


def _load_from_metrics(text: str) -> int:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return int(total)


class LoadSampler:
    """Polls each replica for its in-flight requests (running + queued)."""

    def __init__(self, session: aiohttp.ClientSession, replica_urls: Sequence[str]) -> None:
        self._session = session
        self._urls = [u.rstrip("/") for u in replica_urls]
        self._use_metrics = [False] * len(self._urls)
        self._timeout = aiohttp.ClientTimeout(total=5.0)

    async def _one(self, i: int) -> int:
        url = self._urls[i]
        if not self._use_metrics[i]:
            async with self._session.get(f"{url}/_emulator/state", timeout=self._timeout) as resp:
                if resp.status == 200:
                    return _load_from_state(await resp.json())
                self._use_metrics[i] = True
        # a real SGLang: /v1/loads is a few 100 ms behind; its /metrics gauges lag seconds
        async with self._session.get(f"{url}/v1/loads", timeout=self._timeout) as resp:
            if resp.status == 200:
                return _load_from_loads(await resp.json())
        async with self._session.get(
            f"{url}/metrics", headers={"Accept": "text/plain"}, timeout=self._timeout
        ) as resp:
            return _load_from_metrics(await resp.text())

    async def sample(self) -> tuple[int, ...]:
        res = await asyncio.gather(*(self._one(i) for i in range(len(self._urls))), return_exceptions=True)
        return tuple(r if isinstance(r, int) else 0 for r in res)

    async def names(self) -> tuple[str, ...]:
        return tuple(u.split("://", 1)[-1] for u in self._urls)


_QUEUE_FAMILY = "sglang:queue_time_seconds"
_TTFT_FAMILY = "sglang:time_to_first_token_seconds"


def engine_queue_from_metrics(texts: Sequence[str]) -> EngineQueue | None:
    """The queue-time histogram and the TTFT histogram's sum and count, summed over replicas'
    ``/metrics`` texts and label sets. None if any text lacks the queue-time family."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    q_sum = q_count = t_sum = t_count = 0.0
    for text in texts:
        found = False
        for fam in text_string_to_metric_families(text):
            if fam.name not in (_QUEUE_FAMILY, _TTFT_FAMILY):
                continue
            queue = fam.name == _QUEUE_FAMILY
            found = found or queue
            for smp in fam.samples:
                if smp.name.endswith("_bucket") and queue:
                    ub = float(smp.labels["le"])
                    buckets[ub] = buckets.get(ub, 0.0) + smp.value
                elif smp.name.endswith("_sum"):
                    if queue:
                        q_sum += smp.value
                    else:
                        t_sum += smp.value
                elif smp.name.endswith("_count"):
                    if queue:
                        q_count += smp.value
                    else:
                        t_count += smp.value
        if not found:
            return None
    if not buckets:
        return None
    return EngineQueue(tuple(sorted(buckets.items())), q_sum, q_count, t_sum, t_count)


async def _engine_queue(session: aiohttp.ClientSession, replica_urls: Sequence[str]) -> EngineQueue | None:
    """``engine_queue_from_metrics`` of every replica's ``/metrics`` now; None if one does not answer."""

    async def one(url: str) -> str:
        async with session.get(f"{url.rstrip('/')}/metrics", headers={"Accept": "text/plain"}) as resp:
            resp.raise_for_status()
            return await resp.text()

    if not replica_urls:
        return None
    try:
        texts = await asyncio.gather(*(one(u) for u in replica_urls))
    except (aiohttp.ClientError, TimeoutError):
        return None
    try:
        return engine_queue_from_metrics(texts)
    except ValueError:  # not a Prometheus exposition
        return None


@dataclass(frozen=True, slots=True)
class FleetKv:
    """What the replicas report of their KV (``/server_info``), in their own tokens."""

    page_size: int = 1
    capacity_tokens: int = 0  # Σ max_total_num_tokens (HBM)
    host_capacity_tokens: int = 0  # Σ HiCache host pools (hicache_ratio x HBM where enabled)


async def _fleet_kv(session: aiohttp.ClientSession, replica_urls: Sequence[str]) -> FleetKv:
    """Page size of the first replica and the fleet's summed KV capacity (SGLang's ``/server_info``:
    ``page_size``, ``max_total_num_tokens`` per data-parallel rank times ``dp_size``,
    ``enable_hierarchical_cache`` + ``hicache_ratio``). A replica that does not answer adds nothing;
    page size 1 if none does."""
    page = 0
    cap = host = 0
    for url in replica_urls:
        try:
            async with session.get(f"{url.rstrip('/')}/server_info") as resp:
                info = await resp.json() if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        size = info.get("page_size")
        if not page and isinstance(size, int) and size >= 1:
            page = size
        hbm = info.get("max_total_num_tokens")
        if isinstance(hbm, int) and hbm > 0:
            # one data-parallel rank's pool: a --dp-size N engine has N of them
            dp = info.get("dp_size")
            ranks = dp if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1 else 1
            cap += hbm * ranks
            ratio = info.get("hicache_ratio")
            if info.get("enable_hierarchical_cache") and isinstance(ratio, int | float) and ratio > 0:
                host += int(hbm * ratio) * ranks
    return FleetKv(page_size=page or 1, capacity_tokens=cap, host_capacity_tokens=host)


# ---- the driver ------------------------------------------------------------------------------------


def rendered_turns(spec: SessionSpec, token_unit: int) -> Iterator[tuple[Conversation, bool]]:
    """Each turn of one chain as the driver renders it: its conversation (the messages it sends) and
    whether it continues the previous turn's. Pure: the parity tests hold the simulator's inputs to it."""
    inputs = turn_inputs(spec)
    overlaps = turn_overlaps(spec)
    starts = conversation_starts(spec)
    shared_model = int(spec.shared_prefix_tokens)
    conv: Conversation | None = None
    for k in range(len(spec.turns)):
        continuation = conv is not None and starts[k] != k
        if conv is None or not continuation:
            # a new context (first turn, compaction): shared prefix + new text
            conv = Conversation(key=f"{spec.session_id}~{k}", shared_prefix_tokens=shared_model, token_unit=token_unit)
            conv.add(max(inputs[k] - shared_model, 1))
        else:
            # the previous turn's context up to where this one departs from it (the trace may
            # rewrite its tail), then what is new: the previous reply, tool results, user text
            conv.truncate(overlaps[k] - shared_model)
            conv.add(max(inputs[k] - shared_model - conv.history_model_tokens, 0))
        yield conv, continuation


# route reasons of a request that leaves its session's home for itself only: the binding stays
# (rule 8's spill, an overflow or a conversation followed to one, a retry, a pinned request)
_AWAY_REASONS: frozenset[str] = frozenset({Reason.QUEUE_SPILL, Reason.THICC_SPLIT, Reason.RETRY, Reason.PINNED})
# the reasons of kvroute's baselines, which bind no session
_UNBOUND_REASONS: frozenset[str] = frozenset({Reason.RANDOM, Reason.ROUND_ROBIN, Reason.LEAST_LOADED, Reason.HASH})


class HomeChanges:
    """Counts session moves from the responses, as the simulator counts them
    (``loadtests.sim.run``'s ``_count_move``). A router that names its reason (kvroute's
    ``X-Kvroute-Reason``) binds sessions: a move is a change of home, and a request away from home
    for itself only (``_AWAY_REASONS``) is none, nor is the turn that comes back after it. A router
    that binds none (no reason named, or a baseline's): a move is the main conversation's request
    on another replica than its last."""

    def __init__(self) -> None:
        self._home: dict[str, str] = {}

    def moved(self, sid: str, replica: str, *, main: bool, reason: str | None) -> bool:
        if reason in _AWAY_REASONS or (not main and (reason is None or reason in _UNBOUND_REASONS)):
            return False
        prev = self._home.get(sid)
        self._home[sid] = replica
        return prev is not None and prev != replica


class _Run:
    def __init__(
        self,
        config: LoadConfig,
        session: aiohttp.ClientSession,
        stats: LiveStats,
        kv: FleetKv,
    ) -> None:
        self.c = config
        self.http = session
        self.stats = stats
        self.t0 = time.monotonic()
        self.deadline = self.t0 + config.duration_s
        self.outcomes: list[Outcome] = []
        self.stopping = asyncio.Event()
        self.ideal = InfiniteCache(kv.page_size)
        # no capacity known (no replica answered /server_info): no pooled figure
        self.pooled = (
            PooledCache(kv.capacity_tokens, kv.page_size, kv.host_capacity_tokens) if kv.capacity_tokens else None
        )
        # the replicas report their KV in their own tokens and the pool counts the driver's (4 bytes
        # each): equal on the emulator, not on a real engine's tokenizer. The pool is sized by the
        # ratio the engines' usage shows (engine prompt tokens per driver prompt token, so far)
        self.kv = kv
        self.engine_prompt_tokens = 0
        self.driver_prompt_tokens = 0
        self.pool_ratio = 1.0
        self.tasks: list[asyncio.Task[None]] = []
        self.last_replica: dict[str, str] = {}
        self.homes = HomeChanges()
        self.move_times: list[float] = []  # modelled t of each session home change
        self.lanes_spent_at: list[float] = []  # modelled t at which each lane ran out of sessions
        self.issued = 0
        self._urls = [u.rstrip("/") + API_PATHS[config.api] for u in (config.url, *config.extra_urls)]

    def modelled_now(self) -> float:
        return (time.monotonic() - self.t0) / self.c.time_scale

    def may_issue(self) -> bool:
        if self.stopping.is_set() or time.monotonic() >= self.deadline:
            self.stopping.set()
            return False
        if self.c.max_requests is not None and self.issued >= self.c.max_requests:
            self.stopping.set()
            return False
        return True

    async def sleep_modelled(self, modelled_s: float) -> bool:
        """Sleep; False if the run ends first."""
        wall = max(modelled_s, 0.0) * self.c.time_scale
        remaining = self.deadline - time.monotonic()
        if wall >= remaining:
            await asyncio.sleep(max(remaining, 0.0))
            self.stopping.set()
            return False
        if wall > 0:
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=wall)
                return False
            except TimeoutError:
                pass
        return not self.stopping.is_set()

    def spawn(self, spec: SessionSpec, delay_modelled_s: float) -> None:
        self.tasks.append(asyncio.create_task(self.chain(spec, delay_modelled_s)))

    async def lane(self, specs: Sequence[SessionSpec]) -> None:
        """Sessions back to back (AgentX ``--concurrency`` semantics): the first at its ``start_s``,
        each next one as soon as the previous session's main chain ends."""
        for i, spec in enumerate(specs):
            if self.stopping.is_set():
                return
            await self.chain(spec, float(spec.start_s) - self.modelled_now() if i == 0 else 0.0)
        if not self.stopping.is_set():
            self.lanes_spent_at.append(self.modelled_now())

    async def chain(self, spec: SessionSpec, delay_modelled_s: float) -> None:
        """Run one chain (a session or a branch) closed-loop; branches spawn after their parent turn."""
        c = self.c
        if not await self.sleep_modelled(delay_modelled_s):
            return
        sid = str(spec.routing_key)
        rendered = rendered_turns(spec, c.token_unit)
        for k, turn in enumerate(spec.turns):
            if k > 0 and not await self.sleep_modelled(min(float(turn.think_s), c.max_think_modelled_s)):
                return
            if not self.may_issue():
                return
            conv, continuation = next(rendered)
            out = max(1, emulated_tokens(int(turn.output_tokens), c.token_unit))
            messages = conv.messages
            body = json.dumps(self._body(messages, out), separators=(",", ":")).encode()
            blocks, prompt_emul = self.ideal.blocks(messages, conv.key)
            main = spec.parent is None
            pooled = self.pooled.hit(blocks, prompt_emul) if self.pooled is not None else None
            ctx = (sid, self.ideal.hit(blocks, prompt_emul), prompt_emul, continuation, pooled)
            reqs = [self.request(body, ctx, side=False, main=main)]
            for _ in range(max(1, int(turn.parallel)) - 1):
                if not self.may_issue():
                    break
                reqs.append(self.request(body, ctx, side=True, main=False))
            await asyncio.gather(*reqs)
            self.ideal.insert(blocks)  # the next turn (of any session) may hit this prompt
            if self.pooled is not None:
                self.pooled.insert(blocks, stored_tokens=prompt_emul + out)  # the replica keeps the reply too
            for b in spec.branches:
                if int(b.spawn_after_turn) == k:
                    self.spawn(b, float(b.start_s))

    def _body(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        if self.c.api in ("messages", "responses"):
            system = "\n".join(m["content"] for m in messages if m["role"] == "system")
            rest = [m for m in messages if m["role"] != "system"]
            if self.c.api == "messages":
                doc: dict[str, Any] = {"model": self.c.model, "messages": rest, "max_tokens": max_tokens}
                if system:
                    doc["system"] = system
            else:
                # SGLang keeps two tokens of max_output_tokens for itself: ask for two more
                doc = {"model": self.c.model, "input": rest, "max_output_tokens": max_tokens + 2, "store": False}
                if system:
                    doc["instructions"] = system
            if self.c.stream:
                doc["stream"] = True
            return doc
        body: dict[str, Any] = {
            "model": self.c.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": self.c.stream,
        }
        if self.c.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def request(self, body: bytes, ctx: _Ctx, *, side: bool, main: bool) -> None:
        """Send one request; ``ctx`` = (session id, ideal cached and prompt emulated tokens,
        continuation, pooled cached emulated tokens or None)."""
        c = self.c
        sid = ctx[0]
        self.issued += 1
        self.stats.started += 1
        self.stats.in_flight += 1
        headers = {name: sid for name in c.session_headers}
        headers["Content-Type"] = "application/json"
        t_start = time.monotonic()
        ttft: float | None = None
        usage: dict[str, Any] | None = None
        replica: str | None = None
        reason: str | None = None
        status = 0
        error: str | None = None
        try:
            n = len(self._urls)
            url = self._urls[sticky_gateway(sid, n) if self.c.gateway_assign == "sticky" else self.issued % n]
            async with self.http.post(url, data=body, headers=headers) as resp:
                status = resp.status
                replica = next((resp.headers[h] for h in _REPLICA_HEADERS if h in resp.headers), None)
                reason = resp.headers.get("X-Kvroute-Reason")
                if status != 200:
                    error = (await resp.text())[:300]
                elif c.stream:
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        if ttft is None and not line.startswith(_BEFORE_FIRST_TOKEN):
                            ttft = time.monotonic() - t_start
                        # the Responses API's events carry "error":null until one fails
                        if b'"error"' in line and b'"choices"' not in line and b'"error":null' not in line:
                            error = line.decode(errors="replace")[:300]
                        elif b'"usage"' in line:
                            ev = json.loads(line[5:])
                            # Anthropic's message_start, the Responses API's last event
                            u = (ev.get("message") or ev.get("response") or ev).get("usage")
                            if isinstance(u, dict):
                                usage = _merged_usage(usage, u)
                else:
                    doc = await resp.json()
                    ttft = time.monotonic() - t_start
                    usage = _merged_usage(None, doc.get("usage") or {})
        except asyncio.CancelledError:
            self.stats.in_flight -= 1
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        e2e = time.monotonic() - t_start
        self.stats.in_flight -= 1
        self._record(ctx, replica, t_start, ttft, e2e, usage, status, error, side, main, reason)

    def _record(
        self,
        ctx: _Ctx,
        replica: str | None,
        t_start: float,
        ttft: float | None,
        e2e: float,
        usage: dict[str, Any] | None,
        status: int,
        error: str | None,
        side: bool,
        main: bool,
        reason: str | None,
    ) -> None:
        c, u = self.c, self.c.token_unit
        sid, ideal_emul, prompt_emul, continuation, pooled_emul = ctx
        ok = error is None and status == 200
        prompt = int((usage or {}).get("prompt_tokens") or prompt_emul)
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        output = int((usage or {}).get("completion_tokens") or 0)
        # ideal_emul / prompt_emul are in the emulator's tokens (loadtests.ideal): equal to the
        # replica's own count on an emulated replica, scaled to a real engine's count otherwise
        ideal = min(round(ideal_emul * prompt / prompt_emul) if prompt_emul > 0 else 0, prompt)
        if ok and usage and usage.get("prompt_tokens") and prompt_emul > 0:
            self._learn_token_ratio(prompt, prompt_emul)
        pooled: int | None = None
        if pooled_emul is not None:
            pooled = min(round(pooled_emul * prompt / prompt_emul) if prompt_emul > 0 else 0, prompt) * u
        brk: str | None = None
        prev = self.last_replica.get(sid)
        # an affinity break: a continuation whose cached tokens fall short of its previous context
        if ok and continuation and ideal > 0 and cached < c.break_tolerance * ideal:
            if side or not main and prev is not None and replica != prev:
                brk = "thicc_split"
            elif prev is not None and replica is not None and prev != replica:
                brk = "moved"
            else:
                brk = "evicted"
        if ok and replica is not None and self.homes.moved(sid, replica, main=main, reason=reason):
            self.move_times.append((t_start - self.t0) / c.time_scale)
        if ok and main and replica is not None:
            self.last_replica[sid] = replica
        t_rel = (t_start - self.t0) / c.time_scale
        out = Outcome(
            session_id=sid,
            replica=replica,
            t_start=t_rel,
            ttft_s=None if ttft is None else ttft / c.time_scale,
            e2e_s=e2e / c.time_scale,
            input_tokens=prompt * u,
            cached_tokens=cached * u,
            output_tokens=output * u,
            ideal_cached_tokens=ideal * u,
            pooled_cached_tokens=pooled if ok else 0,
            ok=ok,
            break_reason=brk,
            status=status,
            error=error,
            side=side,
            route_reason=reason,
        )
        self.outcomes.append(out)
        st = self.stats
        st.finished += 1
        if not ok:
            st.errors += 1
        elif t_start - self.t0 >= c.warmup_s:
            st.input_tokens += out.input_tokens
            st.cached_tokens += out.cached_tokens
            st.ideal_cached_tokens += out.ideal_cached_tokens
            if out.ttft_s is not None:
                st.ttfts.append(out.ttft_s)


    def _learn_token_ratio(self, engine_tokens: int, driver_tokens: int) -> None:
        """Resize the pool when the engines' tokens per driver token moved by more than 2 %."""
        self.engine_prompt_tokens += engine_tokens
        self.driver_prompt_tokens += driver_tokens
        ratio = self.engine_prompt_tokens / self.driver_prompt_tokens
        if self.pooled is not None and abs(ratio / self.pool_ratio - 1.0) > 0.02:
            self.pool_ratio = ratio
            self.pooled.resize(round(self.kv.capacity_tokens / ratio), round(self.kv.host_capacity_tokens / ratio))

    def token_ratio(self) -> float | None:
        if not self.driver_prompt_tokens:
            return None
        return round(self.engine_prompt_tokens / self.driver_prompt_tokens, 4)


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The model the fleet behind ``url`` serves (``/v1/models``): SGLang's Responses API refuses
    any other name, where its chat route takes any."""
    async with session.get(url.rstrip("/") + "/v1/models") as r:
        doc = await r.json(content_type=None)
        if r.status != 200 or not isinstance(doc, dict) or not doc.get("data"):
            raise RuntimeError(f"{url}/v1/models answered {r.status}: {str(doc)[:200]}")
    return str(doc["data"][0]["id"])


async def run_load(
    sessions: Sequence[SessionSpec],
    config: LoadConfig,
    *,
    stats: LiveStats | None = None,
    on_tick: Callable[[LiveStats], Awaitable[None] | None] | None = None,
) -> LoadResult:
    """Drive ``sessions`` (``SessionSpec``s) against ``config.url``; return measures and raw data."""
    stats = stats if stats is not None else LiveStats()
    connector = aiohttp.TCPConnector(limit=0, force_close=config.fresh_connections)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=10.0)
    samples: list[tuple[float, tuple[int, ...]]] = []
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as probe,
    ):
        sampler = LoadSampler(probe, config.replica_urls)
        stats.replica_names = await sampler.names()
        kv = await _fleet_kv(probe, config.replica_urls)
        if config.page_size:
            kv = FleetKv(config.page_size, kv.capacity_tokens, kv.host_capacity_tokens)
        if config.api == "responses" and config.model == "default":
            config = replace(config, model=await served_model(probe, config.url))
        run = _Run(config, http, stats, kv)

        async def sample_loop() -> None:
            next_t = time.monotonic()
            while True:
                loads = await sampler.sample() if config.replica_urls else ()
                now = time.monotonic()
                stats.elapsed_s = now - run.t0
                stats.last_loads = loads
                if loads and not run.stopping.is_set():
                    samples.append(((now - run.t0) / config.time_scale, loads))
                    if now - run.t0 >= config.warmup_s:
                        stats.add_loads(loads)
                if on_tick is not None:
                    r = on_tick(stats)
                    if r is not None:
                        await r
                next_t += config.sample_interval_s
                await asyncio.sleep(max(next_t - time.monotonic(), 0.0))

        sampler_task = asyncio.create_task(sample_loop())

        async def queue_at_warmup() -> EngineQueue | None:
            await asyncio.sleep(max(run.t0 + config.warmup_s - time.monotonic(), 0.0))
            return await _engine_queue(probe, config.replica_urls)

        queue_before = asyncio.create_task(queue_at_warmup())
        if config.lanes is None:
            for s in sessions:
                run.spawn(s, float(s.start_s))
        else:
            for i in range(min(config.lanes, len(sessions))):
                run.tasks.append(asyncio.create_task(run.lane(sessions[i :: config.lanes])))
            run.lanes_spent_at.extend([0.0] * (config.lanes - len(run.tasks)))  # lanes with no session at all
        censored = 0

        async def all_done() -> None:
            while pending := [t for t in run.tasks if not t.done()]:
                await asyncio.wait(pending)

        done_all = asyncio.create_task(all_done())
        stop_wait = asyncio.create_task(run.stopping.wait())
        try:
            await asyncio.wait(
                [done_all, stop_wait],
                timeout=max(run.deadline - time.monotonic(), 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            run.stopping.set()
            if not done_all.done():
                # stopped: requests already in flight get drain_s to finish
                try:
                    await asyncio.wait_for(asyncio.shield(done_all), timeout=config.drain_s)
                except TimeoutError:
                    censored = stats.in_flight
        finally:
            # on cancellation too: nothing of this run outlives it
            helpers = [sampler_task, done_all, stop_wait]
            for t in [*helpers, *run.tasks]:
                t.cancel()
            await asyncio.gather(*helpers, *run.tasks, return_exceptions=True)
            queue_before.cancel()  # a no-op once it has its answer
        wall = time.monotonic() - run.t0
        if queue_before.done() and not queue_before.cancelled():
            queue = (queue_before.result(), await _engine_queue(probe, config.replica_urls))
        else:  # the run ended before its warm-up did: nothing measured
            queue = (None, None)
    measures = _measures(run, samples, config, wall, censored, queue)
    return LoadResult(
        measures=measures,
        outcomes=tuple(run.outcomes),
        load_samples=tuple(samples),
        replica_names=stats.replica_names,
    )


def _measures(
    run: _Run,
    samples: Sequence[tuple[float, tuple[int, ...]]],
    config: LoadConfig,
    wall_s: float,
    censored: int,
    queue: tuple[EngineQueue | None, EngineQueue | None] = (None, None),
) -> dict[str, Any]:
    from loadtests.measures import MeasureCollector, RequestRecord

    warm_modelled = config.warmup_s / config.time_scale
    end_modelled = min(wall_s, config.duration_s) / config.time_scale
    col = MeasureCollector(
        warmup_s=warm_modelled, end_s=end_modelled, replicas=max(len(config.replica_urls), 1), lanes=config.lanes
    )
    for t in run.lanes_spent_at:
        col.lane_spent(t)
    profile = config.floor_profile
    for o in run.outcomes:
        e2e = o.e2e_s if o.e2e_s is not None else math.nan
        floor = None
        if o.ok and profile is not None and o.pooled_cached_tokens is not None:
            floor = alone_ttft_s(profile, o.input_tokens, o.pooled_cached_tokens)
        col.add(
            RequestRecord(
                session_id=o.session_id,
                replica=o.replica,
                t_start=o.t_start,
                ttft_s=o.ttft_s if o.ttft_s is not None else e2e,
                e2e_s=e2e,
                input_tokens=o.input_tokens,
                cached_tokens=o.cached_tokens,
                output_tokens=o.output_tokens,
                ideal_cached_tokens=o.ideal_cached_tokens,
                ok=o.ok,
                break_reason=o.break_reason,
                pooled_cached_tokens=o.pooled_cached_tokens,
                route_reason=o.route_reason,
                floor_ttft_s=floor,
            )
        )
    for t, loads in samples:
        col.sample(t, loads)
    for t in run.move_times:
        col.session_moved(t)
    col.set_engine_queue(*queue)
    # the collector's window ([warm-up, end)): requests started while the run drained are in neither
    # figure, else error_kinds counted more failures than "errors" did
    window = [o for o in run.outcomes if warm_modelled <= o.t_start < end_modelled]
    reasons = Counter(o.route_reason for o in window if o.route_reason)
    errors = Counter(_error_kind(o) for o in window if not o.ok)
    m = dict(col.result())
    m.update(
        {
            "time_unit": "modelled_s",
            "time_scale": config.time_scale,
            "token_unit": config.token_unit,
            "token_count_unit": "model_tokens",
            "wall_s": round(wall_s, 3),
            "warmup_modelled_s": warm_modelled,
            "censored": censored,
            "load_source": "replicas",
            "gateways": 1 + len(config.extra_urls),
            "gateway_assign": config.gateway_assign,
            "fresh_connections": config.fresh_connections,
            "route_reasons": dict(sorted(reasons.items())),  # X-Kvroute-Reason counts (kvroute only)
            # the engines' prompt tokens per driver token (1 on the emulator): the pool's scale
            "engine_tokens_per_driver_token": run.token_ratio(),
            "error_kinds": dict(sorted(errors.items())),
        }
    )
    return m


def _error_kind(o: Outcome) -> str:
    if o.status and o.status != 200:
        return f"http_{o.status}"
    return (o.error or "unknown").split(":", 1)[0][:60]


# ---- CLI ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="OpenAI-compatible base URL (kvroute, a peer, a replica)")
    p.add_argument("--replica-url", action="append", default=[], help="replica to sample load from (repeat)")
    p.add_argument("--workload", choices=["synthetic", "weka", "mooncake"], default="synthetic")
    p.add_argument("--trace", type=Path, help="trace path for weka/mooncake")
    p.add_argument("--sessions", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="default")
    p.add_argument("--duration", type=float, default=60.0, help="wall seconds of load")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--lanes", type=int, help="keep this many sessions alive (run the workload's sessions back to back)")
    p.add_argument("--warmup", type=float, default=0.0, help="wall seconds excluded from measures")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall = modelled x this (match the replicas)")
    p.add_argument("--token-unit", type=int, default=1, help="model tokens per emulated token (match replicas)")
    p.add_argument("--sample-interval", type=float, default=0.25, help="wall seconds between load samples")
    p.add_argument("--fresh-connections", action="store_true", help="new TCP connection per request")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--api", choices=list(API_PATHS), default="chat",
                   help="chat completions, Anthropic's Messages API (/v1/messages, as Claude Code) or OpenAI's "
                   "Responses API (/v1/responses, as Codex)")
    p.add_argument(
        "--no-session-id", action="store_true",
        help="send no session header (as a plain OpenAI client): the router keys on the prompt",
    )
    p.add_argument("--max-think", type=float, default=120.0, help="cap on one think time, modelled s")
    p.add_argument(
        "--page-size", type=int,
        help="the replicas' KV page size in emulated tokens, for the ideal hit (default: the first replica's "
        "/server_info, else 1)",
    )
    p.add_argument("--json", type=Path, help="write the measures here")
    p.add_argument("--no-progress", action="store_true")
    return p


def load_workload(kind: str, trace: Path | None, sessions: int, seed: int) -> list[SessionSpec]:
    """Sessions for ``kind`` (synthetic from ``SyntheticParams``; traces from ``trace`` or the default)."""
    from loadtests import workloads as w

    if kind == "synthetic":
        params = w.SyntheticParams(sessions=sessions)
        return list(w.synthetic_sessions(params, random.Random(seed)))
    if kind == "weka":
        path = trace or w.DEFAULT_WEKA_TRACE
        return list(w.read_weka(path, limit=sessions))
    path = trace or w.DEFAULT_MOONCAKE_TRACE
    return list(w.read_mooncake(path))[:sessions]


def _merged_usage(have: dict[str, Any] | None, u: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage as it is; the Responses API's (``input_tokens`` is the whole prompt) and
    Anthropic's (Messages API: the input in ``message_start``, the output in ``message_delta``)
    merged into OpenAI's keys."""
    if "input_tokens" not in u and "output_tokens" not in u:
        return u
    out = dict(have or {})
    details = u.get("input_tokens_details")
    if isinstance(details, dict):
        out["prompt_tokens"] = int(u.get("input_tokens") or 0)
        out["prompt_tokens_details"] = {"cached_tokens": int(details.get("cached_tokens") or 0)}
    elif "input_tokens" in u:
        cached = int(u.get("cache_read_input_tokens") or 0)
        out["prompt_tokens"] = int(u["input_tokens"]) + cached
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    if u.get("output_tokens"):
        out["completion_tokens"] = int(u["output_tokens"])
    return out


async def _amain(ns: argparse.Namespace) -> int:
    sessions = load_workload(ns.workload, ns.trace, ns.sessions, ns.seed)
    config = LoadConfig(
        url=ns.url,
        replica_urls=tuple(ns.replica_url),
        model=ns.model,
        time_scale=ns.time_scale,
        token_unit=ns.token_unit,
        duration_s=ns.duration,
        max_requests=ns.max_requests,
        lanes=ns.lanes,
        warmup_s=ns.warmup,
        sample_interval_s=ns.sample_interval,
        fresh_connections=ns.fresh_connections,
        max_think_modelled_s=ns.max_think,
        stream=not ns.no_stream,
        api=ns.api,
        page_size=ns.page_size,
        session_headers=() if ns.no_session_id else DEFAULT_SESSION_HEADERS,
    )
    show = not ns.no_progress and sys.stderr.isatty()
    if show:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("[bold]load"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        task = progress.add_task("load", total=config.duration_s, info="")

        def tick(st: LiveStats) -> None:
            progress.update(
                task,
                completed=min(st.elapsed_s, config.duration_s),
                info=f"req {st.finished} err {st.errors} chr {st.chr:.3f} "
                f"disp {st.dispersion:.2f} ttft p99 {st.ttft_quantile(0.99):.2f}s",
            )

        with progress:
            result = await run_load(sessions, config, on_tick=tick)
    else:
        result = await run_load(sessions, config)
    text = json.dumps(result.measures, indent=2, sort_keys=True)
    if ns.json:
        ns.json.write_text(text + "\n")
    print(text)
    sent, failed = result.measures["requests"], result.measures["errors"]
    if sent and failed == sent:  # a wrong URL or a dead fleet is not a measurement
        kinds = ", ".join(f"{k} {n}" for k, n in result.measures["error_kinds"].items())
        print(f"kvroute load: every request failed ({failed}: {kinds})", file=sys.stderr)
        return 1
    return 0


def cli_main(argv: list[str]) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    if not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?/?", ns.url):
        parser.error(f"--url: expected http://host:port, got {ns.url!r}")
    if ns.sessions < 1:
        parser.error("--sessions must be >= 1")
    if ns.json is not None and not ns.json.parent.is_dir():
        parser.error(f"--json: no such directory: {ns.json.parent}")
    try:
        return run_on_loop(_amain(ns), os.environ)
    except (ValueError, OSError) as exc:  # a bad setting (LoadConfig) or an unreadable trace
        print(f"kvroute load: {exc}", file=sys.stderr)
        return 2

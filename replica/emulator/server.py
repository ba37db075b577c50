"""The emulator's HTTP shell: an aiohttp app that looks like one SGLang 0.5.23 server.

The pure engine (``timemodel.ReplicaEngine`` over ``cache.PrefixCache``) decides *what happens
when* in modelled seconds; this shell maps modelled time to wall time (wall = modelled x
``time_scale``), feeds requests in, and turns engine events into SGLang's HTTP bytes.

Rule 1: one background task per replica sleeps until the engine's next event; handlers also
        ``poll()`` the engine before reading it, so nobody depends on the task's timing.
Rule 2: everything a replica reports about itself (``e2e_latency``, histograms, throughput) is
        in modelled seconds, as the emulated replica would see it.
Rule 3: a request whose client goes away (or whose handler ends early for any reason) is
        aborted in the engine, freeing its slot and KV.
Rule 4: SSE bytes are ``b"data: " + compact JSON + b"\\n\\n"``, ending with ``data: [DONE]``.
        Chunks follow decode steps (``stream_interval`` tokens each, default 1 step's worth),
        coalesced to at most one per ``min_chunk_interval_s`` of wall time. (``/v1/messages``
        frames Anthropic's events instead: ``anthropic.sse_event``, no ``[DONE]``; ``/v1/responses``
        OpenAI's Responses events: ``responses.EventStream``, no ``[DONE]``.)

Test hooks (not part of SGLang): ``POST/GET/DELETE /_emulator/faults`` and ``GET
/_emulator/state`` (see docs/EMULATOR.md); every response carries ``X-Emulator-Replica``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

import mmh3
from aiohttp import web

from replica.emulator import anthropic, responses
from replica.emulator.cache import PrefixCache
from replica.emulator.kv_events import KvEventRecorder, KvEventsConfig, KvEventsPublisher
from replica.emulator.kv_events import Source as KvSource
from replica.emulator.metrics import CONTENT_TYPE, ReplicaMetrics
from replica.emulator.profiles import Profile
from replica.emulator.sessions import Continuation, SessionError, SessionParams, SessionTable
from replica.emulator.timemodel import EngineLoad, EngineRequest, Finished, FirstToken, ReplicaEngine, Started
from replica.emulator.tokenizer import (
    BYTES_PER_TOKEN,
    ChainMemo,
    Prompt,
    block_hashes,
    decode_ids,
    encode_ids,
    encode_text,
    output_text,
    render_chat,
    salt_seed,
    token_ids,
)

__all__ = ["REPLICA_KEY", "EmulatorConfig", "Faults", "Replica", "make_emulator_app"]

SGLANG_VERSION = "0.5.23"
DP_RANK_HEADER = "X-Data-Parallel-Rank"
EOS_TOKEN_ID = 163586
SAMPLING_PARAMS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
    "choice",
)
_SAMPLING_SET = frozenset(SAMPLING_PARAMS)


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """One replica's settings.

    time_scale: wall seconds per modelled second (0.01 = 100x faster than the modelled GPU).
    default_max_tokens: output length when a request names none (then ``finish_reason`` is
        ``stop``; with an explicit max it is always ``length``: the emulator never stops early).
    get_load_format: what the removed ``/get_load`` answers: ``off`` (404, as SGLang 0.5.23 does;
        the default), ``sglang`` (older 0.5.x array, what sglang-router's power_of_two polls) or
        ``vllm`` (``{"load": N}``).
    startup_delay_s: ``/health`` answers 503 this long (wall) after start.
    dp_size: SGLang's ``--dp-size``: that many schedulers behind the one port, each with the
        profile's engine and KV pool (on GPUs each rank has devices of its own), its own KV-event
        publisher (port + rank), its own ``/v1/loads`` entry and ``dp_rank`` metric labels.
    enable_response_store: SGLang's ``--enable-response-store``: ``/v1/responses`` keeps responses
        in memory (``previous_response_id``, ``background``, GET and cancel of a stored response;
        ``responses.py`` Rule 3); off, they are refused as SGLang refuses them by default.
    """

    name: str = "replica-0"
    profile: Profile = field(default_factory=Profile)
    served_model_name: str | None = None
    time_scale: float = 1.0
    host: str = "127.0.0.1"
    port: int = 0
    stream_interval: int = 0  # tokens per chunk; 0 = one chunk per decode step
    min_chunk_interval_s: float = 0.002
    enable_cache_report: bool = True
    stream_response_default_include_usage: bool = False
    incremental_streaming_output: bool = False
    default_max_tokens: int = 128
    get_load_format: str = "off"
    startup_delay_s: float = 0.0
    api_key: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    kv_events_config: str | None = None  # SGLang's --kv-events-config JSON (replica/emulator/kv_events.py)
    enable_response_store: bool = False
    dp_size: int = 1  # SGLang's --dp-size: schedulers behind one port, each a profile's engine and cache

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not 1 <= self.dp_size <= 64:
            raise ValueError("dp_size must be 1-64")
        if self.get_load_format not in {"sglang", "vllm", "off"}:
            raise ValueError("get_load_format must be sglang, vllm or off")
        if self.stream_interval < 0 or self.default_max_tokens < 0 or self.min_chunk_interval_s < 0:
            raise ValueError("stream_interval, default_max_tokens, min_chunk_interval_s must be >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.profile.model_name

    @property
    def token_unit(self) -> int:
        return self.profile.token_unit

    @property
    def page_size(self) -> int:
        return self.profile.page_size


@dataclass(slots=True)
class Faults:
    """Fault injection for gateway tests. ``count`` = apply to the next N data-plane requests."""

    status: int | None = None  # data-plane requests answer this status (SGLang-shaped error)
    health_status: int | None = None  # /health and /health_generate answer this status
    hang: bool = False  # data-plane requests never answer (until the client goes away)
    break_after_chunks: int | None = None  # streams are cut (connection closed) after N chunks
    slow_factor: float = 1.0  # modelled time runs this many times slower on the wall clock
    delay_s: float = 0.0  # wall delay before a data-plane request is handled
    count: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _ClientGone(Exception):
    pass


class _ClientError(Exception):
    """Bad input. ``plain``: SGLang's schema gate answers ``{"error": "<text>"}`` (a bare string).

    ``stage`` says where SGLang 0.5.23 finds the error, which decides how a *streamed* request
    learns of it (unstreamed: always the status with an error body):

    * ``None``: before the response starts (the schema gate, the serving layer's own checks): the
      status, for streams too;
    * ``"validation"``: FastAPI's request validation (bad JSON, a missing or mistyped field):
      400 ``{"object": "error", ..., "type": "Bad Request"}`` on every route, ``/generate`` too;
    * ``"tokenizer"``: in the tokenizer manager (context checks, bad sampling values): ``/generate``
      has already answered 200 ``text/event-stream`` and sends one ``data: {"error": ...}`` event and
      ``[DONE]``; the OpenAI routes still answer the status;
    * ``"scheduler"``: refused by the scheduler (input over ``max_req_input_len``): every route's
      stream is 200 and carries the refusal in-stream (``_scheduler_refusal_stream``).
    """

    def __init__(
        self, message: str, status: int = 400, plain: bool = False, stage: str | None = None,
        type_: str = "BadRequestError",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.plain = plain
        self.stage = stage
        self.type_ = type_  # the OpenAI routes' error ``type``


@dataclass(slots=True)
class _Parsed:
    rid: str
    prompt: Prompt
    max_tokens: int
    explicit_max: bool
    stream: bool
    include_usage: bool
    salt: int
    routing_key: str | None
    session_id: str | None
    # ``n`` as the client sent it (SGLang's usage sums step over choices by it); the engine runs
    # ``max(1, n)`` sequences
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # an engine-session request (``session_params``): where it goes in its session
    continuation: Continuation | None = None
    dp_rank: int | None = None  # the rank it named (``routed_dp_rank``, ``X-Data-Parallel-Rank``)


class _Flight:
    __slots__ = (
        "cached_device", "cached_host", "done", "dp_rank", "finished", "first", "first_t", "is_health", "n_out",
        "prompt",
        "rid", "session", "stream", "submit_model",
    )

    def __init__(self, rid: str, prompt: Prompt, n_out: int, stream: bool, submit_model: float) -> None:
        self.rid = rid
        self.prompt = prompt
        self.n_out = n_out
        self.stream = stream
        self.submit_model = submit_model
        self.cached_device = 0
        self.cached_host = 0
        self.first_t: float | None = None
        self.finished: Finished | None = None
        self.first = asyncio.Event()
        self.done = asyncio.Event()
        self.is_health = False
        self.session: str | None = None  # the engine session it belongs to (``session_params``)
        self.dp_rank = 0  # the scheduler running it

    @property
    def cached(self) -> int:
        return self.cached_device + self.cached_host


class _Rank:
    """One data-parallel scheduler of the replica: a radix cache, an engine over it, and with KV
    events a recorder and a publisher (at ``endpoint`` port + ``dp_rank``, as SGLang's)."""

    __slots__ = ("cache", "dp_rank", "engine", "kv_publisher", "kv_recorder")

    def __init__(self, prof: Profile, dp_rank: int, kv_config: KvEventsConfig | None) -> None:
        self.dp_rank = dp_rank
        self.kv_recorder = KvEventRecorder(prof.page_size) if kv_config is not None and kv_config.enabled else None
        self.kv_publisher: KvEventsPublisher | None = None
        self.cache = PrefixCache(
            prof.capacity_tokens,
            prof.page_size,
            prof.host_tokens,
            evict_whole_nodes=prof.evict_whole_nodes,
            listener=self.kv_recorder,
        )
        self.engine = ReplicaEngine(prof, self.cache)

    def publish_kv_events(self) -> None:
        if self.kv_recorder is not None and self.kv_publisher is not None:
            self.kv_publisher.publish(self.kv_recorder.take())


class Replica:
    """One emulated replica: ``dp_size`` schedulers (``_Rank``: engine + cache each) behind one
    model clock, in-flight requests, metrics and faults.

    Without a rank named (``routed_dp_rank``, ``X-Data-Parallel-Rank``) a request goes to the
    next rank round robin, SGLang's default ``--load-balance-method``; health checks keep a round
    robin of their own, as SGLang's DataParallelController does.
    """

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        prof = config.profile
        # KV events (SGLang's --kv-events-config): each rank's cache queues them, poll() publishes
        self.kv_config = None if config.kv_events_config is None else KvEventsConfig.from_cli(config.kv_events_config)
        if self.kv_config is not None:
            self.kv_config.check_ranks(config.dp_size)
        self.ranks = [_Rank(prof, r, self.kv_config) for r in range(config.dp_size)]
        self.metrics = ReplicaMetrics(
            config.model_name, [r.engine.load for r in self.ranks], prof.host_tokens > 0, prof.tp_size
        )
        self.faults = Faults()
        self.chains = ChainMemo()
        self.flights: dict[str, _Flight] = {}
        self.served = 0
        self.sessions: set[str] = set()  # session ids / routing keys seen (a statistic)
        self.engine_sessions = SessionTable()  # SGLang's /open_session sessions
        self.responses = responses.ResponseStore()  # /v1/responses with --enable-response-store
        self.background: dict[str, asyncio.Task[None]] = {}  # background Responses runs by response id
        self.status = "starting"
        self.started_wall = time.monotonic()
        self.startup_time = time.time()
        self._scale = config.time_scale
        self._anchor_wall = time.monotonic()
        self._anchor_model = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._round_robin = 0
        self._health_round_robin = 0

    # rank 0's parts (the only rank unless ``dp_size`` > 1), for callers that know one rank
    @property
    def engine(self) -> ReplicaEngine:
        return self.ranks[0].engine

    @property
    def cache(self) -> PrefixCache:
        return self.ranks[0].cache

    @property
    def kv_publisher(self) -> KvEventsPublisher | None:
        return self.ranks[0].kv_publisher

    # ---- model clock ---------------------------------------------------------------------
    def model_now(self) -> float:
        return self._anchor_model + (time.monotonic() - self._anchor_wall) / self._scale

    def wall_delay(self, model_t: float) -> float:
        return max(0.0, (model_t - self.model_now()) * self._scale)

    def set_slow_factor(self, factor: float) -> None:
        now_model = self.model_now()
        self._anchor_wall = time.monotonic()
        self._anchor_model = now_model
        self._scale = self.config.time_scale * factor
        self._wake.set()

    # ---- engine driving ------------------------------------------------------------------
    def poll(self) -> None:
        now = self.model_now()
        for rank in self.ranks:
            evs = rank.engine.advance(now)
            rank.publish_kv_events()
            for ev in evs:
                fl = self.flights.get(ev.rid)
                if fl is None:
                    continue
                if isinstance(ev, Started):
                    fl.cached_device, fl.cached_host = ev.cached_device, ev.cached_host
                    if not fl.is_health:
                        self.metrics.queue_time[rank.dp_rank].observe(ev.t - fl.submit_model)
                elif isinstance(ev, FirstToken):
                    fl.first_t = ev.t
                    fl.first.set()
                elif isinstance(ev, Finished):
                    self._finish(fl, ev)

    def _output_bytes(self, fl: _Flight, tokens: int) -> bytes:
        """The first ``tokens`` output tokens of ``fl`` as the client sees them (4 bytes a token)."""
        return output_text(fl.n_out, _text_seed(fl.rid)).encode()[: tokens * BYTES_PER_TOKEN]

    def publish_kv_events(self) -> None:
        """One batch per rank with what its cache reported since the last one."""
        for rank in self.ranks:
            rank.publish_kv_events()

    def _finish(self, fl: _Flight, ev: Finished) -> None:
        fl.finished = ev
        fl.first.set()
        fl.done.set()
        del self.flights[fl.rid]
        self.ranks[fl.dp_rank].engine.forget(fl.rid)
        if fl.session is not None:  # its output is now history a later request can continue
            self.engine_sessions.finish(fl.session, fl.rid, self._output_bytes(fl, ev.completion_tokens))
        if fl.is_health:
            return
        m = self.metrics
        s = "true" if fl.stream else "false"
        if ev.reason == "abort":
            m.aborted += 1
            return
        self.served += 1
        m.num_requests[s] += 1
        m.prompt_tokens[s] += fl.prompt.num_tokens
        m.generation_tokens[s] += ev.completion_tokens
        m.cached_tokens["device"] += fl.cached_device
        m.cached_tokens["host"] += fl.cached_host
        if fl.first_t is not None:
            m.ttft[s].observe(fl.first_t - fl.submit_model)
        m.e2e[s].observe(ev.t - fl.submit_model)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.poll()
            times = [t for r in self.ranks if (t := r.engine.next_event_time()) is not None]
            self._wake.clear()
            handle = loop.call_later(self.wall_delay(min(times)), self._wake.set) if times else None
            try:
                await self._wake.wait()
            finally:
                if handle is not None:
                    handle.cancel()

    def start(self) -> None:
        if self.kv_config is not None and self.kv_config.enabled:
            for rank in self.ranks:
                rank.kv_publisher = KvEventsPublisher(self.kv_config, rank.dp_rank)
                rank.kv_publisher.start()
                rank.publish_kv_events()  # the cache's creation: AllBlocksCleared is sequence 0, as in SGLang
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"emulator-{self.config.name}")
        self.status = "ready"

    async def stop(self) -> None:
        self.status = "stopping"
        for rid in list(self.flights):
            self.abort(rid)
        tasks = list(self.background.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for rank in self.ranks:
            if rank.kv_publisher is not None:
                rank.publish_kv_events()
                await rank.kv_publisher.close()
                rank.kv_publisher = None

    def rank_for(self, dp_rank: int | None, is_health: bool = False) -> _Rank:
        """The rank a request named, else the next one round robin (SGLang's DataParallelController)."""
        n = len(self.ranks)
        if dp_rank is not None:  # the parsers refused one out of range and ignore 0 without DP (_routed_dp_rank)
            return self.ranks[dp_rank]
        if is_health:
            i, self._health_round_robin = self._health_round_robin, (self._health_round_robin + 1) % n
        else:
            i, self._round_robin = self._round_robin, (self._round_robin + 1) % n
        return self.ranks[i]

    def submit(self, parsed: _Parsed, stream: bool, is_health: bool = False) -> _Flight:
        prof = self.config.profile
        prompt = parsed.prompt
        n_out = parsed.max_tokens
        cont = parsed.continuation
        memo_key = parsed.session_id or parsed.routing_key or (cont.session_id if cont is not None else None)
        hashes = self.chains.hashes(prompt, prof.page_size, parsed.salt, memo_key)
        extra: list[int] = []
        step = prof.page_size * BYTES_PER_TOKEN
        raw = prompt.raw
        b0 = len(raw) // step
        tail = b""
        # SGLang caches the output but its last token, whose KV was never computed
        if n_out > 1 and (len(raw) + (n_out - 1) * BYTES_PER_TOKEN) // step > b0 and b0 == len(hashes):
            tail = raw[b0 * step :] + output_text(n_out - 1, _text_seed(parsed.rid)).encode()
            extra = block_hashes(tail, prof.page_size, prev_hash=hashes[b0 - 1] if b0 else None,
                                 seed=parsed.salt)
        now = self.model_now()
        fl = _Flight(parsed.rid, prompt, n_out, stream, now)
        fl.is_health = is_health
        if parsed.rid in self.flights:
            raise _ClientError(f"Duplicate request ID {parsed.rid}")
        rank = self.rank_for(parsed.dp_rank, is_health)
        fl.dp_rank = rank.dp_rank
        owner = None
        if rank.kv_recorder is not None:  # the tokens of the blocks it may store, for the events
            owner = KvSource(raw[: b0 * step] + tail if extra else prompt.data, parsed.session_id)
        try:
            rank.engine.submit(EngineRequest(parsed.rid, prompt.num_tokens, hashes, n_out, extra, owner), now)
        except ValueError as exc:
            raise _ClientError(str(exc)) from None
        self.flights[parsed.rid] = fl
        if cont is not None and not is_health:
            fl.session = cont.session_id
            self.engine_sessions.add(cont, parsed.rid)
        if parsed.session_id:
            self.sessions.add(parsed.session_id)
        elif parsed.routing_key:
            self.sessions.add(parsed.routing_key)
        self._wake.set()
        return fl

    def abort(self, rid: str) -> bool:
        fl = self.flights.get(rid)  # an unknown id is in no rank's engine either
        ok = fl is not None and self.ranks[fl.dp_rank].engine.abort(rid, self.model_now())
        self.poll()
        self._wake.set()
        return ok

    def state(self) -> dict[str, Any]:
        self.poll()
        self.engine_sessions.reap(self.model_now())
        loads = [r.engine.load() for r in self.ranks]
        ranks = []
        for r, load in zip(self.ranks, loads, strict=True):
            st = r.cache.stats()
            ranks.append({
                "dp_rank": r.dp_rank,
                "load": dataclasses.asdict(load),
                "cache": {**dataclasses.asdict(st), "hit_rate": st.hit_rate},
                "kv_events": None if r.kv_publisher is None else {
                    **r.kv_publisher.stats(), "recorder_blocks": r.kv_recorder.blocks if r.kv_recorder else 0,
                },
            })
        running, queued = sum(x.running for x in loads), sum(x.queued for x in loads)
        return {
            "name": self.config.name,
            "status": self.status,
            "model": self.config.model_name,
            "profile": self.config.profile.name,
            "time_scale": self.config.time_scale,
            "token_unit": self.config.token_unit,
            "model_time": self.model_now(),
            "dp_size": len(self.ranks),
            "running": running,
            "queued": queued,
            "in_flight": running + queued,
            "requests_served": self.served,
            "requests_aborted": self.metrics.aborted,
            "sessions_seen": len(self.sessions),
            "engine_sessions_open": len(self.engine_sessions),
            "cpu_s": time.process_time(),  # this process's CPU (all replicas in it): for `kvroute bench emulator`
            # one rank: its load, cache and events at the top level, as before ranks were modelled
            **({k: v for k, v in ranks[0].items() if k != "dp_rank"} if len(ranks) == 1 else {}),
            "ranks": ranks,
            "faults": self.faults.to_json(),
        }


def _text_seed(rid: str) -> int:
    return mmh3.hash(rid.encode(), signed=False) & 0xFFFF


# ---- fake log-probabilities ---------------------------------------------------------------------
# There is no model: values are deterministic per (sequence id, position, rank) and negative, the
# alternatives sorted best first; tokens are the emulated output's own 4-byte tokens (alternatives:
# tokens of the same filler text), so token strings agree with the text sent.

_TokenLogprob = tuple[str, int, float, list[tuple[str, int, float]]]  # token, id, logprob, top


def _fake_logprob(rid: str, i: int, rank: int) -> float:
    return -round(0.01 + (mmh3.hash(f"{rid}:{i}:{rank}", signed=False) % 1_000_000) / 100_000, 6)


def _token_id(tok: str) -> int:
    return int.from_bytes(tok.encode().ljust(BYTES_PER_TOKEN, b"\0")[:BYTES_PER_TOKEN], "little")


def _token_logprobs(rid: str, text: str, lo: int, hi: int, top: int) -> list[_TokenLogprob]:
    """Tokens ``lo``..``hi`` of ``text`` (4 bytes a token) with fake logprobs and ``top`` alternatives."""
    out: list[_TokenLogprob] = []
    for i in range(lo, hi):
        tok = text[i * BYTES_PER_TOKEN : (i + 1) * BYTES_PER_TOKEN]
        alts = sorted((_fake_logprob(rid, i, r) for r in range(1, top + 1)), reverse=True)
        # consecutive words of the wheel: distinct tokens, as an engine's top-k are (a completions
        # response keys them by token, so two alike would collapse into one)
        h = mmh3.hash(f"{rid}:{i}", signed=False)
        top_list = [(a := output_text(1, h + r), _token_id(a), lp) for r, lp in enumerate(alts, 1)]
        out.append((tok, _token_id(tok), _fake_logprob(rid, i, 0), top_list))
    return out


def _chat_logprobs(lps: list[_TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/chat/completions (OpenAI's shape, ``bytes`` = UTF-8 bytes)."""
    return {"content": [
        {"token": t, "bytes": list(t.encode()), "logprob": lp,
         "top_logprobs": [{"token": a, "bytes": list(a.encode()), "logprob": alp} for a, _, alp in top]}
        for t, _, lp, top in lps
    ]}


def _responses_logprobs(lps: list[_TokenLogprob]) -> list[dict[str, Any]]:
    """``output_text.logprobs`` of /v1/responses (``include: ["message.output_text.logprobs"]``)."""
    return [
        {"token": t, "bytes": list(t.encode()), "logprob": lp,
         "top_logprobs": [{"token": a, "bytes": list(a.encode()), "logprob": alp} for a, _, alp in top]}
        for t, _, lp, top in lps
    ]


def _completion_logprobs(lps: list[_TokenLogprob], top: int) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/completions: SGLang sends ``text_offset`` -1 for every token
    and ``top_logprobs`` ``[]`` (not a list of empty dicts) when no alternatives were asked for."""
    return {
        "text_offset": [-1] * len(lps),
        "token_logprobs": [lp for _, _, lp, _ in lps],
        "tokens": [t for t, _, _, _ in lps],
        "top_logprobs": [{a: alp for a, _, alp in tl} for _, _, _, tl in lps] if top else [],
    }


def _native_logprobs(lps: list[_TokenLogprob], total: int, top: int) -> dict[str, Any]:
    """``meta_info`` fields of /generate with ``return_logprob``: ``[logprob, id, null]`` triples
    (no text without ``return_text_in_logprobs``), the top lists only with ``top_logprobs_num``."""
    d: dict[str, Any] = {
        "input_token_logprobs": [],
        "output_token_logprobs": [[lp, tid, None] for _, tid, lp, _ in lps],
        "output_token_logprobs_length": total,
    }
    if top:
        d["input_top_logprobs"] = []
        d["output_top_logprobs"] = [[[alp, aid, None] for _, aid, alp in tl] for _, _, _, tl in lps]
    return d


REPLICA_KEY = web.AppKey("kvroute_emulator_replica", Replica)
_BREAK_KEY = web.RequestKey("kvroute_emulator_break_after", int)


# ---- encoding helpers --------------------------------------------------------------------------


try:  # orjson parses a 400 KB coding prompt ~2x faster; the stdlib is the fallback
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj).encode(), status=status, content_type="application/json")


def _openai_error(message: str, status: int = 400, type_: str = "BadRequestError") -> web.Response:
    return _json({"object": "error", "message": message, "type": type_, "param": None, "code": status}, status)


def _anthropic_error(status: int, type_: str, message: str) -> web.Response:
    return _json(anthropic.error_body(type_, message), status)


def _status_phrase(status: int) -> str:
    """What FastAPI's HTTPException handler names an error by on ``/v1/responses``."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return str(status)


def _responses_error(
    message: str, status: int, type_: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    return _json(responses.error_body(message, type_, param, status), status)


def _error_type(status: int) -> str:
    return {
        400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 429: "TooManyRequestsError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError")


def _weight_metadata(completion_tokens: int) -> dict[str, Any]:
    """An unstreamed OpenAI response's ``metadata``: one weight version served every output token."""
    return {"weight_version": "default",
            "weight_versions": [{"version": "default", "start": 0, "end": completion_tokens}]}


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _validation_error(message: str) -> _ClientError:
    """FastAPI's request validation refused the body (SGLang's ``RequestValidationError`` handler
    names the type by the status phrase, ``Bad Request``, not ``BadRequestError``)."""
    return _ClientError(f"1 validation error:\n  {message}", stage="validation")


def _validation_response(exc: _ClientError) -> web.Response:
    return _openai_error(str(exc), exc.status, "Bad Request")


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.read()
        obj = _loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _validation_error(f"JSON decode error: {exc}") from None
    if not isinstance(obj, dict):
        # real SGLang's chat route crashes here (500, or a reset connection): the gateway refuses such
        # bodies itself, so the emulator answers like the other routes do
        raise _validation_error("Input should be a valid dictionary or object to extract fields from")
    return obj


def _lax_int(body: dict[str, Any], key: str) -> int | None:
    """``body[key]`` as pydantic's lax ``int`` takes it: ``2``, ``2.0`` and ``"2"`` are 2; anything
    else is a validation error."""
    v = body.get(key)
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        with contextlib.suppress(ValueError):
            return int(v.strip())
    raise _validation_error(f"{key}: Input should be a valid integer")


def _int_field(body: dict[str, Any], key: str, minimum: int = 0) -> int | None:
    v = _lax_int(body, key)
    if v is not None and v < minimum:
        raise _ClientError(f"{key} must be an integer >= {minimum}")
    return v


def _routed_dp_rank(body: dict[str, Any], request: web.Request, cfg: EmulatorConfig, header: bool) -> int | None:
    """The rank a request names: ``routed_dp_rank`` (or its deprecated alias ``data_parallel_rank``)
    in the body, overridden on the OpenAI-style routes (``header``) by ``X-Data-Parallel-Rank``.
    The tokenizer manager refuses a rank the engine lacks; rank 0 of an engine without DP is
    ignored."""
    rank = _lax_int(body, "routed_dp_rank")
    if rank is None:
        rank = _lax_int(body, "data_parallel_rank")
    value = request.headers.get(DP_RANK_HEADER) if header else None
    if value is not None:
        try:
            rank = int(value)
        except ValueError:
            raise _ClientError(
                f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{value}'", type_="400"
            ) from None
    if rank is None or (cfg.dp_size <= 1 and rank == 0):
        return None
    if not 0 <= rank < cfg.dp_size:
        raise _ClientError(f"routed_dp_rank={rank} out of range [0, {cfg.dp_size})", stage="tokenizer")
    return rank


# roles SGLang's ChatCompletionRequest takes (its message union refuses any other)
_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})


def _verify_sampling(values: dict[str, Any]) -> None:
    """SGLang's ``SamplingParams.verify`` on the values a request sets (the tokenizer manager runs it
    after the context checks). The messages print the values as the engine holds them: floats from
    the OpenAI routes (pydantic made them so), the client's numbers from ``/generate``."""

    def num(key: str, default: float) -> float:
        v = values.get(key)
        return v if isinstance(v, int | float) and not isinstance(v, bool) else default

    temperature, top_p, min_p = num("temperature", 1.0), num("top_p", 1.0), num("min_p", 0.0)
    top_k = num("top_k", -1)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise _ClientError(f"temperature must be a non-negative finite number, got {temperature}.", stage="tokenizer")
    if 0 <= temperature < 1e-6:
        top_k = 1  # greedy (SamplingParams.__init__)
    if not 0.0 < top_p <= 1.0:
        raise _ClientError(f"top_p must be in (0, 1], got {top_p}.", stage="tokenizer")
    if not 0.0 <= min_p <= 1.0:
        raise _ClientError(f"min_p must be in [0, 1], got {min_p}.", stage="tokenizer")
    if top_k != -1 and top_k < 1:
        raise _ClientError(f"top_k must be -1 (disable) or at least 1, got {top_k}.", stage="tokenizer")
    for key in ("frequency_penalty", "presence_penalty"):
        v = num(key, 0.0)
        if not -2.0 <= v <= 2.0:
            raise _ClientError(f"{key} must be in [-2, 2], got {v}.", stage="tokenizer")
    rp = num("repetition_penalty", 1.0)
    if not 0.0 < rp <= 2.0:
        raise _ClientError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rp}.", stage="tokenizer"
        )


def _salt(body: dict[str, Any]) -> int:
    salt = body.get("cache_salt") or body.get("extra_key")
    return salt_seed(salt if isinstance(salt, str) else None)


def _max_req_len(prof: Profile) -> int:
    """SGLang's scheduler bound on prompt + output (``tp_worker``): one under the context length and
    one under the KV pool, whichever is smaller."""
    return min(prof.max_context_tokens - 1, prof.capacity_tokens - 1)


def max_req_input_len(prof: Profile) -> int:
    """The longest prompt SGLang's scheduler takes is one *under* this (``validate_input_length``)."""
    return _max_req_len(prof) - 5


def _check_context(
    cfg: EmulatorConfig, prompt_tokens: int, max_tokens: int | None, default: int,
    verify: Callable[[], None] = lambda: None,
) -> int:
    """SGLang 0.5.23's length checks, in its order; returns the output length the request gets.

    The tokenizer manager refuses a prompt of the context length or more, and prompt + ``max_tokens``
    over it *only when the client gave* ``max_tokens`` (without one nothing is summed). The scheduler
    then checks the sampling values (``verify``); the scheduler refuses a prompt of ``max_req_input_len`` or more, and caps the output at
    ``max_req_len - prompt - 1``: a request without ``max_tokens`` near the limit is served, shorter.
    """
    _tokenizer_limits(cfg, prompt_tokens, max_tokens, verify)
    return _scheduler_limits(cfg, prompt_tokens, max_tokens, default)


def _tokenizer_limits(
    cfg: EmulatorConfig, prompt_tokens: int, max_tokens: int | None, verify: Callable[[], None]
) -> None:
    """The tokenizer manager's part of ``_check_context`` (the client's own tokens only: a session's
    history is added later, by the scheduler)."""
    limit = cfg.profile.max_context_tokens
    if prompt_tokens >= limit:
        raise _ClientError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({limit} tokens).",
            stage="tokenizer",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        raise _ClientError(
            f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
            f"You requested a total of {prompt_tokens + max_tokens} tokens: {prompt_tokens} tokens from the "
            f"input messages and {max_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit.",
            stage="tokenizer",
        )
    verify()


def _scheduler_limits(cfg: EmulatorConfig, prompt_tokens: int, max_tokens: int | None, default: int) -> int:
    """The scheduler's part of ``_check_context``: refuses a long prompt, returns the output length."""
    prof = cfg.profile
    cap = max_req_input_len(prof)
    if prompt_tokens >= cap:
        raise _ClientError(
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({cap} tokens). "
            "Use a shorter input or enable --allow-auto-truncate.",
            stage="scheduler",
        )
    wanted = default if max_tokens is None else max_tokens
    return max(0, min(wanted, _max_req_len(prof) - prompt_tokens - 1))


def _max_new_tokens_error(n: int) -> _ClientError:
    return _ClientError(f"max_new_tokens must be at least 0, got {n}.", stage="tokenizer")


def _stream_options(body: dict[str, Any], cfg: EmulatorConfig) -> bool:
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _ClientError("stream_options must be an object")
    if so:  # SGLang's should_include_usage: the server's default wins over a client's false
        return bool(so.get("include_usage")) or cfg.stream_response_default_include_usage
    return cfg.stream_response_default_include_usage


def _lax_bool(body: dict[str, Any], key: str) -> bool:
    """``body[key]`` as pydantic's lax ``bool`` takes it (``"yes"``, ``1`` ... are true)."""
    v = anthropic.lax_bool(body.get(key))
    if v is None:
        raise _validation_error(f"{key}: Input should be a valid boolean")
    return v


def _openai_sampling_extras(body: dict[str, Any], chat: bool) -> tuple[int, bool, int]:
    """(n, logprobs on, top logprobs) as SGLang 0.5.23 reads them: ``n`` any integer (0 and
    negatives fail or miscount later, as there); chat's ``logprobs`` a bool with ``top_logprobs``
    beside it (ignored without it), completions' ``logprobs`` the top count itself; no upper bound
    on the count and a negative one is 0."""
    n = _lax_int(body, "n")
    if chat:
        on = _lax_bool(body, "logprobs")
        top = _lax_int(body, "top_logprobs") or 0
    else:
        lp = body.get("logprobs")
        lp = _lax_int({"logprobs": int(lp) if isinstance(lp, bool) else lp}, "logprobs")
        on, top = lp is not None, lp or 0
    return (1 if n is None else n), on, (max(0, top) if on else 0)


def _parse_openai(
    body: dict[str, Any], request: web.Request, cfg: EmulatorConfig, chat: bool, serving_chat: bool = True
) -> _Parsed:
    """``serving_chat`` False: a chat body another API built (``/v1/responses``), which skips
    serving_chat's own ``max_completion_tokens`` bound and goes straight to the engine's checks."""
    n, logprobs, top_logprobs = _openai_sampling_extras(body, chat)
    dp_rank = _routed_dp_rank(body, request, cfg, header=True)
    if chat:
        if body.get("input_ids") is not None:
            prompt = _ids_prompt(body["input_ids"])
        else:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                raise _validation_error("messages: Field required")
            if not msgs:
                raise _ClientError("messages must be a non-empty list")
            for i, m in enumerate(msgs):
                role = m.get("role") if isinstance(m, dict) else None
                if not isinstance(role, str) or role not in _CHAT_ROLES:  # a list role is unhashable
                    raise _validation_error(
                        f"messages.{i}.role: 'role' must be one of " + ", ".join(sorted(_CHAT_ROLES))
                    )
            tools = body.get("tools")
            try:
                prompt = encode_text(render_chat(msgs, tools if isinstance(tools, list) else None))
            except ValueError as exc:
                raise _ClientError(str(exc)) from None
        max_tokens = _openai_max_tokens(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _openai_max_tokens(body, "max_tokens")
        limit = cfg.profile.max_context_tokens
        if serving_chat and max_tokens and max_tokens > limit:  # serving_chat's own, before the tokenizer's
            raise _ClientError(
                f"max_completion_tokens is too large: {max_tokens}."
                f"This model supports at most {limit} completion tokens."
            )
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            prompt = encode_text(p)
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            prompt = _ids_prompt(p)
        elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            return _parse_openai({**body, "prompt": p[0]}, request, cfg, chat)
        else:
            raise _validation_error("prompt: Field required (a string or a list of token ids)")
        max_tokens = _lax_int(body, "max_tokens")
        if max_tokens is None:
            max_tokens = 16
        elif max_tokens <= 0:  # CompletionRequest's own validator
            raise _validation_error("max_tokens: Value error, max_tokens must be positive")
    if prompt.num_tokens == 0:
        raise _ClientError("The prompt is empty")
    n_out = _check_context(
        cfg, prompt.num_tokens, max_tokens, cfg.default_max_tokens,
        lambda: _verify_sampling({k: float(v) if k != "top_k" and isinstance(v, int | float) else v
                                  for k, v in body.items()}),
    )
    # without a max_tokens the output ends on EOS ("stop"), unless the context cut it short
    explicit = max_tokens is not None or n_out < cfg.default_max_tokens
    stream = bool(body.get("stream", False))
    rid = body.get("rid")
    session = body.get("session_id")
    return _Parsed(
        rid=rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
        prompt=prompt,
        max_tokens=n_out,
        explicit_max=explicit,
        stream=stream,
        include_usage=_stream_options(body, cfg) if stream else False,
        salt=_salt(body),
        routing_key=request.headers.get("x-smg-routing-key") or _opt_str(body.get("routing_key")),
        session_id=_opt_str(session),
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        dp_rank=dp_rank,
    )


def _openai_max_tokens(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if isinstance(v, int) and not isinstance(v, bool) and v < 0:
        raise _max_new_tokens_error(v)
    return _int_field(body, key)


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _ids_prompt(ids: Any) -> Prompt:
    if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise _ClientError("input_ids must be a list of integers")
    try:
        return encode_ids(ids)
    except ValueError as exc:
        raise _ClientError(str(exc)) from None


def _session_params(body: dict[str, Any]) -> SessionParams | None:
    try:
        params = SessionParams.from_json(body.get("session_params"))
    except (TypeError, ValueError) as exc:
        raise _ClientError(str(exc), stage="tokenizer") from None
    if body.get("session_params") is not None and body.get("session_id") is not None:
        raise _ClientError("session_id and session_params cannot both be set.", stage="tokenizer")
    return params


def _parse_generate(
    body: dict[str, Any],
    request: web.Request,
    cfg: EmulatorConfig,
    enter_session: Callable[[SessionParams, Prompt], Continuation],
) -> _Parsed:
    """``enter_session`` places a ``session_params`` request in its session (the scheduler's part)."""
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _ClientError("sampling_params must be an object")
    unknown = [k for k in sp if k not in _SAMPLING_SET]
    if unknown:
        raise _ClientError(
            f"unknown field `{unknown[0]}`, expected one of " + ", ".join(f"`{k}`" for k in SAMPLING_PARAMS),
            plain=True,
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        kind = f"string {json.dumps(stream)}" if isinstance(stream, str) else json.dumps(stream)
        raise _ClientError(f"invalid type: {kind}, expected a boolean", plain=True)
    if body.get("input_ids") is not None:  # the engine tokenizes text only when no ids were given
        prompt = _ids_prompt(body["input_ids"])
    elif isinstance(body.get("text"), str):
        prompt = encode_text(body["text"])
    elif isinstance(body.get("text"), list) or body.get("input_ids") is not None:
        raise _ClientError("batch requests are not supported by the emulator")
    else:
        raise _ClientError("Either text, input_ids or input_embeds should be provided.", stage="tokenizer")
    mnt = sp.get("max_new_tokens")
    if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int)):
        kind = f"string {json.dumps(mnt)}" if isinstance(mnt, str) else json.dumps(mnt)
        raise _ClientError(f"invalid type: {kind}, expected i64", plain=True)
    if mnt is not None and mnt < 0:
        raise _max_new_tokens_error(mnt)
    dp_rank = _routed_dp_rank(body, request, cfg, header=False)
    session = _session_params(body)
    if prompt.num_tokens == 0 and session is None:  # in a session the history may be the whole prompt
        raise _ClientError("The input is empty")
    _tokenizer_limits(cfg, prompt.num_tokens, mnt, lambda: _verify_sampling(sp))
    cont = None
    if session is not None:
        cont = enter_session(session, prompt)
        # token-aligned, with no raw tail: the output is cached after the padding, where the
        # continuing request's history puts it
        prompt = Prompt(cont.prompt)
    n_out = _scheduler_limits(cfg, prompt.num_tokens, mnt, cfg.default_max_tokens)
    explicit = mnt is not None or n_out < cfg.default_max_tokens
    rid = body.get("rid")
    return _Parsed(
        rid=rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
        prompt=prompt,
        max_tokens=n_out,
        explicit_max=explicit,
        stream=stream,
        include_usage=False,
        salt=_salt(body),
        routing_key=_opt_str(body.get("routing_key")) or request.headers.get("x-smg-routing-key"),
        session_id=_opt_str(body.get("session_id")),
        # n <= 1 is one sequence and a single response object (SGLang's is_single)
        n=n if isinstance(n := sp.get("n"), int) and not isinstance(n, bool) and n > 1 else 1,
        logprobs=bool(body.get("return_logprob")),
        top_logprobs=max(0, t) if isinstance(t := body.get("top_logprobs_num"), int) else 0,
        continuation=cont,
        dp_rank=dp_rank,
    )


# ---- the app ---------------------------------------------------------------------------------


def _loads_prometheus(docs: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus`` as SGLang renders it: a ``# TYPE`` line per figure, then one
    gauge per rank labelled by ``dp_rank`` only (``memory`` and ``queues`` flattened by prefix)."""
    series: dict[str, list[str]] = {}
    for d in docs:
        flat = {k: v for k, v in d.items() if k not in ("dp_rank", "memory", "queues", "speculative")}
        for section in ("memory", "queues"):
            if isinstance(d.get(section), dict):
                flat.update({f"{section}_{k}": v for k, v in d[section].items()})
        for k, v in flat.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                series.setdefault(k, []).append(f'sglang_{k}{{dp_rank="{d["dp_rank"]}"}} {v}')
    return "".join(f"# TYPE sglang_{k} gauge\n" + "".join(f"{ln}\n" for ln in lines) for k, lines in series.items())


class _Handlers:
    def __init__(self, rep: Replica) -> None:
        self.rep = rep
        self.cfg = rep.config

    # ---- shared request plumbing ---------------------------------------------------------
    def _take_fault(self) -> Faults | None:
        f = self.rep.faults
        if f.status is None and not f.hang and f.break_after_chunks is None and f.delay_s <= 0:
            return None
        snapshot = dataclasses.replace(f)
        if f.count is not None:
            f.count -= 1
            if f.count <= 0:
                slow = f.slow_factor
                self.rep.faults = Faults(slow_factor=slow)
        return snapshot

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.05)
        return web.Response(status=499)  # nobody is listening any more

    async def _wait_done(self, request: web.Request, fl: _Flight) -> None:
        while not fl.done.is_set():
            try:
                await asyncio.wait_for(fl.done.wait(), 0.25)
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise _ClientGone from None

    async def _all_finished(self, request: web.Request, fls: list[_Flight]) -> list[Finished]:
        """Every sequence's end, in choice order, once all have ended (an unstreamed answer)."""
        out: list[Finished] = []
        for fl in fls:
            await self._wait_done(request, fl)
            assert fl.finished is not None
            out.append(fl.finished)
        return out

    def _finish_reason(self, parsed: _Parsed, fin: Finished) -> tuple[str, int | None]:
        if fin.reason == "abort":
            return "abort", None
        if parsed.explicit_max:
            return "length", None
        return "stop", EOS_TOKEN_ID

    def _usage(self, parsed: _Parsed, fls: list[_Flight], streamed: bool = False) -> dict[str, Any]:
        """SGLang's UsageProcessor: completion tokens summed over the choices, prompt and cached
        tokens once per prompt -- the choices at positions ``0, n, 2n ...`` unstreamed
        (``range(0, len, n)``: none for a negative ``n``), those with ``index % n == 0`` streamed."""
        n = parsed.n
        firsts = [fl for i, fl in enumerate(fls) if i % n == 0] if streamed else fls[0 : len(fls) : n] if n > 0 else []
        p = sum(fl.prompt.num_tokens for fl in firsts)
        completion = sum(fl.finished.completion_tokens for fl in fls if fl.finished is not None)
        cached = sum(fl.cached for fl in firsts)
        return {
            "prompt_tokens": p,
            "total_tokens": p + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if self.cfg.enable_cache_report else None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def _meta(
        self, parsed: _Parsed, fl: _Flight, completion: int, fin: Finished | None, first: bool, first_lo: int = 0
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": fl.rid,
            "finish_reason": None,
            "prompt_tokens": fl.prompt.num_tokens,
            "weight_version": "default",
            "num_retractions": 0,
        }
        if parsed.logprobs:  # /generate's return_logprob (the OpenAI routes never send meta_info with them)
            text = output_text(parsed.max_tokens, _text_seed(fl.rid))
            lo = first_lo if self.cfg.incremental_streaming_output else 0
            meta.update(_native_logprobs(
                _token_logprobs(fl.rid, text, lo, completion, parsed.top_logprobs), completion, parsed.top_logprobs
            ))
        meta.update({
            "reasoning_tokens": 0,
            "completion_tokens": completion,
            "cached_tokens": fl.cached,
        })
        if fl.cached:
            meta["cached_tokens_details"] = {"device": fl.cached_device, "host": fl.cached_host}
        meta["dp_rank"] = fl.dp_rank if self.cfg.dp_size > 1 else None
        if fin is not None:
            if fin.reason == "abort":
                meta["finish_reason"] = {"type": "abort", "message": "Abort request", "status_code": None,
                                         "err_type": None}
            elif parsed.explicit_max:
                meta["finish_reason"] = {"type": "length", "length": completion}
            else:
                meta["finish_reason"] = {"type": "stop", "matched": EOS_TOKEN_ID}
            meta["e2e_latency"] = round(fin.t - fl.submit_model, 6)
            a = self.cfg.profile.spec_accept_length
            if a > 1.0 and completion > 1:
                verify = max(1, round((completion - 1) / a))
                meta.update({
                    "spec_accept_rate": round((a - 1) / a, 4),
                    "spec_accept_length": round(completion / verify, 4),
                    "spec_num_correct_drafts": completion - verify,
                    "spec_num_proposed_drafts": verify * max(1, round(a)),
                    "spec_verify_ct": verify,
                })
        if first:
            meta["response_sent_to_client_ts"] = time.time()
        return meta

    async def _run(
        self,
        request: web.Request,
        parsed: _Parsed,
        endpoint: str,
        respond: Callable[[_Parsed, list[_Flight]], Awaitable[web.StreamResponse]],
        error: Callable[[str, int], web.StreamResponse],
    ) -> web.StreamResponse:
        rep = self.rep
        key = (endpoint, request.method)
        active = rep.metrics.http_active
        active[key] = active.get(key, 0) + 1
        try:
            fault = self._take_fault()
            if fault is not None:
                if fault.delay_s > 0:
                    await asyncio.sleep(fault.delay_s)
                if fault.status is not None:
                    return error("Emulated fault", fault.status)
                if fault.hang:
                    return await self._hang(request)
                if fault.break_after_chunks is not None:
                    if not parsed.stream:  # nothing to cut mid-way: drop the connection unanswered
                        if request.transport is not None:
                            request.transport.abort()
                        return web.Response(status=499)
                    request[_BREAK_KEY] = fault.break_after_chunks
            fls: list[_Flight] = []
            try:
                await self._submit(request, parsed, fls)
                return await respond(parsed, fls)
            except _ClientError as exc:
                return error(str(exc), exc.status)
            except (_ClientGone, ConnectionResetError):
                return web.Response(status=499)  # client went away (or an emulated break)
            finally:
                for fl in fls:
                    if not fl.done.is_set():
                        rep.abort(fl.rid)
        finally:
            active[key] -= 1

    async def _submit(self, request: web.Request, parsed: _Parsed, fls: list[_Flight]) -> None:
        """Submits the request's sequences into ``fls`` (appended as they go in, so the caller
        aborts whatever is in there). ``n`` > 1 is SGLang's parallel sampling: a request with
        ``max_new_tokens`` 0 caches the prompt first, then ``n`` sequences with fresh ids run as
        requests of their own that share the cached prompt (each computes only its last token)."""
        rep = self.rep
        if parsed.n <= 1:
            fls.append(rep.submit(parsed, parsed.stream))
            return
        # the warm-up is not a client request: kept out of the request metrics, like a health probe
        warm = rep.submit(dataclasses.replace(parsed, rid=uuid.uuid4().hex, max_tokens=0), False, is_health=True)
        fls.append(warm)
        await self._wait_done(request, warm)
        fls.remove(warm)
        for _ in range(parsed.n):
            fls.append(rep.submit(dataclasses.replace(parsed, rid=uuid.uuid4().hex), parsed.stream))

    async def _progress_all(
        self, request: web.Request, fls: list[_Flight]
    ) -> AsyncIterator[tuple[int, int, int, Finished | None]]:
        """``_progress_chunks`` of every sequence, merged as they come: (choice index, sent, now,
        Finished on a sequence's last item)."""
        if len(fls) == 1:
            async for sent, total, fin in self._progress_chunks(request, fls[0]):
                yield 0, sent, total, fin
            return
        gens = [self._progress_chunks(request, fl) for fl in fls]

        async def step(i: int) -> tuple[int, int, Finished | None]:
            return await gens[i].__anext__()

        tasks = {asyncio.ensure_future(step(i)): i for i in range(len(gens))}
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(done, key=lambda t: tasks[t]):
                    i = tasks.pop(t)
                    try:
                        sent, total, fin = t.result()
                    except StopAsyncIteration:
                        continue
                    yield i, sent, total, fin
                    tasks[asyncio.ensure_future(step(i))] = i
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()

    async def _progress_chunks(
        self, request: web.Request, fl: _Flight
    ) -> AsyncGenerator[tuple[int, int, Finished | None]]:
        """Yields (tokens already sent, tokens now, Finished on the last item) at decode steps."""
        rep = self.rep
        engine = rep.ranks[fl.dp_rank].engine
        await fl.first.wait()
        interval = self.cfg.stream_interval
        min_gap = self.cfg.min_chunk_interval_s
        sent = 0
        last_emit = 0.0
        while True:
            fin = fl.finished
            if fin is None:
                now = rep.model_now()
                pr = engine.progress(fl.rid, now)
                if pr.next_time is None or pr.next_time <= now or pr.tokens >= fl.n_out:
                    rep.poll()  # an engine event is due: let it land before reading again
                    fin = fl.finished
            if fin is not None:
                if sent == 0 and fin.completion_tokens > 1 and fin.reason != "abort":
                    # SGLang streams the prefill's token on its own, however soon the rest follows
                    yield 0, 1, None
                    sent = 1
                yield sent, fin.completion_tokens, fin
                return
            tokens = max(pr.tokens, 1)
            if tokens > sent and (interval == 0 or tokens - sent >= interval or sent == 0):
                yield sent, tokens, None
                sent = tokens
                last_emit = time.monotonic()
            # sleep to the next decode step (a finish is one too); a changed batch just means
            # waking to no news and sleeping again
            delay = rep.wall_delay(pr.next_time) if pr.next_time is not None else 0.05
            if min_gap:
                delay = max(delay, last_emit + min_gap - time.monotonic())
            # +50 µs: the loop may fire a timer a hair early, which would cost a wasted wake-up
            await asyncio.sleep(min(delay, 1.0) + 5e-5)

    async def _write(self, request: web.Request, resp: web.StreamResponse, data: bytes, n_chunks: int) -> int:
        limit = request.get(_BREAK_KEY)
        if limit is not None and n_chunks >= limit:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("emulated stream break")
        await resp.write(data)
        return n_chunks + 1

    # ---- errors a stream reports in-stream (SGLang 0.5.23; see _ClientError.stage) ---------
    async def _sse_response(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
        await resp.write(_DONE)
        await resp.write_eof()
        return resp

    async def _scheduler_refusal_stream(
        self, request: web.Request, body: dict[str, Any], obj: str, exc: _ClientError
    ) -> web.StreamResponse:
        """A streamed OpenAI request the scheduler refuses: 200, an error event (Python's default
        ``json.dumps`` spacing, type ``BAD_REQUEST``), then -- with usage on -- a usage chunk that
        counts the one-token stand-in prompt the scheduler ran instead (prompt 1, completion 1)."""
        err = {
            "object": "error",
            "message": str(exc),
            "type": "BAD_REQUEST",
            "param": None,
            "code": exc.status,
        }
        events = [b"data: " + json.dumps({"error": err}, ensure_ascii=False).encode() + b"\n\n"]
        if _stream_options(body, self.cfg):
            rid = body.get("rid")
            usage: dict[str, Any] = {
                "prompt_tokens": 1,
                "total_tokens": 2,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 0} if self.cfg.enable_cache_report else None,
                "reasoning_tokens": 0,
            }
            if obj == "chat.completion.chunk":
                usage["completion_tokens_details"] = None
            else:
                usage = {k: v for k, v in usage.items() if v is not None}
            chunk: dict[str, Any] = {
                "id": rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
                "object": obj,
                "created": int(time.time()),
                "model": body.get("model") if isinstance(body.get("model"), str) else "default",
                "choices": [],
                "usage": usage,
            }
            events.append(_sse(chunk))
        return await self._sse_response(request, events)

    async def _generate_error_stream(
        self, request: web.Request, body: dict[str, Any], exc: _ClientError
    ) -> web.StreamResponse:
        """A streamed ``/generate`` answers 200 before the tokenizer manager validates it: a
        tokenizer error is one ``error`` event; a scheduler refusal is a finished chunk (abort, the
        one-token stand-in prompt and its one output token)."""
        if exc.stage == "tokenizer":
            err = {
                "message": str(exc),
                "type": "invalid_request_error",
                "code": exc.status,
                "retryable": False,
            }
            return await self._sse_response(request, [_sse({"error": err})])
        rid = body.get("rid")
        text = output_text(1, _text_seed(uuid.uuid4().hex))
        reason = {
            "type": "abort",
            "message": str(exc),
            "status_code": exc.status,
            "err_type": "BadRequestError",
        }
        meta = {
            "id": rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
            "finish_reason": reason,
            "prompt_tokens": 1,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": 1,
            "cached_tokens": 0,
            "cached_tokens_details": None,
            "dp_rank": None,
            "e2e_latency": 0.0,
            "response_sent_to_client_ts": time.time(),
        }
        return await self._sse_response(
            request, [_sse({"text": text, "output_ids": token_ids(encode_text(text)), "meta_info": meta})]
        )

    # ---- data plane ----------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        if not request.content_type.startswith("application/json"):
            return _validation_response(_validation_error("Unsupported Media Type: Only 'application/json' is allowed"))
        body: dict[str, Any] = {}
        try:
            body = await _read_json(request)
            parsed = _parse_openai(body, request, self.cfg, chat=True)
        except _ClientError as exc:
            if exc.stage == "validation":
                return _validation_response(exc)
            if exc.stage == "scheduler" and body.get("stream"):
                return await self._scheduler_refusal_stream(request, body, "chat.completion.chunk", exc)
            return _openai_error(str(exc), exc.status, exc.type_)
        model = body.get("model") if isinstance(body.get("model"), str) else "default"
        want_details = bool(body.get("return_cached_tokens_details"))
        want_meta = bool(body.get("return_meta_info"))

        async def respond(p: _Parsed, fls: list[_Flight]) -> web.StreamResponse:
            created = int(time.time())
            texts = [output_text(p.max_tokens, _text_seed(fl.rid)) for fl in fls]
            if not p.stream:
                choices = []
                for i, (fl, ended) in enumerate(zip(fls, await self._all_finished(request, fls), strict=True)):
                    n = ended.completion_tokens
                    reason, matched = self._finish_reason(p, ended)
                    choice: dict[str, Any] = {
                        "index": i,
                        "message": {"role": "assistant", "content": texts[i][: n * BYTES_PER_TOKEN],
                                    "reasoning_content": None},
                        "logprobs": _chat_logprobs(_token_logprobs(fl.rid, texts[i], 0, n, p.top_logprobs))
                        if p.logprobs else None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                    if want_meta:
                        choice["meta_info"] = self._meta(p, fl, n, ended, False)
                    choices.append(choice)
                if p.n == 0:  # SGLang's usage sum steps by n: range() refuses a zero step
                    return _openai_error("range() arg 3 must not be zero", 400, "BadRequest")
                n0 = fls[0].finished.completion_tokens if fls[0].finished is not None else 0
                out: dict[str, Any] = {
                    "id": fls[0].rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": self._usage(p, fls), "metadata": _weight_metadata(n0),
                }
                if want_details:
                    f0 = fls[0]
                    out["sglext"] = {"cached_tokens_details": {"device": f0.cached_device, "host": f0.cached_host}}
                return _json(out)
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            heads = [{"id": fl.rid, "object": "chat.completion.chunk", "created": created, "model": model} for fl in fls]
            # the hot path (no logprobs): a bytes template per choice, one json string encode a chunk
            pres = [b"data: " + _dumps(h).encode()[:-1]
                    + b',"choices":[{"index":%d,"delta":{"reasoning_content":null,"content":' % i
                    for i, h in enumerate(heads)]
            post = b'},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'
            n_chunks = 0
            finished: dict[int, Finished] = {}  # in the order the choices finished
            last = 0  # SGLang's closing chunks carry the id of the choice it heard from last
            async for i, sent, total, fin in self._progress_all(request, fls):
                last = i
                if fin is not None:
                    finished[i] = fin
                if sent == 0 and total > 0:
                    n_chunks = await self._write(request, resp, _sse({**heads[i], "choices": [{
                        "index": i, "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None, "matched_stop": None}]}), n_chunks)
                if total <= sent:
                    continue
                piece = texts[i][sent * BYTES_PER_TOKEN : total * BYTES_PER_TOKEN]
                if p.logprobs:
                    lps = _chat_logprobs(_token_logprobs(fls[i].rid, texts[i], sent, total, p.top_logprobs))
                    data = _sse({**heads[i], "choices": [{
                        "index": i, "delta": {"reasoning_content": None, "content": piece}, "logprobs": lps,
                        "finish_reason": None, "matched_stop": None}]})
                else:
                    data = pres[i] + json.dumps(piece).encode() + post
                n_chunks = await self._write(request, resp, data, n_chunks)
            head = heads[last]
            for i, fin in finished.items():
                reason, matched = self._finish_reason(p, fin)
                n_chunks = await self._write(request, resp, _sse({**head, "choices": [{
                    "index": i, "delta": {"reasoning_content": None}, "logprobs": None, "finish_reason": reason,
                    "matched_stop": matched}]}), n_chunks)
            if want_details:
                f0 = fls[0]
                await resp.write(_sse({**head, "choices": [], "sglext": {
                    "cached_tokens_details": {"device": f0.cached_device, "host": f0.cached_host}}}))
            if p.include_usage:
                if p.n == 0:  # SGLang's usage sum takes index % n: the error ends the stream, no [DONE]
                    await resp.write_eof()
                    return resp
                await resp.write(_sse({**head, "choices": [], "usage": self._usage(p, fls, streamed=True)}))
            await resp.write(_DONE)
            await resp.write_eof()
            return resp

        return await self._run(request, parsed, "/v1/chat/completions", respond, lambda m, s: _openai_error(m, s, _error_type(s)))

    # ---- Anthropic Messages API (replica/emulator/anthropic.py) ----------------------------
    async def _anthropic_chat(self, request: web.Request, count_tokens: bool) -> dict[str, Any] | web.Response:
        """The chat body SGLang converts an Anthropic request to, or the 400 it answers instead."""
        if not request.content_type.startswith("application/json"):
            return _anthropic_error(
                400, "invalid_request_error", "header.content-type: Unsupported Media Type: Only 'application/json' is allowed"
            )
        raw = await request.read()
        if not raw.strip():  # FastAPI takes an empty body for a missing one
            return _anthropic_error(400, "invalid_request_error", "Field required")
        try:
            body = _loads(raw)
        except (ValueError, UnicodeDecodeError):
            try:  # FastAPI names the position where the stdlib parser stopped
                json.loads(raw)
                pos = 0
            except json.JSONDecodeError as exc:
                pos = exc.pos
            except UnicodeDecodeError as exc:
                pos = exc.start
            return _anthropic_error(400, "invalid_request_error", f"{pos}: JSON decode error")
        if not isinstance(body, dict):
            return _anthropic_error(
                400, "invalid_request_error", "Input should be a valid dictionary or object to extract fields from"
            )
        try:
            return anthropic.to_chat(body, count_tokens=count_tokens)
        except anthropic.AnthropicRequestError as exc:
            return _anthropic_error(400, "invalid_request_error", str(exc))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        chat = await self._anthropic_chat(request, count_tokens=False)
        if isinstance(chat, web.Response):
            return chat
        stream = chat["stream"]
        if not chat["messages"]:  # serving_chat's _validate_request
            return _anthropic_error(400, "invalid_request_error", "Messages cannot be empty.")
        try:
            parsed = _parse_openai(chat, request, self.cfg, chat=True)
        except _ClientError as exc:
            if exc.stage not in ("tokenizer", "scheduler"):
                return _anthropic_error(exc.status, anthropic.error_type(exc.status), str(exc))
            if stream:  # the stream has started: message_start, the error, message_stop
                return await self._anthropic_stream_error(request, chat["model"], str(exc))
            # the chat handler's own error body, passed through with its type (BadRequestError)
            return _anthropic_error(exc.status, _error_type(exc.status), str(exc))
        model = chat["model"]
        report = self.cfg.enable_cache_report

        async def respond(p: _Parsed, fls: list[_Flight]) -> web.StreamResponse:
            fl = fls[0]
            text = output_text(p.max_tokens, _text_seed(fl.rid))
            if not p.stream:
                done = (await self._all_finished(request, fls))[0]
                n = done.completion_tokens
                return _json({
                    "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": text[: n * BYTES_PER_TOKEN]}], "model": model,
                    "stop_reason": self._stop_reason(p, done),
                    "usage": anthropic.usage(fl.prompt.num_tokens, fl.cached if report else 0, n),
                })
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)
            n_chunks = 0
            block_open = False
            fin: Finished | None = None
            async for _, sent, total, ended in self._progress_all(request, fls):
                fin = ended or fin
                if sent == 0:  # the first chunk carries the prompt's usage
                    n_chunks = await self._write(request, resp, anthropic.sse_event({
                        "type": "message_start", "message": {
                            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [],
                            "model": model, "usage": anthropic.usage(fl.prompt.num_tokens, fl.cached if report else 0, 0),
                        }}), n_chunks)
                if total <= sent:
                    continue
                if not block_open:
                    block_open = True
                    n_chunks = await self._write(request, resp, anthropic.sse_event(
                        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                    ), n_chunks)
                n_chunks = await self._write(request, resp, anthropic.sse_event({
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text[sent * BYTES_PER_TOKEN : total * BYTES_PER_TOKEN]},
                }), n_chunks)
            assert fin is not None
            tail = [{"type": "content_block_stop", "index": 0}] if block_open else []
            tail += [
                {"type": "message_delta", "delta": {"stop_reason": self._stop_reason(p, fin)},
                 "usage": {"output_tokens": fin.completion_tokens}},
                {"type": "message_stop"},
            ]
            for ev in tail:
                n_chunks = await self._write(request, resp, anthropic.sse_event(ev), n_chunks)
            await resp.write_eof()
            return resp

        return await self._run(
            request, parsed, "/v1/messages", respond,
            lambda m, s: _anthropic_error(s, anthropic.error_type(s), "Internal server error" if s >= 500 else m),
        )

    def _stop_reason(self, parsed: _Parsed, fin: Finished) -> str:
        return anthropic.STOP_REASONS.get(self._finish_reason(parsed, fin)[0], "end_turn")

    async def _anthropic_stream_error(self, request: web.Request, model: str, message: str) -> web.StreamResponse:
        """SGLang's ``_flush_on_error`` for a request refused once its stream has started."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        start = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [],
                 "model": model, "usage": {"input_tokens": 0, "output_tokens": 0}}
        for ev in (
            {"type": "message_start", "message": start},
            anthropic.error_body("invalid_request_error", message),
            {"type": "message_stop"},
        ):
            await resp.write(anthropic.sse_event(ev))
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        chat = await self._anthropic_chat(request, count_tokens=True)
        if isinstance(chat, web.Response):
            return chat
        if not chat["messages"]:  # the chat template's own refusal
            return _anthropic_error(
                400, "invalid_request_error",
                "Cannot apply chat template to an empty conversation. Provide at least one message.",
            )
        # the templated prompt's length, unchecked against the context (as SGLang does)
        return _json({"input_tokens": encode_text(render_chat(chat["messages"], chat.get("tools"))).num_tokens})

    # ---- OpenAI Responses API (replica/emulator/responses.py) ------------------------------
    async def _responses_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The validated body, or FastAPI's 400 (``"type": "Bad Request"``) SGLang answers instead."""
        if request.content_type != "application/json":
            return _responses_error(responses.content_type_error(), 400, "Bad Request")
        raw = await request.read()
        if not raw.strip():  # FastAPI takes an empty body for a missing one
            return _responses_error(responses.body_error("missing", (), "Field required", None), 400, "Bad Request")
        try:
            body = _loads(raw)
        except (ValueError, UnicodeDecodeError):
            try:  # FastAPI names the position where the stdlib parser stopped
                json.loads(raw)
                pos, why = 0, "invalid JSON"
            except json.JSONDecodeError as exc:
                pos, why = exc.pos, exc.msg
            except UnicodeDecodeError as exc:
                pos, why = exc.start, exc.reason
            message = responses.body_error("json_invalid", (pos,), "JSON decode error", {}, {"error": why})
            return _responses_error(message, 400, "Bad Request")
        if not isinstance(body, dict):
            message = responses.body_error(
                "model_attributes_type", (), "Input should be a valid dictionary or object to extract fields from", body
            )
            return _responses_error(message, 400, "Bad Request")
        try:
            responses.validate(body)
        except responses.ResponsesValidationError as exc:
            return _responses_error(str(exc), 400, "Bad Request")
        return body

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body = await self._responses_body(request)
        if isinstance(body, web.Response):
            return body
        store = self.rep.responses
        try:
            responses.check(body, self.cfg.model_name, store=self.cfg.enable_response_store)
            if body.get("previous_response_id") is not None:  # (only with the store on: checked)
                store.get(body["previous_response_id"])
            chat = responses.to_chat(store.prompt_body(body))
        except responses.ResponsesRequestError as exc:
            return _responses_error(str(exc), exc.status, param=exc.param)
        persist = self.cfg.enable_response_store and responses.stores(body)
        # background and stream: SGLang streams it on this connection, as any stream
        background = persist and bool(anthropic.lax_bool(body.get("background"))) and not chat["stream"]
        if persist:
            store.begin(chat["rid"], body)
        try:
            parsed = _parse_openai(chat, request, self.cfg, chat=True, serving_chat=False)
        except _ClientError as exc:
            if background and exc.stage in ("tokenizer", "scheduler"):  # found by the run, after "queued"
                return _json(self._queue_background(body, chat, int(time.time()), None, None))
            if chat["stream"] and exc.stage in ("tokenizer", "scheduler"):
                return await self._responses_failed_stream(request, body, chat, exc)
            # the engine's refusals reach the serving layer as a ValueError: its 400
            return _responses_error(str(exc), exc.status)
        model = chat["model"]
        logprobs = "message.output_text.logprobs" in (body.get("include") or [])
        top = body.get("top_logprobs") or 0
        hold = responses.holds_message_events(body)

        async def respond(p: _Parsed, fls: list[_Flight]) -> web.StreamResponse:
            fl = fls[0]
            created = int(time.time())
            item_id = f"msg_{uuid.uuid4().hex}"
            text = output_text(p.max_tokens, _text_seed(fl.rid))

            def doc(output: list[dict[str, Any]], fin: Finished | None) -> dict[str, Any]:
                if fin is None:
                    return responses.response_doc(body, rid=p.rid, model=model, created=created, output=output,
                                                  status="in_progress", usage=None)
                status, error = responses.outcome(self._finish_reason(p, fin)[0], "Abort request")
                n = fin.completion_tokens
                return responses.response_doc(body, rid=p.rid, model=model, created=created, output=output,
                                              status=status, usage=responses.usage(fl.prompt.num_tokens, fl.cached, n),
                                              error=error)

            def unstreamed(fin: Finished) -> dict[str, Any]:
                n = fin.completion_tokens
                lps = _responses_logprobs(_token_logprobs(fl.rid, text, 0, n, int(top))) if logprobs else None
                answer = text[: n * BYTES_PER_TOKEN]
                return doc([responses.message_item(item_id, answer, lps)] if answer else [], fin)

            if background:
                fls.remove(fl)  # the background run owns it now (_run aborts what is left in fls)
                return _json(self._queue_background(body, chat, created, fl, unstreamed))
            if not p.stream:
                final = unstreamed((await self._all_finished(request, fls))[0])
                if persist:
                    store.finish(body, final)
                return _json(final)
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            ev = responses.EventStream()
            n_chunks = 0
            for type_ in ("response.created", "response.in_progress"):
                n_chunks = await self._write(request, resp, ev.lifecycle(type_, doc([], None)), n_chunks)
            held: list[bytes] = []  # the message's events, when SGLang holds them to the end
            answer = ""
            fin: Finished | None = None
            async for _, sent, total, ended in self._progress_all(request, fls):
                fin = ended or fin
                if total <= sent:
                    continue
                frames = ev.open_message(item_id) if not answer else []
                piece = text[sent * BYTES_PER_TOKEN : total * BYTES_PER_TOKEN]
                answer += piece
                frames.append(ev.delta(item_id, piece))
                if hold:
                    held += frames
                    continue
                for frame in frames:
                    n_chunks = await self._write(request, resp, frame, n_chunks)
            assert fin is not None
            output = []
            if answer:
                held += ev.close_message(item_id, answer)
                output = [responses.message_item(item_id, answer)]
            final = doc(output, fin)
            if persist:  # kept before the last event goes out, as SGLang does
                store.finish(body, final)
            for frame in [*held, ev.lifecycle(f"response.{final['status']}", final)]:
                n_chunks = await self._write(request, resp, frame, n_chunks)
            await resp.write_eof()
            return resp

        return await self._run(
            request, parsed, "/v1/responses", respond, lambda m, s: _responses_error(m, s, _status_phrase(s))
        )

    async def _responses_failed_stream(
        self, request: web.Request, body: dict[str, Any], chat: dict[str, Any], exc: _ClientError
    ) -> web.StreamResponse:
        """A streamed request the engine refuses: SGLang has started the stream (created,
        in_progress) and ends it with ``response.failed``. A scheduler refusal comes after the
        one-token stand-in prompt it ran: its one output token is a message, and usage counts it."""
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        ev = responses.EventStream()
        created = int(time.time())

        def doc(output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
            return responses.response_doc(body, rid=chat["rid"], model=chat["model"], created=created, output=output,
                                          status=status, usage=usage, error=error)

        frames = [ev.lifecycle(t, doc([], "in_progress")) for t in ("response.created", "response.in_progress")]
        output: list[dict[str, Any]] = []
        usage = None
        if exc.stage == "scheduler":
            item_id = f"msg_{uuid.uuid4().hex}"
            text = output_text(1, _text_seed(item_id))
            frames += [*ev.open_message(item_id), ev.delta(item_id, text), *ev.close_message(item_id, text)]
            output, usage = [responses.message_item(item_id, text)], responses.usage(1, 0, 1)
        _, error = responses.outcome("abort", str(exc))
        frames.append(ev.lifecycle("response.failed", doc(output, "failed", usage, error)))
        for frame in frames:
            await resp.write(frame)
        await resp.write_eof()
        return resp

    def _queue_background(
        self, body: dict[str, Any], chat: dict[str, Any], created: int, fl: _Flight | None,
        final: Callable[[Finished], dict[str, Any]] | None,
    ) -> dict[str, Any]:
        """SGLang's ``background``: the ``queued`` response (no output, no usage) is kept and
        answered at once; a task runs the request (``fl``; None: the engine refused it) and keeps
        its ``final`` response. Returns the queued response (the task updates it in place)."""
        queued = responses.response_doc(body, rid=chat["rid"], model=chat["model"], created=created, output=[],
                                        status="queued", usage=None)
        self.rep.responses.queue(queued)
        rid = queued["id"]
        tasks = self.rep.background
        task = asyncio.get_running_loop().create_task(self._background_run(body, queued, fl, final),
                                                      name=f"create_{rid}")
        tasks[rid] = task
        task.add_done_callback(lambda t: tasks.pop(rid) if tasks.get(rid) is t else None)
        return queued

    async def _background_run(
        self, body: dict[str, Any], queued: dict[str, Any], fl: _Flight | None,
        final: Callable[[Finished], dict[str, Any]] | None,
    ) -> None:
        """``_run_background_request``: ``in_progress`` as it starts; an engine refusal leaves the
        response ``failed`` (without output or error, as SGLang's); a cancel or the server
        stopping cancels this task (and aborts the run)."""
        store = self.rep.responses
        queued["status"] = "in_progress"
        if fl is None or final is None:
            store.fail(queued["id"])
            return
        try:
            await fl.done.wait()
        finally:
            if not fl.done.is_set():
                self.rep.abort(fl.rid)
        assert fl.finished is not None
        store.finish(body, final(fl.finished))

    async def retrieve_response(self, request: web.Request) -> web.Response:
        """GET ``/v1/responses/{id}``: the stored response as it is now (Rule 3 of responses.py)."""
        if not self.cfg.enable_response_store:
            return _responses_error(responses.STORE_DISABLED, 400, param="response_id")
        try:
            return _json(self.rep.responses.get(request.match_info["response_id"]))
        except responses.ResponsesRequestError as exc:
            return _responses_error(str(exc), exc.status, param=exc.param)

    async def cancel_response(self, request: web.Request) -> web.Response:
        """POST ``/v1/responses/{id}/cancel``: a queued or running (background) response becomes
        ``cancelled`` and its run is aborted; any other is answered as it is."""
        if not self.cfg.enable_response_store:
            return _responses_error(responses.STORE_DISABLED, 400, param="response_id")
        rid = request.match_info["response_id"]
        try:
            doc, running = self.rep.responses.cancel(rid)
        except responses.ResponsesRequestError as exc:
            return _responses_error(str(exc), exc.status, param=exc.param)
        task = self.rep.background.get(rid)
        if running and task is not None:  # its run aborts the request as it ends (_background_run)
            task.cancel()
            await asyncio.wait([task])
        return _json(doc)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = {}
        try:
            body = await _read_json(request)
            parsed = _parse_openai(body, request, self.cfg, chat=False)
        except _ClientError as exc:
            if exc.stage == "validation":
                return _validation_response(exc)
            if exc.stage == "scheduler" and body.get("stream"):
                return await self._scheduler_refusal_stream(request, body, "text_completion", exc)
            return _openai_error(str(exc), exc.status, exc.type_)
        model = body.get("model") if isinstance(body.get("model"), str) else "default"

        async def respond(p: _Parsed, fls: list[_Flight]) -> web.StreamResponse:
            created = int(time.time())
            texts = [output_text(p.max_tokens, _text_seed(fl.rid)) for fl in fls]

            def logprobs(i: int, lo: int, hi: int) -> dict[str, Any] | None:
                if not p.logprobs or hi <= lo:
                    return None
                return _completion_logprobs(_token_logprobs(fls[i].rid, texts[i], lo, hi, p.top_logprobs),
                                            p.top_logprobs)

            if not p.stream:
                choices = []
                for i, ended in enumerate(await self._all_finished(request, fls)):
                    n = ended.completion_tokens
                    reason, matched = self._finish_reason(p, ended)
                    choices.append({"index": i, "text": texts[i][: n * BYTES_PER_TOKEN], "logprobs": logprobs(i, 0, n),
                                    "finish_reason": reason, "matched_stop": matched})
                if p.n == 0:  # SGLang's usage sum steps by n: range() refuses a zero step
                    return _openai_error("range() arg 3 must not be zero", 400, "BadRequest")
                n0 = fls[0].finished.completion_tokens if fls[0].finished is not None else 0
                return _json({
                    "id": fls[0].rid, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "usage": self._usage(p, fls), "metadata": _weight_metadata(n0),
                })
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            heads = [{"id": fl.rid, "object": "text_completion", "created": created, "model": model} for fl in fls]
            n_chunks = 0
            last = 0
            async for i, sent, total, fin in self._progress_all(request, fls):
                last = i
                if total <= sent and fin is None:
                    continue
                # one chunk per engine output; the last one carries the finish reason with its text
                end: tuple[str | None, int | None] = (None, None) if fin is None else self._finish_reason(p, fin)
                n_chunks = await self._write(request, resp, _sse({**heads[i], "choices": [{
                    "index": i, "text": texts[i][sent * BYTES_PER_TOKEN : total * BYTES_PER_TOKEN],
                    "logprobs": logprobs(i, sent, total), "finish_reason": end[0], "matched_stop": end[1]}],
                    "usage": None}), n_chunks)
            if p.include_usage:
                if p.n == 0:  # SGLang's usage sum takes index % n: reported as an in-stream error
                    err = {"object": "error", "message": "integer modulo by zero", "type": "BadRequestError",
                           "param": None, "code": 400}
                    await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
                else:
                    usage = self._usage(p, fls, streamed=True)
                    usage = {k: v for k, v in usage.items() if v is not None}
                    await resp.write(_sse({**heads[last], "choices": [], "usage": usage}))
            await resp.write(_DONE)
            await resp.write_eof()
            return resp

        return await self._run(request, parsed, "/v1/completions", respond, lambda m, s: _openai_error(m, s, _error_type(s)))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = {}
        try:
            body = await _read_json(request)
            parsed = _parse_generate(body, request, self.cfg, self._enter_session)
        except _ClientError as exc:
            if exc.stage == "validation":
                return _validation_response(exc)
            if exc.stage is not None and body.get("stream") is True:
                return await self._generate_error_stream(request, body, exc)
            return _json({"error": str(exc) if exc.plain else {"message": str(exc)}}, exc.status)
        want_prompt_ids = bool(body.get("return_prompt_token_ids"))
        incremental = self.cfg.incremental_streaming_output

        def doc(p: _Parsed, fl: _Flight, lo: int, hi: int, fin: Finished | None, first: bool) -> dict[str, Any]:
            start = lo if incremental else 0
            text = output_text(p.max_tokens, _text_seed(fl.rid))
            ids = token_ids(encode_text(text))
            d: dict[str, Any] = {
                "text": text[start * 4 : hi * 4],
                "output_ids": ids[start:hi],
                "meta_info": self._meta(p, fl, hi, fin, first, first_lo=lo),
            }
            if want_prompt_ids:
                d["prompt_token_ids"] = token_ids(fl.prompt)
            return d

        async def respond(p: _Parsed, fls: list[_Flight]) -> web.StreamResponse:
            if not p.stream:
                fins = await self._all_finished(request, fls)
                docs = [doc(p, fl, 0, fin.completion_tokens, fin, False) for fl, fin in zip(fls, fins, strict=True)]
                return _json(docs if p.n > 1 else docs[0])  # n > 1: a list, one object per sequence
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            n_chunks = 0
            firsts = set(range(len(fls)))
            async for i, sent, total, fin in self._progress_all(request, fls):
                d = doc(p, fls[i], sent, total, fin, i in firsts)
                if p.n > 1:
                    d["index"] = i  # which sequence this chunk is of (SGLang adds it after meta_info)
                n_chunks = await self._write(request, resp, _sse(d), n_chunks)
                firsts.discard(i)
            await resp.write(_DONE)
            await resp.write_eof()
            return resp

        return await self._run(request, parsed, "/generate", respond, lambda m, s: _json({"error": {"message": m}}, s))

    def _enter_session(self, params: SessionParams, prompt: Prompt) -> Continuation:
        """SGLang's scheduler places a ``session_params`` request (``sessions.py``); a refusal
        aborts the request (400, or in-stream when streamed)."""
        rep = self.rep
        now = rep.model_now()
        rep.engine_sessions.reap(now)
        try:
            # ``replace`` aborts a running request: its Finished (and so its output) comes at once
            return rep.engine_sessions.begin(params, prompt.data, now, rep.abort)
        except SessionError as exc:
            raise _ClientError(str(exc), stage="scheduler") from None

    async def open_session(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            capacity = _lax_int(body, "capacity_of_str_len")
            if capacity is None:
                raise _validation_error("capacity_of_str_len: Field required")
            sid = body.get("session_id")
            if sid is not None and not isinstance(sid, str):
                raise _validation_error("session_id: Input should be a valid string")
            streaming = _lax_bool(body, "streaming")
            timeout = body.get("timeout")
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
                raise _validation_error("timeout: Input should be a valid number")
        except _ClientError as exc:
            return _validation_response(exc)
        if streaming:  # SGLang serves them only with --enable-streaming-session; the emulator never
            return _json({"error": {"message": "Streaming sessions are disabled. "
                                               "Please relaunch with --enable-streaming-session."}}, 400)
        rep = self.rep
        now = rep.model_now()
        rep.engine_sessions.reap(now)
        sid = uuid.uuid4().hex if sid is None else sid
        if not rep.engine_sessions.open(sid, capacity, None if timeout is None else float(timeout), now):
            return _json({"error": {"message": "Failed to open the session. "
                                               "Check if a session with the same id is still open."}}, 400)
        return _json(sid)

    async def close_session(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            sid = body.get("session_id")
            if not isinstance(sid, str):
                raise _validation_error(
                    "session_id: Field required" if sid is None else "session_id: Input should be a valid string"
                )
        except _ClientError as exc:
            return _validation_response(exc)
        self.rep.engine_sessions.close(sid)
        return web.Response(status=200)

    # ---- control plane -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        rep = self.rep
        if rep.faults.health_status is not None:
            return web.Response(status=rep.faults.health_status)
        if rep.status != "ready" or time.monotonic() - rep.started_wall < self.cfg.startup_delay_s:
            return web.Response(status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        pre = await self.health(request)
        if pre.status != 200:
            return pre
        rep = self.rep
        if rep.flights:  # already producing output
            return web.Response(status=200)
        parsed = _Parsed(f"HEALTH_CHECK_{uuid.uuid4().hex}", encode_ids([0]), 1, True, False, False, 0, None, None)
        fl = rep.submit(parsed, False, is_health=True)
        try:
            await asyncio.wait_for(fl.done.wait(), 20.0)
        except TimeoutError:
            return web.Response(status=503)
        finally:
            if not fl.done.is_set():
                rep.abort(fl.rid)
        return web.Response(status=200)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": int(self.rep.startup_time),
                "owned_by": "sglang", "root": self.cfg.model_name, "parent": None,
                "max_model_len": self.cfg.profile.max_context_tokens}

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.cfg.model_name:
            return _json({"error": {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}, 404)
        return _json(self._model_card())

    async def model_info(self, request: web.Request) -> web.Response:
        m = self.cfg.model_name
        return _json({
            "model_path": m, "served_model_name": m, "tokenizer_path": m, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "load_format": "auto",
            "reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2", "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
        })

    async def server_info(self, request: web.Request) -> web.Response:
        cfg, prof, rep = self.cfg, self.cfg.profile, self.rep
        rep.poll()
        loads = [r.engine.load() for r in rep.ranks]
        load = loads[0]
        host = prof.host_tokens > 0
        spec = prof.spec_accept_length > 1.0
        args: dict[str, Any] = {
            "model_path": cfg.model_name, "served_model_name": cfg.model_name, "tokenizer_path": cfg.model_name,
            "host": cfg.host, "port": cfg.port, "tp_size": prof.tp_size, "dp_size": cfg.dp_size, "pp_size": 1, "ep_size": 1,
            "context_length": prof.max_context_tokens, "max_running_requests": prof.max_running_requests,
            "max_total_tokens": None, "chunked_prefill_size": max(1, prof.chunked_prefill_size // prof.token_unit),
            "max_prefill_tokens": 16384, "page_size": prof.page_size, "schedule_policy": prof.schedule_policy,
            "prefill_decode_interval": prof.prefill_decode_interval,
            "prefill_decode_interval_min_bs": prof.prefill_decode_interval_min_bs,
            "kv_cache_dtype": "fp8_e4m3", "quantization": "modelopt_fp4",
            # SGLang reports its defaults (ratio 2.0, size 0 GB) whether HiCache is on or not
            "enable_hierarchical_cache": host, "hicache_ratio": (prof.host_capacity_tokens / prof.kv_capacity_tokens)
            if host else 2.0, "hicache_size": 0, "hicache_write_policy": "write_through",
            "speculative_algorithm": "DFLASH" if spec else None, "enable_metrics": True,
            "enable_cache_report": cfg.enable_cache_report, "stream_interval": max(1, cfg.stream_interval),
            "stream_response_default_include_usage": cfg.stream_response_default_include_usage,
            "incremental_streaming_output": cfg.incremental_streaming_output, "weight_version": "default",
            "enable_response_store": cfg.enable_response_store,
            "reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2", "disable_radix_cache": False,
            "api_key": None, "load_balance_method": "round_robin",
        }
        internals = []  # one per rank (each rank's scheduler), as SGLang's
        for x in loads:
            internal = {**args, "world_size": prof.tp_size, "effective_max_running_requests_per_dp":
                        prof.max_running_requests, "last_gen_throughput": x.gen_throughput,
                        "memory_usage": {"weight": 125.0, "kvcache": 30.0, "graph": 1.2,
                                         "token_capacity": x.capacity_tokens}}
            if spec:
                internal["avg_spec_accept_length"] = prof.spec_accept_length
            internals.append(internal)
        return _json({
            **args,
            "launch_command": f"kvroute emulate --profile {prof.name} --time-scale {cfg.time_scale}",
            "status": rep.status, "max_total_num_tokens": load.capacity_tokens,  # one rank's pool
            "max_req_input_len": max_req_input_len(prof), "startup_time": rep.startup_time,
            "kv_events_config": rep.kv_config.raw if rep.kv_config is not None else None,
            "kv_events": rep.kv_config.describe(
                prof.page_size,
                rep.kv_publisher.bound if rep.kv_publisher else None,
                rep.kv_publisher.bound_replay if rep.kv_publisher else None,
                dp_size=cfg.dp_size,
            ) if rep.kv_config is not None else None,
            "internal_states": internals, "version": SGLANG_VERSION, "frontend": "python",
            "emulator": {"name": cfg.name, "profile": dataclasses.asdict(prof), "time_scale": cfg.time_scale,
                         "token_unit": prof.token_unit},
        })

    def _load_docs(self) -> list[tuple[dict[str, Any], EngineLoad]]:
        """Each rank's ``/v1/loads`` entry (``include=core``) and the load it was read from."""
        rep = self.rep
        rep.poll()
        prof = self.cfg.profile
        out = []
        for r in rep.ranks:
            load = r.engine.load()
            out.append(({
                "timestamp": time.time(), "dp_rank": r.dp_rank, "num_running_reqs": load.running,
                "num_waiting_reqs": load.queued, "num_waiting_uncached_tokens": load.pending_prefill_tokens,
                "num_used_tokens": load.used_tokens, "num_total_tokens": load.used_tokens + load.waiting_tokens,
                "num_active_tokens": load.used_tokens + load.waiting_tokens, "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": load.capacity_tokens, "max_running_requests": prof.max_running_requests,
                "token_usage": round(load.token_usage, 6), "gen_throughput": round(load.gen_throughput, 3),
                "cache_hit_rate": round(load.cache_hit_rate, 6),
                "utilization": round(min(1.0, load.running / prof.max_running_requests), 6),
                "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None,
            }, load))
        return out

    async def loads(self, request: web.Request) -> web.Response:
        include = set(request.query.get("include", "all").split(","))
        want = request.query.get("dp_rank")
        docs = []
        for core, load in self._load_docs():
            if want is not None and want != str(core["dp_rank"]):  # SGLang: a rank it lacks lists nothing
                continue
            doc = dict(core)
            if include & {"all", "memory"}:
                doc["memory"] = {"weight_gb": 125.0, "kv_cache_gb": 30.0, "graph_gb": 1.2,
                                 "token_capacity": load.capacity_tokens}
            if include & {"all", "spec"} and load.spec_accept_length > 1.0:
                a = load.spec_accept_length
                doc["speculative"] = {"accept_length": a, "accept_rate": round((a - 1) / a, 4)}
            if include & {"all", "queues"}:
                doc["queues"] = {"waiting": load.queued, "grammar": 0, "paused": 0, "retracted": 0,
                                 "prealloc_ready": 0}
            docs.append(doc)
        if request.query.get("format") == "prometheus":
            return web.Response(text=_loads_prometheus(docs), content_type="text/plain")
        return _json({"timestamp": datetime.now(UTC).isoformat(), "version": SGLANG_VERSION,
                      "accelerator": "NVIDIA B200 (emulated)", "num_accelerators": self.cfg.profile.tp_size,
                      "loads": docs})

    async def get_load(self, request: web.Request) -> web.Response:
        fmt = self.cfg.get_load_format
        if fmt == "off":
            raise web.HTTPNotFound()
        docs = [d for d, _ in self._load_docs()]
        if fmt == "vllm":
            return _json({"load": sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in docs)})
        return _json([{"dp_rank": d["dp_rank"], "num_reqs": d["num_running_reqs"],
                       "num_waiting_reqs": d["num_waiting_reqs"], "num_tokens": d["num_used_tokens"],
                       "num_pending_tokens": d["num_waiting_uncached_tokens"], "ts_tic": d["timestamp"]}
                      for d in docs])

    async def metrics(self, request: web.Request) -> web.Response:
        self.rep.poll()
        return web.Response(body=self.rep.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def flush_cache(self, request: web.Request) -> web.Response:
        rep = self.rep
        rep.poll()
        # every rank's cache or none: a running request anywhere refuses it, as in SGLang
        if rep.flights or not all([r.cache.flush() for r in rep.ranks]):  # noqa: C419 (flush each)
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
        rep.publish_kv_events()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
        except _ClientError as exc:
            return _json({"error": {"message": str(exc)}}, 400)
        if body.get("abort_all"):
            for rid in list(self.rep.flights):
                self.rep.abort(rid)
        elif isinstance(body.get("rid"), str):
            self.rep.abort(body["rid"])
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            if isinstance(body.get("messages"), list):
                tools = body.get("tools")
                prompt = encode_text(render_chat(body["messages"], tools if isinstance(tools, list) else None))
            elif isinstance(body.get("prompt"), str):
                prompt = encode_text(body["prompt"])
            else:
                raise _ClientError("prompt (string) or messages (list) is required")
        except (_ClientError, ValueError) as exc:
            return _openai_error(str(exc), 400)
        ids = token_ids(prompt)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": self.cfg.profile.max_context_tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise _ClientError("tokens (list of ints) is required")
            text = decode_ids(tokens)
        except (_ClientError, ValueError) as exc:
            return _openai_error(str(exc), 400)
        return _json({"text": text})

    # ---- emulator hooks ------------------------------------------------------------------
    async def get_faults(self, request: web.Request) -> web.Response:
        return _json(self.rep.faults.to_json())

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            known = {f.name for f in dataclasses.fields(Faults)}
            bad = set(body) - known
            if bad:
                raise _ClientError(f"unknown fault fields: {sorted(bad)}; known: {sorted(known)}")
            f = Faults(**body)
            if f.status is not None and not (isinstance(f.status, int) and 400 <= f.status <= 599):
                raise _ClientError("status must be an HTTP error status (400-599)")
            if f.health_status is not None and not isinstance(f.health_status, int):
                raise _ClientError("health_status must be an integer")
            if not isinstance(f.slow_factor, int | float) or f.slow_factor <= 0:
                raise _ClientError("slow_factor must be > 0")
            if f.break_after_chunks is not None and (not isinstance(f.break_after_chunks, int) or f.break_after_chunks < 0):
                raise _ClientError("break_after_chunks must be an integer >= 0")
        except (_ClientError, TypeError) as exc:
            return _openai_error(str(exc), 400)
        self.rep.faults = f
        self.rep.set_slow_factor(float(f.slow_factor))
        return _json(f.to_json())

    async def clear_faults(self, request: web.Request) -> web.Response:
        self.rep.faults = Faults()
        self.rep.set_slow_factor(1.0)
        return _json(self.rep.faults.to_json())

    async def state(self, request: web.Request) -> web.Response:
        return _json(self.rep.state())


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 404:
            return _json({"detail": "Not Found"}, 404)
        if exc.status == 405:
            return _json({"detail": "Method Not Allowed"}, 405)
        if exc.status == 413:
            return _openai_error("Request body too large", 413, "BadRequestError")
        raise


def _auth_middleware(api_key: str) -> Any:
    """SGLang's ``--api-key``: a bearer token on everything but probes and the emulator's own routes."""

    @web.middleware
    async def auth(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        p = request.path
        if request.method == "OPTIONS" or p.startswith(("/health", "/ready", "/metrics", "/_emulator")):
            return await handler(request)
        if request.headers.get("Authorization") != f"Bearer {api_key}":
            return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    return auth


def make_emulator_app(config: EmulatorConfig) -> web.Application:
    """An aiohttp app serving one emulated replica (the engine task runs while the app runs)."""
    middlewares: list[Any] = [_errors_middleware]
    if config.api_key:
        middlewares.append(_auth_middleware(config.api_key))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    rep = Replica(config)
    app[REPLICA_KEY] = rep
    h = _Handlers(rep)

    async def lifecycle(app_: web.Application) -> Any:
        rep.start()
        yield
        await rep.stop()

    app.cleanup_ctx.append(lifecycle)

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Emulator-Replica"] = config.name

    app.on_response_prepare.append(tag)

    r = app.router
    r.add_post("/v1/chat/completions", h.chat)
    r.add_post("/v1/completions", h.completions)
    r.add_post("/v1/messages", h.messages)
    r.add_post("/v1/messages/count_tokens", h.count_tokens)
    r.add_post("/v1/responses", h.create_response)
    r.add_get("/v1/responses/{response_id}", h.retrieve_response)
    r.add_post("/v1/responses/{response_id}/cancel", h.cancel_response)
    r.add_post("/generate", h.generate)
    r.add_put("/generate", h.generate)
    r.add_get("/health", h.health)
    r.add_get("/health_generate", h.health_generate)
    r.add_get("/ready", h.health)
    r.add_get("/ping", h.health)
    r.add_get("/v1/models", h.models)
    r.add_get("/v1/models/{model:.+}", h.model)
    r.add_get("/model_info", h.model_info)
    r.add_get("/get_model_info", h.model_info)
    r.add_get("/server_info", h.server_info)
    r.add_get("/get_server_info", h.server_info)
    r.add_get("/v1/loads", h.loads)
    r.add_get("/get_load", h.get_load)
    r.add_get("/metrics", h.metrics)
    r.add_get("/flush_cache", h.flush_cache)
    r.add_post("/flush_cache", h.flush_cache)
    r.add_post("/abort_request", h.abort_request)
    for path, handler in (("/open_session", h.open_session), ("/close_session", h.close_session)):
        r.add_get(path, handler)
        r.add_post(path, handler)
    for path in ("/tokenize", "/v1/tokenize"):
        r.add_post(path, h.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        r.add_post(path, h.detokenize)
    r.add_get("/_emulator/faults", h.get_faults)
    r.add_post("/_emulator/faults", h.set_faults)
    r.add_delete("/_emulator/faults", h.clear_faults)
    r.add_get("/_emulator/state", h.state)
    return app

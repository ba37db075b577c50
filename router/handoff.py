"""Warm hand-off of a draining replica's sessions (opt-in).

When a replica drains, its sessions move at their next turn (docs/POLICY.md, rule 5) and that turn pays a
cold re-prefill of the whole context (~4-7 s for 100k tokens on the reference replica). A coding
session is idle most of its wall time (think time, tool calls), so the gateway can use that idle time:
for every idle session homed on a draining replica, it asks the policy where the session should go
(the same ``route()`` the next turn would run: the draining home is not eligible, so this is a
load-aware re-placement), binds the session there, and sends the session's *last prompt* with one
output token to the new replica. The next turn then finds its prefix in the new replica's cache.

Whether it helped is counted: the session's next turn on the hand-off target reports cached tokens
of at least ``help_ratio`` x the warmed prompt -> ``helped``; fewer -> ``not_helped``; the next turn
went elsewhere or failed -> ``missed``.

Pieces:
  - :func:`warmup_body` (PURE): the last request body -> the same prompt with one output token,
    non-streaming.
  - :class:`PromptBook`: the last request body per session (bounded LRU), recorded by
    :class:`CapturingClient`, a ``ReplicaClient`` wrapper that sees every upstream request and the
    session id the gateway forwards under its routing-key header.
  - :class:`HandoffManager`: the background loop + the ``RequestFinished`` hook that counts help.
  - :func:`handoff_setup`: an ``extra_setup`` for ``make_app``/``start_gateway`` wiring all of it.

With several gateways only the one that served a session's last turn holds its prompt, so hand-offs
are naturally not duplicated; a duplicate (session moved between gateways) only warms the same target
twice, because the first hand-off already rebound the session.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from router.errors import KvrouteError
from router.eventloop import stop_tasks
from router.events import Event, RequestFinished
from router.gateway.forward import DP_RANK_HEADER, usage_from_json
from router.model import Completion, KeySource, ReplicaStatus, SessionState
from router.route_input import route_request

__all__ = [
    "HANDOFF_KEY",
    "CapturingClient",
    "HandoffConfig",
    "HandoffManager",
    "HandoffStats",
    "PromptBook",
    "handoff_setup",
    "warmup_body",
]

log = logging.getLogger("kvroute.handoff")

# every inference route a session's turn can take (router.gateway.handlers.INFERENCE_ROUTES)
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/v1/responses")


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    interval_s: float = 0.5  # how often draining replicas are scanned
    max_concurrent: int = 4  # warm-up requests in flight at once (they cost prefill on the target)
    max_sessions: int = 10_000  # prompts remembered (LRU)
    max_prompt_bytes: int = 16 * 1024 * 1024
    timeout_s: float = 120.0  # one warm-up request (a cold prefill of a long context)
    help_ratio: float = 0.5  # next turn's cached tokens / warmed prompt tokens that counts as "helped"

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.max_concurrent < 1 or self.max_sessions < 1 or self.timeout_s <= 0:
            raise ValueError("interval_s, timeout_s > 0; max_concurrent, max_sessions >= 1")
        if not 0 < self.help_ratio <= 1:
            raise ValueError("help_ratio must be in (0, 1]")


@dataclass(slots=True)
class HandoffStats:
    sent: int = 0  # warm-up requests that completed (2xx)
    failed: int = 0  # warm-up requests that failed
    skipped_no_prompt: int = 0  # idle sessions on a draining replica whose prompt this gateway lacks
    skipped_unwarmable: int = 0  # whose last prompt cannot run elsewhere (warmup_body: None)
    skipped_no_target: int = 0  # the policy had nowhere else to put the session
    helped: int = 0
    not_helped: int = 0
    missed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


# ---- pure ------------------------------------------------------------------------------------------


def warmup_body(route: str, body: bytes) -> bytes | None:
    """The same prompt with exactly one output token, not streamed, stored nowhere. ``None`` if it
    cannot be replayed on another replica: not a JSON object, or it names what lives on the old one
    only (an SGLang engine session's ``session_params``, a stored response's
    ``previous_response_id``)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("session_params") or doc.get("previous_response_id"):
        return None
    doc["stream"] = False
    doc.pop("stream_options", None)
    if route == "/generate":
        sp = doc.get("sampling_params")
        sp = dict(sp) if isinstance(sp, dict) else {}
        sp["max_new_tokens"] = 1
        sp.pop("min_new_tokens", None)
        sp["n"] = 1
        doc["sampling_params"] = sp
    elif route == "/v1/messages":
        doc["max_tokens"] = 1  # thinking stays: it shapes the prompt's template, and SGLang allows it
    elif route == "/v1/responses":
        doc["max_output_tokens"] = 3  # SGLang keeps 2 of it for BOS/EOS: one token is generated
        doc["store"] = False  # nobody will ask for this response
        doc["background"] = False
    else:
        doc["max_tokens"] = 1
        if "max_completion_tokens" in doc:
            doc["max_completion_tokens"] = 1
        doc.pop("min_tokens", None)
        doc["n"] = 1  # tools, system prompt, messages stay: they are the prefix to warm
    return json.dumps(doc, separators=(",", ":")).encode()


# ---- the prompt book and the capturing client ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Prompt:
    replica_id: str
    route: str
    body: bytes


class PromptBook:
    """The last request body per session (bounded, least recently updated forgotten first)."""

    def __init__(self, max_sessions: int, max_bytes: int) -> None:
        self._max = max_sessions
        self._max_bytes = max_bytes
        self._items: OrderedDict[str, _Prompt] = OrderedDict()

    def record(self, session_id: str, replica_id: str, route: str, body: bytes) -> None:
        if route not in _ROUTES or len(body) > self._max_bytes:
            return
        self._items[session_id] = _Prompt(replica_id, route, body)
        self._items.move_to_end(session_id)
        while len(self._items) > self._max:
            self._items.popitem(last=False)

    def get(self, session_id: str) -> _Prompt | None:
        return self._items.get(session_id)

    def __len__(self) -> int:
        return len(self._items)


class CapturingClient:
    """``ReplicaClient`` wrapper: records each session's last prompt, then delegates."""

    def __init__(self, inner: Any, book: PromptBook, session_header: str) -> None:
        self.inner = inner
        self.book = book
        self._header = session_header.lower()

    async def send(
        self, replica_id: str, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> Any:
        if method == "POST":
            for name, value in headers:
                if name.lower() == self._header:
                    self.book.record(value, replica_id, urlsplit(url).path, body)
                    break
        return await self.inner.send(replica_id, method, url, headers, body)

    async def fetch(
        self, replica_id: str, url: str, *, accept: str | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        result: tuple[int, bytes] = await self.inner.fetch(
            replica_id, url, accept=accept, timeout_s=timeout_s
        )
        return result

    async def close(self) -> None:
        await self.inner.close()


# ---- the manager -----------------------------------------------------------------------------------


@dataclass(slots=True)
class HandoffManager:
    runtime: Any  # router.gateway.runtime.GatewayRuntime (typed loosely: no gateway import at module load)
    book: PromptBook
    config: HandoffConfig = field(default_factory=HandoffConfig)
    stats: HandoffStats = field(default_factory=HandoffStats)
    _pending: dict[str, tuple[str, int]] = field(default_factory=dict)  # sid -> (target, prompt tokens)
    _busy: set[str] = field(default_factory=set)
    _skipped: set[str] = field(default_factory=set)  # counted as skipped while on a draining home
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _sem: asyncio.Semaphore | None = None

    # ---- hook: did it help? ----

    def __call__(self, event: Event) -> None:
        if not isinstance(event, RequestFinished) or event.session_id is None:
            return
        pending = self._pending.pop(event.session_id, None)
        if pending is None:
            return
        target, prompt_tokens = pending
        if not event.ok or event.replica_id != target:
            self.stats.missed += 1
        elif (
            event.cached_tokens is not None and event.cached_tokens >= self.config.help_ratio * prompt_tokens
        ):
            self.stats.helped += 1
        else:
            self.stats.not_helped += 1

    # ---- the loop ----

    async def scan_once(self) -> None:
        rt = self.runtime
        seen: set[str] = set()
        for rep in await rt.store.replicas():
            if rep.status is not ReplicaStatus.DRAINING:
                continue
            for sess in await rt.store.sessions_on(rep.id, limit=100_000):
                seen.add(sess.session_id)
                self._maybe_start(sess, rep.id)
        self._skipped &= seen  # a session skipped once is counted once while it stays on a draining home

    def _maybe_start(self, sess: SessionState, home: str) -> None:
        sid = sess.session_id
        if sess.in_flight_total > 0 or sid in self._busy or sid in self._pending or sid in self._skipped:
            return
        prompt = self.book.get(sid)
        body = warmup_body(prompt.route, prompt.body) if prompt is not None else None
        if prompt is None or body is None:
            self._skipped.add(sid)
            if prompt is None:
                self.stats.skipped_no_prompt += 1
            else:
                self.stats.skipped_unwarmable += 1
            return
        self._busy.add(sid)
        task = asyncio.create_task(self._handoff(sid, home, prompt.route, body), name=f"kvroute-handoff-{sid[:32]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handoff(self, sid: str, home: str, route: str, body: bytes) -> None:
        rt = self.runtime
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.max_concurrent)
        try:
            async with self._sem:
                snap = await rt.store.snapshot(sid)
                if snap.session is None or snap.session.home != home or snap.session.in_flight_total:
                    return  # moved or busy meanwhile: the next scan decides again
                req = route_request(sid, KeySource.HEADER, route=route, body_bytes=len(body), session=snap.session)
                decision = rt.policy.route(req, snap, rt.rng)
                if decision.replica_id == home:
                    self.stats.skipped_no_target += 1
                    return
                lease = await rt.store.acquire(decision, req)
                completion = Completion(ok=False)
                try:
                    completion = await self._warm(lease.replica_id, route, body, sid)
                finally:
                    await rt.store.release(lease, completion)
                if completion.ok:
                    self.stats.sent += 1
                    self._pending[sid] = (lease.replica_id, completion.prompt_tokens or len(body) // 4)
                    if len(self._pending) > self.config.max_sessions:  # sessions that never came back
                        del self._pending[next(iter(self._pending))]
                        self.stats.missed += 1
                    log.info("warm hand-off", extra={"session_replica_from": home, "to": lease.replica_id})
                else:
                    self.stats.failed += 1
        except KvrouteError as exc:
            self.stats.failed += 1
            log.warning("warm hand-off failed: %s", exc)
        finally:
            self._busy.discard(sid)

    async def _warm(self, replica_id: str, route: str, body: bytes, sid: str) -> Completion:
        rt = self.runtime
        rep = next((r for r in await rt.store.replicas() if r.id == replica_id), None)
        if rep is None or rt.client is None:
            return Completion(ok=False)
        headers = [("Content-Type", "application/json"), ("Accept", "application/json")]
        if rt.config.routing_key_header:
            headers.append((rt.config.routing_key_header, sid))
        if rep.dp_rank is not None:  # a replica that is one rank of its engine: warm that rank
            headers.append((DP_RANK_HEADER, str(rep.dp_rank)))
        client = rt.client.inner if isinstance(rt.client, CapturingClient) else rt.client
        async with asyncio.timeout(self.config.timeout_s):
            resp = await client.send(replica_id, "POST", rep.url + route, headers, body)
        try:
            async with asyncio.timeout(self.config.timeout_s):
                raw = await resp.read(1 << 22)
        except BaseException:
            resp.abort()
            raise
        resp.release()
        try:
            usage = usage_from_json(json.loads(raw))
        except (ValueError, UnicodeDecodeError):
            usage = None
        ok = 200 <= resp.status < 300
        if usage is None:
            return Completion(ok=ok, started_output=False)
        return Completion(
            ok=ok,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            started_output=False,
        )

    async def run(self) -> None:
        while True:
            try:
                await self.scan_once()
            except (KvrouteError, OSError) as exc:  # a store hiccup must not end the loop
                log.warning("hand-off scan failed: %s", exc)
            await asyncio.sleep(self.config.interval_s)

    async def close(self) -> None:
        await stop_tasks(*self._tasks)


HANDOFF_KEY: web.AppKey[HandoffManager] = web.AppKey("kvroute_handoff", HandoffManager)


def handoff_setup(config: HandoffConfig | None = None) -> Callable[[web.Application], None]:
    """``extra_setup`` for ``make_app``/``start_gateway``: warm hand-off of draining replicas' sessions.

    Needs the gateway to forward session ids upstream (``routing_key_header`` non-empty, the default).
    The manager is ``app[HANDOFF_KEY]``; its ``stats`` are the counters.
    """
    cfg = config or HandoffConfig()

    def setup(app: web.Application) -> None:
        from router.gateway.runtime import EMITTER_KEY, RUNTIME_KEY

        rt = app[RUNTIME_KEY]
        if not rt.config.routing_key_header:
            log.warning("warm hand-off disabled: routing_key_header is empty (session ids are not forwarded)")
            return
        book = PromptBook(cfg.max_sessions, cfg.max_prompt_bytes)
        manager = HandoffManager(rt, book, cfg)
        app[HANDOFF_KEY] = manager
        app[EMITTER_KEY].add(manager)

        async def ctx(app: web.Application) -> AsyncIterator[None]:
            # runs after the gateway's own contexts: the upstream client exists now
            if rt.client is not None and not isinstance(rt.client, CapturingClient):
                rt.client = CapturingClient(rt.client, book, rt.config.routing_key_header)
            task = asyncio.create_task(manager.run(), name="kvroute-handoff")
            yield
            await stop_tasks(task)
            await manager.close()

        app.cleanup_ctx.append(ctx)

    return setup

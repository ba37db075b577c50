"""Request handlers: session key -> snapshot -> ``policy.route`` -> ``store.acquire`` -> forward ->
``store.release``, with bounded retry before the first byte.

Rules:
  1. The body is parsed only when there is no session header (the prefix key needs the prompt);
     otherwise it is forwarded without being looked at.
  2. Requests go only to replicas registered in the store, by their registered URL. The client's
     Host header and any absolute URL in the request line are ignored.
  3. ``store.release`` runs exactly once per ``store.acquire``, in a ``finally``, shielded from a
     second cancellation: completed, failed, retried, client gone - the load is always released.
  4. Retry: a connect error, timeout, broken body or 5xx *before the first byte reached the client*
     releases the lease (``ok=False``), excludes the replica and routes again, at most
     ``max_retries`` times. After the first byte nothing is retried: an SSE stream ends with a
     parseable error event and ``data: [DONE]``; any other body is cut off by closing the
     connection (its status is already sent; a client sees a truncated body, never a wrong one).
  5. The response is committed (status + headers sent) only when the first upstream body chunk
     arrived, so a replica that accepts the request and dies during prefill is still retried. A
     Responses API stream opens with two lifecycle events sent before the prefill: they are held
     until the first token's event, for the same reason.
  6. Client disconnect: the handler is cancelled (``handler_cancellation``) or its next write
     fails; either way the upstream response is closed at once (SGLang aborts the request) and
     the lease is released.
  7. With tracing on (``runtime.tracer``), each upstream request gets a client span and carries its
     W3C ``traceparent``, whichever ``ReplicaClient`` sends it: observing changes no code path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.config import GatewayConfig
from router.errors import (
    BadRequestError,
    KvrouteError,
    NoReplicaError,
    ReplicaNotFoundError,
    StaleSessionError,
    StoreError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    error_body,
)
from router.events import (
    AffinityBroken,
    RequestFinished,
    RequestRouted,
    ResidencyJudged,
    StoreDegraded,
    UpstreamRetry,
)
from router.gateway.background import running_response
from router.gateway.bodies import body_string, checked_session_id, parse_body
from router.gateway.engine_sessions import SESSION_ROUTES, EngineSessionCall, engine_session_call
from router.gateway.forward import (
    DP_RANK_FIELD,
    DP_RANK_FIELDS,
    DP_RANK_HEADER,
    UpstreamResponse,
    Usage,
    UsageSniffer,
    filter_headers,
    is_connect_failure,
    request_drop_set,
    response_drop_set,
    usage_from_json,
    with_first_field,
)
from router.gateway.middleware import REQUEST_ID_HEADER, REQUEST_ID_KEY, read_body_limited
from router.gateway.residency import with_session_id
from router.gateway.runtime import RUNTIME_KEY, GatewayRuntime
from router.gateway.stored_responses import (
    gone,
    keeps_response,
    pin_response,
    previous_response_id,
    response_id_in,
)
from router.model import (
    AffinityBreak,
    ClusterSnapshot,
    Completion,
    KeySource,
    Lease,
    PinKind,
    Reason,
    ReplicaId,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
)
from router.policy.breaks import classify_break, home_found
from router.policy.hashing import hrw_slot
from router.policy.params import PolicyParams
from router.policy.prefill import expected_uncached
from router.policy.prefix_key import chain_key, prefix_key
from router.residency import ResidencyIndex, with_residency
from router.route_input import route_request

__all__ = [
    "COUNT_TOKENS_ROUTE",
    "INFERENCE_ROUTES",
    "MESSAGES_ROUTE",
    "REASON_HEADER",
    "REPLICA_HEADER",
    "RESPONSES_ROUTE",
    "handle_health",
    "handle_inference",
    "handle_models",
    "handle_ready",
    "serve_inference",
    "session_id_from_headers",
    "sse_error_event",
]

log = logging.getLogger("kvroute.gateway")

MESSAGES_ROUTE = "/v1/messages"  # Anthropic's Messages API, as SGLang serves it
RESPONSES_ROUTE = "/v1/responses"  # OpenAI's Responses API (Codex); its stored responses: stored_responses.py
INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", MESSAGES_ROUTE, RESPONSES_ROUTE)
COUNT_TOKENS_ROUTE = "/v1/messages/count_tokens"
# proxied like inference, but nothing is generated and nothing learnt from the answer
_CONTROL_ROUTES = (*SESSION_ROUTES, COUNT_TOKENS_ROUTE)
# where SGLang reads DP_RANK_HEADER; native /generate takes its rank in its body only (DP_RANK_FIELD)
_DP_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", MESSAGES_ROUTE, RESPONSES_ROUTE})
_GENERATE_ROUTE = "/generate"
REPLICA_HEADER = "X-Kvroute-Replica"
REASON_HEADER = "X-Kvroute-Reason"
# set by the gateway itself: a client's own values are dropped (X-Forwarded-For is extended)
_FORWARD_DROP = request_drop_set({REQUEST_ID_HEADER.lower(), "x-forwarded-for"})
# a replica's own decision headers (a kvroute behind kvroute) give way to ours
_RELAY_DROP = response_drop_set()
_RELAY_DROP_DECIDED = response_drop_set({REPLICA_HEADER.lower(), REASON_HEADER.lower()})
_REQUEST_ID_LOWER = REQUEST_ID_HEADER.lower()
_DP_RANK_LOWER = DP_RANK_HEADER.lower()
_ERROR_BODY_LIMIT = 64 * 1024
_FINISHED = frozenset({"completed", "incomplete"})  # a Responses API run that produced its answer
_MAX_STALE_REROUTES = 3  # a session moved by other gateways between our snapshot and acquire


def session_id_from_headers(headers: Mapping[str, str], cfg: GatewayConfig) -> str | None:
    """The session id from the first configured header present; ``BadRequestError`` if it is bad."""
    for name in cfg.session_headers:
        value = headers.get(name)
        if value is None:
            continue
        value = value.strip()
        if value:
            return checked_session_id(name, value, cfg)
    return None


def sse_error_event(
    message: str, code: int = 502, error_type: str = "upstream_error", *, route: str = "", sequence: int = 0
) -> bytes:
    """The gateway's last event of a stream it cannot finish: OpenAI's ``data:`` error and
    ``[DONE]``; on Anthropic's Messages API an ``error`` event (which ends its streams); on OpenAI's
    Responses API its ``error`` event, numbered ``sequence`` (the events relayed before it)."""
    if route == RESPONSES_ROUTE:
        doc = {"type": "error", "code": error_type, "message": message, "param": None, "sequence_number": sequence}
        return f"event: error\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()
    payload = json.dumps(error_body(message, error_type, code), separators=(",", ":"))
    if route == MESSAGES_ROUTE:
        return f"event: error\ndata: {payload}\n\n".encode()
    return f"data: {payload}\n\n".encode() + b"data: [DONE]\n\n"


def _prefix_params(policy: object) -> PolicyParams:
    params = getattr(policy, "params", None)
    return params if isinstance(params, PolicyParams) else PolicyParams()


def _chain_key(body: bytes, route: str, policy: object) -> str | None:
    """Which of its session's conversations a request continues (``RouteRequest.chain_key``); None
    when the body says nothing (the replica judges a malformed body, not the router)."""
    try:
        obj = parse_body(body)
        p = _prefix_params(policy)
        return chain_key(obj, route, p.prefix_block_chars, p.prefix_blocks)
    except (BadRequestError, RecursionError):  # RecursionError: an anchor too deep to render
        return None


def _refuse_empty_generate(body: bytes) -> None:
    """``/generate`` with an empty ``text`` is refused here: SGLang 0.5.23's scheduler crashes on it
    (a reshape of 0 elements; the whole server exits), and the gateway's retry would take the next
    replica down with it. A body that does not parse is the replica's to judge, as elsewhere."""
    try:
        obj = parse_body(body)
    except BadRequestError:
        return
    text, ids = obj.get("text"), obj.get("input_ids")
    empty_text = text == "" or (isinstance(text, list) and any(t == "" for t in text))
    empty_ids = ids == [] or (isinstance(ids, list) and any(i == [] for i in ids))
    if empty_text or empty_ids:
        raise BadRequestError("the input is empty: text and input_ids must not be empty")


def _samples_per_prompt(body: bytes) -> int:
    """How many outputs the engine makes of each prompt: the OpenAI routes' ``n``, or a ``/generate``
    body's ``sampling_params.n`` (SGLang's parallel sampling; a batch's list of sampling params
    shares one ``n``). 1 when absent or unreadable. Parsed only when the bytes mention it."""
    if b'"n"' not in body:
        return 1
    try:
        obj = parse_body(body)
    except BadRequestError:
        return 1
    sp = obj.get("sampling_params")
    if isinstance(sp, list):
        sp = sp[0] if sp else None
    n = sp.get("n") if isinstance(sp, dict) else obj.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _routing_key(
    session_id: str | None, body: bytes, route: str, policy: object, cfg: GatewayConfig
) -> tuple[str | None, KeySource]:
    """The session a request belongs to: the header's id; else the body's own ``session_id`` (SGLang's
    field: the engine names the blocks the request stores by it, so exact residency must read the
    session under that name); else its ``prompt_cache_key`` (OpenAI's field for keeping a
    conversation on one cache, which Codex and OpenAI SDK users set); else the prompt's prefix key
    (rule 7)."""
    if session_id is not None:
        return session_id, KeySource.HEADER
    obj = parse_body(body)
    for name in ("session_id", "prompt_cache_key"):
        named = obj.get(name)
        if isinstance(named, str) and named:  # other types are the replica's to refuse
            return checked_session_id(name, named, cfg), KeySource.BODY
    p = _prefix_params(policy)
    try:
        key = prefix_key(obj, route, p.prefix_block_chars, p.prefix_blocks)
    except RecursionError:  # valid JSON (orjson reads 1024 levels) too deep to render: no key
        key = None
    return key, (KeySource.PREFIX if key is not None else KeySource.NONE)


class _Relay:
    """The client side of one inference request on aiohttp's server: ``response`` is what the handler
    returns. Status and headers are held by ``begin`` and leave with the first body bytes (rule 5):
    a body that ends with its first piece goes out as one ``web.Response`` (head and body in one
    write); a longer one as a ``web.StreamResponse`` (chunked when its length is unknown)."""

    __slots__ = ("_headers", "_length", "_status", "request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self._status = 0
        self._headers: Sequence[tuple[str, str]] = ()
        self._length: int | None = None

    async def begin(self, status: int, headers: Sequence[tuple[str, str]], content_length: int | None) -> None:
        """Commit the status line and headers (``content_length`` ``None``: chunked or streamed)."""
        self._status, self._headers, self._length = status, headers, content_length

    async def write(self, data: bytes) -> None:
        """One body piece; ``ConnectionResetError`` once the client is gone."""
        resp = self.response
        if resp is None:
            resp = self.response = web.StreamResponse(status=self._status, headers=CIMultiDict(self._headers))
            if self._length is not None:
                resp.content_length = self._length
            await resp.prepare(self.request)
        await resp.write(data)

    async def end(self, last: bytes) -> None:
        """The final body piece and the end of the response."""
        resp = self.response
        if resp is None:
            resp = self.response = web.Response(status=self._status, headers=CIMultiDict(self._headers), body=last)
            await resp.prepare(self.request)
            await resp.write_eof()
        else:
            await resp.write_eof(last)

    def cut(self) -> None:
        """Close the client connection now: a body that broke off after its status was sent."""
        if self.response is not None:
            self.response.force_close()
        transport = self.request.transport
        if transport is not None:
            transport.close()


@dataclass(slots=True)
class _Progress:
    """Mutable bookkeeping of one HTTP request (lives in one handler task)."""

    t0: float
    retries: int = 0
    status: int = 0
    sent: bool = False  # a byte of the response body or status reached the client
    stream: bool = False
    ttft_s: float | None = None
    upstream_wait_s: float = 0.0
    write_wait_s: float = 0.0
    client_gone: bool = False
    ok: bool = False
    error: str | None = None
    replica_id: str | None = None
    reason: Reason | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    usage_estimated: bool = False
    breaks: tuple[AffinityBreak, ...] = ()
    residency: str = ""  # the last decision's RouteDecision.residency (reported with its break)
    resident_tokens: int | None = None  # the session's own tokens the events showed at its home then
    error_content_type: str = ""  # of the last replica error body (relayed when retries run out)


@dataclass(slots=True)
class _Answer:
    """A replica's answer being read: its chunks, what the sniffer has seen, the first piece."""

    upstream: UpstreamResponse
    chunks: AsyncIterator[bytes]
    sniffer: UsageSniffer
    first_token_event: int  # events before the first token's (0: the first chunk carries it)
    first: bytes | None = None
    fed: bool = False  # ``first`` was fed to the sniffer already


def panic_snapshot(snap: ClusterSnapshot, excluded: frozenset[str]) -> ClusterSnapshot | None:
    """PURE. ``snap`` with its DOWN replicas shown ACTIVE, for a request the policy could place
    nowhere; ``None`` when no DOWN replica is left outside ``excluded``. Health is a guess (a slow
    probe, a blip): when it rules out the whole fleet, the replicas are likelier alive than not,
    and sending the request beats a certain 503 (Envoy's panic threshold). The policy still picks,
    so a session goes back to its home and affinity survives a false alarm."""
    if not any(r.status is ReplicaStatus.DOWN and r.id not in excluded for r in snap.replicas):
        return None
    shown = tuple(
        replace(r, status=ReplicaStatus.ACTIVE) if r.status is ReplicaStatus.DOWN else r for r in snap.replicas
    )
    return replace(snap, replicas=shown)


class _Proxy:
    """Routes and forwards one inference request."""

    def __init__(
        self,
        downstream: _Relay,
        request_id: str,
        rt: GatewayRuntime,
        body: bytes,
        req: RouteRequest,
        fwd_headers: list[tuple[str, str]],
        prog: _Progress,
        call: EngineSessionCall | None = None,
        pin: ReplicaId | None = None,
        continues: str | None = None,
    ) -> None:
        self.ds = downstream
        self.rt = rt
        self.cfg = rt.config
        self.body = body
        self.req = req
        self.fwd_headers = fwd_headers
        self.p = prog
        self.request_id = request_id
        self.call = call  # an SGLang engine session this request opens, uses or closes
        self.pin = pin  # the replica that engine session or stored response lives on: the only one tried
        self.continues = continues  # the stored response this request continues (previous_response_id)
        self.prompt_bytes = 0 if continues else len(body)  # a continuation's body is not its prompt
        self._tagged: bytes | None = None  # the body with the session id (kv_events.forward_session_id)
        # behind KV events, a header session whose body names another session_id: the engine names
        # this request's blocks by the body's id, so residency is read under it
        self._engine_id: str | None = None
        if rt.residency is not None and req.key_source is KeySource.HEADER:
            named = body_string(body, "session_id")  # SGLang's own field
            self._engine_id = named if named != req.session_key else None
        self._chain: tuple[str | None] | None = None  # RouteRequest.chain_key, once computed

    def _chain_key(self) -> str | None:
        """Parsed and hashed at most once per request, and only when the policy needs it."""
        if self._chain is None:
            self._chain = (_chain_key(self.body, self.req.route, self.rt.policy),)
        return self._chain[0]

    async def run(self) -> None:
        excluded: set[str] = set()
        last_error: UpstreamError | None = None
        attempt = 0
        stale = 0
        while True:
            snap, req = await self._snapshot(excluded)
            panicked = False
            if self.pin is not None:
                if snap.replica(self.pin) is None:
                    if self.call is not None:
                        raise await self.call.replica_gone(self.rt.store, self.pin)
                    raise await gone(self.rt, self.continues or "", self.pin, "previous_response_id")
                decision = RouteDecision(self.pin, Reason.PINNED)  # what it names exists there only
            else:
                try:
                    decision, panicked = self._choose(req, snap)
                except NoReplicaError:
                    if last_error is not None:
                        return await self._give_up(last_error)
                    raise
            try:
                lease = await self.rt.store.acquire(decision, req)
            except StaleSessionError:  # another gateway moved the session: decide again on fresh state
                stale += 1
                if stale > _MAX_STALE_REROUTES:
                    raise NoReplicaError("the session's home kept changing under this gateway") from None
                continue
            except ReplicaNotFoundError:  # the chosen replica was removed between snapshot and acquire
                excluded.add(decision.replica_id)
                continue
            self._routed(snap, req, decision, lease, attempt, panicked)
            self.rt.prefill.sent(lease.lease_id, lease.replica_id, expected_uncached(req, snap, lease.replica_id))
            can_retry = attempt < self.cfg.max_retries and self.pin is None
            try:
                return await self._attempt(lease, snap.replica(lease.replica_id), can_retry)
            except UpstreamError as exc:
                if self.p.sent:
                    raise
                last_error = exc
                await self._failed(lease.replica_id, exc)
                if not can_retry:
                    return await self._give_up(exc)
                excluded.add(lease.replica_id)
                attempt += 1
                self.p.retries = attempt
                self.rt.emit(
                    UpstreamRetry(
                        request_id=self.request_id,
                        at=self.rt.clock.now(),
                        replica_id=lease.replica_id,
                        attempt=attempt,
                        error=exc.code,
                    )
                )
                log.info("retrying after %s on %s (attempt %d)", exc.code, lease.replica_id, attempt)

    async def _snapshot(self, excluded: set[str]) -> tuple[ClusterSnapshot, RouteRequest]:
        """The state this attempt is decided on, and the request as the policy sees it then."""
        snap = await self.rt.store.snapshot(self.req.session_key)
        if self._engine_id is not None and snap.session is not None and self.rt.residency is not None:
            snap = replace(snap, session=with_residency(snap.session, self.rt.residency.view, self._engine_id))
        snap = self.rt.prefill.with_ahead(snap, others=self.rt.discovery is not None and self.rt.discovery.others_live)
        req = self.req = route_request(
            self.req.session_key,
            self.req.key_source,
            route=self.req.route,
            body_bytes=self.req.body_bytes,
            session=snap.session,
            excluded=frozenset(excluded),
            chain_key=self._chain_key if self.req.key_source.named else None,
        )
        return snap, req

    def _choose(self, req: RouteRequest, snap: ClusterSnapshot) -> tuple[RouteDecision, bool]:
        """The policy's decision, and whether it was panic routing: when every replica looks down,
        they are tried anyway rather than the client refused (as Envoy does); a refused connection
        still excludes one per attempt. ``NoReplicaError`` when not even a DOWN one is left."""
        try:
            return self.rt.policy.route(req, snap, self.rt.rng), False
        except NoReplicaError:
            panic = panic_snapshot(snap, req.excluded)
            if panic is None:
                raise
            decision = self.rt.policy.route(req, panic, self.rt.rng)
            log.warning("no healthy replica: panic-routing to %s (DOWN)", decision.replica_id)
            return decision, True

    def _routed(
        self, snap: ClusterSnapshot, req: RouteRequest, decision: RouteDecision, lease: Lease, attempt: int, panic: bool
    ) -> None:
        self.p.replica_id, self.p.reason = lease.replica_id, lease.reason
        self.p.residency = decision.residency
        at_home = snap.session is not None and snap.session.home == lease.replica_id
        self.p.resident_tokens = snap.session.resident_tokens if at_home and snap.session else None
        self.rt.emit(
            RequestRouted(
                request_id=self.request_id,
                at=self.rt.clock.now(),
                route=req.route,
                replica_id=lease.replica_id,
                reason=lease.reason,
                key_source=req.key_source,
                session_id=req.session_key if req.key_source.named else None,
                attempt=attempt,
                disagreement=lease.disagreement,
                scores=decision.scores,
                residency=decision.residency,
                estimate_check=decision.estimate_check,
                panic=panic,
            )
        )

    async def _failed(self, replica_id: ReplicaId, exc: UpstreamError) -> None:
        """An attempt failed before the first byte: evidence against its replica for discovery."""
        discovery = self.rt.discovery
        if discovery is None:
            return
        if is_connect_failure(exc):
            await discovery.on_connect_error(replica_id, str(exc))
        else:  # answered badly or not in time: evidence against it (discovery rule 3)
            discovery.on_request_failure(replica_id, str(exc))

    @staticmethod
    async def _opening(
        first: bytes, chunks: AsyncIterator[bytes], upstream: UpstreamResponse, sniffer: UsageSniffer, events: int
    ) -> bytes:
        """A stream's first ``events`` events (or all of it, if shorter) as one piece, fed to
        ``sniffer``. A replica that fails meanwhile raises before the client has a byte."""
        held = [first]
        sniffer.feed(first)
        while sniffer.events < events and not upstream.at_eof():
            chunk = await anext(chunks, None)
            if chunk is None:
                break
            held.append(chunk)
            sniffer.feed(chunk)
        return b"".join(held) if len(held) > 1 else first

    async def _give_up(self, exc: UpstreamError) -> None:
        """Every attempt failed before the first byte. A replica's own 5xx answer is relayed as it
        was (status and body); connect errors and timeouts become OpenAI-style 502/504 JSON."""
        if isinstance(exc, UpstreamStatusError) and exc.body:
            self.p.status = exc.upstream_status
            headers = [("Content-Type", self.p.error_content_type or "application/json")]
            if self.cfg.decision_headers and self.p.replica_id is not None and self.p.reason is not None:
                headers += _decision_headers(self.p.replica_id, self.p.reason)
            headers.append((REQUEST_ID_HEADER, self.request_id))
            await self.ds.begin(exc.upstream_status, headers, len(exc.body))
            self.p.sent = True
            await self.ds.end(exc.body)
            return
        raise exc

    async def _attempt(self, lease: Lease, state: ReplicaState | None, can_retry: bool) -> None:
        upstream: UpstreamResponse | None = None
        answer: _Answer | None = None
        ask_stores: str | None = None  # the replica's URL, when whether it keeps responses is unknown
        running: str | None = None  # a background response's id: its engine runs it after the answer
        completion = Completion(ok=False)
        flights = self.rt.rank_flights
        dp_rank: int | None = None  # named to the engine: counted in flights until the finally
        try:
            # inside the try: whatever happens from here on, the finally releases the lease
            dp_rank = self._dp_rank(state)
            if dp_rank is not None:
                flights[lease.replica_id, dp_rank] += 1
            url = await self.rt.replica_url(lease.replica_id, state)
            if url is None:
                raise UpstreamConnectError(f"replica {lease.replica_id} is no longer registered")
            upstream = await self._send(lease, url + self.req.route, can_retry, dp_rank)
            answer = await self._open(upstream)
            # ---- commit: from here on the client has our status line -----------------------------
            keeps, ask_stores = self._keeps_response(lease, url, upstream.status)
            completion, running = await self._relay(lease, answer, keeps)
        except UpstreamError as exc:
            self.p.error = exc.code
            raise
        except asyncio.CancelledError:
            self.p.client_gone = True
            if answer is not None:
                completion = self._completion(answer.sniffer, ok=False)
            raise
        finally:
            self.rt.prefill.prefilled(lease.lease_id)
            if dp_rank is not None:
                flights[lease.replica_id, dp_rank] -= 1
                if not flights[lease.replica_id, dp_rank]:
                    del flights[lease.replica_id, dp_rank]
            if upstream is not None:
                upstream.abort()  # unless read to its end: closes the connection, the engine aborts the request
            completion = dataclasses.replace(completion, started_output=self.p.sent)
            if running is not None:  # its load stays until the engine has run it (background.py)
                self.body, self._tagged = b"", None  # not kept alive for the run (a Codex body: 100s of kB)
                await self.rt.background.hold(self.rt, lease.replica_id, running, functools.partial(self._ran, lease))
            else:
                await self._release(lease, completion)
            if completion.ok and ask_stores is not None and self.rt.client is not None:
                await self.rt.response_stores.learn(self.rt.client, lease.replica_id, ask_stores, self.rt.clock.now())

    def _dp_rank(self, state: ReplicaState | None) -> int | None:
        """The data-parallel rank for a session's request to an engine with several (each its own
        cache): the session's own, so that its turns meet their cache rather than the engine's round
        robin, which scatters a session over every rank. Where the engine's KV events are followed,
        the rank holding the session's cache, or for a session cached on none the rank with the
        fewest of this gateway's requests in flight (then the one holding least); else the
        session's rendezvous rank. A replica that is one rank of its engine (``dp_rank``) is placed
        by the policy like any other: its rank. ``None``: one rank, no session, or the client
        named a rank itself."""
        if state is None or (state.dp_rank is None and state.engine.dp_ranks <= 1) or self._names_rank():
            return None  # (one rank: the body is not scanned)
        if state.dp_rank is not None:
            return state.dp_rank
        key = self.req.session_key
        if key is None:
            return None
        svc = self.rt.residency
        if svc is not None and isinstance(svc.view, ResidencyIndex):
            # the name the engine stores this request's blocks under (a body's own session_id wins)
            n = state.engine.dp_ranks
            busy = [self.rt.rank_flights[state.id, i] for i in range(n)]
            rank = svc.view.rank_for(state.id, self._engine_id or key, busy)
            if rank is not None:
                return rank
        return hrw_slot(key, state.engine.dp_ranks)

    def _names_rank(self) -> bool:
        """Whether the rank is not ours to name: a route the engine takes no rank on, or a client
        that named one (the header, or on ``/generate`` the body)."""
        route = self.req.route
        if route == _GENERATE_ROUTE:
            return any(f in self.body for f in DP_RANK_FIELDS)
        return route not in _DP_ROUTES or any(name.lower() == _DP_RANK_LOWER for name, _ in self.fwd_headers)

    async def _send(self, lease: Lease, target: str, can_retry: bool, dp_rank: int | None = None) -> UpstreamResponse:
        """The request sent, its status line and headers in. A 5xx that may be retried elsewhere is
        raised (with its body, relayed if no retry is left)."""
        clock = self.rt.clock
        client = self.rt.client
        assert client is not None, "gateway client not started"
        tracer = self.rt.tracer
        span = tracer.start("POST", target) if tracer is not None else None
        headers = self.fwd_headers if span is None else [*self.fwd_headers, *span.headers]
        body = self._body_for(lease)
        if dp_rank is not None and self.req.route == _GENERATE_ROUTE:
            body = with_first_field(body, DP_RANK_FIELD, dp_rank, DP_RANK_FIELDS)
        elif dp_rank is not None:
            headers = [*headers, (DP_RANK_HEADER, str(dp_rank))]
        t = clock.now()
        try:
            upstream = await client.send(lease.replica_id, "POST", target, headers, body)
        except BaseException as exc:
            if span is not None:
                span.fail(exc)
            raise
        finally:
            self.p.upstream_wait_s += clock.now() - t
        if span is not None:
            span.end(upstream.status)
        try:
            if upstream.status >= 500 and can_retry:
                t = clock.now()
                try:
                    err_body = await upstream.read(_ERROR_BODY_LIMIT)
                finally:
                    self.p.upstream_wait_s += clock.now() - t
                self.p.error_content_type = upstream.content_type
                raise UpstreamStatusError(
                    f"replica {lease.replica_id} answered {upstream.status}", upstream.status, err_body
                )
            if self.rt.discovery is not None:
                self.rt.discovery.on_success(lease.replica_id)
            if self.call is not None:  # pinned or unpinned before the client has the answer
                await self.call.answered(self.rt.store, lease.replica_id, upstream.status)
        except BaseException:
            upstream.abort()  # the caller never holds this answer: it is closed here
            raise
        return upstream

    async def _open(self, upstream: UpstreamResponse) -> _Answer:
        """The answer's first piece read. A replica that fails meanwhile raises before the client has
        a byte (so the request may still be retried)."""
        sniffer = UsageSniffer(upstream.content_type)
        # SGLang opens a Responses API stream with two lifecycle events before the prefill: the first
        # token comes with the third event (TTFT counts from the first chunk elsewhere)
        first_token_event = 3 if self.req.route == RESPONSES_ROUTE else 0
        answer = _Answer(upstream, upstream.chunks().__aiter__(), sniffer, first_token_event)
        clock = self.rt.clock
        t = clock.now()
        try:
            answer.first = await anext(answer.chunks, None)
            if answer.first is not None and first_token_event > 0 and sniffer.is_sse:
                # rule 5: held (and fed to the sniffer) until the first token's event
                answer.first = await self._opening(answer.first, answer.chunks, upstream, sniffer, first_token_event)
                answer.fed = True
        finally:
            self.p.upstream_wait_s += clock.now() - t
        return answer

    def _keeps_response(self, lease: Lease, url: str, status: int) -> tuple[bool, str | None]:
        """Whether the answer may hold a response the engine stored (its id is then pinned,
        stored_responses.py), and the replica's URL when whether it keeps any is not yet known. A
        replica known to keep nothing is not asked about, nor the body read for ``store``."""
        if self.req.route != RESPONSES_ROUTE or status != 200:
            return False, None
        known = self.rt.response_stores.keeps(lease.replica_id, self.rt.clock.now())
        keeps = known is not False and keeps_response(self.body)
        return keeps, (url if keeps and known is None else None)

    def _relay_headers(self, lease: Lease, upstream: UpstreamResponse) -> list[tuple[str, str]]:
        decided = self.cfg.decision_headers
        headers = filter_headers(upstream.headers, _RELAY_DROP_DECIDED if decided else _RELAY_DROP)
        if decided:
            headers += _decision_headers(lease.replica_id, lease.reason)
        # headers leave with the first chunk: the request id is set now
        if not any(k.lower() == _REQUEST_ID_LOWER for k, _ in headers):
            headers.append((REQUEST_ID_HEADER, self.request_id))
        return headers

    async def _relay(self, lease: Lease, answer: _Answer, keeps: bool) -> tuple[Completion, str | None]:
        """The answer relayed to the client from its first piece on: what it taught, and the id of a
        background response its engine runs on. A break after the first byte is never retried (rule
        4): a stream ends with an error event, any other body is cut."""
        clock = self.rt.clock
        upstream, sniffer, ds = answer.upstream, answer.sniffer, self.ds
        self.p.status = upstream.status
        self.p.stream = sniffer.is_sse
        last_tail = b""
        fed = answer.fed
        try:
            t = clock.now()
            length = upstream.content_length if not sniffer.is_sse else None
            await ds.begin(upstream.status, self._relay_headers(lease, upstream), length)
            self.p.sent = True
            chunk = answer.first
            last = b""  # the body's final piece: sent with the end of the response, one write
            while chunk is not None:
                if chunk:
                    if keeps and (response_id := response_id_in(chunk)) is not None:
                        keeps = False
                        await pin_response(self.rt, response_id, lease.replica_id)
                    if not fed:
                        sniffer.feed(chunk)
                    fed = False
                    if upstream.at_eof():
                        last = chunk
                        break
                    await ds.write(chunk)
                    last_tail = (last_tail + chunk)[-2:]
                self.p.write_wait_s += clock.now() - t
                if self.p.ttft_s is None and sniffer.events >= answer.first_token_event:
                    self.p.ttft_s = clock.now() - self.p.t0
                    self.rt.prefill.prefilled(lease.lease_id)  # its prefill no longer waits ahead of others
                t = clock.now()
                try:
                    chunk = await anext(answer.chunks, None)
                finally:
                    self.p.upstream_wait_s += clock.now() - t
                t = clock.now()
            upstream.release()
            self.p.ok = 200 <= upstream.status < 300
            await ds.end(last)
            # learnt once the client has its last byte: usage parsing is off the latency path
            # (a client that hangs up during this last write still counts as not ok, below)
            completion = self._completion(sniffer, ok=self.p.ok)
            running = None
            if self.req.route == RESPONSES_ROUTE and completion.ok:
                running = running_response(sniffer.document())
            self.p.write_wait_s += clock.now() - t
            if self.p.ttft_s is None:
                self.p.ttft_s = clock.now() - self.p.t0
            return completion, running
        except UpstreamError as exc:
            self.p.error = exc.code
            log.warning("upstream %s broke mid-response: %s", lease.replica_id, exc)
            if self.rt.discovery is not None:
                self.rt.discovery.on_request_failure(lease.replica_id, str(exc))
            completion = self._completion(sniffer, ok=False)
            if sniffer.is_sse:
                sep = b"" if last_tail == b"\n\n" else b"\n\n"
                msg = f"upstream {lease.replica_id} failed mid-stream: {exc.code}"
                code = 504 if isinstance(exc, UpstreamTimeoutError) else 502
                await ds.end(sep + sse_error_event(msg, code, route=self.req.route, sequence=sniffer.events))
            else:
                ds.cut()
            return completion, None
        except ConnectionResetError:
            # the client went away while we wrote (handler not cancelled): stop at once
            self.p.client_gone = True
            return self._completion(sniffer, ok=False), None

    async def _release(self, lease: Lease, completion: Completion) -> None:
        """The lease's one release, and what the answer taught about the session's cache."""
        try:
            store = self.rt.store
            if getattr(store, "never_suspends", False):
                await store.release(lease, completion)  # no await point: nothing can cancel it
            else:
                await asyncio.shield(store.release(lease, completion))
        except StoreError as exc:  # the response is already decided: never fail it for this
            log.warning("store release failed for %s: %s", lease.replica_id, exc)
            self.rt.emit(StoreDegraded(at=self.rt.clock.now(), error=str(exc)))
        if completion.ok:
            self._judge_residency(lease, completion)

    async def _ran(self, lease: Lease, final: Mapping[str, Any] | None) -> None:
        """A background response's run ended (``final``: the response as its engine keeps it) or
        is no longer watched (``None``): its lease is released."""
        completion = Completion(ok=False, started_output=True)
        if final is not None and final.get("status") in _FINISHED:
            usage = usage_from_json(final)
            completion = Completion(ok=True, started_output=True)
            if usage is not None and usage.prompt_tokens is not None:
                completion = replace(self._learnt(usage, ok=True, samples=1), started_output=True)
        await self._release(lease, completion)

    def _body_for(self, lease: Lease) -> bytes:
        """The body, with the session's key in it for a replica whose KV events we follow: SGLang then
        names the session on the blocks the request stores (docs/KV_EVENTS.md). A prefix key too:
        a key with no blocks on a complete replica reads as a cache that is gone."""
        svc = self.rt.residency
        sid = self.req.session_key
        if (
            svc is None
            or sid is None
            or not self.cfg.kv_events.forward_session_id
            or not svc.subscribed(lease.replica_id)
        ):
            return self.body
        if self._tagged is None:
            self._tagged = with_session_id(self.body, sid)
        return self._tagged

    def _completion(self, sniffer: UsageSniffer | None, ok: bool) -> Completion:
        if self.req.route in _CONTROL_ROUTES:  # nothing was generated: nothing to learn
            return Completion(ok=ok)
        n = functools.cache(functools.partial(_samples_per_prompt, self.body))  # the body is parsed once
        usage = sniffer.result(n) if sniffer is not None else None
        if sniffer is not None and sniffer.errored:
            # the engine failed the request inside its 200 stream: relayed as it is, counted failed,
            # and nothing learnt (its usage, if any, counts a stand-in prompt)
            self.p.ok = False
            self.p.error = "upstream_error_event"
            return Completion(ok=False)
        if usage is not None and usage.prompt_tokens is not None:
            self.p.prompt_tokens = usage.prompt_tokens
            self.p.cached_tokens = usage.cached_tokens
            self.p.completion_tokens = usage.completion_tokens
            self.p.usage_estimated = False
            return self._learnt(usage, ok, self._samples(sniffer, n) if usage.completion_tokens else 1)
        if not ok:
            return Completion(ok=False)
        # no usage in the response (stream without include_usage): estimate, cached unknown
        est = self.req.prompt_tokens_estimate
        self.p.prompt_tokens, self.p.cached_tokens, self.p.completion_tokens = est, None, None
        self.p.usage_estimated = True
        return Completion(ok=True, prompt_tokens=est)

    def _learnt(self, usage: Usage, ok: bool, samples: int) -> Completion:
        return Completion(
            ok=ok,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            prompt_bytes=self.prompt_bytes,
            samples=samples,
        )

    def _samples(self, sniffer: UsageSniffer | None, n: Callable[[], int]) -> int:
        """Outputs the usage's ``completion_tokens`` adds up: every one of ``n`` on the OpenAI routes
        and in ``/generate``'s list; a ``/generate`` stream's last chunk counts its own sequence."""
        if sniffer is not None and sniffer.is_sse and self.req.route == "/generate":
            return 1
        return n()

    def _judge_residency(self, lease: Lease, completion: Completion) -> None:
        """Rule 6 feedback: a break when the engine found less of the session's context cached than
        it had sent, and for a request sent home for its cache, whether the residency was right."""
        expected = min(lease.prev_context_tokens, completion.prompt_tokens or 0)
        cached = completion.cached_tokens or 0
        exact = self.p.resident_tokens if self.p.residency == "events" else None
        found = home_found(lease, completion, resident_tokens=exact)
        if found is not None and self.p.residency:
            self.rt.emit(
                ResidencyJudged(
                    request_id=self.request_id,
                    at=self.rt.clock.now(),
                    replica_id=lease.replica_id,
                    residency=self.p.residency,
                    found=found,
                    expected_cached_tokens=expected,
                    cached_tokens=cached,
                    resident_tokens=self.p.resident_tokens,
                )
            )
        reason = classify_break(lease, completion, self.req.key_source)
        if reason is None:
            return
        self.p.breaks = (*self.p.breaks, reason)
        self.rt.emit(
            AffinityBroken(
                request_id=self.request_id,
                at=self.rt.clock.now(),
                replica_id=lease.replica_id,
                session_id=lease.session_id if self.req.key_source.named else None,
                reason=reason,
                expected_cached_tokens=expected,
                cached_tokens=cached,
                residency=self.p.residency,
            )
        )


def _decision_headers(replica_id: str, reason: Reason) -> list[tuple[str, str]]:
    """``X-Kvroute-Replica`` / ``X-Kvroute-Reason``. A replica id comes from the registry (a
    sidecar's entry in Redis is not validated as the admin API's are): one with a line break in it
    would split the response head, so it is left out."""
    if "\r" in replica_id or "\n" in replica_id:
        return [(REASON_HEADER, str(reason))]
    return [(REPLICA_HEADER, replica_id), (REASON_HEADER, str(reason))]


@functools.lru_cache(maxsize=8)
def _drop_with(header: str) -> frozenset[str]:
    return _FORWARD_DROP | {header.lower()}  # once per configured header, not per request


def _forward_headers(
    headers: Mapping[str, str] | CIMultiDictProxy[str] | CIMultiDict[str],
    remote: str | None,
    cfg: GatewayConfig,
    session_id: str | None,
    request_id: str,
) -> list[tuple[str, str]]:
    drop = _FORWARD_DROP
    if cfg.routing_key_header and session_id is not None:
        drop = _drop_with(cfg.routing_key_header)
    out = filter_headers(headers.items(), drop)
    if cfg.routing_key_header and session_id is not None:
        out.append((cfg.routing_key_header, session_id))
    prior = headers.get("X-Forwarded-For")
    peer = remote or ""
    if peer:
        out.append(("X-Forwarded-For", f"{prior}, {peer}" if prior else peer))
    out.append((REQUEST_ID_HEADER, request_id))
    return out


async def serve_inference(
    rt: GatewayRuntime,
    route: str,
    headers: CIMultiDictProxy[str] | CIMultiDict[str],
    remote: str | None,
    request_id: str,
    read_body: Callable[[], Awaitable[bytes]],
    downstream: _Relay,
) -> None:
    """One inference request: session key, body, route, forward, relay to ``downstream``. Errors
    before the first byte reached the client raise ``KvrouteError`` (the middleware renders them as
    OpenAI-style JSON)."""
    cfg = rt.config
    clock = rt.clock
    prog = _Progress(t0=clock.now())
    req: RouteRequest | None = None
    call: EngineSessionCall | None = None
    rt.in_flight += 1
    try:
        session_id = session_id_from_headers(headers, cfg)
        body = await read_body()
        prog.t0 = clock.now()  # the client's upload time is not ours
        if route == "/generate":
            _refuse_empty_generate(body)
        call = engine_session_call(route, body, cfg)
        pin: ReplicaId | None = None
        continues: str | None = None
        if call is not None:
            body = call.body
            pin = await call.pinned(rt.store)
        elif route == RESPONSES_ROUTE:
            continues = previous_response_id(body, cfg)
            if continues is not None:
                pin = await rt.store.pinned(PinKind.RESPONSE, continues)
        key, source = _routing_key(session_id, body, route, rt.policy, cfg)
        if call is not None and not source.named:  # a /generate in an engine session: keyed by it
            key, source = call.session_id, KeySource.BODY
        req = route_request(key, source, route=route, body_bytes=len(body), session=None)
        fwd = _forward_headers(headers, remote, cfg, key if source.named else None, request_id)
        proxy = _Proxy(downstream, request_id, rt, body, req, fwd, prog, call, pin, continues)
        try:
            await proxy.run()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                prog.client_gone = True
            elif isinstance(exc, KvrouteError):
                prog.error = exc.code
                prog.status = 502 if isinstance(exc, UpstreamStatusError) else exc.status
            raise
    finally:
        rt.in_flight -= 1
        if req is not None:
            e2e = clock.now() - prog.t0
            rt.emit(
                RequestFinished(
                    request_id=request_id,
                    at=clock.now(),
                    route=route,
                    status=prog.status,
                    ok=prog.ok,
                    stream=prog.stream,
                    replica_id=prog.replica_id,
                    reason=prog.reason,
                    key_source=req.key_source,
                    session_id=req.session_key if req.key_source.named else None,
                    retries=prog.retries,
                    ttft_s=prog.ttft_s,
                    e2e_s=e2e,
                    overhead_s=max(0.0, e2e - prog.upstream_wait_s - prog.write_wait_s),
                    prompt_tokens=prog.prompt_tokens,
                    cached_tokens=prog.cached_tokens,
                    completion_tokens=prog.completion_tokens,
                    usage_estimated=prog.usage_estimated,
                    breaks=prog.breaks,
                    client_disconnected=prog.client_gone,
                    error=prog.error,
                )
            )
        if call is not None and call.reserved:  # an open that got no answer frees its id (shielded:
            try:  # a client gone cancels this task, not the store's write)
                await asyncio.shield(call.abandoned(rt.store))
            except StoreError as exc:
                log.warning("engine session reservation not freed: %s", exc)


async def handle_inference(request: web.Request) -> web.StreamResponse:
    """The inference routes (``INFERENCE_ROUTES``)."""
    rt = request.app[RUNTIME_KEY]
    limit = rt.config.limits.max_body_bytes
    relay = _Relay(request)
    await serve_inference(
        rt,
        request.path,
        request.headers,
        request.remote,
        request[REQUEST_ID_KEY],
        lambda: read_body_limited(request, limit),
        relay,
    )
    assert relay.response is not None, "serve_inference returned without a response"
    return relay.response


# ---- small routes ----------------------------------------------------------------------------------


async def handle_health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    # in_flight: requests inside the handlers; background_responses: runs whose load is still held
    return web.json_response(
        {
            "status": "ok",
            "gateway_id": rt.config.gateway_id,
            "in_flight": rt.in_flight,
            "background_responses": len(rt.background),
        }
    )


async def handle_ready(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    replicas = await rt.store.replicas()
    active = sum(1 for r in replicas if r.status is ReplicaStatus.ACTIVE)
    body: dict[str, Any] = {"ready": False, "active_replicas": active, "replicas": len(replicas)}
    if rt.draining:
        body.update(error_body("gateway is shutting down", "service_unavailable", "draining"))
        return web.json_response(body, status=503)
    if active == 0:
        body.update(error_body("no active replica", "service_unavailable", "no_replica"))
        return web.json_response(body, status=503)
    body["ready"] = True
    return web.json_response(body)


async def _fetch_models(rt: GatewayRuntime) -> dict[str, Any]:
    replicas = [
        r for r in await rt.store.replicas() if r.status in (ReplicaStatus.ACTIVE, ReplicaStatus.DRAINING)
    ]
    if not replicas:
        raise NoReplicaError("no active replica to list models from")
    client = rt.client
    assert client is not None

    async def one(rid: str, url: str) -> Sequence[Any] | None:
        try:
            status, body = await client.fetch(rid, url + "/v1/models", accept="application/json")
        except UpstreamError:
            return None
        if status != 200:
            return None
        try:
            data = json.loads(body).get("data")
        except (ValueError, AttributeError, UnicodeDecodeError):
            return None
        return data if isinstance(data, list) else None

    results = await asyncio.gather(*(one(r.id, r.url) for r in replicas))
    if all(r is None for r in results):
        raise UpstreamConnectError("no replica answered /v1/models")
    merged: dict[str, Any] = {}
    for data in results:
        for item in data or ():
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                merged.setdefault(item["id"], item)
    return {"object": "list", "data": [merged[k] for k in sorted(merged)]}


async def handle_models(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    now = rt.clock.now()
    if rt.models_body is None or now - rt.models_at > rt.config.models_cache_s:
        rt.models_body = await _fetch_models(rt)
        rt.models_at = now
    return web.json_response(rt.models_body)


async def handle_model(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    await handle_models(request)
    name = request.match_info["model"]
    assert rt.models_body is not None
    for item in rt.models_body["data"]:
        if item.get("id") == name:
            return web.json_response(item)
    return web.json_response(
        error_body(f"The model '{name}' does not exist", "invalid_request_error", "model_not_found"), status=404
    )

"""Frozen event records the gateway (and discovery) emit, and the ``Hook`` seam that consumes them.

Rules:
  1. Events are immutable values (``frozen=True, slots=True``); times are seconds on the injected
     clock (monotonic), durations are ``*_s``.
  2. The core never imports metrics or tracing: ``router.observability`` registers hooks.
  3. A hook must be fast and must not raise; :class:`Emitter` still isolates a failing hook so a bug
     in observability can never fail a request (it logs the error once per hook and event type).
  4. Session ids appear in events (tracing may want them) but must never become metric labels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from router.model import AffinityBreak, KeySource, Reason, ReplicaId

__all__ = [
    "AffinityBroken",
    "Emitter",
    "Event",
    "Hook",
    "ReplicaActivated",
    "ReplicaEjected",
    "ReplicaReadmitted",
    "RequestFinished",
    "RequestRouted",
    "ResidencyJudged",
    "StoreDegraded",
    "StoreRecovered",
    "UpstreamRetry",
]

log = logging.getLogger("kvroute.events")


@dataclass(frozen=True, slots=True)
class RequestRouted:
    """A replica was chosen and the request counted in flight (one per attempt)."""

    request_id: str
    at: float
    route: str
    replica_id: ReplicaId
    reason: Reason
    key_source: KeySource
    session_id: str | None
    attempt: int = 0  # 0 = first try, 1.. = retries
    disagreement: bool = False  # the store overrode the decision (another gateway bound first)
    scores: tuple[tuple[ReplicaId, float], ...] = ()  # the policy's per-replica scores (tracing)
    residency: str = ""  # RouteDecision.residency
    estimate_check: str = ""  # RouteDecision.estimate_check
    panic: bool = False  # every replica looked down and the request was sent to one anyway


@dataclass(frozen=True, slots=True)
class UpstreamRetry:
    """An attempt failed before any byte reached the client; the request is routed again."""

    request_id: str
    at: float
    replica_id: ReplicaId
    attempt: int
    error: str  # error code: upstream_connect_error | upstream_status | upstream_timeout


@dataclass(frozen=True, slots=True)
class AffinityBroken:
    """A response's cached tokens fell short of the session's previous context."""

    request_id: str
    at: float
    replica_id: ReplicaId
    session_id: str | None
    reason: AffinityBreak
    expected_cached_tokens: int
    cached_tokens: int
    residency: str = ""  # which residency the decision went by: "events" | "estimate" | "" (none)


@dataclass(frozen=True, slots=True)
class ResidencyJudged:
    """A request sent home because its session's cache was thought resident there
    (``Reason.AFFINITY``), continuing that context: did the engine find it cached
    (``router.policy.breaks.home_found``)? By the residency the decision went by, this is how often
    the KV events (or the estimate) were right."""

    request_id: str
    at: float
    replica_id: ReplicaId
    residency: str  # "events" | "estimate"
    found: bool
    expected_cached_tokens: int
    cached_tokens: int
    resident_tokens: int | None = None  # the session's own tokens the events showed at home when it was routed


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """An inference request ended (any outcome): exactly one per request that passed validation
    (session id, body size, JSON where needed) and was routed or failed to be. Requests refused
    before that (4xx) are counted by the HTTP layer, not here."""

    request_id: str
    at: float
    route: str
    status: int  # HTTP status sent to the client (0 if the client left before any status)
    ok: bool  # 2xx and the response completed
    stream: bool  # the response was an SSE stream
    replica_id: ReplicaId | None  # last replica tried
    reason: Reason | None
    key_source: KeySource
    session_id: str | None
    retries: int = 0
    ttft_s: float | None = None  # request start -> first byte written to the client
    e2e_s: float = 0.0
    overhead_s: float = 0.0  # time in the gateway itself: e2e minus the time spent waiting on upstreams
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    usage_estimated: bool = False  # no usage in the response: prompt tokens estimated from body size
    breaks: tuple[AffinityBreak, ...] = ()
    client_disconnected: bool = False
    error: str | None = None  # error code if not ok


@dataclass(frozen=True, slots=True)
class ReplicaActivated:
    """JOINING -> ACTIVE after its first good health check."""

    at: float
    replica_id: ReplicaId


@dataclass(frozen=True, slots=True)
class ReplicaEjected:
    """ACTIVE -> DOWN: failed health checks (``cause="health"``) or connect errors (``"connect"``)."""

    at: float
    replica_id: ReplicaId
    cause: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaReadmitted:
    """DOWN -> ACTIVE after enough consecutive good health checks."""

    at: float
    replica_id: ReplicaId


@dataclass(frozen=True, slots=True)
class StoreDegraded:
    """The shared-state backend failed; the gateway serves from local state."""

    at: float
    error: str


@dataclass(frozen=True, slots=True)
class StoreRecovered:
    at: float


Event = (
    RequestRouted
    | UpstreamRetry
    | AffinityBroken
    | ResidencyJudged
    | RequestFinished
    | ReplicaActivated
    | ReplicaEjected
    | ReplicaReadmitted
    | StoreDegraded
    | StoreRecovered
)


class Hook(Protocol):
    def __call__(self, event: Event) -> None: ...


class Emitter:
    """Fans events out to hooks; a raising hook is logged and skipped, never propagated."""

    __slots__ = ("_hooks", "_warned")

    def __init__(self, hooks: Iterable[Hook] = ()) -> None:
        self._hooks: tuple[Hook, ...] = tuple(hooks)
        self._warned: set[tuple[int, type]] = set()

    @property
    def hooks(self) -> tuple[Hook, ...]:
        return self._hooks

    def add(self, hook: Hook) -> None:
        self._hooks = (*self._hooks, hook)

    def __call__(self, event: Event) -> None:
        for hook in self._hooks:
            try:
                hook(event)
            except Exception:  # observability must never fail the request path (rule 3)
                key = (id(hook), type(event))
                if key not in self._warned:
                    self._warned.add(key)
                    log.exception("event hook %r failed on %s", hook, type(event).__name__)

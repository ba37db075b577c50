"""Frozen value types shared by the policy, the state stores, the gateway and the simulator.

Rules:
  1. Everything here is immutable (``frozen=True, slots=True``) and free of I/O.
  2. Times are float seconds on the *store's* clock (monotonic in the gateway, virtual in the
     simulator). Token counts are ints.
  3. The policy reads a :class:`ClusterSnapshot` and returns a :class:`RouteDecision` whose
     ``effects`` describe state changes; a store performs them (atomically in Redis).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "MAX_CHAINS",
    "AffinityBreak",
    "BindSession",
    "ClusterSnapshot",
    "Completion",
    "Effect",
    "EngineLoad",
    "FleetTotals",
    "HealthStamp",
    "KeySource",
    "Lease",
    "PinKind",
    "Reason",
    "ReplicaId",
    "ReplicaSpec",
    "ReplicaState",
    "ReplicaStatus",
    "RouteDecision",
    "RouteRequest",
    "SessionState",
    "SetOverflow",
    "capacities",
    "fleet_totals",
    "rank_replica_id",
    "remember_chain",
]

ReplicaId = str
"""A replica's id: ``host:port`` of its URL unless configured otherwise (path-safe)."""


class ReplicaStatus(StrEnum):
    JOINING = "joining"  # registered, no good health check yet: gets nothing
    ACTIVE = "active"
    DRAINING = "draining"  # finishes in-flight work, gets no new sessions, sessions move at next turn
    DOWN = "down"  # failed health checks / ejected: gets nothing


class KeySource(StrEnum):
    HEADER = "header"  # session id from a configured header (Modal-Session-Id, ...)
    # no header: the body's own ``session_id`` (SGLang's field; the engine names its blocks by it), else
    # its ``prompt_cache_key`` (OpenAI's)
    BODY = "body"
    PREFIX = "prefix"  # derived from a hash chain over the request's first prompt blocks
    NONE = "none"  # nothing to key on (e.g. an empty body)

    @property
    def named(self) -> bool:
        """The client named the session (a header or the body), rather than the gateway keying it."""
        return self is KeySource.HEADER or self is KeySource.BODY


class PinKind(StrEnum):
    """What lives in one engine only, so every request naming it must go there (``StateStore.pin``);
    the value prefixes its Redis key."""

    ENGINE_SESSION = "es"  # SGLang's /open_session: the engine holds the session's request tree
    RESPONSE = "resp"  # a Responses API response the engine stored (--enable-response-store)


class Reason(StrEnum):
    """Why a replica was chosen. Low cardinality: used as a metric label and response header."""

    AFFINITY = "affinity"  # known session, home is fine
    THICC_SPLIT = "thicc_split"  # session has too many requests in flight at home -> overflow replica
    PLACED_NEW = "placed_new"  # first request of a session
    PLACED_EVICTED = "placed_evicted"  # home's cache of this session is surely gone: placed afresh by load
    # a session the store does not know (its binding expired, the gateway restarted on embedded state)
    # whose cache the engines' KV events show resident: placed there
    PLACED_RESIDENT = "placed_resident"
    REASSIGNED_OVERLOAD = "reassigned_overload"  # home persistently overloaded: moved at turn start
    REASSIGNED_DRAINING = "reassigned_draining"  # home draining
    REASSIGNED_GONE = "reassigned_gone"  # home down or removed
    RETRY = "retry"  # previous choice failed before the first byte
    # home's prefill work ahead of this warm turn is far more than its cold start elsewhere: this
    # request only goes there (no rebind; rule 8)
    QUEUE_SPILL = "queue_spill"
    PINNED = "pinned"  # names what lives in one engine only (an engine session, a stored response)
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    HASH = "hash"


class AffinityBreak(StrEnum):
    """Why a response's cached tokens fell short of the session's previous context."""

    OVERLOAD_SPILL = "overload_spill"
    THICC_SPLIT = "thicc_split"
    REPLICA_GONE = "replica_gone"
    EVICTED = "evicted"
    NO_SESSION_ID = "no_session_id"
    GATEWAY_DISAGREEMENT = "gateway_disagreement"


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """How a replica is registered (static config, admin API, sidecar heartbeat)."""

    id: ReplicaId
    url: str  # base URL, e.g. http://127.0.0.1:31001 (no trailing slash)
    model: str = ""
    capacity_tokens: int = 0  # KV capacity in HBM (max_total_num_tokens); 0 = unknown
    host_capacity_tokens: int = 0  # HiCache host tier; 0 = none
    tp_size: int = 0
    source: str = "static"  # static | admin | registry
    # one data-parallel rank of an engine (``--dp-size``), placed as a replica of its own: requests
    # name it to the engine (X-Data-Parallel-Rank), its loads and KV events are that rank's alone
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Figures the engine reports about itself (scraped from /metrics; a little stale)."""

    running: int = 0
    queued: int = 0
    kv_util: float = 0.0  # sglang:token_usage, 0..1
    capacity_tokens: int = 0  # sglang:max_total_num_tokens
    host_used_tokens: int = 0
    host_capacity_tokens: int = 0
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    # /v1/loads num_waiting_uncached_tokens: prefill work queued behind the running batch (tokens not
    # in its cache), what a new request waits for before its own prefill starts
    waiting_uncached_tokens: int = 0
    # /v1/loads entries: the engine's data-parallel schedulers, each with a cache of its own
    dp_ranks: int = 1
    updated_at: float = 0.0  # store clock; 0 = never scraped
    reported_by: str = ""  # the gateway discovery that scraped them ("" = a sidecar's heartbeat): rules 6 and 8


@dataclass(frozen=True, slots=True)
class HealthStamp:
    """The last good health check of a replica that its writer shared through the store (discovery
    rule 7): when (store clock), who checked (a gateway's or a sidecar's writer id) and for how long
    the writer vouches for it (its next check is due within that)."""

    at: float
    by: str
    fresh_s: float


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the policy sees it."""

    id: ReplicaId
    url: str
    status: ReplicaStatus = ReplicaStatus.ACTIVE
    joined_at: float = 0.0  # when it first became ACTIVE (scale-up ramp)
    # requests in flight through all gateways: this gateway's own at once, others' as of the last refresh
    in_flight: int = 0
    engine: EngineLoad = field(default_factory=EngineLoad)
    capacity_tokens: int = 0  # HBM KV capacity (``capacities``: engine first; 0 = unknown -> policy default)
    host_capacity_tokens: int = 0  # HiCache host tier (``capacities``); 0 = none
    residency_horizon_tokens: int = 0  # tokens written after which a session's cache was last seen gone
    # (or still there) at this replica: engine feedback on the residency estimate; 0 = none yet
    sessions_active: int = 0  # sessions homed here and seen within the active window
    active_context_tokens: int = 0  # sum of their context tokens: the working set
    tokens_written: int = 0  # cumulative tokens our requests wrote into its cache (residency clock)
    placed_recent: int = 0  # new sessions placed here within the ramp window
    model: str = ""
    dp_rank: int | None = None  # ``ReplicaSpec.dp_rank``: this replica is that rank of its engine


MAX_CHAINS = 8
"""Conversations remembered per session (``SessionState.chains``): more than a coding agent runs at
once; an older one forgotten only loses its placement hint."""


def remember_chain(
    chains: tuple[tuple[str, ReplicaId], ...], chain_key: str, replica_id: ReplicaId
) -> tuple[tuple[str, ReplicaId], ...]:
    """``chains`` with ``chain_key`` last run on ``replica_id`` (moved to the newest end, oldest
    dropped past ``MAX_CHAINS``). The stores keep this rule (Redis in acquire.lua)."""
    kept = [(k, r) for k, r in chains if k != chain_key]
    kept.append((chain_key, replica_id))
    return tuple(kept[-MAX_CHAINS:])


def rank_replica_id(engine_id: str, rank: int) -> str:
    """The replica id of data-parallel rank ``rank`` of the engine ``engine_id`` (``host:port-dpR``),
    where each rank is registered as a replica of its own (``ReplicaSpec.dp_rank``)."""
    return f"{engine_id}-dp{rank}"


def capacities(spec: ReplicaSpec, engine: EngineLoad) -> tuple[int, int]:
    """``(HBM, host tier)`` KV capacity of a replica, by one precedence rule everywhere (the stores,
    the admin view): what the engine itself reports on ``/metrics`` (``max_total_num_tokens``,
    ``hicache_host_total_tokens``) wins over the registration (static config, admin API, or the
    sidecar's reading of the engine's ``/server_info``); 0 when neither says."""
    hbm = engine.capacity_tokens or spec.capacity_tokens
    host = engine.host_capacity_tokens or spec.host_capacity_tokens
    return max(0, hbm), max(0, host)


@dataclass(frozen=True, slots=True)
class SessionState:
    """One session's routing state."""

    session_id: str
    home: ReplicaId | None = None
    overflow: tuple[ReplicaId, ...] = ()
    in_flight: tuple[tuple[ReplicaId, int], ...] = ()  # per replica, only non-zero entries, sorted
    context_tokens: int = 0  # prompt + completion tokens of the last finished turn
    last_seen: float = 0.0
    residency_mark: int = 0  # home's tokens_written right after this session last wrote there
    turns: int = 0
    bytes_per_token: float = 0.0  # body bytes / prompt tokens of its last turn at home; 0 = unknown
    # exact residency from the engines' KV events (router/residency.py, docs/KV_EVENTS.md), filled when
    # the snapshot is built; None / () = no exact knowledge (events off, incomplete, or not attributed)
    # tokens of this session's own context resident on its home: beyond the (shared) prefix it found
    # cached there when it first stored (router/residency.py rule 2b)
    resident_tokens: int | None = None
    resident_on: tuple[tuple[ReplicaId, int], ...] = ()  # every replica known to hold > 0 of it, sorted
    # replicas whose incomplete mirror holds the block the session stored last, of a depth the events
    # do not tell (its chain begins before the replay did); filled only for a session without a home
    # (router.residency.unbound_with_residency). A radix cache evicts leaves first, so all of the
    # session's context up to that block is there.
    tip_on: tuple[ReplicaId, ...] = ()
    # where each of the session's recent conversations (RouteRequest.chain_key) last ran, oldest first
    # (at most MAX_CHAINS): a sub-agent's context is where its own previous turn went, not at home
    chains: tuple[tuple[str, ReplicaId], ...] = ()

    def chain_at(self, chain_key: str | None) -> ReplicaId | None:
        if chain_key is None:
            return None
        for key, rid in self.chains:
            if key == chain_key:
                return rid
        return None

    def in_flight_at(self, replica_id: ReplicaId) -> int:
        for rid, n in self.in_flight:
            if rid == replica_id:
                return n
        return 0

    @property
    def in_flight_total(self) -> int:
        return sum(n for _, n in self.in_flight)


@dataclass(frozen=True, slots=True)
class FleetTotals:
    """Counts and sums over a snapshot's replicas, kept as running totals by a store that can
    (``MemoryCore``) so the policy does not scan a large fleet per request. Always equal to
    ``fleet_totals(snapshot.replicas)``."""

    replicas: int = 0
    active: int = 0
    joining: int = 0
    down: int = 0
    active_in_flight: int = 0  # the sums are over ACTIVE replicas
    active_sessions: int = 0
    active_placed_recent: int = 0


def fleet_totals(replicas: tuple[ReplicaState, ...]) -> FleetTotals:
    """The reference definition of ``FleetTotals`` (a full scan)."""
    active = [r for r in replicas if r.status is ReplicaStatus.ACTIVE]
    return FleetTotals(
        replicas=len(replicas),
        active=len(active),
        joining=sum(1 for r in replicas if r.status is ReplicaStatus.JOINING),
        down=sum(1 for r in replicas if r.status is ReplicaStatus.DOWN),
        active_in_flight=sum(r.in_flight for r in active),
        active_sessions=sum(r.sessions_active for r in active),
        active_placed_recent=sum(r.placed_recent for r in active),
    )


_NO_AHEAD: Mapping[ReplicaId, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """What the policy sees for one request: all replicas plus the request's own session."""

    now: float
    replicas: tuple[ReplicaState, ...]  # sorted by id
    session: SessionState | None = None  # None: unknown session (or no key)
    seq: int = 0  # monotone request counter of the store (round robin cursor)
    sessions_active: int = 0  # fleet-wide sessions seen within the active window
    serving_since: float | None = None  # when the store routed its first request; None = not yet.
    # Replicas ACTIVE before it are the initial fleet; later ones joined by scale-up (rule 4).
    # Derived from ``replicas``, filled by stores that keep them (None: the reader scans):
    # (not part of the value: two snapshots of the same fleet are equal whether a store filled them)
    totals: FleetTotals | None = field(default=None, compare=False)
    # the prefill work ahead of a new request on each replica as this gateway knows it: the expected
    # uncached prompt tokens of its own requests there that have no first token yet
    # (``router.policy.prefill.PrefillLedger``), replicas with none left out (rule 8); read-only
    prefill_ahead: Mapping[ReplicaId, int] = field(default_factory=lambda: _NO_AHEAD)
    # other gateways send to this fleet too: a replica's work ahead is at least its engine's own
    # report of its queue (``router.policy.prefill.work_ahead``; read per replica, where rule 8 looks)
    engines_ahead: bool = False
    positions: Mapping[ReplicaId, int] | None = field(default=None, compare=False)  # id -> index in ``replicas``

    def replica(self, replica_id: ReplicaId | None) -> ReplicaState | None:
        if replica_id is None:
            return None
        if self.positions is not None:
            i = self.positions.get(replica_id)
            return None if i is None else self.replicas[i]
        for r in self.replicas:
            if r.id == replica_id:
                return r
        return None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the gateway extracted from an HTTP request (the policy never sees HTTP)."""

    session_key: str | None
    key_source: KeySource = KeySource.HEADER
    route: str = "/v1/chat/completions"
    prompt_tokens_estimate: int = 0  # from the body size (router.route_input); refined by responses
    excluded: frozenset[ReplicaId] = frozenset()  # replicas that already failed this request
    body_bytes: int = 0  # size of the request body
    # which of the session's conversations this request continues (the parent's, or one sub-agent's):
    # a hash of the prompt's anchor (router.policy.prefix_key.chain_key); None = not known
    chain_key: str | None = None


# ---- effects: the policy describes, the store performs -------------------------------------------


@dataclass(frozen=True, slots=True)
class BindSession:
    """Make ``replica_id`` the session's home.

    ``only_if`` expresses the compare-and-set: the bind takes effect only if the session's current
    home equals it (``None`` = only if unbound: the atomic first bind). If it does not, the store
    keeps the existing home and the request goes there (``Lease.replica_id``).
    """

    session_id: str
    replica_id: ReplicaId
    only_if: ReplicaId | None
    reason: Reason


@dataclass(frozen=True, slots=True)
class SetOverflow:
    """Replace the session's overflow replicas (thicc split grows or collapses)."""

    session_id: str
    replicas: tuple[ReplicaId, ...]


Effect = BindSession | SetOverflow


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: ReplicaId
    reason: Reason
    effects: tuple[Effect, ...] = ()
    scores: tuple[tuple[ReplicaId, float], ...] = ()  # lower is better for kv_aware (expected delay)
    expected_break: AffinityBreak | None = None  # the cache loss this decision knowingly accepts
    residency: str = ""  # which told the policy where the session's cache is: "events" | "estimate"
    # with events: would the estimate have judged the same? "agree" | "false_gone" | "false_resident"
    estimate_check: str = ""


@dataclass(frozen=True, slots=True)
class Lease:
    """A request held in flight on a replica (returned by ``StateStore.acquire``)."""

    lease_id: str
    replica_id: ReplicaId
    session_id: str | None
    reason: Reason
    acquired_at: float
    disagreement: bool = False  # the store overrode the decision (another gateway bound first)
    prev_context_tokens: int = 0  # session context known when the request started


@dataclass(frozen=True, slots=True)
class Completion:
    """What the gateway learned from the response; feeds context sizes and residency marks."""

    ok: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    started_output: bool = False  # at least one byte reached the client
    prompt_bytes: int = 0  # size of the request body (with prompt_tokens: the session's bytes per token)
    # outputs per prompt (the request's ``n``): ``completion_tokens`` counts all of them, and all are
    # written to the cache, but a conversation goes on from one: its context grows by one share
    samples: int = 1

"""The fleet simulation: closed-loop sessions -> G gateways (real policy, shared MemoryCore) ->
R emulated replicas (pure engine + cache), in virtual time. ``run_sim(specs, config)``.

Model (docs/SIMULATOR.md has the long form):
  * Sessions are closed loops: turn k+1 is sent ``think_s`` after turn k's last response;
    branches (sub-agents) start ``start_s`` after their parent's spawning turn and run
    concurrently, routed with the root session id; ``Turn.parallel`` copies go out together.
  * A request picks a gateway (``gateway_assign``: "random" per request, as behind a Service, or
    "sticky" per session, as a client-pod sidecar). The gateway takes a snapshot, calls the real
    ``policy.route``, then ``MemoryCore.acquire`` (which performs the effects, compare-and-set
    first binds, and counts the request in flight), submits to the replica's engine, and on the
    engine's ``Finished`` event calls ``MemoryCore.release`` with the usage the engine reported.
  * State lag: with ``state_lag_s > 0`` each gateway routes on a copy of the replica table that
    it refreshes every ``state_lag_s`` (the store's polled view), overlaid with the in-flight
    changes it made itself since (a gateway always knows its own traffic). Session state is read
    fresh (one round trip per request, DESIGN §4), and acquire/release hit the shared core.
  * Engine load (running, queue, KV use, capacity) reaches the store every ``scrape_interval_s``,
    like the live gateway's discovery loop.
  * Fleet events: ``ScaleEvent(at_s, to)`` adds replicas (JOINING, ACTIVE after
    ``health_interval_s``) or drains the highest-numbered ones (removed once empty);
    ``FailureEvent(at_s, replica)`` kills one: requests without output yet are retried elsewhere
    (excluding it), streaming ones fail; it refuses connections until marked DOWN after
    ``fail_detect_s``.
  * Measures: every request is a ``RequestRecord`` (cached tokens from the engine, ideal from one
    infinite cache, break reason from ``router.policy.classify_break``); per-replica in-flight is
    sampled every ``sample_interval_s`` over serving replicas; a session's home change counts as
    a move (by scale-up when the new home joined by scale-up and the session did not have to move
    anyway: ``_FORCED_MOVES``); ``pooled_chr`` pools the KV of the replicas serving at each moment.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtests.ideal import PooledCache
from loadtests.measures import EngineQueue, MeasureCollector, RequestRecord
from loadtests.sim.engine import EventLoop
from loadtests.sim.prompts import ChainNamer, IdealCache, check_page_size
from loadtests.sim.replica_model import SimReplica
from loadtests.workloads import SessionSpec, conversation_starts, sticky_gateway
from replica.emulator.kv_events import ResidencyFeeder
from replica.emulator.metrics import QUEUE_BUCKETS, Histogram
from replica.emulator.profiles import Profile, get_profile
from replica.emulator.timemodel import EngineRequest, Finished, FirstToken, Started, alone_ttft_s
from router.errors import NoReplicaError, ReplicaNotFoundError
from router.model import (
    AffinityBreak,
    ClusterSnapshot,
    Completion,
    KeySource,
    Lease,
    Reason,
    ReplicaState,
    ReplicaStatus,
)
from router.policy import Policy, classify_break, home_found, make_policy
from router.policy.params import PolicyParams
from router.policy.prefill import PrefillLedger, expected_uncached
from router.residency import ResidencyIndex
from router.route_input import route_request
from router.store.base import StoreConfig
from router.store.memory import MemoryCore

__all__ = ["DEFAULT_PAGE_SIZE", "FailureEvent", "ScaleEvent", "SimConfig", "SimResult", "default_profile", "run_sim"]

DEFAULT_PAGE_SIZE = 512
"""Simulated cache page (tokens). Coarser than SGLang's so a 100k prompt is ~200 blocks, not
1,600: the cache work per request drops 8x, at a cost of < 0.5 % of the cached tokens."""


CHAT_ROUTE = "/v1/chat/completions"

SIM_BYTES_PER_TOKEN = 4
"""The simulated request body: what the live driver sends for a prompt of N tokens (the emulator's
tokenizer reads 4 bytes a token) plus the chat request's JSON framing (``SIM_BODY_FRAMING_BYTES``),
so the gateway's estimate from the body size (``router.route_input``) is fed the same facts."""
SIM_BODY_FRAMING_BYTES = 160


def body_bytes(prompt_tokens: int) -> int:
    return SIM_BYTES_PER_TOKEN * prompt_tokens + SIM_BODY_FRAMING_BYTES


def default_profile(page_size: int = DEFAULT_PAGE_SIZE) -> Profile:
    return get_profile("kimi-k2.6-b200-tp4").with_overrides(page_size=page_size)


# re-homings a session undergoes whether or not a replica joined (DESIGN rule 4 is about the others)
_FORCED_MOVES = frozenset({Reason.PLACED_EVICTED, Reason.REASSIGNED_GONE, Reason.REASSIGNED_DRAINING})


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    at_s: float
    to: int  # replicas wanted (ACTIVE + JOINING) after the event


@dataclass(frozen=True, slots=True)
class FailureEvent:
    at_s: float
    replica: int  # index of the replica that dies (r{index:03d})


@dataclass(frozen=True, slots=True)
class SimConfig:
    replicas: int = 8
    policy: str = "kv_aware"
    policy_params: PolicyParams = field(default_factory=PolicyParams)
    profile: Profile = field(default_factory=default_profile)
    gateways: int = 1
    state_lag_s: float = 0.0
    gateway_assign: str = "random"  # "random" per request | "sticky" per session
    scrape_interval_s: float = 1.0
    sample_interval_s: float = 1.0
    warmup_s: float = 0.0
    duration_s: float | None = None  # no new turn starts after this; the measured window ends here
    drain_s: float = 120.0  # after duration_s, in-flight requests get this long to finish
    lanes: int = 0  # > 0: keep this many sessions alive (a finished one is replaced by the next spec)
    lane_ramp_s: float = 30.0  # lanes: the initial sessions start spread over this window
    # lanes as the live driver runs them (``loadtests.live``): lane i runs specs i, i + L, i + 2L, ...
    # back to back, the first at its own ``start_s``, each next one as soon as the previous
    # session's main chain ended (its sub-agents may still run)
    striped_lanes: bool = False
    # > 0: name prompts as the live driver renders them (``loadtests.sim.prompts``): a turn's closing
    # marker (this many tokens) and its output are not reused by the next turn (synthetic chains only)
    turn_framing_tokens: int = 0
    start_mid_session: bool = False  # initial sessions start at a random turn (no cold-start transient)
    health_interval_s: float = 5.0  # scale-up: JOINING -> ACTIVE after this
    fail_detect_s: float = 2.0  # a failed replica is marked DOWN after this
    max_attempts: int = 3  # per request: first try + retries before the first byte
    scale: tuple[ScaleEvent, ...] = ()
    failures: tuple[FailureEvent, ...] = ()
    store: StoreConfig = field(default_factory=StoreConfig)
    seed: int = 0
    replica_ids: tuple[str, ...] = ()  # ids of the first replicas (default r000, r001, ...)
    # the replicas publish their cache changes as SGLang's KV events would, and the store routes on
    # exact residency (router.residency, fed directly: what a subscriber ends up with)
    kv_events: bool = False
    # False: the clients send no session id; the gateway keys each request by its conversation's
    # prompt (rule 7's prefix key: one key per conversation, sub-agents apart). ``conversation_key``
    # (spec, turn the conversation began) names it as the gateway would (``loadtests.scenario``:
    # from the live driver's prompt); None: by the conversation's own name
    session_ids: bool = True
    conversation_key: Callable[[SessionSpec, int], str] | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.gateways < 1:
            raise ValueError("replicas and gateways must be >= 1")
        if self.gateway_assign not in ("random", "sticky"):
            raise ValueError("gateway_assign must be 'random' or 'sticky'")
        if self.state_lag_s < 0 or self.sample_interval_s <= 0 or self.scrape_interval_s <= 0:
            raise ValueError("intervals must be > 0 and state_lag_s >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.striped_lanes and self.lanes < 1:
            raise ValueError("striped_lanes needs lanes >= 1")


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    measures: dict[str, Any]
    load_histogram: dict[int, int]
    stats: dict[str, Any]
    records: tuple[RequestRecord, ...] = ()


# ---- mutable run state ------------------------------------------------------------------------


class _Root:
    __slots__ = ("index", "last_replica", "open", "spec", "uid")

    def __init__(self, spec: SessionSpec, index: int, uid: int) -> None:
        self.spec = spec
        self.last_replica: str | None = None  # non-binding policies: where the main chain last went
        self.index = index
        self.uid = uid
        self.open = 0  # chains still running


class _Chain:
    __slots__ = ("branches_at", "gateway", "key", "last_replica", "namer", "next_turn", "pending", "root", "spec",
                 "starts")  # fmt: skip

    def __init__(self, spec: SessionSpec, root: _Root, namer: ChainNamer, gateway: int, first_turn: int) -> None:
        self.spec = spec
        self.root = root
        self.namer = namer
        self.key = root.spec.routing_key
        self.gateway = gateway
        self.next_turn = first_turn
        self.pending = 0
        self.last_replica: str | None = None
        self.starts = conversation_starts(spec)
        at: dict[int, list[SessionSpec]] = {}
        for b in spec.branches:
            if b.spawn_after_turn >= first_turn:
                at.setdefault(b.spawn_after_turn, []).append(b)
        self.branches_at = at


class _Req:
    __slots__ = (
        "attempt",
        "body_bytes",
        "cached",
        "chain",
        "excluded",
        "full",
        "gw",
        "ideal",
        "input_tokens",
        "key",
        "lease",
        "names",
        "output_tokens",
        "pooled",
        "replica",
        "residency",
        "resident",
        "rid",
        "t_first",
        "t_start",
        "t_submit",
        "turn",
    )

    def __init__(self, rid: str, chain: _Chain, turn: int, names: list[int], full: list[int], t: float) -> None:
        self.rid = rid
        self.chain = chain
        self.turn = turn
        self.names = names
        self.full = full
        self.t_start = t
        self.key = chain.key  # the routing key (``_dispatch`` sets it per attempt)
        self.input_tokens = chain.namer.inputs[turn]
        self.body_bytes = body_bytes(self.input_tokens)
        self.output_tokens = chain.spec.turns[turn].output_tokens
        self.attempt = 0
        self.excluded: frozenset[str] = frozenset()
        self.lease: Lease | None = None
        self.replica: SimReplica | None = None
        self.t_first: float | None = None
        self.t_submit = t
        self.cached = 0
        self.ideal = 0
        self.pooled = 0
        self.gw = 0
        self.residency = ""  # the decision's RouteDecision.residency
        self.resident: int | None = None  # with events: the session's own tokens its home held then


class _Gateway:
    """A gateway's lagged replica table: the store's snapshot as of ``refreshed_at`` with the
    in-flight changes the gateway made since (``delta``) patched into its own copy (``reps``), one
    replica at a time as they happen, so a request costs O(1) rather than a pass over the fleet."""

    __slots__ = (
        "active_in_flight", "delta", "index", "policy", "prefill", "refreshed_at", "reps", "rng", "sent", "snap",
    )  # fmt: skip

    def __init__(self, index: int, policy: Policy, rng: random.Random) -> None:
        self.index = index
        self.policy = policy
        self.rng = rng
        self.snap: ClusterSnapshot | None = None
        self.refreshed_at = -1e18
        self.delta: dict[str, int] = {}
        self.sent = 0
        self.reps: list[ReplicaState] = []  # snap.replicas with delta applied
        self.active_in_flight = 0  # over ACTIVE replicas in ``reps`` (the snapshot's total, patched)
        self.prefill = PrefillLedger()  # its own requests' prefill work ahead (rule 8), as the gateway's

    def refresh(self, snap: ClusterSnapshot, t: float) -> None:
        self.snap = snap
        self.refreshed_at = t
        self.delta.clear()
        self.sent = 0
        self.reps = list(snap.replicas)
        self.active_in_flight = snap.totals.active_in_flight if snap.totals is not None else 0

    def count(self, replica_id: str, change: int) -> None:
        """This gateway sent (+1) or finished (-1) a request on ``replica_id``."""
        d = self.delta[replica_id] = self.delta.get(replica_id, 0) + change
        snap = self.snap
        if snap is None or snap.positions is None or (i := snap.positions.get(replica_id)) is None:
            return  # not in the table: nothing shows it
        base, old = snap.replicas[i], self.reps[i]
        new = replace(base, in_flight=max(0, base.in_flight + d)) if d else base
        self.reps[i] = new
        if base.status is ReplicaStatus.ACTIVE:
            self.active_in_flight += new.in_flight - old.in_flight


class _Sim:
    def __init__(self, specs: Sequence[SessionSpec], cfg: SimConfig, policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.specs = specs
        self.loop = EventLoop()
        self.clock = self.loop.clock
        self.core = MemoryCore(self.clock, cfg.store)
        self.residency = ResidencyIndex() if cfg.kv_events else None
        self.core.residency = self.residency
        self.page = cfg.profile.page_size
        self.ideal = IdealCache(self.page)
        prof = cfg.profile
        self.pooled = PooledCache(cfg.replicas * prof.capacity_tokens, self.page, cfg.replicas * prof.host_tokens)
        self.measures = MeasureCollector(
            warmup_s=cfg.warmup_s, end_s=cfg.duration_s, replicas=cfg.replicas, lanes=cfg.lanes or None
        )
        # the engines' own queue-time and TTFT histograms, fleet totals, as the live driver reads them
        # from /metrics at the warm-up's end and after the run (``engine_queue_*``)
        self.queue_hist = Histogram(QUEUE_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.queue_at_warmup: EngineQueue | None = None
        # the decisions of requests started in the window, by reason: what the live driver tallies
        # from kvroute's X-Kvroute-Reason header (``route_reasons``), so parity compares decisions too
        self.reasons: Counter[str] = Counter()
        self.rng = random.Random(f"sim:{cfg.seed}")
        self.gateways = [
            _Gateway(g, policy or make_policy(cfg.policy, cfg.policy_params), random.Random(f"gw:{cfg.seed}:{g}"))
            for g in range(cfg.gateways)
        ]
        self.reps: dict[str, SimReplica] = {}
        self.order: list[SimReplica] = []
        self.reqs: dict[str, _Req] = {}
        self.prefix_keys: dict[str, str] = {}  # conversation -> the gateway's key (``session_ids`` off)
        self.next_rid = 0
        self.next_root = 0
        self.live_roots = 0
        self.pending_starts = 0
        self.uid = 0
        self.end = cfg.duration_s if cfg.duration_s is not None else float("inf")
        self.stats: dict[str, Any] = {
            "sessions_started": 0,
            "sessions_finished": 0,
            "requests_sent": 0,
            "retries": 0,
            "refused": 0,
            "no_replica": 0,
            "residency_checks": {},
            "residency_outcomes": {},
        }

    # ---- fleet ---------------------------------------------------------------------------------

    def add_replica(self, t: float, *, active: bool, by_scaleup: bool) -> SimReplica:
        i = len(self.order)
        ids = self.cfg.replica_ids
        rid = ids[i] if i < len(ids) else f"r{i:03d}"
        feeder = None
        if self.residency is not None:
            feeder = ResidencyFeeder(self.residency.replica(rid), self.page)
        rep = SimReplica.make(i, self.cfg.profile, by_scaleup=by_scaleup, rid=rid, listener=feeder)
        self.order.append(rep)
        self.reps[rep.id] = rep
        status = ReplicaStatus.ACTIVE if active else ReplicaStatus.JOINING
        self.core.upsert_replica(rep.spec, status)
        rep.status = status
        self.core.report_engine_load(rep.id, rep.engine_load(t))
        return rep

    def _activate(self, t: float, rep: SimReplica) -> None:
        if rep.removed or rep.dead or rep.status is not ReplicaStatus.JOINING:
            return
        self.core.set_status(rep.id, ReplicaStatus.ACTIVE)
        rep.status = ReplicaStatus.ACTIVE
        self._resize_pool()

    def _resize_pool(self) -> None:
        """``pooled_chr`` pools the KV of the replicas that serve now (ACTIVE or DRAINING): a scale
        event or a failure changes the bound as it changes the fleet."""
        n, prof = len(self._serving()), self.cfg.profile
        self.pooled.resize(n * prof.capacity_tokens, n * prof.host_tokens)

    def _scale(self, t: float, ev: ScaleEvent) -> None:
        live = [r for r in self.order if not r.removed and not r.dead and r.status in (
            ReplicaStatus.ACTIVE, ReplicaStatus.JOINING)]
        if ev.to > len(live):
            for _ in range(ev.to - len(live)):
                rep = self.add_replica(t, active=False, by_scaleup=True)
                self.loop.at(t + self.cfg.health_interval_s, self._activate, rep)
        elif ev.to < len(live):
            for rep in sorted(live, key=lambda r: -r.index)[: len(live) - ev.to]:
                self.core.set_status(rep.id, ReplicaStatus.DRAINING)
                rep.status = ReplicaStatus.DRAINING
                self._maybe_remove(rep)

    def _maybe_remove(self, rep: SimReplica) -> None:
        if rep.status is ReplicaStatus.DRAINING and rep.in_flight == 0 and not rep.removed:
            self.core.remove_replica(rep.id)
            rep.removed = True
            self._resize_pool()
            if self.residency is not None:
                self.residency.drop(rep.id)

    def _fail(self, t: float, ev: FailureEvent) -> None:
        if ev.replica >= len(self.order):
            return
        rep = self.order[ev.replica]
        if rep.dead or rep.removed:
            return
        rep.dead = True
        self._resize_pool()
        if self.residency is not None:  # its publisher is gone: no exact answer (the estimate decides)
            self.residency.drop(rep.id)
        for rid in sorted(rep.requests):
            req = self.reqs.get(rid)
            rep.done(rid)
            if req is None:
                continue
            if req.t_first is None:
                self._retry_or_fail(t, req, "replica_gone")
            else:
                self._complete(t, req, ok=False, reason="replica_gone")
        self.loop.at(t + self.cfg.fail_detect_s, self._mark_down, rep)

    def _mark_down(self, t: float, rep: SimReplica) -> None:
        if not rep.removed:
            self.core.set_status(rep.id, ReplicaStatus.DOWN)
            rep.status = ReplicaStatus.DOWN

    def _busy(self) -> bool:
        """Sessions still to start or running: periodic tasks keep going only while there are."""
        return self.pending_starts > 0 or self.live_roots > 0

    def _serving(self) -> list[SimReplica]:
        return [
            r
            for r in self.order
            if not r.removed and not r.dead and r.status in (ReplicaStatus.ACTIVE, ReplicaStatus.DRAINING)
        ]

    def _sample(self, t: float, _: object) -> None:
        serving = self._serving()
        self.measures.sample(t, [r.in_flight for r in serving], [r.id for r in serving])
        nt = t + self.cfg.sample_interval_s
        if nt < self.end and self._busy():
            self.loop.at(nt, self._sample)

    def _scrape(self, t: float, _: object) -> None:
        for r in self.order:
            if not r.removed and not r.dead:
                self.core.report_engine_load(r.id, r.engine_load(t))
        nt = t + self.cfg.scrape_interval_s
        if nt < self.end + self.cfg.drain_s and self._busy():
            self.loop.at(nt, self._scrape)

    # ---- sessions ------------------------------------------------------------------------------

    def _start_root(self, t: float, index: int) -> None:
        if t >= self.end or index >= len(self.specs):
            return
        self.live_roots += 1
        spec = self.specs[index]
        self.uid += 1
        root = _Root(spec, index, self.uid)
        self.stats["sessions_started"] += 1
        first = 0
        if self.cfg.start_mid_session and t < self.cfg.warmup_s and len(spec.turns) > 1:
            first = self.rng.randrange(len(spec.turns))
        self._start_chain(t, root, spec, first)

    def _start_chain(self, t: float, root: _Root, spec: SessionSpec, first_turn: int) -> None:
        if t >= self.end:
            if root.open == 0:
                self._root_done(t, root)
            return
        self.uid += 1
        namer = ChainNamer(spec, self.uid, root.uid, self.page, self.cfg.turn_framing_tokens)
        if self.cfg.gateway_assign == "sticky":
            gw = sticky_gateway(root.spec.routing_key, self.cfg.gateways)
        else:
            gw = -1
        chain = _Chain(spec, root, namer, gw, first_turn)
        root.open += 1
        self._send_turn(t, chain)

    def _branch(self, t: float, arg: tuple[_Chain, SessionSpec]) -> None:
        parent, spec = arg
        parent.root.open -= 1  # drop the spawn's placeholder (taken when it was scheduled)
        self._start_chain(t, parent.root, spec, 0)

    def _send_turn(self, t: float, chain: _Chain) -> None:
        k = chain.next_turn
        if t >= self.end or k >= len(chain.spec.turns):
            self._chain_done(t, chain)
            return
        turn = chain.spec.turns[k]
        names = chain.namer.names(k)
        full = chain.namer.full_names(k, names)
        chain.pending = turn.parallel
        for _ in range(turn.parallel):
            self.next_rid += 1
            req = _Req(f"q{self.next_rid}", chain, k, names, full, t)
            self.stats["requests_sent"] += 1
            self._dispatch(t, req)

    def _next_turn(self, t: float, chain: _Chain) -> None:
        self._send_turn(t, chain)

    def _chain_done(self, t: float, chain: _Chain) -> None:
        chain.namer.forget()
        chain.root.open -= 1
        if self.cfg.striped_lanes and chain.spec.parent is None:
            nxt = chain.root.index + self.cfg.lanes
            if nxt >= len(self.specs):
                self.measures.lane_spent(t)
            elif t < self.end:
                self._schedule_start(t, nxt)
        if chain.root.open == 0:
            self._root_done(t, chain.root)

    def _root_done(self, t: float, root: _Root) -> None:
        self.stats["sessions_finished"] += 1
        self.live_roots -= 1
        if self.cfg.striped_lanes:
            return  # the lane went on when the main chain ended
        if self.cfg.lanes > 0 and self.next_root >= len(self.specs):
            self.measures.lane_spent(t)
        elif self.cfg.lanes > 0 and t < self.end:
            self.next_root += 1
            self._schedule_start(t, self.next_root - 1)

    def _schedule_start(self, t: float, index: int) -> None:
        self.pending_starts += 1
        self.loop.at(t, self._start_root_cb, index)

    def _start_root_cb(self, t: float, index: int) -> None:
        self.pending_starts -= 1
        self._start_root(t, index)

    # ---- requests ------------------------------------------------------------------------------

    def _gateway(self, chain: _Chain) -> _Gateway:
        if chain.gateway >= 0:
            return self.gateways[chain.gateway]
        if len(self.gateways) == 1:
            return self.gateways[0]
        return self.gateways[self.rng.randrange(len(self.gateways))]

    def _view(self, gw: _Gateway, t: float, key: str) -> ClusterSnapshot:
        lag = self.cfg.state_lag_s
        if lag <= 0:
            return self.core.snapshot(key)
        if gw.snap is None or t - gw.refreshed_at >= lag:
            gw.refresh(self.core.snapshot(None), t)
        snap = gw.snap
        assert snap is not None
        totals = snap.totals
        if totals is not None:
            totals = replace(totals, active_in_flight=gw.active_in_flight)
        return ClusterSnapshot(
            now=t,
            replicas=tuple(gw.reps),
            session=self.core.session(key),
            seq=snap.seq + gw.sent,
            sessions_active=snap.sessions_active,
            totals=totals,
            positions=snap.positions,
        )

    def _dispatch(self, t: float, req: _Req) -> None:
        chain = req.chain
        gw = self._gateway(chain)
        req.gw = gw.index
        # the conversation this turn continues (the gateway hashes the same thing from the body)
        ck = f"{chain.spec.session_id}~{chain.starts[req.turn]}"
        if self.cfg.session_ids:
            key, source = chain.key, KeySource.HEADER
        else:
            key, source = self._prefix_key(chain, req.turn, ck), KeySource.PREFIX
        req.key = key
        snap = gw.prefill.with_ahead(self._view(gw, t, key), others=self.cfg.gateways > 1)
        request = route_request(key, source, route=CHAT_ROUTE, body_bytes=req.body_bytes, session=snap.session,
                                excluded=req.excluded, chain_key=ck if source is KeySource.HEADER else None)
        try:
            decision = gw.policy.route(request, snap, gw.rng)
        except NoReplicaError:
            self.stats["no_replica"] += 1
            self._complete(t, req, ok=False, reason=None)
            return
        if decision.estimate_check:  # events told residency exactly: would the estimate have agreed?
            checks = self.stats["residency_checks"]
            checks[decision.estimate_check] = checks.get(decision.estimate_check, 0) + 1
        req.residency = decision.residency
        sess = snap.session
        home = sess.home if sess is not None else None
        req.resident = sess.resident_tokens if sess is not None and decision.replica_id == home else None
        try:
            lease = self.core.acquire(decision, request)
        except ReplicaNotFoundError:  # a lagging view chose a replica the store already removed: refused
            req.excluded = req.excluded | {decision.replica_id}
            self._retry_or_fail(t, req, AffinityBreak.REPLICA_GONE.value)
            return
        gw.sent += 1
        if self.cfg.state_lag_s > 0:
            gw.count(lease.replica_id, +1)
        req.lease = lease
        gw.prefill.sent(lease.lease_id, lease.replica_id, expected_uncached(request, snap, lease.replica_id))
        self._count_move(t, req, snap, lease)
        rep = self.reps.get(lease.replica_id)
        if rep is None or rep.dead or rep.removed:
            self._retry_or_fail(t, req, "replica_gone")
            return
        req.replica = rep
        req.ideal = self.ideal.hit_tokens(req.names, req.input_tokens)
        req.pooled = self.pooled.hit(req.names, req.input_tokens)
        n = len(req.names)
        ereq = EngineRequest(req.rid, req.input_tokens, req.names, req.output_tokens, tuple(req.full[n:]),
                             owner=req.key if self.residency is not None else None)
        req.t_submit = t
        try:
            rep.submit(ereq, t)
        except ValueError:  # larger than the whole KV pool: refused (400 from SGLang)
            self.stats["refused"] += 1
            req.replica = None
            self._complete(t, req, ok=False, reason=None)
            return
        self.reqs[req.rid] = req
        self._pump(rep, t)

    def _prefix_key(self, chain: _Chain, turn: int, name: str) -> str:
        key = self.prefix_keys.get(name)
        if key is None:
            of = self.cfg.conversation_key
            key = self.prefix_keys[name] = of(chain.spec, chain.starts[turn]) if of is not None else name
        return key

    def _count_move(self, t: float, req: _Req, snap: ClusterSnapshot, lease: Lease) -> None:
        """A session moved when its home changed (binding policies) or, for policies that bind
        nothing (the baselines), when its main chain's request went somewhere else than the last."""
        root = req.chain.root
        key = req.key
        prev_home = snap.session.home if snap.session is not None else None
        new_home = self.core.session_home(key)
        moved_to: str | None = None
        if new_home is not None:
            if prev_home is not None and new_home != prev_home:
                moved_to = new_home
        elif req.chain.spec.parent is None and req.attempt == 0:
            if root.last_replica is not None and root.last_replica != lease.replica_id:
                moved_to = lease.replica_id
            root.last_replica = lease.replica_id
        if moved_to is not None:
            rep_new = self.reps.get(moved_to)
            # by the scale-up: onto a replica that joined by it, unless the session had to move anyway
            # (its cache gone, its home down or draining), where a new replica is a target like any
            forced = lease.reason in _FORCED_MOVES
            self.measures.session_moved(t, by_scaleup=rep_new is not None and rep_new.by_scaleup and not forced)

    def _release(self, req: _Req, completion: Completion) -> None:
        lease = req.lease
        if lease is None:
            return
        req.lease = None
        self.gateways[req.gw].prefill.prefilled(lease.lease_id)
        self.core.release(lease, completion)
        if self.cfg.state_lag_s > 0:
            self.gateways[req.gw].count(lease.replica_id, -1)

    def _retry_or_fail(self, t: float, req: _Req, reason: str) -> None:
        """The replica refused or died before the first byte: retry elsewhere (bounded)."""
        lease = req.lease
        if lease is not None:
            self._release(req, Completion(ok=False))
            req.excluded = req.excluded | {lease.replica_id}
        self.reqs.pop(req.rid, None)
        req.replica = None
        req.attempt += 1
        if req.attempt < self.cfg.max_attempts:
            self.stats["retries"] += 1
            self._dispatch(t, req)
        else:
            self._complete(t, req, ok=False, reason=reason)

    def _pump(self, rep: SimReplica, t: float) -> None:
        for ev in rep.advance(t):
            req = self.reqs.get(ev.rid)
            if req is None:
                continue
            if isinstance(ev, Started):
                req.cached = ev.cached_device + ev.cached_host
                self.queue_hist.observe(ev.t - req.t_submit)
            elif isinstance(ev, FirstToken):
                req.t_first = ev.t
                if req.lease is not None:
                    self.gateways[req.gw].prefill.prefilled(req.lease.lease_id)
            elif isinstance(ev, Finished):
                rep.done(ev.rid)
                if ev.reason == "length":
                    if req.t_first is not None:
                        self.ttft_sum += req.t_first - req.t_submit
                        self.ttft_count += 1
                    self._complete(ev.t, req, ok=True, reason=None)
                self._maybe_remove(rep)
        nt = rep.next_event_time()
        if nt is not None and nt != rep.wake_at:
            rep.wake_at = nt
            self.loop.at(nt, self._wake, (rep, nt))

    def _queue_reading(self) -> EngineQueue:
        h = self.queue_hist
        cum = tuple((float(bound), count) for bound, count in h.buckets())
        return EngineQueue(cum, h.total, float(sum(h.counts)), self.ttft_sum, float(self.ttft_count))

    def _read_queue_at_warmup(self, t: float, _: object) -> None:
        self.queue_at_warmup = self._queue_reading()

    def _wake(self, t: float, arg: tuple[SimReplica, float]) -> None:
        rep, stamp = arg
        if rep.wake_at != stamp or rep.dead:
            return
        rep.wake_at = None
        self._pump(rep, t)

    def _break(self, req: _Req, lease: Lease, completion: Completion) -> str | None:
        """The gateway's own classification (``classify_break``), as live. Policies that bind no
        session (the baselines) leave the store without a session context, so it abstains; then
        the simulator, which knows what an infinite cache would have hit, classifies the loss
        itself: same replica as the chain's previous turn (or its first) -> evicted; another -> the
        baseline moved it (hash: membership change -> replica_gone; others -> overload_spill)."""
        source = KeySource.HEADER if self.cfg.session_ids else KeySource.PREFIX
        brk = classify_break(lease, completion, source, page_tokens=self.page)
        if brk is not None:
            return brk.value
        if lease.prev_context_tokens > 0 or req.ideal <= 0:
            return None
        tolerance = self.page + 0.02 * req.ideal
        if req.cached >= req.ideal - tolerance:
            return None
        chain = req.chain
        if chain.last_replica is None or chain.last_replica == lease.replica_id:
            return AffinityBreak.EVICTED.value
        if lease.reason is Reason.HASH:
            return AffinityBreak.REPLICA_GONE.value
        return AffinityBreak.OVERLOAD_SPILL.value

    def _complete(self, t: float, req: _Req, *, ok: bool, reason: str | None) -> None:
        self.reqs.pop(req.rid, None)
        lease = req.lease
        break_reason = reason
        if ok:
            completion = Completion(
                ok=True,
                prompt_tokens=req.input_tokens,
                cached_tokens=req.cached,
                completion_tokens=req.output_tokens,
                started_output=True,
                prompt_bytes=req.body_bytes,
            )
            if lease is not None:
                break_reason = self._break(req, lease, completion)
                found = None
                if req.residency:  # kv_aware's decisions on a known session
                    exact = req.resident if req.residency == "events" else None
                    found = home_found(lease, completion, resident_tokens=exact, page_tokens=self.page)
                if found is not None:  # as the gateway counts kvroute_residency_outcomes_total
                    tally = self.stats["residency_outcomes"].setdefault(req.residency, {"found": 0, "missed": 0})
                    tally["found" if found else "missed"] += 1
            self.ideal.add(req.full, req.ideal // self.page)
            self.pooled.insert(req.full)
        else:
            completion = Completion(ok=False, started_output=req.t_first is not None)
        self._release(req, completion)
        ttft = (req.t_first - req.t_start) if req.t_first is not None else t - req.t_start
        self.measures.add(
            RequestRecord(
                session_id=req.chain.key,
                replica=req.replica.id if req.replica is not None else None,
                t_start=req.t_start,
                ttft_s=ttft,
                e2e_s=t - req.t_start,
                input_tokens=req.input_tokens,
                cached_tokens=req.cached if ok else 0,
                output_tokens=req.output_tokens if ok else 0,
                ideal_cached_tokens=req.ideal,
                ok=ok,
                break_reason=break_reason,
                pooled_cached_tokens=req.pooled if ok else 0,
                route_reason=lease.reason.value if lease is not None else None,
                floor_ttft_s=alone_ttft_s(self.cfg.profile, req.input_tokens, req.pooled) if ok else None,
            )
        )
        if lease is not None and req.t_start >= self.cfg.warmup_s:
            self.reasons[lease.reason.value] += 1
        chain = req.chain
        if ok and req.replica is not None:
            chain.last_replica = req.replica.id
        chain.pending -= 1
        if chain.pending > 0:
            return
        k = req.turn
        for b in chain.branches_at.pop(k, ()):
            chain.root.open += 1  # placeholder until the branch starts
            self.loop.at(t + b.start_s, self._branch, (chain, b))
        chain.next_turn = k + 1
        if chain.next_turn >= len(chain.spec.turns):
            self._chain_done(t, chain)
            return
        self.loop.at(t + chain.spec.turns[chain.next_turn].think_s, self._next_turn, chain)

    # ---- run -----------------------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg = self.cfg
        wall0 = time.perf_counter()
        for _ in range(cfg.replicas):
            self.add_replica(0.0, active=True, by_scaleup=False)
        if cfg.striped_lanes:
            for i in range(min(cfg.lanes, len(self.specs))):
                self._schedule_start(float(self.specs[i].start_s), i)
        elif cfg.lanes > 0:
            n = min(cfg.lanes, len(self.specs))
            for i in range(n):
                self._schedule_start(cfg.lane_ramp_s * i / max(1, n), i)
            self.next_root = n
        else:
            for i, s in enumerate(self.specs):
                self._schedule_start(s.start_s, i)
        for _ in range(cfg.lanes - len(self.specs)):  # lanes with no session at all
            self.measures.lane_spent(0.0)
        for ev in cfg.scale:
            self.loop.at(ev.at_s, self._scale, ev)
        for fe in cfg.failures:
            self.loop.at(fe.at_s, self._fail, fe)
        self.loop.at(0.0, self._sample)
        self.loop.at(cfg.scrape_interval_s, self._scrape)
        self.loop.at(cfg.warmup_s, self._read_queue_at_warmup)
        until = None if cfg.duration_s is None else cfg.duration_s + cfg.drain_s
        self.loop.run(until=until)
        self.measures.set_engine_queue(self.queue_at_warmup, self._queue_reading())
        wall = time.perf_counter() - wall0
        m = self.measures.result()
        m["route_reasons"] = dict(sorted(self.reasons.items()))
        stats = dict(self.stats)
        stats.update(
            wall_s=round(wall, 3),
            events=self.loop.processed,
            sim_end_s=round(self.clock.now(), 3),
            unfinished=len(self.reqs),
            replicas_final=len(self._serving()),
        )
        return SimResult(
            policy=cfg.policy,
            measures=m,
            load_histogram=self.measures.load_histogram(),
            stats=stats,
            records=self.measures.records,
        )


def run_sim(specs: Sequence[SessionSpec], config: SimConfig, *, policy: Policy | None = None) -> SimResult:
    """Simulate ``specs`` on the fleet of ``config`` with ``config.policy`` (or the ``policy`` object
    given: every gateway calls it, e.g. a recording wrapper in the parity test). Deterministic.

    ``ValueError`` up front if the cache page does not align with the trace's hash blocks."""
    check_page_size(specs, config.profile.page_size)
    return _Sim(specs, config, policy).run()

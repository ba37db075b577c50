"""Every tunable of the kv_aware policy, with defaults and the reason for each (docs/POLICY.md).

``PolicyParams`` is a frozen value: the admin API changes it live through :meth:`with_changes`, which
validates each key and raises ``ValueError`` naming it, and replaces the whole object atomically.
Load figures are in "requests in flight" units unless the name says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PolicyParams"]


@dataclass(frozen=True, slots=True)
class PolicyParams:
    # ---- rule 2: thicc sessions ------------------------------------------------------------------
    thicc_threshold: int = 3
    """A session with this many requests in flight at one replica sends the next to an overflow."""
    max_overflow: int = 2
    """At most this many overflow replicas per session (a session spans ≤ 1 + max_overflow)."""
    keep_extending: int = 1
    """1: a request whose prompt extends the session's context (``prompt_tokens_estimate`` ≥
    ``context_tokens``: the parent chain's next turn) stays at home even when the session is thicc
    there, and the short requests (sub-agents) are the ones spilled. 0: spill whichever comes."""
    short_to_overflow: int = 0
    """1: while a session has requests in flight and an overflow replica with room, its short
    requests (prompt < session context: sub-agent turns) go to that overflow, where the earlier
    sub-agent turns left their context, instead of alternating between home and overflow."""
    collapse_idle_only: int = 0
    """1: overflow replicas are dropped only when the session has nothing in flight (its fan-out is
    over); 0: whenever a request goes home and an overflow has nothing of the session in flight."""

    # ---- rules 1, 3, 5: load bounds --------------------------------------------------------------
    load_moves: int = 2
    """Which idle sessions rule 5 may move off their home for load (failure, drain and eviction moves
    happen at every level). 2: off a busy home (mean + 1) or one over the hard bound, which keeps
    per-replica load sub-Poisson; 1: only off a home over the hard bound; 0: never. Each load move is
    a cold prefill: lower levels give a better hit rate and TTFT p99 on large or overloaded fleets at
    the cost of dispersion (docs/POLICY.md round 7)."""
    load_moves_max_sessions: float = 12.0
    """Load moves stop (as at ``load_moves`` 0) while the fleet holds more than this many active
    sessions per ACTIVE replica on average. Each session is then a small share of its home's load,
    whose excess over the mean comes from many independent bursts and fades within a few turns,
    while a move still costs a whole cold prefill (round 7: the WEKA replays at 16-25 sessions per
    replica). 0 = no limit."""
    bounded_load_epsilon: float = 0.25
    """No replica takes a new session while it holds ≥ ceil((1+ε)·mean) active sessions."""
    hard_bound_factor: float = 2.0
    hard_bound_min: int = 8
    """Affinity yields when home in-flight ≥ max(hard_bound_min, hard_bound_factor · mean in-flight)."""
    reassign_factor: float = 1.0
    reassign_margin: float = 1.0
    """Home is persistently overloaded when in-flight ≥ reassign_factor · mean + reassign_margin and
    the engine's polled figures (queue > 0, or running over the same bound) showed it too."""
    reassign_min_gain: float = 1.5
    reassign_tokens_per_gain: int = 25_000
    """A soft reassignment happens only if the best alternative scores at least
    reassign_min_gain + move cost / reassign_tokens_per_gain lower than home: cheap sessions
    (small context) move first (rule 5)."""
    reassign_load_ref: float = 4.0
    """Below this mean in-flight per ACTIVE replica a unit of gain buys proportionally less
    re-prefill: tokens_per_gain × min(1, mean / reassign_load_ref). A light fleet's imbalance is
    short-lived and cheap in delay while a move's cold prefill costs the same (round 6). 0 = off."""
    light_move_pressure: float = 1.5
    """Below ``reassign_load_ref`` mean in-flight, a soft move off a busy home (not one over the
    hard bound) also needs home's active working set above light_move_pressure × (1 − mean /
    reassign_load_ref) of its cache (HBM + host). A light fleet's hot spot whose sessions' caches
    fit is home prefilling one long request with cache hits queued behind it; it clears within
    seconds, while the move re-prefills the whole context (rounds 9-10). 0 = off."""
    saturation_fraction: float = 0.75
    """The fleet is saturated while at least this fraction of the pool's engines report requests
    waiting (polled queue > 0): there is no idle capacity to move work to and a move's cold prefill
    only adds work, so soft moves stop (over-bound moves still may, if they pay). 0 = off."""
    move_headroom: float = 0.6
    """A move displaces the target's other sessions for the part of (its homed working set + the
    moved context) beyond this fraction of its cache (HBM + host); that part counts twice in the
    move's price (rule 5)."""
    thrash_factor: float = 1.0
    """A home whose active sessions' context exceeds thrash_factor × (HBM + host tier) is thrashing:
    even the host tier cannot hold its working set, so it recomputes (rule 3)."""

    # ---- rule 4: scale-up ramp -------------------------------------------------------------------
    fresh_window_s: float = 120.0
    """A replica that became ACTIVE less than this long ago is *fresh* and ramp-capped."""
    rehome_delay_s: float = 600.0
    """A replica that joined after the initial fleet takes no *re-homed* session (reassigned,
    evicted) for this long: it fills with new sessions only, so a scale-up moves nothing."""
    ramp_cap_factor: float = 1.5
    """A fresh replica takes at most ramp_cap_factor × its fair share of the placements in the
    store's ramp window (``ReplicaState.placed_recent``), and at least one."""

    # ---- rule 6: residency -----------------------------------------------------------------------
    default_capacity_tokens: int = 850_000
    """KV capacity assumed when neither the spec nor the engine reports one (FP8 TP4 B200)."""
    residency_slack: float = 1.0
    """A session's cache is surely gone once its home wrote more than slack × (HBM + host) tokens
    since the session last wrote there (LRU: everything older than capacity is evicted)."""

    # ---- rule 3: expected-delay score (lower is better) -----------------------------------------
    w_in_flight: float = 1.0
    w_queue: float = 1.0
    w_kv_util: float = 1.0
    w_sessions: float = 0.25
    """Closed-loop sessions come back: each active session bound here counts this many requests."""
    w_working_set: float = 4.0
    """Weight of (working set + this session's context) / HBM capacity beyond working_set_limit."""
    working_set_limit: float = 0.9
    """Fraction of HBM capacity the active working set may fill before the replica is penalised."""
    prefill_tokens_per_unit: int = 10_000
    """Prompt tokens waiting to be computed at a replica (its prefill backlog) that weigh as one
    request in flight: a cold 100k-token prefill ahead of a request delays its first token as much
    as ten warm turns do."""
    score_quantum: float = 0.5
    """Scores within one quantum tie; ties go to the rendezvous-hash winner so gateways agree."""

    # ---- failures --------------------------------------------------------------------------------
    panic_threshold: float = 0.5
    """If fewer than this fraction of non-excluded replicas are ACTIVE, route among every replica
    that still serves (ACTIVE or DRAINING), ignoring load bounds, rather than overload a few."""

    # ---- rule 7: prefix keys ---------------------------------------------------------------------
    prefix_block_chars: int = 1024
    prefix_blocks: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, int) and not isinstance(value, int):
                raise ValueError(f"{f.name}: expected an integer, got {value!r}")  # noqa: TRY004 - the admin API maps ValueError to 400
            _validate(f.name, value)

    def with_changes(self, **changes: Any) -> PolicyParams:
        """A copy with ``changes`` applied; ``ValueError`` names the first bad key."""
        names = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in names:
                raise ValueError(f"{key}: unknown policy parameter")
        coerced = {k: _coerce(k, type(getattr(self, k)), v) for k, v in changes.items()}
        return dataclasses.replace(self, **coerced)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyParams:
        return cls().with_changes(**dict(data))


_POSITIVE_INT = {
    "thicc_threshold",
    "hard_bound_min",
    "reassign_tokens_per_gain",
    "default_capacity_tokens",
    "prefix_block_chars",
    "prefill_tokens_per_unit",
    "prefix_blocks",
}
_FRACTION = {"panic_threshold", "saturation_fraction"}
_FLAG = {"keep_extending", "short_to_overflow", "collapse_idle_only"}


def _coerce(key: str, want: type, value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected {want.__name__}, got bool")  # noqa: TRY004
    if want is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if want is float:
        if isinstance(value, int | float):
            return float(value)
        raise ValueError(f"{key}: expected a number, got {value!r}")
    raise ValueError(f"{key}: unsupported type")  # pragma: no cover - all fields are numbers


def _validate(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number, got {value!r}")  # noqa: TRY004
    if not math.isfinite(value):
        raise ValueError(f"{key}: must be finite")
    if key in _POSITIVE_INT and value < 1:
        raise ValueError(f"{key}: must be ≥ 1, got {value!r}")
    if key in _FLAG and value not in (0, 1):
        raise ValueError(f"{key}: must be 0 or 1, got {value!r}")
    if key == "load_moves" and value not in (0, 1, 2):
        raise ValueError(f"{key}: must be 0, 1 or 2, got {value!r}")
    if key in _FRACTION and not 0.0 <= value <= 1.0:
        raise ValueError(f"{key}: must be within [0, 1], got {value!r}")
    if value < 0:
        raise ValueError(f"{key}: must be ≥ 0, got {value!r}")
    if key == "hard_bound_factor" and value < 1.0:
        raise ValueError(f"{key}: must be ≥ 1, got {value!r}")
    if key == "move_headroom" and not 0.0 < value <= 1.0:
        raise ValueError(f"{key}: must be within (0, 1], got {value!r}")
    if key == "residency_slack" and value <= 0.0:
        raise ValueError(f"{key}: must be > 0, got {value!r}")
    if key == "score_quantum" and value <= 0.0:
        raise ValueError(f"{key}: must be > 0, got {value!r}")

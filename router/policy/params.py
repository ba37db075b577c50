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
    """A session with this many requests in flight at one replica sends the next to an overflow (a
    request that continues the session's context, the parent chain's next turn, stays at home)."""
    max_overflow: int = 2
    """At most this many overflow replicas per session (a session spans ≤ 1 + max_overflow)."""

    # ---- rules 1 and 3: load bounds -------------------------------------------------------------
    hard_bound_factor: float = 2.0
    hard_bound_min: int = 8
    """The hard bound, max(hard_bound_min, hard_bound_factor · mean in-flight): nothing is placed on a
    replica at or beyond it, and a warm session's affinity yields to it where the home is KV-bound
    (its sessions' working set exceeds its HBM + host tier; docs/POLICY.md round 25)."""

    # ---- rule 4: scale-up ramp -------------------------------------------------------------------
    fresh_window_s: float = 120.0
    """A replica that became ACTIVE by scale-up less than this long ago is *fresh* and ramp-capped
    (``router.policy.kv_aware.RAMP_CAP_FACTOR``). A duration, so a time-scaled fleet scales it."""

    # ---- rule 6: residency -----------------------------------------------------------------------
    default_capacity_tokens: int = 850_000
    """KV capacity assumed when neither the engine nor the registration reports one (FP8 TP4 B200)."""

    # ---- rule 3: expected-delay score (lower is better) -----------------------------------------
    w_sessions: float = 0.25
    """Closed-loop sessions come back: each active session bound here counts this many requests.
    Scores closer than half of this tie (the rendezvous winner takes them, so gateways agree): one
    session more always counts, a sliver of working-set penalty does not."""
    w_working_set: float = 4.0
    """Weight of (working set + this session's context) / HBM capacity beyond working_set_limit."""
    working_set_limit: float = 0.9
    """Fraction of HBM capacity the active working set may fill before the replica is penalised."""

    # ---- rule 8: queue spill ---------------------------------------------------------------------
    queue_spill_factor: float = 2.0
    """A warm turn goes elsewhere for this request only when its home's prefill work ahead plus its
    own uncached prompt exceeds this × the same on the best other replica whose host tier has room
    for its prompt (uncached tokens: ``ClusterSnapshot.prefill_ahead``). 0 turns the rule off."""

    # ---- failures --------------------------------------------------------------------------------
    panic_threshold: float = 0.5
    """If fewer than this fraction of the non-excluded, once-active replicas are ACTIVE, route among
    every replica that still serves (ACTIVE or DRAINING), ignoring load bounds, rather than overload
    a few."""

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
    "default_capacity_tokens",
    "prefix_block_chars",
    "prefix_blocks",
}
_FRACTION = {"panic_threshold", "working_set_limit"}
_MAX_INT = 2**53  # integer parameters beyond this lose precision in the policy's float arithmetic


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
            try:
                return float(value)
            except OverflowError:  # an int past float's range (JSON allows any number of digits)
                raise ValueError(f"{key}: must be finite") from None
        raise ValueError(f"{key}: expected a number, got {value!r}")
    raise ValueError(f"{key}: unsupported type")  # pragma: no cover - all fields are numbers


def _validate(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number, got {value!r}")  # noqa: TRY004
    if isinstance(value, int):
        if abs(value) > _MAX_INT:  # math.isfinite() of a larger int raises OverflowError
            raise ValueError(f"{key}: must be at most 2**53")
    elif not math.isfinite(value):
        raise ValueError(f"{key}: must be finite")
    if key in _POSITIVE_INT and value < 1:
        raise ValueError(f"{key}: must be ≥ 1, got {value!r}")
    if key in _FRACTION and not 0.0 <= value <= 1.0:
        raise ValueError(f"{key}: must be within [0, 1], got {value!r}")
    if value < 0:
        raise ValueError(f"{key}: must be ≥ 0, got {value!r}")
    if key == "queue_spill_factor" and 0.0 < value < 1.0:
        raise ValueError(f"{key}: must be 0 (off) or ≥ 1, got {value!r}")
    if key == "hard_bound_factor" and value < 1.0:
        raise ValueError(f"{key}: must be ≥ 1, got {value!r}")

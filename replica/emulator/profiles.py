"""Named replica profiles for the time model and the cache (docs/EMULATOR.md: where the numbers come from).

``kimi-k2.6-b200-tp4`` (default) — Kimi K2.6 NVFP4 on 4xB200, FP8 KV, HiCache 2x, DFlash-like spec:
  * KV capacity 850k tokens (0.77–0.91 M in FP8 on this deployment), host tier 2x = 1.7 M tokens.
  * prefill: t = new x (c_lin + c_attn x (ctx + new/2)) (§6.5) with c_lin = 1/70k tok/s and
    c_attn = c_lin x 3.9e-5 x 1.5 -> cold 100k ≈ 5.6 s, warm 700 on 100k ≈ 70 ms; plus a fixed
    per-forward cost.
  * decode step: 8.4 ms + 0.365 ms x B + Σ ctx x 35,136 B / (8 TB/s x 0.7) (§6.4), each step
    yielding ``spec_accept_length`` tokens per request (DFlash on code ≈ 5.5).
  * host reload: 35,136 B/token over ~50 GB/s ≈ 0.7 µs/token (far cheaper than recompute).

``small-test`` — tiny capacities and a short context so tests hit eviction and queueing quickly.

Every field can be overridden (``with_overrides`` / CLI ``--set field=value`` or named flags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["PROFILES", "SCHEDULE_POLICIES", "Profile", "get_profile", "parse_overrides"]

_FP8_KV_BYTES_PER_TOKEN = 35_136  # 576 x 1 B x 61 layers (§6.2)
_HBM_BW = 8e12
_HBM_EFF = 0.7
_C_LIN = 1.0 / 70_000.0


SCHEDULE_POLICIES: tuple[str, ...] = ("fcfs", "lpm", "shortest-prefill-first")
"""The ``--schedule-policy`` values the engine model implements (SGLang has more)."""


@dataclass(frozen=True, slots=True)
class Profile:
    """Attributes (all times in modelled seconds, token counts in *model* tokens):

    name, model_name, tp_size, context_length: identity as reported by the HTTP surface.
    kv_capacity_tokens: device KV pool (``max_total_num_tokens`` x ``token_unit``).
    host_capacity_tokens: HiCache host pool; 0 disables the host tier.
    page_size: cache block size in *emulated* tokens.
    max_running_requests: continuous-batching slots; the rest wait in the queue.
    chunked_prefill_size: max new tokens computed by one prefill forward.
    prefill_base_s, prefill_c_lin_s, prefill_c_attn_s: prefill forward cost.
    decode_base_s, decode_per_req_s, decode_kv_read_s_per_token: decode step cost.
    spec_accept_length: tokens accepted per request per decode step (1.0 = no speculation).
    host_reload_s_per_token: cost to load one host-tier token back to HBM.
    token_unit: each emulated token stands for this many model tokens (time + capacity).
    evict_whole_nodes: evict whole radix nodes and never merge them, as SGLang 0.5.23 does
        (``cache.py`` Rule 6); ``False`` = the finer model (evict exactly what is needed).
    schedule_policy: the order in which waiting requests are admitted, as SGLang's
        ``--schedule-policy`` (``SCHEDULE_POLICIES``; ``timemodel`` Rule 2).
    prefill_decode_interval, prefill_decode_interval_min_bs: SGLang's ``--prefill-decode-interval``
        and ``--prefill-decode-interval-min-bs``: after a prefill forward, this many decode rounds
        run before the next prefill, while at least ``..._min_bs`` requests decode (0 = SGLang's
        default: prefill first; ``timemodel`` Rule 1).
    """

    name: str = "kimi-k2.6-b200-tp4"
    model_name: str = "moonshotai/Kimi-K2.6"
    tp_size: int = 4
    context_length: int = 262_144
    kv_capacity_tokens: int = 850_000
    host_capacity_tokens: int = 1_700_000
    page_size: int = 64
    max_running_requests: int = 64
    chunked_prefill_size: int = 8192
    prefill_base_s: float = 0.004
    prefill_c_lin_s: float = _C_LIN
    prefill_c_attn_s: float = _C_LIN * 3.9e-5 * 1.5
    decode_base_s: float = 0.0084
    decode_per_req_s: float = 0.000365
    decode_kv_read_s_per_token: float = _FP8_KV_BYTES_PER_TOKEN / (_HBM_BW * _HBM_EFF)
    spec_accept_length: float = 5.5
    host_reload_s_per_token: float = _FP8_KV_BYTES_PER_TOKEN / 50e9
    token_unit: int = 1
    evict_whole_nodes: bool = True
    schedule_policy: str = "fcfs"
    prefill_decode_interval: int = 0
    prefill_decode_interval_min_bs: int = 0

    def __post_init__(self) -> None:
        problems = []
        for f in ("tp_size", "context_length", "kv_capacity_tokens", "page_size", "max_running_requests",
                  "chunked_prefill_size", "token_unit"):
            if getattr(self, f) <= 0:
                problems.append(f"{f} must be > 0")
        for f in ("host_capacity_tokens", "prefill_decode_interval", "prefill_decode_interval_min_bs"):
            if getattr(self, f) < 0:
                problems.append(f"{f} must be >= 0")
        if self.spec_accept_length < 1.0:
            problems.append("spec_accept_length must be >= 1")
        for f in ("prefill_base_s", "prefill_c_lin_s", "prefill_c_attn_s", "decode_base_s", "decode_per_req_s",
                  "decode_kv_read_s_per_token", "host_reload_s_per_token"):
            if getattr(self, f) < 0:
                problems.append(f"{f} must be >= 0")
        if self.decode_base_s + self.decode_per_req_s <= 0:
            problems.append("a decode step must take some time")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            problems.append(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        if problems:
            raise ValueError("invalid profile: " + "; ".join(problems))

    # capacities in emulated tokens (what the HTTP surface reports)
    @property
    def capacity_tokens(self) -> int:
        return self.kv_capacity_tokens // self.token_unit

    @property
    def host_tokens(self) -> int:
        return self.host_capacity_tokens // self.token_unit

    @property
    def max_context_tokens(self) -> int:
        return self.context_length // self.token_unit

    def with_overrides(self, **changes: Any) -> Profile:
        """A copy with fields replaced; string values are cast to the field's type."""
        types = {f.name: f.type for f in fields(self)}
        cast: dict[str, Any] = {}
        for key, value in changes.items():
            key = key.replace("-", "_")
            if key not in types:
                raise ValueError(f"unknown profile field {key!r}; known: {', '.join(sorted(types))}")
            if isinstance(value, str):
                t = str(types[key])
                if t == "bool":
                    if value.lower() not in {"true", "false", "1", "0", "yes", "no"}:
                        raise ValueError(f"profile field {key!r} is a boolean, not {value!r}")
                    value = value.lower() in {"true", "1", "yes"}
                else:
                    value = int(float(value)) if t == "int" else float(value) if t == "float" else value
            cast[key] = value
        return dataclasses.replace(self, **cast)


PROFILES: dict[str, Profile] = {
    "kimi-k2.6-b200-tp4": Profile(),
    "kimi-k2.6-b200-tp4-bf16": Profile(
        name="kimi-k2.6-b200-tp4-bf16",
        kv_capacity_tokens=420_000,
        host_capacity_tokens=840_000,
        decode_kv_read_s_per_token=2 * _FP8_KV_BYTES_PER_TOKEN / (_HBM_BW * _HBM_EFF),
        host_reload_s_per_token=2 * _FP8_KV_BYTES_PER_TOKEN / 50e9,
    ),
    "small-test": Profile(
        name="small-test",
        model_name="emulated/small-test",
        tp_size=1,
        context_length=16_384,
        kv_capacity_tokens=8_192,
        host_capacity_tokens=16_384,
        page_size=16,
        max_running_requests=4,
        chunked_prefill_size=2048,
        spec_accept_length=2.0,
    ),
}


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """``FIELD=VALUE`` items (``kvroute emulate --set``) as ``with_overrides`` keywords, later ones
    winning; ``ValueError`` for an item without ``=`` or a field name."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"a profile setting needs FIELD=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None

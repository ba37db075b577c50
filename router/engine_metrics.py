"""PURE: SGLang's Prometheus exposition (``GET /metrics``, ``Accept: text/plain``) -> ``EngineLoad``,
the same from ``GET /v1/loads`` (:func:`load_from_v1_loads`: all but the host tier, plus the queued
uncached prefill ``/metrics`` lacks), and when each is read (:class:`LoadReadings`: the gateway's
discovery and the sidecar's probe alike).

Names are SGLang's own (``sglang:num_running_reqs`` ...); the underscore
spelling (``sglang_num_running_reqs``, OpenMetrics / ``/v1/loads?format=prometheus``) is accepted too.

Robustness rules (a scrape must never crash the poller or invent load):
  1. HELP text is ignored (older multiprocess registries write "Multiprocess metric").
  2. Missing families leave the field at its default (0); NaN and infinite samples are skipped.
  3. Several label sets of one family are combined: samples that differ only in *rank-like* labels
     (``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``attn_tp_rank``, ``pid``) are copies of one figure
     (``--enable-metrics-for-all-schedulers``, pid-labelled gauges): take the max among them. The
     remaining groups (``dp_rank``, ``engine_type``, ...) are distinct schedulers: sum counts and
     capacities over them, take the max of utilisations.
  4. With priority scheduling, ``priority=""`` is the total; the per-priority series are ignored.
  5. Only the wanted families' sample lines reach the parser: a scrape runs on the gateway's event
     loop, per replica per interval, and SGLang's full exposition (histograms, counters, HELP text)
     is mostly lines we do not need. A line that is neither a comment nor a sample still fails the
     scrape.
  6. Given a ``dp_rank`` (a replica that is one rank of its engine), only that rank's samples and
     those of no rank count: the other ranks are other replicas.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Container, Iterable, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.model import EngineLoad

__all__ = [
    "METRICS_EVERY",
    "LoadReadings",
    "MetricsParseError",
    "listed_dp_ranks",
    "load_from_v1_loads",
    "parse_engine_metrics",
    "scrape_values",
    "v1_loads_query",
]

_PREFIX = "sglang_"
_RANK_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank", "attn_cp_rank", "pid"})

_SUM = "sum"
_MAX = "max"
# EngineLoad field -> its /metrics family (underscore spelling, no prefix), its /v1/loads key (None:
# that source lacks it), and how label groups and DP ranks combine (rule 3)
_FIELDS: dict[str, tuple[str | None, str | None, str]] = {
    "running": ("num_running_reqs", "num_running_reqs", _SUM),
    "queued": ("num_queue_reqs", "num_waiting_reqs", _SUM),
    "kv_util": ("token_usage", "token_usage", _MAX),
    "capacity_tokens": ("max_total_num_tokens", "max_total_num_tokens", _SUM),
    "host_used_tokens": ("hicache_host_used_tokens", None, _SUM),
    "host_capacity_tokens": ("hicache_host_total_tokens", None, _SUM),
    "cache_hit_rate": ("cache_hit_rate", "cache_hit_rate", _MAX),
    "gen_throughput": ("gen_throughput", "gen_throughput", _SUM),
    "waiting_uncached_tokens": (None, "num_waiting_uncached_tokens", _SUM),
}
_COUNTS = frozenset({"running", "queued", "capacity_tokens", "host_used_tokens", "host_capacity_tokens",
                     "waiting_uncached_tokens", "dp_ranks"})  # fmt: skip
_FRACTIONS = frozenset({"kv_util", "cache_hit_rate"})
# family -> how label groups combine
_WANTED: dict[str, str] = {fam: how for fam, _, how in _FIELDS.values() if fam is not None}
_FIELD_OF_FAMILY = {fam: name for name, (fam, _, _) in _FIELDS.items() if fam is not None}


def _engine_load(values: Mapping[str, float], now: float) -> EngineLoad:
    """``values`` (by EngineLoad field; absent: 0) clamped to their ranges: counts are whole and not
    negative, fractions within [0, 1]."""
    fields: dict[str, Any] = {}
    for name, v in values.items():
        v = max(0.0, v)
        fields[name] = round(v) if name in _COUNTS else min(1.0, v) if name in _FRACTIONS else v
    return EngineLoad(updated_at=now, **fields)


class MetricsParseError(ValueError):
    """The text is not a Prometheus exposition."""


_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=[{ \t])")


def _wanted_lines(text: str, want: Container[str]) -> str:
    """The sample lines of wanted families (rule 5); raises on a line that is not one at all."""
    keep: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        m = _SAMPLE_NAME.match(line)
        if m is None:
            raise MetricsParseError(f"not a Prometheus text exposition: {line[:80]!r}")
        if _norm(m.group()) in want:
            keep.append(line)
    keep.append("")
    return "\n".join(keep)


def _norm(name: str) -> str | None:
    n = name.replace(":", "_")
    return n[len(_PREFIX) :] if n.startswith(_PREFIX) else None


def scrape_values(text: str, wanted: Iterable[str] = _WANTED, dp_rank: int | None = None) -> dict[str, float]:
    """Combined value of each wanted gauge family present in ``text`` (rules 2–4, 6)."""
    rank = None if dp_rank is None else str(dp_rank)
    want = {w: _WANTED.get(w, _SUM) for w in wanted}
    # family -> group labels -> values of that group's rank-copies
    groups: dict[str, dict[tuple[tuple[str, str], ...], list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        families = list(text_string_to_metric_families(_wanted_lines(text, want)))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not a Prometheus text exposition: {exc}") from exc
    for fam in families:
        for sample in fam.samples:
            key = _norm(sample.name)
            if key is None or key not in want:
                continue
            value = float(sample.value)
            if math.isnan(value) or math.isinf(value):
                continue
            labels = sample.labels
            if "priority" in labels and labels["priority"] != "":
                continue
            if rank is not None and labels.get("dp_rank", rank) != rank:
                continue
            group = tuple(sorted((k, v) for k, v in labels.items() if k not in _RANK_LABELS))
            groups[key][group].append(value)
    out: dict[str, float] = {}
    for key, by_group in groups.items():
        per_group = [max(vs) for vs in by_group.values() if vs]
        if not per_group:
            continue
        out[key] = sum(per_group) if want[key] == _SUM else max(per_group)
    return out


def parse_engine_metrics(text: str, *, now: float = 0.0, dp_rank: int | None = None) -> EngineLoad:
    """Parse one scrape into an ``EngineLoad`` stamped ``updated_at=now`` (the caller's clock);
    ``dp_rank``: of that data-parallel rank alone (rule 6).

    Raises :class:`MetricsParseError` if the text is not an exposition at all.
    """
    values = scrape_values(text, dp_rank=dp_rank)
    return _engine_load({_FIELD_OF_FAMILY[fam]: v for fam, v in values.items()}, now)


def _ranks(doc: Any) -> list[Mapping[str, Any]]:
    ranks = doc.get("loads") if isinstance(doc, Mapping) else None
    if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
        raise MetricsParseError("not a /v1/loads document (no 'loads' list of objects)")
    return ranks


def v1_loads_query(dp_rank: int | None = None) -> str:
    """The query of a ``GET /v1/loads`` for routing: its flat figures only (without the memory,
    queue and spec sections), and with ``dp_rank`` SGLang's own filter to that rank."""
    return "?include=core" if dp_rank is None else f"?include=core&dp_rank={dp_rank}"


def listed_dp_ranks(doc: Any) -> list[int] | None:
    """The data-parallel ranks a ``/v1/loads`` answer lists, sorted (``None``: not such an answer)."""
    try:
        listed = [r.get("dp_rank") for r in _ranks(doc)]
    except MetricsParseError:
        return None
    ranks = [r for r in listed if type(r) is int]
    return sorted(ranks) if len(ranks) == len(listed) else None


def _finite(v: Any) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def load_from_v1_loads(
    doc: Any, *, now: float = 0.0, host: EngineLoad | None = None, dp_rank: int | None = None
) -> EngineLoad:
    """An ``EngineLoad`` from one ``GET /v1/loads`` answer alone, stamped ``updated_at=now``: every
    figure ``/metrics`` gives but the HiCache host tier, which is taken from ``host`` (an earlier
    ``/metrics`` reading; 0 without one). DP ranks combine as ``/metrics``' schedulers do (rule 3);
    with ``dp_rank``, that rank's entry alone (rule 6).
    Raises :class:`MetricsParseError` unless every rank reports its running requests: an answer
    that does not is no load report to go by (``/metrics`` then is)."""
    ranks = _ranks(doc)
    if dp_rank is not None:
        ranks = [r for r in ranks if type(r.get("dp_rank")) is int and r["dp_rank"] == dp_rank]
        if not ranks:
            raise MetricsParseError(f"a /v1/loads document without data-parallel rank {dp_rank}")
    if not ranks or any(_finite(r.get("num_running_reqs")) is None for r in ranks):
        raise MetricsParseError("a /v1/loads document without num_running_reqs for every rank")
    values: dict[str, float] = {}
    for name, (_, key, how) in _FIELDS.items():
        found = [v for r in ranks if key is not None and (v := _finite(r.get(key))) is not None]
        if found:
            values[name] = sum(max(0.0, v) for v in found) if how == _SUM else max(found)
    if host is not None:
        values["host_used_tokens"], values["host_capacity_tokens"] = host.host_used_tokens, host.host_capacity_tokens
    values["dp_ranks"] = len(ranks)
    return _engine_load(values, now)


METRICS_EVERY = 10
"""While ``/v1/loads`` answers, ``/metrics`` is read at every this many readings only: the host tier's
figures are all it adds, and parsing SGLang's whole exposition (35.7 kB on the real CPU engine, idle)
is most of a reading's cost."""


class LoadReadings:
    """One engine's load read over time: ``/v1/loads`` every time, ``/metrics`` when
    :meth:`metrics_due` (the first time, every ``METRICS_EVERY``-th, and whenever ``/v1/loads`` gave
    nothing: an older engine, another engine), its host tier's figures kept in between. Not thread-safe;
    one per engine."""

    __slots__ = ("_host", "_wait")

    def __init__(self) -> None:
        self._host: EngineLoad | None = None  # the last /metrics reading
        self._wait = 0  # readings until /metrics is due again

    @property
    def host(self) -> EngineLoad | None:
        """The last ``/metrics`` reading (its host-tier figures go into :func:`load_from_v1_loads`)."""
        return self._host

    def metrics_due(self, loads: EngineLoad | None) -> bool:
        """Whether ``/metrics`` is read this time, given what ``/v1/loads`` gave (``None``: nothing)."""
        if loads is not None and self._wait > 0:
            self._wait -= 1
            return False
        return True

    def combine(self, loads: EngineLoad | None, metrics: EngineLoad | None) -> EngineLoad | None:
        """The load of a reading for which ``/metrics`` was due (``None`` where it gave nothing)."""
        if metrics is None:
            return loads
        self._host, self._wait = metrics, METRICS_EVERY - 1
        if loads is None:
            return metrics
        return replace(loads, host_used_tokens=metrics.host_used_tokens, host_capacity_tokens=metrics.host_capacity_tokens)

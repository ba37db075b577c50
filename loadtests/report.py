"""Tables and plots for live runs: one row / one curve per policy or router.

* :func:`comparison_table` — the measures (``loadtests/measures.py``) side by side (rich).
* :func:`plot_load` — per-replica load, like the seed's charts: left, the distribution of per-replica
  in-flight requests pooled over samples (with the Poisson pmf of the same mean, which is what
  uniform hashing tends to); right, each replica's mean in-flight (imbalance at a glance).
* :func:`plot_ttft_cdf` — the TTFT CDF per policy (log x).

matplotlib is imported lazily with the Agg backend, so tables work without a display.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["comparison_table", "load_values", "plot_load", "plot_ttft_cdf", "replica_means", "spent_lanes_caption"]

_ROWS: tuple[tuple[str, str, str], ...] = (
    ("chr", "CHR", "{:.3f}"),
    ("ideal_chr", "ideal CHR", "{:.3f}"),
    ("pooled_chr", "pooled CHR (one shared LRU)", "{:.3f}"),
    ("routing_loss", "routing loss (pooled - CHR)", "{:.3f}"),
    ("routing_loss_by_route", "  by decision", "{:.3f}"),
    ("dispersion", "dispersion (var/mean)", "{:.2f}"),
    ("dispersion_between", "  of it between replicas", "{:.2f}"),
    ("dispersion_floor", "dispersion floor (sticky)", "{:.2f}"),
    ("dispersion_sticky", "  with parallel requests", "{:.2f}"),
    ("p_load_le1", "P(load<=1)", "{:.3f}"),
    ("p_load_ge12", "P(load>=12)", "{:.4f}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99 (s)", "{:.2f}"),
    ("ttft_floor_p99_s", "  floor: no queueing", "{:.2f}"),
    ("ttft_p99_ceiling_s", "  no-contention fleet (simulated)", "{:.2f}"),
    ("engine_queue_p99_s", "  engines' queue time p99", "{:.2f}"),
    ("engine_queue_share", "  share of engine TTFT queued", "{:.2f}"),
    ("e2e_p99_s", "E2E p99 (s)", "{:.2f}"),
    ("tps_user_p50", "tok/s/user p50", "{:.1f}"),
    ("throughput_tok_s_per_replica", "tok/s/replica", "{:.0f}"),
    ("cold_prefill_tokens", "cold prefill tok", "{:,}"),
    ("cold_prefill_by_cause", "  by cause", "{:,}"),
    ("cold_prefill_by_route", "  by decision", "{:,}"),
    ("sessions_moved", "sessions moved", "{}"),
    ("requests", "requests", "{}"),
    ("requests_ceiling", "  ceiling: no contention (simulated)", "{}"),
    ("requests_of_ceiling", "  requests / ceiling", "{:.2f}"),
    ("lanes_spent", "  lanes out of sessions", "{}"),
    ("errors", "errors", "{}"),
)


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, Mapping):  # a breakdown: "cause value, ..." with the row's format
        return ", ".join(f"{k} {_fmt(v, fmt)}" for k, v in value.items()) or "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def comparison_table(results: Mapping[str, Mapping[str, Any]], title: str = "measures") -> Any:
    """A rich ``Table``: one column per policy/router, one row per measure."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("measure")
    for name in results:
        table.add_column(name, justify="right")
    for key, label, fmt in _ROWS:
        table.add_row(label, *(_fmt(m.get(key), fmt) for m in results.values()))
    breaks = [m.get("affinity_breaks") or {} for m in results.values()]
    table.add_row("affinity breaks", *(", ".join(f"{k} {v}" for k, v in b.items()) or "0" for b in breaks))
    table.caption = spent_lanes_caption(results, "use more sessions or a shorter run")
    return table


def spent_lanes_caption(results: Mapping[str, Mapping[str, Any]], hint: str) -> str | None:
    """The note under a table whose routers ran lanes out of sessions (``lanes_spent``), else None."""
    spent = [f"{name} {m['lanes_spent']}" for name, m in results.items() if m.get("lanes_spent")]
    if not spent:
        return None
    return (
        f"lanes out of sessions before the window ended: {', '.join(spent)}. A spent lane sends nothing"
        f" more, so requests also measure the workload's pool: {hint}"
    )


def load_values(samples: Sequence[tuple[float, Sequence[int]]]) -> list[int]:
    """Pooled per-replica in-flight values from ``(t, loads)`` samples."""
    return [x for _, loads in samples for x in loads]


def replica_means(samples: Sequence[tuple[float, Sequence[int]]]) -> list[float]:
    if not samples:
        return []
    n = len(samples[0][1])
    sums = [0.0] * n
    count = 0
    for _, loads in samples:
        if len(loads) != n:
            continue
        count += 1
        for i, x in enumerate(loads):
            sums[i] += x
    return [s / count for s in sums] if count else []


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_load(
    per_policy: Mapping[str, Sequence[tuple[float, Sequence[int]]]], path: Path, title: str = ""
) -> Path:
    """Per-replica load: in-flight distribution (+ Poisson reference) and per-replica means."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(per_policy)
    width = 0.8 / max(len(names), 1)
    top = 1
    for i, name in enumerate(names):
        values = load_values(per_policy[name])
        if not values:
            continue
        counts = Counter(values)
        n = len(values)
        top = max(top, max(counts))
        xs = sorted(counts)
        ax1.bar([x + (i - (len(names) - 1) / 2) * width for x in xs], [counts[x] / n for x in xs],
                width=width, label=name)
        means = replica_means(per_policy[name])
        ax2.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(means))], means, width=width, label=name)
    all_values = [x for name in names for x in load_values(per_policy[name])]
    if all_values:
        mean = sum(all_values) / len(all_values)
        ks = list(range(top + 1))
        if mean > 0:
            ax1.plot(ks, [math.exp(-mean) * mean**k / math.factorial(k) for k in ks], "k--", lw=1,
                     label=f"Poisson({mean:.1f})")
    if top > 30:  # keep the body readable; a router that herds everything onto one replica shows
        ax1.set_xlim(-0.5, 30.5)  # up in the right panel anyway
        ax1.text(0.98, 0.5, f"x axis cut at 30 (max {top})", transform=ax1.transAxes, ha="right", fontsize=8)
    ax1.set_xlabel("in-flight requests on a replica (sampled)")
    ax1.set_ylabel("fraction of samples")
    ax1.set_title("per-replica load distribution")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("replica")
    ax2.set_ylabel("mean in-flight")
    ax2.set_title("mean load per replica")
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(per_policy: Mapping[str, Sequence[float]], path: Path, title: str = "") -> Path:
    """Empirical TTFT CDF per policy (modelled seconds, log x)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ttfts in per_policy.items():
        xs = sorted(t for t in ttfts if t > 0 and not math.isnan(t))
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (modelled seconds)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title or "TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def histogram_quantiles(metrics_text: str, name: str, qs: Sequence[float]) -> list[float | None]:
    """Quantiles (linear within a bucket, Prometheus ``histogram_quantile`` style) of histogram
    ``name`` summed over its label sets, from Prometheus text exposition. None if absent/empty."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
    if not buckets:
        return [None for _ in qs]
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return [None for _ in qs]
    out: list[float | None] = []
    for q in qs:
        rank = q * total
        prev_b, prev_c = 0.0, 0.0
        value: float | None = None
        for b in bounds:
            c = buckets[b]
            if c >= rank:
                if math.isinf(b):
                    value = prev_b
                else:
                    frac = 0.0 if c == prev_c else (rank - prev_c) / (c - prev_c)
                    value = prev_b + (b - prev_b) * frac
                break
            prev_b, prev_c = b, c
        out.append(value)
    return out

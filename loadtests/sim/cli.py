"""``kvroute sim``: run routing policies on the identical workload in the fleet simulator.

    kvroute sim --workload synthetic|weka|mooncake [--trace PATH] --replicas R
                --policies kv_aware,hash,... [--gateways G] [--state-lag-s S]
                [--scale-up AT:TO] [--scale-down AT:TO] [--fail AT:INDEX]
                [--duration S] [--warmup S] [--sessions N] [--lanes N] [--seed K] [--jobs N]
                [--ceiling] --json PATH

Writes ``{policy: measures}`` (DESIGN §7 field names) to ``--json`` and prints a table.
``--details PATH`` also writes the run statistics, the per-replica load histograms and the
configuration. ``--ceiling`` also runs the workload on a fleet without contention
(``loadtests.sim.ceiling``) and adds ``requests_ceiling`` and ``requests_of_ceiling`` to every
policy's measures: how much of what the closed loop allows each policy completes. Defaults per
workload are in ``_DEFAULTS`` and docs/SIMULATOR.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import random
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtests.sim.ceiling import ceiling_config, run_ceiling, with_ceiling
from loadtests.sim.prompts import check_page_size
from loadtests.sim.run import DEFAULT_PAGE_SIZE, FailureEvent, ScaleEvent, SimConfig, SimResult, run_sim
from loadtests.workloads import (
    DEFAULT_MOONCAKE_TRACE,
    DEFAULT_WEKA_TRACE,
    SessionSpec,
    SyntheticParams,
    SyntheticSessions,
    drop_long_requests,
    read_mooncake,
    read_weka,
    with_arrivals,
)
from replica.emulator.profiles import Profile, get_profile
from router.policy.params import PolicyParams
from router.policy.registry import POLICIES

__all__ = ["build_parser", "cli_main", "load_workload"]

# Per-workload defaults: (lanes per replica, duration_s, warmup_s, max_think_s)
_DEFAULTS: dict[str, dict[str, float]] = {
    "synthetic": {"lanes_per_replica": 7, "duration_s": 600.0, "warmup_s": 120.0, "max_think_s": 0.0},
    "weka": {"lanes_per_replica": 8, "duration_s": 1800.0, "warmup_s": 300.0, "max_think_s": 60.0},
    "mooncake": {"lanes_per_replica": 0, "duration_s": 3600.0, "warmup_s": 300.0, "max_think_s": 0.0},
}


def _at_to(text: str) -> tuple[float, int]:
    try:
        at, to = text.split(":", 1)
        return float(at), int(to)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AT:N (seconds:count), got {text!r}") from None


def _kv(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()


def _variant(text: str) -> tuple[str, str, dict[str, float]]:
    try:
        label, rest = text.split("=", 1)
        policy, _, changes = rest.partition(":")
        kv = dict(_kv(c) for c in changes.split(",") if c.strip())
        return label.strip(), policy.strip(), {k: float(v) for k, v in kv.items()}
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected LABEL=POLICY:K=V,K=V, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute sim", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--workload", choices=("synthetic", "weka", "mooncake"), default="synthetic")
    p.add_argument("--trace", type=Path, help="trace file (weka: *_requests.jsonl, mooncake: *_trace.jsonl)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--policies", default="kv_aware,hash", help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--gateways", type=int, default=1)
    p.add_argument("--state-lag-s", type=float, default=0.0, help="gateway replica-table refresh interval")
    p.add_argument("--gateway-assign", choices=("random", "sticky"), default="random")
    p.add_argument("--scale-up", type=_at_to, action="append", default=[], metavar="AT:TO")
    p.add_argument("--scale-down", type=_at_to, action="append", default=[], metavar="AT:TO")
    p.add_argument("--fail", type=_at_to, action="append", default=[], metavar="AT:INDEX")
    p.add_argument("--duration", type=float, help="seconds of simulated time with new turns")
    p.add_argument("--warmup", type=float, help="seconds excluded from the measures")
    p.add_argument("--sessions", type=int, help="synthetic: sessions generated; traces: at most this many")
    p.add_argument("--lanes", type=int, help="sessions kept alive (0: use each session's start time)")
    p.add_argument("--no-mid-start", action="store_true", help="initial sessions start at turn 0")
    p.add_argument("--arrival-rate", type=float, help="traces without a clock (weka), lanes 0: sessions/s")
    p.add_argument("--max-think-s", type=float, help="cap on a think time (0: none)")
    p.add_argument("--max-input-tokens", type=int,
                   help="drop requests with longer prompts (weka default: the profile's context window; 0: keep all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--set", type=_kv, action="append", default=[], metavar="FIELD=V", help="profile override")
    p.add_argument("--param", type=_kv, action="append", default=[], metavar="K=V", help="kv_aware PolicyParams")
    p.add_argument("--variant", type=_variant, action="append", default=[], metavar="LABEL=POLICY:K=V,K=V",
                   help="also run POLICY with these PolicyParams changes, reported as LABEL (tuning)")
    p.add_argument("--synthetic", type=_kv, action="append", default=[], metavar="K=V", help="SyntheticParams")
    p.add_argument("--no-session-id", action="store_true",
                   help="the clients send no session id: the gateway keys each conversation by its prompt (rule 7)")
    p.add_argument("--kv-events", action="store_true",
                   help="replicas publish SGLang's KV events; kv_aware routes on exact residency")
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--scrape-interval-s", type=float, default=1.0)
    p.add_argument("--json", type=Path, required=True, help="write {policy: measures} here")
    p.add_argument("--details", type=Path, help="also write stats, load histograms, config here")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the policies in this many worker processes (same results as 1)")
    p.add_argument("--ceiling", action="store_true",
                   help="also run the sessions on a fleet without contention (3 replicas a lane, 20x HBM): "
                        "requests_ceiling and requests_of_ceiling per policy")
    p.add_argument("--quiet", action="store_true")
    return p


def _synthetic_params(pairs: Sequence[tuple[str, str]], sessions: int) -> SyntheticParams:
    types = {f.name: f.type for f in dataclasses.fields(SyntheticParams)}
    changes: dict[str, Any] = {"sessions": sessions}
    for k, v in pairs:
        k = k.replace("-", "_")
        if k not in types:
            raise ValueError(f"--synthetic {k}: unknown; known: {', '.join(sorted(types))}")
        t = str(types[k])
        if v.lower() == "none":
            changes[k] = None
        elif t.startswith("int"):
            changes[k] = int(float(v))
        else:
            changes[k] = float(v)
    return SyntheticParams(**changes)


def _cap_think(specs: Sequence[SessionSpec], cap: float) -> list[SessionSpec]:
    def cap_one(s: SessionSpec) -> SessionSpec:
        turns = tuple(replace(t, think_s=min(t.think_s, cap)) if t.think_s > cap else t for t in s.turns)
        return replace(s, turns=turns, start_s=s.start_s if s.parent is None else min(s.start_s, cap),
                       branches=tuple(cap_one(b) for b in s.branches))

    return [cap_one(s) for s in specs]


def load_workload(args: argparse.Namespace, lanes: int, context_window: int = 0) -> Sequence[SessionSpec]:
    rng = random.Random(f"workload:{args.seed}")
    specs: Sequence[SessionSpec]
    if args.workload == "synthetic":
        n = args.sessions or max(100, 4 * lanes)
        # generated as the run reads them (the cap and the filter below read them all)
        specs = SyntheticSessions(_synthetic_params(args.synthetic, n), rng)
    elif args.workload == "weka":
        weka = read_weka(args.trace or DEFAULT_WEKA_TRACE, limit=args.sessions)
        rng.shuffle(weka)
        specs = with_arrivals(weka, rng, rate_per_s=args.arrival_rate or 0.5) if lanes == 0 else weka
    else:
        specs = read_mooncake(args.trace or DEFAULT_MOONCAKE_TRACE, limit=args.sessions)
    cap = args.max_think_s if args.max_think_s is not None else _DEFAULTS[args.workload]["max_think_s"]
    if cap and cap > 0:
        specs = _cap_think(specs, cap)
    limit = args.max_input_tokens
    if limit is None:
        limit = context_window if args.workload == "weka" else 0
    if limit > 0:
        specs = drop_long_requests(specs, limit)
    return specs


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _print_table(results: list[SimResult], quiet: bool) -> None:
    if quiet:
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvroute sim: DESIGN §7 measures per policy")
    cols = ["policy", "chr", "ideal", "pooled", "disp", "floor", "p≤1", "p≥12", "ttft p50", "ttft p99", "e2e p99",
            "moved", "by scale-up", "breaks", "cold prefill Mtok", "requests", "errors", "wall s"]
    ceiling = any("requests_of_ceiling" in r.measures for r in results)
    if ceiling:
        cols.insert(cols.index("errors"), "req/ceil")
    for c in cols:
        t.add_column(c, justify="right" if c != "policy" else "left")
    for r in results:
        m = r.measures
        t.add_row(
            r.policy, _fmt(m["chr"]), _fmt(m["ideal_chr"]), _fmt(m["pooled_chr"]), _fmt(m["dispersion"]),
            _fmt(m["dispersion_floor"]), _fmt(m["p_load_le1"]),
            _fmt(m["p_load_ge12"], 4), _fmt(m["ttft_p50_s"]), _fmt(m["ttft_p99_s"]), _fmt(m["e2e_p99_s"]),
            str(m["sessions_moved"]), str(m["sessions_moved_by_scaleup"]),
            str(sum(m["affinity_breaks"].values())), f"{m['cold_prefill_tokens'] / 1e6:.1f}",
            str(m["requests"]), *([_fmt(m.get("requests_of_ceiling"))] if ceiling else []), str(m["errors"]),
            _fmt(r.stats["wall_s"], 1),
        )
    from loadtests.report import spent_lanes_caption

    t.caption = spent_lanes_caption({r.policy: r.measures for r in results}, "use more --sessions or a shorter --duration")
    Console(stderr=True, width=max(200, Console(stderr=True).width)).print(t)


def _simulate(specs: Sequence[SessionSpec], base: SimConfig, label: str, policy: str,
              params: PolicyParams) -> SimResult:
    res = run_sim(specs, replace(base, policy=policy, policy_params=params))
    return replace(res, policy=label, records=())  # the records stay in the process that made them


GC_YOUNG_THRESHOLD = 50_000
"""Allocations between two young collections of the cyclic GC during a run (CPython's default: 700)."""


@contextmanager
def _settled_gc() -> Iterator[None]:
    """Make the cyclic GC cheap for the run. A run allocates millions of small objects that live for
    minutes (cache nodes and their block names, sessions, records) and churns through containers of
    fleet size (the snapshot's replica tuple): with the default thresholds the collector took ~14 %
    of a 1,000-replica run (young collections ~800 times a minute, full ones over the whole
    workload). What exists before the run (modules, parsed arguments) is frozen out of it, and young
    collections happen ~70x less often. Nothing in a run is freed through the collector on purpose
    (no finalizers, no weak references), so the results are the same; only when memory is given
    back changes. The caller's settings come back afterwards (``cli_main`` also runs in tests)."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


_worker_input: tuple[Sequence[SessionSpec], SimConfig] | None = None  # set once in each worker


def _worker_init(specs: Sequence[SessionSpec], base: SimConfig) -> None:
    global _worker_input
    _worker_input = (specs, base)


def _worker_run(label: str, policy: str, params: PolicyParams) -> SimResult:
    assert _worker_input is not None
    return _simulate(*_worker_input, label, policy, params)


def _simulate_all(specs: Sequence[SessionSpec], base: SimConfig, runs: Sequence[tuple[str, str, PolicyParams]],
                  jobs: int) -> Iterator[SimResult]:
    """Each run in order; with ``jobs > 1`` in that many worker processes. A run is a deterministic
    function of its inputs, so where it runs changes nothing. Forked workers inherit the workload
    (the initializer's arguments are not pickled under fork); spawned ones get it pickled once."""
    if jobs <= 1 or len(runs) <= 1:
        for label, pol, pparams in runs:
            yield _simulate(specs, base, label, pol, pparams)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(min(jobs, len(runs)), mp_context=ctx, initializer=_worker_init,
                             initargs=(specs, base)) as pool:
        yield from pool.map(_worker_run, *zip(*runs, strict=True))


def _sim_config(args: argparse.Namespace, profile: Profile, lanes: int, duration: float, warmup: float) -> SimConfig:
    scale = tuple(ScaleEvent(at, to) for at, to in args.scale_up + args.scale_down)
    fails = tuple(FailureEvent(at, idx) for at, idx in args.fail)
    return SimConfig(
        replicas=args.replicas,
        profile=profile,
        gateways=args.gateways,
        state_lag_s=args.state_lag_s,
        gateway_assign=args.gateway_assign,
        scrape_interval_s=args.scrape_interval_s,
        sample_interval_s=args.sample_interval_s,
        warmup_s=warmup,
        duration_s=duration,
        lanes=lanes,
        start_mid_session=not args.no_mid_start and lanes > 0,
        scale=scale,
        failures=fails,
        seed=args.seed,
        kv_events=args.kv_events,
        session_ids=not args.no_session_id,
    )


def cli_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    d = _DEFAULTS[args.workload]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies + [v[1] for v in args.variant] if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if args.replicas < 1 or args.gateways < 1:
        parser.error("--replicas and --gateways must be >= 1")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    lanes = args.lanes if args.lanes is not None else int(d["lanes_per_replica"] * args.replicas)
    if args.ceiling and lanes <= 0:
        parser.error("--ceiling is a closed loop's limit: it needs --lanes > 0")
    try:
        profile = get_profile(args.profile).with_overrides(page_size=args.page_size, **dict(args.set))
        params = PolicyParams().with_changes(**{k: float(v) for k, v in args.param})
        specs = load_workload(args, lanes, profile.context_length)
        check_page_size(specs, profile.page_size)
    except (ValueError, OSError) as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    duration = args.duration if args.duration is not None else d["duration_s"]
    warmup = args.warmup if args.warmup is not None else d["warmup_s"]
    if duration <= 0 or warmup < 0:
        parser.error("--duration must be > 0 and --warmup >= 0")
    runs: list[tuple[str, str, PolicyParams]] = [(p, p, params) for p in policies]
    try:
        runs += [(label, pol, params.with_changes(**ch)) for label, pol, ch in args.variant]
    except ValueError as exc:
        print(f"kvroute sim: --variant: {exc}", file=sys.stderr)
        return 2
    if len({label for label, _, _ in runs}) != len(runs):
        parser.error("policy and variant labels must be unique")
    try:
        base = _sim_config(args, profile, lanes, duration, warmup)
    except ValueError as exc:
        parser.error(str(exc))
    results: list[SimResult] = []
    with _settled_gc():
        for res in _simulate_all(specs, base, runs, args.jobs):
            results.append(res)
            if not args.quiet:
                print(f"[sim] {res.policy}: {res.stats['requests_sent']} requests, {res.stats['events']} events, "
                      f"{res.stats['wall_s']:.1f} s wall", file=sys.stderr)
    ceil = None
    if args.ceiling:
        with _settled_gc():
            ceil = run_ceiling(specs, base)
        results = [replace(r, measures=with_ceiling(r.measures, ceil)) for r in results]
        if not args.quiet:
            print(f"[sim] ceiling (no contention, {ceiling_config(base).replicas} replicas): "
                  f"{ceil['requests_ceiling']} requests", file=sys.stderr)
    out = {r.policy: r.measures for r in results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if args.details is not None:
        details = {
            "argv": argv,
            "workload": args.workload,
            "sessions": len(specs),
            "lanes": lanes,
            "duration_s": duration,
            "warmup_s": warmup,
            "profile": dataclasses.asdict(profile),
            "policy_params": {label: pp.to_dict() for label, _, pp in runs},
            "runs": {
                r.policy: {"stats": r.stats, "load_histogram": {str(k): v for k, v in r.load_histogram.items()}}
                for r in results
            },
        }
        args.details.parent.mkdir(parents=True, exist_ok=True)
        args.details.write_text(json.dumps(details, indent=2, sort_keys=True) + "\n")
    _print_table(results, args.quiet)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))

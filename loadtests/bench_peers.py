"""``kvroute bench peers``: kvroute against sglang-router and vllm-router on the identical workload.

Each target runs on a fresh emulated fleet (``loadtests.peers`` starts the routers, ``loadtests.demo``
drives the load); ``--seeds`` repeats the comparison per seed and pairs the measures seed by seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtests.live import API_PATHS, GATEWAY_ASSIGN, Outcome
from loadtests.peers import PEERS, find_binary, with_engine_dp

__all__ = ["BENCH_TARGETS", "bench_peers_main", "requests_path", "run_peers_bench", "seeds_table", "summarise_seeds"]


BENCH_TARGETS: tuple[str, ...] = (
    "kvroute",
    "sglang-cache_aware",
    "sglang-manual",
    "vllm-consistent_hash",
    "vllm-sticky_least_loaded",
)


def requests_path(out_dir: Path, router: str) -> Path:
    """Where ``run_peers_bench`` writes ``router``'s requests, one JSON line each."""
    return out_dir / f"requests-{router.replace(' ', '_')}.jsonl"


async def run_peers_bench(
    targets: Sequence[str],
    scenario: object,
    *,
    out_dir: Path,
    say: Callable[[str], None],
    fleet_urls: Sequence[str] | None = None,
    engine_dp: int = 1,
) -> dict[str, object]:
    """Each target on a fresh emulated fleet, the identical workload; returns the JSON document.
    ``fleet_urls``: real engines already running instead (``--fleet real-sglang``): every target
    meets the same engines one after another, their caches flushed before each. ``engine_dp``: the
    engines' data-parallel ranks; every peer then runs in its own data-parallel mode."""
    from loadtests.demo import DemoScenario, run_policy
    from loadtests.report import plot_load, plot_ttft_cdf

    assert isinstance(scenario, DemoScenario)
    sessions = scenario.workload()
    results: dict[str, dict[str, object]] = {}
    skipped: dict[str, str] = {}
    loads: dict[str, list[tuple[float, tuple[int, ...]]]] = {}
    ttfts: dict[str, list[float]] = {}
    requests: dict[str, Sequence[Outcome]] = {}
    warm = scenario.duration_s * scenario.warmup_frac / scenario.time_scale
    with tempfile.TemporaryDirectory(prefix="kvroute-peers-") as tmp:
        for t in targets:
            spec = with_engine_dp(PEERS[t], engine_dp)
            if find_binary(spec.binary) is None:
                skipped[spec.name] = f"{spec.binary} not installed (pip install 'kvroute[peers]')"
                say(f"skip {spec.name}: {skipped[spec.name]}")
                continue
            say(f"running {spec.name} ({scenario.duration_s:.0f} s){'; ' + spec.note if spec.note else ''}")
            if fleet_urls is not None:
                from loadtests.real_sglang import flush_caches

                await asyncio.to_thread(flush_caches, list(fleet_urls))  # every target starts cold
            try:
                res = await run_policy(
                    spec, scenario, sessions, log_dir=Path(tmp), live=False, fleet_urls=fleet_urls
                )
            except RuntimeError as exc:  # a router that failed to start: report, go on with the rest
                skipped[spec.name] = f"failed to start: {str(exc).splitlines()[0]}"
                say(f"skip {spec.name}: {skipped[spec.name]}")
                continue
            m = dict(res.measures)
            m["router"] = spec.kind
            m["policy"] = spec.policy
            m["note"] = spec.note
            results[spec.name] = m
            loads[spec.name] = [s for s in res.load_samples if s[0] >= warm]
            requests[spec.name] = res.outcomes
            ttfts[spec.name] = [o.ttft_s for o in res.outcomes if o.ok and o.ttft_s is not None and o.t_start >= warm]
    if fleet_urls is None:  # the emulated fleet's time model is known: the no-contention ceiling
        from loadtests.scenario import ceiling
        from loadtests.sim.ceiling import with_ceiling

        ceil = ceiling(scenario)
        results = {name: with_ceiling(m, ceil) for name, m in results.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "real SGLang servers" if fleet_urls is not None else "emulated replicas"
    for name, outcomes in requests.items():  # every request as the client saw it, to find where a tail came from
        with requests_path(out_dir, name).open("w") as f:
            f.writelines(json.dumps(asdict(o)) + "\n" for o in outcomes)
    plots = {
        "load": str(plot_load(loads, out_dir / "peers_load.png", title=f"{scenario.replicas} {kind}")),
        "ttft_cdf": str(plot_ttft_cdf(ttfts, out_dir / "peers_ttft_cdf.png")),
    }
    return {"bench": "peers", "results": results, "skipped": skipped, "plots": plots}


# measures compared seed by seed: (key, label, higher is better)
_PAIRED: tuple[tuple[str, str, bool], ...] = (
    ("chr", "CHR", True),
    ("routing_loss", "routing loss", False),
    ("ttft_p50_s", "TTFT p50 (s)", False),
    ("ttft_p99_s", "TTFT p99 (s)", False),
    ("ttft_floor_p99_s", "TTFT p99 floor, no queueing (s)", False),
    ("engine_queue_p99_s", "engines' queue time p99 (s)", False),
    ("engine_queue_share", "share of engine TTFT queued", False),
    ("dispersion", "dispersion", False),
    ("dispersion_floor", "dispersion floor", False),
    ("dispersion_sticky", "dispersion of whole sessions", False),
    ("dispersion_between", "dispersion between replicas", False),
    ("p_load_ge12", "P(load>=12)", False),
    ("e2e_p99_s", "E2E p99 (s)", False),
    ("requests", "requests", True),
    ("requests_of_ceiling", "requests / no-contention ceiling", True),
)


def summarise_seeds(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Across seeds: each router's mean / min / max per measure, and for every other router how many
    seeds kvroute did better on (paired: same seed, same workload), per measure."""
    routers: list[str] = []
    for results in per_seed.values():
        routers += [r for r in results if r not in routers]
    stats: dict[str, dict[str, dict[str, float]]] = {}
    for r in routers:
        stats[r] = {}
        for key, _, _ in _PAIRED:
            xs = [float(res[r][key]) for res in per_seed.values() if r in res and res[r].get(key) is not None]
            if xs:
                stats[r][key] = {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    ours = next((r for r in routers if r.startswith("kvroute")), None)
    wins: dict[str, dict[str, str]] = {}
    if ours is not None:
        for r in routers:
            if r == ours:
                continue
            wins[r] = {}
            for key, _, higher in _PAIRED:
                pairs = [
                    (float(res[ours][key]), float(res[r][key]))
                    for res in per_seed.values()
                    if ours in res and r in res and res[ours].get(key) is not None and res[r].get(key) is not None
                ]
                better = sum(1 for a, b in pairs if (a > b if higher else a < b))
                wins[r][key] = f"{better}/{len(pairs)}"
    return {"seeds": sorted(per_seed), "stats": stats, "kvroute": ours, "kvroute_better_on_seeds": wins}


def seeds_table(summary: Mapping[str, Any]) -> Any:
    """A rich ``Table``: mean [min-max] per router and measure, and kvroute's paired wins."""
    from rich.table import Table

    stats: Mapping[str, Mapping[str, Mapping[str, float]]] = summary["stats"]
    wins: Mapping[str, Mapping[str, str]] = summary["kvroute_better_on_seeds"]
    table = Table(title=f"mean [min-max] over seeds {summary['seeds']}; 'kvroute better': seeds won, paired")
    table.add_column("measure")
    for r in stats:
        table.add_column(r, justify="right")
    for r in wins:
        table.add_column(f"kvroute better than {r}", justify="right")
    for key, label, _ in _PAIRED:
        fmt = "{:.0f}" if key == "requests" else "{:.4f}" if key == "p_load_ge12" else "{:.3f}"
        cells = []
        for r in stats:
            st = stats[r].get(key)
            cells.append("-" if st is None else f"{fmt.format(st['mean'])} [{fmt.format(st['min'])}-{fmt.format(st['max'])}]")
        table.add_row(label, *cells, *(wins[r].get(key, "-") for r in wins))
    return table


def bench_peers_main(argv: list[str]) -> int:
    import argparse

    from rich.console import Console

    from loadtests.demo import DemoScenario
    from loadtests.report import comparison_table
    from loadtests.scenario import WORKLOAD_TOKEN_UNITS

    d = DemoScenario()
    p = argparse.ArgumentParser(
        prog="kvroute bench peers",
        description="kvroute and the peer routers one after another on the identical workload and fleet",
    )
    routers = sorted(k for k, spec in PEERS.items() if spec.kind != "floor")  # the floor is one replica
    p.add_argument("--targets", default=",".join(BENCH_TARGETS), help=f"comma list from {routers}")
    p.add_argument(
        "--fleet",
        choices=["emulated", "real-sglang"],
        default="emulated",
        help="emulated: a fresh emulated fleet per router; real-sglang: real SGLang 0.5.23 servers on this "
        "machine's CPUs (kvroute launch --profile sglang-cpu-tiny, one core each, small KV pool), started "
        "once and flushed before each router (docs/REAL_SGLANG.md)",
    )
    p.add_argument(
        "--pool-tokens", type=int, default=REAL_POOL_TOKENS, help="real-sglang: each server's KV pool (tokens)"
    )
    p.add_argument(
        "--engine-dp", type=int, default=1, metavar="N",
        help="each replica runs N data-parallel schedulers (SGLang's --dp-size N, each its own cache: with "
        "--fleet real-sglang a KV pool of --pool-tokens; emulated, the profile's engine and pool; the engine "
        "spreads requests over them round robin unless told a rank); "
        "the peers then run in their own data-parallel modes (sglang-router --dp-aware, vllm-router "
        "--intra-node-data-parallel-size N)",
    )
    p.add_argument("--replicas", type=int, help=f"default {d.replicas}; real-sglang: {REAL_DEFAULTS['replicas']}")
    p.add_argument(
        "--duration", type=float, help=f"wall seconds of load per router (default {d.duration_s:g}; "
        f"real-sglang: {REAL_DEFAULTS['duration_s']:g})",
    )
    p.add_argument("--sessions", type=int, help=f"default {d.sessions}; real-sglang: {REAL_DEFAULTS['sessions']}")
    p.add_argument("--time-scale", type=float, help=f"default {d.time_scale:g}; real-sglang: 1 (real time)")
    p.add_argument(
        "--token-unit", type=int, help=f"model tokens per workload token (default {d.token_unit}; "
        f"mooncake: {WORKLOAD_TOKEN_UNITS['mooncake']}; real-sglang: {REAL_DEFAULTS['token_unit']}, so coding contexts fit "
        "the tiny servers)",
    )
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--seeds",
        help="comma list: one run per seed (the routers' order alternates from seed to seed), "
        "OUT/seed-S/ per seed, and a mean [min-max] table with kvroute's paired wins",
    )
    p.add_argument("--hicache", action="store_true", help="give the replicas their HiCache host tier (2x HBM)")
    p.add_argument(
        "--gateways", type=int, default=1,
        help="kvroute gateway processes sharing state in a fresh Redis (the peers run one router); the "
        "clients spread their requests over them as --gateway-assign says",
    )
    p.add_argument(
        "--gateway-assign", choices=GATEWAY_ASSIGN, default="round_robin",
        help="with several gateways: each request to the next (as behind a Service), or each session's "
        "requests to one of them (sticky, as a client pod's sidecar)",
    )
    p.add_argument(
        "--kv-events", action="store_true",
        help="the replicas (emulated or real) publish SGLang's KV events; kvroute routes on exact residency",
    )
    p.add_argument("--workload", choices=["synthetic", "weka", "mooncake"], default="synthetic",
                   help="synthetic coding-agent sessions, or a replay: WEKA's Claude Code sessions, Mooncake's Kimi chat")
    p.add_argument("--trace", help="the trace file of --workload weka|mooncake (default: the copy in the shared traces)")
    p.add_argument(
        "--no-session-id", action="store_true",
        help="the clients send no session header; every router keys on the prompt (docs/BENCHMARKS.md)",
    )
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kvroute policy parameter (repeatable, passed to kvroute serve), e.g. thicc_threshold=4",
    )
    p.add_argument(
        "--engine-set", action="append", default=[], metavar="FIELD=VALUE",
        help="an emulated engine's profile field (repeatable, kvroute emulate --set), e.g. schedule_policy=lpm",
    )
    p.add_argument("--api", choices=list(API_PATHS), default="chat",
                   help="the clients speak chat completions, Anthropic's Messages API (as Claude Code) or "
                   "OpenAI's Responses API (as Codex)")
    p.add_argument("--out", type=Path, default=Path("out/peers"), help="directory for plots")
    p.add_argument("--json", type=Path, help="write the JSON here (default OUT/peers.json)")
    ns = p.parse_args(argv)
    targets = [t for t in ns.targets.split(",") if t]
    try:
        _scenario(ns, ns.seed).check()
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    unknown = [t for t in targets if t not in routers]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {routers}")
    if ns.engine_dp < 1:
        p.error("--engine-dp must be at least 1")
    if ns.gateways < 1:
        p.error("--gateways must be at least 1")
    if ns.fleet == "real-sglang":
        if ns.engine_set:
            p.error("--engine-set sets the emulated engines' profile; real SGLang servers take their own flags")
        if ns.time_scale not in (None, 1.0):
            p.error("--fleet real-sglang runs in real time: --time-scale must be 1")
        for key, value in REAL_DEFAULTS.items():
            attr = key.removesuffix("_s") if key == "duration_s" else key
            if getattr(ns, attr) is None:
                setattr(ns, attr, value)
        from loadtests.real_sglang import runtime_missing

        why = runtime_missing()
        if why is not None:
            p.error(why)
    if ns.seeds is not None:
        try:
            seeds = [int(x) for x in ns.seeds.split(",") if x.strip()]
        except ValueError:
            p.error(f"--seeds: a comma list of integers, not {ns.seeds!r}")
        if not seeds or len(set(seeds)) != len(seeds):
            p.error("--seeds: give at least one seed, each once")
        with _fleet(ns) as urls:
            return _bench_peers_seeds(ns, targets, seeds, urls)
    scenario = _scenario(ns, ns.seed)
    console = Console(stderr=True, width=160)
    with _fleet(ns) as urls:
        doc = asyncio.run(
            run_peers_bench(
                targets, scenario, out_dir=ns.out, say=console.print, fleet_urls=urls, engine_dp=ns.engine_dp
            )
        )
    doc["scenario"] = asdict(scenario)
    doc["fleet"] = _fleet_doc(ns)
    results = doc["results"]
    assert isinstance(results, dict)
    if results:
        console.print(comparison_table(results, title="routers side by side (same workload, fresh fleet each)"))
    path = ns.json or ns.out / "peers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {path} and plots in {ns.out}")
    print(json.dumps(doc, indent=2))
    return 0


# --fleet real-sglang: two tiny real servers (one core each) and a coding-agent workload scaled so
# that its working set (~40 sessions x ~2.5k tokens at token unit 40) outgrows their 2 x 40k KV pools
REAL_POOL_TOKENS = 40_000
REAL_DEFAULTS: dict[str, Any] = {
    "replicas": 2, "sessions": 40, "duration_s": 120.0, "token_unit": 40, "time_scale": 1.0,
}


@contextlib.contextmanager
def _fleet(ns: Any) -> Any:
    """The real SGLang servers of ``--fleet real-sglang`` (their URLs), or ``None`` (emulated)."""
    if ns.fleet != "real-sglang":
        yield None
        return
    from loadtests.real_sglang import real_sglang_fleet

    log_dir = Path(ns.out) / "sglang-logs"
    print(f"starting {ns.replicas} real SGLang servers (logs in {log_dir})", file=sys.stderr, flush=True)
    with real_sglang_fleet(
        ns.replicas, log_dir=log_dir, max_total_tokens=ns.pool_tokens, kv_events=ns.kv_events, dp_size=ns.engine_dp
    ) as servers:
        yield [s.url for s in servers]


def _fleet_doc(ns: Any) -> dict[str, Any]:
    if ns.fleet != "real-sglang":
        return {"kind": "emulated", "profile": ns.profile, "dp_size": ns.engine_dp}
    return {
        "kind": "real-sglang", "sglang": "0.5.23", "profile": "sglang-cpu-tiny", "servers": ns.replicas,
        "pool_tokens_each": ns.pool_tokens, "cpu_per_server": 1, "dp_size": ns.engine_dp,
        "model": "tiny random Qwen2 (2 layers, hidden 256), --load-format dummy",
    }


def _scenario(ns: Any, seed: int) -> Any:
    """The demo scenario that ``bench peers``' flags describe, with ``seed``."""
    from loadtests.demo import demo_scenario

    real = ns.fleet == "real-sglang"
    return demo_scenario(
        replicas=ns.replicas, duration_s=ns.duration, sessions=ns.sessions, time_scale=ns.time_scale,
        token_unit=ns.token_unit, profile=ns.profile, seed=seed, host_tier=ns.hicache,
        workload_kind=ns.workload, trace=ns.trace, policy_params=tuple(ns.policy_param), kv_events=ns.kv_events,
        gateways=ns.gateways, gateway_assign=ns.gateway_assign, page_size=1 if real else None,  # SGLang's page size on CPU (the ideal caches pages like it)
        engine_set=tuple(ns.engine_set), session_ids=not ns.no_session_id, api=ns.api,
        dp_size=None if real else ns.engine_dp,  # real engines get theirs from _fleet
    )


def _bench_peers_seeds(
    ns: Any, targets: Sequence[str], seeds: Sequence[int], fleet_urls: Sequence[str] | None = None
) -> int:
    """``bench peers --seeds``: the single-seed bench once per seed, then the summary."""
    from rich.console import Console

    from loadtests.report import comparison_table

    console = Console(stderr=True, width=200)
    per_seed: dict[int, dict[str, Any]] = {}
    docs: dict[str, Any] = {}
    for i, seed in enumerate(seeds):
        scenario = _scenario(ns, seed)
        order = list(targets) if i % 2 == 0 else list(reversed(targets))  # drift falls on every router alike
        console.print(f"seed {seed} ({i + 1}/{len(seeds)}): {', '.join(order)}")
        out = ns.out / f"seed-{seed}"
        doc = asyncio.run(
            run_peers_bench(
                order, scenario, out_dir=out, say=console.print, fleet_urls=fleet_urls, engine_dp=ns.engine_dp
            )
        )
        doc["scenario"] = asdict(scenario)
        doc["fleet"] = _fleet_doc(ns)
        (out / "peers.json").write_text(json.dumps(doc, indent=2) + "\n")
        results = doc["results"]
        assert isinstance(results, dict)
        if results:
            console.print(comparison_table(results, title=f"seed {seed}"))
        per_seed[seed] = results
        docs[str(seed)] = doc
    summary = summarise_seeds(per_seed)
    console.print(seeds_table(summary))
    path = ns.json or ns.out / "peers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {"bench": "peers", "seeds": list(seeds), "fleet": _fleet_doc(ns), "summary": summary, "per_seed": docs}
    path.write_text(json.dumps(full, indent=2) + "\n")
    console.print(f"wrote {path} (per seed: {ns.out}/seed-S/)")
    print(json.dumps({"bench": "peers", "seeds": list(seeds), "summary": summary}, indent=2))
    return 0

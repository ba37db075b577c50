"""``kvroute demo``: kvroute on its embedded default, in front of emulated replicas, under coding-agent load.

For each policy (default ``kv_aware`` then ``hash``), on the identical workload:
  1. start N fresh emulated replicas (``kvroute emulate``, one subprocess: cold caches every time),
  2. start a fresh gateway (``kvroute serve --policy P``, embedded memory store, its own subprocess),
  3. drive synthetic coding-agent sessions through it with the live load driver for ``--duration``
     wall seconds, showing a live view (per-replica in-flight bars sampled from the replicas,
     dispersion, CHR, TTFT p50/p99, requests, errors),
then print a comparison table and, with ``--json``, write ``{policy: measures}`` (``loadtests/measures.py``).

Three processes (driver, gateway, replicas) so that two cores are used and the gateway never shares
an event loop with the load it is measured under. Wall time is bounded: per policy ``duration`` +
start-up (a few seconds) + at most ``drain`` seconds for requests still in flight at the end.

Why the defaults (the scenario, :class:`DemoScenario`): replicas use the reference profile (Kimi K2.6
on TP4 B200, FP8 KV = 0.85 M tokens) with the HiCache host tier off, so each replica's HBM holds only a
handful of coding sessions' context; 110 live sessions (lanes: a finished session is replaced by a fresh
one) of the synthetic coding-agent workload (~100k-token median context, ~500 output tokens, WEKA-like
think times: 85 % tool calls of ~3 s median, 15 % human turns of ~30 s, some thicc sessions with
concurrent sub-agents) give ~4-6 requests in flight per replica, and a total working set close to the
fleet's KV capacity: a placement that ignores load and working sets leaves some replicas thrashing.
Time runs 10x faster than modelled and each emulated token stands for 100 model tokens, so request
bodies stay small enough for one laptop while the cache and queueing dynamics are those of real sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from loadtests.live import API_PATHS, LiveStats, LoadConfig, LoadResult, run_load
from loadtests.peers import PeerSpec, emulated_fleet, running_redis, running_router
from loadtests.scenario import KV_EVENTS_CONFIG, WORKLOAD_TOKEN_UNITS, DemoScenario, ceiling, demo_scenario
from loadtests.sim.ceiling import with_ceiling
from loadtests.workloads import SessionSpec

__all__ = ["KV_EVENTS_CONFIG", "DemoScenario", "cli_main", "demo_scenario", "run_demo", "run_policy"]


# ---- live view ---------------------------------------------------------------------------------------


def _bar(x: int, top: int, width: int = 30) -> str:
    n = 0 if top <= 0 else round(width * min(x, top) / top)
    return "█" * n + "·" * (width - n)


def _render(policy: str, st: LiveStats, duration_s: float) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        ("kvroute demo ", "bold"),
        (f"policy {policy}", "bold cyan"),
        f"   {min(st.elapsed_s, duration_s):5.1f}/{duration_s:.0f} s   "
        f"requests {st.finished} (in flight {st.in_flight})   errors {st.errors}",
    )
    loads = st.last_loads
    top = max([12, *loads]) if loads else 12
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("replica")
    table.add_column("in-flight", justify="right")
    table.add_column("")
    for name, x in zip(st.replica_names, loads, strict=False):
        table.add_row(name, str(x), _bar(x, top))
    figures = Text(
        f"dispersion {st.dispersion:.2f}   CHR {st.chr:.3f} (ideal {st.ideal_chr:.3f})   "
        f"TTFT p50 {st.ttft_quantile(0.5):.2f} s  p99 {st.ttft_quantile(0.99):.2f} s (modelled)"
    )
    return Group(head, table, figures)


async def run_policy(
    spec: PeerSpec,
    scenario: DemoScenario,
    sessions: Sequence[SessionSpec],
    *,
    log_dir: Path,
    live: bool,
    fresh: bool | None = None,
    fleet_urls: Sequence[str] | None = None,
) -> LoadResult:
    """Fresh fleet + fresh router ``spec`` + the load; returns the driver's result. With
    ``scenario.gateways`` > 1 (kvroute only) that many gateways share a fresh Redis and the driver
    spreads requests over them round robin. ``fleet_urls``: replicas already running (a real SGLang
    fleet, its caches flushed by the caller) instead of a fresh emulated fleet."""
    async with contextlib.AsyncExitStack() as stack:
        if fleet_urls is not None:
            urls = list(fleet_urls)
        else:
            fleet = await stack.enter_async_context(
                emulated_fleet(scenario.replicas, scenario.emulator_args(), log_dir=log_dir)
            )
            urls = fleet.urls
        extra: list[str] = scenario.kvroute_args() if spec.kind == "kvroute" else []
        env = scenario.kvroute_env() if spec.kind == "kvroute" else None
        n_gateways = scenario.gateways if spec.kind == "kvroute" else 1
        if n_gateways > 1:
            redis = await stack.enter_async_context(running_redis(log_dir=log_dir))
            extra += ["--redis", redis.url]
        routers = []
        for i in range(n_gateways):
            gw = replace(spec, name=f"{spec.name} gw{i}") if n_gateways > 1 else spec
            ids = ["--gateway-id", f"gw{i}"] if n_gateways > 1 else []
            routers.append(
                await stack.enter_async_context(
                    running_router(gw, urls, log_dir=log_dir, extra_args=extra + ids, env=env)
                )
            )
        config = scenario.load_config(
            routers[0].url, urls, fresh=spec.fresh_connections if fresh is None else fresh
        )
        config = replace(
            config,
            extra_urls=tuple(r.url for r in routers[1:]),
            floor_profile=scenario.replica_profile() if fleet_urls is None else None,
        )
        stats = LiveStats()
        result = await _drive(spec, scenario, sessions, config, stats, live=live)
        if spec.kind == "kvroute":
            await _gateway_overhead([r.url for r in routers], result.measures)
        return result


async def _gateway_overhead(urls: Sequence[str], measures: dict[str, Any]) -> None:
    """Fill ``gateway_overhead_*_ms`` from kvroute's own histogram (time spent in the gateway,
    upstream waits excluded), summed over every gateway of the run; bucket-interpolated, so read it
    to the bucket's resolution. Nothing if a gateway cannot be read (a part would mislead)."""
    import aiohttp

    from loadtests.report import histogram_quantiles

    texts: list[str] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for url in urls:
                async with http.get(f"{url}/metrics", headers={"Accept": "text/plain"}) as r:
                    if r.status != 200:
                        return
                    texts.append(await r.text())
    except (aiohttp.ClientError, TimeoutError):
        return
    text = "\n".join(texts)  # one family per gateway: the readers below sum over them
    p50, p99 = histogram_quantiles(text, "kvroute_gateway_overhead_seconds", (0.5, 0.99))
    if p50 is not None and p99 is not None:
        measures["gateway_overhead_p50_ms"] = p50 * 1e3
        measures["gateway_overhead_p99_ms"] = p99 * 1e3
        measures["gateway_overhead_source"] = (
            "kvroute_gateway_overhead_seconds histogram (whole run"
            + (f", {len(urls)} gateways)" if len(urls) > 1 else ")")
        )
    # whole run, warm-up included: the residency kvroute's decisions went by, and with KV events how
    # often the estimate would have judged otherwise (docs/KV_EVENTS.md)
    measures["residency_checks"] = _counter_by_label(text, "kvroute_residency_checks_total", "verdict")
    measures["affinity_breaks_by_residency"] = {
        k: v for k, v in _counter_by_label(text, "kvroute_affinity_breaks_total", "residency").items() if v
    }
    # and how often a turn sent home for its cache found it there, by the residency that said so
    outcomes: dict[str, dict[str, int]] = {}
    judged = _counter_by_labels(text, "kvroute_residency_outcomes_total", ("residency", "found"))
    for (residency, found), n in judged.items():
        outcomes.setdefault(residency, {"found": 0, "missed": 0})["found" if found == "true" else "missed"] += n
    measures["residency_outcomes"] = outcomes


def _counter_by_label(text: str, name: str, label: str) -> dict[str, int]:
    """Σ of a Prometheus counter's samples grouped by one label (``{}`` when absent)."""
    return {k[0]: v for k, v in _counter_by_labels(text, name, (label,)).items()}


def _counter_by_labels(text: str, name: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], int]:
    """Σ of a Prometheus counter's samples grouped by some of its labels (``{}`` when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, ...], int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(lb in s.labels for lb in labels):
                key = tuple(s.labels[lb] for lb in labels)
                out[key] = out.get(key, 0) + int(s.value)
    return out


async def _drive(
    spec: PeerSpec,
    scenario: DemoScenario,
    sessions: Sequence[SessionSpec],
    config: LoadConfig,
    stats: LiveStats,
    *,
    live: bool,
) -> LoadResult:
    if live:
        from rich.live import Live

        with Live(_render(spec.name, stats, scenario.duration_s), refresh_per_second=4) as view:

            def tick(st: LiveStats) -> None:
                view.update(_render(spec.name, st, scenario.duration_s))

            return await run_load(sessions, config, stats=stats, on_tick=tick)
    every = min(5.0, max(1.0, scenario.duration_s / 6))
    last = [time.monotonic()]

    def line(st: LiveStats) -> None:
        print(
            f"[{spec.name}] {st.elapsed_s:5.1f}s req {st.finished} err {st.errors} "
            f"in-flight {list(st.last_loads)} disp {st.dispersion:.2f} chr {st.chr:.3f} "
            f"ttft p50 {st.ttft_quantile(0.5):.2f}s p99 {st.ttft_quantile(0.99):.2f}s",
            flush=True,
        )

    def plain(st: LiveStats) -> None:
        if time.monotonic() - last[0] >= every:
            last[0] = time.monotonic()
            line(st)

    result = await run_load(sessions, config, stats=stats, on_tick=plain)
    line(stats)
    return result


async def run_demo(
    policies: Sequence[str], scenario: DemoScenario, *, live: bool, plots: Path | None = None
) -> dict[str, Any]:
    sessions = scenario.workload()
    results: dict[str, LoadResult] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-") as tmp:
        for policy in policies:
            spec = PeerSpec(f"kvroute {policy}", "kvroute", policy, "kvroute")
            results[policy] = await run_policy(spec, scenario, sessions, log_dir=Path(tmp), live=live)
    ceil = ceiling(scenario)
    doc: dict[str, Any] = {p: with_ceiling(r.measures, ceil) for p, r in results.items()}
    if plots is not None:
        from loadtests.report import plot_load, plot_ttft_cdf

        warm = scenario.duration_s * scenario.warmup_frac / scenario.time_scale
        plot_load({p: [s for s in r.load_samples if s[0] >= warm] for p, r in results.items()},
                  plots / "demo_load.png", title=f"kvroute demo, {scenario.replicas} emulated replicas")
        plot_ttft_cdf({p: [o.ttft_s for o in r.outcomes if o.ok and o.ttft_s is not None and o.t_start >= warm]
                       for p, r in results.items()}, plots / "demo_ttft_cdf.png")
    return doc


def _verdict(doc: dict[str, Any]) -> list[str]:
    if "kv_aware" not in doc or "hash" not in doc:
        return []
    a, h = doc["kv_aware"], doc["hash"]
    lines = []
    for key, better in (("chr", "higher"), ("dispersion", "lower"), ("ttft_p99_s", "lower")):
        x, y = a.get(key), h.get(key)
        if x is None or y is None:
            continue
        if abs(x - y) <= 0.005 * max(abs(x), abs(y)):
            verdict = "tie (within 0.5 %)"
        else:
            wins = x > y if better == "higher" else x < y
            verdict = f"{'kv_aware' if wins else 'hash'} wins"
        lines.append(f"{key}: kv_aware {x:.4f} vs hash {y:.4f} -> {verdict} ({better} is better)")
    if a.get("requests_ceiling"):
        lines.append(
            f"requests: kv_aware {a['requests']} vs hash {h['requests']}; the same sessions on a fleet without "
            f"contention complete {a['requests_ceiling']} (simulated): kv_aware {a['requests_of_ceiling']:.2f} "
            f"and hash {h['requests_of_ceiling']:.2f} of what the closed loop allows"
        )
    return lines


def cli_main(argv: list[str]) -> int:
    d = DemoScenario()
    p = argparse.ArgumentParser(prog="kvroute demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--duration", type=float, default=d.duration_s, help="wall seconds of load per policy")
    p.add_argument("--policies", default="kv_aware,hash", help="comma list of kvroute policies")
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="wall = modelled x this")
    p.add_argument("--token-unit", type=int, help=f"model tokens per emulated token (default {d.token_unit}; "
                   f"mooncake: {WORKLOAD_TOKEN_UNITS['mooncake']})")
    p.add_argument("--profile", default=d.profile, help="emulator profile")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--hicache", action="store_true", help="give the replicas their HiCache host tier (2x HBM)")
    p.add_argument("--gateways", type=int, default=1, help="kvroute gateway processes (> 1: shared state in Redis)")
    p.add_argument("--workload", choices=["synthetic", "weka", "mooncake"], default="synthetic",
                   help="synthetic coding-agent sessions, or a replay: WEKA's Claude Code sessions, Mooncake's Kimi chat")
    p.add_argument("--trace", help="the trace file of --workload weka|mooncake (default: the copy in the shared traces)")
    p.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                   help="kvroute policy parameter for every kvroute run (repeatable)")
    p.add_argument("--drain", type=float, default=d.drain_s, help="wall seconds in-flight requests get at the end")
    p.add_argument("--json", type=Path, help="write {policy: measures} here")
    p.add_argument("--plots", type=Path, help="write load histogram and TTFT CDF PNGs into this directory")
    p.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live view")
    p.add_argument("--engine-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an emulated engine's profile field (repeatable), e.g. schedule_policy=lpm")
    p.add_argument("--api", choices=list(API_PATHS), default="chat",
                   help="the clients speak chat completions, Anthropic's Messages API (/v1/messages, as Claude Code) "
                   "or OpenAI's Responses API (/v1/responses, as Codex)")
    p.add_argument("--no-session-id", action="store_true",
                   help="the clients send no session header: the gateway keys each conversation by its prompt")
    ns = p.parse_args(argv)
    policies = [x.strip() for x in ns.policies.split(",") if x.strip()]
    if not policies:
        p.error("--policies is empty")
    if ns.replicas < 1 or ns.duration <= 0 or ns.sessions < 1 or ns.gateways < 1:
        p.error("--replicas, --duration, --sessions and --gateways must be positive")
    scenario = demo_scenario(
        replicas=ns.replicas, duration_s=ns.duration, sessions=ns.sessions, time_scale=ns.time_scale,
        token_unit=ns.token_unit, profile=ns.profile, seed=ns.seed, drain_s=ns.drain,
        policy_params=tuple(ns.policy_param), host_tier=ns.hicache, gateways=ns.gateways,
        workload_kind=ns.workload, trace=ns.trace, engine_set=tuple(ns.engine_set), session_ids=not ns.no_session_id,
        api=ns.api,
    )
    try:
        scenario.check()
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    for out_path in (ns.json.parent if ns.json else None, ns.plots):
        try:  # before the run, not after it
            if out_path is not None:
                out_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            p.error(f"cannot write there: {exc}")
    live = sys.stdout.isatty() and not ns.no_live
    print(
        f"kvroute demo: {ns.replicas} emulated replicas ({ns.profile}), {ns.sessions} coding-agent sessions, "
        f"{ns.duration:.0f} s per policy, policies {', '.join(policies)}; time x{1 / ns.time_scale:g}, "
        f"1 emulated token = {scenario.token_unit} model tokens"
        + (f"; {ns.gateways} gateways sharing state in Redis" if ns.gateways > 1 else "")
        + ("; no session ids (prefix keys)" if ns.no_session_id else "")
        + {"chat": "", "messages": "; Anthropic Messages API (/v1/messages)",
           "responses": "; OpenAI Responses API (/v1/responses)"}[ns.api],
        flush=True,
    )
    doc = asyncio.run(run_demo(policies, scenario, live=live, plots=ns.plots))
    from rich.console import Console

    from loadtests.report import comparison_table

    console = Console()
    console.print(comparison_table(doc, title="kvroute demo: same workload, same fleet, per policy"))
    for line in _verdict(doc):
        console.print(line)
    out = dict(doc)
    out["_scenario"] = asdict(scenario) | {"policies": policies}
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {ns.json}")
    return 0


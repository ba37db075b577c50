"""``kvroute bench parity``: does the simulator predict the live gateway?

For each workload, seed and policy (``--policies``, default ``kv_aware``), the same scenario
(``loadtests.scenario.DemoScenario``: fleet, workload, seed, durations) runs twice:

  * live: ``kvroute serve --policy P`` (embedded store) in front of ``kvroute emulate`` replicas,
    driven by the live load driver, exactly as ``kvroute bench peers --targets kvroute`` runs it;
  * simulated: ``kvroute sim``'s model of the same (``loadtests.scenario.sim_config``): the same
    session specs, the same lanes (striped as the live driver runs them), the same profile in model
    tokens (the live fleet runs ``token_unit`` model tokens per emulated token and ``time_scale`` wall
    seconds per modelled second), the same warm-up, sampling and scrape intervals, the same policy parameters, and prompts
    named as the driver renders them (``turn_framing_tokens``: each turn's closing marker and the
    engine's output are not reused by the next turn).

The gateway names each replica by its ``host:port`` and every live fleet listens on fresh ports, so
each live run is simulated with its own fleet's replica ids: placement by hash or rendezvous then
starts from the same inputs in both (with the simulator's own ``r000``... names a hashing policy puts
the sessions on other replicas). Each live gateway draws its tie-breaks from the OS, so the ``i``-th
repeat's simulation draws its own too (``draw``): both sides are then samples of the same spread.

The measures (``loadtests/measures.py``) of both are compared: CHR within ``CHR_ABS`` (absolute),
dispersion within ``DISPERSION_REL`` and TTFT p99 within ``TTFT_P99_REL`` (relative to live). A live
run is not deterministic (the same seed's live CHR spans ~0.01 run to run), so ``--repeats N`` runs
the live side N times (each paired with its own simulation) and compares the medians of each measure
(``median_measures``); every pair's figures (and each live fleet's ``replica_ids``) and whether each
pair alone was within bounds are kept. Simulating is cheap: ``--sim-draws M`` (> N) adds simulations
with further tie-break draws on the live fleets' names, so that the simulated median of a policy whose
ties are drawn at random is not three samples of a wide spread.
With more than one policy, ``rankings`` says for each workload, seed and measure whether the
simulator orders the policies as the live gateway does (what a user comparing policies in the
simulator relies on). JSON: ``{"rows": [{"workload", "seed", "policy", "sim", "live",
"within_bounds", "checks", "live_runs", "sim_runs", "runs_within_bounds"}], "sim_draws", "rankings":
[{"workload", "seed", "measure", "sim", "live", "agree"}], ...}``.

``loadtests.scenario.ceiling`` is a second model of the same scenario: the same sessions on a fleet
without contention (``loadtests.sim.ceiling``), whose completed requests are the closed loop's own
limit. ``kvroute demo`` and ``kvroute bench peers`` report it (``requests_ceiling``,
``requests_of_ceiling``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtests.live import GATEWAY_ASSIGN
from loadtests.scenario import DemoScenario, ceiling, demo_scenario, sim_config
from loadtests.sim.run import run_sim
from router.policy.registry import POLICIES

__all__ = [
    "CHR_ABS",
    "DISPERSION_REL",
    "TTFT_P99_REL",
    "WORKLOADS",
    "ceiling",
    "cli_main",
    "compare",
    "ideal_hits_by_kind",
    "median_measures",
    "rankings",
    "run_sim_for",
    "sim_config",
]

CHR_ABS = 0.01
DISPERSION_REL = 0.20
TTFT_P99_REL = 0.30

# the two standard live scenarios (docs/BENCHMARKS.md): synthetic coding-agent sessions on a KV-bound
# fleet (HBM only), and 80 real Claude Code sessions (WEKA) with the HiCache host tier
WORKLOADS: dict[str, dict[str, Any]] = {
    "synthetic": {"workload_kind": "synthetic", "sessions": 75, "host_tier": False},
    "weka": {"workload_kind": "weka", "sessions": 80, "host_tier": True},
    # Mooncake's Kimi chat sessions with the host tier: short sessions, some with a giant first prompt
    "mooncake": {"workload_kind": "mooncake", "sessions": 150, "host_tier": True},
    # the same replay on HBM alone: the sessions do not fit the fleet (KV-bound)
    "weka-kv": {"workload_kind": "weka", "sessions": 80, "host_tier": False},
    # clients that send no session id: every router keys on the prompt (kvroute: rule 7)
    "synthetic-nosid": {"workload_kind": "synthetic", "sessions": 75, "host_tier": False, "session_ids": False},
    "weka-nosid": {"workload_kind": "weka", "sessions": 80, "host_tier": True, "session_ids": False},
}

COMPARED = ("chr", "ideal_chr", "pooled_chr", "routing_loss", "dispersion", "dispersion_floor", "dispersion_sticky", "dispersion_between", "p_load_ge12",
            "ttft_p50_s", "ttft_p99_s", "ttft_floor_p99_s", "engine_queue_p99_s", "engine_queue_share", "e2e_p99_s", "requests", "errors", "sessions_moved", "route_reasons",
            "cold_prefill_by_route", "routing_loss_by_route", "lanes_spent")  # fmt: skip


def run_sim_for(
    scenario: DemoScenario, policy: str = "kv_aware", replica_ids: Sequence[str] = (), draw: int = 0
) -> dict[str, Any]:
    """The simulator's measures of ``scenario`` under ``policy``. ``replica_ids`` names its replicas
    (default r000, r001, ...): placement by hash or rendezvous depends on the names. ``draw`` > 0
    draws the policy's tie-breaks from another random stream, as each live gateway draws its own (with
    one gateway and no mid-session starts the simulator's seed draws nothing else; the sessions are
    the scenario's)."""
    cfg, specs = sim_config(scenario)
    seed = cfg.seed + 1_000_003 * draw  # draw 0: the scenario's own seed
    return run_sim(specs, replace(cfg, policy=policy, replica_ids=tuple(replica_ids), seed=seed)).measures


def ideal_hits_by_kind(scenario: DemoScenario, sessions: int) -> dict[str, tuple[int, int, float, float]]:
    """The workload as each driver builds its prompts, held to one infinite cache each: per kind of
    turn (``first``, ``continuation``, ``reset``), ``(turns, prompt model tokens, the simulator's hit
    tokens, the live driver's hit tokens)`` over the scenario's first ``sessions`` sessions, each
    session's turns in turn. The simulator names blocks as it does (``ChainNamer``); the live
    driver's rendered text is hashed as the emulator does (``InfiniteCache``), its hits scaled to
    model tokens. Equal ideals are what ``bench parity`` needs of a workload's rendering."""
    from loadtests.ideal import InfiniteCache
    from loadtests.live import rendered_turns
    from loadtests.sim.prompts import ChainNamer, IdealCache
    from loadtests.workloads import turn_inputs

    cfg, specs = sim_config(scenario)
    page = cfg.profile.page_size
    live, sim = InfiniteCache(scenario.page_size), IdealCache(page)
    acc: dict[str, list[float]] = {}
    for uid, spec in enumerate(specs[:sessions]):
        for chain in spec.walk():
            namer = ChainNamer(chain, uid, uid, page, cfg.turn_framing_tokens)
            inputs = turn_inputs(chain)
            for k, (conv, _) in enumerate(rendered_turns(chain, scenario.token_unit)):
                names = namer.names(k)
                sim_hit = sim.hit_tokens(names, inputs[k])
                sim.add(namer.full_names(k, names))
                blocks, emulated = live.blocks(conv.messages, conv.key)
                live_hit = live.hit(blocks, emulated) * inputs[k] / max(1, emulated)
                live.insert(blocks)
                kind = "first" if k == 0 else "reset" if chain.turns[k].reset else "continuation"
                a = acc.setdefault(kind, [0, 0, 0.0, 0.0])
                a[0] += 1
                a[1] += inputs[k]
                a[2] += sim_hit
                a[3] += live_hit
    return {kind: (int(a[0]), int(a[1]), a[2], a[3]) for kind, a in acc.items()}


def _rel(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return abs(sim - live) / abs(live)


def compare(sim: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The three parity checks (module docstring); each is None when a figure is missing."""
    chr_diff = None if sim.get("chr") is None or live.get("chr") is None else abs(sim["chr"] - live["chr"])
    checks = {
        "chr_abs_diff": chr_diff,
        "chr_ok": None if chr_diff is None else chr_diff <= CHR_ABS,
        "dispersion_rel_diff": _rel(sim.get("dispersion"), live.get("dispersion")),
        "ttft_p99_rel_diff": _rel(sim.get("ttft_p99_s"), live.get("ttft_p99_s")),
    }
    d, t = checks["dispersion_rel_diff"], checks["ttft_p99_rel_diff"]
    checks["dispersion_ok"] = None if d is None else d <= DISPERSION_REL
    checks["ttft_p99_ok"] = None if t is None else t <= TTFT_P99_REL
    return checks


async def _live(scenario: DemoScenario, log_dir: Path, policy: str = "kv_aware") -> tuple[dict[str, Any], tuple[str, ...]]:
    """The live run's measures and its replicas' ids (``host:port``, as the gateway names them)."""
    from loadtests.demo import run_policy
    from loadtests.peers import PeerSpec

    log_dir.mkdir(parents=True, exist_ok=True)
    spec = PeerSpec(f"kvroute {policy}", "kvroute", policy, "kvroute")
    result = await run_policy(spec, scenario, scenario.workload(), log_dir=log_dir, live=False)
    return dict(result.measures), result.replica_names


def _pick(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in COMPARED}


def _within(checks: dict[str, Any]) -> bool:
    return all(checks[k] is True for k in ("chr_ok", "dispersion_ok", "ttft_p99_ok"))


def median_measures(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several live runs of one scenario as one: each numeric measure's median over the runs that
    report it; other values (counts by reason) from the run whose CHR is the median one."""
    if not runs:
        raise ValueError("no runs")
    by_chr = sorted(runs, key=lambda m: (m.get("chr") is None, m.get("chr") or 0.0))
    out = dict(by_chr[(len(by_chr) - 1) // 2])
    for k in {k for m in runs for k in m}:
        vals = [m[k] for m in runs if isinstance(m.get(k), int | float) and not isinstance(m.get(k), bool)]
        if vals:
            out[k] = statistics.median(vals)
    return out


def run_parity(
    workloads: Sequence[str],
    seeds: Sequence[int],
    *,
    duration_s: float,
    log_dir: Path,
    kv_events: bool = False,
    repeats: int = 1,
    policies: Sequence[str] = ("kv_aware",),
    sim_draws: int = 1,
    gateways: int = 1,
    time_scale: float | None = None,
    gateway_assign: str = "round_robin",
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        for seed in seeds:
            scenario = demo_scenario(
                seed=seed, duration_s=duration_s, kv_events=kv_events, gateways=gateways, time_scale=time_scale,
                gateway_assign=gateway_assign, **WORKLOADS[workload],
            )
            for policy in policies:
                name = f"{workload} seed {seed}" + (f" {policy}" if len(policies) > 1 else "")
                runs: list[dict[str, Any]] = []
                for i in range(repeats):
                    say(f"{name}: live run {i + 1}/{repeats} ({scenario.duration_s:.0f} s)")
                    sub = f"{workload}-{seed}" + (f"-{policy}" if len(policies) > 1 else "")
                    sub += "" if repeats == 1 else f"-run{i + 1}"
                    measures, ids = asyncio.run(_live(scenario, log_dir / sub, policy))
                    runs.append({**_pick(measures), "replica_ids": list(ids)})
                # each live fleet listens on its own ports, and the gateway names replicas by them:
                # simulation i runs on live run i's names (round robin beyond the runs) with draw i
                say(f"{name}: simulating {max(repeats, sim_draws)} draws on the live runs' replica ids")
                sims = [_pick(run_sim_for(scenario, policy, runs[i % repeats]["replica_ids"], draw=i))
                        for i in range(max(repeats, sim_draws))]  # fmt: skip
                sim = _pick(median_measures(sims))
                live = _pick(median_measures(runs))
                checks = compare(sim, live)
                within = _within(checks)
                rows.append(
                    {
                        "workload": workload,
                        "seed": seed,
                        "policy": policy,
                        "sim": sim,
                        "live": live,
                        "within_bounds": within,
                        "checks": checks,
                        "live_runs": runs,
                        "sim_runs": sims,
                        "runs_within_bounds": sum(1 for m, r in zip(sims, runs, strict=False) if _within(compare(m, r))),
                    }
                )
                say(
                    f"  chr sim {_f(sim.get('chr'))} live {_f(live.get('chr'))} | dispersion "
                    f"{_f(sim.get('dispersion'))} / {_f(live.get('dispersion'))} | TTFT p99 "
                    f"{_f(sim.get('ttft_p99_s'))} / {_f(live.get('ttft_p99_s'))} s | requests "
                    f"{sim.get('requests')} / {live.get('requests')} -> {'ok' if within else 'OUT'}"
                )
    return {
        "bench": "parity",
        "bounds": {"chr_abs": CHR_ABS, "dispersion_rel": DISPERSION_REL, "ttft_p99_rel": TTFT_P99_REL},
        "scenarios": {w: WORKLOADS[w] for w in workloads},
        "policies": list(policies),
        "duration_s": duration_s,
        "gateways": gateways,
        "gateway_assign": gateway_assign,
        "time_scale": demo_scenario(time_scale=time_scale).time_scale,
        "repeats": repeats,
        "sim_draws": max(repeats, sim_draws),
        "rows": rows,
        "within_bounds": sum(1 for r in rows if r["within_bounds"]),
        "rankings": rankings(rows) if len(policies) > 1 else [],
    }


# the measures a user compares policies on, and whether more is better
RANKED: dict[str, bool] = {"chr": True, "ttft_p99_s": False, "e2e_p99_s": False, "requests": True, "dispersion": False}


def rankings(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, seed and ``RANKED`` measure: the policies best first by the simulator and by the
    live gateway, and whether the two orders agree."""
    out: list[dict[str, Any]] = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["seed"]), []).append(r)
    for (workload, seed), group in groups.items():
        for measure, higher in RANKED.items():
            sim, live = _order(group, "sim", measure, higher), _order(group, "live", measure, higher)
            out.append({"workload": workload, "seed": seed, "measure": measure, "sim": sim, "live": live,
                        "agree": sim == live and len(sim) == len(group)})  # fmt: skip
    return out


def _order(group: Sequence[dict[str, Any]], side: str, measure: str, higher: bool) -> list[str]:
    have = [r for r in group if r[side].get(measure) is not None]
    return [r["policy"] for r in sorted(have, key=lambda r: r[side][measure], reverse=higher)]


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def cli_main(argv: list[str]) -> int:
    d = DemoScenario()
    p = argparse.ArgumentParser(
        prog="kvroute bench parity",
        description="the simulator against the live gateway, same workload, seed and fleet",
    )
    p.add_argument("--workload", default="weka,synthetic", help=f"comma list of {sorted(WORKLOADS)}")
    p.add_argument("--seeds", default="1,2,3", help="comma list of seeds")
    p.add_argument("--policies", default="kv_aware",
                   help=f"comma list of {sorted(POLICIES)}: each runs in the simulator and behind the live gateway")
    p.add_argument("--duration", type=float, default=d.duration_s, help="wall seconds of live load per run")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="wall seconds per modelled second of the live fleet (a slower fleet shrinks what the "
                        "gateways' own latency on a small machine weighs in modelled time; scale --duration with it)")  # fmt: skip
    p.add_argument("--kv-events", action="store_true",
                   help="the replicas publish SGLang's KV events, live and simulated; kvroute routes on exact residency")
    p.add_argument("--repeats", type=int, default=1,
                   help="live runs per workload and seed; the simulator is compared against their medians")
    p.add_argument("--sim-draws", type=int, default=0,
                   help="simulated runs per row (at least --repeats): the simulator's median over more tie-break "
                        "draws, for policies that break ties at random (sticky_least_loaded)")  # fmt: skip
    p.add_argument("--gateways", type=int, default=1,
                   help="kvroute gateways sharing state in a fresh Redis, live and simulated (the simulator's "
                        "gateways re-read the replica table as often as the live ones)")  # fmt: skip
    p.add_argument("--gateway-assign", choices=GATEWAY_ASSIGN, default="round_robin",
                   help="with several gateways: per request, or sticky per session (a sidecar), live and simulated")
    p.add_argument("--json", type=Path, help="write the JSON here too")
    p.add_argument("--log-dir", type=Path, default=Path("out/parity"), help="gateway and emulator logs")
    ns = p.parse_args(argv)
    workloads = [w.strip() for w in ns.workload.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        p.error(f"--workload: choose from {sorted(WORKLOADS)}")
    try:
        seeds = [int(s) for s in ns.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds: a comma list of integers, not {ns.seeds!r}")
    if not seeds:
        p.error("--seeds: give at least one seed")
    if ns.duration <= 0:
        p.error("--duration must be > 0")
    if ns.repeats < 1:
        p.error("--repeats must be >= 1")
    if ns.sim_draws < 0:
        p.error("--sim-draws must be >= 0")
    if ns.gateways < 1:
        p.error("--gateways must be >= 1")
    if not 0 < ns.time_scale <= 1:
        p.error("--time-scale must be in (0, 1]")
    policies = list(dict.fromkeys(x.strip() for x in ns.policies.split(",") if x.strip()))
    if not policies or any(x not in POLICIES for x in policies):
        p.error(f"--policies: a comma list of {sorted(POLICIES)}, not {ns.policies!r}")
    doc = run_parity(workloads, seeds, duration_s=ns.duration, log_dir=ns.log_dir, kv_events=ns.kv_events,
                     repeats=ns.repeats, policies=policies, sim_draws=ns.sim_draws, gateways=ns.gateways,
                     time_scale=ns.time_scale, gateway_assign=ns.gateway_assign,
                     say=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    text = json.dumps(doc, indent=2, default=_json_default)
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(text + "\n")
    print(text)
    return 0


def _json_default(o: object) -> object:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")

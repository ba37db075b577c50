"""Round 39: rule 8 (queue spill) patched in-process, in the simulator's model of the live bench or at
scale. Variants (env SPILL_VAR, or the VAR arguments of `ab`):
  off    no spill (as queue_spill_factor=0)
  lo     the shipped rule (the cheapest other replica, equal costs to the lowest id)
  le     only onto a replica with no more requests in flight than home
  lt     only onto a replica with fewer requests in flight than home
  shared=N  the shipped rule told the size of the prefix every session shares: N tokens off every
         expected uncached part the policy cannot see cached (the ledger's too)
With SPILL_LOG=1 every spill prints one JSON row (the prompt, home's work ahead and its own uncached
part, the target's cost, how many replicas tied, in-flight counts at home and at the target).

Bench model (round 38's ab.py set-up), one row per seed and variant:
    PYTHONPATH=. python docs/experiments/round39/spill.py ab WORKLOAD[+hc] SEEDS VAR...
At scale, `kvroute sim`'s arguments, one row:
    PYTHONPATH=. python docs/experiments/round39/spill.py sim VAR <kvroute sim args>
"""
import json
import os
import sys

from loadtests.sim import run as sim_run
from router.model import AffinityBreak, Reason, ReplicaStatus, RouteDecision
from router.policy import kv_aware, prefill
from router.policy.params import PolicyParams

VAR = os.environ.get("SPILL_VAR", "lo")
LOG = os.environ.get("SPILL_LOG") == "1"
KEEP = ("chr", "pooled_chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor", "route_reasons")
_uncached = prefill.expected_uncached


def shared() -> int:
    return int(VAR.partition("=")[2]) if VAR.startswith("shared=") else 0


def expected_uncached(request, snapshot, replica_id):
    u = _uncached(request, snapshot, replica_id)
    sess = snapshot.session
    at_home = sess is not None and sess.session_id == request.session_key and replica_id == sess.home
    return u if at_home else max(0, u - shared())


sim_run.expected_uncached = expected_uncached  # the ledger's entries


def _queue_spill(self, view, request, snapshot, home, kept):
    theta = self.params.queue_spill_factor
    prompt = request.prompt_tokens_estimate
    if VAR == "off" or theta <= 0 or prompt <= 0 or not snapshot.prefill_ahead:
        return None
    at_home = prefill.work_ahead(snapshot, home)
    if at_home <= 0:
        return None
    cost_home = at_home + expected_uncached(request, snapshot, home.id)
    resident = dict(snapshot.session.resident_on) if snapshot.session is not None else {}
    if not shared() and cost_home <= theta * (prompt - max((t for r, t in resident.items() if r != home.id), default=0)):
        return None
    ahead = dict(snapshot.prefill_ahead)
    best = None
    for r in view.pool:
        if r.id == home.id or r.status is not ReplicaStatus.ACTIVE:
            continue
        if not view.panic and r.in_flight >= view.hard_bound:
            continue
        if r.host_capacity_tokens - r.engine.host_used_tokens < prompt:
            continue
        if (VAR == "le" and r.in_flight > home.in_flight) or (VAR == "lt" and r.in_flight >= home.in_flight):
            continue
        cost = ahead.get(r.id, 0) + max(0, prompt - min(prompt, resident.get(r.id, 0)) - shared())
        if best is None or (cost, r.id) < best[:2]:
            best = (cost, r.id, r)
    if best is None or cost_home <= theta * best[0]:
        return None
    t = best[2]
    if LOG:
        sess = snapshot.session
        costs = [ahead.get(r.id, 0) + prompt for r in snapshot.replicas if r.id != home.id]
        print(json.dumps({
            "t": round(snapshot.now, 2), "prompt": prompt, "ctx": sess.context_tokens if sess else None,
            "turns": sess.turns if sess else None, "ahead_home": at_home,
            "own_home": cost_home - at_home, "ahead_target": ahead.get(t.id, 0),
            "ties": costs.count(min(costs)),
            "home_in_flight": home.in_flight, "target_in_flight": t.in_flight, "home_sessions": home.sessions_active,
        }), flush=True)
    return RouteDecision(t.id, Reason.QUEUE_SPILL, kept, ((t.id, kv_aware.load_score(t, 0, self.params)),),
                         AffinityBreak.OVERLOAD_SPILL)


kv_aware.KvAwarePolicy._queue_spill = _queue_spill

if sys.argv[1] == "ab":
    from loadtests.parity import WORKLOADS, run_sim_for
    from loadtests.scenario import demo_scenario

    w, seeds = sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    for seed in seeds:
        for VAR in sys.argv[4:]:
            base, _, hc = w.partition("+")
            extra = {"host_tier": True} if hc == "hc" else {}
            # the workload's own token unit (Mooncake: 32 since f21e980; var_ab.jsonl's rows ran at 100)
            sc = demo_scenario(**{**WORKLOADS[base], **extra}, kv_events=True, seed=seed)
            m = run_sim_for(sc)
            print(json.dumps({"w": w, "seed": seed, "mode": VAR, **{k: m.get(k) for k in KEEP}}), flush=True)
else:
    from loadtests.sim import cli

    VAR = sys.argv[2]
    args = cli.build_parser().parse_args(sys.argv[3:])
    d = cli._DEFAULTS[args.workload]
    lanes = args.lanes if args.lanes is not None else int(d["lanes_per_replica"] * args.replicas)
    profile = cli.get_profile(args.profile).with_overrides(page_size=args.page_size, **dict(args.set))
    specs = cli.load_workload(args, lanes, profile.context_length)
    cfg = cli._sim_config(args, profile, lanes, args.duration or d["duration_s"], args.warmup or d["warmup_s"])
    params = PolicyParams().with_changes(**{k: float(v) for k, v in args.param})
    m = sim_run.run_sim(specs, cfg, policy=kv_aware.KvAwarePolicy(params)).measures
    print(json.dumps({"w": f"{args.workload}-{args.replicas}", "seed": args.seed, "mode": VAR,
                      **{k: m.get(k) for k in KEEP}}), file=sys.stderr if LOG else sys.stdout, flush=True)

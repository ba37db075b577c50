"""Round 45: rule 8 with a guard on the target's load, measured again on the rule as it now is.
Round 39 found "no busier than home" (`le`) better than the shipped rule on WEKA and worse on
Mooncake, but its Mooncake rows ran at 100 model tokens per emulated token, before the workload got
its own unit (32), and on the rule before round 40 (`work_ahead` with other gateways). Variants:
  lo   the shipped rule, unpatched
  le   only onto a replica with no more requests in flight than home
  lt   only onto a replica with fewer requests in flight than home
  off  no spill
Bench model, one row per seed and variant (analyse with docs/experiments/round43/ana.py ROWS lo):
    PYTHONPATH=. python docs/experiments/round45/guard.py ab WORKLOAD[+hc] SEEDS VAR...
At scale, `kvroute sim` on the patched policy (its arguments; the measures go to its --json file):
    PYTHONPATH=. python docs/experiments/round45/guard.py sim VAR <kvroute sim args>
"""

import itertools
import json
import sys

from router.model import AffinityBreak, Reason, ReplicaStatus, RouteDecision
from router.policy import kv_aware
from router.policy.prefill import expected_uncached, work_ahead

KEEP = ("chr", "pooled_chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor")
SHIPPED = kv_aware.KvAwarePolicy._queue_spill
VAR = "lo"


def _guarded(self, view, request, snapshot, home, kept):
    """The shipped `_queue_spill` (main at 3e87b45) with the guard: one `continue` added."""
    theta = self.params.queue_spill_factor
    prompt = request.prompt_tokens_estimate
    if theta <= 0 or prompt <= 0 or not (snapshot.prefill_ahead or snapshot.engines_ahead):
        return None
    at_home = work_ahead(snapshot, home)
    if at_home <= 0:
        return None
    cost_home = at_home + expected_uncached(request, snapshot, home.id)
    resident = snapshot.session.resident_on if snapshot.session is not None else ()
    floor = prompt - max((t for r, t in resident if r != home.id), default=0)
    if cost_home <= theta * floor:
        return None
    best = None
    for r in view.pool:
        if r.id == home.id or r.status is not ReplicaStatus.ACTIVE:
            continue
        if not view.panic and r.in_flight >= view.hard_bound:
            continue
        if r.host_capacity_tokens - r.engine.host_used_tokens < prompt:
            continue
        if r.in_flight > home.in_flight or (VAR == "lt" and r.in_flight == home.in_flight):
            continue
        cost = work_ahead(snapshot, r) + expected_uncached(request, snapshot, r.id)
        if best is None or (cost, r.id) < best[:2]:
            best = (cost, r.id, r)
            if cost <= floor:
                break
    if best is None or cost_home <= theta * best[0]:
        return None
    target = best[2]
    score = kv_aware.load_score(target, 0, self.params)
    return RouteDecision(
        target.id, Reason.QUEUE_SPILL, kept, ((target.id, score),), AffinityBreak.OVERLOAD_SPILL
    )


def _queue_spill(self, view, request, snapshot, home, kept):
    if VAR == "off":
        return None
    if VAR in ("le", "lt"):
        return _guarded(self, view, request, snapshot, home, kept)
    return SHIPPED(self, view, request, snapshot, home, kept)


kv_aware.KvAwarePolicy._queue_spill = _queue_spill

if sys.argv[1] == "ab":
    from loadtests.parity import WORKLOADS, run_sim_for
    from loadtests.scenario import demo_scenario

    w, seeds = sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    base, _, hc = w.partition("+")  # WORKLOAD+hc: with the host tier
    scenario = {**WORKLOADS[base], "host_tier": hc == "hc" or WORKLOADS[base]["host_tier"]}
    for seed, VAR in itertools.product(seeds, sys.argv[4:]):
        m = run_sim_for(demo_scenario(**scenario, kv_events=True, seed=seed))
        row = {
            "w": w,
            "seed": seed,
            "mode": VAR,
            "spills": (m.get("route_reasons") or {}).get("queue_spill", 0),
        }
        print(json.dumps(row | {k: m.get(k) for k in KEEP}), flush=True)
else:  # `kvroute sim` itself, on the patched policy
    from loadtests.sim import cli

    VAR = sys.argv[2]
    raise SystemExit(cli.cli_main(sys.argv[3:]))

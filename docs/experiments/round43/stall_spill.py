"""Round 43: rule 8 charged for the stall its spill imposes. SGLang runs a prefill before any decode
(round 42), so a turn spilled onto a replica stalls every request running there for the length of its
cold prefill. Variant `stall` weighs each replica by the prefill work ahead of the turn plus its
uncached part times (1 + the requests in flight there): the turn's own wait plus the delay its prefill
adds to the others. `stall_t` charges the stall on the target only (a warm turn's own part at home is small).
`lo` is the shipped rule, `off` no spill. Patched in-process, the policy is not
edited. Bench model (the simulator's model of the live bench, KV events), one row per seed and variant:
    PYTHONPATH=. python docs/experiments/round43/stall_spill.py ab WORKLOAD[+hc] SEEDS VAR...
At scale, `kvroute sim` on the patched policy (its arguments; the measures go to its --json file):
    PYTHONPATH=. python docs/experiments/round43/stall_spill.py sim VAR <kvroute sim args>
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


def _stall_spill(self, view, request, snapshot, home, kept):
    theta = self.params.queue_spill_factor
    prompt = request.prompt_tokens_estimate
    if theta <= 0 or prompt <= 0 or not (snapshot.prefill_ahead or snapshot.engines_ahead):
        return None
    at_home = work_ahead(snapshot, home)
    if at_home <= 0:
        return None
    cost_home = at_home + expected_uncached(request, snapshot, home.id) * (1 + (home.in_flight if VAR == "stall" else 0))
    resident = snapshot.session.resident_on if snapshot.session is not None else ()
    # (as shipped: no replica can cost less than the prompt less the most of it cached anywhere else)
    if cost_home <= theta * (prompt - max((t for r, t in resident if r != home.id), default=0)):
        return None
    best = None
    for r in view.pool:
        if r.id == home.id or r.status is not ReplicaStatus.ACTIVE:
            continue
        if not view.panic and r.in_flight >= view.hard_bound:
            continue
        if r.host_capacity_tokens - r.engine.host_used_tokens < prompt:
            continue
        cost = work_ahead(snapshot, r) + expected_uncached(request, snapshot, r.id) * (1 + r.in_flight)
        if best is None or (cost, r.id) < best[:2]:
            best = (cost, r.id, r)
    if best is None or cost_home <= theta * best[0]:
        return None
    t = best[2]
    return RouteDecision(t.id, Reason.QUEUE_SPILL, kept, ((t.id, kv_aware.load_score(t, 0, self.params)),),
                         AffinityBreak.OVERLOAD_SPILL)


def _queue_spill(self, view, request, snapshot, home, kept):
    if VAR == "off":
        return None
    if VAR in ("stall", "stall_t"):
        return _stall_spill(self, view, request, snapshot, home, kept)
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
        row = {"w": w, "seed": seed, "mode": VAR, "spills": (m.get("route_reasons") or {}).get("queue_spill", 0)}
        print(json.dumps(row | {k: m.get(k) for k in KEEP}), flush=True)
else:  # `kvroute sim` itself, on the patched policy
    from loadtests.sim import cli

    VAR = sys.argv[2]
    raise SystemExit(cli.cli_main(sys.argv[3:]))

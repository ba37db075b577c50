"""Round 39: the spills of rule 8 in the simulator's model of the live bench (round 38's ab.py set-up),
one JSON row per spill as why.py prints them:
    PYTHONPATH=. python docs/experiments/round39/why_bench.py WORKLOAD[+hc] SEED > spills.jsonl"""
import json
import sys
from dataclasses import replace

from loadtests.parity import WORKLOADS, run_sim_for
from loadtests.scenario import DemoScenario
from router.model import Reason
from router.policy import kv_aware
from router.policy.prefill import expected_uncached

_orig = kv_aware.KvAwarePolicy._queue_spill


def logged(self, view, request, snapshot, home, kept):
    d = _orig(self, view, request, snapshot, home, kept)
    if d is not None and d.reason is Reason.QUEUE_SPILL:
        ahead = dict(snapshot.prefill_ahead)
        prompt = request.prompt_tokens_estimate
        tgt = snapshot.replica(d.replica_id)
        costs = [ahead.get(r.id, 0) + prompt for r in snapshot.replicas if r.id != home.id]
        sess = snapshot.session
        print(json.dumps({
            "t": round(snapshot.now, 2), "prompt": prompt, "ctx": sess.context_tokens if sess else None,
            "turns": sess.turns if sess else None, "ahead_home": ahead.get(home.id, 0),
            "own_home": expected_uncached(request, snapshot, home.id),
            "ahead_target": ahead.get(d.replica_id, 0), "ties": costs.count(min(costs)),
            "home_in_flight": home.in_flight, "target_in_flight": tgt.in_flight if tgt else None,
            "home_sessions": home.sessions_active, "mean_in_flight": round(view.mean_in_flight, 2),
        }), flush=True)
    return d


kv_aware.KvAwarePolicy._queue_spill = logged

w, seed = sys.argv[1], int(sys.argv[2])
base, _, hc = w.partition("+")
extra = {"host_tier": True} if hc == "hc" else {}
sc = replace(DemoScenario(), **{**WORKLOADS[base], **extra}, kv_events=True, seed=seed)
m = run_sim_for(sc)
print(json.dumps({k: m.get(k) for k in ("chr", "ttft_p99_s", "requests", "dispersion", "route_reasons")}),
      file=sys.stderr)

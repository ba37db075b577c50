"""Round 42: a placement's weight per session already bound to a replica grows with the placed
session's context (its cold prefill stalls every request there; the longer the stall, the likelier
each bound session's next turn arrives in it): w = max(w_sessions, min(CAP, context / R)) instead of
w_sessions (0.25). VAR = R:CAP, or off (the shipped score). The simulator's model of the live bench,
kv_aware with KV events, one row per seed and variant:
    PYTHONPATH=. python docs/experiments/round42/wsess.py weka|mooncake|synthetic SEEDS off 100000:1 50000:1
"""
import dataclasses
import json
import sys

from loadtests.parity import WORKLOADS
from loadtests.scenario import demo_scenario, sim_config
from loadtests.sim.run import run_sim
from router.policy import kv_aware
from router.policy.params import PolicyParams

VAR = "off"
_ls, _lss = kv_aware.load_score, kv_aware.load_scores
def w_of(ctx, p):
    if VAR == "off": return p.w_sessions
    r, cap = (float(x) for x in VAR.split(":"))
    return max(p.w_sessions, min(cap, ctx / r))
def load_score(replica, context_tokens, params):
    return _ls(replica, context_tokens, params) + (w_of(context_tokens, params) - params.w_sessions) * replica.sessions_active
def load_scores(replicas, context_tokens, params):
    d = w_of(context_tokens, params) - params.w_sessions
    return [s + d * r.sessions_active for s, r in zip(_lss(replicas, context_tokens, params), replicas)]
kv_aware.load_score, kv_aware.load_scores = load_score, load_scores
KEEP = ("chr","routing_loss","ttft_p99_s","e2e_p99_s","requests","dispersion","dispersion_floor")
w, seeds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
for seed in seeds:
    for VAR in sys.argv[3:]:
        cfg, specs = sim_config(demo_scenario(**WORKLOADS[w], kv_events=True, seed=seed))
        cfg = dataclasses.replace(cfg, policy="kv_aware")
        m = run_sim(specs, cfg, policy=kv_aware.KvAwarePolicy(PolicyParams())).measures
        print(json.dumps({"w": w, "seed": seed, "var": VAR, **{k: m.get(k) for k in KEEP}}), flush=True)

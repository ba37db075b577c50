"""Round 38 A/B of policy parameters in the simulator's model of the live bench (README.md):
    PYTHONPATH=. python ab.py WORKLOAD[+hc] SEEDS KEY=VALUE[@tag] ..."""
import json, sys
from dataclasses import replace
from loadtests.scenario import DemoScenario
from loadtests.parity import WORKLOADS, run_sim_for
w, seeds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
for seed in seeds:
    for pp in sys.argv[3:]:
        base, _, hc = w.partition("+")
        extra = {"host_tier": True} if hc == "hc" else {}
        sc = replace(DemoScenario(), **{**WORKLOADS[base], **extra}, kv_events=True, seed=seed, policy_params=(pp.split("@")[0],))
        m = run_sim_for(sc)
        keep = {k: m.get(k) for k in ("chr", "pooled_chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor", "route_reasons")}
        print(json.dumps({"w": w, "seed": seed, "mode": pp, **keep}), flush=True)

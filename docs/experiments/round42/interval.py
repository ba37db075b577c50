"""Round 42: SGLang's --prefill-decode-interval N on the engines (timemodel Rule 1), kvroute's policy
unchanged. The simulator's model of the live bench (kv_aware with KV events), one row per seed and N
(0 = SGLang's default, prefill first):
    PYTHONPATH=. python docs/experiments/round42/interval.py weka|mooncake|synthetic SEEDS N...
"""
import dataclasses
import json
import sys

from loadtests.parity import WORKLOADS
from loadtests.scenario import demo_scenario, sim_config
from loadtests.sim.run import run_sim

KEEP = ("chr", "routing_loss", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "requests", "dispersion",
        "dispersion_floor", "dispersion_sticky", "dispersion_between")

w, seeds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
for seed in seeds:
    for n in (int(x) for x in sys.argv[3:]):
        cfg, specs = sim_config(demo_scenario(**WORKLOADS[w], kv_events=True, seed=seed))
        prof = cfg.profile.with_overrides(prefill_decode_interval=n)
        m = run_sim(specs, dataclasses.replace(cfg, policy="kv_aware", profile=prof)).measures
        print(json.dumps({"w": w, "seed": seed, "interval": n, **{k: m.get(k) for k in KEEP}}), flush=True)

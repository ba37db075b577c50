"""Round 42: where dispersion above the sticky floor comes from. The simulator's model of the live bench
(kv_aware, KV events), with the engines' prefill made F times faster (`prefill_c_lin_s` and
`prefill_c_attn_s` divided by F; F = 1 is the reference profile). If the excess is co-located sessions
stalled together behind one long prefill (SGLang runs a prefill before any decode), it shrinks with F;
placement does not change between the rows. One row per seed and F:
    PYTHONPATH=. python docs/experiments/round42/stall.py WORKLOAD SEEDS F...
"""
import dataclasses
import json
import sys

from loadtests.parity import WORKLOADS
from loadtests.scenario import demo_scenario, sim_config
from loadtests.sim.run import run_sim

KEEP = ("chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor", "dispersion_sticky",
        "dispersion_between")

w, seeds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
for seed in seeds:
    for f in (float(x) for x in sys.argv[3:]):
        cfg, specs = sim_config(demo_scenario(**WORKLOADS[w], kv_events=True, seed=seed))
        prof = cfg.profile.with_overrides(prefill_c_lin_s=cfg.profile.prefill_c_lin_s / f,
                                          prefill_c_attn_s=cfg.profile.prefill_c_attn_s / f)
        m = run_sim(specs, dataclasses.replace(cfg, policy="kv_aware", profile=prof)).measures
        print(json.dumps({"w": w, "seed": seed, "prefill_speed": f, **{k: m.get(k) for k in KEEP}}), flush=True)

"""The runner the rule-8 experiment scripts share (rounds 43 and 45). A script patches the policy
in-process, reading its variant from a global that ``set_variant`` sets before each run, and hands
its arguments here:
    ab WORKLOAD[+hc] SEEDS VAR...   the bench model (the simulator's model of the live bench, KV
                                    events), one JSON row per seed and variant
    sim VAR <kvroute sim args>      `kvroute sim` itself on the patched policy
"""

import itertools
import json
from collections.abc import Callable

KEEP = ("chr", "pooled_chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor")


def main(argv: list[str], set_variant: Callable[[str], None]) -> int:
    if argv[0] == "ab":
        from loadtests.parity import WORKLOADS, run_sim_for
        from loadtests.scenario import demo_scenario

        w, seeds = argv[1], [int(x) for x in argv[2].split(",")]
        base, _, hc = w.partition("+")  # WORKLOAD+hc: with the host tier
        scenario = {**WORKLOADS[base], "host_tier": hc == "hc" or WORKLOADS[base]["host_tier"]}
        for seed, var in itertools.product(seeds, argv[3:]):
            set_variant(var)
            m = run_sim_for(demo_scenario(**scenario, kv_events=True, seed=seed))
            spills = (m.get("route_reasons") or {}).get("queue_spill", 0)
            row = {"w": w, "seed": seed, "mode": var, "spills": spills}
            print(json.dumps(row | {k: m.get(k) for k in KEEP}), flush=True)
        return 0
    from loadtests.sim import cli

    set_variant(argv[1])
    return cli.cli_main(argv[2:])

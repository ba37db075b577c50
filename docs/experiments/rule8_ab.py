"""The runner the rule-8 experiment scripts share (rounds 43 and 45). A script hands its arguments
and its variant of the rule, ``spill(variant, self, view, request, snapshot, home, kept)``, to
``main``, which puts it in the policy's place (in-process; ``SHIPPED`` is the rule as shipped) and
runs:
    ab WORKLOAD[+hc] SEEDS VAR...   the bench model (the simulator's model of the live bench, KV
                                    events), one JSON row per seed and variant
    sim VAR <kvroute sim args>      `kvroute sim` itself on the patched policy
"""

import itertools
import json
from collections.abc import Callable
from typing import Any

from router.policy import kv_aware

SHIPPED = kv_aware.KvAwarePolicy._queue_spill
KEEP = ("chr", "pooled_chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor")


def main(argv: list[str], spill: Callable[..., Any]) -> int:
    variant = ["lo"]

    def patched(self: Any, *args: Any) -> Any:
        return spill(variant[0], self, *args)

    kv_aware.KvAwarePolicy._queue_spill = patched  # type: ignore[method-assign]
    if argv[0] == "ab":
        from loadtests.parity import WORKLOADS, run_sim_for
        from loadtests.scenario import demo_scenario

        w, seeds = argv[1], [int(x) for x in argv[2].split(",")]
        base, _, hc = w.partition("+")  # WORKLOAD+hc: with the host tier
        scenario = {**WORKLOADS[base], "host_tier": hc == "hc" or WORKLOADS[base]["host_tier"]}
        for seed, var in itertools.product(seeds, argv[3:]):
            variant[0] = var
            m = run_sim_for(demo_scenario(**scenario, kv_events=True, seed=seed))
            spills = (m.get("route_reasons") or {}).get("queue_spill", 0)
            row = {"w": w, "seed": seed, "mode": var, "spills": spills}
            print(json.dumps(row | {k: m.get(k) for k in KEEP}), flush=True)
        return 0
    from loadtests.sim import cli

    variant[0] = argv[1]
    return cli.cli_main(argv[2:])

"""Round 39: where the simulator's ideal hit rate on the Mooncake workload exceeds the live driver's
(`loadtests.parity.ideal_hits_by_kind`: both drivers' prompts, one infinite cache each), per kind of
turn. The round's runs also split first turns by whether the session shares a prefix (all did).
    PYTHONPATH=. python docs/experiments/round39/mc_ideal.py [SEED] [SESSIONS] [UNIT] [WORKLOAD]
(WORKLOAD: a name of loadtests.parity.WORKLOADS, default mooncake)"""
import json
import sys
from dataclasses import replace

from loadtests.parity import WORKLOADS, ideal_hits_by_kind
from loadtests.scenario import DemoScenario

seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
unit = int(sys.argv[3]) if len(sys.argv) > 3 else DemoScenario().token_unit
work = sys.argv[4] if len(sys.argv) > 4 else "mooncake"
sc = replace(DemoScenario(), **WORKLOADS[work], kv_events=True, seed=seed, token_unit=unit)
acc = ideal_hits_by_kind(sc, limit)
tot = tuple(sum(a[i] for a in acc.values()) for i in range(4))
for kind, a in sorted(acc.items()) + [("all", tot)]:
    print(json.dumps({"kind": kind, "turns": a[0], "prompt_tokens": a[1], "sim_hit": round(a[2] / a[1], 4),
                      "live_hit": round(a[3] / a[1], 4)}))

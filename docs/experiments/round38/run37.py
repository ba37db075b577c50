import json, os, sys
from dataclasses import replace
from loadtests.scenario import DemoScenario
from loadtests.parity import WORKLOADS, run_sim_for
w, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.environ["SPILL"] = mode.split(":")[0]; os.environ["SPILL_GATE"] = (mode.split(":") + [""])[1]
sc = replace(DemoScenario(), **WORKLOADS[w], kv_events=True, seed=seed)
m = run_sim_for(sc)
keep = {k: m.get(k) for k in ("chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "engine_queue_p99_s", "route_reasons")}
print(json.dumps({"w": w, "seed": seed, "mode": mode, **keep}))

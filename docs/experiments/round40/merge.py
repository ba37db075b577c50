"""Round 40: rule 8's work ahead with several gateways. Each gateway's ledger holds only its own
requests; the engine reports its whole queue (SGLang's num_waiting_uncached_tokens, polled every
scrape interval). Variants (the VAR arguments):
  own    the shipped ledger (this gateway's requests only)
  max    per replica, the larger of the ledger and the engine's last reported queue
  shipped  what main does: max with more than one gateway, own with one
  sum    the ledger + the engine's queue (double counts this gateway's queued requests)
  V:T    variant V with queue_spill_factor T (default 2)

Bench model, one row per seed and variant (G gateways sharing state with LAG s of lag):
    PYTHONPATH=. python docs/experiments/round40/merge.py ab WORKLOAD[+hc] SEEDS G LAG VAR...
At scale main itself was run (`kvroute sim --gateways 10 ...`: `shipped`).
"""
import dataclasses
import json
import sys

from router.policy import kv_aware
from router.policy.params import PolicyParams
from router.policy.prefill import PrefillLedger

KEEP = ("chr", "pooled_chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion", "dispersion_floor", "route_reasons")
VAR = "own"
_own = PrefillLedger.with_ahead


def with_ahead(self, snapshot, *, others=False):
    if VAR == "shipped":  # what the simulator passes: others = more than one gateway
        return _own(self, snapshot, others=others)
    if VAR == "own":
        return _own(self, snapshot)
    if VAR == "max":  # as merged (f. round 40): with_ahead(others=True)
        return _own(self, snapshot, others=True)
    mine = dict(self.ahead())  # sum
    out = {}
    for r in snapshot.replicas:
        v = mine.get(r.id, 0) + r.engine.waiting_uncached_tokens
        if v > 0:
            out[r.id] = v
    for rid, v in mine.items():  # a replica the snapshot does not list keeps what we know of it
        out.setdefault(rid, v)
    return dataclasses.replace(snapshot, prefill_ahead=tuple(sorted(out.items()))) if out else snapshot


PrefillLedger.with_ahead = with_ahead

if sys.argv[1] == "ab":  # the only mode
    from loadtests.parity import WORKLOADS
    from loadtests.scenario import demo_scenario, sim_config
    from loadtests.sim.run import run_sim

    w, seeds, g, lag = sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]), float(sys.argv[5])
    for seed in seeds:
        for VAR in sys.argv[6:]:
            base, _, hc = w.partition("+")
            extra = {"host_tier": True} if hc == "hc" else {}
            cfg, specs = sim_config(demo_scenario(**{**WORKLOADS[base], **extra}, kv_events=True, seed=seed))
            cfg = dataclasses.replace(cfg, policy="kv_aware", gateways=g, state_lag_s=lag)
            mode = VAR
            VAR, _, theta = mode.partition(":")  # e.g. max:3 = max with queue_spill_factor 3
            params = PolicyParams().with_changes(**({"queue_spill_factor": float(theta)} if theta else {}))
            m = run_sim(specs, cfg, policy=kv_aware.KvAwarePolicy(params)).measures
            print(json.dumps({"w": w, "g": g, "lag": lag, "seed": seed, "mode": mode, **{k: m.get(k) for k in KEEP}}), flush=True)

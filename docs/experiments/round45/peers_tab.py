"""Round 45's held-out peers runs: per seed, kvroute against the best peer; then medians [min–max].
python docs/experiments/round45/peers_tab.py docs/experiments/round45/peers_heldout.jsonl
"""

import json
import statistics as st
import sys

K = ("chr", "routing_loss", "ttft_p99_s", "e2e_p99_s", "dispersion", "dispersion_floor", "requests", "errors")
with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f]
for w in dict.fromkeys(r["workload"] for r in rows):
    by = [r for r in rows if r["workload"] == w]
    routers = list(dict.fromkeys(r["router"] for r in by))
    print(f"== {w}")
    for s in sorted({r["seed"] for r in by}):
        res = {r["router"]: r for r in by if r["seed"] == s}
        peers = [res[r] for r in routers if not r.startswith("kvroute")]
        k = res["kvroute kv_aware"]
        print(
            f"seed {s}: kvroute / best peer: TTFT p99 {k['ttft_p99_s'] / min(p['ttft_p99_s'] for p in peers):.2f}x,"
            f" E2E p99 {k['e2e_p99_s'] / min(p['e2e_p99_s'] for p in peers):.2f}x,"
            f" requests {k['requests'] / max(p['requests'] for p in peers):.3f}x,"
            f" dispersion - floor {k['dispersion'] - k['dispersion_floor']:.2f}"
        )
    for r in routers:
        cells = []
        for key in K:
            v = [x[key] for x in by if x["router"] == r]
            cells.append(f"{key} {st.median(v):.4g} [{min(v):.4g}-{max(v):.4g}]")
        print(f"  {r:36s}", " | ".join(cells))

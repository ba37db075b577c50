"""Round 46's 1,000-replica runs: kv_aware against hash per seed and gateway count.
python docs/experiments/round46/scale_tab.py docs/experiments/round46/scale.jsonl
"""

import json
import sys

with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f]
print(
    "| seed | gateways | CHR kv_aware / hash | TTFT p99 s | requests | dispersion (floor; counting parallel requests) | routing loss |"
)
print("|---|---|---|---|---|---|---|")
for r in rows:
    k, h = r["kv_aware"], r["hash"]
    print(
        f"| {r['seed']} | {r['gateways']} | {k['chr']:.5f} / {h['chr']:.5f} | {k['ttft_p99_s']:.2f} / {h['ttft_p99_s']:.2f}"
        f" | {k['requests']:,} / {h['requests']:,} | {k['dispersion']:.2f} / {h['dispersion']:.2f}"
        f" ({k['dispersion_floor']:.2f}; {k['dispersion_sticky']:.2f}) | {k['routing_loss']:.4f} / {h['routing_loss']:.4f} |"
    )

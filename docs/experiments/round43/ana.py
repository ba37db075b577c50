"""Variant − base per workload, over the seeds both ran: mean ± standard error (how many seeds higher).
    python docs/experiments/round43/ana.py ROWS.jsonl BASE
"""
import json
import statistics as st
import sys

with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f]
base = sys.argv[2]
by = {(r["w"], r["seed"], r["mode"]): r for r in rows}
for w in sorted({r["w"] for r in rows}):
    for m in sorted({r["mode"] for r in rows if r["w"] == w} - {base}):
        seeds = sorted(s for (w2, s, m2) in by if w2 == w and m2 == m and (w, s, base) in by)
        if len(seeds) < 2:
            continue
        out = []
        for k in ("chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion"):
            d = [by[(w, s, m)][k] - by[(w, s, base)][k] for s in seeds]
            mu, se = st.mean(d), st.stdev(d) / len(d) ** 0.5
            out.append(f"{k} {mu:+.4g}±{se:.2g}({sum(x > 0 for x in d)})")
        spills = [by[(w, s, m)]["spills"] for s in seeds], [by[(w, s, base)]["spills"] for s in seeds]
        print(f"{w} {m}-{base} n={len(seeds)}", " | ".join(out), f"spills {spills[0]} vs {spills[1]}")

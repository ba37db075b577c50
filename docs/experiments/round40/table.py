"""Variant − `own` per workload and gateway count, from merge.py's rows: mean ± standard error over
the seeds (how many seeds lower).  python docs/experiments/round40/table.py ROWS.jsonl..."""
import json
import statistics as st
import sys
from pathlib import Path

rows = [json.loads(ln) for f in sys.argv[1:] for ln in Path(f).read_text().splitlines() if ln.strip()]
by = {(r["w"], r["g"], r["lag"], r["seed"], r["mode"]): r for r in rows}
for w, g, lag in sorted({(r["w"], r["g"], r["lag"]) for r in rows}):
    here = [r for r in rows if (r["w"], r["g"], r["lag"]) == (w, g, lag)]
    seeds = sorted({r["seed"] for r in here})
    base = [by[(w, g, lag, s, "own")] for s in seeds if (w, g, lag, s, "own") in by]
    print(f"== {w} g={g} lag={lag} seeds={seeds} own: ttft {st.mean(b['ttft_p99_s'] for b in base):.2f} "
          f"disp {st.mean(b['dispersion'] for b in base):.2f} floor {st.mean(b['dispersion_floor'] for b in base):.2f} "
          f"chr {st.mean(b['chr'] for b in base):.4f} rl {st.mean(b['pooled_chr'] - b['chr'] for b in base):.4f}")
    for m in sorted({r["mode"] for r in here} - {"own"}):
        out = []
        for k, lab in (("ttft_p99_s", "ttft"), ("e2e_p99_s", "e2e"), ("dispersion", "disp"), ("chr", "chr"),
                       ("requests", "req")):
            d = [by[(w, g, lag, s, m)][k] - by[(w, g, lag, s, "own")][k]
                 for s in seeds if (w, g, lag, s, m) in by and (w, g, lag, s, "own") in by]
            if d:
                se = st.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
                out.append(f"{lab} {st.mean(d):+.3f}±{se:.3f} ({sum(x < 0 for x in d)}/{len(d)} lower)")
        print(f"  {m}: " + "; ".join(out))

import json, statistics as st, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
base=sys.argv[2]
by={(r["w"],r["seed"],r["mode"]):r for r in rows}
for w in sorted({r["w"] for r in rows}):
    seeds=sorted({r["seed"] for r in rows if r["w"]==w})
    for m in sorted({r["mode"] for r in rows if r["w"]==w}):
        if m==base: continue
        out=[]
        for k in ("chr","ttft_p99_s","e2e_p99_s","requests","dispersion"):
            d=[by[(w,s,m)][k]-by[(w,s,base)][k] for s in seeds if (w,s,m) in by and (w,s,base) in by]
            if len(d)<2: continue
            mu=st.mean(d); se=st.stdev(d)/len(d)**.5; hi=sum(1 for x in d if x>0)
            out.append(f"{k} {mu:+.4g}±{se:.2g}({hi})")
        sp=st.mean(by[(w,s,m)]["route_reasons"].get("queue_spill",0) for s in seeds if (w,s,m) in by)
        print(w, m, f"n={len(d)}", " | ".join(out), f"spills~{sp:.0f}")
    print(w, "base ttft", [round(by[(w,s,base)]["ttft_p99_s"],1) for s in seeds if (w,s,base) in by])

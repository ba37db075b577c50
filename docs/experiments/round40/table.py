import json, sys, statistics as st
rows=[json.loads(l) for f in sys.argv[1:] for l in open(f) if l.strip()]
by={}
for r in rows: by[(r["w"],r["g"],r["lag"],r["seed"],r["mode"])]=r
keys=sorted({(r["w"],r["g"],r["lag"]) for r in rows})
for w,g,lag in keys:
    modes=sorted({r["mode"] for r in rows if (r["w"],r["g"],r["lag"])==(w,g,lag)})
    seeds=sorted({r["seed"] for r in rows if (r["w"],r["g"],r["lag"])==(w,g,lag)})
    base=[by[(w,g,lag,s,"own")] for s in seeds if (w,g,lag,s,"own") in by]
    print(f"== {w} g={g} lag={lag} seeds={seeds} own: ttft {st.mean(b['ttft_p99_s'] for b in base):.2f} disp {st.mean(b['dispersion'] for b in base):.2f} floor {st.mean(b['dispersion_floor'] for b in base):.2f} chr {st.mean(b['chr'] for b in base):.4f} rl {st.mean(b['pooled_chr']-b['chr'] for b in base):.4f}")
    for m in modes:
        if m=="own": continue
        out=[]
        for k,lab in (("ttft_p99_s","ttft"),("e2e_p99_s","e2e"),("dispersion","disp"),("chr","chr"),("requests","req")):
            d=[by[(w,g,lag,s,m)][k]-by[(w,g,lag,s,"own")][k] for s in seeds if (w,g,lag,s,m) in by and (w,g,lag,s,"own") in by]
            if not d: continue
            se=st.stdev(d)/len(d)**.5 if len(d)>1 else 0
            lower=sum(x<0 for x in d)
            out.append(f"{lab} {st.mean(d):+.3f}±{se:.3f} ({lower}/{len(d)} lower)")
        print(f"  {m}: "+"; ".join(out))

"""Round 39: what a queue spill (rule 8) sees at the moment it fires, on any `kvroute sim` command.
    PYTHONPATH=. python docs/experiments/round39/why.py --workload synthetic --replicas 200 --duration 300 \
        --warmup 100 --seed 1 --policies kv_aware --json /dev/null > spills.jsonl
One JSON row per spill: simulated time, the prompt, home's work ahead and its own uncached part, the
target's cost, how many replicas tied at that cost, the session's turn count, and the request's
in-flight count at home and at the target."""
import json
import sys

from loadtests.sim import cli
from loadtests.sim.run import run_sim
from router.model import Reason
from router.policy import kv_aware
from router.policy.params import PolicyParams
from router.policy.prefill import expected_uncached


class Logged(kv_aware.KvAwarePolicy):
    def _queue_spill(self, view, request, snapshot, home, kept):
        d = super()._queue_spill(view, request, snapshot, home, kept)
        if d is not None and d.reason is Reason.QUEUE_SPILL:
            ahead = dict(snapshot.prefill_ahead)
            prompt = request.prompt_tokens_estimate
            tgt = snapshot.replica(d.replica_id)
            costs = [ahead.get(r.id, 0) + prompt for r in snapshot.replicas if r.id != home.id]
            sess = snapshot.session
            print(json.dumps({
                "t": round(snapshot.now, 2), "prompt": prompt, "ctx": sess.context_tokens if sess else None,
                "turns": sess.turns if sess else None, "ahead_home": ahead.get(home.id, 0),
                "own_home": expected_uncached(request, snapshot, home.id),
                "ahead_target": ahead.get(d.replica_id, 0), "ties": costs.count(min(costs)),
                "home_in_flight": home.in_flight, "target_in_flight": tgt.in_flight if tgt else None,
                "home_sessions": home.sessions_active,
            }), flush=True)
        return d


def main(argv):
    args = cli.build_parser().parse_args(argv)
    d = cli._DEFAULTS[args.workload]
    lanes = args.lanes if args.lanes is not None else int(d["lanes_per_replica"] * args.replicas)
    profile = cli.get_profile(args.profile).with_overrides(page_size=args.page_size, **dict(args.set))
    specs = cli.load_workload(args, lanes, profile.context_length)
    cfg = cli._sim_config(args, profile, lanes, args.duration or d["duration_s"], args.warmup or d["warmup_s"])
    params = PolicyParams().with_changes(**{k: float(v) for k, v in args.param})
    res = run_sim(specs, cfg, policy=Logged(params))
    m = res.measures
    print(json.dumps({k: m.get(k) for k in ("chr", "ttft_p99_s", "requests", "dispersion", "route_reasons")}),
          file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

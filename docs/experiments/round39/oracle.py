"""Round 39: rule 8 with an oracle for the prefix every session shares (the synthetic workload's
system prompt, cached on every replica), to test whether counting it as work ahead is what makes the
rule spill at scale. SHARED (env, tokens) is taken off every expected uncached part the policy cannot
see cached (a session's first request, another replica than home). Same arguments as `kvroute sim`:
    SHARED=9000 PYTHONPATH=. python docs/experiments/round39/oracle.py --workload synthetic --replicas 200 \
        --duration 300 --warmup 100 --seed 1 --policies kv_aware --json /dev/null"""
import json
import os
import sys

from loadtests.sim import cli
from loadtests.sim import run as sim_run
from loadtests.sim.run import run_sim
from router.model import AffinityBreak, Reason, ReplicaStatus, RouteDecision
from router.policy import kv_aware, prefill
from router.policy.params import PolicyParams

SHARED = int(os.environ.get("SHARED", "0"))
_orig = prefill.expected_uncached


def expected_uncached(request, snapshot, replica_id):
    u = _orig(request, snapshot, replica_id)
    sess = snapshot.session
    at_home = sess is not None and sess.session_id == request.session_key and replica_id == sess.home
    return u if at_home else max(0, u - SHARED)


sim_run.expected_uncached = expected_uncached
kv_aware.expected_uncached = expected_uncached


class Oracle(kv_aware.KvAwarePolicy):
    def _queue_spill(self, view, request, snapshot, home, kept):
        theta = self.params.queue_spill_factor
        prompt = request.prompt_tokens_estimate
        if theta <= 0 or prompt <= 0 or not snapshot.prefill_ahead:
            return None
        at_home = kv_aware._ahead_at(snapshot.prefill_ahead, home.id)
        if at_home <= 0:
            return None
        cost_home = at_home + expected_uncached(request, snapshot, home.id)
        resident = dict(snapshot.session.resident_on) if snapshot.session is not None else {}
        ahead = dict(snapshot.prefill_ahead)
        best = None
        for r in view.pool:
            if r.id == home.id or r.status is not ReplicaStatus.ACTIVE:
                continue
            if not view.panic and r.in_flight >= view.hard_bound:
                continue
            if r.host_capacity_tokens - r.engine.host_used_tokens < prompt:
                continue
            cost = ahead.get(r.id, 0) + max(0, prompt - min(prompt, resident.get(r.id, 0)) - SHARED)
            if best is None or (cost, r.id) < best[:2]:
                best = (cost, r.id, r)
        if best is None or cost_home <= theta * best[0]:
            return None
        t = best[2]
        return RouteDecision(t.id, Reason.QUEUE_SPILL, kept, ((t.id, kv_aware.load_score(t, 0, self.params)),),
                             AffinityBreak.OVERLOAD_SPILL)


def main(argv):
    args = cli.build_parser().parse_args(argv)
    d = cli._DEFAULTS[args.workload]
    lanes = args.lanes if args.lanes is not None else int(d["lanes_per_replica"] * args.replicas)
    profile = cli.get_profile(args.profile).with_overrides(page_size=args.page_size, **dict(args.set))
    specs = cli.load_workload(args, lanes, profile.context_length)
    cfg = cli._sim_config(args, profile, lanes, args.duration or d["duration_s"], args.warmup or d["warmup_s"])
    params = PolicyParams().with_changes(**{k: float(v) for k, v in args.param})
    m = run_sim(specs, cfg, policy=Oracle(params)).measures
    print(json.dumps({"shared": SHARED, "seed": args.seed, "replicas": args.replicas,
                      **{k: m.get(k) for k in ("chr", "ttft_p99_s", "e2e_p99_s", "requests", "dispersion",
                                               "route_reasons")}}))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Round 43: rule 8 charged for the stall its spill imposes. SGLang runs a prefill before any decode
(round 42), so a turn spilled onto a replica stalls every request running there for the length of its
cold prefill. Variant `stall` weighs each replica by the prefill work ahead of the turn plus its
uncached part times (1 + the requests in flight there): the turn's own wait plus the delay its prefill
adds to the others. `stall_t` charges the stall on the target only (a warm turn's own part at home is small).
`lo` is the shipped rule, `off` no spill. Patched in-process, the policy is not
edited. Bench model (the simulator's model of the live bench, KV events), one row per seed and variant:
    PYTHONPATH=. python docs/experiments/round43/stall_spill.py ab WORKLOAD[+hc] SEEDS VAR...
At scale, `kvroute sim` on the patched policy (its arguments; the measures go to its --json file):
    PYTHONPATH=. python docs/experiments/round43/stall_spill.py sim VAR <kvroute sim args>
"""

import functools
import sys

from docs.experiments.rule8_ab import SHIPPED, main
from router.policy import kv_aware
from router.policy.prefill import expected_uncached


def _charged(var, request, snapshot, replica_id):
    """Rule 8's uncached part on a replica, times (1 + its requests in flight) for the variants: in
    `kv_aware` only rule 8 calls it, so patching it there changes the rule's costs and nothing else."""
    u = expected_uncached(request, snapshot, replica_id)
    sess, r = snapshot.session, snapshot.replica(replica_id)
    at_home = sess is not None and sess.session_id == request.session_key and replica_id == sess.home
    if r is None or (var == "stall_t" and at_home):
        return u
    return u * (1 + r.in_flight)


def _queue_spill(var, self, view, request, snapshot, home, kept):
    if var == "off":
        return None
    stall = var in ("stall", "stall_t")
    kv_aware.expected_uncached = functools.partial(_charged, var) if stall else expected_uncached
    return SHIPPED(self, view, request, snapshot, home, kept)


raise SystemExit(main(sys.argv[1:], _queue_spill))

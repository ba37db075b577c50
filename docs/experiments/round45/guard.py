"""Round 45: rule 8 with a guard on the target's load, measured again on the rule as it now is.
Round 39 found "no busier than home" (`le`) better than the shipped rule on WEKA and worse on
Mooncake, but its Mooncake rows ran at 100 model tokens per emulated token, before the workload got
its own unit (32), and on the rule before round 40 (`work_ahead` with other gateways). Variants:
  lo   the shipped rule, unpatched
  le   only onto a replica with no more requests in flight than home
  lt   only onto a replica with fewer requests in flight than home
  off  no spill
Bench model, one row per seed and variant (analyse with docs/experiments/round43/ana.py ROWS lo):
    PYTHONPATH=. python docs/experiments/round45/guard.py ab WORKLOAD[+hc] SEEDS VAR...
At scale, `kvroute sim` on the patched policy (its arguments; the measures go to its --json file):
    PYTHONPATH=. python docs/experiments/round45/guard.py sim VAR <kvroute sim args>
"""

import sys

from docs.experiments.rule8_ab import SHIPPED, main


class _Guarded:
    """The view rule 8 reads (its pool, panic flag and hard bound), its pool cut to the replicas
    with no more (`le`) or fewer (`lt`) requests in flight than home: the shipped rule then runs
    unchanged on it."""

    def __init__(self, view, home, strict):
        self.panic, self.hard_bound = view.panic, view.hard_bound
        n = home.in_flight
        self.pool = tuple(r for r in view.pool if r.in_flight < n or (not strict and r.in_flight == n))


def _queue_spill(var, self, view, request, snapshot, home, kept):
    if var == "off":
        return None
    if var in ("le", "lt"):
        view = _Guarded(view, home, strict=var == "lt")
    return SHIPPED(self, view, request, snapshot, home, kept)


raise SystemExit(main(sys.argv[1:], _queue_spill))

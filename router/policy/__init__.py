"""The routing policy. PURE.

Rule 1: nothing in ``policy/`` awaits, reads a clock, does I/O, logs, or touches global random.
Rule 2: every policy has one signature, ``route(request, snapshot, rng) -> RouteDecision``; the
        gateway, the simulator and the tests call the same code.
Rule 3: ``policy`` imports only ``router.model``, ``router.errors``, ``router.events`` and the
        standard library (plus ``mmh3`` for hashing).
Rule 4: the policy *describes* state changes as effects; a store performs them.

Modules: ``params`` (PolicyParams), ``kv_aware`` (the policy), ``baselines`` (random, round_robin,
least_loaded, hash), ``hashing`` (rendezvous), ``prefix_key`` (rule 7 keys), ``breaks`` (affinity
break classification), ``registry`` (name -> factory), ``base`` (the ``Policy`` Protocol). The
algorithm is in docs/POLICY.md.
"""

from __future__ import annotations

from router.policy.base import Policy
from router.policy.baselines import HashPolicy, LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from router.policy.breaks import classify_break, home_found
from router.policy.hashing import hrw_rank, hrw_top
from router.policy.kv_aware import KvAwarePolicy
from router.policy.params import PolicyParams
from router.policy.prefix_key import prefix_key
from router.policy.registry import POLICIES, make_policy

__all__ = [
    "POLICIES",
    "HashPolicy",
    "KvAwarePolicy",
    "LeastLoadedPolicy",
    "Policy",
    "PolicyParams",
    "RandomPolicy",
    "RoundRobinPolicy",
    "classify_break",
    "home_found",
    "hrw_rank",
    "hrw_top",
    "make_policy",
    "prefix_key",
]

"""Policy names -> factories. The CLI, config, simulator and admin API build policies here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from router.policy import Policy
from router.policy.baselines import (
    HashPolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    StickyLeastLoadedPolicy,
)
from router.policy.kv_aware import KvAwarePolicy
from router.policy.params import PolicyParams

__all__ = ["POLICIES", "make_policy"]

PolicyFactory = Callable[[PolicyParams], Policy]

POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        "kv_aware": KvAwarePolicy,
        "random": lambda params: RandomPolicy(),
        "round_robin": lambda params: RoundRobinPolicy(),
        "least_loaded": lambda params: LeastLoadedPolicy(),
        "hash": lambda params: HashPolicy(),
        "sticky_least_loaded": lambda params: StickyLeastLoadedPolicy(),
    }
)


def make_policy(name: str, params: PolicyParams | None = None) -> Policy:
    """Build the policy called ``name``; ``ValueError`` lists the valid names otherwise."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory(params or PolicyParams())

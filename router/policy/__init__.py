"""The routing policy. PURE.

Rule 1: nothing in ``policy/`` awaits, reads a clock, does I/O, logs, or touches global random.
Rule 2: every policy has one signature, ``route(request, snapshot, rng) -> RouteDecision``; the
        gateway, the simulator and the tests call the same code.
Rule 3: ``policy`` imports only ``router.model``, ``router.events`` and the standard library
        (plus ``mmh3`` for hashing).
Rule 4: the policy *describes* state changes as effects; a store performs them.
"""

from __future__ import annotations

import random
from typing import Protocol

from router.model import ClusterSnapshot, RouteDecision, RouteRequest

__all__ = ["Policy"]


class Policy(Protocol):
    name: str

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        """Choose a replica. Raises ``router.errors.NoReplicaError`` if none is eligible."""
        ...

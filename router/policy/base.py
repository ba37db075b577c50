"""The ``Policy`` Protocol: one signature for every policy (package rule 2)."""

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

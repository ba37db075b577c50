"""Hostile or broken KV-event publishers (review findings): each input once hung or killed the
subscriber, or pointed the gateway's connections at a host of the replica's choosing.

Over real sockets: the emulator's publisher where a well-formed stream with one bad batch is enough,
and a scripted ZMQ PUB + ROUTER (``HostilePublisher``) for what the emulator never sends (a replay
without an end marker, negative sequence numbers).
"""

from __future__ import annotations

import pytest

from router.residency import ReplicaResidency

# ---- 1. a parent cycle in the mirror ------------------------------------------------------------


@pytest.mark.timeout(10, method="signal")  # a regression is an endless loop: fail it, do not hang CI
@pytest.mark.parametrize("cycle", ["self", "pair"])
def test_a_parent_cycle_makes_the_session_unknown_instead_of_hanging(cycle: str) -> None:
    r = ReplicaResidency()
    r.cleared()
    if cycle == "self":
        r.stored(5, [5], 4, 4, 1, None)  # a block that names itself as its parent
        ring = [5]
    else:
        r.stored(6, [5], 4, 4, 1, None)  # 5 below 6 ...
        r.stored(5, [6], 4, 4, 1, None)  # ... and 6 below 5
        ring = [5, 6]
    r.stored(5, [7], 4, 4, 1, "s")
    r.stored(None, [100, 101], 4, 8, 1, "t")  # an honest session beside it
    r.removed([7, *ring], 1)  # the walk up from 7 meets only blocks that are going too
    assert r.resident_tokens("s") is None
    assert r.resident_tokens("t") == 8
    r.removed([101], 1)
    assert r.resident_tokens("t") == 4


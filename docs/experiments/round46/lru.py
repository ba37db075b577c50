"""Round 46: break placement ties by what each candidate would evict (an oracle, in the bench models).

A per-replica LRU evicts what one shared LRU of the same size would keep (round 22: most routing loss
is ``placed_evicted``). The shipped tie-break is the session's rendezvous winner. The oracle reads
each simulated replica's cache: among the tied candidates it takes one where the session's context
fits the free KV, else the one whose least recently used device node (host node, with a host tier
that is full) is the oldest, so the fleet evicts in something nearer one LRU order.

    ab WORKLOAD[+hc] SEEDS VAR...   VAR: hrw (shipped) | lru (the oracle) | lruW (the
                                    oracle among scores within W of the best)
    sim VAR <kvroute sim args>      `kvroute sim` on the patched policy

Nothing here is shipped: the stamps and the registry are patched in-process.
"""

import itertools
import json
import sys
from typing import Any

from loadtests.sim import replica_model
from replica.emulator import cache as cache_mod
from router.policy import kv_aware

_tick = itertools.count()
STAMP: dict[Any, int] = {}  # cache node -> when it last became most recently used
CACHES: dict[str, Any] = {}  # simulated replica id -> its PrefixCache
MODE = ["hrw"]
CTX = [0]

_lru_add = cache_mod.PrefixCache._lru_add


def _stamped_add(self: Any, node: Any) -> None:
    STAMP[node] = next(_tick)
    _lru_add(self, node)


def _stamped_touch(self: Any, hashes: Any) -> Any:
    path = self._walk(hashes if isinstance(hashes, list) else list(hashes))
    for node, _ in reversed(path):
        lru = self._host_lru if node.host else self._lru
        if node in lru:
            lru.move_to_end(node)
            STAMP[node] = next(_tick)
    return self._count(path)


cache_mod.PrefixCache._lru_add = _stamped_add  # type: ignore[method-assign]
cache_mod.PrefixCache.touch = _stamped_touch  # type: ignore[method-assign]

_make = replica_model.SimReplica.make.__func__  # type: ignore[attr-defined]


def _registered_make(cls: Any, *args: Any, **kwargs: Any) -> Any:
    rep = _make(cls, *args, **kwargs)
    CACHES[rep.spec.id] = rep.engine.cache
    return rep


replica_model.SimReplica.make = classmethod(_registered_make)  # type: ignore[assignment]


def victim_weight(rid: str) -> int:
    """Higher is a better place for a new context: free room first, then the oldest victim."""
    c = CACHES[rid]
    if c.free_tokens >= CTX[0]:
        return 10**15 + c.free_tokens
    if c.host_capacity_tokens and c.host_capacity_tokens - c.host_used_tokens >= CTX[0]:
        return 10**14  # demoted to the host tier, not lost
    lru = c._host_lru if c.host_capacity_tokens else c._lru
    front = next(iter(lru), None)
    return -STAMP.get(front, 0) if front is not None else 10**13


_hrw = kv_aware.hrw_weight


def tie_weight(key: str, rid: str) -> int:
    return victim_weight(rid) if MODE[0].startswith("lru") else _hrw(key, rid)


kv_aware.hrw_weight = tie_weight  # type: ignore[assignment]
_place = kv_aware.KvAwarePolicy._place


def _place_ctx(self: Any, *a: Any, **kw: Any) -> Any:
    CTX[0] = kw["ctx"]
    return _place(self, *a, **kw)


kv_aware.KvAwarePolicy._place = _place_ctx  # type: ignore[method-assign]
_scores = kv_aware.load_scores


def _wide_scores(*a: Any, **kw: Any) -> Any:
    """``lruW``: candidates within W of the best score tie (then the oracle picks among them)."""
    scores = _scores(*a, **kw)
    w = float(MODE[0][3:] or 0) if MODE[0].startswith("lru") else 0.0
    if w <= 0 or not scores:
        return scores
    best = min(scores)
    return [best if x <= best + w else x for x in scores]


kv_aware.load_scores = _wide_scores  # type: ignore[assignment]
KEEP = (
    "chr",
    "pooled_chr",
    "routing_loss",
    "ttft_p99_s",
    "e2e_p99_s",
    "requests",
    "dispersion",
    "dispersion_floor",
)


def main(argv: list[str]) -> int:
    if argv[0] == "ab":
        from loadtests.parity import WORKLOADS, run_sim_for
        from loadtests.scenario import demo_scenario

        w, seeds = argv[1], [int(x) for x in argv[2].split(",")]
        base, _, hc = w.partition("+")
        scenario = {**WORKLOADS[base], "host_tier": hc == "hc" or WORKLOADS[base]["host_tier"]}
        for seed, var in itertools.product(seeds, argv[3:]):
            MODE[0] = var
            STAMP.clear()
            CACHES.clear()
            m = run_sim_for(demo_scenario(**scenario, kv_events=True, seed=seed))
            row = {
                "w": w,
                "seed": seed,
                "mode": var,
                "spills": (m.get("route_reasons") or {}).get("queue_spill", 0),
            }
            print(json.dumps(row | {k: m.get(k) for k in KEEP}), flush=True)
        return 0
    from loadtests.sim import cli

    MODE[0] = argv[1]
    return cli.cli_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

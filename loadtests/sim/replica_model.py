"""One simulated replica: the emulator's pure engine + cache, plus what the fleet needs to know.

The engine (``replica.emulator.timemodel.ReplicaEngine``) is event driven: ``submit``/``abort``
change its state at a time, ``next_event_time`` says when it next has something to report, and
``advance`` returns the events up to a time. ``SimReplica`` remembers the time of its one pending
wake-up so that the event loop never holds more than one live wake-up per replica (older ones
are recognised as stale and dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.emulator.cache import CacheListener, PrefixCache
from replica.emulator.profiles import Profile
from replica.emulator.timemodel import EngineEvent, EngineRequest, ReplicaEngine
from router.model import EngineLoad, ReplicaSpec, ReplicaStatus

__all__ = ["SimReplica"]


@dataclass(slots=True)
class SimReplica:
    index: int
    spec: ReplicaSpec
    engine: ReplicaEngine
    status: ReplicaStatus = ReplicaStatus.JOINING
    in_flight: int = 0  # requests submitted and not finished (what sampling measures)
    dead: bool = False  # failed: refuses connections (the gateway learns it at detection)
    by_scaleup: bool = False  # joined after the initial fleet
    wake_at: float | None = None  # time of the live wake-up event, if any
    removed: bool = False
    requests: set[str] = field(default_factory=set)

    @classmethod
    def make(
        cls,
        index: int,
        profile: Profile,
        *,
        by_scaleup: bool = False,
        rid: str | None = None,
        listener: CacheListener | None = None,
    ) -> SimReplica:
        rid = rid or f"r{index:03d}"
        cache = PrefixCache(
            profile.capacity_tokens,
            profile.page_size,
            profile.host_tokens,
            evict_whole_nodes=profile.evict_whole_nodes,  # as the emulator's and SGLang's radix cache
            listener=listener,
        )
        spec = ReplicaSpec(
            id=rid,
            url=f"sim://{rid}",
            model="",  # as a statically configured replica: the gateway learns no model name
            capacity_tokens=profile.capacity_tokens,
            host_capacity_tokens=profile.host_tokens,
            tp_size=profile.tp_size,
            source="static" if not by_scaleup else "registry",
        )
        return cls(index=index, spec=spec, engine=ReplicaEngine(profile, cache), by_scaleup=by_scaleup)

    @property
    def id(self) -> str:
        return self.spec.id

    def submit(self, req: EngineRequest, now: float) -> None:
        self.engine.submit(req, now)
        self.requests.add(req.rid)
        self.in_flight += 1

    def done(self, rid: str) -> None:
        if rid in self.requests:
            self.requests.discard(rid)
            self.in_flight -= 1
            self.engine.forget(rid)

    def advance(self, now: float) -> list[EngineEvent]:
        return self.engine.advance(now)

    def next_event_time(self) -> float | None:
        return self.engine.next_event_time()

    def engine_load(self, now: float) -> EngineLoad:
        """What a scrape of ``/metrics`` would report (the store's ``EngineLoad``): the figures of
        ``ReplicaEngine.load`` it needs, read directly (``load`` also sums the queue and the batch)."""
        eng, cache = self.engine, self.engine.cache
        return EngineLoad(
            running=eng.running,
            queued=eng.queued,
            kv_util=eng.token_usage,
            capacity_tokens=cache.capacity_tokens,
            host_used_tokens=cache.host_used_tokens,
            host_capacity_tokens=cache.host_capacity_tokens,
            cache_hit_rate=eng.cache_hit_rate,
            gen_throughput=eng.gen_throughput,
            waiting_uncached_tokens=eng.pending_prefill_tokens,
            updated_at=now,
        )

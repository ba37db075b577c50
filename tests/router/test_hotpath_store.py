"""``MemoryCore``'s read-path caches (cached ``ReplicaState``s, patched sorted view, running active
count and fleet totals, pruning from fleet-wide time order) give exactly what rebuilding and
pruning everything on every call gives.

``NaiveCore`` is the pre-cache algorithm (full pruning pass + fresh views from the raw state on every
read); both cores get the same random operation sequence on the same virtual clock (short windows,
so entries expire all the time) and every read is compared.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.clock import VirtualClock
from router.errors import ReplicaNotFoundError
from router.model import (
    BindSession,
    ClusterSnapshot,
    Completion,
    EngineLoad,
    Lease,
    Reason,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SetOverflow,
    fleet_totals,
)
from router.store.base import StoreConfig
from router.store.memory import MemoryCore

CFG = StoreConfig(session_ttl_s=20.0, active_window_s=5.0, ramp_window_s=2.0)


class NaiveCore(MemoryCore):
    """Reads computed from scratch, as before the caches: prune every replica, rebuild every view."""

    def _naive_prune(self, now: float) -> None:
        horizon = now - self.config.session_ttl_s
        while self._sessions:
            sid, s = next(iter(self._sessions.items()))
            if s.last_seen >= horizon or any(s.in_flight.values()):
                break
            self._sessions.popitem(last=False)
            if s.home is not None and (rep := self._replicas.get(s.home)) is not None:
                old = rep.active.pop(sid, None)
                if old is not None:
                    rep.active_context -= old[1]
        active_horizon = now - self.config.active_window_s
        ramp_horizon = now - self.config.ramp_window_s
        for rep in self._replicas.values():
            while rep.active:
                sid, (seen, ctx) = next(iter(rep.active.items()))
                if seen >= active_horizon:
                    break
                rep.active.popitem(last=False)
                rep.active_context -= ctx
            while rep.placements and rep.placements[0] < ramp_horizon:
                rep.placements.popleft()

    def _fresh(self) -> tuple[ReplicaState, ...]:
        return tuple(self._build_state(self._replicas[k]) for k in sorted(self._replicas))

    def replicas(self) -> tuple[ReplicaState, ...]:
        self._naive_prune(self.clock.now())
        return self._fresh()

    def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self.clock.now()
        self._naive_prune(now)
        replicas = self._fresh()
        return ClusterSnapshot(
            now=now,
            replicas=replicas,
            session=self.session(session_key) if session_key else None,
            seq=self._seq,
            sessions_active=sum(len(r.active) for r in self._replicas.values()),
            serving_since=self._serving_since,
            totals=fleet_totals(replicas),
            positions={r.id: i for i, r in enumerate(replicas)},
        )


def _run(seed: int, steps: int) -> int:
    rng = random.Random(seed)
    clock = VirtualClock(100.0)
    fast, slow = MemoryCore(clock, CFG), NaiveCore(clock, CFG)
    cores = (fast, slow)
    ids = [f"r{i}" for i in range(6)]
    sids = [f"s{i}" for i in range(25)]
    held: list[tuple[Lease, Lease]] = []
    reads = 0

    def both(fn: str, *args: object) -> tuple[object, object]:
        out = []
        for c in cores:
            try:
                out.append(getattr(c, fn)(*args))
            except ReplicaNotFoundError as exc:
                out.append(("ReplicaNotFoundError", str(exc)))
        return out[0], out[1]

    for rid in ids[:3]:
        both("upsert_replica", ReplicaSpec(id=rid, url=f"http://{rid}"), ReplicaStatus.ACTIVE)
    for _ in range(steps):
        op = rng.random()
        if op < 0.15:
            clock.advance(rng.choice((0.0, 0.001, 0.3, 1.0, 1.999, 2.0, 2.5, 4.9, 5.0, 7.0, 21.0)))
        elif op < 0.2:
            rid = rng.choice(ids)
            spec = ReplicaSpec(id=rid, url=f"http://{rid}", capacity_tokens=rng.choice((0, 1000, 5000)))
            both("upsert_replica", spec, rng.choice((None, *ReplicaStatus)))
        elif op < 0.24:
            both("set_status", rng.choice(ids), rng.choice(list(ReplicaStatus)))
        elif op < 0.26:
            both("remove_replica", rng.choice(ids))
        elif op < 0.3:
            load = EngineLoad(
                running=rng.randint(0, 9), kv_util=rng.random(), capacity_tokens=rng.choice((0, 9000))
            )
            both("report_engine_load", rng.choice(ids), load)
        elif op < 0.6:
            sid = rng.choice(sids) if rng.random() < 0.9 else None
            target = rng.choice(ids)
            effects: list[BindSession | SetOverflow] = []
            if sid is not None and rng.random() < 0.6:
                cur = fast.session(sid)
                only_if = cur.home if cur is not None and rng.random() < 0.8 else rng.choice((None, *ids))
                effects.append(BindSession(sid, target, only_if, rng.choice(list(Reason))))
            if sid is not None and rng.random() < 0.15:
                effects.append(SetOverflow(sid, tuple(rng.sample(ids, rng.randint(0, 3)))))
            decision = RouteDecision(
                replica_id=target, reason=rng.choice(list(Reason)), effects=tuple(effects)
            )
            a, b = both("acquire", decision, RouteRequest(session_key=sid))
            assert (isinstance(a, tuple), a if isinstance(a, tuple) else None) == (
                isinstance(b, tuple),
                b if isinstance(b, tuple) else None,
            )
            if isinstance(a, Lease) and isinstance(b, Lease):
                assert a == b
                held.append((a, b))
        elif op < 0.8 and held:
            la, lb = held.pop(rng.randrange(len(held)))
            ok = rng.random() < 0.8
            prompt = rng.choice((None, rng.randint(0, 4000)))
            comp = Completion(
                ok=ok,
                prompt_tokens=prompt,
                cached_tokens=rng.choice((None, rng.randint(0, 3000))),
                completion_tokens=rng.choice((None, rng.randint(0, 300))),
            )
            fast.release(la, comp)
            slow.release(lb, comp)
        else:
            key = rng.choice((None, *sids))
            a, b = both("snapshot", key)
            assert a == b
            reads += 1
        if rng.random() < 0.2:
            a, b = both("replicas")
            assert a == b
            rid = rng.choice(ids)
            assert fast.sessions_on(rid) == slow.sessions_on(rid)
            assert fast.leases() == slow.leases()
            sid = rng.choice(sids)
            got = fast.session(sid)
            assert fast.session_home(sid) == (got.home if got is not None else None)
            reads += 1
    return reads


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_cached_reads_equal_fresh_reads(seed: int) -> None:
    assert _run(seed, 400) > 0


def test_long_sequence_equal() -> None:
    assert _run(12345, 6000) > 500


def test_snapshot_reuses_unchanged_replica_views() -> None:
    clock = VirtualClock(0.0)
    core = MemoryCore(clock, CFG)
    for rid in ("a", "b", "c"):
        core.upsert_replica(ReplicaSpec(id=rid, url=f"http://{rid}"), ReplicaStatus.ACTIVE)
    s1 = core.snapshot(None)
    s2 = core.snapshot(None)
    assert s1.replicas is s2.replicas  # nothing changed: the same tuple
    lease = core.acquire(RouteDecision(replica_id="b", reason=Reason.RANDOM), RouteRequest(session_key=None))
    s3 = core.snapshot(None)
    assert s3.replicas is not s2.replicas
    assert s3.replicas[0] is s2.replicas[0] and s3.replicas[2] is s2.replicas[2]  # untouched: reused
    assert s3.replicas[1].in_flight == 1
    core.release(lease, Completion(ok=True))
    assert core.snapshot(None).replicas[1].in_flight == 0


def test_lazy_prune_still_expires_on_time() -> None:
    clock = VirtualClock(0.0)
    core = MemoryCore(clock, CFG)
    core.upsert_replica(ReplicaSpec(id="a", url="http://a"), ReplicaStatus.ACTIVE)
    bind = BindSession("s", "a", None, Reason.PLACED_NEW)
    lease = core.acquire(
        RouteDecision(replica_id="a", reason=Reason.PLACED_NEW, effects=(bind,)),
        RouteRequest(session_key="s"),
    )
    core.release(lease, Completion(ok=True, prompt_tokens=100))
    snap = core.snapshot(None)
    assert (snap.sessions_active, snap.replicas[0].placed_recent) == (1, 1)
    clock.set(2.0)  # exactly at the ramp window: still counted (strictly older is dropped)
    assert core.snapshot(None).replicas[0].placed_recent == 1
    clock.set(2.0001)
    snap = core.snapshot(None)
    assert (snap.replicas[0].placed_recent, snap.sessions_active) == (0, 1)
    clock.set(5.0001)
    snap = core.snapshot(None)
    assert (
        snap.sessions_active,
        snap.replicas[0].sessions_active,
        snap.replicas[0].active_context_tokens,
    ) == (
        0,
        0,
        0,
    )

"""Functional: real processes on 127.0.0.1 — emulated SGLang replicas (``kvroute emulate``), replica
sidecars (``kvroute sidecar``), a real redis-server, and the gateway (in this process, real sockets,
``RedisStore``) under closed-loop coding-agent load.

- a sidecar registers its emulated engine in Redis and heartbeats its load; SIGTERM deregisters it;
- SIGTERM drains a replica under load with no request lost;
- a replica killed under load is ejected and its sessions re-placed; only requests that were
  mid-stream on it fail, each with an SSE error event;
- scaling 8 -> 10 under load moves no existing session, and the new replicas fill up within the ramp.

Every load loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from loadtests.procs import Procs as _Procs
from router.clock import SystemClock
from router.model import ReplicaState, ReplicaStatus
from router.store.base import StoreConfig

pytestmark = pytest.mark.slow

PY = sys.executable
MODEL = "moonshotai/Kimi-K2.6"
REPLICA_TTL_S = 2.0


# ---- processes -------------------------------------------------------------------------------------


class Procs(_Procs):
    """``kvroute`` subcommands this test started; each is stopped (by its own pid) at teardown."""

    def start(self, args: list[str], stderr_pipe: bool = True) -> subprocess.Popen[bytes]:
        return super().start([PY, "-m", "router.cli", *args], stderr_pipe=True)


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        ps.cleanup()


async def _readline(p: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    assert p.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), timeout_s)
    if not line:
        err = p.stderr.read().decode() if p.stderr is not None and p.poll() is not None else ""
        raise AssertionError(f"process {p.args} ended without output: {err[-2000:]}")
    return line.decode().strip()


async def start_emulators(
    procs: Procs, n: int, *, time_scale: float = 1.0
) -> tuple[subprocess.Popen[bytes], list[str]]:
    p = procs.start(["emulate", "--replicas", str(n), "--base-port", "0", "--time-scale", str(time_scale)])
    urls = [await _readline(p) for _ in range(n)]
    assert all(u.startswith("http://127.0.0.1:") for u in urls), urls
    return p, urls


async def start_sidecar(
    procs: Procs, engine_url: str, redis_url: str, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    p = procs.start(
        [
            "sidecar",
            "--engine-url",
            engine_url,
            "--redis",
            redis_url,
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            "0",
            "--heartbeat-interval",
            "0.2",
            "--replica-ttl",
            str(REPLICA_TTL_S),
            "--health-interval",
            "0.5",
            "--drain-grace",
            "0.3",
            "--drain-timeout",
            "30",
            *extra,
        ]
    )
    doc = json.loads(await _readline(p))
    assert doc["event"] == "listening"
    return p, f"http://127.0.0.1:{doc['port']}"


async def _wait_exit(p: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while p.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{p.args[:4]} did not exit within {timeout_s}s")
        await asyncio.sleep(0.05)
    return p.returncode


async def _until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        res = pred()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _rid(url: str) -> str:
    return url.removeprefix("http://")


# ---- redis-backed store and gateway ----------------------------------------------------------------


@pytest.fixture
async def reader(redis_url: str) -> AsyncIterator[Any]:
    from router.store.redis import RedisStore

    store = RedisStore.from_url(
        redis_url, gateway_id="test-reader", config=StoreConfig(replica_ttl_s=REPLICA_TTL_S)
    )
    yield store
    await asyncio.wait_for(store.close(), 30)


async def _replicas(store: Any) -> dict[str, ReplicaState]:
    return {r.id: r for r in await store.replicas()}


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Any]:
    from router.config import load_config
    from router.gateway.serve import start_gateway

    cfg = load_config(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--redis",
            redis_url,
            "--seed",
            "7",
            "--set",
            "health.health_interval_s=0.2",
            "--set",
            "health.scrape_interval_s=0.2",
            "--set",
            f"store.replica_ttl_s={REPLICA_TTL_S}",
            "--set",
            "timeouts.first_byte_s=30",
            "--set",
            "timeouts.idle_read_s=10",
        ],
        {},
    )
    gw = await start_gateway(cfg)
    yield gw
    await asyncio.wait_for(gw.close(), 60)


# ---- closed-loop coding-agent client ---------------------------------------------------------------


@dataclass
class Turn:
    sid: str
    turn: int
    started: float
    replica: str | None = None
    reason: str | None = None
    status: int = 0
    committed: float | None = None  # the gateway's status line and headers arrived
    first_byte: float | None = None
    ended: float | None = None
    done: bool = False  # saw data: [DONE]
    error_event: bool = False  # saw an SSE error event
    error: str | None = None  # client-side exception

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error_event and self.error is None


@dataclass
class Load:
    gateway_url: str
    turns: list[Turn] = field(default_factory=list)
    mid_stream: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))  # replica -> turn ids
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    started_sessions: int = 0

    async def one_turn(
        self, http: aiohttp.ClientSession, sid: str, t: int, messages: list[dict[str, str]]
    ) -> Turn:
        rec = Turn(sid, t, time.monotonic())
        self.turns.append(rec)
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 96,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        key = id(rec)
        try:
            async with http.post(
                self.gateway_url + "/v1/chat/completions",
                json=body,
                headers={"Modal-Session-Id": sid},
                timeout=aiohttp.ClientTimeout(total=60),
            ) as r:
                rec.status = r.status
                rec.replica = r.headers.get("X-Kvroute-Replica")
                rec.reason = r.headers.get("X-Kvroute-Reason")
                rec.committed = time.monotonic()
                if rec.replica:
                    self.mid_stream[rec.replica].add(key)
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if rec.first_byte is None:
                        rec.first_byte = time.monotonic()
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        rec.done = True
                    elif b'"error"' in data and json.loads(data).get("error"):
                        rec.error_event = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.ended = time.monotonic()
            if rec.replica:
                self.mid_stream[rec.replica].discard(key)
        return rec

    async def session(self, http: aiohttp.ClientSession, sid: str, turns: int, think_s: float) -> None:
        words = " ".join(f"{sid}-w{i}" for i in range(600))  # a distinct ~2.4k-token system prompt
        messages = [{"role": "system", "content": f"You are a coding agent. {words}"}]
        for t in range(turns):
            if self.stop.is_set():
                return
            messages.append({"role": "user", "content": f"turn {t}: run the tests for {sid}"})
            rec = await self.one_turn(http, sid, t, messages)
            messages.append({"role": "assistant", "content": f"ok {t} ({rec.status})"})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), think_s)

    async def churn(
        self, http: aiohttp.ClientSession, concurrency: int, turns: int, think_s: float, prefix: str
    ) -> None:
        """Keep ``concurrency`` sessions running; a finished session is replaced by a new one."""

        async def lane(lane_id: int) -> None:
            # staggered starts and lengths (turns .. turns+3): session generations do not line up
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.15 * lane_id)
            k = 0
            while not self.stop.is_set():
                self.started_sessions += 1
                await self.session(http, f"{prefix}-{lane_id}-{k}", turns + (lane_id + k) % 4, think_s)
                k += 1

        await asyncio.gather(*(lane(i) for i in range(concurrency)))


def _homes(turns: list[Turn], before: float | None = None) -> dict[str, str]:
    """Each session's replica on its last turn started before ``before``."""
    out: dict[str, str] = {}
    for t in sorted(turns, key=lambda x: x.started):
        if (before is None or t.started < before) and t.replica and t.ok:
            out[t.sid] = t.replica
    return out


# ---- tests -----------------------------------------------------------------------------------------


async def test_sidecar_registers_heartbeats_and_deregisters_on_sigterm(
    procs: Procs, redis_url: str, reader: Any
) -> None:
    _, (url,) = await start_emulators(procs, 1)
    info = Procs(env={"KVROUTE_LOG_LEVEL": "info"})  # its ``registered`` line is checked at the end
    try:
        await _sidecar_lifecycle(info, url, redis_url, reader)
    finally:
        info.cleanup()


async def _sidecar_lifecycle(procs: Procs, url: str, redis_url: str, reader: Any) -> None:
    sidecar, probe = await start_sidecar(procs, url, redis_url)
    rid = _rid(url)

    async def registered() -> bool:
        r = (await _replicas(reader)).get(rid)
        return r is not None and r.engine.updated_at > 0

    await _until(registered, 20, "registration with load")
    rep = (await _replicas(reader))[rid]
    assert rep.url == url and rep.model == MODEL and rep.status is ReplicaStatus.JOINING
    assert rep.capacity_tokens == 850_000 and rep.host_capacity_tokens == 1_700_000  # from the emulator
    async with aiohttp.ClientSession() as http:
        async with http.get(probe + "/readyz") as r:
            assert r.status == 200
        async with http.get(probe + "/status") as r:
            st = await r.json()
            assert st["spec"]["tp_size"] == 4 and st["phase"] == "registered"
        first = st["heartbeats_ok"]
        # heartbeats keep the entry alive past several TTLs and keep refreshing the load
        await asyncio.sleep(REPLICA_TTL_S * 1.5)
        async with http.get(probe + "/status") as r:
            assert (await r.json())["heartbeats_ok"] >= first + 5
        assert rid in await _replicas(reader)
        # running requests show up in the heartbeated load
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 4000}], "max_tokens": 400,
                "ignore_eos": True}  # fmt: skip
        req = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body))

        async def running() -> bool:
            r = (await _replicas(reader)).get(rid)
            return r is not None and r.engine.running >= 1

        await _until(running, 10, "running request in heartbeated load")
        (await req).release()
    sidecar.send_signal(signal.SIGTERM)
    assert await _wait_exit(sidecar, 20) == 0
    assert rid not in await _replicas(reader)
    # its log names the capacities it registered: token counts are not secrets, not [REDACTED]
    assert sidecar.stderr is not None
    lines = [json.loads(x) for x in sidecar.stderr.read().decode().splitlines() if x.startswith("{")]
    regs = [x for x in lines if x.get("msg") == "registered"]
    assert len(regs) == 1, lines
    reg = regs[0]
    assert reg["spec"]["capacity_tokens"] == 850_000 and reg["spec"]["host_capacity_tokens"] == 1_700_000, reg


async def test_sigterm_drains_a_replica_under_load_without_losing_a_request(
    procs: Procs, redis_url: str, reader: Any, gateway: Any
) -> None:
    emus = [await start_emulators(procs, 1) for _ in range(3)]
    urls = [u for _, (u,) in emus]
    sidecars = [await start_sidecar(procs, u, redis_url) for u in urls]

    async def all_active() -> bool:
        reps = await _replicas(reader)
        return len(reps) == 3 and all(r.status is ReplicaStatus.ACTIVE for r in reps.values())

    await _until(all_active, 30, "3 active replicas")
    load = Load(gateway.url)
    victim = _rid(urls[0])
    async with aiohttp.ClientSession() as http:
        runner = asyncio.ensure_future(load.churn(http, concurrency=9, turns=12, think_s=0.15, prefix="d"))
        await _until(
            lambda: len(load.mid_stream[victim]) >= 1 and len(load.turns) >= 20, 30, "load on the victim"
        )
        sigterm_at = time.monotonic()
        sidecars[0][0].send_signal(signal.SIGTERM)  # pod deletion: the sidecar drains first
        rc = await _wait_exit(sidecars[0][0], 30)
        drained_at = time.monotonic()
        # ... then the engine stops (Kubernetes sends SIGTERM once the preStop drain returned)
        emus[0][0].send_signal(signal.SIGTERM)
        await _wait_exit(emus[0][0], 15)
        await asyncio.sleep(1.5)  # keep the load running on the survivors
        load.stop.set()
        await asyncio.wait_for(runner, 60)
    assert rc == 0
    turns = load.turns
    failed = [t for t in turns if not t.ok]
    assert not failed, f"{len(failed)} requests failed: {failed[:3]}"
    on_victim = [t for t in turns if t.replica == victim]
    assert on_victim, "the victim served requests before the drain"
    # every request the victim took finished before the sidecar let the engine go
    assert max(t.ended for t in on_victim if t.ended) <= drained_at  # type: ignore[type-var]
    # nothing new reached it once draining was visible (Redis: immediate; allow one heartbeat)
    late = [t for t in on_victim if t.started > sigterm_at + 0.5]
    assert not late, f"{len(late)} requests routed to a draining replica"
    # its sessions moved at their next turn
    homed = {sid for sid, rep in _homes(turns, before=sigterm_at).items() if rep == victim}
    moved = [t for t in turns if t.sid in homed and t.started > sigterm_at + 0.5]
    assert moved and all(t.replica != victim for t in moved)
    assert victim not in await _replicas(reader)


async def test_killed_replica_is_ejected_and_only_mid_stream_requests_fail(
    procs: Procs, redis_url: str, reader: Any, gateway: Any
) -> None:
    emus = [await start_emulators(procs, 1) for _ in range(3)]
    urls = [u for _, (u,) in emus]
    for u in urls:
        await start_sidecar(procs, u, redis_url, "--unhealthy-after", "2")

    async def all_active() -> bool:
        reps = await _replicas(reader)
        return len(reps) == 3 and all(r.status is ReplicaStatus.ACTIVE for r in reps.values())

    await _until(all_active, 30, "3 active replicas")
    load = Load(gateway.url)
    victim = _rid(urls[0])
    async with aiohttp.ClientSession() as http:
        runner = asyncio.ensure_future(load.churn(http, concurrency=9, turns=12, think_s=0.15, prefix="k"))
        await _until(
            lambda: len(load.mid_stream[victim]) >= 2 and len(load.turns) >= 20, 30, "streams on the victim"
        )
        mid_stream_at_kill = len(load.mid_stream[victim])
        killed_at = time.monotonic()
        emus[0][0].send_signal(signal.SIGKILL)  # the engine dies; its sidecar stays up
        await _wait_exit(emus[0][0], 10)
        dead_at = time.monotonic()

        async def ejected() -> bool:
            r = (await _replicas(reader)).get(victim)
            return r is None or r.status is ReplicaStatus.DOWN

        await _until(ejected, 15, "victim ejected")
        await asyncio.sleep(2.0)
        load.stop.set()
        await asyncio.wait_for(runner, 60)
    turns = load.turns
    failed = [t for t in turns if not t.ok]
    # only requests that were mid-stream on the dead replica may fail, and each ends with an error event
    print(
        f"\nkill: {len(failed)} failed of {len(turns)}, {mid_stream_at_kill} mid-stream on the victim at kill"
    )
    # "mid-stream at the kill" is not the count taken just before the signal: the load goes on until
    # the engine is seen dead, so a stream that the victim began in between may fail too (with its
    # error event). What may fail is exactly what was streaming from the victim when it died.
    streaming = {
        id(t)
        for t in turns
        if t.replica == victim
        and t.committed is not None
        and t.committed <= dead_at
        and t.ended is not None
        and t.ended >= killed_at
    }
    assert len(streaming) >= mid_stream_at_kill >= 2
    assert all(id(t) in streaming for t in failed), (failed, mid_stream_at_kill)
    assert all(t.status == 200 and t.error_event for t in failed), failed
    # requests that started after the kill all succeeded elsewhere (failover before the first byte)
    after = [t for t in turns if t.started > killed_at + 0.05]
    assert after and all(t.ok and t.replica != victim for t in after)
    # the victim's sessions were re-placed
    homed = {sid for sid, rep in _homes(turns, before=killed_at).items() if rep == victim}
    replaced = [t for t in after if t.sid in homed]
    assert replaced, "the victim's sessions came back"
    # the sidecar withdrew the dead engine from the registry (its deep checks fail)
    await _until(lambda: _absent(reader, victim), 15, "withdrawal by the sidecar")


async def _absent(store: Any, rid: str) -> bool:
    return rid not in await _replicas(store)


async def test_scale_up_8_to_10_moves_no_session_and_new_replicas_fill_within_the_ramp(
    procs: Procs, redis_url: str, reader: Any, gateway: Any
) -> None:
    from replica.agent import Agent, StoreRegistrar
    from replica.config import AgentConfig, validate
    from replica.probe import EngineProbe
    from router.store.redis import RedisStore

    _, urls = await start_emulators(procs, 10)
    old, new = urls[:8], urls[8:]
    agents: list[tuple[Agent, asyncio.Task[int], Any]] = []
    async with aiohttp.ClientSession() as http:
        # the first eight replicas: the sidecar logic in this process (8 more interpreters would
        # starve a 2-core runner); the two that join under load are real `kvroute sidecar` processes
        for u in old:
            cfg = validate(AgentConfig(engine_url=u, redis_url=redis_url, heartbeat_interval_s=0.2,
                                       replica_ttl_s=REPLICA_TTL_S, health_interval_s=0.5,
                                       drain_grace_s=0.2, drain_timeout_s=5.0))  # fmt: skip
            store = RedisStore.from_url(
                redis_url, gateway_id=f"sc-{_rid(u)}", config=StoreConfig(replica_ttl_s=REPLICA_TTL_S)
            )
            agent = Agent(cfg, StoreRegistrar(store), EngineProbe(http, u), SystemClock())
            agents.append((agent, asyncio.ensure_future(agent.run()), store))

        async def active(n: int) -> bool:
            reps = await _replicas(reader)
            return sum(r.status is ReplicaStatus.ACTIVE for r in reps.values()) == n

        await _until(lambda: active(8), 30, "8 active replicas")
        load = Load(gateway.url)
        runner = asyncio.ensure_future(load.churn(http, concurrency=20, turns=5, think_s=0.3, prefix="s"))
        in_flight: dict[str, list[int]] = defaultdict(list)
        try:
            await asyncio.sleep(4.0)  # steady state on 8
            scale_at = time.monotonic()
            for u in new:
                await start_sidecar(procs, u, redis_url)
            await _until(lambda: active(10), 20, "10 active replicas")
            active_at = time.monotonic()
            await asyncio.sleep(4.0)  # the ramp (store ramp_window_s = 10 s caps the new replicas' share)
            sample_until = time.monotonic() + 4.0
            while time.monotonic() < sample_until:  # per-replica in-flight at the end of the ramp
                for rid, rep in (await _replicas(reader)).items():
                    in_flight[rid].append(rep.in_flight)
                await asyncio.sleep(0.1)
            load.stop.set()
            await asyncio.wait_for(runner, 60)
        finally:
            load.stop.set()
            for agent, _, _ in agents:
                agent.request_drain()
            await asyncio.wait([task for _, task, _ in agents], timeout=15)
            for _, _, store in agents:
                await asyncio.wait_for(store.close(), 10)
    turns = load.turns
    assert len(turns) >= 100
    failed = [t for t in turns if not t.ok]
    assert not failed, failed[:3]
    new_ids = {_rid(u) for u in new}
    # no existing session moved because replicas joined. A session that had to move anyway (its
    # cache gone: placed_evicted) may land on a new replica like anywhere else (round 29), and a move
    # by rule 5 (home persistently overloaded, reassigned_overload) is load-driven and allowed, but
    # must stay rare.
    before = _homes(turns, before=scale_at)
    spanning = {t.sid for t in turns if t.started > scale_at and t.sid in before}
    assert len(spanning) >= 8, "the check needs sessions that were running when replicas joined"
    first_move: dict[str, Turn] = {}  # a session's first turn away from its pre-scale-up home
    for t in sorted(turns, key=lambda x: x.started):
        if t.sid in spanning and t.started > scale_at and t.replica != before[t.sid]:
            first_move.setdefault(t.sid, t)
    by_scaleup = {sid for sid, t in first_move.items() if t.reason not in ("reassigned_overload", "placed_evicted")}
    by_overload = {sid for sid, t in first_move.items() if t.reason == "reassigned_overload"}
    assert not by_scaleup, [first_move[sid] for sid in by_scaleup][:3]
    assert len(by_overload) <= max(2, len(spanning) // 5), by_overload
    # the new replicas take new sessions, each of them some, and not more than a flood
    first_turns = [t for t in turns if t.turn == 0 and t.started > active_at]
    placed = Counter(t.replica for t in first_turns)
    fair = len(first_turns) / 10
    assert all(placed[r] >= 1 for r in new_ids), (sorted(new_ids), placed, fair)
    assert all(placed[r] <= 3 * fair + 2 for r in new_ids), (sorted(new_ids), placed, fair)
    # and at the end of the ramp they carry load comparable to the others
    mean_if = {rid: sum(v) / len(v) for rid, v in in_flight.items() if v}
    fleet_mean = sum(mean_if.values()) / len(mean_if)
    print(
        f"\nscale-up: {len(turns)} turns, {len(spanning)} sessions spanning the scale-up, "
        f"{len(by_scaleup)} moved by the scale-up, {len(by_overload)} by overload; new {sorted(new_ids)}; "
        f"new sessions placed {dict(placed)} (fair {fair:.1f}); mean in-flight at the end of the ramp "
        f"{ {k: round(v, 2) for k, v in mean_if.items()} } (fleet {fleet_mean:.2f})"
    )
    assert all(mean_if.get(r, 0.0) >= 0.3 * fleet_mean for r in new_ids), (mean_if, fleet_mean)


async def test_discovery_combines_static_registry_and_admin_sources(
    procs: Procs, redis_url: str, reader: Any
) -> None:
    """One gateway, three replicas from three sources: a static ``--replica``, one registered in Redis
    by ``kvroute sidecar --redis``, one registered through the admin API by ``kvroute sidecar
    --gateway``. All become active and take sessions; the admin-registered one drains via its sidecar."""
    from router.config import load_config
    from router.gateway.serve import start_gateway
    from router.observability.surface import operator_surface_from_config

    _, (static_url, registry_url, admin_url) = await start_emulators(procs, 3)
    cfg = load_config(
        ["--host", "127.0.0.1", "--port", "0", "--redis", redis_url, "--replica", static_url, "--seed", "1",
         "--set", "health.health_interval_s=0.2", "--set", f"store.replica_ttl_s={REPLICA_TTL_S}",
         "--set", "admin_token=sekret"],
        {},
    )  # fmt: skip
    surface = operator_surface_from_config(cfg)
    gw = await start_gateway(cfg, extra_setup=(surface.setup,))
    try:
        await start_sidecar(procs, registry_url, redis_url)
        admin_sidecar = procs.start(
            ["sidecar", "--engine-url", admin_url, "--gateway", gw.url, "--admin-token", "sekret",
             "--listen-host", "127.0.0.1", "--listen-port", "0", "--heartbeat-interval", "0.2",
             "--health-interval", "0.5", "--drain-grace", "0.3"]
        )  # fmt: skip
        assert json.loads(await _readline(admin_sidecar))["event"] == "listening"

        async def three_active() -> bool:
            reps = await _replicas(reader)
            return len(reps) == 3 and all(r.status is ReplicaStatus.ACTIVE for r in reps.values())

        await _until(three_active, 30, "three active replicas from three sources")
        load = Load(gw.url)
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(load.session(http, f"src-{i}", 2, 0.05) for i in range(12)))
            served = Counter(t.replica for t in load.turns if t.ok)
            assert set(served) == {_rid(u) for u in (static_url, registry_url, admin_url)}, served
            assert all(t.ok for t in load.turns)
            # the admin-registered replica leaves through its sidecar (admin API drain + delete)
            admin_sidecar.send_signal(signal.SIGTERM)
            assert await _wait_exit(admin_sidecar, 20) == 0
            assert _rid(admin_url) not in await _replicas(reader)
            load2 = Load(gw.url)
            await asyncio.gather(*(load2.session(http, f"src-{i}", 1, 0.0) for i in range(12)))
            assert all(t.ok and t.replica != _rid(admin_url) for t in load2.turns)
    finally:
        await asyncio.wait_for(gw.close(), 60)

"""``kvroute bench restart``: what a gateway on embedded state loses when it restarts, and what the
engines' KV events win back.

A gateway on embedded state (no Redis) forgets every session's home when it restarts; its replicas
keep their caches. With KV events the new gateway replays what each engine holds and sends each
session's next turn to its cache (``placed_resident``, docs/POLICY.md); without them it places each
one as new, by load. For each arm, all on 127.0.0.1:

- ``--replicas`` ``kvroute emulate`` processes (small-test profile, fast clock) publishing SGLang's KV
  events, with room for every session's cache (so a miss is placement, not eviction);
- one ``kvroute serve`` on embedded state on a fixed port. The arm says how it routes: ``events``
  (kv_aware on the engines' events), ``estimate`` (kv_aware, ``kv_events.mode=off``), ``hash``;
  ``redis`` is ``events`` with the gateway's state in Redis instead (what a restart keeps);
- the fault campaign's closed-loop sessions (``loadtests.faults.Load``: growing histories, SSE streams
  with usage).

After a warm-up and a ``before`` phase the gateway gets SIGTERM and a new one starts on the same port
while the load runs on (a client that finds no listener counts a clean error and goes on after its
think time). Reported per arm: CHR before and after the restart and, for each session that ran
before the restart, its *first turn after it*: whether it went back to the replica of its last turn,
its CHR, and the new gateway's route reason; requests lost (must be 0). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtests.bench import emit_json
from loadtests.faults import ADMIN_TOKEN, Load, Outcomes, start_emulator, start_gateway_proc
from loadtests.procs import Procs, free_port
from loadtests.scenario import KV_EVENTS_CONFIG

__all__ = ["ARMS", "HANDOVERS", "FirstTurns", "cli_main", "run_restart"]

ARMS: dict[str, tuple[str, ...]] = {
    "events": (),
    "estimate": ("--set", "kv_events.mode=off"),
    "hash": ("--policy", "hash"),
    "redis": (),
}
"""The gateway's flags per arm; every arm runs on the same fleet, which publishes KV events. ``redis``:
kv_aware on the events with its state in a fresh ``redis-server`` (not embedded): the reference, a
restart that forgets nothing."""

HANDOVERS = ("stop-start", "reuse-port")
"""How the new gateway takes the port: after the old one has exited, or (``--reuse-port``, both
gateways) beside it, the old one then draining."""


@dataclass
class FirstTurns:
    """Each session's last replica before the restart, and its first turn after it."""

    armed: bool = False  # set once the new gateway listens
    last: dict[str, str] = field(default_factory=dict)  # session -> replica of its last turn before
    seen: set[str] = field(default_factory=set)
    back_home: int = 0
    moved: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def __call__(self, sid: str, replica: str, reason: str, prompt: int, cached: int) -> None:
        if not self.armed:
            self.last[sid] = replica
            return
        if sid in self.seen or sid not in self.last:  # a later turn, or a session begun after the restart
            return
        self.seen.add(sid)
        if replica == self.last[sid]:
            self.back_home += 1
        else:
            self.moved += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.reasons[reason or "none"] += 1

    def report(self) -> dict[str, Any]:
        n = self.back_home + self.moved
        return {
            "sessions": n,
            "back_home": self.back_home,
            "back_home_frac": round(self.back_home / n, 4) if n else None,
            "chr": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
            "reasons": dict(self.reasons.most_common()),
        }


def _totals(phases: Sequence[Outcomes]) -> dict[str, Any]:
    errors: Counter[str] = Counter()
    for o in phases:
        errors.update(o.errors)
    return {
        "completed": sum(o.completed for o in phases),
        "clean_errors": sum(o.clean_error for o in phases),
        "lost": sum(o.lost for o in phases),
        "error_kinds": dict(errors),
    }


async def _residency_sources(s: aiohttp.ClientSession, gw: str) -> dict[str, Any]:
    """The new gateway's replicas by residency source (``events``: its mirror is complete), and its
    subscribers' counters summed (``GET /admin/kv-events``)."""
    async with s.get(gw + "/admin/kv-events", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
        r.raise_for_status()
        kv = await r.json()
    ranks = [rank for sub in kv.get("subscribers", {}).values() for rank in sub["ranks"]]
    counters = ("syncs", "rebuilds", "replay_failures", "replay_resumes", "gaps", "gaps_unrecovered", "restarts", "disconnects")
    return {
        "sources": dict(Counter(str(v["source"]) for v in kv.get("replicas", {}).values())),
        "subscribers": {c: sum(int(rk[c]) for rk in ranks) for c in counters} if ranks else {},
    }


async def run_arm(
    arm: str,
    *,
    replicas: int,
    clients: int,
    phase_s: float,
    time_scale: float,
    seed: int,
    replay_batches: int | None = None,
    handover: str = "stop-start",
    client_timeout_s: float = 20.0,
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """One arm: a fleet, a gateway, warm-up, ``before``, the restart, ``after``. Bounded: about
    ``3 * phase_s`` plus the processes' start and the client timeout. ``replay_batches``: the
    engines' replay buffer (SGLang's ``buffer_steps``; None: its default, 10,000). ``handover``
    (``HANDOVERS``): how the new gateway takes over the port."""
    procs = Procs({"KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN})
    redis = None
    if arm == "redis":
        from loadtests.redis_server import RedisServer

        redis = RedisServer().start()
    kv = json.loads(KV_EVENTS_CONFIG) | ({} if replay_batches is None else {"buffer_steps": replay_batches})
    # room for every client's session (about 1,200 tokens) on any replica: a miss is placement
    room = ["--set", f"kv_capacity_tokens={max(8192, 2 * 1200 * clients)}", "--kv-events-config", json.dumps(kv)]
    try:
        emus = await asyncio.gather(*(start_emulator(procs, time_scale, room) for _ in range(replicas)))
        urls = [u for _, u in emus]
        port = free_port()
        gw_args = (*ARMS[arm], *(["--reuse-port"] if handover == "reuse-port" else []))
        redis_url = None if redis is None else redis.url
        old, gw = await start_gateway_proc(procs, urls, redis_url, f"{arm}-1", gw_args, port=port)
        first = FirstTurns()
        load = Load([gw], clients, seed, client_timeout_s, observe=first)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await asyncio.sleep(1.0)  # first health rounds
            task = asyncio.ensure_future(load.run(s))
            await asyncio.sleep(phase_s)  # warm-up: sessions get homes and caches
            warm = load.new_phase()
            await asyncio.sleep(phase_s)
            before = load.new_phase()
            log(f"{arm}: restarting the gateway")
            t0 = time.monotonic()
            if handover == "reuse-port":  # the new one listens beside the old, then the old drains
                _new, gw2 = await start_gateway_proc(procs, urls, redis_url, f"{arm}-2", gw_args, port=port)
                listening_s = time.monotonic() - t0
                old.send_signal(signal.SIGTERM)
                await asyncio.to_thread(old.wait, 30)
            else:
                old.send_signal(signal.SIGTERM)
                await asyncio.to_thread(old.wait, 30)  # its requests end before it exits (graceful shutdown)
                _new, gw2 = await start_gateway_proc(procs, urls, redis_url, f"{arm}-2", gw_args, port=port)
                listening_s = time.monotonic() - t0
            first.armed = True  # from here every completed request started at the new gateway
            handover_s = time.monotonic() - t0
            assert gw2 == gw, (gw2, gw)
            load.dead.clear()
            await asyncio.sleep(phase_s)
            after = load.new_phase()
            sources = await _residency_sources(s, gw)
            load.stop.set()
            await asyncio.wait_for(task, client_timeout_s + 5)
            late = load.new_phase()
    finally:
        procs.cleanup()
        if redis is not None:
            redis.cleanup()
    return {
        "arm": arm,
        "gateway_args": list(gw_args),
        "chr_before": before.chr(),
        "chr_after": after.chr(),
        "first_turn_after_restart": first.report(),
        "handover": handover,
        "restart_to_listening_s": round(listening_s, 2),
        "restart_to_old_gone_and_new_listening_s": round(handover_s, 2),
        "residency_sources_after": sources,
        **_totals((warm, before, after, late)),
    }


async def run_restart(
    arms: Sequence[str] = tuple(ARMS),
    *,
    replicas: int = 4,
    clients: int = 16,
    phase_s: float = 6.0,
    time_scale: float = 0.05,
    seed: int = 1,
    replay_batches: int | None = None,
    handover: str = "stop-start",
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    rows = []
    for arm in arms:
        rows.append(await run_arm(arm, replicas=replicas, clients=clients, phase_s=phase_s, time_scale=time_scale,
                                  seed=seed, replay_batches=replay_batches, handover=handover, log=log))  # fmt: skip
    return {
        "bench": "restart",
        "replicas": replicas,
        "clients": clients,
        "phase_s": phase_s,
        "time_scale": time_scale,
        "seed": seed,
        "replay_batches": replay_batches,
        "handover": handover,
        "arms": rows,
        "total_lost": sum(r["lost"] for r in rows),
    }


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench restart", description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of: {', '.join(ARMS)}")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--phase-s", type=float, default=6.0, help="wall seconds of warm-up, of before and of after")
    p.add_argument("--time-scale", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--replay-batches", type=int, default=None, metavar="N",
        help="the engines keep only their last N batches of KV events (SGLang's buffer_steps, default 10,000): "
        "an engine that has served a while, whose history a restarted gateway cannot replay from the start",
    )  # fmt: skip
    p.add_argument("--handover", choices=HANDOVERS, default="stop-start",
                   help="stop the old gateway, then start the new one; or start the new one beside it "
                   "(both --reuse-port) and then stop the old one")  # fmt: skip
    p.add_argument("--output", metavar="PATH", help="also write the JSON here")
    a = p.parse_args(argv)
    arms = tuple(x.strip() for x in a.arms.split(",") if x.strip())
    bad = [x for x in arms if x not in ARMS]
    if (bad or not arms or a.replicas < 2 or a.clients < 1 or a.phase_s <= 0 or a.time_scale <= 0
            or (a.replay_batches is not None and a.replay_batches < 1)):
        print(f"kvroute bench restart: bad arguments (unknown arms {bad}; need replicas >= 2, clients >= 1, "
              "phase-s > 0, time-scale > 0)", file=sys.stderr)  # fmt: skip
        return 2
    out = asyncio.run(run_restart(arms, replicas=a.replicas, clients=a.clients, phase_s=a.phase_s,
                                  time_scale=a.time_scale, seed=a.seed, replay_batches=a.replay_batches,
                                  handover=a.handover,
                                  log=lambda m: print(m, file=sys.stderr, flush=True)))  # fmt: skip
    emit_json(out, a.output)
    return 0 if out["total_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))

"""The simulator and the live gateway feed the policy the same inputs (STYLE §6, issue: one input path).

One small trace runs through both drivers: the live gateway (``start_gateway``, embedded store)
in front of emulated replicas over real sockets, driven by the live load driver; and the simulator
with the same replicas (same ids, same profile), the same sessions and lanes. Requests never
overlap (one lane, think times between turns), so every request's inputs are determined by the
trace. A recording wrapper around the real ``kv_aware`` policy keeps each ``(RouteRequest,
ClusterSnapshot, RouteDecision)``; the two sequences must agree field by field (token counts within
the template's few tokens: the live prompt is the rendered chat, the simulated one the trace's
size), and the decisions must be the same. A field that one driver fills and the other leaves at its
default, or fills by another rule, fails the test.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from loadtests.live import DEFAULT_SESSION_HEADERS, LoadConfig, run_load
from loadtests.scenario import prefix_keys
from loadtests.sim.run import SimConfig, run_sim
from loadtests.workloads import SessionSpec, Turn, turn_inputs
from replica.emulator.profiles import get_profile
from replica.emulator.runner import start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.clock import SystemClock
from router.gateway.serve import start_gateway
from router.model import ClusterSnapshot, KeySource, RouteDecision, RouteRequest
from router.policy import Policy, make_policy
from router.policy.params import PolicyParams
from router.store.memory import MemoryStore
from tests.router.conftest import fast_config

PROFILE = get_profile("kimi-k2.6-b200-tp4").with_overrides(
    kv_capacity_tokens=40_000, host_capacity_tokens=0, page_size=16, context_length=16_384
)
TIME_SCALE = 0.01


class RecordingPolicy:
    """The real policy, with every call's inputs and output kept."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[RouteRequest, ClusterSnapshot, RouteDecision]] = []

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        decision = self.inner.route(request, snapshot, rng)
        self.calls.append((request, snapshot, decision))
        return decision


def _sessions() -> list[SessionSpec]:
    def turns(n: int, parallel_at: int = -1) -> tuple[Turn, ...]:
        return tuple(
            Turn(new_tokens=600 + 100 * k, output_tokens=24, think_s=0.0 if k == 0 else 5.0,
                 parallel=2 if k == parallel_at else 1)
            for k in range(n)
        )

    return [
        # two identical requests at once on turn 2: the second sees the first in flight, so both
        # drivers name its conversation (RouteRequest.chain_key) and the store records where it ran
        SessionSpec("p0", 0.0, shared_prefix_tokens=400, turns=turns(4, parallel_at=2)),
        SessionSpec("p1", 0.0, shared_prefix_tokens=400, turns=turns(3)),
        SessionSpec("p2", 0.0, shared_prefix_tokens=400, turns=turns(3)),
    ]


async def _live(specs: list[SessionSpec], session_ids: bool = True) -> tuple[RecordingPolicy, list[str]]:
    reps = await start_emulators(2, config=EmulatorConfig(profile=PROFILE, time_scale=TIME_SCALE))
    try:
        urls = [r.url for r in reps]
        # the gateway's windows in modelled time, as the benches set them (loadtests.demo.kvroute_env)
        cfg = fast_config(urls, store={"active_window_s": 60 * TIME_SCALE, "ramp_window_s": 10 * TIME_SCALE})
        clock = SystemClock()
        policy = RecordingPolicy(make_policy("kv_aware"))
        gw = await start_gateway(
            cfg, MemoryStore(clock, cfg.store.to_store_config()), policy=policy, clock=clock
        )
        try:
            load = LoadConfig(url=gw.url, replica_urls=tuple(urls), time_scale=TIME_SCALE, token_unit=1,
                              duration_s=30.0, warmup_s=0.0, drain_s=5.0, lanes=1, stream=True,
                              session_headers=DEFAULT_SESSION_HEADERS if session_ids else ())  # fmt: skip
            await run_load(specs, load)
        finally:
            await gw.close()
        ids = sorted({r.id for _, snap, _ in policy.calls for r in snap.replicas})
        return policy, ids
    finally:
        await stop_emulators(reps)


def _sim(specs: list[SessionSpec], ids: list[str], session_ids: bool = True) -> RecordingPolicy:
    policy = RecordingPolicy(make_policy("kv_aware"))
    cfg = SimConfig(
        replicas=len(ids), profile=PROFILE, lanes=1, striped_lanes=True, duration_s=1000.0, scrape_interval_s=5.0,
        turn_framing_tokens=12, replica_ids=tuple(ids), seed=7, session_ids=session_ids,
        conversation_key=None if session_ids else prefix_keys(1, PolicyParams()),
    )  # fmt: skip
    run_sim(specs, cfg, policy=policy)
    return policy


def _close(a: float, b: float, rel: float = 0.1, absolute: float = 64) -> bool:
    """Token counts: the live prompt is the rendered chat (a few dozen template tokens more)."""
    return abs(a - b) <= absolute + rel * max(abs(a), abs(b))


TOKEN_FIELDS = {
    "tokens_written",
    "active_context_tokens",
    "context_tokens",
    "residency_mark",
}
CLOCK_FIELDS = {"now", "joined_at", "last_seen", "updated_at", "serving_since"}  # each driver's own clock
# the engine's figures as of the last scrape, and who scraped them (live: a gateway's discovery)
POLLED_FIELDS = {"running", "queued", "kv_util", "cache_hit_rate", "gen_throughput", "host_used_tokens", "reported_by"}


class KeyMatch:
    """Conversation keys are the drivers' own names (the gateway hashes the prompt's anchor, the
    simulator names the trace's conversation): what must agree is which requests share one, so each
    live key must always meet the same simulated key and no two live keys the same one."""

    def __init__(self) -> None:
        self.to_sim: dict[str, str] = {}
        self.to_live: dict[str, str] = {}

    def same(self, live: str | None, sim: str | None) -> bool:
        if live is None or sim is None:
            return live is sim
        return self.to_sim.setdefault(live, sim) == sim and self.to_live.setdefault(sim, live) == live


KEYS = KeyMatch()


def _diff(path: str, live: Any, sim: Any) -> Iterator[str]:
    """Every field where the two drivers filled a value differently."""
    if dataclasses.is_dataclass(live) and not isinstance(live, type):
        assert type(live) is type(sim), path
        for f in dataclasses.fields(live):
            yield from _diff(f"{path}.{f.name}", getattr(live, f.name), getattr(sim, f.name))
        return
    if isinstance(live, tuple) and live and dataclasses.is_dataclass(live[0]):
        if len(live) != len(sim):
            yield f"{path}: {len(live)} vs {len(sim)} entries"
            return
        for i, (a, b) in enumerate(zip(live, sim, strict=True)):
            yield from _diff(f"{path}[{i}]", a, b)
        return
    name = path.rsplit(".", 1)[-1]
    if name in CLOCK_FIELDS:
        if (live is None) != (sim is None):
            yield f"{path}: set {live!r} vs {sim!r}"
    elif name in POLLED_FIELDS:
        return  # the engine's figures as of the last scrape: when that was differs by driver
    elif name in TOKEN_FIELDS or name in {"prompt_tokens_estimate", "body_bytes"}:
        rel = 0.25 if name == "body_bytes" else 0.1
        if not _close(float(live), float(sim), rel=rel):
            yield f"{path}: {live!r} vs {sim!r}"
    elif name == "bytes_per_token":
        if (
            (live > 0) != (sim > 0)
            or (live > 0 and not 3.0 <= live / 1.0 <= 6.0)
            or (sim > 0 and not 3.0 <= sim <= 6.0)
        ):
            yield f"{path}: {live!r} vs {sim!r}"
    elif name == "chain_key":
        if not KEYS.same(live, sim):
            yield f"{path}: {live!r} vs {sim!r} (keys so far {KEYS.to_sim})"
    elif name == "chains":
        if len(live) != len(sim) or any(
            lr != sr or not KEYS.same(lk, sk) for (lk, lr), (sk, sr) in zip(live, sim, strict=False)
        ):
            yield f"{path}: {live!r} vs {sim!r}"
    elif name == "prefill_ahead":  # replica -> uncached tokens of the requests without a first token
        if live.keys() != sim.keys() or any(not _close(float(live[r]), float(sim[r])) for r in live):
            yield f"{path}: {live!r} vs {sim!r}"
    elif name == "url":
        return  # sim://... vs http://...
    elif name == "scores":
        return  # derived from the rest (compared through the decision)
    elif live != sim:
        yield f"{path}: {live!r} vs {sim!r}"


@pytest.mark.parametrize("session_ids", [True, False], ids=["session-id", "no-session-id"])
async def test_the_simulator_and_the_gateway_fill_the_policys_inputs_alike(session_ids: bool) -> None:
    """With session ids, and without: then the gateway keys every request by its conversation's
    prompt (rule 7) and the simulator must name it by the same key."""
    KEYS.__init__()
    specs = _sessions()
    live, ids = await _live(specs, session_ids)
    sim = _sim(specs, ids, session_ids)
    n_requests = sum(t.parallel for s in specs for t in s.turns)
    # one lane: the sessions in order, a parallel turn's requests one after another
    prompts = [n for spec in specs for n, t in zip(turn_inputs(spec), spec.turns, strict=True) for _ in range(t.parallel)]
    assert len(live.calls) == len(sim.calls) == n_requests
    problems: list[str] = []
    for i, ((lreq, lsnap, ldec), (sreq, ssnap, sdec)) in enumerate(zip(live.calls, sim.calls, strict=True)):
        problems += _diff(f"#{i}.request", lreq, sreq)
        problems += _diff(f"#{i}.snapshot", lsnap, ssnap)
        # once a session's own bytes per token are learned, both estimates are the prompt's size
        # (the live prompt carries a few dozen template tokens more)
        if lsnap.session is not None and lsnap.session.bytes_per_token > 0:
            for who, est in (("live", lreq.prompt_tokens_estimate), ("sim", sreq.prompt_tokens_estimate)):
                if not _close(est, prompts[i], rel=0.02, absolute=48):
                    problems.append(f"#{i}.request.prompt_tokens_estimate ({who}): {est} for {prompts[i]} tokens")
        problems += _diff(f"#{i}.decision", ldec, sdec)  # replica, reason, effects (session keys mapped)
    assert not problems, "\n".join(problems)
    # the trace exercised what it should: placements, affinity, learned contexts and ratios
    reasons = {d.reason.value for _, _, d in live.calls}
    assert {"placed_new", "affinity"} <= reasons
    last = live.calls[-1][1].session
    assert last is not None and last.context_tokens > 0 and last.bytes_per_token > 0
    # the parallel turn's requests overlap: each later one sees the earlier ones' prefill ahead
    assert any(snap.prefill_ahead for _, snap, _ in live.calls)
    sources = {req.key_source for req, _, _ in live.calls}
    assert sources == {KeySource.HEADER if session_ids else KeySource.PREFIX}
    if session_ids:
        named = [(req.chain_key, snap.session) for req, snap, _ in live.calls if req.chain_key is not None]
        assert named, "no request named its conversation: the chain inputs were not compared"
        assert any(s is not None and s.chains for _, snap, _ in live.calls for s in [snap.session])
    else:  # the simulator names each conversation with the gateway's own key (compared above)
        assert len({req.session_key for req, _, _ in live.calls}) == len(specs)


def test_identical_inputs_give_identical_decisions() -> None:
    """The policy is a pure function: a recorded call replayed gives the same decision."""
    specs = _sessions()
    rec = _sim(specs, ["a:1", "b:2"])
    fresh = make_policy("kv_aware")
    for req, snap, decision in rec.calls:
        assert fresh.route(req, snap, random.Random(7)) == decision


def test_the_live_prompts_are_the_workloads_and_share_what_the_simulator_shares() -> None:
    """The simulator's model of a live bench run (``sim_config``) takes the workload's prompt sizes and
    names the first ``shared_prefix_tokens`` of every conversation alike. The live driver renders chat
    text in the emulator's tokens (``token_unit`` model tokens each): every turn must be as long as the
    workload says (to one emulated token) unless its own part is smaller than the id and the template,
    and two conversations must share exactly their shared prefix, as the simulator's names do (before
    round 28 they shared ~1,600 model tokens more and live hit rates were inflated)."""
    from loadtests.ideal import InfiniteCache
    from loadtests.live import rendered_turns
    from loadtests.parity import WORKLOADS
    from loadtests.scenario import demo_scenario, sim_config
    from loadtests.sim.prompts import ChainNamer

    scenario = demo_scenario(seed=1, **WORKLOADS["synthetic"])
    unit = scenario.token_unit
    cfg, specs = sim_config(scenario)
    page_model = cfg.profile.page_size
    live_cache = InfiniteCache(page_model // unit)
    chains = [c for s in specs[:40] for c in s.walk()]
    assert any(c.parent is not None for c in chains)  # sub-agents too
    floored = turns = 0
    first_blocks: dict[int, list[list[int]]] = {}  # shared prefix size -> first turns' live blocks
    for chain in chains:
        sizes = turn_inputs(chain)
        for k, (conv, _) in enumerate(rendered_turns(chain, unit)):
            live = conv.prompt_tokens * unit
            turns += 1
            if sizes[k] - chain.shared_prefix_tokens < 2_500:
                floored += live > sizes[k] + unit
                assert live <= chain.shared_prefix_tokens + 2_500 + unit
            else:
                assert abs(live - sizes[k]) <= unit, (chain.session_id, k, live, sizes[k])
            if k == 0:
                blocks, _ = live_cache.blocks(conv.messages, conv.key)
                first_blocks.setdefault(chain.shared_prefix_tokens, []).append(blocks)
    assert floored <= 0.02 * turns
    for shared, firsts in first_blocks.items():
        # the simulator: the first shared // page names of every chain of this shared size are alike
        namers = [ChainNamer(c, i, i, page_model) for i, c in enumerate(ch for ch in chains if ch.shared_prefix_tokens == shared)]
        sim_common = min(len(os.path.commonprefix([namers[0].names(0), n.names(0)])) for n in namers[1:])
        live_common = min(len(os.path.commonprefix([firsts[0], b])) for b in firsts[1:])
        assert sim_common == shared // page_model
        assert live_common == sim_common, (shared, live_common, sim_common)

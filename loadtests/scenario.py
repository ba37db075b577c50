"""One comparable live run, and the simulator's models of it.

:class:`DemoScenario` is everything that defines a run of ``kvroute demo`` and ``kvroute bench peers``
(fleet, workload, seed, durations, scaling; why the defaults: ``loadtests/demo.py``). Two models of
the same run in the fleet simulator live beside it, so that ``demo`` reports the ceiling without
importing ``parity`` (which runs ``demo``'s live side):

  * :func:`sim_config`: the simulator's model of one live run of kvroute (``kvroute bench parity``
    holds it to the live gateway; ``loadtests/parity.py`` says how it matches the live fleet);
  * :func:`ceiling`: the same sessions on a fleet without contention (``loadtests.sim.ceiling``),
    the closed loop's own limit that ``demo`` and ``bench peers`` report.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadtests.live import DEFAULT_SESSION_HEADERS, LoadConfig
from loadtests.sim.ceiling import run_ceiling
from loadtests.sim.run import SimConfig
from loadtests.textgen import BYTES_PER_TOKEN, conversation_prefix_key
from loadtests.workloads import SessionSpec
from replica.emulator.profiles import Profile, get_profile, parse_overrides
from replica.emulator.tokenizer import encode_text, render_chat
from router.policy.params import PolicyParams
from router.store.redis import GATEWAY_REPLICA_REFRESH_S, REFRESH_ENV

__all__ = [
    "KV_EVENTS_CONFIG", "DemoScenario", "ceiling", "demo_scenario", "framing_tokens", "prefix_keys", "sim_config",
]

KV_EVENTS_CONFIG = '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
"""SGLang's ``--kv-events-config`` for emulated replicas: a publisher and a replay socket on free ports
(``/server_info.kv_events`` says which)."""



@dataclass(frozen=True, slots=True)
class DemoScenario:
    """Everything that defines one comparable run (shared by ``kvroute demo`` and ``bench peers``)."""

    replicas: int = 8
    duration_s: float = 60.0  # wall seconds of load per policy
    sessions: int = 75  # live sessions at any time (lanes); each lane runs fresh sessions back to back
    session_pool_factor: int = 4  # sessions generated per lane
    time_scale: float = 0.1  # wall = modelled x time_scale
    token_unit: int = 100  # model tokens per emulated token
    profile: str = "kimi-k2.6-b200-tp4"
    page_size: int = 4  # emulated tokens per cache page (= 400 model tokens at token_unit 100)
    seed: int = 7
    warmup_frac: float = 0.25  # fraction of the duration excluded from measures
    start_spread_frac: float = 0.15  # sessions start over this fraction of the run (modelled)
    drain_s: float = 5.0
    sample_interval_s: float = 0.25
    max_think_modelled_s: float = 60.0
    # think times: WEKA-like (in the real Claude Code trace a session is busy ~12 % of its wall time), so a
    # replica's bound sessions need more KV than it has while only a few of them are in flight
    tool_think_fraction: float = 0.85
    tool_think_median_s: float = 3.0
    human_think_median_s: float = 30.0
    # HiCache host tier off: HBM (0.85 M tokens) is the only KV tier, the regime in which routing
    # decides whether a replica's working set fits (with a 2x host tier reloads are cheap and every
    # sticky policy keeps its CHR; ``--hicache`` turns it on)
    host_tier: bool = False
    gateways: int = 1  # kvroute gateways; > 1 shares state in a fresh Redis
    gateway_assign: str = "round_robin"  # with several: per request, or "sticky" per session (a sidecar)
    # or "weka": the real Claude Code sessions, "mooncake": Mooncake's Kimi chat sessions (traces/)
    workload_kind: str = "synthetic"
    trace: str | None = None  # the trace file (default: the shared traces' WEKA or Mooncake conversation file)
    extra_emulator_args: tuple[str, ...] = ()
    # FIELD=VALUE profile fields of the emulated engines (``kvroute emulate --set``), e.g.
    # schedule_policy=lpm; the simulator's model of the run takes the same (``sim_config``)
    engine_set: tuple[str, ...] = ()
    # the replicas publish SGLang's KV events (free ports); kvroute subscribes and routes on exact
    # residency (docs/KV_EVENTS.md)
    kv_events: bool = False
    policy_params: tuple[str, ...] = ()  # KEY=VALUE, passed to kvroute serve --policy-param (after the scaled ones)
    # False: clients send no session header, as a plain OpenAI client; each router keys on the prompt
    # (kvroute: rule 7's prefix key, docs/POLICY.md). The measures still group by the driver's sessions.
    session_ids: bool = True
    api: str = "chat"  # the clients' API: chat completions, "messages" (Anthropic's, as Claude Code) or "responses"
    dp_size: int = 1  # data-parallel ranks per emulated replica (SGLang's --dp-size), each a profile's engine

    def emulator_args(self) -> list[str]:
        return [
            "--profile", self.profile,
            "--time-scale", str(self.time_scale),
            "--token-unit", str(self.token_unit),
            "--set", f"page_size={self.page_size}",
            *([] if self.host_tier else ["--host-capacity-tokens", "0"]),
            *(["--kv-events-config", self._kv_events_config()] if self.kv_events else []),
            *(["--dp-size", str(self.dp_size)] if self.dp_size > 1 else []),
            *[arg for kv in self.engine_set for arg in ("--set", kv)],
            *self.extra_emulator_args,
        ]

    def _kv_events_config(self) -> str:
        """Free ports: ``*`` for one rank; with ranks, rank r of replica i publishes on base + 2·dp·i + r
        and replays dp ports above (the emulator's layout), so a block of free ports is taken now."""
        if self.dp_size <= 1:
            return KV_EVENTS_CONFIG
        import json

        from loadtests.procs import free_port_block

        base = free_port_block(2 * self.dp_size * self.replicas)
        return json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}",
                           "replay_endpoint": f"tcp://127.0.0.1:{base + self.dp_size}"})  # fmt: skip

    def engine_overrides(self) -> dict[str, str]:
        """``engine_set`` as profile overrides, parsed as the emulator parses ``--set``."""
        return parse_overrides(self.engine_set)

    def replica_profile(self) -> Profile | None:
        """The emulated replicas' profile as ``emulator_args`` configures them (the time model
        behind ``ttft_floor_p99_s``); None when extra emulator flags may change it."""
        if self.extra_emulator_args:
            return None
        # the emulator's order: --set page_size, then the engine settings, then --token-unit
        return get_profile(self.profile).with_overrides(
            **{"page_size": self.page_size, **self.engine_overrides(), "token_unit": self.token_unit}
        )

    def kvroute_args(self) -> list[str]:
        """Gateway flags for this scenario. The gateway learns token counts from the replicas, which
        report *emulated* tokens, so the policy's absolute token parameters are divided by
        ``token_unit`` to keep their meaning; its durations (``*_s``) run on the wall clock while
        the fleet runs ``time_scale`` times faster, so they are multiplied by ``time_scale``."""
        import dataclasses

        from router.policy.params import PolicyParams

        out: list[str] = []
        defaults = PolicyParams()
        for f in dataclasses.fields(PolicyParams):
            value = getattr(defaults, f.name)
            if "tokens" in f.name and isinstance(value, int) and not isinstance(value, bool):
                out += ["--policy-param", f"{f.name}={max(1, value // self.token_unit)}"]
            elif f.name.endswith("_s") and isinstance(value, float):
                out += ["--policy-param", f"{f.name}={value * self.time_scale:g}"]
        for kv in self.policy_params:
            out += ["--policy-param", kv]
        return out

    def kvroute_env(self) -> dict[str, str]:
        """The gateway's own windows in modelled time (``KVROUTE_*`` settings, docs/CONFIG.md): which
        sessions count as active on their home and the ramp cap's window, how often replicas are
        scraped — a 1 s scrape against a fleet running 10x fast is 10 s stale — and, with several
        gateways, how often each re-reads the others' in-flight counts from Redis (the fast path's
        table; unscaled, a 10x fleet saw them 0.5 s old and placed new sessions on stale counts:
        docs/BENCHMARKS.md round 41). Safety TTLs (leases, sessions, replicas) and timeouts stay
        wall-clock."""
        from router.config import HealthConfig
        from router.store.base import StoreConfig

        store = StoreConfig()
        scrape_s = HealthConfig.model_fields["scrape_interval_s"].default
        ts = self.time_scale
        return {
            "KVROUTE_STORE__ACTIVE_WINDOW_S": f"{store.active_window_s * ts:g}",
            "KVROUTE_STORE__RAMP_WINDOW_S": f"{store.ramp_window_s * ts:g}",
            "KVROUTE_HEALTH__SCRAPE_INTERVAL_S": f"{max(0.05, scrape_s * ts):g}",
            REFRESH_ENV: f"{GATEWAY_REPLICA_REFRESH_S * ts:g}",
        }

    def check(self) -> None:
        """Raise ValueError (or OSError for an unreadable trace) on a setting that a run would
        otherwise trip over only after its fleet has started."""
        self.replica_profile()
        self.load_config("http://127.0.0.1:1", ())
        self.workload()  # a trace is read and checked (a fraction of a second); synthetic is lazy

    def load_config(self, url: str, replica_urls: Sequence[str], *, fresh: bool = False) -> LoadConfig:
        return LoadConfig(
            url=url,
            replica_urls=tuple(replica_urls),
            time_scale=self.time_scale,
            token_unit=self.token_unit,
            duration_s=self.duration_s,
            warmup_s=self.duration_s * self.warmup_frac,
            drain_s=self.drain_s,
            sample_interval_s=self.sample_interval_s,
            fresh_connections=fresh,
            max_think_modelled_s=self.max_think_modelled_s,
            lanes=self.sessions,
            gateway_assign=self.gateway_assign,
            page_size=self.page_size,
            session_headers=DEFAULT_SESSION_HEADERS if self.session_ids else (),
            api=self.api,
        )

    def workload(self) -> list[SessionSpec]:
        from loadtests import workloads as w

        modelled = self.duration_s / self.time_scale
        rng = random.Random(self.seed)
        if self.workload_kind == "weka":
            # real sessions (sub-agents as branches), spread over the start window; requests longer
            # than the emulated context window are dropped, the rest of their session kept (AgentX)
            path = Path(self.trace) if self.trace else w.DEFAULT_WEKA_TRACE
            specs = w.read_weka(path, limit=self.sessions * self.session_pool_factor)
            specs = w.drop_long_requests(specs, 250_000)
            rng.shuffle(specs)
            return w.with_arrivals(specs, rng, spread_s=modelled * self.start_spread_frac)
        if self.workload_kind == "mooncake":
            # real Kimi chat sessions (Mooncake's conversation trace, sessions inferred from their
            # shared blocks), in random order: most are one or two turns, so a lane runs many and
            # the whole trace is the pool; some open with a 50-126k-token prompt
            path = Path(self.trace) if self.trace else w.DEFAULT_MOONCAKE_TRACE
            specs = w.read_mooncake(path)
            rng.shuffle(specs)
            return w.with_arrivals(specs, rng, spread_s=modelled * self.start_spread_frac)
        if self.workload_kind != "synthetic":
            raise ValueError(f"unknown workload {self.workload_kind!r} (synthetic | weka | mooncake)")
        params = w.SyntheticParams(
            sessions=self.sessions * self.session_pool_factor,
            start_spread_s=modelled * self.start_spread_frac,
            tool_think_fraction=self.tool_think_fraction,
            tool_think_median_s=self.tool_think_median_s,
            human_think_median_s=self.human_think_median_s,
        )
        return w.synthetic_sessions(params, rng)


# a workload's own model tokens per emulated token, where the default does not render it as its trace
# says: Mooncake shares only its first 512-token block across sessions, and at 100 model tokens per
# emulated token the chat template's markers every prompt opens with (~18 emulated tokens) stood for
# ~1,800 shared model tokens, so the live driver's ideal hit rate was 0.04 above the simulator's
# (docs/SIMULATOR.md, "Mooncake's token unit")
WORKLOAD_TOKEN_UNITS: dict[str, int] = {"mooncake": 32}


def demo_scenario(**overrides: Any) -> DemoScenario:
    """A ``DemoScenario`` with the given fields (None = the default), and the workload's own token
    unit (``WORKLOAD_TOKEN_UNITS``) unless one is given."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if "token_unit" not in given:
        unit = WORKLOAD_TOKEN_UNITS.get(given.get("workload_kind", DemoScenario().workload_kind))
        if unit is not None:
            given["token_unit"] = unit
    return replace(DemoScenario(), **given)


# ---- the simulator's models of a run --------------------------------------------------------------


def _page(scenario: DemoScenario, specs: Sequence[SessionSpec]) -> int:
    """The live fleet's page in model tokens, rounded to a multiple of the traces' block size (the
    simulator names blocks by the trace's hash ids, so its pages must align with them)."""
    page = scenario.page_size * scenario.token_unit
    blocks = {c.block_size for s in specs for c in s.walk() if c.block_size}
    if not blocks:
        return page
    b = max(blocks)
    return max(b, round(page / b) * b)


def _cap_turn_think(specs: Sequence[SessionSpec], cap_s: float) -> list[SessionSpec]:
    """The live driver waits ``min(think_s, cap)`` before a chain's turns; a branch still starts at its
    own ``start_s`` (``loadtests.live._Run.chain``)."""

    def cap(s: SessionSpec) -> SessionSpec:
        turns = tuple(replace(t, think_s=min(t.think_s, cap_s)) if t.think_s > cap_s else t for t in s.turns)
        return replace(s, turns=turns, branches=tuple(cap(b) for b in s.branches))

    return [cap(s) for s in specs]


def framing_tokens(token_unit: int) -> int:
    """Model tokens of what ends a rendered prompt and is not reused by the next turn: the emulator's
    chat template closes the one user message and adds the generation prompt."""
    body = "abcd" * 64
    head = "<|im_user|>user<|im_middle|>"
    whole = encode_text(render_chat([{"role": "user", "content": body}])).num_tokens
    return (whole - len((head + body).encode()) // BYTES_PER_TOKEN) * token_unit


def sim_config(scenario: DemoScenario) -> tuple[SimConfig, list[SessionSpec]]:
    """The simulator's model of one live ``bench peers`` run of kvroute (module docstring)."""
    specs = _cap_turn_think(scenario.workload(), scenario.max_think_modelled_s)
    ts = scenario.time_scale
    # the engine settings the live replicas get (``--set``), in model tokens here as there
    profile = get_profile(scenario.profile).with_overrides(**scenario.engine_overrides())
    profile = profile.with_overrides(page_size=_page(scenario, specs))
    if not scenario.host_tier:
        profile = profile.with_overrides(host_capacity_tokens=0)
    params = PolicyParams()
    for kv in scenario.policy_params:
        key, _, value = kv.partition("=")
        params = params.with_changes(**{key.strip(): float(value)})
    modelled = scenario.duration_s / ts
    cfg = SimConfig(
        replicas=scenario.replicas,
        policy="kv_aware",
        policy_params=params,
        profile=profile,
        scrape_interval_s=max(0.05, 1.0 * ts) / ts,  # DemoScenario.kvroute_env: KVROUTE_HEALTH__SCRAPE_INTERVAL_S
        # several gateways share a Redis: each re-reads the replica table every
        # GATEWAY_REPLICA_REFRESH_S of modelled time (kvroute_env), a request goes to any of them
        gateways=scenario.gateways,
        state_lag_s=GATEWAY_REPLICA_REFRESH_S if scenario.gateways > 1 else 0.0,
        # the live driver's round robin is per request, as the model's random pick; sticky is by the
        # same hash of the session id
        gateway_assign="sticky" if scenario.gateway_assign == "sticky" else "random",
        sample_interval_s=scenario.sample_interval_s / ts,
        warmup_s=modelled * scenario.warmup_frac,
        duration_s=modelled,
        drain_s=scenario.drain_s / ts,
        lanes=scenario.sessions,
        striped_lanes=True,
        turn_framing_tokens=framing_tokens(scenario.token_unit),
        start_mid_session=False,
        seed=scenario.seed,
        kv_events=scenario.kv_events,
        session_ids=scenario.session_ids,
        conversation_key=None if scenario.session_ids else prefix_keys(scenario.token_unit, params),
    )
    return cfg, specs


def prefix_keys(token_unit: int, params: PolicyParams, model: str = "default") -> Callable[[SessionSpec, int], str]:
    """The gateway's key for a conversation without a session id, as the live driver renders it at
    ``token_unit`` for ``model`` (``LoadConfig.model``; ``SimConfig.conversation_key``)."""

    def key(spec: SessionSpec, start: int) -> str:
        return conversation_prefix_key(
            spec.session_id, start, int(spec.shared_prefix_tokens), token_unit=token_unit, model=model,
            block_chars=params.prefix_block_chars, blocks=params.prefix_blocks,
        )

    return key


def ceiling(scenario: DemoScenario) -> dict[str, Any] | None:
    """The scenario's no-contention ceiling (``loadtests.sim.ceiling.run_ceiling``); None when the live
    replicas' time model is unknown (extra emulator flags)."""
    if scenario.replica_profile() is None:
        return None
    cfg, specs = sim_config(scenario)
    return run_ceiling(specs, cfg)

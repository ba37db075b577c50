"""Coding-agent workloads: a synthetic session generator and trace readers (WEKA, Mooncake).

Shared by the discrete-event simulator (``loadtests/sim``) and the live load driver. Pure: no I/O
except the trace readers' file reads, no clock, randomness only from an injected ``random.Random``.

Rules:
  1. A workload is a ``list[SessionSpec]``. A session is closed-loop: turn ``k+1`` is sent
     ``turns[k+1].think_s`` seconds after the response to turn ``k`` completed.
  2. Context convention (the caller appends the previous *output*): the input of turn ``k`` is
         input_0 = shared_prefix_tokens + new_tokens_0
         input_k = input_{k-1} + output_{k-1} + new_tokens_k        (k >= 1)
         input_k = shared_prefix_tokens + new_tokens_k              (turn.reset: compaction / new context)
     unless ``turn.input_tokens > 0`` (trace replay), which gives the exact prompt size instead.
     ``turn_inputs(spec)`` applies this; use it rather than re-deriving.
  3. Thicc sessions are expressed as ``branches``: concurrent sub-agent chains that route with the
     *root* session id (``spec.routing_key``) but have their own context. A branch starts
     ``start_s`` seconds after the response to its parent's turn ``spawn_after_turn`` and runs on its
     own (no join: the real Claude Code trace shows parents continuing while sub-agents run).
     ``Turn.parallel > 1`` is the other form: that many identical requests sent at once (side calls
     forked from the same context); the turn completes when all have, the context continues from one.
  4. Prefix-hash information: ``Turn.hash_runs`` carries a trace's block hash ids run-length encoded
     (``[(start, n), ...]`` expands to ``start, start+1, ..., start+n-1``), block size
     ``spec.block_size`` and scope ``spec.hash_scope`` ("session": ids local to the routing key,
     "global": ids shared by the whole trace). Empty ``hash_runs`` means "synthesize": the context is
     append-only, so a consumer derives per-session chained ids from ``turn_inputs`` (the first
     ``shared_prefix_tokens`` are identical across sessions).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

__all__ = [
    "DEFAULT_MOONCAKE_TRACE",
    "DEFAULT_WEKA_TRACE",
    "SessionSpec",
    "SyntheticParams",
    "SyntheticSessions",
    "Turn",
    "conversation_starts",
    "drop_long_requests",
    "expand_runs",
    "iter_requests",
    "read_mooncake",
    "read_weka",
    "runs_of",
    "sticky_gateway",
    "synthetic_sessions",
    "traces_dir",
    "turn_inputs",
    "turn_overlaps",
    "with_arrivals",
    "workload_stats",
]

def traces_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the public traces live: ``$KVROUTE_TRACES``, else ``shared/traces`` beside the checkout
    (the project's layout), else ``/work/shared/traces``. They are read in place, never copied."""
    env = os.environ if environ is None else environ
    if env.get("KVROUTE_TRACES"):
        return Path(env["KVROUTE_TRACES"])
    beside = Path(__file__).resolve().parents[2] / "shared" / "traces"
    return beside if beside.is_dir() else Path("/work/shared/traces")


DEFAULT_WEKA_TRACE = traces_dir() / "weka_cc_kvtester_requests.jsonl"
DEFAULT_MOONCAKE_TRACE = traces_dir() / "mooncake_conversation_trace.jsonl"

HashRuns = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session (see the module docstring for the context convention).

    Attributes:
        new_tokens: tokens appended to the context before this request, *excluding* the previous
            turn's output (the caller appends that itself).
        output_tokens: tokens the model generates (send as ``max_tokens`` with ``ignore_eos``).
        think_s: delay between the previous response's end and this request (0 for turn 0 of a
            session: the session's ``start_s`` applies instead).
        parallel: number of identical requests sent at once for this turn (side calls).
        input_tokens: exact prompt size when known (trace replay); 0 = derive from the convention.
        reset: the context is replaced before this turn (compaction): input = shared prefix + new.
        hash_runs: the trace's block hash ids, run-length encoded; () = synthesize.
    """

    new_tokens: int
    output_tokens: int
    think_s: float
    parallel: int = 1
    input_tokens: int = 0
    reset: bool = False
    hash_runs: HashRuns = ()


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """One coding-agent session (or one sub-agent branch of one).

    Attributes:
        session_id: unique name of this chain (branches: ``"<root>/<agent>"``).
        start_s: top-level: absolute start time of turn 0 (seconds from the run's start);
            branch: delay after the response to the parent's turn ``spawn_after_turn``.
        shared_prefix_tokens: system prompt + tool definitions, identical across sessions.
        turns: the requests, in order.
        branches: concurrent sub-agent chains (thicc); they route with the root session id.
        parent: the parent's ``session_id`` for a branch, else ``None``.
        spawn_after_turn: branch only: index of the parent turn whose response spawns it.
        block_size: tokens per hash block of ``Turn.hash_runs`` (0: no trace hashes).
        hash_scope: "session" (ids local to the routing key) or "global" (shared by the trace).
        source: "synthetic" | "weka" | "mooncake".
    """

    session_id: str
    start_s: float
    shared_prefix_tokens: int
    turns: tuple[Turn, ...]
    branches: tuple[SessionSpec, ...] = ()
    parent: str | None = None
    spawn_after_turn: int = 0
    block_size: int = 0
    hash_scope: str = "session"
    source: str = "synthetic"

    @property
    def routing_key(self) -> str:
        """The value sent as the session header: the root session's id (branches share it)."""
        if self.parent is None:
            return self.session_id
        return self.session_id.split("/", 1)[0]

    def walk(self) -> Iterator[SessionSpec]:
        """This chain and all its branches, depth first."""
        yield self
        for b in self.branches:
            yield from b.walk()

    @property
    def n_requests(self) -> int:
        return sum(t.parallel for s in self.walk() for t in s.turns)


def turn_inputs(spec: SessionSpec) -> tuple[int, ...]:
    """Prompt tokens of every turn of ``spec`` (not its branches), per the context convention."""
    out: list[int] = []
    prev_in = 0
    prev_out = 0
    for k, t in enumerate(spec.turns):
        if t.input_tokens > 0:
            cur = t.input_tokens
        elif k == 0 or t.reset:
            cur = spec.shared_prefix_tokens + t.new_tokens
        else:
            cur = prev_in + prev_out + t.new_tokens
        out.append(cur)
        prev_in, prev_out = cur, t.output_tokens
    return tuple(out)


def sticky_gateway(session_id: str, gateways: int) -> int:
    """The gateway a session's requests all go to when each client pod has its own (a sidecar): the
    same pick in the live driver and the simulator, so that both put a session on the same one."""
    return zlib.crc32(session_id.encode()) % gateways


def conversation_starts(spec: SessionSpec) -> tuple[int, ...]:
    """Per turn, the index of the turn that began its conversation: a turn continues the previous
    one's conversation when it reuses more than the shared prefix of it (``turn_overlaps``), else it
    starts a new one (the first turn, a compaction). The live driver renders a new conversation
    there and the simulator names a new chain there, so both drivers split a session alike."""
    shared = int(spec.shared_prefix_tokens)
    out: list[int] = []
    for k, overlap in enumerate(turn_overlaps(spec)):
        out.append(out[-1] if k > 0 and overlap > shared else k)
    return tuple(out)


def turn_overlaps(spec: SessionSpec) -> tuple[int, ...]:
    """Per turn, the tokens of its prompt that continue the previous turn's prompt + output (0 for
    turn 0 and for a context that starts over): what a prefix cache holding the previous turn serves.

    With the trace's block hashes it is their common prefix (a trace rewrites the tail of its
    context: reasoning stripped, tool results trimmed), a reset's too (Mooncake's resets keep a few
    blocks of the old context, which the simulator's block names share); without them, the previous
    prompt + output unless the turn is a reset or does not extend it.
    """
    inputs = turn_inputs(spec)
    out: list[int] = []
    prev_in = prev_out = 0
    prev_ids: list[int] | None = None
    for k, t in enumerate(spec.turns):
        ids = expand_runs(t.hash_runs) if t.hash_runs and spec.block_size else None
        if k == 0 or (t.reset and ids is None):
            overlap = 0
        elif ids is not None and prev_ids is not None:
            m = 0
            for a, b in zip(ids, prev_ids, strict=False):
                if a != b:
                    break
                m += 1
            overlap = min(m * spec.block_size, inputs[k], prev_in)
        else:
            overlap = prev_in + prev_out if inputs[k] >= prev_in + prev_out else 0
        out.append(overlap)
        prev_in, prev_out, prev_ids = inputs[k], t.output_tokens, ids
    return tuple(out)


def expand_runs(runs: Iterable[tuple[int, int]]) -> list[int]:
    return [s + k for s, n in runs for k in range(n)]


def runs_of(ids: Sequence[int]) -> HashRuns:
    """Run-length encode consecutive integer ids (inverse of ``expand_runs``)."""
    runs: list[tuple[int, int]] = []
    for h in ids:
        if runs and runs[-1][0] + runs[-1][1] == h:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((h, 1))
    return tuple(runs)


# ---- synthetic ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticParams:
    """Parameters of the synthetic coding-agent workload. Defaults = the "blog-like" workload.

    Sizes are log-normal (``*_median`` and log-space ``*_sigma``), clamped to ``[*_min, *_max]``.
    With the defaults the median request carries ~100k input and ~500 output tokens, mirroring
    the WEKA Claude Code trace (median input 104k tokens) with Kimi-style outputs.
    """

    sessions: int = 250
    """Number of top-level sessions."""
    arrival_rate_per_s: float | None = None
    """Poisson session arrivals at this rate; ``None``: start times uniform in [0, start_spread_s]."""
    start_spread_s: float = 60.0
    """Window over which session starts are spread when ``arrival_rate_per_s`` is None."""

    turns_median: float = 55.0
    """Requests per session (main chain): median (WEKA: 45.5; a little more here so the median
    request input lands near 100k despite compaction)."""
    turns_sigma: float = 0.9
    """Log-space spread of requests per session: heterogeneous session sizes (WEKA p90 157)."""
    turns_min: int = 2
    turns_max: int = 400

    shared_prefix_tokens: int = 20_000
    """System prompt + tool definitions: identical across all sessions (the cross-session prefix)."""
    task_tokens_median: float = 4_000.0
    """Session-specific first-turn content (task, CLAUDE.md, first file): median."""
    task_tokens_sigma: float = 1.0
    new_tokens_median: float = 700.0
    """Tokens appended per turn (tool results, user text), excluding the previous output: median."""
    new_tokens_sigma: float = 1.4
    """Heavy tail: an occasional big file read or test log (WEKA p99 ~17k)."""
    new_tokens_max: int = 60_000
    output_tokens_median: float = 500.0
    """Output tokens per request: median."""
    output_tokens_sigma: float = 0.8
    output_tokens_min: int = 16
    output_tokens_max: int = 8_000

    max_context_tokens: int = 240_000
    """When a turn would exceed this, the agent compacts: the context restarts from the shared
    prefix plus a summary of ``compact_tokens`` (a ``Turn.reset``)."""
    compact_tokens: int = 20_000

    tool_think_fraction: float = 0.97
    """Fraction of think times that are tool calls (the rest are human turns). Blog-like: an agent
    running mostly on its own, so sessions are busy a good part of their life."""
    tool_think_median_s: float = 0.5
    """Tool call (grep, edit, run a quick test): seconds, log-normal; the tail reaches minutes."""
    tool_think_sigma: float = 1.0
    human_think_median_s: float = 15.0
    """Human reading and typing: seconds, log-normal; the tail reaches the cap (hours)."""
    human_think_sigma: float = 1.5
    think_max_s: float = 1_800.0
    """Cap on a single think time (replays cap idle gaps)."""

    thicc_fraction: float = 0.10
    """Fraction of sessions that spawn concurrent sub-agent branches."""
    thicc_max_concurrency: int = 5
    """Max requests of one session in flight at once: the parent plus up to this minus one branches."""
    thicc_spawns_max: int = 3
    """Sub-agent fan-outs per thicc session (each spawns 1..concurrency-1 branches)."""
    branch_shared_prefix_tokens: int = 9_000
    """Sub-agent system prompt + tools (shorter than the parent's)."""
    branch_turns_median: float = 10.0
    branch_turns_sigma: float = 0.6
    branch_task_tokens_median: float = 3_000.0
    branch_spawn_delay_s: float = 0.5
    """Branches start this long after the parent's spawning turn (plus up to the same again)."""

    def __post_init__(self) -> None:
        if self.sessions < 0:
            raise ValueError("sessions must be >= 0")
        if self.arrival_rate_per_s is not None and self.arrival_rate_per_s <= 0:
            raise ValueError("arrival_rate_per_s must be > 0")
        if not 0.0 <= self.thicc_fraction <= 1.0 or not 0.0 <= self.tool_think_fraction <= 1.0:
            raise ValueError("fractions must lie in [0, 1]")
        if self.thicc_max_concurrency < 1:
            raise ValueError("thicc_max_concurrency must be >= 1")
        if self.compact_tokens + self.shared_prefix_tokens >= self.max_context_tokens:
            raise ValueError("compact_tokens + shared_prefix_tokens must be < max_context_tokens")


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _think(rng: random.Random, p: SyntheticParams) -> float:
    if rng.random() < p.tool_think_fraction:
        x = p.tool_think_median_s * math.exp(rng.gauss(0.0, p.tool_think_sigma))
    else:
        x = p.human_think_median_s * math.exp(rng.gauss(0.0, p.human_think_sigma))
    return min(p.think_max_s, round(x, 3))


def _chain(
    rng: random.Random, p: SyntheticParams, n_turns: int, shared: int, task_median: float
) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    ctx = 0  # input + output of the previous turn
    for k in range(n_turns):
        out = _lognormal_int(rng, p.output_tokens_median, p.output_tokens_sigma, p.output_tokens_min,
                             p.output_tokens_max)
        if k == 0:
            new = _lognormal_int(rng, task_median, p.task_tokens_sigma, 1, p.new_tokens_max)
            turns.append(Turn(new_tokens=new, output_tokens=out, think_s=0.0))
            ctx = shared + new + out
            continue
        new = _lognormal_int(rng, p.new_tokens_median, p.new_tokens_sigma, 1, p.new_tokens_max)
        think = _think(rng, p)
        if ctx + new > p.max_context_tokens:
            turns.append(Turn(new_tokens=p.compact_tokens, output_tokens=out, think_s=think, reset=True))
            ctx = shared + p.compact_tokens + out
        else:
            turns.append(Turn(new_tokens=new, output_tokens=out, think_s=think))
            ctx += new + out
    return tuple(turns)


def synthetic_sessions(params: SyntheticParams, rng: random.Random) -> list[SessionSpec]:
    """Generate ``params.sessions`` sessions, sorted by start time. Deterministic for a seeded rng."""
    return list(SyntheticSessions(params, rng))


class SyntheticSessions(Sequence[SessionSpec]):
    """The sessions of ``synthetic_sessions``, each generated the first time it (or a later one) is
    read. A closed-loop run reads them in start order and uses only a part of a large workload (the
    1,000-replica run: ~10,000 of 28,000 sessions), so it no longer pays for the rest; and
    ``--jobs`` workers generate what they use in parallel instead of the parent, serially, before
    they fork. Identical to the list: the start times are drawn up front, then each session in
    index order from the same ``rng`` (which this object then owns)."""

    def __init__(self, params: SyntheticParams, rng: random.Random) -> None:
        self._params = params
        self._rng = rng
        self._made: list[SessionSpec] = []
        starts: list[float] = []
        t = 0.0
        for _ in range(params.sessions):
            if params.arrival_rate_per_s is not None:
                t += rng.expovariate(params.arrival_rate_per_s)
                starts.append(round(t, 3))
            else:
                starts.append(round(rng.uniform(0.0, params.start_spread_s), 3))
        starts.sort()
        self._starts = starts

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> SessionSpec: ...

    @overload
    def __getitem__(self, index: slice) -> list[SessionSpec]: ...

    def __getitem__(self, index: int | slice) -> SessionSpec | list[SessionSpec]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("session index out of range")
        made = self._made
        while len(made) <= index:
            made.append(self._session(len(made)))
        return made[index]

    def _session(self, i: int) -> SessionSpec:
        p, rng = self._params, self._rng
        sid = f"s{i:05d}-{rng.getrandbits(32):08x}"
        n_turns = _lognormal_int(rng, p.turns_median, p.turns_sigma, p.turns_min, p.turns_max)
        turns = _chain(rng, p, n_turns, p.shared_prefix_tokens, p.task_tokens_median)
        branches: list[SessionSpec] = []
        if p.thicc_max_concurrency > 1 and n_turns > 1 and rng.random() < p.thicc_fraction:
            n_spawns = rng.randint(1, p.thicc_spawns_max)
            at_turns = sorted(rng.sample(range(n_turns - 1), min(n_spawns, n_turns - 1)))
            for at in at_turns:
                width = rng.randint(1, p.thicc_max_concurrency - 1)
                for _ in range(width):
                    bt = _lognormal_int(rng, p.branch_turns_median, p.branch_turns_sigma, 1, p.turns_max)
                    branches.append(
                        SessionSpec(
                            session_id=f"{sid}/a{len(branches):02d}",
                            start_s=round(p.branch_spawn_delay_s * (1.0 + rng.random()), 3),
                            shared_prefix_tokens=p.branch_shared_prefix_tokens,
                            turns=_chain(rng, p, bt, p.branch_shared_prefix_tokens, p.branch_task_tokens_median),
                            parent=sid,
                            spawn_after_turn=at,
                        )
                    )
        return SessionSpec(
            session_id=sid,
            start_s=self._starts[i],
            shared_prefix_tokens=p.shared_prefix_tokens,
            turns=turns,
            branches=tuple(branches),
        )


def with_arrivals(
    specs: Sequence[SessionSpec],
    rng: random.Random,
    *,
    rate_per_s: float | None = None,
    spread_s: float | None = None,
) -> list[SessionSpec]:
    """Give top-level sessions new start times: Poisson at ``rate_per_s`` or uniform over
    ``spread_s`` (traces without a global clock, e.g. WEKA, come with every start at 0)."""
    if (rate_per_s is None) == (spread_s is None):
        raise ValueError("give exactly one of rate_per_s, spread_s")
    starts: list[float] = []
    t = 0.0
    for _ in specs:
        if rate_per_s is not None:
            t += rng.expovariate(rate_per_s)
            starts.append(round(t, 3))
        else:
            assert spread_s is not None
            starts.append(round(rng.uniform(0.0, spread_s), 3))
    starts.sort()
    return [replace(s, start_s=t0) for s, t0 in zip(specs, starts)]


def drop_long_requests(specs: Sequence[SessionSpec], max_input_tokens: int) -> list[SessionSpec]:
    """Drop every request whose prompt exceeds ``max_input_tokens`` and keep the rest of its session
    (AgentX's ``_256k`` corpora do this for a model's context window).

    Kept turns get their exact ``input_tokens`` so later prompts do not shift; a branch spawned by a
    dropped turn spawns after the last kept turn before it; chains left empty disappear.
    """

    def one(s: SessionSpec) -> SessionSpec | None:
        inputs = turn_inputs(s)
        keep = [k for k, inp in enumerate(inputs) if inp <= max_input_tokens]
        if not keep:
            return None
        turns = tuple(
            s.turns[k] if s.turns[k].input_tokens else replace(s.turns[k], input_tokens=inputs[k]) for k in keep
        )
        branches: list[SessionSpec] = []
        for b in s.branches:
            nb = one(b)
            if nb is None:
                continue
            after = max(0, sum(1 for k in keep if k <= b.spawn_after_turn) - 1)
            branches.append(replace(nb, spawn_after_turn=after))
        return replace(s, turns=turns, branches=tuple(branches))

    out = [one(s) for s in specs]
    return [s for s in out if s is not None]


# ---- WEKA Claude Code trace --------------------------------------------------------------------


def _weka_sessions_path(path: Path) -> Path:
    name = path.name.replace("_requests.jsonl", "_sessions.jsonl")
    return path.with_name(name)


def _checked_trace(kind: str, path: Path, read: Callable[[], list[SessionSpec]]) -> list[SessionSpec]:
    """``read()``, with a file that is not such a trace (bad JSON, a missing or mistyped field) or
    holds no session refused as a ValueError that names the file (OSError passes: unreadable)."""
    try:
        specs = read()
    except (KeyError, TypeError, ValueError, IndexError) as exc:  # json's errors are ValueErrors
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{path}: not a {kind} trace ({what})") from None
    if not specs:
        raise ValueError(f"{path}: no sessions in this {kind} trace")
    return specs


def read_weka(path: str | Path = DEFAULT_WEKA_TRACE, *, limit: int | None = None) -> list[SessionSpec]:
    """Read the flattened WEKA kv-cache-tester Claude Code trace (traces/README.md).

    ``path`` is the ``*_requests.jsonl`` file; the ``*_sessions.jsonl`` beside it (optional) gives
    each agent's tool + system prompt tokens (the shared prefix). ``limit`` caps the number of
    sessions (first ones in file order). Sub-agents become branches: each spawns after the parent's
    last request that started before it, ``start_s`` = the gap from that request's recorded end
    (``t_abs + api_time``), floored at 0. ``think_s`` = the recorded ``think_time``. Every
    session starts at 0 (the trace has no global clock): use ``with_arrivals``. A file that is not
    such a trace, or holds no session, is a ValueError that names it.
    """
    path = Path(path)
    return _checked_trace("WEKA", path, lambda: _read_weka(path, limit))


def _read_weka(path: Path, limit: int | None) -> list[SessionSpec]:
    """The reader behind ``read_weka``."""
    path = Path(path)
    prefix: dict[tuple[str, str], int] = {}
    meta_path = _weka_sessions_path(path)
    if meta_path.exists() and meta_path != path:
        with meta_path.open() as f:
            for line in f:
                m = json.loads(line)
                prefix[(m["id"], "main")] = int(m.get("tool_tokens", 0)) + int(m.get("system_tokens", 0))
                for sub in m.get("subagents", ()):
                    prefix[(m["id"], sub["agent_id"])] = int(sub.get("tool_tokens", 0)) + int(
                        sub.get("system_tokens", 0)
                    )
    rows_by_session: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    with path.open() as f:
        for line in f:
            r = json.loads(line)
            sid = r["session"]
            if sid not in rows_by_session:
                if limit is not None and len(order) >= limit:
                    break
                order.append(sid)
                rows_by_session[sid] = []
            rows_by_session[sid].append(r)
    return [_weka_session(sid, rows_by_session[sid], prefix) for sid in order]


def _weka_turns(rows: list[dict[str, Any]]) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    prev_in = prev_out = 0
    prev_first = None
    for k, r in enumerate(rows):
        runs = tuple((int(s), int(n)) for s, n in r["hash_runs"])
        cur_in = int(r["in"])
        first = runs[0][0] if runs else None
        reset = k > 0 and first != prev_first
        new = cur_in if k == 0 or reset else max(0, cur_in - prev_in - prev_out)
        turns.append(
            Turn(
                new_tokens=new,
                output_tokens=max(1, int(r["out"])),
                think_s=0.0 if k == 0 else max(0.0, float(r.get("think_time") or 0.0)),
                input_tokens=cur_in,
                reset=reset,
                hash_runs=runs,
            )
        )
        prev_in, prev_out, prev_first = cur_in, int(r["out"]), first
    return tuple(turns)


def _weka_session(sid: str, rows: list[dict[str, Any]], prefix: dict[tuple[str, str], int]) -> SessionSpec:
    by_agent: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_agent[r["agent"]].append(r)
    main = sorted(by_agent.pop("main", []), key=lambda r: (r["t_abs"], r["i"]))
    branches: list[SessionSpec] = []
    for agent in sorted(by_agent, key=lambda a: (min(r["t_abs"] for r in by_agent[a]), a)):
        arows = sorted(by_agent[agent], key=lambda r: (r["t_abs"], r["i"]))
        t0 = float(arows[0]["t_abs"])
        after = 0
        for k, r in enumerate(main):
            if float(r["t_abs"]) <= t0:
                after = k
        gap = 0.0
        if main:
            parent_end = float(main[after]["t_abs"]) + float(main[after].get("api_time") or 0.0)
            gap = max(0.0, t0 - parent_end)
        branches.append(
            SessionSpec(
                session_id=f"{sid}/{agent}",
                start_s=round(gap, 3),
                shared_prefix_tokens=prefix.get((sid, agent), 0),
                turns=_weka_turns(arows),
                parent=sid,
                spawn_after_turn=after,
                block_size=64,
                hash_scope="session",
                source="weka",
            )
        )
    if not main:  # a session made only of sub-agent rows: promote the first branch
        first = branches.pop(0)
        return replace(first, session_id=sid, parent=None, start_s=0.0, branches=tuple(branches))
    return SessionSpec(
        session_id=sid,
        start_s=0.0,
        shared_prefix_tokens=prefix.get((sid, "main"), 0),
        turns=_weka_turns(main),
        branches=tuple(branches),
        block_size=64,
        hash_scope="session",
        source="weka",
    )


# ---- Mooncake trace ----------------------------------------------------------------------------

_POPULAR_BLOCK = 50  # as traces/tools/annotate_mooncake_sessions.py
NOMINAL_PREFILL_TOK_S = 10_000.0  # nominal service model (docs/WORKLOADS.md; turns gaps into think)
NOMINAL_DECODE_S_PER_TOKEN = 0.03


def _mooncake_session_keys(rows: list[dict[str, Any]], csv_path: Path | None) -> list[int]:
    if csv_path is not None and csv_path.exists():
        keys: list[int] = []
        with csv_path.open(newline="") as f:
            for row in csv.DictReader(f):
                keys.append(int(row["session"]))
        if len(keys) == len(rows):
            return keys
    cnt = Counter(b for r in rows for b in r["hash_ids"])
    sid: dict[object, int] = {}
    out = []
    for i, r in enumerate(rows):
        k: object = next((b for b in r["hash_ids"] if cnt[b] < _POPULAR_BLOCK), ("solo", i))
        out.append(sid.setdefault(k, len(sid)))
    return out


def read_mooncake(path: str | Path = DEFAULT_MOONCAKE_TRACE, *, limit: int | None = None) -> list[SessionSpec]:
    """Read a Mooncake FAST'25 trace (``{"timestamp" ms, "input_length", "output_length",
    "hash_ids"}`` per line, 512-token blocks, global ids) into sessions.

    Sessions come from the ``*_sessions.csv`` beside the trace when present (``*_trace.jsonl`` ->
    ``*_sessions.csv``), else are inferred the same way (first block used by < 50 requests).
    ``start_s`` = first request's timestamp; ``think_s`` of a later turn = gap between request
    starts minus the previous request's nominal service time (uncached/10k tok/s + 30 ms/output
    token), floored at 0. ``shared_prefix_tokens`` = the leading popular blocks x 512.
    ``limit`` caps the number of sessions (in order of first appearance).
    A file that is not such a trace, or holds no session, is a ValueError that names it.
    """
    path = Path(path)
    return _checked_trace("Mooncake", path, lambda: _read_mooncake(path, limit))


def _read_mooncake(path: Path, limit: int | None) -> list[SessionSpec]:
    """The reader behind ``read_mooncake``."""
    path = Path(path)
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    csv_path = path.with_name(path.name.replace("_trace.jsonl", "_sessions.csv"))
    keys = _mooncake_session_keys(rows, csv_path if csv_path != path else None)
    cnt = Counter(b for r in rows for b in r["hash_ids"])
    groups: dict[int, list[dict[str, Any]]] = {}
    for r, k in zip(rows, keys):
        groups.setdefault(k, []).append(r)
    out: list[SessionSpec] = []
    for k, grp in groups.items():
        if limit is not None and len(out) >= limit:
            break
        grp.sort(key=lambda r: r["timestamp"])
        turns: list[Turn] = []
        prev: dict[str, Any] | None = None
        for r in grp:
            ids = r["hash_ids"]
            inp, outp = int(r["input_length"]), max(1, int(r["output_length"]))
            if prev is None:
                think = 0.0
                new = inp
                reset = False
            else:
                prev_ids = prev["hash_ids"]
                lead = 0
                for a, b in zip(ids, prev_ids):
                    if a != b:
                        break
                    lead += 1
                uncached_prev = max(0, int(prev["input_length"]) - 512 * lead)
                service = uncached_prev / NOMINAL_PREFILL_TOK_S + NOMINAL_DECODE_S_PER_TOKEN * int(
                    prev["output_length"]
                )
                think = max(0.0, (r["timestamp"] - prev["timestamp"]) / 1000.0 - service)
                reset = lead < len(prev_ids) // 2
                new = max(0, inp - int(prev["input_length"]) - int(prev["output_length"]))
            turns.append(
                Turn(
                    new_tokens=new,
                    output_tokens=outp,
                    think_s=round(think, 3),
                    input_tokens=inp,
                    reset=reset,
                    hash_runs=runs_of(ids),
                )
            )
            prev = r
        first_ids = grp[0]["hash_ids"]
        shared_blocks = next((j for j, b in enumerate(first_ids) if cnt[b] < _POPULAR_BLOCK), len(first_ids))
        out.append(
            SessionSpec(
                session_id=f"mc{k:05d}",
                start_s=grp[0]["timestamp"] / 1000.0,
                shared_prefix_tokens=min(512 * shared_blocks, int(grp[0]["input_length"])),
                turns=tuple(turns),
                block_size=512,
                hash_scope="global",
                source="mooncake",
            )
        )
    out.sort(key=lambda s: (s.start_s, s.session_id))
    return out


# ---- summaries -----------------------------------------------------------------------------------


def iter_requests(specs: Iterable[SessionSpec]) -> Iterator[tuple[SessionSpec, int, Turn, int]]:
    """Every (chain, turn index, turn, input tokens) of the workload, branches included."""
    for top in specs:
        for chain in top.walk():
            for k, (t, inp) in enumerate(zip(chain.turns, turn_inputs(chain))):
                yield chain, k, t, inp


def _median(xs: list[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    sessions: int
    requests: int
    input_median: float
    output_median: float
    thicc_fraction: float
    extra: dict[str, float] = field(default_factory=dict)


def workload_stats(specs: Sequence[SessionSpec]) -> WorkloadStats:
    ins: list[float] = []
    outs: list[float] = []
    news: list[float] = []
    for _, k, t, inp in iter_requests(specs):
        for _ in range(t.parallel):
            ins.append(inp)
            outs.append(t.output_tokens)
            if k > 0 and not t.reset:
                news.append(t.new_tokens)
    thicc = sum(1 for s in specs if s.branches or any(t.parallel > 1 for t in s.turns))
    return WorkloadStats(
        sessions=len(specs),
        requests=len(ins),
        input_median=_median(ins),
        output_median=_median(outs),
        thicc_fraction=thicc / len(specs) if specs else 0.0,
        extra={"new_tokens_median": _median(news), "input_mean": sum(ins) / len(ins) if ins else 0.0},
    )

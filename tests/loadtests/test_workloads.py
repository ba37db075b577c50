from __future__ import annotations

import dataclasses
import random
from dataclasses import replace
from pathlib import Path

import pytest

from loadtests.workloads import (
    SessionSpec,
    SyntheticParams,
    SyntheticSessions,
    Turn,
    expand_runs,
    iter_requests,
    read_mooncake,
    read_weka,
    runs_of,
    synthetic_sessions,
    traces_dir,
    turn_inputs,
    with_arrivals,
    workload_stats,
)

TRACES = traces_dir()


def test_turn_inputs_follow_the_convention() -> None:
    spec = SessionSpec(
        "x",
        0.0,
        100,
        (
            Turn(10, 5, 0.0),
            Turn(20, 7, 1.0),
            Turn(3, 1, 1.0, reset=True),
            Turn(0, 1, 1.0, input_tokens=999),
            Turn(1, 1, 1.0),
        ),
    )
    assert turn_inputs(spec) == (110, 110 + 5 + 20, 103, 999, 999 + 1 + 1)


def test_runs_roundtrip() -> None:
    ids = [1, 2, 3, 7, 8, 100]
    assert runs_of(ids) == ((1, 3), (7, 2), (100, 1))
    assert expand_runs(runs_of(ids)) == ids


def test_synthetic_blog_like_statistics() -> None:
    specs = synthetic_sessions(SyntheticParams(sessions=600), random.Random(7))
    st = workload_stats(specs)
    assert st.sessions == 600
    assert 80_000 <= st.input_median <= 120_000
    assert 400 <= st.output_median <= 600
    assert 550 <= st.extra["new_tokens_median"] <= 850
    assert 0.05 <= st.thicc_fraction <= 0.16
    # heterogeneous sizes: requests per session spread over an order of magnitude
    sizes = sorted(s.n_requests for s in specs)
    assert sizes[len(sizes) // 10] * 4 < sizes[9 * len(sizes) // 10]
    # think-time mixture: many short tool calls, a heavy tail of long human pauses
    thinks = sorted(t.think_s for _, k, t, _ in iter_requests(specs) if k > 0)
    assert thinks[len(thinks) // 2] < 2.0
    assert thinks[int(len(thinks) * 0.999)] > 60.0
    assert thinks[-1] > 600.0
    # every session shares the same system+tools prefix, context never exceeds the cap
    assert {s.shared_prefix_tokens for s in specs} == {20_000}
    assert max(inp for *_, inp in iter_requests(specs)) <= SyntheticParams().max_context_tokens + 1
    # thicc: branches route with the root id and keep concurrency bounded
    thicc = [s for s in specs if s.branches]
    assert thicc and all(
        b.routing_key == s.session_id and b.parent == s.session_id for s in thicc for b in s.branches
    )
    for s in thicc:
        per_turn: dict[int, int] = {}
        for b in s.branches:
            per_turn[b.spawn_after_turn] = per_turn.get(b.spawn_after_turn, 0) + 1
        assert max(per_turn.values()) <= SyntheticParams().thicc_max_concurrency - 1
    starts = [s.start_s for s in specs]
    assert starts == sorted(starts) and 0.0 <= starts[0] and starts[-1] <= 60.0


def test_synthetic_is_deterministic_and_seed_sensitive() -> None:
    p = SyntheticParams(sessions=30, arrival_rate_per_s=2.0)
    a = synthetic_sessions(p, random.Random(3))
    b = synthetic_sessions(p, random.Random(3))
    c = synthetic_sessions(p, random.Random(4))
    assert a == b
    assert a != c


@pytest.mark.parametrize("rate", [None, 2.0])
def test_synthetic_sessions_made_on_demand_equal_the_list(rate: float | None) -> None:
    p = SyntheticParams(sessions=40, arrival_rate_per_s=rate)
    listed = synthetic_sessions(p, random.Random(5))
    lazy = SyntheticSessions(p, random.Random(5))
    assert len(lazy) == 40
    assert lazy[7] == listed[7]  # reads out of order make every session before it, in order
    assert lazy[3] == listed[3] and lazy[-1] == listed[-1]
    assert lazy[10:14] == listed[10:14]
    assert list(lazy) == listed
    with pytest.raises(IndexError):
        lazy[40]


def test_synthetic_params_validation() -> None:
    with pytest.raises(ValueError):
        SyntheticParams(thicc_fraction=1.5)
    with pytest.raises(ValueError):
        SyntheticParams(arrival_rate_per_s=0.0)


def test_with_arrivals() -> None:
    specs = [SessionSpec(f"s{i}", 0.0, 0, (Turn(1, 1, 0.0),)) for i in range(50)]
    out = with_arrivals(specs, random.Random(1), spread_s=10.0)
    assert all(0.0 <= s.start_s <= 10.0 for s in out)
    assert [s.session_id for s in out] == [s.session_id for s in specs]
    out2 = with_arrivals(specs, random.Random(1), rate_per_s=5.0)
    assert out2[-1].start_s == pytest.approx(10.0, rel=0.5)
    with pytest.raises(ValueError):
        with_arrivals(specs, random.Random(1))


def test_read_weka_real_file() -> None:
    specs = read_weka(TRACES / "weka_cc_kvtester_requests.jsonl", limit=40)
    assert len(specs) == 40
    s0 = specs[0]
    assert s0.session_id == "trace_0001" and s0.block_size == 64 and s0.source == "weka"
    assert s0.turns[0].input_tokens == 71175 and s0.turns[0].output_tokens == 169
    assert s0.turns[1].think_s == 12.0
    assert 12974 + 4243 == s0.shared_prefix_tokens
    assert expand_runs(s0.turns[0].hash_runs) == list(range(1, 1113))
    assert turn_inputs(s0)[:2] == (71175, 72762)
    # sub-agents are branches of trace_0004 that route with the parent's id
    t4 = next(s for s in specs if s.session_id == "trace_0004")
    assert len(t4.branches) == 2
    b = t4.branches[0]
    assert b.session_id == "trace_0004/agent_001" and b.routing_key == "trace_0004"
    assert b.turns[0].input_tokens == 18251 and b.shared_prefix_tokens == 7771 + 952
    assert 0 <= b.spawn_after_turn < len(t4.turns)
    st = workload_stats(specs)
    assert st.requests == sum(s.n_requests for s in specs)
    assert 50_000 < st.input_median < 200_000


def test_read_mooncake_real_file_sessions_match_csv() -> None:
    specs = read_mooncake(TRACES / "mooncake_conversation_trace.jsonl")
    st = workload_stats(specs)
    assert st.sessions == 7373 and st.requests == 12031
    assert st.input_median == 6909
    multi = [s for s in specs if len(s.turns) > 1]
    assert multi
    s = multi[0]
    ids0 = expand_runs(s.turns[0].hash_runs)
    ids1 = expand_runs(s.turns[1].hash_runs)
    assert ids1[: len(ids0) // 2] == ids0[: len(ids0) // 2]  # later turns extend the prefix
    assert s.block_size == 512 and s.hash_scope == "global"
    assert s.shared_prefix_tokens == 512  # block 0 is everybody's system prompt
    assert all(t.think_s >= 0 for t in s.turns)


def test_read_mooncake_infers_sessions_without_csv(tmp_path: Path) -> None:
    src = TRACES / "mooncake_synthetic_trace.jsonl"
    lines = src.read_text().splitlines()[:400]
    p = tmp_path / "mini.jsonl"
    p.write_text("\n".join(lines) + "\n")
    specs = read_mooncake(p)
    assert sum(len(s.turns) for s in specs) == 400
    assert len(specs) < 400
    assert read_mooncake(p, limit=5) == specs[:5]


def test_replace_keeps_frozen_semantics() -> None:
    t = Turn(1, 2, 0.0)
    with pytest.raises(AttributeError):
        t.new_tokens = 3  # type: ignore[misc]
    assert replace(t, think_s=1.0).think_s == 1.0


def test_drop_long_requests_keeps_the_rest_of_the_session() -> None:
    from loadtests.workloads import drop_long_requests

    br = SessionSpec("s/a", 0.1, 10, (Turn(50, 5, 0.0), Turn(500, 5, 0.1)), parent="s", spawn_after_turn=1)
    spec = SessionSpec("s", 0.0, 100, (Turn(100, 10, 0.0), Turn(1000, 10, 1.0), Turn(5, 10, 1.0)), branches=(br,))
    assert turn_inputs(spec) == (200, 1210, 1225)
    out = drop_long_requests([spec], 300)
    assert len(out) == 1
    s = out[0]
    assert turn_inputs(s) == (200,)  # turns 1 and 2 exceed 300 tokens
    assert len(s.branches) == 1 and s.branches[0].spawn_after_turn == 0
    assert turn_inputs(s.branches[0]) == (60,)
    assert drop_long_requests([spec], 10) == []
    weka = read_weka(TRACES / "weka_cc_kvtester_requests.jsonl", limit=80)
    kept = drop_long_requests(weka, 262_144)
    assert all(inp <= 262_144 for *_, inp in iter_requests(kept))
    n_before = sum(1 for _ in iter_requests(weka))
    n_after = sum(1 for _ in iter_requests(kept))
    assert 0.8 * n_before < n_after < n_before


def test_traces_dir_prefers_env_then_the_shared_folder_beside_the_checkout(tmp_path: Path) -> None:
    assert traces_dir({"KVROUTE_TRACES": str(tmp_path)}) == tmp_path
    found = traces_dir({})
    assert (found / "weka_cc_kvtester_requests.jsonl").is_file()


def test_turn_overlaps_follow_the_trace_hashes_or_the_append_convention() -> None:
    from loadtests.workloads import SessionSpec, Turn, conversation_starts, turn_overlaps

    synthetic = SessionSpec("s", 0.0, 100, (Turn(50, 10, 0.0), Turn(20, 5, 1.0), Turn(30, 5, 1.0, reset=True)))
    assert turn_overlaps(synthetic) == (0, 160, 0)  # 100 + 50 + 10; a reset starts over
    # a trace (block 10): turn 1 keeps blocks 1-3 of turn 0 and rewrites the rest
    trace = SessionSpec(
        "t", 0.0, 0,
        (Turn(0, 5, 0.0, input_tokens=50, hash_runs=((1, 5),)),
         Turn(0, 5, 1.0, input_tokens=60, hash_runs=((1, 3), (9, 3)))),
        block_size=10,
    )  # fmt: skip
    assert turn_overlaps(trace) == (0, 30)
    # a trace's reset keeps what its hashes share with the turn before (Mooncake's resets keep a few
    # blocks): the conversation goes on from there, in both drivers
    reset = SessionSpec(
        "r", 0.0, 10,
        (Turn(0, 5, 0.0, input_tokens=80, hash_runs=((1, 8),)),
         Turn(0, 5, 1.0, input_tokens=60, reset=True, hash_runs=((1, 2), (20, 4)))),
        block_size=10,
    )  # fmt: skip
    assert turn_overlaps(reset) == (0, 20)
    assert conversation_starts(reset) == (0, 0)
    # one sharing no more than the shared prefix starts a new conversation
    fresh = dataclasses.replace(reset, shared_prefix_tokens=20)
    assert conversation_starts(fresh) == (0, 1)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"bad json\n', "not a {kind} trace"),
        ('{"a": 1}\n', "not a {kind} trace (missing field"),
        ("", "no sessions in this {kind} trace"),
    ],
    ids=["bad-json", "wrong-schema", "empty"],
)
@pytest.mark.parametrize("kind", ["WEKA", "Mooncake"])
def test_a_file_that_is_not_a_trace_is_a_value_error_naming_it(tmp_path: Path, kind: str, text: str, says: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        (read_weka if kind == "WEKA" else read_mooncake)(path)
    assert str(exc.value).startswith(f"{path}: ") and says.format(kind=kind) in str(exc.value)

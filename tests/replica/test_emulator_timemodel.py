from __future__ import annotations

import time

import pytest

from replica.emulator.cache import PrefixCache
from replica.emulator.profiles import PROFILES, Profile, get_profile
from replica.emulator.timemodel import (
    EngineEvent,
    EngineRequest,
    Finished,
    FirstToken,
    ReplicaEngine,
    Started,
    Tokens,
    alone_ttft_s,
    decode_step_time,
    prefill_time,
)
from replica.emulator.tokenizer import block_hashes, encode_text

KIMI = get_profile("kimi-k2.6-b200-tp4")


def req(rid: str, text: str, out: int, page: int) -> EngineRequest:
    p = encode_text(text)
    return EngineRequest(rid, p.num_tokens, block_hashes(p, page), out)


def drain(e: ReplicaEngine, until: float = float("inf")) -> list[EngineEvent]:
    evs: list[EngineEvent] = []
    while (t := e.next_event_time()) is not None and t <= until:
        evs += e.advance(t)
    return evs


def first(evs: list[EngineEvent], kind: type, rid: str) -> EngineEvent:
    return next(ev for ev in evs if isinstance(ev, kind) and ev.rid == rid)


def test_prefill_cost_monotone_in_new_and_context() -> None:
    for ctx in (0, 10_000, 100_000):
        ts = [prefill_time(KIMI, n, ctx) for n in (1, 100, 1000, 8192)]
        assert ts == sorted(ts) and len(set(ts)) == 4
    for n in (1, 700, 8192):
        ts = [prefill_time(KIMI, n, c) for c in (0, 1000, 50_000, 200_000)]
        assert ts == sorted(ts) and len(set(ts)) == 4
    # per-new-token cost grows with context
    assert prefill_time(KIMI, 700, 100_000) / 700 > 4 * prefill_time(KIMI, 700, 0) / 700


@pytest.mark.parametrize("unit", [1, 100])
def test_alone_ttft_is_when_the_engine_gives_the_first_token_on_an_idle_replica(unit: int) -> None:
    profile = KIMI.with_overrides(token_unit=unit, page_size=4)
    page = profile.page_size
    shared = "tool definitions and system prompt " * 300
    for words, out in ((60, 1), (600, 5), (2_000, 3)):  # up to ~7k tokens: fits 8.5k at unit 100
        e = ReplicaEngine(profile)
        warm = req("warm", shared, 1, page)
        e.submit(warm, 0.0)
        drain(e)
        r = req("r", shared + "the task " * words, out, page)
        t0 = 1000.0
        e.submit(r, t0)
        evs = drain(e)
        started = first(evs, Started, "r")
        ttft = first(evs, FirstToken, "r").t - t0
        assert started.cached_device > 0  # the shared prompt was a hit
        expect = alone_ttft_s(profile, r.prompt_tokens * unit, started.cached_device * unit)
        assert ttft == pytest.approx(expect, rel=1e-9)
        assert alone_ttft_s(profile, r.prompt_tokens * unit, 0) > expect  # more cached, sooner
    # a fully cached prompt still computes its last token in one forward
    assert alone_ttft_s(KIMI, 1000, 1000) == pytest.approx(KIMI.prefill_base_s + prefill_time(KIMI, 1, 999))


def test_decode_step_monotone_in_batch_and_context() -> None:
    assert decode_step_time(KIMI, 1, 0) == pytest.approx(0.0084 + 0.000365)
    by_batch = [decode_step_time(KIMI, b, 8000 * b) for b in (1, 4, 16, 64)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 4
    by_ctx = [decode_step_time(KIMI, 8, c) for c in (0, 100_000, 800_000)]
    assert by_ctx == sorted(by_ctx) and len(set(by_ctx)) == 3
    # the reference deployment measured ~31 ms TPOT at TP4, concurrency 64, ~9k context (docs/EMULATOR.md)
    assert 0.025 < decode_step_time(KIMI, 64, 64 * 9000) < 0.040


def test_calibrated_cold_and_warm_ttft() -> None:
    e = ReplicaEngine(KIMI)
    base = "x" * 400_000  # 100k tokens
    e.submit(req("cold", base, 100, KIMI.page_size), 0.0)
    evs = drain(e)
    ttft_cold = first(evs, FirstToken, "cold").t
    assert 4.0 <= ttft_cold <= 7.0
    e.submit(req("warm", base + "y" * 2800, 100, KIMI.page_size), 10.0)  # +700 tokens
    evs = drain(e)
    st = first(evs, Started, "warm")
    assert isinstance(st, Started) and st.cached_device >= 99_900
    ttft_warm = first(evs, FirstToken, "warm").t - 10.0
    assert 0.05 <= ttft_warm <= 0.09


def test_batch_ttft_ordering_and_decode_time_matches_stepwise_sum() -> None:
    prof = KIMI.with_overrides(spec_accept_length=1.0)
    e = ReplicaEngine(prof, token_events=True)
    sizes = {"a": 2000, "b": 8000, "c": 500}
    for rid, n in sizes.items():
        e.submit(req(rid, rid * (4 * n), 50, prof.page_size), 0.0)
    evs = drain(e)
    ft = {rid: first(evs, FirstToken, rid).t for rid in sizes}
    assert ft["a"] < ft["b"] < ft["c"]  # FCFS prefill order
    fin = {rid: first(evs, Finished, rid) for rid in sizes}
    assert all(isinstance(f, Finished) and f.completion_tokens == 50 and f.reason == "length" for f in fin.values())
    # all three decode together after the last prefill; 49 steps each, computed step by step:
    t = ft["c"]
    ctx = sum(n + 1 for n in sizes.values())
    for _ in range(49):
        t += decode_step_time(prof, 3, ctx)
        ctx += 3
    assert all(f.t == pytest.approx(t, rel=1e-9) for f in fin.values())  # type: ignore[union-attr]
    assert not [ev for ev in evs if isinstance(ev, Tokens)]  # one segment: nobody left mid-way


def test_continuous_batching_queue_and_slots() -> None:
    prof = get_profile("small-test").with_overrides(max_running_requests=2)
    e = ReplicaEngine(prof)
    for i in range(5):
        e.submit(req(f"r{i}", f"{i}" * 400, 40, prof.page_size), 0.0)
    load = e.load()
    assert load.running == 1 and load.queued == 4  # r0 is prefilling; the rest arrived during it
    evs = drain(e)
    starts = {ev.rid: ev.t for ev in evs if isinstance(ev, Started)}
    assert list(starts) == ["r0", "r1", "r2", "r3", "r4"]  # FCFS
    fins = {ev.rid: ev.t for ev in evs if isinstance(ev, Finished)}
    assert len(fins) == 5
    assert starts["r2"] >= min(fins["r0"], fins["r1"])  # never more than 2 running
    assert starts["r1"] < fins["r0"]  # r1 joined r0's batch (continuous batching)
    assert e.load().running == 0 and e.idle


def test_cheap_load_figures_equal_load() -> None:
    prof = get_profile("small-test").with_overrides(max_running_requests=2)
    e = ReplicaEngine(prof)
    for i in range(5):
        e.submit(req(f"r{i}", f"{i}" * 400, 40, prof.page_size), 0.0)
    for t in (0.0, 0.05, 0.2, 1.0):
        e.advance(t)
        ld = e.load()
        assert (e.running, e.queued, e.cache_hit_rate, e.gen_throughput) == (
            ld.running, ld.queued, ld.cache_hit_rate, ld.gen_throughput)


def test_pending_prefill_is_the_uncached_work_not_yet_done() -> None:
    # what /v1/loads reports as num_waiting_uncached_tokens: a cold prompt counts whole, falls chunk
    # by chunk as it is prefilled, and a repeat of it counts only its uncached tail
    prof = KIMI
    e = ReplicaEngine(prof)
    cold = req("cold", "c" * 40_000, 4, prof.page_size)
    e.submit(cold, 0.0)
    assert e.pending_prefill_tokens == cold.prompt_tokens == e.load().pending_prefill_tokens
    first_chunk = e.next_event_time()
    assert first_chunk is not None
    e.advance(first_chunk)
    assert e.pending_prefill_tokens == cold.prompt_tokens - prof.chunked_prefill_size // prof.token_unit
    evs = drain(e)
    assert e.pending_prefill_tokens == 0 and any(isinstance(ev, FirstToken) for ev in evs)
    again = req("again", "c" * 40_000 + "tail" * 100, 4, prof.page_size)
    e.submit(again, e.next_event_time() or first(evs, Finished, "cold").t)
    assert 0 < e.pending_prefill_tokens < again.prompt_tokens - cold.prompt_tokens + prof.page_size


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_queued_prompts_count_as_sglang_estimates_them(policy: str) -> None:
    """Rule 7: with requests waiting, ``fcfs`` (SGLang's default) counts each waiting prompt whole
    times the miss rate of the last 15 s of prefills; the cache-aware orders count each one's
    uncached part. The prompt being prefilled counts its uncached rest either way."""
    prof = get_profile("small-test").with_overrides(max_running_requests=1, schedule_policy=policy)
    e = ReplicaEngine(prof)
    base = "shared prefix of the session " * 40
    first_turn = req("warm-up", base, 1, prof.page_size)
    e.submit(first_turn, 0.0)
    evs = drain(e)
    t = max(ev.t for ev in evs)
    running = req("running", base + "a first question " * 4, 200, prof.page_size)  # holds the one slot
    e.submit(running, t)
    while e.running and not any(isinstance(ev, FirstToken) and ev.rid == "running" for ev in evs):
        evs += e.advance(e.next_event_time() or t)  # its prefill done: it decodes, the slot stays taken
    started = [ev for ev in evs if isinstance(ev, Started)]
    assert [ev.rid for ev in started] == ["warm-up", "running"] and e.running == 1
    hits = sum(ev.cached_device + ev.cached_host for ev in started)
    assert hits > 0  # "running" found the base cached
    miss = 1 - hits / (first_turn.prompt_tokens + running.prompt_tokens)
    warm = req("warm", base + "and a new question", 4, prof.page_size)
    cold = req("cold", "y" * 600, 4, prof.page_size)
    e.submit(warm, t + 0.01)
    e.submit(cold, t + 0.01)
    assert e.queued == 2 and e.running == 1
    if policy == "fcfs":
        assert e.pending_prefill_tokens == int(warm.prompt_tokens * miss) + int(cold.prompt_tokens * miss)
    else:
        matched = e.cache.match(warm.block_hashes[: (warm.prompt_tokens - 1) // prof.page_size]).tokens
        assert matched > 0
        assert e.pending_prefill_tokens == warm.prompt_tokens - matched + cold.prompt_tokens


def test_more_batch_slower_per_request() -> None:
    prof = KIMI
    e1 = ReplicaEngine(prof)
    e1.submit(req("solo", "s" * 40_000, 500, prof.page_size), 0.0)
    solo = first(drain(e1), Finished, "solo").t
    e8 = ReplicaEngine(prof)
    for i in range(8):
        e8.submit(req(f"b{i}", chr(65 + i) * 40_000, 500, prof.page_size), 0.0)
    evs = drain(e8)
    assert min(ev.t for ev in evs if isinstance(ev, Finished)) > solo


def test_arrival_cuts_decode_and_gets_prefilled_promptly() -> None:
    prof = KIMI
    e = ReplicaEngine(prof)
    e.submit(req("long", "l" * 4000, 5000, prof.page_size), 0.0)
    drain(e, until=1.0)
    e.submit(req("late", "q" * 4000, 10, prof.page_size), 1.0)
    evs = drain(e)
    ft = first(evs, FirstToken, "late").t
    assert 1.0 < ft < 1.0 + 0.05  # waits at most one decode step + its own prefill
    p_long = e.progress("long", ft)
    assert p_long.finished


def test_abort_frees_slot_and_kv() -> None:
    prof = get_profile("small-test").with_overrides(max_running_requests=1)
    e = ReplicaEngine(prof)
    e.submit(req("hog", "h" * 4000, 3000, prof.page_size), 0.0)
    e.submit(req("next", "n" * 400, 5, prof.page_size), 0.0)
    drain(e, until=0.5)
    assert e.load().queued == 1
    assert e.abort("hog", 0.5)
    assert not e.abort("hog", 0.5)
    evs = drain(e)
    ab = first(evs, Finished, "hog")
    assert isinstance(ab, Finished) and ab.reason == "abort" and 0 < ab.completion_tokens < 3000
    st = first(evs, Started, "next")
    assert 0.5 <= st.t < 0.6
    assert e.load().used_tokens == e.cache.used_tokens
    assert e.cache.evictable_tokens == e.cache.used_tokens  # nothing pinned, nothing reserved


def test_abort_waiting_and_unknown() -> None:
    prof = get_profile("small-test").with_overrides(max_running_requests=1)
    e = ReplicaEngine(prof)
    e.submit(req("a", "a" * 400, 50, prof.page_size), 0.0)
    e.submit(req("b", "b" * 400, 50, prof.page_size), 0.0)
    assert e.abort("b", 0.001)
    assert not e.abort("nope", 0.001)
    evs = drain(e)
    assert [ev.rid for ev in evs if isinstance(ev, Started)] == ["a"]  # b never started
    assert first(evs, Finished, "b").reason == "abort"  # type: ignore[union-attr]


def test_kv_full_blocks_admission_until_space() -> None:
    prof = get_profile("small-test").with_overrides(host_capacity_tokens=0, max_running_requests=8)
    e = ReplicaEngine(prof)
    e.submit(req("big1", "1" * 4 * 3000, 1000, prof.page_size), 0.0)  # 4000 of 8192 slots
    e.submit(req("big2", "2" * 4 * 3000, 1000, prof.page_size), 0.0)
    e.submit(req("big3", "3" * 4 * 3000, 1000, prof.page_size), 0.0)  # must wait
    evs = drain(e, until=1.0)
    assert e.load().running == 2 and e.load().queued == 1
    evs += drain(e)
    s3 = first(evs, Started, "big3").t
    assert s3 >= min(ev.t for ev in evs if isinstance(ev, Finished))


def test_a_waiting_prefix_stays_cached_behind_a_cold_head_of_line() -> None:
    """Rule 6: a warm turn queued behind a cold prompt keeps its context while the cold one is
    admitted, as SGLang's waiting-prefix refresh keeps it: the admission evicts an older
    session's cache instead (without the refresh, the warm turn's own context went first)."""
    prof = get_profile("small-test").with_overrides(host_capacity_tokens=0, max_running_requests=8)
    page = prof.page_size
    e = ReplicaEngine(prof)
    ctx_a = "a" * 4 * 2000
    e.submit(req("prime-a", ctx_a, 1, page), 0.0)
    drain(e)
    e.submit(req("prime-b", "b" * 4 * 2000, 1, page), 10.0)  # cached after a: the newer of the two
    drain(e)
    e.submit(req("busy", "c" * 4 * 100, 3900, page), 20.0)  # holds 4,000 of 8,192 slots while it decodes
    e.advance(20.5)
    e.submit(req("cold", "d" * 4 * 4400, 100, page), 21.0)  # fits only once busy has finished
    e.submit(req("warm-a", ctx_a + " and the next user message", 5, page), 21.0)
    for i in range(40):  # admission rounds (each arrival is one): SGLang refreshes every 32nd
        e.submit(req(f"small-{i}", f"{i:03d}" * 20, 1, page), 21.1 + i / 10)
    assert e.advance(26.0) == [] and e.load().queued == 42
    evs = drain(e)
    cold, warm = (first(evs, Started, rid) for rid in ("cold", "warm-a"))
    assert isinstance(cold, Started) and isinstance(warm, Started) and cold.t <= warm.t
    assert warm.cached_device == 2000 // page * page  # all of a's context, still there
    assert e.cache.match(block_hashes(encode_text("b" * 4 * 2000), page)).tokens < 2000  # b paid for it


def test_refuses_request_bigger_than_pool() -> None:
    prof = get_profile("small-test")
    e = ReplicaEngine(prof)
    with pytest.raises(ValueError):
        e.submit(req("huge", "z" * 4 * 9000, 10, prof.page_size), 0.0)
    with pytest.raises(ValueError):
        e.submit(EngineRequest("neg", 10, [], -1), 0.0)


def test_host_tier_hit_costs_reload_not_recompute() -> None:
    prof = get_profile("small-test").with_overrides(max_running_requests=1)
    e = ReplicaEngine(prof)
    a = "A" * 4 * 5000
    e.submit(req("a1", a, 5, prof.page_size), 0.0)
    drain(e)
    e.submit(req("b1", "B" * 4 * 6000, 5, prof.page_size), 100.0)  # pushes a to host
    drain(e)
    e.submit(req("a2", a + "more" * 10, 5, prof.page_size), 200.0)
    evs = drain(e)
    st = first(evs, Started, "a2")
    assert isinstance(st, Started) and st.cached_host > 2000 and st.cached_device + st.cached_host >= 4990
    ttft = first(evs, FirstToken, "a2").t - 200.0
    e_cold = ReplicaEngine(prof)
    e_cold.submit(req("a2", a + "more" * 10, 5, prof.page_size), 0.0)
    ttft_cold = first(drain(e_cold), FirstToken, "a2").t
    assert ttft < ttft_cold / 3


def test_token_unit_scales_time_and_capacity() -> None:
    p1 = KIMI
    p8 = KIMI.with_overrides(token_unit=8)
    assert p8.capacity_tokens == 850_000 // 8 and p8.host_tokens == 1_700_000 // 8
    e1, e8 = ReplicaEngine(p1), ReplicaEngine(p8)
    e1.submit(req("r", "x" * 4 * 80_000, 800, p1.page_size), 0.0)
    e8.submit(req("r", "x" * 4 * 10_000, 100, p8.page_size), 0.0)
    f1, f8 = first(drain(e1), Finished, "r"), first(drain(e8), Finished, "r")
    assert f8.t == pytest.approx(f1.t, rel=0.05)


def test_the_first_token_is_one_model_token_at_any_token_unit() -> None:
    """At ``token_unit`` 100 one emulated token is 100 model tokens; the first token is still one
    model token, so a reply decodes for as many steps as the model's would (it skipped ~18 steps of
    a 500-token reply when the first token counted one emulated token)."""
    p1, p100 = KIMI, KIMI.with_overrides(token_unit=100)
    e1, e100 = ReplicaEngine(p1), ReplicaEngine(p100)
    e1.submit(req("r", "x" * 4 * 80_000, 500, p1.page_size), 0.0)
    e100.submit(req("r", "x" * 4 * 800, 5, p100.page_size), 0.0)
    ev1, ev100 = drain(e1), drain(e100)
    decode1 = first(ev1, Finished, "r").t - first(ev1, FirstToken, "r").t
    decode100 = first(ev100, Finished, "r").t - first(ev100, FirstToken, "r").t
    assert decode100 == pytest.approx(decode1, rel=0.01)
    assert first(ev100, Finished, "r").completion_tokens == 5


def test_an_abort_after_the_first_token_reports_it() -> None:
    prof = KIMI.with_overrides(token_unit=100)
    e = ReplicaEngine(prof)
    e.submit(req("r", "x" * 4 * 100, 5, prof.page_size), 0.0)
    evs: list[EngineEvent] = []
    while not any(isinstance(ev, FirstToken) for ev in evs):
        t = e.next_event_time()
        assert t is not None
        evs = e.advance(t)
    ft = first(evs, FirstToken, "r").t
    assert e.progress("r", ft).tokens == 0  # a hundredth of an emulated token so far
    e.abort("r", ft)
    assert first(e.advance(ft), Finished, "r").completion_tokens == 1  # the stream has shown one


def test_progress_counts_tokens_in_closed_form() -> None:
    prof = KIMI.with_overrides(spec_accept_length=4.0)
    e = ReplicaEngine(prof)
    e.submit(req("r", "p" * 4000, 401, prof.page_size), 0.0)
    ft = first(drain(e, until=0.5), FirstToken, "r").t
    step = decode_step_time(prof, 1, 1001)
    pr = e.progress("r", ft + 10.5 * step)
    assert pr.tokens == 1 + 40 and not pr.finished
    assert pr.next_time is not None and pr.next_time == pytest.approx(ft + 11 * step, rel=1e-3)
    drain(e)
    assert e.progress("r", 100.0).finished


def test_profiles_and_overrides() -> None:
    assert set(PROFILES) >= {"kimi-k2.6-b200-tp4", "small-test"}
    assert KIMI.kv_capacity_tokens == 850_000 and KIMI.host_capacity_tokens == 1_700_000
    assert KIMI.spec_accept_length == 5.5
    p = KIMI.with_overrides(**{"max-running-requests": "8", "spec_accept_length": "3.5"})
    assert p.max_running_requests == 8 and p.spec_accept_length == 3.5
    with pytest.raises(ValueError):
        KIMI.with_overrides(nope=1)
    with pytest.raises(ValueError):
        Profile(page_size=0)
    with pytest.raises(ValueError):
        get_profile("gpt-9")


def test_engine_cost_is_per_request_not_per_token() -> None:
    """10k requests with long outputs through one engine: must be cheap (simulator budget)."""
    prof = KIMI
    e = ReplicaEngine(prof, PrefixCache(prof.capacity_tokens, prof.page_size, prof.host_tokens))
    n = 4000
    t0 = time.process_time()
    now = 0.0
    for i in range(n):
        now += 0.05
        hashes = [(i % 40) * 1_000_003 + k for k in range(200)]  # 40 "sessions", 12.8k tokens
        e.submit(EngineRequest(f"r{i}", 200 * 64 + 10, hashes, 2000), now)
        e.advance(now)
    drain(e)
    cpu = time.process_time() - t0
    assert e.finished_count == n
    assert cpu / n < 0.002, cpu / n


def test_forgotten_requests_leave_no_state() -> None:
    prof = get_profile("small-test")
    e = ReplicaEngine(prof)
    for i in range(3):
        e.submit(req(f"r{i}", f"{i}" * 400, 300, prof.page_size), 0.0)
    drain(e, until=0.3)
    e.abort("r0", 0.3)
    evs = e.advance(0.3)
    for ev in evs:
        if isinstance(ev, Finished):
            e.forget(ev.rid)  # what the server and the simulator do on Finished
    for ev in drain(e):
        if isinstance(ev, Finished):
            e.forget(ev.rid)
    assert e._reqs == {}
    assert e.cache.stats().reserved_tokens == 0


@pytest.mark.parametrize(("policy", "warm_first"), [("fcfs", False), ("lpm", True), ("shortest-prefill-first", True)])
def test_schedule_policy_orders_the_waiting_queue(policy: str, warm_first: bool) -> None:
    """One slot, busy; a cold prompt arrives, then a warm continuation of what the cache holds. FCFS
    admits them in arrival order; SGLang's cache-aware policies admit the warm one first."""
    profile = KIMI.with_overrides(max_running_requests=1, page_size=16, schedule_policy=policy)
    page = profile.page_size
    e = ReplicaEngine(profile)
    history = "the session's long context " * 400
    e.submit(req("prime", history, 1, page), 0.0)
    drain(e)
    e.submit(req("busy", "an unrelated request " * 50, 200, page), 1.0)
    e.advance(1.0)
    e.submit(req("cold", "a brand new session's first prompt " * 300, 5, page), 1.1)
    e.submit(req("warm", history + " and one more user message", 5, page), 1.2)
    evs = drain(e)
    started = [ev.rid for ev in evs if isinstance(ev, Started)]
    assert started[-2:] == (["warm", "cold"] if warm_first else ["cold", "warm"])
    cold, warm = (first(evs, Started, rid) for rid in ("cold", "warm"))
    assert isinstance(warm, Started) and warm.cached_device > 0 and isinstance(cold, Started) and cold.cached_device == 0


def test_schedule_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        KIMI.with_overrides(schedule_policy="nope")


def _decode_through_a_long_prefill(interval: int, min_bs: int = 0) -> tuple[int, int, float]:
    """One request decoding, then a long cold prompt: how many tokens the decoding request had when
    the long prompt's prefill began and when its first token came, and that first token's time."""
    profile = KIMI.with_overrides(page_size=16, prefill_decode_interval=interval, prefill_decode_interval_min_bs=min_bs)
    e = ReplicaEngine(profile, token_events=True)
    e.submit(req("dec", "a short question " * 20, 2_000, 16), 0.0)
    drain(e, until=0.5)
    e.submit(req("long", "a brand new session's first prompt " * 6_000, 1, 16), 0.5)
    evs = drain(e)
    started, ft = first(evs, Started, "long").t, first(evs, FirstToken, "long").t
    before = max(ev.n for ev in evs if isinstance(ev, Tokens) and ev.rid == "dec" and ev.t <= started)
    during = max(ev.n for ev in evs if isinstance(ev, Tokens) and ev.rid == "dec" and ev.t <= ft)
    return before, during, ft - 0.5


def test_a_long_prefill_stalls_every_decode_unless_the_interval_lets_them_step() -> None:
    """SGLang runs a prefill whenever one can run: a long prompt's chunks follow one another and the
    running requests generate nothing until its last chunk. With ``--prefill-decode-interval`` N
    each chunk is followed by N decode steps: they keep generating, and the long prompt's first
    token comes later by about those steps."""
    chunks = -(-encode_text("a brand new session's first prompt " * 6_000).num_tokens // KIMI.chunked_prefill_size)
    assert chunks >= 4
    before, during, ttft = _decode_through_a_long_prefill(0)
    assert during == before  # stalled for the whole prefill
    step = KIMI.spec_accept_length
    before4, during4, ttft4 = _decode_through_a_long_prefill(4)
    assert before4 == before
    # 4 steps after every chunk but the last (the last one's first token ends the window)
    assert during4 - before4 == pytest.approx(4 * step * (chunks - 1), abs=step)
    decode_s = decode_step_time(KIMI, 1, 60_000)
    assert ttft < ttft4 < ttft + 4 * (chunks - 1) * 2 * decode_s
    assert ttft4 - ttft > 4 * (chunks - 1) * 0.5 * decode_s
    # the interval applies only while at least min_bs requests decode: one is not enough for 2
    assert _decode_through_a_long_prefill(4, min_bs=2) == (before, during, ttft)


def test_prefill_decode_interval_is_validated() -> None:
    for field in ("prefill_decode_interval", "prefill_decode_interval_min_bs"):
        with pytest.raises(ValueError, match=field):
            KIMI.with_overrides(**{field: -1})

"""Exact residency against a real SGLang 0.5.23 (CPU, tiny random Qwen2, page_size 1), through the
gateway: the gateway reads the engine's ``/server_info.kv_events``, subscribes, forwards the session
id (so the engine names the session on the blocks it stores), and its snapshot's
``resident_tokens`` for a session must agree with the ``cached_tokens`` the engine reports on that
session's next turn: never less than what the next prompt shares with the last one while the session
is resident, and exactly equal once another session's prompt has evicted part of it (a 3,000-token
pool). Both with pages of one token and of 16 (a GPU deployment pages its KV; only whole pages are
cached). Then the engine is restarted on the same ports: the subscriber rebuilds from its sequence 0.

Needs the CPU SGLang runtime (``replica/build_sglang_cpu_env.sh``: ``$KVROUTE_SGLANG_HOME``, default
``~/.cache/kvroute/sglang-cpu``, or ``$KVROUTE_SGLANG_PYTHON``); a failure under CI when missing, a
skip elsewhere. Three servers (one per page size, one with a short replay buffer), started together
and spread over the CPUs, ~30-60 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtests.peers import PEERS, find_binary, running_router, with_engine_dp
from loadtests.procs import free_port
from loadtests.real_sglang import (
    RealServer,
    runtime_missing,
    start_real_server,
    stop_real_server,
    wait_healthy,
)
from router.clock import SystemClock
from router.gateway.serve import RunningGateway, start_gateway
from router.handoff import HANDOFF_KEY, HandoffConfig, handoff_setup
from router.model import ReplicaStatus
from router.policy.hashing import hrw_weight
from router.residency import EVENTS
from router.store.memory import MemoryStore
from tests.ci import missing
from tests.router.conftest import fast_config, wait_for

pytestmark = pytest.mark.slow

POOL = 3000
PAGES = (1, 16)
ROLLED = 4
# a turn finds its previous prompt cached but for the last few tokens: the real tokenizer may merge the
# end of that prompt with the reply appended after it (seen: 199 of 200); a rank that never held the
# session would have only the few template tokens every session starts with
_BPE_SEAM = 3


def aligned(n: int, page: int) -> int:
    """What the engine caches of ``n`` tokens: whole pages."""
    return n // page * page


class _Server:
    """One real SGLang (``kvroute launch --profile sglang-cpu-tiny``) publishing KV events on fixed
    ports, so that a restart comes back on the same endpoints."""

    def __init__(self, ports: tuple[int, int, int], cpu: int, log_dir: Path, page: int = 1,
                 buffer_steps: int | None = None, dp: int = 1) -> None:  # fmt: skip
        self.port, self.kv_port, self.replay_port = ports
        self.cpu, self.log_dir, self.page, self.dp = cpu, log_dir, page, dp
        self.buffer_steps = buffer_steps  # SGLang's replay buffer (None: its default, 10,000 batches)
        self.real: RealServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        kv: dict[str, Any] = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.kv_port}", "bind": True,
                              "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}  # fmt: skip
        if self.buffer_steps is not None:
            kv["buffer_steps"] = self.buffer_steps
        self.real = start_real_server(self.port, self.cpu, log_dir=self.log_dir, max_total_tokens=POOL,
                                      context_length=4096,
                                      sets=[f"kv-events-config={json.dumps(kv)}", f"page-size={self.page}"],
                                      dp_size=self.dp)  # fmt: skip

    def wait(self) -> None:
        assert self.real is not None
        wait_healthy([self.real], timeout_s=240)

    def start(self) -> None:
        self.launch()
        self.wait()

    def stop(self) -> None:
        real, self.real = self.real, None
        if real is not None:
            stop_real_server(real)


@pytest.fixture(scope="module")
def started() -> Iterator[list[_Server]]:
    """Every server of this module, started together: one per page size of ``PAGES``, one that replays
    only its last ``ROLLED`` batches of KV events (its test needs it fresh), and one with two
    data-parallel ranks."""
    yield from _serve(*({"page": p} for p in PAGES), {"buffer_steps": ROLLED}, {"dp": 2})


@pytest.fixture
def servers(started: list[_Server]) -> dict[int, _Server]:
    return dict(zip(PAGES, started, strict=False))


@pytest.fixture
def server(started: list[_Server]) -> _Server:
    return started[0]


@pytest.fixture
def rolled_server(started: list[_Server]) -> _Server:
    return started[len(PAGES)]


@pytest.fixture
def dp_server(started: list[_Server]) -> _Server:
    return started[len(PAGES) + 1]


def _serve(*configs: dict[str, Any]) -> Iterator[list[_Server]]:
    """Servers of ``configs`` (``_Server``'s keyword arguments), started together (start-up is most of
    their cost) on CPUs of their own where there are enough."""
    why = runtime_missing()
    if why is not None:
        missing(why)
    cpus = sorted(os.sched_getaffinity(0), reverse=True)
    with tempfile.TemporaryDirectory(prefix="kvroute-kv-events-") as tmp:

        def launched(i: int, attempt: int) -> _Server:
            s = _Server((free_port(), free_port(), free_port()), cpus[i % len(cpus)],
                        Path(tmp) / f"{i}-{attempt}", **configs[i])  # fmt: skip
            s.launch()
            return s

        started = [launched(i, 0) for i in range(len(configs))]
        try:
            for i in range(len(started)):
                # The engine's start can fail once on a loaded machine (2 full runs in ~6 here: it
                # exited right after "ready", the cause cut from the log's tail; a port taken between
                # free_port() and the engine's bind is one way). One more start on fresh ports; a
                # second failure fails the test with both logs.
                try:
                    started[i].wait()
                except RuntimeError as first:
                    started[i].stop()
                    started[i] = launched(i, 1)
                    try:
                        started[i].wait()
                    except RuntimeError as second:
                        missing(f"real SGLang did not start: {first}\n---\n{second}")
            yield started
        finally:
            for s in started:
                s.stop()


@contextlib.asynccontextmanager
async def gateway(url: str, extra_setup: tuple[Any, ...] = (), **overrides: Any) -> AsyncIterator[RunningGateway]:
    cfg = fast_config([url], kv_events={"mode": "subscribe", "refresh_s": 0.5},
                      timeouts={"first_byte_s": 60.0, "idle_read_s": 60.0, "probe_s": 5.0}, **overrides)
    clock = SystemClock()
    gw = await start_gateway(cfg, MemoryStore(clock, cfg.store.to_store_config()), clock=clock,
                             rng=random.Random(1), extra_setup=extra_setup)
    try:
        yield gw
    finally:
        await gw.close()


async def _chat(http: aiohttp.ClientSession, gw: RunningGateway, sid: str, msgs: list[dict[str, str]],
                max_tokens: int = 12) -> dict[str, Any]:
    body = {"model": "tiny", "messages": msgs, "max_tokens": max_tokens}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]


async def _cached_placed_resident(
    http: aiohttp.ClientSession, gw: RunningGateway, sid: str, msgs: list[dict[str, str]], max_tokens: int
) -> int:
    """The session's next turn through a gateway that did not know it: sent back to its cache
    (``placed_resident``); the engine's ``cached_tokens`` for it."""
    body = {"model": "tiny", "messages": msgs, "max_tokens": max_tokens}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Kvroute-Reason"] == "placed_resident"
        return int((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _resident(gw: RunningGateway, sid: str) -> int | None:
    snap = await gw.store.snapshot(sid)
    return None if snap.session is None else snap.session.resident_tokens


async def _settled(gw: RunningGateway, sid: str, at_least: int) -> int:
    """The session's resident tokens once the engine's batch for its last request arrived."""
    deadline = time.monotonic() + 20
    while True:
        v = await _resident(gw, sid)
        if v is not None and v >= at_least:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"resident tokens of {sid}: {v}, expected >= {at_least}")
        await _sleep()


async def _sleep() -> None:
    await asyncio.sleep(0.05)


@pytest.mark.parametrize("page", PAGES)
async def test_resident_prefix_matches_the_engines_cached_tokens(servers: dict[int, _Server], page: int) -> None:
    server = servers[page]
    async with gateway(server.url) as gw, aiohttp.ClientSession() as http:
        rid = f"127.0.0.1:{server.port}"
        svc = gw.runtime.residency
        assert svc is not None
        await wait_for(lambda: svc.view.source(rid) == EVENTS, 30)
        # a session grows turn by turn: what the events say is resident covers the next turn's hit
        msgs = [{"role": "user", "content": "Tell me how a radix cache keeps prefixes. " * 12}]
        d = await _chat(http, gw, "real-A", msgs)
        # the answers count the session's own tokens: beyond what it found cached at its first store
        base = d["usage"]["prompt_tokens_details"]["cached_tokens"]
        checked = 0
        for turn in range(3):
            u = d["usage"]
            # the engine caches the prompt at prefill, then prompt + output (but its last token) at the end
            resident = base + await _settled(gw, "real-A", aligned(u["prompt_tokens"] + u["completion_tokens"] - 1, page) - base)
            msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"and then what happens at step {turn}?"}]
            d = await _chat(http, gw, "real-A", msgs)
            cached = d["usage"]["prompt_tokens_details"]["cached_tokens"]
            # the next prompt repeats the last one (all of it resident) and then re-renders the answer
            # (its re-tokenised text may part from what the engine cached after the prompt, and its
            # first characters may merge with the prompt's last token, "assistant\n": seen once)
            assert aligned(u["prompt_tokens"] - 1, page) <= cached <= resident, (turn, u, cached, resident)
            print(f"turn {turn}: prompt {u['prompt_tokens']} + {u['completion_tokens']}, resident {resident}, "
                  f"next turn cached {cached}")
            checked += 1
        before = await _settled(gw, "real-A", aligned(d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"] - 1, page) - base)
        # another session's long prompt fills most of the 3,000-token pool: A loses its tail
        await _chat(http, gw, "real-B", [{"role": "user", "content": "Filler text that evicts the other session. " * 170}], 4)
        deadline = time.monotonic() + 20
        after = await _resident(gw, "real-A")
        while (after is None or after >= before) and time.monotonic() < deadline:
            await _sleep()
            after = await _resident(gw, "real-A")
        assert after is not None and after + base < d["usage"]["prompt_tokens"], (before, after)
        msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                {"role": "user", "content": "one more question"}]
        d = await _chat(http, gw, "real-A", msgs)
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == base + after  # exactly what was left
        print(f"evicted: resident {before} -> {after}; next turn cached {after} of {d['usage']['prompt_tokens']}")
        assert checked == 3
        subs = svc.manager.stats()[rid]["ranks"][0]
        assert subs["gaps"] == 0 and subs["decode_errors"] == 0 and subs["rebuilds"] == 1


@pytest.mark.parametrize("page", PAGES)
async def test_a_restarted_gateway_finds_each_sessions_cache_in_the_engines_replay(
    servers: dict[int, _Server], page: int
) -> None:
    """A gateway on embedded state forgets every session when it restarts; the engine does not. The
    new gateway asks the real engine to replay its KV events from sequence 0 (a fresh engine's buffer
    still holds them all), finds the session's blocks under its id, and sends its next turn back to
    that cache (``placed_resident``, not ``placed_new``)."""
    server = servers[page]
    rid = f"127.0.0.1:{server.port}"
    msgs = [{"role": "user", "content": "a session that outlives its gateway " * 15}]
    async with gateway(server.url) as first, aiohttp.ClientSession() as http:
        svc = first.runtime.residency
        assert svc is not None
        await wait_for(lambda: svc.view.source(rid) == EVENTS, 30)
        d = await _chat(http, first, "real-R", msgs)
        u = d["usage"]
        await _settled(first, "real-R", aligned(u["prompt_tokens"] + u["completion_tokens"] - 1, page) - u["prompt_tokens_details"]["cached_tokens"])
    msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and after the restart?"}]  # fmt: skip
    async with gateway(server.url) as second, aiohttp.ClientSession() as http:
        svc = second.runtime.residency
        assert svc is not None
        assert svc.view.source(rid) == EVENTS  # it listened only once the engine's replay was in
        assert await second.store.session("real-R") is None  # the store knows nothing of it
        snap = await second.store.snapshot("real-R")
        assert snap.session is not None and [r for r, _ in snap.session.resident_on] == [rid]
        cached = await _cached_placed_resident(http, second, "real-R", msgs, 4)
        assert cached >= aligned(u["prompt_tokens"] - 1, page), (cached, u)


async def test_an_engine_restart_is_rebuilt_from_sequence_zero(server: _Server) -> None:
    async with gateway(server.url) as gw, aiohttp.ClientSession() as http:
        rid = f"127.0.0.1:{server.port}"
        svc = gw.runtime.residency
        assert svc is not None
        await wait_for(lambda: svc.view.source(rid) == EVENTS, 30)
        d = await _chat(http, gw, "real-C", [{"role": "user", "content": "remember me " * 20}])
        u = d["usage"]  # its own tokens: beyond the template's head other sessions cached before it
        await _settled(gw, "real-C", u["prompt_tokens"] + u["completion_tokens"] - 1 - u["prompt_tokens_details"]["cached_tokens"])
        server.stop()
        await wait_for(lambda: svc.view.source(rid) != EVENTS, 30)  # disconnected: not exact any more
        assert await _resident(gw, "real-C") is None
        server.start()  # same ports: its sequence numbers start again at 0, its cache is empty
        await wait_for(lambda: svc.view.source(rid) == EVENTS, 60)
        assert await _resident(gw, "real-C") == 0
        st = svc.manager.stats()[rid]["ranks"][0]
        assert st["rebuilds"] >= 2 and st["disconnects"] >= 1


async def test_a_restarted_gateway_finds_a_session_after_the_engines_replay_buffer_rolled(
    rolled_server: _Server,
) -> None:
    """The engine has published more batches than it keeps, so a restarted gateway cannot rebuild its
    cache from sequence 0 (the mirror is incomplete, the session's depth unknown). The session's last
    turn stored its blocks within the buffer: the new gateway finds that block (``tip_on``) and sends
    the next turn to it, where the engine reports all of the previous prompt cached."""
    server = rolled_server
    rid = f"127.0.0.1:{server.port}"
    msgs = [{"role": "user", "content": "a session older than the replay buffer " * 15}]
    async with gateway(server.url) as first, aiohttp.ClientSession() as http:
        svc = first.runtime.residency
        assert svc is not None and svc.view.source(rid) == EVENTS
        for turn in range(6):  # two batches a turn (its prompt at prefill, prompt + answer at the end)
            d = await _chat(http, first, "real-O", msgs, max_tokens=8)
            msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"and at step {turn}?"}]  # fmt: skip
        last = d["usage"]
        seq = svc.manager.stats()[rid]["ranks"][0]["last_seq"]
        assert seq >= 2 * ROLLED, seq
    async with gateway(server.url) as second, aiohttp.ClientSession() as http:
        svc = second.runtime.residency
        assert svc is not None
        assert svc.view.source(rid) == "estimate"  # incomplete: the replay began after sequence 0
        snap = await second.store.snapshot("real-O")
        assert snap.session is not None and snap.session.resident_tokens is None, snap.session
        assert snap.session.resident_on == () and snap.session.tip_on == (rid,), snap.session
        cached = await _cached_placed_resident(http, second, "real-O", msgs, 2)
        assert cached >= last["prompt_tokens"] - _BPE_SEAM, (cached, last)


async def test_a_data_parallel_engine_keeps_each_session_on_its_own_rank(dp_server: _Server) -> None:
    """``--dp-size 2``: two schedulers, each with a cache and a publisher of its own (port base + rank),
    and the engine's own round robin between them. Sent straight to the engine, a conversation's
    second turn lands on the other rank and finds none of the first cached. Through the gateway
    (``X-Data-Parallel-Rank``) every turn finds the one before it cached, the session's blocks are
    on one rank only, and each new session goes to the rank holding fewer blocks."""
    server = dp_server
    rid = f"127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as http:  # before any gateway probes the engine (its /health is a generation)
        msgs = [{"role": "user", "content": "straight to a data-parallel engine " * 12}]
        firsts = []
        for _ in range(2):
            body = {"model": "tiny", "messages": msgs, "max_tokens": 8}
            async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                d = await r.json()
            firsts.append(d["usage"])
            msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "and then?"}]  # fmt: skip
        assert firsts[1]["prompt_tokens_details"]["cached_tokens"] < firsts[0]["prompt_tokens"] // 2, firsts
    async with gateway(server.url) as gw, aiohttp.ClientSession() as http:
        svc = gw.runtime.residency
        assert svc is not None and svc.manager is not None
        await wait_for(lambda: svc.view.source(rid) == EVENTS, 30)

        async def two_ranks() -> bool:
            return [r.engine.dp_ranks for r in (await gw.store.snapshot(None)).replicas] == [2]

        await wait_for(two_ranks, 30)
        ranks = svc.manager.index.ranks(rid)
        assert len(ranks) == 2

        def holding(sid: str) -> list[int]:
            return [i for i, r in enumerate(ranks) if r.resident_tokens(sid)]

        async def converse(sid: str, turns: int, text: str) -> None:
            msgs = [{"role": "user", "content": text}]
            last: dict[str, Any] | None = None
            for turn in range(turns):
                d = await _chat(http, gw, sid, msgs, max_tokens=8)
                u = d["usage"]
                if last is not None:  # the previous prompt and its answer, but for the answer's last token
                    assert u["prompt_tokens_details"]["cached_tokens"] >= last["prompt_tokens"] - _BPE_SEAM, (sid, turn, last, u)
                last = u
                msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"and at step {turn}?"}]  # fmt: skip
                await wait_for(lambda: holding(sid) != [], 20)  # its blocks are in before the next turn
                assert len(holding(sid)) == 1, (sid, turn)

        await converse("real-P", 4, "a session on a data-parallel engine " * 12)
        for i in range(4):  # new sessions, one after another: each where there is most room
            fewer = min((0, 1), key=lambda k: (ranks[k].resident_blocks, -hrw_weight(f"real-N{i}", str(k))))
            await converse(f"real-N{i}", 1, f"new session number {i} on the engine " * 10)
            assert holding(f"real-N{i}") == [fewer], i
        # two new sessions at once: the second goes to the rank the first is not in flight on, whatever
        # the ranks hold; every request's count is given back
        await asyncio.gather(*(converse(f"real-T{i}", 1, f"sessions started together, number {i} " * 10)
                               for i in range(2)))  # fmt: skip
        assert sorted(holding("real-T0") + holding("real-T1")) == [0, 1]
        assert not gw.runtime.rank_flights
        # a client whose body names its own session_id (one per conversation): the engine stores the
        # blocks under that name, so its rank is found by it; by the header's id (stored under no
        # name) each turn would go wherever fewer blocks are, away from the one before it
        msgs = [{"role": "user", "content": "a conversation named in the body " * 20}]
        turns = []
        for turn in range(3):
            body = {"model": "tiny", "messages": msgs, "max_tokens": 8, "session_id": "body-conv"}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": "real-H"}) as r:
                assert r.status == 200
                d = await r.json()
            turns.append(d["usage"])
            if turn:
                assert d["usage"]["prompt_tokens_details"]["cached_tokens"] >= turns[-2]["prompt_tokens"], turns
            msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"and at step {turn}?"}]  # fmt: skip
            await wait_for(lambda: holding("body-conv") != [], 20)
        assert len(holding("body-conv")) == 1 and holding("real-H") == []
        stats = svc.manager.stats()[rid]
        assert stats["dp_size"] == 2 and [s["connected"] for s in stats["ranks"]] == [True, True]


async def test_each_rank_of_a_data_parallel_engine_is_a_replica_of_its_own(dp_server: _Server) -> None:
    """``--replica-dp-ranks 2`` (what ``kvroute bench peers --engine-dp 2`` runs kvroute as): the policy
    places sessions over the engine's two ranks as over two replicas. Each reads its own rank's load
    and KV capacity (``/v1/loads?dp_rank=``) and follows its own rank's publisher; every request of a
    session names its replica's rank, so each turn finds the one before it cached on that rank alone."""
    server = dp_server
    engine = f"127.0.0.1:{server.port}"
    units = [f"{engine}-dp0", f"{engine}-dp1"]
    async with aiohttp.ClientSession() as http, http.get(server.url + "/server_info") as r:
        info = await r.json()
    per_rank = info["max_total_num_tokens"]  # one rank's pool
    async with gateway(server.url, replica_dp_ranks=2) as gw, aiohttp.ClientSession() as http:
        svc = gw.runtime.residency
        assert svc is not None and svc.manager is not None

        async def read() -> bool:
            reps = (await gw.store.snapshot(None)).replicas
            return [(r.id, r.dp_rank, r.engine.dp_ranks, r.capacity_tokens, r.status.value) for r in reps] == [
                (units[0], 0, 1, per_rank, "active"), (units[1], 1, 1, per_rank, "active")]  # fmt: skip

        await wait_for(read, 30)
        await wait_for(lambda: all(svc.view.source(u) == EVENTS for u in units), 30)
        stats = svc.manager.stats()
        base = info["kv_events"]["endpoint_port_base"]
        assert [(stats[u]["dp_size"], stats[u]["endpoint"]) for u in units] == [
            (1, f"tcp://127.0.0.1:{base}"), (1, f"tcp://127.0.0.1:{base + 1}")]  # fmt: skip
        assert all(s["connected"] for u in units for s in stats[u]["ranks"])

        def holding(sid: str) -> list[str]:
            return [u for u in units if svc.manager.index.ranks(u)[0].resident_tokens(sid)]

        placed: dict[str, str] = {}
        for i in range(6):  # new sessions one after another, then a second and third turn of each
            sid = f"rank-unit-{i}"
            msgs = [{"role": "user", "content": f"session {i} on one rank of a data-parallel engine " * 10}]
            last: dict[str, Any] | None = None
            for turn in range(3):
                body = {"model": "tiny", "messages": msgs, "max_tokens": 8}
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                    assert r.status == 200, await r.text()
                    where = r.headers["X-Kvroute-Replica"]
                    d = await r.json()
                assert placed.setdefault(sid, where) == where, (sid, turn)
                u = d["usage"]
                if last is not None:
                    assert u["prompt_tokens_details"]["cached_tokens"] >= last["prompt_tokens"] - _BPE_SEAM, (sid, turn, last, u)
                last = u
                msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"and at step {turn}?"}]  # fmt: skip
                await wait_for(lambda sid=sid: holding(sid) != [], 20)  # type: ignore[misc]
                assert holding(sid) == [where], (sid, turn)
        # the working set of what a rank holds weighs in placing the next: both ranks get sessions
        assert set(placed.values()) == set(units), placed
        # native /generate takes its rank from the body: the gateway puts its replica's rank there
        text = "a native session on one rank " * 12
        for turn in range(2):
            body = {"text": text, "sampling_params": {"max_new_tokens": 4}}
            async with http.post(gw.url + "/generate", json=body, headers={"Modal-Session-Id": "native-rank"}) as r:
                assert r.status == 200, await r.text()
                where = r.headers["X-Kvroute-Replica"]
                meta = (await r.json())["meta_info"]
            assert meta["dp_rank"] == units.index(where), (where, meta)
            if turn:
                assert meta["cached_tokens"] >= meta["prompt_tokens"] - 1, meta
        assert not gw.runtime.rank_flights


async def test_a_rank_the_real_engine_does_not_have_is_never_in_service(dp_server: _Server) -> None:
    """Three rank replicas in front of the ``--dp-size 2`` engine: SGLang answers ``/v1/loads?dp_rank=2``
    with an empty list and would refuse every request named to rank 2 (``routed_dp_rank=2 out of
    range``), so that replica stays JOINING while the two real ranks serve."""
    engine = f"127.0.0.1:{dp_server.port}"
    async with gateway(dp_server.url, replica_dp_ranks=3) as gw, aiohttp.ClientSession() as http:
        async def statuses() -> list[str]:
            return [r.status.value for r in (await gw.store.snapshot(None)).replicas]

        async def two_active() -> bool:
            return await statuses() == ["active", "active", "joining"]

        await wait_for(two_active, 30)
        await asyncio.sleep(2.0)  # many health and scrape rounds
        assert await statuses() == ["active", "active", "joining"]
        for i in range(4):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"rank check {i}"}], "max_tokens": 4}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": f"rc{i}"}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Kvroute-Replica"] in (f"{engine}-dp0", f"{engine}-dp1")


async def test_a_draining_rank_hands_its_sessions_warm_to_another_rank(dp_server: _Server) -> None:
    """Warm hand-off (``--warm-handoff``) between two ranks of one engine: while a rank drains, its
    idle sessions' last prompts are prefilled on the other rank (named in the header), so each
    session's next turn, placed there, finds its whole previous prompt cached."""
    server = dp_server
    engine = f"127.0.0.1:{server.port}"
    setup = (handoff_setup(HandoffConfig(interval_s=0.1)),)
    async with gateway(server.url, extra_setup=setup, replica_dp_ranks=2) as gw, aiohttp.ClientSession() as http:
        async def both() -> bool:
            return len([r for r in (await gw.store.snapshot(None)).replicas if r.status is ReplicaStatus.ACTIVE]) == 2

        await wait_for(both, 30)
        convs: dict[str, list[dict[str, str]]] = {}
        first: dict[str, tuple[str, int]] = {}
        for i in range(4):
            sid = f"handoff-{i}"
            convs[sid] = [{"role": "user", "content": f"a session handed from rank to rank, number {i} " * 10}]
            body = {"model": "tiny", "messages": convs[sid], "max_tokens": 8}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                assert r.status == 200, await r.text()
                d = await r.json()
                first[sid] = (r.headers["X-Kvroute-Replica"], d["usage"]["prompt_tokens"])
            convs[sid] += [{"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                           {"role": "user", "content": "and now?"}]  # fmt: skip
        victim = f"{engine}-dp0" if any(w == f"{engine}-dp0" for w, _ in first.values()) else f"{engine}-dp1"
        moved = [sid for sid, (w, _) in first.items() if w == victim]
        await gw.store.set_status(victim, ReplicaStatus.DRAINING)
        manager = gw.app[HANDOFF_KEY]
        await wait_for(lambda: manager.stats.sent + manager.stats.failed >= len(moved), 60)
        assert manager.stats.failed == 0, manager.stats
        for sid in moved:
            body = {"model": "tiny", "messages": convs[sid], "max_tokens": 8}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                assert r.status == 200
                assert r.headers["X-Kvroute-Replica"] != victim
                u = (await r.json())["usage"]
            # as the emulator's hand-off test: its previous prompt all but a token or so (a cold rank
            # would hold only the few tokens every session here starts with)
            assert u["prompt_tokens_details"]["cached_tokens"] >= 0.9 * first[sid][1], (sid, first[sid], u)


@pytest.mark.peers
@pytest.mark.parametrize("target", ["sglang-cache_aware", "vllm-consistent_hash"])
async def test_each_peer_in_its_own_data_parallel_mode_keeps_a_conversation_on_one_rank(
    dp_server: _Server, target: str, tmp_path: Path
) -> None:
    """What ``kvroute bench peers --engine-dp 2`` runs the peers as (``with_engine_dp``): sglang-router
    with ``--dp-aware`` (each rank a worker, the rank named in the body) and vllm-router with
    ``--intra-node-data-parallel-size 2`` (the rank in a header). Left to the engine's round robin a
    second turn finds less than half of the first cached (the first test above); in these modes every
    turn finds the one before it, so the peers are compared at their best on data-parallel engines."""
    spec = with_engine_dp(PEERS[target], 2)
    assert spec.args and spec.args != PEERS[target].args
    if find_binary(spec.binary) is None:
        missing(f"{spec.binary} is not installed (pip install 'kvroute[peers]')")
    async with running_router(spec, [dp_server.url], log_dir=tmp_path) as peer, aiohttp.ClientSession() as http:
        msgs = [{"role": "user", "content": f"a conversation through {target} " * 12}]
        usages: list[dict[str, Any]] = []
        for turn in range(4):
            body = {"model": "tiny", "messages": msgs, "max_tokens": 8}
            sticky = {"X-SMG-Routing-Key": "peer-conv", "x-session-id": "peer-conv"}
            async with http.post(peer.url + "/v1/chat/completions", json=body, headers=sticky) as r:
                assert r.status == 200, await r.text()
                d = await r.json()
            usages.append(d["usage"])
            if turn:
                assert d["usage"]["prompt_tokens_details"]["cached_tokens"] >= usages[-2]["prompt_tokens"] - _BPE_SEAM, usages
            msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"and at step {turn}?"}]  # fmt: skip

"""The KV-event subscriber (router/kv_events.py) against the emulator's ZMQ publisher, over real
sockets: stores, removals, clears, gaps (replayed or not), a late join, a restarted publisher, a
lost connection, and the manager driven by a live emulator's /server_info."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from replica.emulator.kv_events import KvEventsConfig, KvEventsPublisher
from replica.emulator.profiles import get_profile
from replica.emulator.runner import running_emulators
from replica.emulator.server import EmulatorConfig
from router.kv_events import KvEventsManager, KvEventSubscriber
from router.residency import EVENTS, ReplicaResidency, ResidencyIndex


def local(port: str = "*", replay_port: str | None = "*", **extra: Any) -> str:
    """SGLang's --kv-events-config JSON on 127.0.0.1 (``*``: a free port, an emulator extension)."""
    cfg: dict[str, Any] = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return json.dumps({**cfg, **extra})


from tests.router.conftest import wait_for

until = functools.partial(wait_for, timeout_s=10.0)  # events cross sockets and processes: a longer wait


def stored(hashes: list[int], parent: int | None, sid: str | None = None, block: int = 4) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                          "token_ids": [7] * (block * len(hashes)), "block_size": block, "lora_id": None,
                          "medium": "GPU"}
    if sid is not None:
        ev["session_id"] = sid
    return ev


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}


@contextlib.asynccontextmanager
async def publisher(port: str = "*", replay_port: str | None = "*", **extra: Any) -> AsyncIterator[KvEventsPublisher]:
    raw = local(port, replay_port, **extra)
    pub = KvEventsPublisher(KvEventsConfig.from_cli(raw))
    pub.start()
    try:
        yield pub
    finally:
        await pub.close()


@contextlib.asynccontextmanager
async def subscribed(pub: KvEventsPublisher, sink: ReplicaResidency, replay: bool = True) -> AsyncIterator[KvEventSubscriber]:
    assert pub.bound is not None
    sub = KvEventSubscriber(pub.bound, sink, replay_endpoint=pub.bound_replay if replay else None,
                            replay_timeout_s=2.0)
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_stores_removals_and_clear_over_the_wire() -> None:
    sink = ReplicaResidency()
    async with publisher() as pub:
        pub.publish([CLEARED])  # seq 0: the cache's creation
        async with subscribed(pub, sink) as sub:
            await until(lambda: sub.stats.syncs == 1 and not sink.stale)
            assert sink.complete and sub.stats.rebuilds == 1
            pub.publish([stored([1, 2, 3], None, "s")])
            await until(lambda: sink.resident_tokens("s") == 12)
            pub.publish([stored([4], 3, "s"), removed([4, 3])])
            await until(lambda: sink.resident_tokens("s") == 8)
            pub.publish([CLEARED])
            await until(lambda: sink.resident_tokens("s") == 0 and sink.resident_blocks == 0)
            assert sub.stats.gaps == 0 and sub.stats.decode_errors == 0


async def test_late_join_replays_the_whole_history() -> None:
    sink = ReplicaResidency()
    async with publisher() as pub:
        pub.publish([CLEARED])
        pub.publish([stored([1, 2], None, "s")])
        pub.publish([stored([3], 2, "s")])
        await until(lambda: pub.published == 3)
        async with subscribed(pub, sink) as sub:
            await until(lambda: sink.resident_tokens("s") == 12)
            assert sink.complete and sub.stats.rebuilds == 1 and pub.replays == 1


async def test_late_join_after_the_buffer_rolled_is_an_estimate_until_a_clear() -> None:
    sink = ReplicaResidency()
    async with publisher(buffer_steps=2) as pub:
        pub.publish([CLEARED])
        pub.publish([stored([1, 2], None, "old")])
        pub.publish([stored([3], 2, "old")])
        pub.publish([stored([9], None, "fresh")])
        await until(lambda: pub.published == 4)
        async with subscribed(pub, sink) as sub:
            await until(lambda: sub.stats.syncs == 1 and not sink.stale)
            assert not sink.complete
            # replayed: seq 2 hangs below a block we never saw, seq 3 starts at the root
            assert sink.resident_tokens("old") is None
            assert sink.resident_tokens("fresh") == 4
            assert sink.resident_tokens("nobody") is None
            pub.publish([CLEARED, stored([5], None, "s")])
            await until(lambda: sink.complete)
            assert sink.resident_tokens("s") == 4 and sink.resident_tokens("nobody") == 0


async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    sink = ReplicaResidency()
    async with publisher() as pub:
        pub.publish([CLEARED])
        async with subscribed(pub, sink) as sub:
            await until(lambda: sub.stats.syncs == 1 and not sink.stale)
            pub.publish([stored([1, 2], None, "s")], drop_live=True)  # lost on the live stream
            pub.publish([stored([3], 2, "s")])
            await until(lambda: sink.resident_tokens("s") == 12)
            assert sub.stats.gaps == 1 and sub.stats.gaps_unrecovered == 0 and sink.complete


async def test_an_unreplayable_gap_drops_to_estimate() -> None:
    sink = ReplicaResidency()
    async with publisher(replay_port=None) as pub, subscribed(pub, sink, replay=False) as sub:
        await until(lambda: sub.connected)
        # without a replay socket the first batches may be missed (ZMQ's slow joiner); a clear
        # is a complete point whatever its sequence number
        pub.publish([CLEARED, stored([1], None, "a")])
        await until(lambda: sink.resident_tokens("a") == 4)
        assert sink.complete
        pub.publish([stored([2], 1, "a")], drop_live=True)
        pub.publish([stored([9], None, "b")])
        await until(lambda: sub.stats.gaps == 1)
        assert not sink.complete and sub.stats.gaps_unrecovered == 1
        assert sink.resident_tokens("a") is None and sink.resident_tokens("b") == 4


async def test_a_restarted_publisher_is_rebuilt_from_its_sequence_zero() -> None:
    sink = ReplicaResidency()
    async with publisher() as pub:
        pub.publish([CLEARED, stored([1, 2], None, "s")])
        assert pub.bound is not None and pub.bound_replay is not None
        port, rport = pub.bound.rpartition(":")[2], pub.bound_replay.rpartition(":")[2]
        endpoint, replay = pub.bound, pub.bound_replay
        sub = KvEventSubscriber(endpoint, sink, replay_endpoint=replay)
        task = asyncio.create_task(sub.run())
        try:
            await until(lambda: sink.resident_tokens("s") == 8)
            await pub.close()
            await until(lambda: sink.stale)  # disconnected: answers are None
            assert sink.resident_tokens("s") is None
            # same ports (a concrete address binds only when told to, as in SGLang); sequence from 0
            async with publisher(port, rport, bind=True) as pub2:
                pub2.publish([CLEARED, stored([5], None, "t")])
                await until(lambda: not sink.stale and sink.resident_tokens("t") == 4)
                assert sink.complete and sink.resident_tokens("s") == 0  # the old cache is gone
                assert sub.stats.rebuilds == 2 and sub.stats.disconnects >= 1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_no_replay_and_joining_late_is_incomplete() -> None:
    sink = ReplicaResidency()
    async with publisher(replay_port=None) as pub:
        pub.publish([CLEARED])
        await until(lambda: pub.published == 1)
        async with subscribed(pub, sink, replay=False) as sub:
            await until(lambda: sub.connected)
            pub.publish([stored([1], None, "a")])
            await until(lambda: sub.stats.batches == 1)
            assert not sink.complete and sink.resident_tokens("a") == 4


def _emu_config(**kw: Any) -> EmulatorConfig:
    prof = get_profile("small-test").with_overrides(kv_capacity_tokens=1024, host_capacity_tokens=0)
    return EmulatorConfig(profile=prof, time_scale=0.01, kv_events_config=local(), **kw)


async def test_manager_follows_a_live_emulator_and_matches_cached_tokens() -> None:
    """A session's resident prefix, as the events say, is what the engine reports as cached on the
    session's next turn: before and after other sessions evict it."""
    async with running_emulators(1, config=_emu_config()) as reps, aiohttp.ClientSession() as http:
        url = reps[0].url

        async def fetch(rid: str, u: str) -> dict[str, Any] | None:
            async with http.get(u) as r:
                return await r.json()  # type: ignore[no-any-return]

        idx = ResidencyIndex()
        mgr = KvEventsManager(idx, fetch)
        try:
            await mgr.refresh([("r0", url)])
            assert mgr.subscribed() == ("r0",)
            await until(lambda: idx.source("r0") == EVENTS)

            async def turn(sid: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
                body = {"messages": msgs, "max_tokens": 8, "session_id": sid}
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    return await r.json()  # type: ignore[no-any-return]

            pub = reps[0].replica.kv_publisher
            assert pub is not None

            async def synced() -> None:  # the subscriber applied every batch published so far
                await until(lambda: mgr_last_seq(mgr) == pub.stats()["next_seq"] - 1)

            msgs = [{"role": "user", "content": "tell me about caches " * 10}]
            checked = 0
            d = await turn("A", msgs)
            for i in range(6):
                await synced()
                want = idx.resident_tokens("r0", "A")
                msgs = [*msgs, {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"turn {i} " * 8}]
                if i == 3:  # another session fills most of the 1024-token pool: A loses its tail
                    await turn("B", [{"role": "user", "content": "x" * 3600}])
                    await synced()
                    before, want = want, idx.resident_tokens("r0", "A")
                    assert want is not None and before is not None and want < before
                d = await turn("A", msgs)
                cached = d["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert want == cached, (i, want, cached)
                checked += 1
            assert checked == 6
            # /flush_cache is an AllBlocksCleared: everything reads 0, still exact
            async with http.post(url + "/flush_cache") as r:
                assert r.status == 200
            await until(lambda: idx.resident_tokens("r0", "A") == 0)
            assert idx.source("r0") == EVENTS
            st = mgr.stats()["r0"]["ranks"][0]
            assert st["gaps"] == 0 and st["decode_errors"] == 0 and st["connected"]
            # the replica is gone from the registry: unsubscribed and forgotten
            await mgr.refresh([])
            assert mgr.subscribed() == () and idx.source("r0") == "off"
        finally:
            await mgr.close()


def mgr_last_seq(mgr: KvEventsManager) -> int:
    return int(mgr.stats()["r0"]["ranks"][0]["last_seq"])


async def test_manager_ignores_a_replica_without_events() -> None:
    cfg = dataclasses_replace(_emu_config(), kv_events_config=None)
    async with running_emulators(1, config=cfg) as reps, aiohttp.ClientSession() as http:

        async def fetch(rid: str, u: str) -> dict[str, Any] | None:
            async with http.get(u) as r:
                return await r.json()  # type: ignore[no-any-return]

        idx = ResidencyIndex()
        mgr = KvEventsManager(idx, fetch)
        try:
            await mgr.refresh([("r0", reps[0].url)])
            assert mgr.subscribed() == () and idx.source("r0") == "off"
        finally:
            await mgr.close()


def dataclasses_replace(cfg: EmulatorConfig, **kw: Any) -> EmulatorConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize("bad", ['{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*"}'])
async def test_emulator_reports_its_config_back(bad: str) -> None:
    cfg = dataclasses_replace(_emu_config(), kv_events_config=bad)
    async with running_emulators(1, config=cfg) as reps, aiohttp.ClientSession() as http:
        async with http.get(reps[0].url + "/server_info") as r:
            info = await r.json()
        assert info["kv_events_config"] == bad
        kv = info["kv_events"]
        assert kv["publisher"] == "zmq" and kv["endpoint_host"] == "127.0.0.1" and kv["block_size"] == 16
        assert "replay_endpoint_port_base" not in kv and kv["dp_size"] == 1
        assert json.loads(bad)["endpoint"].endswith(":*")


async def test_wait_synced_returns_once_the_replay_is_in_and_is_bounded_when_nobody_answers() -> None:
    """What a starting gateway waits for before it serves (``ResidencyService.ready``): the
    replay of a live publisher comes in at once; one that is advertised but does not answer holds
    the wait until the caller's bound."""
    from loadtests.procs import free_port

    def info(endpoint: str, replay: str) -> dict[str, Any]:
        return {"kv_events": {"publisher": "zmq", "endpoint_port_base": int(endpoint.rsplit(":", 1)[1]),
                              "replay_endpoint_port_base": int(replay.rsplit(":", 1)[1])}}  # fmt: skip

    async with publisher() as pub:
        pub.publish([CLEARED])
        pub.publish([stored([1, 2], None, "s")])
        await until(lambda: pub.published == 2)
        assert pub.bound is not None and pub.bound_replay is not None
        dead = f"tcp://127.0.0.1:{free_port()}"
        infos = {"live": info(pub.bound, pub.bound_replay), "dead": info(dead, dead)}

        async def fetch(rid: str, u: str) -> dict[str, Any] | None:
            return infos[rid]

        idx = ResidencyIndex()
        mgr = KvEventsManager(idx, fetch, replay_timeout_s=0.5)
        try:
            await mgr.refresh([("live", "http://127.0.0.1:1")])
            async with asyncio.timeout(5.0):
                assert await mgr.wait_synced()
            assert idx.resident_tokens("live", "s") == 8  # applied before the wait returned

            await mgr.refresh([("live", "http://127.0.0.1:1"), ("dead", "http://127.0.0.1:1")])
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await mgr.wait_synced()
        finally:
            await mgr.close()


async def test_a_starting_gateways_wait_for_the_replays_is_bounded() -> None:
    """``ResidencyService.ready``: the gateway's start waits for the registry's first read and every
    replay, and no longer than its bound when a publisher never answers (it then serves anyway)."""
    from loadtests.procs import free_port
    from router.gateway.residency import ResidencyService

    dead = free_port()

    async def fetch(rid: str, u: str) -> dict[str, Any] | None:
        return {"kv_events": {"publisher": "zmq", "endpoint_port_base": dead, "replay_endpoint_port_base": dead}}

    idx = ResidencyIndex()
    svc = ResidencyService(idx, "auto")
    svc.manager = KvEventsManager(idx, fetch, replay_timeout_s=0.5)
    try:
        assert not await svc.ready(0.2)  # the registry was never read
        await svc.manager.refresh([("dead", "http://127.0.0.1:1")])
        svc.first_refresh.set()
        t0 = asyncio.get_running_loop().time()
        assert not await svc.ready(0.3)
        assert asyncio.get_running_loop().time() - t0 < 2.0
        assert await ResidencyService(idx, "redis").ready(0.1)  # nothing to subscribe to: ready at once
    finally:
        await svc.manager.close()


async def test_an_unanswered_replay_is_asked_again_and_the_mirror_becomes_complete() -> None:
    """Rule 2: a replay that got no answer (a stalled engine) leaves the mirror incomplete only
    until the subscriber asks again (after 1, 2, 4 x ``replay_timeout_s``), not for good."""
    sink = ReplicaResidency()
    async with publisher() as pub:
        pub.publish([CLEARED])
        pub.publish([stored([1, 2], None, "s")])
        await until(lambda: pub.published == 2)
        pub.ignore_replays = 2  # the first sync's replay and its first retry go unanswered
        assert pub.bound is not None
        sub = KvEventSubscriber(pub.bound, sink, replay_endpoint=pub.bound_replay, replay_timeout_s=0.2)
        task = asyncio.create_task(sub.run())
        try:
            await until(lambda: sub.stats.replay_failures == 1)
            assert not sink.complete and sink.resident_tokens("s") is None
            await until(lambda: sink.complete and sink.resident_tokens("s") == 8)
            assert sub.stats.replay_failures == 2 and sub.stats.rebuilds == 1 and pub.replays == 3
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class ThreadPublisher:
    """SGLang's ``ZmqEventPublisher`` replay as it is written: a thread with a blocking ROUTER that
    answers a replay request by sending every buffered batch at once, then the end marker (the
    emulator's asyncio publisher yields to its loop between sends, so it rarely overflows)."""

    def __init__(self, batches: list[tuple[int, bytes]], lose: list[tuple[range, bool]] | None = None) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._batches = batches
        # what the n-th answer loses, as a ROUTER whose send queue overflowed: (batches, end marker)
        self._lose = lose or []
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            client, _, start_b = self._router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            lost, end_lost = self._lose[self.replays] if self.replays < len(self._lose) else (range(0), False)
            self.replays += 1
            for seq, buf in self._batches:
                if seq >= start and seq not in lost:
                    self._router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), buf))
            if not end_lost:
                self._router.send_multipart((client, b"", b"", KvEventsPublisher.END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


@pytest.mark.parametrize("lose", ["as_it_falls", "a_hole_then_the_end_marker"])
async def test_a_replay_of_a_full_buffer_is_complete_though_the_publisher_drops_part_of_it(lose: str) -> None:
    """SGLang answers a replay by sending its whole buffer (10,000 batches by default) at once on a
    ROUTER socket, which drops what overflows its send queue, the end marker included. The
    subscriber takes all of it into its own queue and asks again from the first batch it lost, so
    the mirror is complete (rule 2). ``a_hole_then_the_end_marker``: the first answer loses 200
    batches in the middle, the second (from the first lost) its end marker, the third brings it (or
    a later one, where a busy machine's queue overflowed on its own as well)."""
    n = 10_000
    encode = msgspec.msgpack.Encoder().encode
    batches = [(0, encode([0.0, [CLEARED], 0]))]
    batches += [(i, encode([0.0, [stored([i], i - 1 if i > 1 else None, "s")], 0])) for i in range(1, n)]
    scripted = lose == "a_hole_then_the_end_marker"
    pub = ThreadPublisher(batches, [(range(4000, 4200), False), (range(0), True)] if scripted else None)
    sink = ReplicaResidency()
    sub = KvEventSubscriber(pub.endpoint, sink, replay_endpoint=pub.replay_endpoint, replay_timeout_s=1.0)
    task = asyncio.create_task(sub.run())
    try:
        await until(lambda: sub.stats.syncs >= 1 and not sink.stale, timeout_s=30.0)
        assert sub.stats.replay_failures == 0 and sub.stats.gaps_unrecovered == 0, sub.stats
        assert sink.complete and sink.resident_tokens("s") == 4 * (n - 1)
        # each resume is one more request answered; a busy machine's own overflow (as_it_falls) may
        # add one to the two the script forces
        assert pub.replays == sub.stats.replay_resumes + 1, (pub.replays, sub.stats)
        if scripted:
            assert sub.stats.replay_resumes >= 2, sub.stats
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close()

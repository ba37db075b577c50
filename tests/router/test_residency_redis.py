"""Exact residency shared through a real Redis (router/store/residency.py): one writer, mirrors."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from router.residency import ESTIMATE, EVENTS, OFF, ResidencyIndex
from router.store.keys import KeySpace
from router.store.residency import RedisResidencyMirror, RedisResidencyWriter
from tests.router.conftest import wait_for

GPU = 1

until = functools.partial(wait_for, timeout_s=10.0)  # events cross sockets and processes: a longer wait


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield c
    finally:
        await c.aclose()


@contextlib.asynccontextmanager
async def running(mirror: RedisResidencyMirror) -> AsyncIterator[RedisResidencyMirror]:
    mirror.start()
    try:
        await until(lambda: not mirror.stale)
        yield mirror
    finally:
        await mirror.close()


def fed_index() -> ResidencyIndex:
    idx = ResidencyIndex(track_changes=True)
    r = idx.replica("a")
    r.cleared()
    r.stored(None, [1, 2, 3], 16, 48, GPU, "s1")
    r.stored(None, [9], 16, 16, GPU, "s2")
    return idx


async def test_close_ends_a_blocked_read_at_once(client: aioredis.Redis) -> None:
    # a mirror blocks in XREAD for up to block_ms; shutting a gateway down must not wait that out
    m = RedisResidencyMirror(client, block_ms=30_000)
    m.start()
    await until(lambda: not m.stale)
    await asyncio.sleep(0.1)  # in the blocked XREAD now: nothing is written
    t0 = time.monotonic()
    await m.close()
    assert time.monotonic() - t0 < 2.0
    assert await client.ping()  # the shared client still works


async def test_writer_publishes_and_mirrors_follow(client: aioredis.Redis) -> None:
    idx = fed_index()
    w = RedisResidencyWriter(client, idx, writer_id="sidecar-a", ttl_s=5.0)
    assert await w.flush_once() == 1
    assert await client.hgetall("{kvroute}:res:a") == {"s1": "48", "s2": "16"}
    m = RedisResidencyMirror(client, block_ms=100)
    async with running(m):
        assert m.resident_tokens("a", "s1") == 48 and m.source("a") == EVENTS
        assert m.resident_tokens("a", "nobody") == 0  # complete: untracked is 0
        assert m.tracks("a", "s1") and not m.tracks("a", "nobody") and not m.tracks("b", "s1")
        assert m.resident_on("s2") == (("a", 16),)
        assert m.source("b") == OFF and m.resident_tokens("b", "s1") is None
        # changes flow through the stream: an eviction, a new session
        r = idx.replica("a")
        r.removed([3], GPU)
        r.stored(None, [50, 51], 16, 32, GPU, "s3")
        await w.flush_once()
        await until(lambda: m.resident_tokens("a", "s1") == 32 and m.resident_tokens("a", "s3") == 32)
        # an incomplete replica: unknown sessions read None
        r.reset_incomplete()
        r.stored(None, [70], 16, 16, GPU, "s4")
        await w.flush_once()
        await until(lambda: m.source("a") == ESTIMATE)
        assert m.resident_tokens("a", "s4") == 16 and m.resident_tokens("a", "s1") is None
        assert await client.hgetall("{kvroute}:res:a") == {"s4": "16"}
        # the writer leaves: its replica is dropped
        await w.close()
        await until(lambda: m.source("a") == OFF)
        assert m.gaps == 0 and m.errors == 0


async def test_a_session_the_bound_dropped_is_forgotten_by_the_mirrors(client: aioredis.Redis) -> None:
    """Rule 6 drops the least recently changed session: mirrors then no longer track it (``None``
    is published, not its rule-5 0), as the writer's own index does not."""
    idx = ResidencyIndex(max_sessions=2, track_changes=True)
    r = idx.replica("a")
    r.cleared()
    r.stored(None, [1], 16, 16, GPU, "s1")
    r.stored(None, [2], 16, 16, GPU, "s2")
    w = RedisResidencyWriter(client, idx, ttl_s=5.0)
    await w.flush_once()
    m = RedisResidencyMirror(client, block_ms=100)
    async with running(m):
        assert m.tracks("a", "s1") and m.tracks("a", "s2")
        r.stored(None, [3], 16, 16, GPU, "s3")  # s1 is dropped
        await w.flush_once()
        await until(lambda: m.tracks("a", "s3"))
        assert not idx.tracks("a", "s1") and not m.tracks("a", "s1") and m.resident_tokens("a", "s1") == 0
        assert await client.hgetall("{kvroute}:res:a") == {"s2": "16", "s3": "16"}


async def test_a_dead_writer_expires(client: aioredis.Redis) -> None:
    w = RedisResidencyWriter(client, fed_index(), ttl_s=1.0)
    await w.flush_once()
    m = RedisResidencyMirror(client, block_ms=50)
    async with running(m):
        assert m.resident_tokens("a", "s1") == 48  # read well within the second
        await until(lambda: m.source("a") == ESTIMATE)  # no heartbeat within the TTL
        assert m.resident_tokens("a", "s1") is None
        await w.flush_once()  # it comes back: a heartbeat (due) revives it
        await until(lambda: m.source("a") == EVENTS)


async def test_heartbeats_only_when_due(client: aioredis.Redis) -> None:
    w = RedisResidencyWriter(client, fed_index(), ttl_s=30.0)
    assert await w.flush_once() == 1
    assert await w.flush_once() == 0  # nothing changed, heartbeat not due
    assert w.writes == 1


async def test_a_gap_in_the_stream_triggers_a_full_read(client: aioredis.Redis) -> None:
    idx = fed_index()
    w = RedisResidencyWriter(client, idx, ttl_s=30.0)
    await w.flush_once()
    m = RedisResidencyMirror(client, block_ms=50)
    async with running(m):
        reads = m.reads
        await client.incr("{kvroute}:resn")  # an entry the mirror never sees (trimmed away)
        idx.replica("a").stored(None, [80], 16, 16, GPU, "s5")
        await w.flush_once()
        await until(lambda: m.resident_tokens("a", "s5") == 16)
        assert m.gaps == 1 and m.reads == reads + 1


async def test_mirror_is_stale_while_redis_is_away(redis_killable) -> None:  # type: ignore[no-untyped-def]
    c = aioredis.Redis.from_url(redis_killable.url, decode_responses=True, socket_timeout=0.5)
    try:
        w = RedisResidencyWriter(c, fed_index(), ttl_s=30.0)
        await w.flush_once()
        m = RedisResidencyMirror(c, block_ms=50, retry_s=0.05)
        async with running(m):
            assert m.resident_tokens("a", "s1") == 48
            redis_killable.kill()
            await until(lambda: m.stale)
            assert m.resident_tokens("a", "s1") is None
            redis_killable.restart()  # an empty Redis: nothing is known until the writer writes again
            w.index.replica("a").stored(None, [90], 16, 16, GPU, "s6")
            await until(lambda: not m.stale, timeout_s=20)
            assert m.source("a") == OFF
            await w.flush_once()  # its counter went back: Redis forgot us
            await w.flush_once()  # so everything is written whole again
            await until(lambda: m.resident_tokens("a", "s1") == 48 and m.resident_tokens("a", "s6") == 16)
    finally:
        await c.aclose()


def test_keys() -> None:
    k = KeySpace("fleet")
    assert (k.residency("r1"), k.residency_sources, k.residency_stream, k.residency_counter) == (
        "{fleet}:res:r1", "{fleet}:ress", "{fleet}:resx", "{fleet}:resn")

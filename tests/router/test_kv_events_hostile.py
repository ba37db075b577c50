"""Hostile or broken KV-event publishers (review findings): each input once hung or killed the
subscriber, or pointed the gateway's connections at a host of the replica's choosing.

Over real sockets: the emulator's publisher where a well-formed stream with one bad batch is enough,
and a scripted ZMQ PUB + ROUTER (``HostilePublisher``) for what the emulator never sends (a replay
without an end marker, negative sequence numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

import msgspec
import pytest
import zmq
import zmq.asyncio

import router.kv_events
from router.kv_events import KvEventSubscriber
from router.kv_wire import END_SEQ, WireError, decode_seq, parse_descriptor
from router.residency import ReplicaResidency
from tests.router.conftest import wait_for
from tests.router.test_kv_events_functional import publisher, stored, subscribed

until = functools.partial(wait_for, timeout_s=10.0)


def payload(events: list[dict[str, Any]]) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, 0])


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


# what the hostile replay socket answers to one request: the frames [topic, seq, payload] to send
ReplayScript = Callable[[int], AsyncIterator[list[bytes]]]


class HostilePublisher:
    """A PUB socket for live batches and a ROUTER that answers replay requests with ``script``."""

    def __init__(self, script: ReplayScript) -> None:
        self._ctx = zmq.asyncio.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a script ends when its client has gone
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replays = 0
        self._script = script
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self._ctx.destroy(linger=0)

    async def send(self, seq: int, events: list[dict[str, Any]]) -> None:
        await self.pub.send_multipart([b"", seq_frame(seq), payload(events)])

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            with contextlib.suppress(zmq.ZMQError):
                async for frames in self._script(int.from_bytes(start, "big")):
                    await self.router.send_multipart([client, b"", *frames])


@contextlib.asynccontextmanager
async def following(pub: HostilePublisher, sink: ReplicaResidency, replay_timeout_s: float = 2.0,
                    ) -> AsyncIterator[tuple[KvEventSubscriber, asyncio.Task[None]]]:
    sub = KvEventSubscriber(pub.endpoint, sink, replay_endpoint=pub.replay_endpoint,
                            replay_timeout_s=replay_timeout_s)
    task = asyncio.create_task(sub.run())
    try:
        yield sub, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


# ---- 1. a parent cycle in the mirror ------------------------------------------------------------


@pytest.mark.timeout(10, method="signal")  # a regression is an endless loop: fail it, do not hang CI
@pytest.mark.parametrize("cycle", ["self", "pair"])
def test_a_parent_cycle_makes_the_session_unknown_instead_of_hanging(cycle: str) -> None:
    r = ReplicaResidency()
    r.cleared()
    if cycle == "self":
        r.stored(5, [5], 4, 4, 1, None)  # a block that names itself as its parent
        ring = [5]
    else:
        r.stored(6, [5], 4, 4, 1, None)  # 5 below 6 ...
        r.stored(5, [6], 4, 4, 1, None)  # ... and 6 below 5
        ring = [5, 6]
    r.stored(5, [7], 4, 4, 1, "s")
    r.stored(None, [100, 101], 4, 8, 1, "t")  # an honest session beside it
    r.removed([7, *ring], 1)  # the walk up from 7 meets only blocks that are going too
    assert r.resident_tokens("s") is None
    assert r.resident_tokens("t") == 8
    r.removed([101], 1)
    assert r.resident_tokens("t") == 4


# ---- 2. a batch that decodes but cannot be applied ------------------------------------------------


async def test_a_batch_with_non_array_token_ids_is_a_decode_error_not_a_dead_subscriber() -> None:
    sink = ReplicaResidency()
    async with publisher() as pub, subscribed(pub, sink) as sub:
        pub.publish([stored([1, 2], None, "a")])
        await until(lambda: sink.resident_tokens("a") == 8)
        assert sink.complete
        bad = stored([3], 2, "a")
        bad["token_ids"] = "not an array"
        pub.publish([bad])
        await until(lambda: sub.stats.decode_errors == 1)
        assert not sink.complete  # the mirror may hold half the batch: not trustworthy
        pub.publish([stored([10, 11, 12], None, "b")])
        await until(lambda: sink.resident_tokens("b") == 12)
        assert sub.stats.last_seq == 2 and sub.stats.decode_errors == 1


# ---- 3. a replay without an end marker ------------------------------------------------------------


def endless(interval_s: float) -> ReplayScript:
    async def script(start: int) -> AsyncIterator[list[bytes]]:
        seq = max(start, 0)
        while True:  # never the end marker
            yield [b"", seq_frame(seq), payload([stored([1000 + seq], None)])]
            seq += 1
            await asyncio.sleep(interval_s)
    return script


@pytest.mark.parametrize("bound", ["time", "batches"])
async def test_a_replay_without_end_is_abandoned_and_the_live_stream_followed(
    bound: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bound == "time":  # a trickle, each batch well inside replay_timeout_s
        timeout_s, script = 0.1, endless(0.01)
    else:  # a flood, far faster than any time bound
        monkeypatch.setattr(router.kv_events, "_REPLAY_MAX_BATCHES", 500, raising=False)
        timeout_s, script = 30.0, endless(0.0)
    sink = ReplicaResidency()
    async with HostilePublisher(script) as pub, following(pub, sink, timeout_s) as (sub, task):
        await until(lambda: sub.stats.replay_failures >= 1)
        assert not sink.complete and not sink.stale and not task.done()
        await pub.send(0, [stored([1, 2], None, "a")])
        await until(lambda: sink.resident_tokens("a") == 8)
        assert sub.stats.last_seq == 0


def losing(batch: int, n: int) -> ReplayScript:
    """Every answer loses the same batch (a resume can never fill the hole)."""
    async def script(start: int) -> AsyncIterator[list[bytes]]:
        for seq in range(max(start, 0), n):
            if seq != batch:
                yield [b"", seq_frame(seq), payload([stored([1000 + seq], None)])]
        yield [b"", END_SEQ, b""]
    return script


def trickle() -> ReplayScript:
    """Every answer brings one batch more, then falls silent without its end marker."""
    async def script(start: int) -> AsyncIterator[list[bytes]]:
        yield [b"", seq_frame(max(start, 0)), payload([stored([1000 + start], None)])]
    return script


@pytest.mark.timeout(20, method="signal")
@pytest.mark.parametrize("kind", ["the_same_hole", "a_trickle"])
async def test_a_replay_that_cannot_be_completed_is_abandoned_in_bounded_time(kind: str) -> None:
    """Rule 2's resumes: a hole the publisher loses again, or answers that each bring one batch and
    never the end, end the replay (failed, mirror incomplete) within its budget, and the live
    stream is followed."""
    sink = ReplicaResidency()
    script = losing(5, 20) if kind == "the_same_hole" else trickle()
    async with HostilePublisher(script) as pub, following(pub, sink, replay_timeout_s=0.1) as (sub, task):
        await until(lambda: sub.stats.replay_failures >= 1)
        assert not sink.complete and not task.done()
        if kind == "the_same_hole":
            assert sub.stats.replay_resumes == 1 and pub.replays == 2  # asked again once: no progress
        else:
            assert sub.stats.replay_resumes >= 2  # one batch more each time, until the budget ran out
        await pub.send(40, [stored([1, 2], None, "a")])
        await until(lambda: sink.resident_tokens("a") == 8)


# ---- 4. negative sequence numbers -----------------------------------------------------------------


def test_a_negative_sequence_number_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_seq(seq_frame(-5))
    with pytest.raises(WireError):
        decode_seq(END_SEQ)  # the replay's end marker is matched on its bytes, never decoded
    assert decode_seq(seq_frame(2**63 - 1)) == 2**63 - 1


async def test_a_replay_of_negative_sequence_numbers_does_not_kill_the_subscriber() -> None:
    async def script(start: int) -> AsyncIterator[list[bytes]]:
        yield [b"", seq_frame(-5), payload([stored([1], None)])]
        yield [b"", END_SEQ, b""]

    sink = ReplicaResidency()
    async with HostilePublisher(script) as pub, following(pub, sink) as (sub, task):
        await until(lambda: sub.stats.syncs >= 1 and not sink.stale)
        await pub.send(3, [stored([7, 8], None, "a")])  # a gap after the replay: replayed from its start
        await until(lambda: sink.resident_tokens("a") == 8 or task.done())
        assert not task.done()
        assert sub.stats.decode_errors >= 1


# ---- 5. the endpoint host comes from the registered URL only -----------------------------------


@pytest.mark.parametrize("host", ["169.254.169.254", "evil.example.com", "127.0.0.1", "[::1]", "10.0.0.8"])
def test_a_hostile_endpoint_host_is_ignored(host: str) -> None:
    kv = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": 5557,
          "replay_endpoint_port_base": 5558}
    d = parse_descriptor({"kv_events": kv}, "http://10.0.0.7:30000")
    assert d is not None
    assert (d.endpoint(), d.replay_endpoint()) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")

"""Subscribers to SGLang's KV-event streams (ZMQ), feeding a ``router.residency.ResidencyIndex``.

The I/O shell around two pure parts: ``router.kv_wire`` (decode) and ``router.residency`` (state).
Needs the ``kvevents`` extra (``pyzmq``, ``msgspec``); nothing imports this module unless KV events
are turned on.

Rules:
  1. One :class:`KvEventSubscriber` per publisher (one per DP rank of a replica): a SUB socket on the
     event endpoint, a socket monitor to see (re)connections, a fresh DEALER per replay request.
  2. Synchronisation (``router.residency`` rule 3). On every (re)connection the subscriber asks the
     replay socket for everything from sequence 0:
       * the answer starts at 0: the publisher's whole history is there; the mirror is rebuilt from
         an empty cache and is complete (this is also how an engine *restart* is absorbed: its
         sequence numbers start again at 0);
       * it starts later (the buffer rolled) but joins what we already applied: we continue;
       * otherwise, or with no replay socket or no answer in time: the mirror is dropped and marked
         incomplete (``estimate``) until the engine clears its cache (``AllBlocksCleared``) or
         restarts. Without a replay socket, a first live batch with sequence 0 is a complete start.
       * a replay that got no answer is asked again after 1, 2 and 4 x ``replay_timeout_s`` (a
         transient stall must not leave a young engine's mirror incomplete for good).
       * the publisher sends a replay at once on a ROUTER socket, which drops what overflows (the
         end marker too): a replay with a hole, or that falls silent without its end marker, is
         continued from the first batch missing.
     A replay is bounded as a whole (10 x ``replay_timeout_s``, 200,000 batches): past either, it
     is abandoned as if unanswered and the live stream followed.
  3. Live batches must arrive with consecutive sequence numbers. A jump is a *gap* (ZMQ drops
     messages past the high-water mark): the missing range is replayed; if it cannot be, the mirror
     is dropped and marked incomplete. A sequence number at or below the last one applied means the
     publisher restarted (rule 2), except right after a replay, whose overlap with the live stream
     is skipped.
  4. While disconnected the mirror is *stale*: its answers are ``None`` and the replica reads
     ``estimate`` (a dead engine lost its cache; a live one changed it without us).
  5. Decoding and applying run on the event loop (``bench kv-events`` measures them); a replay
     yields to the loop every ``_YIELD_EVERY`` batches so a long one never stalls requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.errors import UpstreamError
from router.eventloop import stop_tasks
from router.kv_wire import (
    END_SEQ,
    KvEventsDescriptor,
    WireError,
    decode_batch,
    decode_seq,
    feed_batch,
    parse_descriptor,
)
from router.residency import ReplicaResidency, ResidencyIndex

__all__ = ["KvEventSubscriber", "KvEventsManager", "SubscriberStats", "json_fetcher"]

log = logging.getLogger("kvroute.kv_events")

_YIELD_EVERY = 64
# Bounds on one whole replay, whatever the publisher does: one that never sends its end marker (but
# never pauses as long as ``replay_timeout_s`` either) would otherwise hold the subscriber in the
# replay for good and buffer batches without limit. SGLang's buffer holds 10,000 batches by default,
# so 200,000 is far beyond an honest answer; 10 x the timeout leaves an honest one time to stream.
_REPLAY_BUDGET_TIMEOUTS = 10
_REPLAY_MAX_BATCHES = 200_000
_REPLAY_RCVHWM = 50_000  # messages: five of SGLang's default buffers
_RESYNC_TRIES = 3  # rule 2: a replay that got no answer is asked again, after 1, 2, 4 x replay_timeout_s
_CONNECT_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DISCONNECT_EVENTS = zmq.EVENT_DISCONNECTED


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0  # sequence jumps seen on the live stream
    gaps_unrecovered: int = 0  # ... that the replay could not fill (mirror dropped)
    restarts: int = 0  # sequence numbers went back: the publisher restarted
    syncs: int = 0  # synchronisations after a (re)connection
    rebuilds: int = 0  # complete rebuilds from sequence 0
    replay_failures: int = 0
    replay_resumes: int = 0  # a replay asked again from the first batch the publisher dropped
    decode_errors: int = 0
    connects: int = 0
    disconnects: int = 0
    last_seq: int = -1
    apply_s: float = 0.0  # event-loop time spent decoding and applying
    last_batch_at: float = 0.0  # time.monotonic()

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class KvEventSubscriber:
    """Follows one publisher and keeps ``sink`` (one rank's mirror) in step with it."""

    def __init__(
        self,
        endpoint: str,
        sink: ReplicaResidency,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        name: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.sink = sink
        self.name = name or endpoint
        self.replay_timeout_s = replay_timeout_s
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.stats = SubscriberStats()
        self.connected = False
        self._last = -1  # last sequence number applied
        self._dups_ok = False  # right after a replay: live batches at or below _last are its overlap
        self._await_first = False  # no replay socket: the first live batch decides (rule 2)
        self.synced = asyncio.Event()  # set by the first synchronisation (or when the subscriber ends)
        self._resync_at: float | None = None  # time.monotonic() of the next try of an unanswered replay
        self._resync_tries = 0
        sink.stale = True

    # ---- main loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        mon = sub.get_monitor_socket(_CONNECT_EVENTS | _DISCONNECT_EVENTS)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while True:
                wait_ms = None if self._resync_at is None else max(0, int((self._resync_at - time.monotonic()) * 1000))
                ready = dict(await poller.poll(wait_ms))
                if self._resync_at is not None and time.monotonic() >= self._resync_at:
                    self._resync_at = None
                    if self.connected:
                        await self._sync()
                if mon in ready:
                    # ZMQ's readiness is edge-triggered: drain the queue, or a message can sit unseen
                    while True:
                        try:
                            frames = await mon.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_monitor(parse_monitor_message(frames))
                if sub in ready:
                    # drain what is queued before polling again (one poll per burst, not per batch)
                    while True:
                        try:
                            frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_frames(frames)
        finally:
            self.connected = False
            self.sink.stale = True
            self.synced.set()  # nobody waits for a subscriber that has ended
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, msg: Mapping[str, Any]) -> None:
        ev = msg.get("event")
        if ev == _CONNECT_EVENTS:
            self.connected = True
            self.stats.connects += 1
            self._resync_tries = 0
            await self._sync()
        elif ev == _DISCONNECT_EVENTS:
            self.connected = False
            self.stats.disconnects += 1
            self.sink.stale = True  # rule 4
            log.info("kv events %s: disconnected", self.name)

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        try:
            seq = decode_seq(frames[1])
        except WireError:
            self.stats.decode_errors += 1
            return
        await self._on_batch(seq, frames[2])

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        if self._await_first:  # no replay socket: the first batch after a connection decides
            self._await_first = False
            if seq == 0:
                self._start_complete()
            elif not (self.sink.complete and seq == self._last + 1):
                self._drop("no replay socket and the stream did not start at 0")
            self._last = seq - 1
        if seq <= self._last:
            if self._dups_ok:
                return  # overlap of the replay with the live stream
            self.stats.restarts += 1
            log.info("kv events %s: sequence went back (%d after %d): publisher restarted", self.name, seq, self._last)
            await self._sync()
            if seq <= self._last:
                return
        self._dups_ok = False
        if seq > self._last + 1:
            self.stats.gaps += 1
            await self._fill(self._last + 1, seq)
            if seq <= self._last:
                return
        self._apply(seq, payload)

    # ---- synchronisation (rules 2, 3) ----------------------------------------------------------
    async def _sync(self) -> None:
        try:
            await self._resync()
        finally:
            self.synced.set()

    async def _resync(self) -> None:
        self.stats.syncs += 1
        if self.replay_endpoint is None:
            self._await_first = True
            self.sink.stale = False
            return
        batches = await self._replay(0)
        if batches is None:
            self._drop("replay socket did not answer")
            self.sink.stale = False
            self._await_first = False
            if self._resync_tries < _RESYNC_TRIES:
                self._resync_at = time.monotonic() + self.replay_timeout_s * 2**self._resync_tries
                self._resync_tries += 1
            return
        self._resync_tries = 0
        if not batches or batches[0][0] == 0:
            # the whole history (or none yet: nothing published, the cache is still empty)
            self._start_complete()
            self._last = -1
        elif not (self.sink.complete and batches[0][0] <= self._last + 1):
            self._drop(f"replay starts at {batches[0][0]}, after what we hold ({self._last})")
            self._last = batches[0][0] - 1
        await self._apply_all(batches)
        self._dups_ok = True
        self.sink.stale = False

    async def _fill(self, start: int, upto: int) -> None:
        """Replay ``[start, upto)`` after a gap on the live stream."""
        batches = None if self.replay_endpoint is None else await self._replay(start)
        if batches is not None and batches and batches[0][0] == start:
            await self._apply_all([b for b in batches if b[0] < upto])
            if self._last >= upto - 1:
                return
        self.stats.gaps_unrecovered += 1
        self._drop(f"gap {start}..{upto - 1} not replayable")
        self._last = upto - 1

    def _start_complete(self) -> None:
        self.stats.rebuilds += 1
        self.sink.reset_incomplete()
        self.sink.cleared()  # seq 0 follows an empty cache: from here on we know all of it
        self.sink.events -= 1  # not an engine event
        self.sink.clears -= 1

    def _drop(self, why: str) -> None:
        log.info("kv events %s: residency incomplete (%s)", self.name, why)
        self.sink.reset_incomplete()

    async def _apply_all(self, batches: list[tuple[int, bytes]]) -> None:
        for i, (seq, payload) in enumerate(batches):
            if seq <= self._last:
                continue
            if seq != self._last + 1:
                self.stats.gaps_unrecovered += 1
                self._drop(f"replay has a hole before {seq}")
            self._apply(seq, payload)
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        t0 = time.perf_counter()
        self._last = seq
        self.stats.last_seq = seq
        try:
            # applying decodes too (``token_ids``' length is read only then): a bad field can be
            # met halfway through a batch, which leaves the mirror untrustworthy either way
            events = feed_batch(decode_batch(payload), self.sink)
        except WireError as exc:
            self.stats.decode_errors += 1
            self._drop(str(exc))
            return
        self.stats.events += events
        self.stats.batches += 1
        t1 = time.perf_counter()
        self.stats.apply_s += t1 - t0
        self.stats.last_batch_at = time.monotonic()

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from ``start``, in order and without a hole (``None``: no answer
        within the timeout, or not all of it within ``_REPLAY_BUDGET_TIMEOUTS`` timeouts and
        ``_REPLAY_MAX_BATCHES`` batches).

        SGLang sends its whole buffer at once on a ROUTER socket, which drops what overflows its
        send queue, the end marker too: what was lost is asked for again, from the first batch
        missing, as long as each answer brings more (rule 2)."""
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + _REPLAY_BUDGET_TIMEOUTS * self.replay_timeout_s
        ask = start
        try:
            while True:
                got, ended = await self._ask_replay(ask, deadline, _REPLAY_MAX_BATCHES - len(out))
                before, whole = len(out), True
                for seq, payload in got:
                    if out and seq <= out[-1][0]:
                        continue
                    if out and seq != out[-1][0] + 1:
                        whole = False  # dropped by the publisher: asked for again
                        break
                    out.append((seq, payload))
                if ended and whole:
                    return out
                if len(out) == before:
                    raise _ReplayFailed(f"replay from {ask} brought nothing new")
                self.stats.replay_resumes += 1
                ask = out[-1][0] + 1
        except _ReplayFailed as exc:
            self.stats.replay_failures += 1
            log.info("kv events %s: %s (%d batches from %d in)", self.name, exc, len(out), start)
            return None

    async def _ask_replay(self, start: int, deadline: float, limit: int) -> tuple[list[tuple[int, bytes]], bool]:
        """One replay request: the batches that arrived, and whether the end marker did."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # a whole buffer fits in the socket's queue while the event loop is busy elsewhere: past the
        # default 1,000 the publisher's sends back up and it drops the rest
        dealer.setsockopt(zmq.RCVHWM, _REPLAY_RCVHWM)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: list[tuple[int, bytes]] = []
            while True:
                left_s = deadline - time.monotonic()
                if left_s <= 0 or len(got) >= limit:
                    raise _ReplayFailed(f"replay from {start} abandoned (no end marker)")
                if not await dealer.poll(max(1, int(min(self.replay_timeout_s, left_s) * 1000))):
                    if got:
                        return got, False  # the end marker was dropped, or what followed it
                    raise _ReplayFailed(f"replay from {start} timed out")
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    self.stats.decode_errors += 1
                    continue
                if frames[2] == END_SEQ:
                    return got, True
                try:
                    got.append((decode_seq(frames[2]), frames[3]))
                except WireError:
                    self.stats.decode_errors += 1
        finally:
            dealer.close(linger=0)


class _ReplayFailed(Exception):
    pass


# ---- many replicas ------------------------------------------------------------------------------

FetchJson = Callable[[str, str], Awaitable[dict[str, Any] | None]]


@dataclass(slots=True)
class _Sub:
    descriptor: KvEventsDescriptor
    subscribers: list[KvEventSubscriber]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class KvEventsManager:
    """Starts and stops one subscriber per DP rank of every replica that publishes KV events.

    ``refresh(replicas)`` is called with ``(replica_id, url)`` pairs, or ``(replica_id, url,
    dp_rank)`` triples (from the store's registry): replicas new to it have their ``/server_info``
    read through ``fetch_json`` and are subscribed to if it advertises a ZMQ publisher
    (``kv_events``); replicas no longer listed are dropped. A replica that is one data-parallel rank
    of its engine (``dp_rank`` not ``None``) follows that rank's publisher alone.
    """

    def __init__(
        self,
        index: ResidencyIndex,
        fetch_json: FetchJson,
        *,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        recheck_rounds: int = 6,
    ) -> None:
        self.index = index
        self._fetch = fetch_json
        self._ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self._replay_timeout_s = replay_timeout_s
        self._recheck = max(1, recheck_rounds)
        self._subs: dict[str, _Sub] = {}
        self._dying: set[asyncio.Task[None]] = set()  # cancelled, not yet finished (closing sockets)
        self._none: dict[str, int] = {}  # replicas without a publisher: rounds until we look again
        self._round = 0

    def subscribed(self) -> tuple[str, ...]:
        return tuple(sorted(self._subs))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for rid, sub in sorted(self._subs.items()):
            out[rid] = {
                "endpoint": sub.descriptor.endpoint(),
                "dp_size": sub.descriptor.dp_size,
                "ranks": [s.stats.to_dict() | {"connected": s.connected} for s in sub.subscribers],
            }
        return out

    async def wait_synced(self) -> bool:
        """Wait until every subscriber has had its first synchronisation (the replay of what its
        engine holds) or has ended; False if one was added meanwhile. The caller bounds the wait."""
        for sub in list(self._subs.values()):
            for s in sub.subscribers:
                await s.synced.wait()
        return all(s.synced.is_set() for sub in self._subs.values() for s in sub.subscribers)

    def ensure(self, replica_id: str, desc: KvEventsDescriptor) -> None:
        cur = self._subs.get(replica_id)
        if cur is not None and cur.descriptor == desc and all(not t.done() for t in cur.tasks):
            return
        if cur is not None:
            self._cancel(cur)
        self.index.drop(replica_id)
        subs = []
        for rank in range(desc.dp_size):
            sink = self.index.replica(replica_id, rank, desc.dp_size)
            subs.append(
                KvEventSubscriber(
                    desc.endpoint(rank),
                    sink,
                    replay_endpoint=desc.replay_endpoint(rank),
                    topic=desc.topic,
                    ctx=self._ctx,
                    replay_timeout_s=self._replay_timeout_s,
                    name=f"{replica_id}#{rank}",
                )
            )
        entry = _Sub(desc, subs)
        entry.tasks = [asyncio.create_task(s.run(), name=f"kvroute-kv-events-{replica_id}-{i}") for i, s in enumerate(subs)]
        for t in entry.tasks:
            t.add_done_callback(_log_death)
        self._subs[replica_id] = entry
        log.info("kv events: subscribed to %s at %s (dp %d)", replica_id, desc.endpoint(), desc.dp_size)

    def stop(self, replica_id: str) -> None:
        cur = self._subs.pop(replica_id, None)
        if cur is not None:
            self._cancel(cur)
        self.index.drop(replica_id)

    async def refresh(self, replicas: Iterable[tuple[str, str] | tuple[str, str, int | None]]) -> None:
        self._round += 1
        seen: set[str] = set()
        for rid, url, *rank in replicas:
            seen.add(rid)
            cur = self._subs.get(rid)
            if cur is not None and self._round % self._recheck != 0:
                if any(t.done() for t in cur.tasks):
                    self.ensure(rid, cur.descriptor)  # a subscriber died (a bug): start again
                continue
            if cur is None:
                wait = self._none.get(rid, 0)
                if wait > 0:
                    self._none[rid] = wait - 1
                    continue
            info = await self._fetch(rid, url + "/server_info")
            desc = None if info is None else parse_descriptor(info, url)
            if desc is not None and rank and rank[0] is not None:
                desc = desc.of_rank(rank[0])
            if desc is None:
                if info is not None:
                    self._none[rid] = self._recheck  # no publisher: look again later (a restart may add one)
                    if cur is not None:
                        self.stop(rid)
                continue
            self._none.pop(rid, None)
            self.ensure(rid, desc)
        for rid in [r for r in self._subs if r not in seen]:
            self.stop(rid)
        for rid in [r for r in self._none if r not in seen]:
            del self._none[rid]

    async def close(self) -> None:
        for s in list(self._subs.values()):
            self._cancel(s)
        self._subs.clear()
        await stop_tasks(*self._dying)
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    def _cancel(self, sub: _Sub) -> None:
        for t in sub.tasks:
            t.cancel()
            self._dying.add(t)
            t.add_done_callback(self._dying.discard)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        # its mirror is stale from now on (answers None); the next refresh starts a new subscriber
        log.error("kv events subscriber %s died", task.get_name(), exc_info=task.exception())


def json_fetcher(fetch: Callable[..., Awaitable[tuple[int, bytes]]], timeout_s: float = 2.0) -> FetchJson:
    """A ``FetchJson`` over a ``ReplicaClient.fetch`` (``None`` on any failure or non-200)."""

    async def get(replica_id: str, url: str) -> dict[str, Any] | None:
        try:
            status, body = await fetch(replica_id, url, accept="application/json", timeout_s=timeout_s)
        except UpstreamError:  # not now: the next round asks again
            return None
        if status != 200:
            return None
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None

    return get

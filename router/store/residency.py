"""Exact residency shared through Redis: one writer per replica, a local mirror in every gateway.

Why: a gateway that subscribes to every replica's KV events pays for every event of the fleet. With
many gateways (one per client pod), the replica's sidecar (``kvroute sidecar --kv-events``) or one
gateway (``kv_events.publish: true``) subscribes instead and writes *per-session answers* into Redis;
every other gateway (``kv_events.mode: redis``) keeps a mirror of them fed by a Redis stream, so a
request still costs no extra round trip (the snapshot reads the mirror in memory).

Rules:
  1. The writer (:class:`RedisResidencyWriter`) publishes, every ``flush_s``, the sessions whose
     answer changed on each replica it follows (``ReplicaResidency.take_changes``), in one Lua call
     per replica: the hash ``res:<rid>`` is updated, the replica's source and expiry are set in
     ``ress``, and the change is appended to the stream ``resx`` with a counter. An idle replica is
     re-published every ``ttl_s / 3`` (a heartbeat): a writer that dies lets its replica expire,
     and mirrors then read ``None`` / ``estimate`` for it.
  2. The mirror (:class:`RedisResidencyMirror`, a ``ResidencyView``) reads everything once (one Lua
     call: all hashes and the stream position, atomically), then follows the stream. A gap in the
     counter (the stream was trimmed past it, or a Redis outage) triggers a full read again. While
     Redis is unreachable the mirror is *stale*: every answer is ``None``.
  3. Keys are in ``router/store/keys.py`` (hash tag ``{prefix}``: one slot, Cluster-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from router.eventloop import stop_tasks
from router.residency import EVENTS, OFF, ResidencyIndex
from router.store.keys import KeySpace

__all__ = ["RedisResidencyMirror", "RedisResidencyWriter"]

log = logging.getLogger("kvroute.store.residency")

_ERRORS = (rexc.RedisError, OSError, TimeoutError)


def _script() -> str:
    lua = resources.files("router.store").joinpath("lua")
    return lua.joinpath("_lib.lua").read_text() + "\n" + lua.joinpath("residency.lua").read_text()


class RedisResidencyWriter:
    """Publishes the answers of a :class:`ResidencyIndex` built with ``track_changes=True``."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        index: ResidencyIndex,
        *,
        keys: KeySpace | None = None,
        writer_id: str = "",
        flush_s: float = 0.05,
        ttl_s: float = 3.0,
        maxlen: int = 100_000,
    ) -> None:
        if not index.track_changes:
            raise ValueError("the index must be built with track_changes=True")
        self.client = client
        self.index = index
        self.keys = keys or KeySpace()
        self.writer_id = writer_id
        self.flush_s = flush_s
        self.ttl_s = ttl_s
        self.maxlen = maxlen
        self._script = client.register_script(_script())
        self._beat_at: dict[str, float] = {}
        self._source: dict[str, str] = {}
        self._failed: set[str] = set()  # replicas whose last write failed: rewrite them whole
        self._last_n = 0  # the stream counter our last write got (it goes back: Redis lost its data)
        self.writes = 0
        self.entries = 0  # sessions written
        self.errors = 0

    async def _call(self, *args: str | int) -> Any:
        return await self._script(keys=[self.keys.residency_counter], args=[self.keys.base, *args])

    async def flush_once(self) -> int:
        """Write every replica whose answers or source changed (or whose heartbeat is due)."""
        now = time.monotonic()
        n = 0
        for rid in self.index.replica_ids():
            ranks = self.index.ranks(rid)
            # a replica new to this writer, or whose last write failed, is written whole
            reset = rid in self._failed or rid not in self._source
            changed: set[str] = set()
            for r in ranks:
                rr, items = r.take_changes()
                reset = reset or rr
                changed.update(sid for sid, _ in items)
            if reset:  # everything known now, from scratch
                changed = {sid for r in ranks for sid in r.tips}
            source = self.index.source(rid)
            due = now - self._beat_at.get(rid, 0.0) >= self.ttl_s / 3
            if not changed and not reset and source == self._source.get(rid) and not due:
                continue
            # a session no rank tracks any more (dropped, rule 6) is forgotten by the mirrors too
            pairs = [[sid, self.index.resident_tokens(rid, sid) if self.index.tracks(rid, sid) else None]
                     for sid in sorted(changed)]  # fmt: skip
            try:
                got = int(await self._call("write", rid, source, int(self.ttl_s * 1000), int(reset), self.maxlen,
                                           self.writer_id, json.dumps(pairs, separators=(",", ":"))))
            except _ERRORS as exc:
                self.errors += 1
                self._failed.add(rid)  # what was taken is lost: the next write is a full one
                log.warning("residency write for %s failed: %s", rid, exc)
                continue
            self._failed.discard(rid)
            if got <= self._last_n:  # a restarted (emptied) Redis: everything is written whole again
                log.info("residency: Redis lost what was written; rewriting every replica")
                self._failed.update(r for r in self.index.replica_ids() if r != rid or not reset)
            self._last_n = got
            self._beat_at[rid] = now
            self._source[rid] = source
            self.writes += 1
            self.entries += len(pairs)
            n += 1
        for rid in [r for r in self._source if r not in set(self.index.replica_ids())]:
            with contextlib.suppress(*_ERRORS):
                await self._call("drop", rid)
            self._source.pop(rid, None)
            self._beat_at.pop(rid, None)
        return n

    async def run(self) -> None:
        while True:
            await self.flush_once()
            await asyncio.sleep(self.flush_s)

    async def close(self) -> None:
        for rid in list(self._source):
            with contextlib.suppress(*_ERRORS):
                await self._call("drop", rid)


class RedisResidencyMirror:
    """A ``ResidencyView`` over what the writers published (rule 2). ``start`` / ``close`` it.

    Its ``XREAD`` blocks for up to ``block_ms``: ``close`` cancels it (``stop_tasks``, which asks
    again when redis-py loses the cancel)."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        keys: KeySpace | None = None,
        block_ms: int = 1000,
        retry_s: float = 1.0,
    ) -> None:
        self.client = client
        self.keys = keys or KeySpace()
        self.block_ms = block_ms
        self.retry_s = retry_s
        self._script = client.register_script(_script())
        self._res: dict[str, dict[str, int]] = {}
        self._src: dict[str, tuple[str, float]] = {}  # rid -> (source, expiry on time.monotonic())
        self._last_id = "0-0"
        self._n = 0
        self.stale = True
        self.reads = 0
        self.entries = 0
        self.gaps = 0
        self.errors = 0
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="kvroute-residency-mirror")

    async def close(self) -> None:
        self._closing = True
        t, self._task = self._task, None
        await stop_tasks(t)

    # ---- ResidencyView -----------------------------------------------------------------------
    def _live(self, rid: str) -> str | None:
        s = self._src.get(rid)
        if s is None or self.stale or s[1] < time.monotonic():
            return None
        return s[0]

    def resident_tokens(self, replica_id: str, session_id: str) -> int | None:
        src = self._live(replica_id)
        if src is None:
            return None
        v = self._res.get(replica_id, {}).get(session_id)
        if v is None:
            return 0 if src == EVENTS else None
        return v

    def resident_on(self, session_id: str) -> tuple[tuple[str, int], ...]:
        out = []
        for rid in sorted(self._res):
            v = self._res[rid].get(session_id)
            if v and self._live(rid) is not None:
                out.append((rid, v))
        return tuple(out)

    def tip_on(self, session_id: str) -> tuple[str, ...]:
        return ()  # the writers publish token counts only

    def tracks(self, replica_id: str, session_id: str) -> bool:
        return self._live(replica_id) is not None and session_id in self._res.get(replica_id, {})

    def source(self, replica_id: str) -> str:
        if replica_id not in self._src:
            return OFF
        src = self._live(replica_id)
        return "estimate" if src is None else src

    # ---- feeding -----------------------------------------------------------------------------
    async def read_all(self) -> None:
        out = await self._script(keys=[self.keys.residency_counter], args=[self.keys.base, "read"])
        last_id, n, redis_ms = out[0], int(out[1]), int(out[2])
        now = time.monotonic()
        res: dict[str, dict[str, int]] = {}
        src: dict[str, tuple[str, float]] = {}
        for rid, meta, flat in out[3:]:
            source, exp, _writer = str(meta).split("|", 2)
            src[rid] = (source, now + (int(exp) - redis_ms) / 1000.0)
            res[rid] = {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        self._res, self._src = res, src
        self._last_id, self._n = str(last_id), n
        self.stale = False
        self.reads += 1

    def apply(self, fields: Mapping[str, str]) -> bool:
        """One stream entry; ``False`` on a gap in the counter (a full read is needed)."""
        n = int(fields["n"])
        if n <= self._n:
            return True  # already in what we read
        if n != self._n + 1:
            self.gaps += 1
            return False
        self._n = n
        rid, kind = fields["r"], fields["k"]
        if kind == "x":
            self._res.pop(rid, None)
            self._src.pop(rid, None)
            return True
        d = self._res.setdefault(rid, {})
        if kind == "r":
            d.clear()
        for sid, v in json.loads(fields["d"]):
            if v is None:
                d.pop(sid, None)
            else:
                d[sid] = int(v)
        self._src[rid] = (fields["s"], time.monotonic() + int(fields["t"]) / 1000.0)
        self.entries += 1
        return True

    async def run(self) -> None:
        while not self._closing:
            try:
                if self.stale:
                    await self.read_all()
                resp: Any = await self.client.xread(
                    {self.keys.residency_stream: self._last_id}, count=1000, block=self.block_ms
                )
                for _stream, entries in resp or ():
                    for entry_id, fields in entries:
                        self._last_id = entry_id if isinstance(entry_id, str) else entry_id.decode()
                        f = {_s(k): _s(v) for k, v in fields.items()}
                        if not self.apply(f):
                            self.stale = True
                            break
                    if self.stale:
                        break
            except _ERRORS as exc:
                self.errors += 1
                self.stale = True
                log.warning("residency mirror: %s", exc)
                if not self._closing:
                    await asyncio.sleep(self.retry_s)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

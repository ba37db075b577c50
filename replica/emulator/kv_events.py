"""SGLang's KV-event stream from the emulator: same flag, same ``/server_info``, same bytes.

``--kv-events-config`` takes SGLang 0.5.23's JSON (``KVEventsConfig``: publisher, endpoint, bind,
replay_endpoint, buffer_steps, hwm, max_queue_size, topic, format). The emulator's cache reports
what it stores and drops through its listener (``cache`` Rule 6); this module turns that into the
engine's events and publishes them exactly as ``sglang/srt/disaggregation/kv_events.py`` does.

Theory of operation
-------------------
Rule 1 (hashes): a block's published hash is SGLang's: ``d_i = SHA-256(d_{i-1} || tokens_i)`` with
        each token a little-endian ``uint32`` (no ``d_{i-1}`` for the first block of a chain), and
        the event carries the first 8 bytes of ``d_i`` as a big-endian signed int64
        (``mem_cache/utils.py::hash_str_to_int64``, ``cpp_utils/hash_binding.cpp``). The emulator's
        tokens are already those 4-byte words, so the same tokens and page size give the same
        hashes as the real engine. ``cache_salt`` / ``extra_key`` namespaces are not reproduced.
Rule 2 (state): the recorder keeps, for every cached block, its SHA-256 digest (the next block's
        chain input), its token bytes (a tier move publishes them again) and its tiers; a block is
        forgotten when it leaves its last tier.
Rule 3 (events): one ``BlockStored`` per stored run (coalesced with the previous one when it
        continues it, as SGLang's recorder does), one ``BlockRemoved`` per removed run (coalesced),
        ``AllBlocksCleared`` when the cache is flushed and once at start (SGLang's cache emits one
        when it is created). A request's ``session_id`` rides on the blocks it stores.
Rule 4 (batches): the server takes the queue after every engine step it runs (one batch per step,
        like SGLang's scheduler) and the publisher sends ``[topic, seq (8 bytes BE), msgpack
        [ts, events, dp_rank]]`` on a PUB socket, keeps the last ``buffer_steps`` batches and serves
        them on the ROUTER replay socket.

:class:`ResidencyFeeder` is the shortcut for the simulator: the same listener calls applied to a
``router.residency.ReplicaResidency`` with no hashing, encoding or sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replica.emulator.cache import DEVICE, HOST

if TYPE_CHECKING:
    from router.residency import ReplicaResidency

__all__ = [
    "KvEventRecorder",
    "KvEventsConfig",
    "KvEventsPublisher",
    "ResidencyFeeder",
    "Source",
    "event_hash",
    "for_replica",
    "sglang_digests",
]

log = logging.getLogger("replica.emulator.kv_events")

_MEDIUM = {DEVICE: "GPU", HOST: "CPU_PINNED"}
_BYTES_PER_TOKEN = 4


def sglang_digests(data: bytes, page_size: int, prior: bytes | None = None) -> list[bytes]:
    """SHA-256 chain over the full ``page_size``-token pages of ``data`` (4 bytes per token)."""
    step = page_size * _BYTES_PER_TOKEN
    out: list[bytes] = []
    d = prior
    sha = hashlib.sha256
    for i in range(len(data) // step):
        page = data[i * step : (i + 1) * step]
        d = sha(page if d is None else d + page).digest()
        out.append(d)
    return out


def event_hash(digest: bytes) -> int:
    """The int64 an event carries for a block (Rule 1)."""
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True, slots=True)
class Source:
    """What a request is admitted with (the cache's ``owner``): its chain's token bytes (prompt, then
    output) and its ``session_id``."""

    data: bytes
    session_id: str | None = None


class KvEventRecorder:
    """A ``CacheListener`` that queues SGLang-shaped events (plain dicts in the schema's field order,
    optional ``None`` fields omitted: what msgspec's ``omit_defaults`` encoding produces)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._step = page_size * _BYTES_PER_TOKEN
        # emulator block hash -> [digest, token bytes, tiers] (Rule 2)
        self._blocks: dict[int, list[Any]] = {}
        self._queue: list[dict[str, Any]] = [{"type": "AllBlocksCleared"}]
        self.unknown_blocks = 0  # stores whose tokens or parent were not known (a bug if > 0)

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def take(self) -> list[dict[str, Any]]:
        q, self._queue = self._queue, []
        return q

    # ---- CacheListener -------------------------------------------------------------------------
    def stored(self, parent: int | None, hashes: list[int], depth: int, tier: int, owner: object) -> None:
        blocks = self._blocks
        prev_digest: bytes | None = None
        if parent is not None:
            pb = blocks.get(parent)
            if pb is None:
                self.unknown_blocks += 1
            else:
                prev_digest = pb[0]
        src = owner if isinstance(owner, Source) else None
        step = self._step
        out_hashes: list[int] = []
        tokens = array("I")
        for i, h in enumerate(hashes):
            b = blocks.get(h)
            if b is None:
                if src is None or depth < 0:
                    self.unknown_blocks += 1
                    return
                lo = (depth + i) * step
                page = src.data[lo : lo + step]
                if len(page) != step:
                    self.unknown_blocks += 1
                    return
                d = hashlib.sha256(page if prev_digest is None else prev_digest + page).digest()
                b = blocks[h] = [d, page, tier]
            else:
                b[2] |= tier
            prev_digest = b[0]
            out_hashes.append(event_hash(b[0]))
            tokens.frombytes(b[1])
        parent_hash = None if parent is None or parent not in blocks else event_hash(blocks[parent][0])
        self._enqueue_stored(out_hashes, parent_hash, tokens.tolist(), _MEDIUM[tier], src.session_id if src else None)

    def removed(self, hashes: list[int], tier: int) -> None:
        blocks = self._blocks
        out: list[int] = []
        for h in hashes:
            b = blocks.get(h)
            if b is None:
                self.unknown_blocks += 1
                continue
            out.append(event_hash(b[0]))
            b[2] &= ~tier
            if not b[2]:
                del blocks[h]
        if not out:
            return
        medium = _MEDIUM[tier]
        q = self._queue
        if q and q[-1]["type"] == "BlockRemoved" and q[-1]["medium"] == medium:
            q[-1]["block_hashes"].extend(out)
            return
        q.append({"type": "BlockRemoved", "block_hashes": out, "medium": medium})

    def cleared(self) -> None:
        self._blocks.clear()
        self._queue.append({"type": "AllBlocksCleared"})

    def _enqueue_stored(
        self, hashes: list[int], parent: int | None, tokens: list[int], medium: str, session_id: str | None
    ) -> None:
        q = self._queue
        if q:
            tail = q[-1]
            if (
                tail["type"] == "BlockStored"
                and tail["medium"] == medium
                and tail.get("session_id") == session_id
                and tail["block_hashes"]
                and parent == tail["block_hashes"][-1]
            ):
                tail["block_hashes"].extend(hashes)
                tail["token_ids"].extend(tokens)
                return
        ev: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.page_size,
            "lora_id": None,
            "medium": medium,
        }
        if session_id is not None:
            ev["session_id"] = session_id
        q.append(ev)


class ResidencyFeeder:
    """A ``CacheListener`` applying the cache's changes to a ``ReplicaResidency`` directly (what a
    subscriber would end up with, minus hashing, encoding and sockets): for the simulator and tests.
    ``owner`` is the session id (a ``str``) or a :class:`Source`."""

    def __init__(self, sink: ReplicaResidency, page_size: int) -> None:
        self.sink = sink
        self.page_size = page_size
        sink.cleared()  # the cache starts empty: the mirror is complete

    def stored(self, parent: int | None, hashes: list[int], depth: int, tier: int, owner: object) -> None:
        sid = owner.session_id if isinstance(owner, Source) else owner if isinstance(owner, str) else None
        self.sink.stored(parent, hashes, self.page_size, len(hashes) * self.page_size, tier, sid)

    def removed(self, hashes: list[int], tier: int) -> None:
        self.sink.removed(hashes, tier)

    def cleared(self) -> None:
        self.sink.cleared()


# ---- configuration (SGLang's KVEventsConfig) ------------------------------------------------------

_FIELDS: dict[str, tuple[type, ...]] = {
    "publisher": (str,),
    "endpoint": (str,),
    "bind": (bool, type(None)),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
    "format": (str,),
}


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """SGLang's ``--kv-events-config`` (the same JSON, the same defaults). ``raw`` is reported back
    verbatim in ``/server_info.kv_events_config``, as the engine does."""

    raw: str
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: str = "default"

    @classmethod
    def from_cli(cls, raw: str) -> KvEventsConfig:
        """Parse like pydantic's ``KVEventsConfig.model_validate_json``; ``ValueError`` on bad input."""
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config: not JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise ValueError("--kv-events-config: expected a JSON object")  # noqa: TRY004 - one error type for bad input
        kw: dict[str, Any] = {}
        for k, v in obj.items():
            types = _FIELDS.get(k)
            if types is None:
                continue  # pydantic's default (extra="ignore")
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise ValueError(f"--kv-events-config: {k} has the wrong type")
            kw[k] = v
        cfg = cls(raw=raw, **kw)
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"Unknown event publisher '{cfg.publisher}'")
        if cfg.format not in ("default", "dynamo"):
            raise ValueError("--kv-events-config: format must be 'default' or 'dynamo'")
        if cfg.format == "dynamo":
            raise ValueError("--kv-events-config: the emulator publishes the 'default' format only")
        if cfg.buffer_steps < 0 or cfg.hwm < 0 or cfg.max_queue_size <= 0:
            raise ValueError("--kv-events-config: buffer_steps, hwm >= 0 and max_queue_size > 0")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    def check_ranks(self, dp_size: int) -> None:
        """Rank r publishes on the endpoint's port + r and replays on the replay port + r (SGLang's
        layout): with several ranks the ports must be numbers and the two ranges must not meet."""
        ports = [e.rpartition(":")[2] for e in (self.endpoint, self.replay_endpoint) if e and e.startswith("tcp://")]
        if dp_size <= 1 or not self.enabled:
            return
        if "*" in ports:
            raise ValueError("--kv-events-config: with more than one data-parallel rank the ports must be numbers "
                             "(rank r publishes on port + r)")
        if len(ports) == 2 and ports[0].isdigit() and ports[1].isdigit() and abs(int(ports[0]) - int(ports[1])) < dp_size:
            raise ValueError(f"--kv-events-config: endpoint and replay_endpoint ports must be at least {dp_size} "
                             "apart (one port per data-parallel rank each)")

    def describe(
        self, page_size: int, bound: str | None = None, bound_replay: str | None = None, dp_size: int = 1
    ) -> dict[str, Any] | None:
        """``/server_info.kv_events`` (``describe_kv_events_publisher``): ``None`` unless a tcp
        endpoint is published. ``bound``/``bound_replay``: the endpoints actually bound, whose
        ports stand in for a ``*`` port (an emulator extension: free ports for tests)."""
        hp = _tcp(self.endpoint, bound)
        if not self.enabled or hp is None or page_size <= 0:
            return None
        out: dict[str, Any] = {
            "publisher": self.publisher,
            "endpoint_host": hp[0],
            "endpoint_port_base": hp[1],
            "topic": self.topic,
            "block_size": page_size,
            "dp_size": dp_size,
        }
        rp = _tcp(self.replay_endpoint, bound_replay)
        if rp is not None:
            out["replay_endpoint_port_base"] = rp[1]
        return out


def _tcp(endpoint: str | None, bound: str | None = None) -> tuple[str, int] | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if port == "*" and bound is not None and bound.startswith("tcp://"):
        port = bound.rpartition(":")[2]
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


def for_replica(raw: str, index: int, stride: int = 2) -> str:
    """The config of replica ``index`` of several served together: both ports shifted by
    ``index * stride`` (``*`` ports stay free ports). ``raw`` itself for replica 0."""
    if index == 0:
        return raw
    obj = json.loads(raw)
    for key in ("endpoint", "replay_endpoint"):
        e = obj.get(key)
        if isinstance(e, str) and e.startswith("tcp://"):
            base, _, port = e.rpartition(":")
            if port.isdigit():
                obj[key] = f"{base}:{int(port) + index * stride}"
    return json.dumps(obj, separators=(",", ":"))


# ---- the publisher -----------------------------------------------------------------------------------


class KvEventsPublisher:
    """SGLang's ``ZmqEventPublisher`` on asyncio: PUB + ROUTER replay + a bounded replay buffer.

    ``publish`` never blocks the engine: batches go through a queue of ``max_queue_size`` (a full
    queue drops the batch and counts it, as a stuck subscriber must never stall the replica; the
    sequence number then jumps, so subscribers see a gap) to a sender task.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KvEventsConfig, dp_rank: int = 0) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self.config = config
        self.dp_rank = dp_rank
        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.asyncio.Context()
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps or None)
        self._queue: asyncio.Queue[tuple[int, bytes, bool, float] | None] = asyncio.Queue(maxsize=config.max_queue_size)
        self._seq = 0
        self.published = 0
        self.dropped = 0
        self.replays = 0
        self.ignore_replays = 0  # fault injection for tests: leave the next N replay requests unanswered
        self.lag_s = 0.0  # fault injection for tests: send each batch this long after it was published
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        bind = config.bind
        if bind is None:  # SGLang's heuristic: wildcards and ipc/inproc bind, anything else connects
            e = config.endpoint
            bind = any(w in e for w in ("*", "::", "0.0.0.0")) or e.startswith(("ipc://", "inproc://"))
        endpoint = _offset(config.endpoint, dp_rank) or config.endpoint
        self.bound: str | None = None
        self.bound_replay: str | None = None
        if bind:
            self._pub.bind(endpoint)
            self.bound = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(_offset(config.replay_endpoint, dp_rank) or config.replay_endpoint)
            self.bound_replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._send_loop(), name="emulator-kv-events-pub"))
        if self._replay is not None:
            self._tasks.append(loop.create_task(self._replay_loop(), name="emulator-kv-events-replay"))

    def publish(self, events: list[dict[str, Any]], *, drop_live: bool = False) -> None:
        """Queue one batch. ``drop_live`` (fault injection for tests): keep it for replay but never
        send it live, as a subscriber behind a full high-water mark would miss it."""
        if not events:
            return
        seq = self._seq
        self._seq += 1
        payload = self._encode([time.time(), events, self.dp_rank])
        try:
            self._queue.put_nowait((seq, payload, not drop_live, time.monotonic() + self.lag_s))
        except asyncio.QueueFull:
            self.dropped += 1

    async def _send_loop(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            seq, payload, live, due = item
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            if live:
                await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self.published += 1
            self._buffer.append((seq, payload))

    async def _replay_loop(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request (%d frames)", len(frames))
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.replays += 1
            if self.ignore_replays > 0:
                self.ignore_replays -= 1
                continue
            for seq, buf in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), buf))
            await sock.send_multipart((client, b"", b"", self.END_SEQ, b""))

    async def close(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)
        for t in self._tasks[1:]:
            t.cancel()
        if self._tasks:
            # let the sender flush what is queued (bounded), then stop it
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), 1.0)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.destroy(linger=0)

    def stats(self) -> dict[str, int]:
        return {"published": self.published, "dropped": self.dropped, "replays": self.replays, "next_seq": self._seq}


def _offset(endpoint: str | None, rank: int) -> str | None:
    """``ZmqEventPublisher.offset_endpoint_port``: rank r publishes on port + r."""
    if not endpoint or rank == 0 or endpoint.endswith(":*"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


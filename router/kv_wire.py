"""SGLang's KV-event wire format (0.5.23), decoded with the engine's own schema. PURE (no I/O).

Source: ``sglang/srt/disaggregation/kv_events.py`` (publisher, schema) and
``sglang/srt/runtime_context.py::describe_kv_events_publisher`` (the ``/server_info.kv_events``
descriptor). docs/KV_EVENTS.md has the whole picture.

Wire:
  * one ZMQ PUB socket per DP rank at ``tcp://<replica host>:<endpoint_port_base + rank>`` (the host
    of the registered replica URL, never the descriptor's ``endpoint_host``); each message
    is multipart ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0 per publisher
    process, ``payload`` a msgpack array ``[ts, events, attn_dp_rank]``;
  * events are msgpack maps tagged by ``type`` (msgspec ``tag=True``): ``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``; optional fields left at ``None`` are omitted;
  * replay: a DEALER sends ``[b"", start_seq(8 bytes)]`` to the ROUTER at
    ``replay_endpoint_port_base + rank`` and gets ``[b"", topic, seq, payload]`` for every buffered
    batch with ``seq >= start_seq``, then ``[b"", b"", END_SEQ, b""]`` (``END_SEQ`` = -1).

Rule 1: ``token_ids`` stays undecoded (``msgspec.Raw``): the residency index needs only the count,
        which is read from the msgpack array header. With ``page_size`` 1 a 100k-token store is
        100k ids; decoding them would cost most of the event's handling time.
Rule 2: a ``medium`` of ``None`` means ``GPU`` (the engine's default). Tiers become bits of a mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_BITS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventSink",
    "KvEventsDescriptor",
    "WireError",
    "decode_batch",
    "decode_seq",
    "feed_batch",
    "medium_bit",
    "parse_descriptor",
    "token_count",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)

# one bit per storage tier (SGLang's StorageMedium values); a block is resident while any bit is set
MEDIUM_BITS: dict[str, int] = {"GPU": 1, "CPU_PINNED": 2, "DISK": 4, "EXTERNAL": 8}
_UNKNOWN_MEDIUM_BIT = 16


class WireError(ValueError):
    """A message that does not follow the wire format (bad frame count, seq size, payload)."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: msgspec.Raw  # rule 1
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad KV-event payload: {exc}") from None


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame has {len(frame)} bytes, expected 8")
    # unsigned: a publisher counts up from 0 (the replay's end marker, -1, is matched on its bytes
    # before this); a negative number would later be sent back as a replay start and not fit
    seq = int.from_bytes(frame, "big")
    if seq >= 1 << 63:
        raise WireError("negative sequence number")
    return seq


def token_count(raw: msgspec.Raw | bytes | memoryview) -> int:
    """Length of the msgpack array in ``raw`` (read from its header; the elements are not decoded)."""
    b = bytes(memoryview(raw)[:5])
    if not b:
        raise WireError("empty token_ids")
    t = b[0]
    if 0x90 <= t <= 0x9F:
        return t & 0x0F
    if t == 0xDC and len(b) >= 3:
        return int.from_bytes(b[1:3], "big")
    if t == 0xDD and len(b) >= 5:
        return int.from_bytes(b[1:5], "big")
    if t == 0xC0:  # nil
        return 0
    raise WireError(f"token_ids is not a msgpack array (type byte 0x{t:02x})")


def medium_bit(medium: str | None) -> int:
    if medium is None:
        return 1
    return MEDIUM_BITS.get(medium, _UNKNOWN_MEDIUM_BIT)


class EventSink(Protocol):
    """What a decoded batch is applied to (``router.residency.ReplicaResidency``)."""

    def stored(
        self,
        parent: int | None,
        hashes: list[int],
        block_tokens: int,
        total_tokens: int,
        medium: int,
        session_id: str | None,
    ) -> None: ...

    def removed(self, hashes: list[int], medium: int) -> None: ...

    def cleared(self) -> None: ...


def feed_batch(batch: EventBatch, sink: EventSink) -> int:
    """Apply every event of ``batch`` to ``sink`` in order; returns the number of events."""
    for ev in batch.events:
        if type(ev) is BlockStored:
            sink.stored(
                ev.parent_block_hash,
                ev.block_hashes,
                ev.block_size,
                token_count(ev.token_ids),
                medium_bit(ev.medium),
                ev.session_id,
            )
        elif type(ev) is BlockRemoved:
            sink.removed(ev.block_hashes, medium_bit(ev.medium))
        else:
            sink.cleared()
    return len(batch.events)


# ---- /server_info.kv_events ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvEventsDescriptor:
    """Where one replica publishes (``/server_info.kv_events``, on the registered replica's host)."""

    host: str  # bracketed if IPv6
    port_base: int
    topic: str = ""
    block_size: int = 1
    dp_size: int = 1
    replay_port_base: int | None = None

    def endpoint(self, rank: int = 0) -> str:
        return f"tcp://{self.host}:{self.port_base + rank}"

    def replay_endpoint(self, rank: int = 0) -> str | None:
        if self.replay_port_base is None:
            return None
        return f"tcp://{self.host}:{self.replay_port_base + rank}"

    def of_rank(self, rank: int) -> KvEventsDescriptor | None:
        """The publisher of data-parallel rank ``rank`` alone (a replica that is that rank), or
        ``None`` if the engine has no such rank."""
        if not 0 <= rank < self.dp_size:
            return None
        replay = None if self.replay_port_base is None else self.replay_port_base + rank
        return replace(self, port_base=self.port_base + rank, dp_size=1, replay_port_base=replay)


def _port(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 65535:
        return None
    return v


def parse_descriptor(server_info: Mapping[str, Any], replica_url: str) -> KvEventsDescriptor | None:
    """The publisher of a replica from its ``/server_info`` (``None``: it publishes nothing we can
    subscribe to). The host is always the registered replica URL's: ``endpoint_host`` is ignored,
    as the replica is not trusted to send the gateway's connections anywhere else (the egress
    rules vetted the registered host, not what the replica reports)."""
    kv = server_info.get("kv_events")
    if not isinstance(kv, Mapping) or kv.get("publisher") != "zmq":
        return None
    port = _port(kv.get("endpoint_port_base"))
    if port is None:
        return None
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    topic = kv.get("topic")
    block = kv.get("block_size")
    dp = kv.get("dp_size")
    return KvEventsDescriptor(
        host=host,
        port_base=port,
        topic=topic if isinstance(topic, str) else "",
        block_size=block if isinstance(block, int) and not isinstance(block, bool) and block > 0 else 1,
        dp_size=dp if isinstance(dp, int) and not isinstance(dp, bool) and 0 < dp <= 1024 else 1,
        replay_port_base=_port(kv.get("replay_endpoint_port_base")),
    )

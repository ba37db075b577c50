"""SGLang's KV-event wire format (router/kv_wire.py): decoding, token counts, the descriptor."""

from __future__ import annotations

import base64
import json
from array import array
from pathlib import Path

import msgspec
import pytest

from router.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
    decode_seq,
    feed_batch,
    medium_bit,
    parse_descriptor,
    token_count,
)
from router.residency import ReplicaResidency

enc = msgspec.msgpack.encode


def sglang_payload() -> bytes:
    """A batch as SGLang 0.5.23 encodes it (tagged maps, omitted None defaults, array batch)."""
    return enc(
        [
            1767225600.5,
            [
                {"type": "AllBlocksCleared"},
                {
                    "type": "BlockStored",
                    "block_hashes": [-5, 7],
                    "parent_block_hash": None,
                    "token_ids": list(range(40)),
                    "block_size": 32,
                    "lora_id": None,
                    "medium": "GPU",
                    "session_id": "s1",
                },
                {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7, "token_ids": [1] * 32,
                 "block_size": 32, "lora_id": None, "medium": "CPU_PINNED"},
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            ],
            0,
        ]
    )


def test_decode_and_feed() -> None:
    batch = decode_batch(sglang_payload())
    assert batch.ts == 1767225600.5 and batch.attn_dp_rank == 0
    kinds = [type(e) for e in batch.events]
    assert kinds == [AllBlocksCleared, BlockStored, BlockStored, BlockRemoved]
    st = batch.events[1]
    assert isinstance(st, BlockStored)
    assert st.block_hashes == [-5, 7] and st.session_id == "s1" and token_count(st.token_ids) == 40
    r = ReplicaResidency()
    assert feed_batch(batch, r) == 4
    # 40 tokens in blocks of 32: the first block ends at 32, the second (partial) at 40
    assert r.complete and r.resident_tokens("s1") == 32  # its tip (7) left the GPU and was on no other tier


def test_an_unknown_event_type_or_garbage_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_batch(enc([0.0, [{"type": "Nope"}], 0]))
    with pytest.raises(WireError):
        decode_batch(b"\xc1")
    with pytest.raises(WireError):
        decode_seq(b"\x00" * 4)
    assert decode_seq((5).to_bytes(8, "big")) == 5


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536, 100_000])
def test_token_count_reads_the_array_header(n: int) -> None:
    raw = msgspec.Raw(enc(list(range(n))))
    assert token_count(raw) == n


def test_token_count_of_pairs_counts_pages_not_ints() -> None:
    # EAGLE (bigram) pages publish tuples: still one element per token
    assert token_count(msgspec.Raw(enc([[1, 2], [2, 3]]))) == 2
    with pytest.raises(WireError):
        token_count(msgspec.Raw(enc("x")))


def test_medium_bits() -> None:
    assert medium_bit(None) == medium_bit("GPU") == 1
    assert medium_bit("CPU_PINNED") == 2
    assert medium_bit("SOMETHING_NEW") not in (1, 2, 4, 8)


def test_descriptor_from_server_info() -> None:
    kv = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
          "block_size": 64, "dp_size": 2, "replay_endpoint_port_base": 5558}
    d = parse_descriptor({"kv_events": kv}, "http://10.0.0.7:30000")
    assert d is not None
    assert (d.endpoint(0), d.endpoint(1), d.replay_endpoint(1)) == (
        "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "tcp://10.0.0.7:5559")
    assert d.block_size == 64 and d.dp_size == 2
    v6 = parse_descriptor({"kv_events": {**kv, "endpoint_host": "::"}}, "http://[::1]:30000")
    assert v6 is not None and v6.endpoint() == "tcp://[::1]:5557"
    # the registered URL's host, never the one the replica names (tests/router/test_kv_events_hostile.py)
    named = parse_descriptor({"kv_events": {**kv, "endpoint_host": "engine-0.svc"}}, "http://1.2.3.4:1")
    assert named is not None and named.endpoint() == "tcp://1.2.3.4:5557"
    no_replay = parse_descriptor({"kv_events": {k: v for k, v in kv.items() if "replay" not in k}}, "http://h:1")
    assert no_replay is not None and no_replay.replay_endpoint() is None
    # a replica that is one data-parallel rank follows that rank's publisher alone
    r1 = d.of_rank(1)
    assert r1 is not None and (r1.endpoint(), r1.replay_endpoint(), r1.dp_size) == ("tcp://10.0.0.7:5558", "tcp://10.0.0.7:5559", 1)
    assert d.of_rank(2) is None and d.of_rank(-1) is None
    assert no_replay.of_rank(1) is not None and no_replay.of_rank(1).replay_endpoint() is None  # type: ignore[union-attr]
    for bad in (None, {"publisher": "null"}, {**kv, "endpoint_port_base": 0}, {**kv, "endpoint_port_base": "x"}):
        assert parse_descriptor({"kv_events": bad}, "http://h:1") is None
    assert parse_descriptor({}, "http://h:1") is None


# ---- bytes captured from a real SGLang 0.5.23 (CPU, page_size 1) ---------------------------------------
# tests/router/fixtures/kv_events/: the whole replay buffer of a server and its /server_info
# (kv_events part), at two page sizes; every request carried its ``session_id`` in the body.
# - page 1 (``sglang-0.5.23-cpu``): sessions sess-A (4 turns), sess-B (3 turns), sess-D (3 turns,
#   then evicted by sess-E's 2,652-token prompt in a 3,000-token pool, then one more turn: 7 tokens
#   cached), then a flush.
# - page 16 (``sglang-0.5.23-cpu-page16``, ``--page-size 16``, as a GPU deployment pages its KV):
#   sess-A (4 turns), sess-B (3), sess-D (3), sess-E's 2,764-token prompt in a 2,992-token pool
#   evicting the others and part of sess-D, sess-D once more (192 cached), then a flush.

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"
CAPTURES = {1: "sglang-0.5.23-cpu", 16: "sglang-0.5.23-cpu-page16"}


def real_frames(page: int = 1) -> list[tuple[int, bytes]]:
    out = []
    for line in (FIXTURES / f"{CAPTURES[page]}-frames.jsonl").read_text().splitlines():
        d = json.loads(line)
        out.append((d["seq"], base64.b64decode(d["payload"])))
    return out


def real_server_info(page: int) -> dict[str, object]:
    return json.loads((FIXTURES / f"{CAPTURES[page]}-server_info.json").read_text())  # type: ignore[no-any-return]


def _replayed(page: int, session: str) -> tuple[ReplicaResidency, list[int]]:
    """The mirror after the whole capture, and each value ``session``'s resident tokens took."""
    frames = real_frames(page)
    assert [s for s, _ in frames] == list(range(len(frames)))
    r = ReplicaResidency()
    seen: list[int] = []
    for seq, payload in frames:
        feed_batch(decode_batch(payload), r)
        if seq == 0:
            assert r.complete  # the engine's cache creation is sequence 0
        v = r.resident_tokens(session)
        if v is not None and (not seen or seen[-1] != v):
            seen.append(v)
    assert r.unknown_parents == 0 and r.unknown_removals == 0 and r.removals >= 1
    assert r.resident_blocks == 0 and r.complete  # the flush
    return r, seen


def test_real_engine_frames_decode_and_replay() -> None:
    # sess-D: untracked (0 on a complete mirror), then each turn stores its prompt and then its output
    # (372 / 383 ... tokens from the root: the engine reported 7, 376, 408 cached tokens), counted
    # beyond the 7 template tokens it found cached, which it shares with everyone (rule 2b); sess-E's
    # prompt cut it to those 7 (its next turn: 7 cached), so none of its own; it grew again; the flush
    assert _replayed(1, "sess-D")[1] == [0, 365, 376, 397, 408, 425, 436, 0, 455, 466, 0]


def test_real_engine_frames_with_pages_of_16_replay_in_whole_pages() -> None:
    # Only whole pages are stored, so every value is a multiple of 16: sess-D's turns left 192, 224,
    # 240, then 256 and 272 as its third turn ended (its third prompt of 262 tokens found 224 cached:
    # the re-rendered answer parts from the cached one). sess-E's 2,764-token prompt evicted its last
    # five pages, and its next turn found exactly the 192 left cached. The 7-token template fills no
    # page, so there is nothing shared to subtract. It grew again; the flush
    assert _replayed(16, "sess-D")[1] == [0, 192, 224, 240, 256, 272, 192, 288, 304, 0]


@pytest.mark.parametrize("page", sorted(CAPTURES))
def test_real_engine_block_hashes_are_the_emulators_sha256_chain(page: int) -> None:
    from replica.emulator.kv_events import event_hash, sglang_digests

    digests: dict[int, bytes] = {}
    checked = 0
    for _, payload in real_frames(page):
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev["type"] != "BlockStored":
                continue
            assert ev["block_size"] == page and ev["medium"] == "GPU" and ev["lora_id"] is None
            assert len(ev["token_ids"]) == page * len(ev["block_hashes"])  # whole pages only
            prior = None if ev["parent_block_hash"] is None else digests[ev["parent_block_hash"]]
            ds = sglang_digests(array("I", ev["token_ids"]).tobytes(), page, prior)
            assert [event_hash(d) for d in ds] == ev["block_hashes"]
            digests.update(zip(ev["block_hashes"], ds, strict=True))
            checked += len(ds)
    assert checked > {1: 4000, 16: 200}[page]


@pytest.mark.parametrize("page", sorted(CAPTURES))
def test_real_engine_sessions_ride_on_their_stores(page: int) -> None:
    sids = set()
    for _, payload in real_frames(page):
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev["type"] == "BlockStored" and "session_id" in ev:
                sids.add(ev["session_id"])
    assert sids == {"sess-A", "sess-B", "sess-D", "sess-E"}


def test_real_server_info_descriptor() -> None:
    info = real_server_info(1)
    d = parse_descriptor(info, "http://127.0.0.1:31555")
    assert d is not None
    assert d.endpoint() == "tcp://127.0.0.1:31556" and d.replay_endpoint() == "tcp://127.0.0.1:31557"
    assert d.block_size == info["page_size"] == 1
    paged = real_server_info(16)
    d = parse_descriptor(paged, "http://127.0.0.1:31555")
    assert d is not None and d.block_size == paged["page_size"] == 16

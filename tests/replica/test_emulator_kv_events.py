"""The emulator's KV events (replica/emulator/kv_events.py): SGLang's hashing and event shapes, and
exactness: a residency index fed by the cache's events (directly, or through SGLang's wire bytes)
always answers what the cache itself holds, under eviction, a host tier, shared prefixes and
concurrent requests of one session."""

from __future__ import annotations

import hashlib
import json
import random
from array import array

import msgspec
import pytest

from replica.emulator.cache import DEVICE, HOST, CacheListener, PrefixCache
from replica.emulator.kv_events import (
    KvEventRecorder,
    KvEventsConfig,
    ResidencyFeeder,
    Source,
    for_replica,
    sglang_digests,
)
from replica.emulator.profiles import get_profile
from replica.emulator.timemodel import EngineRequest, ReplicaEngine
from replica.emulator.tokenizer import BYTES_PER_TOKEN, block_hashes, encode_text, output_text
from router.kv_wire import decode_batch, feed_batch
from router.residency import ReplicaResidency

# ---- SGLang's hash, written from its source independently of the module under test ---------------


def sglang_reference_hashes(token_ids: list[int], page_size: int) -> list[int]:
    """``get_hash_str`` (SHA-256 over uint32-LE pages chained on the previous hex digest) then
    ``hash_str_to_int64`` (first 16 hex chars as uint64, wrapped to int64)."""
    out = []
    prior_hex: str | None = None
    for i in range(len(token_ids) // page_size):
        page = array("I", token_ids[i * page_size : (i + 1) * page_size]).tobytes()
        h = hashlib.sha256()
        if prior_hex is not None:
            h.update(bytes.fromhex(prior_hex))
        h.update(page)
        prior_hex = h.hexdigest()
        u = int(prior_hex[:16], 16)
        out.append(u - 2**64 if u >= 2**63 else u)
    return out


def test_digest_chain_matches_sglang_reference() -> None:
    ids = list(range(1000, 1040))
    data = array("I", ids).tobytes()
    for page in (1, 4, 16):
        got = [int.from_bytes(d[:8], "big", signed=True) for d in sglang_digests(data, page)]
        assert got == sglang_reference_hashes(ids, page)


def _store(rec: KvEventRecorder, cache: PrefixCache, text: str, sid: str | None, out: int = 0) -> list[int]:
    prompt = encode_text(text)
    page = cache.page_size
    hashes = block_hashes(prompt, page)
    got = cache.try_lock(hashes, prompt.num_tokens + out, Source(prompt.data, sid))
    assert got is not None
    lease, m = got
    cache.insert(lease, hashes[m.device_blocks + m.host_blocks :])
    cache.release(lease)
    return hashes


def test_recorder_events_have_sglang_shape_and_hashes() -> None:
    rec = KvEventRecorder(page_size=4)
    cache = PrefixCache(1000, 4, listener=rec)
    assert rec.take() == [{"type": "AllBlocksCleared"}]  # the cache's creation
    text = "abcd" * 12  # 12 tokens, 3 blocks
    _store(rec, cache, text, "s1")
    _store(rec, cache, text + "efgh" * 4, "s1")  # continues: one more block below the first three
    evs = rec.take()
    assert [e["type"] for e in evs] == ["BlockStored"]  # coalesced: the second run continues the first
    ev = evs[0]
    assert list(ev) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                        "medium", "session_id"]
    ids = array("I", (text + "efgh" * 4).encode()).tolist()
    assert ev["token_ids"] == ids
    assert ev["block_hashes"] == sglang_reference_hashes(ids, 4)
    assert ev["parent_block_hash"] is None and ev["block_size"] == 4 and ev["medium"] == "GPU"
    assert ev["session_id"] == "s1" and ev["lora_id"] is None
    assert cache.flush()
    assert rec.take() == [{"type": "AllBlocksCleared"}]
    assert rec.blocks == 0 and rec.unknown_blocks == 0


def test_recorder_without_session_omits_the_field_and_tier_moves_republish() -> None:
    rec = KvEventRecorder(page_size=4)
    cache = PrefixCache(16, 4, host_capacity_tokens=64, listener=rec)  # 4 device blocks
    rec.take()
    a = _store(rec, cache, "aaaa" * 16, None)
    ev = rec.take()[0]
    assert "session_id" not in ev
    _store(rec, cache, "bbbb" * 16, None)  # evicts a to the host tier
    evs = rec.take()
    moved = [e for e in evs if e["type"] == "BlockStored" and e["medium"] == "CPU_PINNED"]
    removed = [e for e in evs if e["type"] == "BlockRemoved"]
    assert moved and moved[0]["block_hashes"] == ev["block_hashes"] and moved[0]["token_ids"] == ev["token_ids"]
    assert removed[0] == {"type": "BlockRemoved", "block_hashes": ev["block_hashes"], "medium": "GPU"}
    assert evs.index(moved[0]) < evs.index(removed[0])  # stored on the new tier first (cache Rule 6)
    assert cache.match(a).host_blocks == 4


def test_config_parses_sglang_json_and_describes_like_the_engine() -> None:
    raw = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                      "topic": "kv", "buffer_steps": 100, "hwm": 1000, "max_queue_size": 10, "format": "default",
                      "unknown_key": 1})
    cfg = KvEventsConfig.from_cli(raw)
    assert cfg.raw == raw and cfg.enabled and cfg.buffer_steps == 100
    assert cfg.describe(64) == {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
                                "topic": "kv", "block_size": 64, "dp_size": 1, "replay_endpoint_port_base": 5558}
    free = KvEventsConfig.from_cli('{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*"}')
    assert free.describe(16) is None  # no port yet
    assert free.describe(16, "tcp://127.0.0.1:40001")["endpoint_port_base"] == 40001  # type: ignore[index]
    assert KvEventsConfig.from_cli("{}").describe(16) is None  # publisher "null"
    for bad in ("[1]", "{", '{"publisher":"kafka"}', '{"buffer_steps":"x"}', '{"format":"dynamo"}',
                '{"bind":1}'):
        with pytest.raises(ValueError):
            KvEventsConfig.from_cli(bad)


def test_for_replica_shifts_both_ports() -> None:
    raw = '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'
    assert for_replica(raw, 0) == raw
    two = json.loads(for_replica(raw, 2))
    assert (two["endpoint"], two["replay_endpoint"]) == ("tcp://*:5561", "tcp://*:5562")
    free = '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*"}'
    assert json.loads(for_replica(free, 3))["endpoint"] == "tcp://127.0.0.1:*"


# ---- exactness under a random workload -----------------------------------------------------------------


class _Tee:
    def __init__(self, *ls: CacheListener) -> None:
        self.ls = ls

    def stored(self, parent: int | None, hashes: list[int], depth: int, tier: int, owner: object) -> None:
        for lst in self.ls:
            lst.stored(parent, hashes, depth, tier, owner)

    def removed(self, hashes: list[int], tier: int) -> None:
        for lst in self.ls:
            lst.removed(hashes, tier)

    def cleared(self) -> None:
        for lst in self.ls:
            lst.cleared()


class _Oracle:
    """The index's contract, computed the slow way: a session's answer is the part of the chain of
    its deepest store (one at least as deep as what is left of the previous one replaces it) that
    has stayed resident since, less its base (the blocks above the first block it ever stored: what
    it found cached); a block leaving every tier cuts the chain there. A block re-stored later by
    *another* session does not extend it again (the session's own next store does)."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.chains: dict[int, list[int]] = {}  # id(owner) -> the request's whole chain
        self.last: dict[str, list[int]] = {}  # session -> the chain of its deepest store
        self.cut: dict[str, int] = {}  # session -> blocks of it still resident
        self.base: dict[str, int] = {}  # session -> fewest blocks above any run it stored
        self.tiers: dict[int, int] = {}

    def tokens(self, sid: str) -> int:
        return max(0, self.cut[sid] - self.base[sid]) * self.page

    def stored(self, parent: int | None, hashes: list[int], depth: int, tier: int, owner: object) -> None:
        for h in hashes:
            self.tiers[h] = self.tiers.get(h, 0) | tier
        if isinstance(owner, Source) and owner.session_id is not None and depth >= 0 and hashes:
            sid = owner.session_id
            self.base[sid] = min(depth, self.base.get(sid, depth))
            chain_ = self.chains[id(owner)][: depth + len(hashes)]
            if self.cut.get(sid, 0) == 0 or len(chain_) >= self.cut[sid]:
                self.last[sid] = chain_
                self.cut[sid] = len(chain_)

    def removed(self, hashes: list[int], tier: int) -> None:
        gone = set()
        for h in hashes:
            self.tiers[h] &= ~tier
            if not self.tiers[h]:
                del self.tiers[h]
                gone.add(h)
        for sid, chain_ in self.last.items():
            for i in range(self.cut[sid]):
                if chain_[i] in gone:
                    self.cut[sid] = i
                    break

    def cleared(self) -> None:
        self.tiers.clear()
        for sid in self.cut:
            self.cut[sid] = 0


def _workload(seed: int, page: int, host: bool) -> None:
    rng = random.Random(seed)
    prof = get_profile("small-test").with_overrides(
        page_size=page, kv_capacity_tokens=3000, host_capacity_tokens=3000 if host else 0, max_running_requests=3
    )
    direct = ReplicaResidency()
    wired = ReplicaResidency()
    oracle = _Oracle(page)
    rec = KvEventRecorder(page)
    feeder = ResidencyFeeder(direct, page)
    cache = PrefixCache(prof.capacity_tokens, page, prof.host_tokens, listener=_Tee(feeder, rec, oracle))
    engine = ReplicaEngine(prof, cache)
    encode = msgspec.msgpack.Encoder().encode
    system = "system prompt shared by some sessions. " * 8
    texts = {f"s{i}": (system if i % 2 else "") + f"session {i} starts here. " for i in range(8)}
    keep: list[Source] = []
    now = 0.0
    checks = exact = 0

    def pump(t: float) -> None:
        engine.advance(t)
        evs = rec.take()
        if evs:
            feed_batch(decode_batch(encode([t, evs, 0])), wired)

    pump(0.0)
    for n in range(160):
        sid = rng.choice(sorted(texts))
        texts[sid] += "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(8, 160)))
        prompt = encode_text(texts[sid])
        hashes = block_hashes(prompt, page)
        n_out = rng.randint(1, 40)
        step = page * BYTES_PER_TOKEN
        raw = prompt.raw
        b0 = len(raw) // step
        extra: list[int] = []
        data = prompt.data
        if (len(raw) + n_out * BYTES_PER_TOKEN) // step > b0 and b0 == len(hashes):
            tail = raw[b0 * step :] + output_text(n_out, n).encode()
            extra = block_hashes(tail, page, prev_hash=hashes[b0 - 1] if b0 else None)
            data = raw[: b0 * step] + tail
        src = Source(data, sid)
        keep.append(src)
        oracle.chains[id(src)] = hashes + extra
        try:
            engine.submit(EngineRequest(f"r{n}", prompt.num_tokens, hashes, n_out, extra, src), now)
        except ValueError:
            continue  # larger than the pool
        if rng.random() < 0.1 and n:
            engine.abort(f"r{n - 1}", now)
        now += rng.uniform(0.0, 0.3)
        pump(now)
        for s, chain_ in oracle.last.items():
            want = oracle.tokens(s)
            assert direct.resident_tokens(s) == want, (n, s)
            assert wired.resident_tokens(s) == want, (n, s)
            held = cache.match(chain_).tokens
            prefix = oracle.cut[s] * page
            assert prefix <= held  # never more than the cache holds
            checks += 1
            exact += prefix == held
        if n == 100:
            now += 1e4  # everything finishes, then the cache is flushed
            pump(now)
            assert engine.idle
            assert cache.flush()
            pump(now)
            assert all(direct.resident_tokens(s) == 0 for s in oracle.last)
    pump(now + 1e6)
    assert checks > 200
    assert exact > 0.9 * checks  # the shortfall: shared blocks re-stored by others after a loss
    assert direct.removals > 20 and direct.clears == 2  # evictions happened (and the one flush)
    assert rec.unknown_blocks == 0
    assert direct.unknown_parents == 0 and wired.unknown_parents == 0
    # the mirrors hold exactly the cache's blocks (device and host)
    st = cache.stats()
    assert direct.resident_blocks == wired.resident_blocks == rec.blocks == (st.cached_tokens + st.host_used_tokens) // page


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("page", "host"), [(16, False), (16, True), (1, True)])
def test_index_matches_the_cache_exactly(seed: int, page: int, host: bool) -> None:
    _workload(seed, page, host)


def test_medium_bits_match_the_wire() -> None:
    from router.kv_wire import MEDIUM_BITS

    assert MEDIUM_BITS["GPU"] == DEVICE and MEDIUM_BITS["CPU_PINNED"] == HOST


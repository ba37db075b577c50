"""``kvroute bench kv-events``: what exact residency costs the gateway (docs/KV_EVENTS.md).

Three numbers, each printed as JSON (one object on stdout):

* **per event**: an SGLang event stream made by the emulator's cache and recorder (sessions growing
  turn by turn on a full replica, so stores and evictions both happen), encoded as the engine
  encodes it (msgpack), then decoded (``router.kv_wire``) and applied to the mirror
  (``router.residency``), as a subscriber does on the gateway's event loop. Reported per event
  and per block hash, for each page size asked for.
* **memory per resident session at 1,000 sessions per replica**: a mirror holding 1,000 sessions of
  ``--context`` tokens each, all resident (``tracemalloc``: every byte the mirror allocated),
  divided by 1,000; also per block.
* **per request**: filling a snapshot's session with ``resident_tokens`` / ``resident_on`` over
  ``--replicas`` mirrors (what every routed request pays when events are on).

Bounded: the stream is ``--turns`` requests; the run takes seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from typing import Any

import msgspec

from replica.emulator.cache import PrefixCache
from replica.emulator.kv_events import KvEventRecorder, Source
from replica.emulator.tokenizer import block_hashes, encode_text
from router.kv_wire import decode_batch, feed_batch
from router.model import SessionState
from router.residency import ReplicaResidency, ResidencyIndex, with_residency

__all__ = ["cli_main", "event_cost", "memory_per_session", "request_cost"]


def _stream(page: int, turns: int, sessions: int, capacity: int, seed: int) -> tuple[list[bytes], int, int]:
    """Encoded batches (one per request), events and block hashes in them."""
    rng = random.Random(seed)
    rec = KvEventRecorder(page)
    cache = PrefixCache(capacity, page, listener=rec)
    enc = msgspec.msgpack.Encoder().encode
    texts = {f"s{i}": f"system prompt for every session. session {i} begins. " for i in range(sessions)}
    batches = [enc([0.0, rec.take(), 0])]
    for n in range(turns):
        sid = rng.choice(sorted(texts))
        texts[sid] += "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(400, 4000)))
        prompt = encode_text(texts[sid])
        hashes = block_hashes(prompt, page)
        total = prompt.num_tokens + 16
        if total > capacity:
            texts[sid] = texts[sid][: len(texts[sid]) // 4]
            continue
        got = cache.try_lock(hashes, total, Source(prompt.data, sid))
        if got is None:
            continue
        lease, m = got
        cache.insert(lease, hashes[m.device_blocks + m.host_blocks :])
        cache.release(lease)
        evs = rec.take()
        if evs:
            batches.append(enc([float(n), evs, 0]))
    n_events = n_hashes = 0
    for b in batches:
        for ev in msgspec.msgpack.decode(b)[1]:
            n_events += 1
            n_hashes += len(ev.get("block_hashes", ()))
    return batches, n_events, n_hashes


def event_cost(page: int, turns: int = 400, sessions: int = 40, capacity: int = 60_000, seed: int = 1,
               repeat: int = 3) -> dict[str, Any]:
    batches, n_events, n_hashes = _stream(page, turns, sessions, capacity, seed)
    best = float("inf")
    sink = ReplicaResidency()
    for _ in range(repeat):
        sink = ReplicaResidency()
        gc.collect()
        t0 = time.perf_counter()
        for b in batches:
            feed_batch(decode_batch(b), sink)
        best = min(best, time.perf_counter() - t0)
    return {
        "page_size": page,
        "batches": len(batches),
        "events": n_events,
        "block_hashes": n_hashes,
        "removals": sink.removals,
        "payload_bytes": sum(len(b) for b in batches),
        "seconds": round(best, 6),
        "us_per_event": round(best / n_events * 1e6, 3),
        "us_per_block_hash": round(best / n_hashes * 1e6, 4),
        "us_per_batch": round(best / len(batches) * 1e6, 3),
    }


def memory_per_session(page: int, context: int, sessions: int = 1000, shared_prefix: int = 0) -> dict[str, Any]:
    """A mirror holding ``sessions`` sessions of ``context`` tokens (the first ``shared_prefix`` of
    them common to all), everything resident."""
    per = max(1, context // page)
    shared = shared_prefix // page
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    r = ReplicaResidency(max_blocks=10**9, max_sessions=10**6)
    r.cleared()
    next_h = 1 << 40
    root = list(range(1, shared + 1))
    if root:
        r.stored(None, root, page, len(root) * page, 1, None)
    for s in range(sessions):
        hashes = list(range(next_h, next_h + per - shared))
        next_h += per
        r.stored(root[-1] if root else None, hashes, page, len(hashes) * page, 1, f"session-{s:06d}")
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(st.size_diff for st in snap.compare_to(base, "filename"))
    assert r.resident_tokens("session-000000") == per * page
    return {
        "page_size": page,
        "sessions": sessions,
        "context_tokens": context,
        "shared_prefix_tokens": shared_prefix,
        "blocks": r.resident_blocks,
        "bytes": used,
        "bytes_per_session": round(used / sessions),
        "bytes_per_block": round(used / max(1, r.resident_blocks), 1),
    }


def request_cost(replicas: int = 8, sessions: int = 1000, n: int = 20_000) -> dict[str, Any]:
    idx = ResidencyIndex()
    for i in range(replicas):
        r = idx.replica(f"10.0.0.{i}:30000")
        r.cleared()
        for s in range(sessions):
            r.stored(None, [i << 32 | s], 64, 64, 1, f"s{s}" if s % replicas == i else None)
    states = [SessionState(session_id=f"s{s}", home=f"10.0.0.{s % replicas}:30000") for s in range(sessions)]
    gc.collect()
    t0 = time.perf_counter()
    for k in range(n):
        with_residency(states[k % sessions], idx)
    dt = time.perf_counter() - t0
    out = with_residency(states[1], idx)
    assert out.resident_tokens == 64
    return {"replicas": replicas, "sessions": sessions, "us_per_request": round(dt / n * 1e6, 3)}


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench kv-events", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", default="64,1", help="page sizes for the event stream (default 64,1)")
    p.add_argument("--turns", type=int, default=400)
    p.add_argument("--context", default="850,8192,100000",
                   help="tokens per session for the memory figure (850: 1,000 sessions fill 0.85 M)")
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    ns = p.parse_args(argv)
    try:
        pages = [int(x) for x in ns.pages.split(",") if x]
        ctxs = [int(x) for x in ns.context.split(",") if x]
    except ValueError:
        p.error("--pages and --context: comma lists of integers")
    if min(pages + ctxs, default=0) < 1 or min(ns.turns, ns.sessions, ns.replicas) < 1:
        p.error("--pages, --context, --turns, --sessions and --replicas must be >= 1")
    out: dict[str, Any] = {
        "event_cost": [event_cost(pg, ns.turns, seed=ns.seed) for pg in pages],
        # bounded: at most 2 M blocks in one mirror
        "memory": [memory_per_session(pg, c, ns.sessions) for pg in pages for c in ctxs
                   if ns.sessions * (c // pg) <= 2_000_000],
        "request_cost": request_cost(ns.replicas, ns.sessions),
    }
    print(json.dumps(out, indent=1))
    for e in out["event_cost"]:
        print(f"page {e['page_size']:>3}: {e['us_per_event']:8.2f} us/event  {e['us_per_block_hash']:.3f} us/hash"
              f"  ({e['events']} events, {e['block_hashes']} hashes, {e['removals']} removals)", file=sys.stderr)
    for m in out["memory"]:
        print(f"page {m['page_size']:>3}, {m['context_tokens']:>7} tok/session: {m['bytes_per_session']:>10} B/session"
              f"  {m['bytes_per_block']:.0f} B/block", file=sys.stderr)
    print(f"per request: {out['request_cost']['us_per_request']} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))

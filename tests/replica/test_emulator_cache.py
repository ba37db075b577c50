from __future__ import annotations

from replica.emulator.cache import PrefixCache

PAGE = 4


def chain(tag: int, n: int, base: tuple[int, ...] = ()) -> list[int]:
    """Fake chained hashes: a chain is identified by its full tuple of ids (unique per prefix)."""
    return list(base) + [hash((tag, len(base) + i)) & 0xFFFFFFFFFFFF for i in range(n)]


def run(cache: PrefixCache, hashes: list[int], total: int) -> int:
    """Admit, 'prefill', finish. Returns cached device tokens at admission."""
    got = cache.try_lock(hashes, total)
    assert got is not None
    lease, m = got
    cache.insert(lease, hashes[m.device_blocks + m.host_blocks :])
    cache.release(lease)
    return m.device_tokens


def test_cold_then_warm() -> None:
    c = PrefixCache(capacity_tokens=100, page_size=PAGE)
    h = chain(1, 5)
    assert run(c, h, 22) == 0
    assert c.used_tokens == 20 and c.evictable_tokens == 20
    assert run(c, h + chain(1, 2, tuple(h))[5:], 30) == 20
    s = c.stats()
    assert s.device_hit_tokens == 20 and s.lookup_tokens == 20 + 28
    assert 0 < s.hit_rate < 1


def test_lru_eviction_at_capacity_evicts_oldest_leaf_first() -> None:
    c = PrefixCache(capacity_tokens=40, page_size=PAGE)  # 10 blocks
    a, b = chain(1, 5), chain(2, 5)
    run(c, a, 20)
    run(c, b, 20)
    assert c.free_tokens == 0
    # touch a again: b is now least recent
    assert run(c, a, 20) == 20
    cc = chain(3, 3)
    run(c, cc, 12)  # needs 3 blocks: evicts b's 3 deepest blocks, never a's
    assert c.match(a).device_blocks == 5
    mb = c.match(b)
    assert mb.device_blocks == 2  # prefix-closed: b's first two blocks survive
    assert c.stats().device_evicted_tokens == 12


def test_touch_makes_a_path_recent_and_still_evicts_leaves_first() -> None:
    c = PrefixCache(capacity_tokens=40, page_size=PAGE)  # 10 blocks
    a, b = chain(1, 5), chain(2, 5)
    run(c, a, 20)
    run(c, b, 20)
    before = c.stats()
    m = c.touch(a + chain(1, 2, tuple(a))[5:])  # a waiting continuation of a: a is now the more recent
    assert m.device_blocks == 5 and c.stats() == before  # a stamp, no lookup counted, nothing moved
    run(c, chain(3, 3), 12)  # needs 3 blocks: they come off b's end, as a was touched after b
    assert c.match(a).device_blocks == 5 and c.match(b).device_blocks == 2
    c.touch(chain(2, 2))  # b's surviving head, touched alone: now newer than a's whole path
    run(c, chain(4, 3), 12)
    assert c.match(a).device_blocks == 2 and c.match(b).device_blocks == 2  # a's deepest blocks went


def test_pinned_blocks_not_evicted_and_admission_refused() -> None:
    c = PrefixCache(capacity_tokens=40, page_size=PAGE)
    a = chain(1, 6)
    got = c.try_lock(a, 24)
    assert got is not None
    lease, _ = got
    c.insert(lease, a)
    assert c.evictable_tokens == 0
    # a request needing 20 slots cannot fit: 24 pinned + 20 > 40
    before = c.stats()
    assert c.try_lock(chain(2, 5), 20) is None
    assert c.stats() == before  # nothing changed
    # 16 fits exactly
    got2 = c.try_lock(chain(3, 4), 16)
    assert got2 is not None
    assert c.match(a).device_blocks == 6
    c.release(lease)
    c.release(got2[0])
    assert c.evictable_tokens == 24 and c.used_tokens == 24
    assert c.flush()
    assert c.used_tokens == 0


def test_shared_prefix_pinned_by_two_requests() -> None:
    c = PrefixCache(capacity_tokens=64, page_size=PAGE)
    base = chain(9, 4)
    run(c, base, 16)
    x = c.try_lock(base + chain(1, 2, tuple(base))[4:], 24)
    y = c.try_lock(base + chain(2, 2, tuple(base))[4:], 24)
    assert x and y
    assert x[1].device_blocks == 4 and y[1].device_blocks == 4
    c.release(x[0])
    assert c.evictable_tokens == 0  # still pinned by y
    c.release(y[0])
    c.release(y[0])  # idempotent
    assert c.evictable_tokens == 16 and c.used_tokens == 16


def test_host_tier_demotes_and_promotes() -> None:
    c = PrefixCache(capacity_tokens=40, page_size=PAGE, host_capacity_tokens=80)
    a, b = chain(1, 8), chain(2, 8)
    run(c, a, 32)
    run(c, b, 32)  # evicts 6 of a's blocks to host (deepest first)
    m = c.match(a)
    assert m.device_blocks == 2 and m.host_blocks == 6
    assert c.host_used_tokens == 24
    got = c.try_lock(a, 32)
    assert got is not None
    lease, m2 = got
    assert (m2.device_tokens, m2.host_tokens) == (8, 24)
    c.release(lease)
    assert c.match(a).device_blocks == 8
    s = c.stats()
    assert s.host_hit_tokens == 24 and s.device_hit_tokens == 8
    assert c.match(b).host_blocks == 6 and c.host_used_tokens == 24  # b demoted to make room


def test_host_tier_capacity_drops_oldest() -> None:
    c = PrefixCache(capacity_tokens=16, page_size=PAGE, host_capacity_tokens=16)
    chains = [chain(i, 4) for i in range(4)]
    for h in chains:
        run(c, h, 16)
    assert c.host_used_tokens == 16
    assert c.match(chains[0]).tokens == 0  # dropped from both tiers
    assert c.match(chains[2]).host_blocks == 4
    assert c.match(chains[3]).device_blocks == 4
    assert c.stats().host_evicted_tokens == 32


def test_extra_output_blocks_cached_on_release() -> None:
    c = PrefixCache(capacity_tokens=100, page_size=PAGE)
    p = chain(5, 3)
    full = p + chain(5, 2, tuple(p))[3:]
    got = c.try_lock(p, 12 + 9)  # 3 prompt blocks + 9 output tokens
    assert got
    c.insert(got[0], p)
    c.release(got[0], extra=full[3:])
    assert c.match(full).device_blocks == 5
    assert c.used_tokens == 20


def test_too_big_never_fits() -> None:
    c = PrefixCache(capacity_tokens=16, page_size=PAGE)
    assert c.try_lock(chain(1, 5), 20) is None


def test_long_conversation_stays_a_few_nodes_and_diverging_prefixes_split() -> None:
    c = PrefixCache(capacity_tokens=1_000_000, page_size=PAGE)
    convo: list[int] = chain(1, 100)
    prev = 0
    for _ in range(50):
        assert run(c, convo, len(convo) * PAGE + 8) == prev * PAGE  # the whole previous turn hits
        prev = len(convo)
        convo = convo + chain(1, 20, tuple(convo))[len(convo):]
    assert c.stats().nodes <= 2
    # a second conversation sharing the first 30 blocks splits the node and shares them
    other = convo[:30] + chain(2, 10, tuple(convo[:30]))[30:]
    assert run(c, other, len(other) * PAGE) == 30 * PAGE
    assert c.match(convo).device_blocks == prev  # the last extension was never sent
    assert c.stats().nodes <= 4


def check_tree(c: PrefixCache) -> None:
    """White-box: the counters agree with the tree; device never hangs below host; LRUs exact."""
    dev = host = evictable = nodes = 0
    stack = [(c._root, False)]
    while stack:
        node, under_host = stack.pop()
        for child in node.children.values():
            assert child.parent is node and child.hashes and node.children[child.hashes[0]] is child
            assert not (under_host and not child.host), "device node below a host node"
            nodes += 1
            if child.host:
                host += len(child.hashes)
                assert child in c._host_lru and child.pins == 0
            else:
                dev += len(child.hashes)
                assert (child in c._lru) == (child.pins == 0)
                evictable += len(child.hashes) if child.pins == 0 else 0
            stack.append((child, child.host))
    assert (dev, host, evictable, nodes) == (c._dev_blocks, c._host_blocks, c._evictable_blocks, c._nodes)
    assert len(c._lru) + len(c._host_lru) <= nodes


def test_randomized_invariants() -> None:
    import random

    rng = random.Random(7)
    c = PrefixCache(capacity_tokens=400, page_size=PAGE, host_capacity_tokens=300)
    system = chain(99, 8)
    sessions = {s: system + chain(s, rng.randint(1, 10), tuple(system))[8:] for s in range(12)}
    running: list[tuple[object, list[int]]] = []
    for _ in range(3000):
        if rng.random() < 0.1:  # a waiting request's prefix stamped as used
            c.touch(sessions[rng.randrange(12)])
        elif running and (rng.random() < 0.5 or len(running) > 4):
            lease, h = running.pop(rng.randrange(len(running)))
            extra = chain(1000 + len(h), 2, tuple(h))[len(h):] if rng.random() < 0.5 else []
            c.release(lease, extra)  # type: ignore[arg-type]
        else:
            s = rng.randrange(12)
            h = sessions[s]
            if rng.random() < 0.3:  # the conversation grows
                h = sessions[s] = h + chain(s * 7 + len(h), rng.randint(1, 6), tuple(h))[len(h):]
            total = len(h) * PAGE + rng.randint(0, 12)
            got = c.try_lock(h[: len(h) - 1], total)
            if got is not None:
                lease, m = got
                c.insert(lease, h[m.device_blocks + m.host_blocks :])
                running.append((lease, h))
        # invariants
        st = c.stats()
        assert 0 <= st.used_tokens <= st.capacity_tokens
        assert 0 <= st.host_used_tokens <= st.host_capacity_tokens
        assert 0 <= st.evictable_tokens <= st.cached_tokens and st.reserved_tokens >= 0
        for _lease, h in running:  # a running request's blocks are all on device
            assert c.match(h).device_blocks == len(h)
        check_tree(c)
    for lease, _ in running:
        c.release(lease)  # type: ignore[arg-type]
    st = c.stats()
    assert st.reserved_tokens == 0 and st.evictable_tokens == st.cached_tokens
    assert st.device_evicted_tokens > 0 and st.host_evicted_tokens > 0 and st.host_hit_tokens > 0
    assert c.flush() and c.stats().nodes == 0


def test_whole_node_eviction_frees_whole_turns_and_keeps_older_ones() -> None:
    """Rule 6 (SGLang 0.5.23): one node per turn, never merged; eviction takes whole LRU leaves, so it
    may free more than needed, and a session whose newest turn went keeps its older turns whole."""
    c = PrefixCache(capacity_tokens=40, page_size=PAGE, evict_whole_nodes=True)  # 10 blocks
    t1 = chain(1, 3)
    t2 = chain(1, 3, tuple(t1))  # turn 2 extends turn 1 by 3 blocks
    b = chain(2, 2)
    assert run(c, t1, 12) == 0
    assert run(c, t2, 24) == 12
    assert run(c, b, 8) == 0
    assert c.stats().nodes == 3  # turn 1, turn 2's extension, b: no merging
    assert c.free_tokens == 8
    # needs 3 blocks (1 short): the LRU leaf is turn 2's 3-block extension, evicted whole
    assert run(c, chain(3, 3), 12) == 0
    assert c.match(t2).device_blocks == 3  # turn 1 survives whole
    assert c.match(b).device_blocks == 2
    assert c.stats().device_evicted_tokens == 12
    split = PrefixCache(capacity_tokens=40, page_size=PAGE)  # the finer model evicts exactly 1 block
    for h, total in ((t1, 12), (t2, 24), (b, 8), (chain(3, 3), 12)):
        run(split, h, total)
    assert split.stats().device_evicted_tokens == 4

"""The live driver's ideal hit: one infinite prefix cache, tokenized and paged as the emulator does."""

from __future__ import annotations

import pytest

from loadtests.ideal import InfiniteCache
from loadtests.textgen import Conversation
from replica.emulator.tokenizer import BYTES_PER_TOKEN, encode_text, render_chat

UNIT = 100


def _common_tokens(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // BYTES_PER_TOKEN


def _rendered(conv: Conversation) -> bytes:
    return encode_text(render_chat(conv.messages)).data


@pytest.mark.parametrize("page", [1, 4, 16])
def test_a_continuation_hits_its_previous_prompt_up_to_the_closing_marker_in_whole_pages(page: int) -> None:
    cache = InfiniteCache(page)
    conv = Conversation(key="s~0", shared_prefix_tokens=20_000, token_unit=UNIT)
    conv.add(8_000)
    first, n_first = cache.blocks(conv.messages, conv.key)
    assert cache.hit(first, n_first) == 0  # nothing inserted yet
    prev = _rendered(conv)
    cache.insert(first)
    for _ in range(3):
        conv.add(300)  # the previous reply
        conv.add(1_500)  # the next tool result
        blocks, n = cache.blocks(conv.messages, conv.key)
        cur = _rendered(conv)
        common = _common_tokens(prev, cur)
        # the previous prompt ends with <|im_end|> and the generation prompt (48 bytes), which the
        # next prompt does not repeat: that much of it can never hit
        assert common == (len(prev.rstrip(b"\0")) - 48) // BYTES_PER_TOKEN
        assert cache.hit(blocks, n) == common // page * page
        cache.insert(blocks)
        prev = cur


def test_another_session_hits_the_shared_system_prefix_only() -> None:
    cache = InfiniteCache(4)
    a = Conversation(key="a~0", shared_prefix_tokens=20_000, token_unit=UNIT)
    a.add(5_000)
    b = Conversation(key="b~0", shared_prefix_tokens=20_000, token_unit=UNIT)
    b.add(5_000)
    blocks_a, _ = cache.blocks(a.messages, a.key)
    cache.insert(blocks_a)
    blocks_b, n_b = cache.blocks(b.messages, b.key)
    hit = cache.hit(blocks_b, n_b)
    assert hit == _common_tokens(_rendered(a), _rendered(b)) // 4 * 4
    assert hit == 200  # 20k model tokens = 200 emulated: the template around them is counted within


def test_the_last_token_is_always_computed() -> None:
    cache = InfiniteCache(4)
    conv = Conversation(key="x~0", shared_prefix_tokens=0, token_unit=UNIT)
    conv.add(1_000)
    blocks, n = cache.blocks(conv.messages, conv.key)
    cache.insert(blocks)
    # the very same prompt again: an engine still computes its last token (as the emulator's
    # admission does: at most (n - 1) // page blocks match)
    assert cache.hit(blocks, n) == (n - 1) // 4 * 4 < n


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="page_size"):
        InfiniteCache(0)


def test_pooled_cache_is_one_lru_of_the_fleets_size() -> None:
    from loadtests.ideal import PooledCache

    pool = PooledCache(capacity_tokens=40, page_size=4)  # 10 blocks
    a = list(range(100, 106))  # 6 blocks
    b = list(range(200, 206))
    assert pool.hit(a, 25) == 0
    pool.insert(a)
    assert pool.hit(a, 25) == 24  # every block, capped at (25 - 1) // 4
    assert pool.hit(a, 9) == 8  # the last token is always computed
    pool.insert(b)  # 12 blocks wanted: a's tail (its least recent part) is evicted first
    assert pool.hit(b, 25) == 24
    assert pool.hit(a, 25) == 16  # a keeps a 4-block prefix: eviction never leaves a hole
    pool.insert(a)  # a is used again: now b's tail goes
    assert pool.hit(a, 25) == 24 and pool.hit(b, 25) == 16
    pool.insert(list(range(300, 330)))  # larger than the whole pool: ignored, nothing changes
    assert pool.hit(a, 25) == 24


def test_pooled_cache_holds_the_reply_pages_a_replica_keeps() -> None:
    """A replica caches prompt and reply; the reply's pages take room in the pool and never hit."""
    from loadtests.ideal import PooledCache

    a, b = list(range(100, 104)), list(range(200, 204))  # 4 blocks each
    prompts_only = PooledCache(capacity_tokens=32, page_size=4)  # 8 blocks
    prompts_only.insert(a)
    prompts_only.insert(b)
    assert prompts_only.hit(a, 17) == 16 and prompts_only.hit(b, 17) == 16
    pool = PooledCache(capacity_tokens=32, page_size=4)
    pool.insert(a, stored_tokens=16 + 9)  # + 2 pages of reply (the partial third is not stored)
    pool.insert(b, stored_tokens=16 + 8)  # 12 blocks wanted: a's reply, then a's tail, go
    assert pool.hit(a, 17) == 8 and pool.hit(b, 17) == 16
    assert pool.hit([*b, 1 << 64], 21) == 16  # a reply's page is never a prompt's
    pool.insert(a, stored_tokens=8)  # fewer tokens than the names: nothing extra
    assert pool.hit(a, 17) == 16


def test_pooled_cache_host_tier_extends_the_pool() -> None:
    from loadtests.ideal import PooledCache

    pool = PooledCache(capacity_tokens=24, page_size=4, host_capacity_tokens=24)  # 6 + 6 blocks
    a, b = list(range(100, 106)), list(range(200, 206))
    pool.insert(a)
    pool.insert(b)  # a demoted to the host tier, still a hit
    assert pool.hit(a, 25) == 24 and pool.hit(b, 25) == 24


def test_pooled_cache_follows_the_fleets_size() -> None:
    """A scale event resizes the pool: grown, it keeps what it held and takes more; shrunk, it evicts
    least recent first, as an insert would."""
    from loadtests.ideal import PooledCache

    pool = PooledCache(capacity_tokens=24, page_size=4)  # 6 blocks
    a, b = list(range(100, 106)), list(range(200, 206))
    pool.insert(a)
    pool.resize(48)  # 12 blocks: a and b both fit now
    pool.insert(b)
    assert pool.hit(a, 25) == 24 and pool.hit(b, 25) == 24
    pool.resize(32)  # 8 blocks: a (least recent) keeps its first 2
    assert pool.hit(a, 25) == 8 and pool.hit(b, 25) == 24
    pool.resize(16, host_capacity_tokens=16)  # 4 + 4 blocks: a's 2 and b's tail demoted to the host
    assert pool.hit(b, 25) == 24 and pool.hit(a, 25) == 8
    pool.resize(16, host_capacity_tokens=8)  # a host tier of 2 blocks: a's, the oldest there, go
    assert pool.hit(b, 25) == 24 and pool.hit(a, 25) == 0

"""The ideal cache hit of each request: one infinite prefix cache, tokenized as the emulator does.

The live driver's ``ideal_cached_tokens`` is what one replica with an infinite cache would have
served. It used to come from the workload's sizes (a continuation: its previous prompt), scaled
by the replica's token count. That overstates what any replica can serve: the driver sends a
session's history as ONE growing user message (``loadtests.textgen.Conversation``), so the previous
prompt's closing marker and generation prompt (``<|im_end|><|im_assistant|>assistant<|im_middle|>``,
12 emulated tokens) are not a prefix of the next one, and a cache matches whole pages only. At
``token_unit`` 100 that was ~1,400 model tokens per continuation that no router could win, 1.3-1.4 %
of CHR on the WEKA replay, counted as a routing loss of every router alike.

Rules:
  1. A prompt's blocks are the emulator's own (``replica.emulator.tokenizer``): the chat template
     rendered by ``render_chat``, 4 bytes per token, chained mmh3 hashes of full ``page_size``
     blocks. The same bytes give the same hashes the emulated replicas compute.
  2. The hit is the run of leading blocks already in the cache, capped like the emulator's engine
     at ``(prompt_tokens - 1) // page_size`` blocks (the last token is always computed).
  3. A request's blocks enter the cache when the caller says so (``insert``): the driver inserts
     a turn's prompt once its requests finished, so a request never hits its own concurrent twin
     (SGLang and the emulator do not either) and a continuation hits its previous prompt.
  4. Against a real engine the hashes are only a model of its cache (its tokenizer differs); the
     driver scales the ideal by the engine's token count, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from replica.emulator.tokenizer import ChainMemo, encode_text, render_chat

__all__ = ["InfiniteCache", "PooledCache"]


class InfiniteCache:
    """Every block ever inserted; ``hit`` = the leading blocks of a prompt found there (emulated tokens)."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._blocks: set[int] = set()
        self._memo = ChainMemo(max_entries=4096)  # a growing conversation is hashed incrementally

    def blocks(self, messages: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], int]:
        """``(block hashes, prompt tokens)`` of a chat request as the emulator tokenizes it."""
        prompt = encode_text(render_chat(messages))
        return self._memo.hashes(prompt, self.page_size, 0, key), prompt.num_tokens

    def hit(self, hashes: list[int], prompt_tokens: int) -> int:
        """Emulated tokens an infinite cache would serve for this prompt (rule 2)."""
        cap = min(len(hashes), max(prompt_tokens - 1, 0) // self.page_size)
        n = 0
        seen = self._blocks
        while n < cap and hashes[n] in seen:
            n += 1
        return n * self.page_size

    def insert(self, hashes: list[int]) -> None:
        self._blocks.update(hashes)


class PooledCache:
    """The fleet's KV as ONE shared LRU prefix cache of the same total size: ``pooled_chr``.

    What no router can beat without more memory (``pooled_chr``): every replica's HBM (and host tier)
    pooled, LRU over the requests in the order they run. It is the emulator's own ``PrefixCache``
    (radix runs, leaf-first eviction), so the same names evict the same way; a request's blocks
    enter it when the caller inserts them (``insert``, at the same moment the ideal cache gets
    them), and a hit follows the engine's rule (at most ``(prompt_tokens - 1) // page`` blocks).
    Reservations of running requests are not modelled: the pool is a bound, not an engine.
    """

    def __init__(self, capacity_tokens: int, page_size: int, host_capacity_tokens: int = 0) -> None:
        from replica.emulator.cache import PrefixCache

        self.page_size = page_size
        self._cache = PrefixCache(max(capacity_tokens, page_size), page_size, max(host_capacity_tokens, 0))
        self._fresh = 1 << 64  # names of reply pages: past every 64-bit block hash

    def resize(self, capacity_tokens: int, host_capacity_tokens: int = 0) -> None:
        """The fleet grew or shrank (scale-up, scale-down, a failure): the pool is its KV now."""
        self._cache.resize(max(capacity_tokens, self.page_size), max(host_capacity_tokens, 0))

    def hit(self, hashes: list[int], prompt_tokens: int) -> int:
        """Tokens the pooled cache holds of this prompt's prefix now (same units as the pages)."""
        cap = min(len(hashes), max(prompt_tokens - 1, 0) // self.page_size)
        m = self._cache.match(hashes[:cap] if cap < len(hashes) else hashes)
        return min(m.device_blocks + m.host_blocks, cap) * self.page_size

    def insert(self, hashes: list[int], stored_tokens: int = 0) -> None:
        """The blocks of a finished request become the most recently used (oldest evicted first).

        ``stored_tokens``: what a replica keeps of the request, prompt and reply (SGLang caches the
        reply too); the pages past ``hashes`` get names of their own, which no later prompt matches:
        a reply's pages take room and never hit (the simulator names them itself)."""
        extra = stored_tokens // self.page_size - len(hashes)
        if extra > 0:
            hashes = [*hashes, *range(self._fresh, self._fresh + extra)]
            self._fresh += extra
        if not hashes:
            return
        got = self._cache.try_lock(hashes, len(hashes) * self.page_size)
        if got is None:
            return  # larger than the whole pool: nothing of it stays
        lease, m = got
        self._cache.release(lease, hashes[m.device_blocks + m.host_blocks :])

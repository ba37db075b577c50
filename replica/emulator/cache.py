"""A pure prefix cache over chained block hashes: device (HBM) tier + optional host (HiCache) tier.

No I/O, no clock, no asyncio: the live emulator and the fleet simulator drive the same object.

Theory of operation
-------------------
A block is ``page_size`` tokens named by a chained hash (``tokenizer.block_hashes``): one hash
names the whole prefix up to and including that block, so a dict of hashes *is* the radix tree.

Rule 1 (accounting): the device pool holds ``capacity_tokens`` token slots. Used slots = cached
        blocks x ``page_size`` + slots *reserved* by running requests (their uncached prompt
        tail and their output, allocated at admission so a running request never runs out).
Rule 2 (pinning): a running request pins every device block of its prefix; pinned blocks are
        not in the LRU and can never be evicted. Pins are counted (requests share prefixes).
Rule 3 (LRU order = radix order): whenever a chain is touched its blocks are (re)appended to
        the LRU deepest-first, so a parent is always more recent than its children. The LRU
        front is therefore always a leaf, eviction is ``popitem(last=False)`` (O(1)), and the
        set of cached blocks stays prefix-closed: a chain's cached part is always a prefix.
Rule 4 (host tier): with ``host_capacity_tokens > 0`` an evicted device block is demoted to the
        host LRU (same ordering rule; its own capacity; overflow is dropped). A lookup matches
        the device prefix, then continues on the host; a host hit is promoted back to the
        device (pinned) when the request is admitted, and the time model charges a reload
        cost per host token. Tiers are exclusive: a block lives in exactly one of them.

Admission is all-or-nothing: :meth:`PrefixCache.try_lock` either pins/promotes/reserves
everything a request needs or changes nothing and returns ``None``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CacheStats", "Lease", "Match", "PrefixCache"]


@dataclass(frozen=True, slots=True)
class Match:
    """Result of a lookup: leading blocks on device, then following blocks on host."""

    device_blocks: int
    host_blocks: int
    page_size: int
    device_unpinned_blocks: int = 0  # of the device blocks, how many are currently evictable

    @property
    def device_tokens(self) -> int:
        return self.device_blocks * self.page_size

    @property
    def host_tokens(self) -> int:
        return self.host_blocks * self.page_size

    @property
    def tokens(self) -> int:
        return (self.device_blocks + self.host_blocks) * self.page_size


@dataclass(frozen=True, slots=True)
class CacheStats:
    capacity_tokens: int
    used_tokens: int  # cached blocks + reservations
    cached_tokens: int  # tokens in cached device blocks (pinned or not)
    evictable_tokens: int  # unpinned device blocks
    reserved_tokens: int
    host_capacity_tokens: int
    host_used_tokens: int
    lookup_tokens: int  # Σ matchable prompt tokens over admitted requests
    device_hit_tokens: int
    host_hit_tokens: int
    device_evicted_tokens: int  # left the device (demoted to host or dropped)
    host_evicted_tokens: int  # dropped from host
    admitted: int

    @property
    def hit_rate(self) -> float:
        hits = self.device_hit_tokens + self.host_hit_tokens
        return hits / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0


class Lease:
    """What one admitted request holds: pinned block hashes (chain order) + reserved slots."""

    __slots__ = ("pinned", "released", "reserved")

    def __init__(self, pinned: list[int], reserved: int) -> None:
        self.pinned = pinned
        self.reserved = reserved
        self.released = False


class PrefixCache:
    def __init__(self, capacity_tokens: int, page_size: int = 64, host_capacity_tokens: int = 0) -> None:
        if capacity_tokens <= 0 or page_size <= 0 or host_capacity_tokens < 0:
            raise ValueError("capacity_tokens and page_size must be > 0, host_capacity_tokens >= 0")
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self.host_capacity_tokens = host_capacity_tokens
        self._host_cap_blocks = host_capacity_tokens // page_size
        self._pins: dict[int, int] = {}  # every device block -> pin count
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned device blocks, LRU first
        self._host: OrderedDict[int, None] = OrderedDict()  # host blocks, LRU first
        self._reserved = 0
        self._lookup = 0
        self._dev_hit = 0
        self._host_hit = 0
        self._dev_evicted = 0
        self._host_evicted = 0
        self._admitted = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def used_tokens(self) -> int:
        return len(self._pins) * self.page_size + self._reserved

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def evictable_tokens(self) -> int:
        return len(self._lru) * self.page_size

    @property
    def host_used_tokens(self) -> int:
        return len(self._host) * self.page_size

    def match(self, hashes: Sequence[int]) -> Match:
        """Longest cached prefix of ``hashes``: device part, then host part. Does not touch LRU."""
        pins = self._pins
        d = 0
        unpinned = 0
        for h in hashes:
            p = pins.get(h)
            if p is None:
                break
            d += 1
            if p == 0:
                unpinned += 1
        k = 0
        if self._host:
            host = self._host
            for i in range(d, len(hashes)):
                if hashes[i] not in host:
                    break
                k += 1
        return Match(d, k, self.page_size, unpinned)

    def can_fit(self, match: Match, total_tokens: int) -> bool:
        """Whether a request occupying ``total_tokens`` slots could be admitted after ``match``."""
        need = total_tokens - match.device_tokens
        room = self.free_tokens + self.evictable_tokens - match.device_unpinned_blocks * self.page_size
        return need <= room

    def stats(self) -> CacheStats:
        return CacheStats(
            capacity_tokens=self.capacity_tokens,
            used_tokens=self.used_tokens,
            cached_tokens=len(self._pins) * self.page_size,
            evictable_tokens=self.evictable_tokens,
            reserved_tokens=self._reserved,
            host_capacity_tokens=self.host_capacity_tokens,
            host_used_tokens=self.host_used_tokens,
            lookup_tokens=self._lookup,
            device_hit_tokens=self._dev_hit,
            host_hit_tokens=self._host_hit,
            device_evicted_tokens=self._dev_evicted * self.page_size,
            host_evicted_tokens=self._host_evicted * self.page_size,
            admitted=self._admitted,
        )

    # ---- mutations -----------------------------------------------------------------------
    def try_lock(self, hashes: Sequence[int], total_tokens: int) -> tuple[Lease, Match] | None:
        """Admit a request whose prompt has (matchable) block ``hashes`` and which will occupy
        ``total_tokens`` slots in all (prompt + output). Pins the device prefix, promotes the host
        continuation, reserves the rest; or returns ``None`` and changes nothing."""
        m = self.match(hashes)
        if not self.can_fit(m, total_tokens):
            return None
        d, k = m.device_blocks, m.host_blocks
        pins, lru = self._pins, self._lru
        for h in hashes[:d]:
            p = pins[h]
            if p == 0:
                del lru[h]
            pins[h] = p + 1
        promoted = hashes[d : d + k]
        for h in promoted:
            del self._host[h]
        self._make_room(total_tokens - m.device_tokens)
        for h in promoted:
            pins[h] = 1
        self._reserved += total_tokens - m.tokens
        self._lookup += len(hashes) * self.page_size
        self._dev_hit += m.device_tokens
        self._host_hit += m.host_tokens
        self._admitted += 1
        return Lease(list(hashes[: d + k]), total_tokens - m.tokens), m

    def insert(self, lease: Lease, hashes: Sequence[int]) -> None:
        """Blocks a running request has just computed: cached and pinned, paid from its reservation."""
        pins, lru, page = self._pins, self._lru, self.page_size
        for h in hashes:
            p = pins.get(h)
            if p is None:
                if lease.reserved < page:
                    break  # cannot happen for prompt blocks; defensive
                self._host.pop(h, None)
                pins[h] = 1
                lease.reserved -= page
                self._reserved -= page
            else:
                if p == 0:
                    del lru[h]
                pins[h] = p + 1
            lease.pinned.append(h)

    def release(self, lease: Lease, extra: Sequence[int] = ()) -> None:
        """A request ended: unpin its blocks and free its reservation. ``extra`` blocks (e.g. its
        prompt+output continuation) are cached unpinned first, paid from the reservation."""
        if lease.released:
            return
        lease.released = True
        pins, lru, page = self._pins, self._lru, self.page_size
        added: list[int] = []
        for h in extra:
            if h in pins:
                continue
            if lease.reserved < page:
                break
            self._host.pop(h, None)
            pins[h] = 0
            lease.reserved -= page
            self._reserved -= page
            added.append(h)
        for h in reversed(added):  # deepest first: parents end up more recent (Rule 3)
            lru[h] = None
        for h in reversed(lease.pinned):
            p = pins[h] - 1
            pins[h] = p
            if p == 0:
                lru[h] = None
        self._reserved -= lease.reserved
        lease.reserved = 0

    def flush(self) -> bool:
        """Drop every unpinned block on both tiers. Refused (False) while anything is running."""
        if self._reserved or len(self._lru) != len(self._pins):
            return False
        self._pins.clear()
        self._lru.clear()
        self._host.clear()
        return True

    def _make_room(self, need: int) -> None:
        lru, pins, host = self._lru, self._pins, self._host
        while self.free_tokens < need and lru:
            h, _ = lru.popitem(last=False)
            del pins[h]
            self._dev_evicted += 1
            if self._host_cap_blocks:
                host[h] = None
                if len(host) > self._host_cap_blocks:
                    host.popitem(last=False)
                    self._host_evicted += 1

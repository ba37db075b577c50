"""A pure prefix cache over chained block hashes: device (HBM) tier + optional host (HiCache) tier.

No I/O, no clock, no asyncio: the live emulator and the fleet simulator drive the same object.

Theory of operation
-------------------
A block is ``page_size`` tokens named by a chained hash (``tokenizer.block_hashes``). Blocks live
in a radix tree whose nodes hold *runs* of blocks (as SGLang's radix cache holds runs of tokens),
so the work per request is O(nodes on its path), not O(blocks): a 100k-token conversation is one
or two nodes, compared with C-speed list slices.

Rule 1 (accounting): the device pool holds ``capacity_tokens`` token slots. Used slots = cached
        device blocks x ``page_size`` + slots *reserved* by running requests (their uncached
        prompt tail and their output, allocated at admission so a running request never runs out).
Rule 2 (pinning): a running request pins every node on its path (root to its deepest node);
        pinned nodes are not in the LRU and can never be evicted. Pins are counted.
Rule 3 (LRU order = radix order): when a path is released its nodes are appended to the LRU
        deepest-first, so a parent is always more recent than its children. The LRU front is
        therefore always a leaf; eviction takes blocks from the *tail* of the front node (splitting
        it if only part is needed), so the cached part of any chain stays a prefix. :meth:`touch`
        (a waiting request's prefix stamped as used) moves a matched path to the end the same way.
Rule 4 (host tier): with ``host_capacity_tokens > 0`` evicted device blocks are demoted to the host
        tier (same ordering rule, own capacity; overflow is dropped, again tail first). A lookup
        matches device nodes, then continues on host nodes; host hits are promoted back to the
        device (pinned) on admission, and the time model charges a reload cost per host token.
        Tiers are exclusive: a block lives in exactly one of them; a device node never hangs below
        a host node.
Rule 5 (compression): on release a node with a single child of the same state is merged with it,
        so a long conversation does not grow a node per turn.
Rule 6 (SGLang's granularity, ``evict_whole_nodes``, the emulator's default): SGLang 0.5.23's radix
        cache never merges nodes (a conversation is a chain of one node per turn) and evicts whole
        leaf nodes, LRU first, until enough is free, so it frees more than it needs: a session whose
        newest turn was evicted keeps its older turns whole. With it, Rule 5 is off and eviction does
        not split the front node. Checked against a real server by
        ``tests/real_sglang/test_emulator_fidelity.py`` (per-request cached tokens agree exactly).

Admission is all-or-nothing: :meth:`PrefixCache.try_lock` either pins/promotes/reserves
everything a request needs or changes nothing and returns ``None``.

Rule 7 (listener): an optional :class:`CacheListener` hears every change of what is cached, as
        SGLang's radix cache reports it in KV events: runs of blocks stored (with the block they
        hang below, their position in the chain, the tier and the ``owner`` the request was admitted
        with), removed from a tier, and the whole cache cleared. A tier move is a store on the new
        tier followed by a removal from the old one, so a block is never absent in between.
        ``replica/emulator/kv_events.py`` turns these into SGLang's event stream; the simulator can
        feed ``router.residency`` with them directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DEVICE", "HOST", "CacheListener", "CacheStats", "Lease", "Match", "PrefixCache"]

# tiers, as bits (the same values as SGLang's GPU / CPU_PINNED in router.kv_wire.MEDIUM_BITS)
DEVICE = 1
HOST = 2


class CacheListener(Protocol):
    """Hears what the cache stores and drops (Rule 6). Calls happen inside cache operations: they
    must not call back into the cache, nor keep the ``hashes`` lists (the cache may extend them)."""

    def stored(self, parent: int | None, hashes: list[int], depth: int, tier: int, owner: object) -> None:
        """``hashes`` (a chain) now live on ``tier`` below block ``parent`` (``None``: the root).
        ``depth``: blocks before the first one in the chain (-1 on a tier move, where ``owner`` is
        ``None``); ``owner``: what the storing request was admitted with."""
        ...

    def removed(self, hashes: list[int], tier: int) -> None: ...

    def cleared(self) -> None: ...


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
    nodes: int  # radix-tree nodes (device + host)

    @property
    def hit_rate(self) -> float:
        hits = self.device_hit_tokens + self.host_hit_tokens
        return hits / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0


class _Node:
    __slots__ = ("children", "hashes", "host", "parent", "pins")

    def __init__(self, hashes: list[int], parent: _Node | None, host: bool = False) -> None:
        self.hashes = hashes
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.pins = 0
        self.host = host


class Lease:
    """What one admitted request holds: the deepest node of its pinned path + reserved slots."""

    __slots__ = ("blocks", "node", "owner", "released", "reserved")

    def __init__(self, node: _Node, blocks: int, reserved: int, owner: object = None) -> None:
        self.node = node
        self.blocks = blocks  # blocks on the pinned path
        self.reserved = reserved
        self.released = False
        self.owner = owner  # passed to the listener with what this request stores (Rule 7)


def _common(run: list[int], hashes: list[int], i: int) -> int:
    """Length of the common prefix of ``run`` and ``hashes[i:]`` (C-speed slice compares)."""
    hi = min(len(run), len(hashes) - i)
    if hashes[i : i + hi] == run[:hi]:
        return hi
    lo = 0  # run[:lo] matches, run[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hashes[i : i + mid] == run[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    def __init__(
        self,
        capacity_tokens: int,
        page_size: int = 64,
        host_capacity_tokens: int = 0,
        *,
        evict_whole_nodes: bool = False,
        listener: CacheListener | None = None,
    ) -> None:
        if capacity_tokens <= 0 or page_size <= 0 or host_capacity_tokens < 0:
            raise ValueError("capacity_tokens and page_size must be > 0, host_capacity_tokens >= 0")
        self.evict_whole_nodes = evict_whole_nodes  # Rule 6
        self.listener = listener  # Rule 7
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self.host_capacity_tokens = host_capacity_tokens
        self._host_cap_blocks = host_capacity_tokens // page_size
        self._root = _Node([], None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # unpinned device nodes, LRU first
        self._host_lru: OrderedDict[_Node, None] = OrderedDict()  # host nodes, LRU first
        self._dev_blocks = 0
        self._evictable_blocks = 0
        self._host_blocks = 0
        self._nodes = 0
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
        return self._dev_blocks * self.page_size + self._reserved

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def evictable_tokens(self) -> int:
        return self._evictable_blocks * self.page_size

    @property
    def host_used_tokens(self) -> int:
        return self._host_blocks * self.page_size

    def _walk(self, hashes: list[int]) -> list[tuple[_Node, int]]:
        """(node, matched blocks in it) from the root; only the last may be partial."""
        path: list[tuple[_Node, int]] = []
        node = self._root
        i, n = 0, len(hashes)
        while i < n:
            child = node.children.get(hashes[i])
            if child is None:
                break
            run = child.hashes
            k = len(run)
            if i + k > n or (k > 1 and hashes[i : i + k] != run):
                k = _common(run, hashes, i)
                path.append((child, k))
                break
            path.append((child, k))
            i += k
            node = child
        return path

    def _count(self, path: list[tuple[_Node, int]]) -> Match:
        d = h = unpinned = 0
        for node, k in path:
            if node.host:
                h += k
            else:
                d += k
                if node.pins == 0:
                    unpinned += k
        return Match(d, h, self.page_size, unpinned)

    def match(self, hashes: Sequence[int]) -> Match:
        """Longest cached prefix of ``hashes``: device part, then host part. Changes nothing."""
        return self._count(self._walk(hashes if isinstance(hashes, list) else list(hashes)))

    def touch(self, hashes: Sequence[int]) -> Match:
        """``match``, and the matched path becomes the most recently used (SGLang's radix
        ``match_prefix`` and ``touch_prefix`` stamp every node they walk): deepest first, so each
        node stays older than its parent and leaves still go first."""
        path = self._walk(hashes if isinstance(hashes, list) else list(hashes))
        for node, _ in reversed(path):
            lru = self._host_lru if node.host else self._lru
            if node in lru:  # pinned device nodes are in no LRU
                lru.move_to_end(node)
        return self._count(path)

    def can_fit(self, match: Match, total_tokens: int) -> bool:
        """Whether a request occupying ``total_tokens`` slots could be admitted after ``match``."""
        need = total_tokens - match.device_tokens
        room = self.free_tokens + self.evictable_tokens - match.device_unpinned_blocks * self.page_size
        return need <= room

    def stats(self) -> CacheStats:
        return CacheStats(
            capacity_tokens=self.capacity_tokens,
            used_tokens=self.used_tokens,
            cached_tokens=self._dev_blocks * self.page_size,
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
            nodes=self._nodes,
        )

    # ---- mutations -----------------------------------------------------------------------
    def try_lock(
        self, hashes: Sequence[int], total_tokens: int, owner: object = None
    ) -> tuple[Lease, Match] | None:
        """Admit a request whose prompt has (matchable) block ``hashes`` and which will occupy
        ``total_tokens`` slots in all (prompt + output). Pins the device prefix, promotes the host
        continuation, reserves the rest; or returns ``None`` and changes nothing. ``owner`` goes to
        the listener with every block this request stores."""
        hl = hashes if isinstance(hashes, list) else list(hashes)
        path = self._walk(hl)
        m = self._count(path)
        if not self.can_fit(m, total_tokens):
            return None
        if path and path[-1][1] < len(path[-1][0].hashes):
            node, k = path[-1]
            path[-1] = (self._split(node, k), k)
        promoted: list[_Node] = []
        for node, _ in path:
            if node.host:
                self._host_lru.pop(node, None)  # a fresh split head is in no LRU
                self._host_blocks -= len(node.hashes)
                promoted.append(node)
            else:
                self._pin(node)
        self._make_room(total_tokens - m.device_tokens)
        for node in promoted:
            node.host = False
            node.pins = 1
            self._dev_blocks += len(node.hashes)
            if self.listener is not None:
                self._moved(node, HOST, DEVICE)
        reserve = total_tokens - m.tokens
        self._reserved += reserve
        self._lookup += len(hl) * self.page_size
        self._dev_hit += m.device_tokens
        self._host_hit += m.host_tokens
        self._admitted += 1
        deepest = path[-1][0] if path else self._root
        return Lease(deepest, m.device_blocks + m.host_blocks, reserve, owner), m

    def insert(self, lease: Lease, hashes: Sequence[int]) -> None:
        """Blocks a running request has just computed (following its pinned path): cached and
        pinned, paid from its reservation."""
        hl = hashes if isinstance(hashes, list) else list(hashes)
        node, i, page = lease.node, 0, self.page_size
        while i < len(hl):
            child = node.children.get(hl[i])
            if child is None:
                break
            k = _common(child.hashes, hl, i)
            if k < len(child.hashes):
                child = self._split(child, k)
            if child.host:  # a concurrent twin was computed and demoted meanwhile: reload it
                if lease.reserved < k * page:
                    break
                self._host_lru.pop(child, None)
                self._host_blocks -= k
                child.host = False
                child.pins = 1
                self._dev_blocks += k
                lease.reserved -= k * page
                self._reserved -= k * page
                if self.listener is not None:
                    self._moved(child, HOST, DEVICE)
            else:
                self._pin(child)
            node = child
            i += k
            lease.blocks += k
        rest = min(len(hl) - i, lease.reserved // page)
        if rest > 0:
            new = _Node(hl[i : i + rest], node)
            new.pins = 1
            node.children[new.hashes[0]] = new
            self._nodes += 1
            self._dev_blocks += rest
            lease.reserved -= rest * page
            self._reserved -= rest * page
            if self.listener is not None:
                self.listener.stored(self._parent_hash(new), new.hashes, lease.blocks, DEVICE, lease.owner)
            lease.blocks += rest
            node = new
        lease.node = node

    def release(self, lease: Lease, extra: Sequence[int] = ()) -> None:
        """A request ended: unpin its path and free its reservation. ``extra`` blocks (e.g. its
        prompt+output continuation) are first cached unpinned below it, paid from the reservation."""
        if lease.released:
            return
        lease.released = True
        page = self.page_size
        node = lease.node
        if extra and node.children.get(extra[0]) is None:
            n = min(len(extra), lease.reserved // page)
            if n > 0:
                new = _Node(list(extra[:n]), node)
                node.children[new.hashes[0]] = new
                self._nodes += 1
                self._dev_blocks += n
                lease.reserved -= n * page
                self._reserved -= n * page
                if self.listener is not None:
                    self.listener.stored(self._parent_hash(new), new.hashes, lease.blocks, DEVICE, lease.owner)
                self._lru_add(new)  # older than its parent, which is appended below (Rule 3)
        while node is not self._root:
            assert node.parent is not None
            node.pins -= 1
            if node.pins == 0:
                self._lru_add(node)
            node = node.parent
        self._reserved -= lease.reserved
        lease.reserved = 0
        if not self.evict_whole_nodes:
            self._compress(lease.node)

    def resize(self, capacity_tokens: int, host_capacity_tokens: int | None = None) -> None:
        """New capacities (a pool whose fleet grew or shrank); what no longer fits is evicted LRU
        first, as by an insert. Pinned blocks stay until released."""
        if capacity_tokens <= 0 or (host_capacity_tokens is not None and host_capacity_tokens < 0):
            raise ValueError("capacity_tokens must be > 0, host_capacity_tokens >= 0")
        self.capacity_tokens = capacity_tokens
        if host_capacity_tokens is not None:
            self.host_capacity_tokens = host_capacity_tokens
            self._host_cap_blocks = host_capacity_tokens // self.page_size
        self._make_room(0)
        self._trim_host()

    def flush(self) -> bool:
        """Drop every unpinned block on both tiers. Refused (False) while anything is running."""
        if self._reserved or self._evictable_blocks != self._dev_blocks:
            return False
        self._root = _Node([], None)
        self._lru.clear()
        self._host_lru.clear()
        self._dev_blocks = self._evictable_blocks = self._host_blocks = self._nodes = 0
        if self.listener is not None:
            self.listener.cleared()
        return True

    # ---- internals -----------------------------------------------------------------------
    def _parent_hash(self, node: _Node) -> int | None:
        p = node.parent
        return None if p is None or p is self._root else p.hashes[-1]

    def _moved(self, node: _Node, old: int, new: int) -> None:
        assert self.listener is not None
        self.listener.stored(self._parent_hash(node), node.hashes, -1, new, None)
        self.listener.removed(node.hashes, old)

    def _lru_add(self, node: _Node) -> None:
        self._lru[node] = None
        self._evictable_blocks += len(node.hashes)

    def _pin(self, node: _Node) -> None:
        if node.pins == 0 and node in self._lru:  # (a fresh split head is in no LRU)
            del self._lru[node]
            self._evictable_blocks -= len(node.hashes)
        node.pins += 1

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` blocks; returns the new head (``node`` keeps the
        tail, so references to ``node`` still name the deeper part). The head is in no LRU."""
        assert node.parent is not None and 0 < k < len(node.hashes)
        head = _Node(node.hashes[:k], node.parent, node.host)
        head.pins = node.pins
        node.parent.children[head.hashes[0]] = head
        node.hashes = node.hashes[k:]
        node.parent = head
        head.children[node.hashes[0]] = node
        self._nodes += 1
        if not node.host and node.pins == 0 and node in self._lru:
            self._evictable_blocks -= k
        return head

    def _make_room(self, need: int) -> None:
        lru, page = self._lru, self.page_size
        while self.free_tokens < need and lru:
            node = next(iter(lru))
            want = -((self.free_tokens - need) // page)  # ceil((need - free) / page)
            if len(node.hashes) > want and not self.evict_whole_nodes:
                head = self._split(node, len(node.hashes) - want)
                self._lru_add(head)
                lru.move_to_end(head, last=False)  # as old as the node it came from
            del lru[node]
            n = len(node.hashes)
            self._evictable_blocks -= n
            self._dev_blocks -= n
            self._dev_evicted += n
            if self._host_cap_blocks:
                node.host = True
                self._host_lru[node] = None
                self._host_blocks += n
                if self.listener is not None:
                    self._moved(node, DEVICE, HOST)
                self._trim_host()
            else:
                if self.listener is not None:
                    self.listener.removed(node.hashes, DEVICE)
                self._detach(node)

    def _trim_host(self) -> None:
        hl = self._host_lru
        while self._host_blocks > self._host_cap_blocks and hl:
            node = next(iter(hl))
            excess = self._host_blocks - self._host_cap_blocks
            if len(node.hashes) > excess:
                head = self._split(node, len(node.hashes) - excess)
                hl[head] = None
                hl.move_to_end(head, last=False)
            del hl[node]
            self._host_blocks -= len(node.hashes)
            self._host_evicted += len(node.hashes)
            if self.listener is not None:
                self.listener.removed(node.hashes, HOST)
            self._detach(node)

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children, "only leaves leave the tree"
        del parent.children[node.hashes[0]]
        node.parent = None
        self._nodes -= 1

    def _compress(self, node: _Node) -> None:
        """Merge unpinned single-child device chains on ``node``'s path (Rule 5)."""
        while node is not self._root:
            parent = node.parent
            assert parent is not None
            if node.pins == 0 and not node.host and len(node.children) == 1:
                (child,) = node.children.values()
                if child.pins == 0 and not child.host:
                    del self._lru[child]
                    node.hashes.extend(child.hashes)  # in place: a growing conversation costs its new blocks only
                    node.children = child.children
                    for gc in node.children.values():
                        gc.parent = node
                    self._nodes -= 1
                    continue  # the merged node may merge again
            node = parent
